"""The order the suite's tests are handed to pytest-xdist's workers: longest first on every worker.

`--dist worksteal` splits the collection by count, worker i taking the next len(pending) // (workers left) tests,
runs each worker's share in order and lets an idle worker steal the back half of the longest queue. Collected in
file order, the two device-window smokes (3 and 2 minutes) landed at the end of a share and ran while the other
worker had nothing left. Here every share starts with its longest tests (their measured seconds in
tests/durations.json), the shares' seconds balanced, so that the end of the run is short tests that stealing evens
out. Tests that share a module- or class-scoped fixture stay together and in file order (pytest sets such a fixture
up again each time its module is re-entered). An unmeasured test counts as 1 second. Refresh the figures with

    python -m pytest -q -n 2 --dist worksteal --junitxml=/tmp/junit.xml && python -m tests.schedule /tmp/junit.xml
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

DURATIONS = Path(__file__).with_name("durations.json")
UNMEASURED_S = 1.0


def _unit_key(item) -> str:
    """Items with the same key run back to back: their module's id where they use a module- or class-scoped
    fixture, else their own id."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    if any(d and d[-1].scope in ("module", "class", "package") for d in defs):
        return item.nodeid.split("::")[0]
    return item.nodeid


def order(items: list, workers: int, seconds: dict[str, float]) -> list:
    """`items` reordered into `workers` consecutive shares of worksteal's sizes, each longest first."""
    units: dict[str, list] = {}
    for item in items:
        units.setdefault(_unit_key(item), []).append(item)
    cost = {k: sum(seconds.get(i.nodeid, UNMEASURED_S) for i in group) for k, group in units.items()}
    room, left = [], len(items)
    for w in range(workers):  # worksteal's first split: len(pending) // (workers left) each, in turn
        room.append(left // (workers - w))
        left -= room[-1]
    shares: list[list] = [[] for _ in range(workers)]
    total = [0.0] * workers
    for key in sorted(units, key=lambda k: -cost[k]):  # stable: equal costs keep file order
        n = len(units[key])
        fits = [w for w in range(workers) if room[w] >= n] or [max(range(workers), key=room.__getitem__)]
        w = min(fits, key=lambda w: total[w])
        shares[w].extend(units[key])
        room[w] -= n
        total[w] += cost[key]
    return [item for share in shares for item in share]


def reorder(items: list, workers: int) -> None:
    """In place, where there is more than one worker and a durations file."""
    if workers > 1 and DURATIONS.is_file():
        items[:] = order(items, workers, json.loads(DURATIONS.read_text())["seconds"])


def main(junit: str) -> None:
    """tests/durations.json from a run's --junitxml: each test's seconds (setup, call and teardown)."""
    import xml.etree.ElementTree as ET

    seconds = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        module, _, cls = path.partition("/Test")
        nodeid = f"{module}.py::" + (f"Test{cls}::" if cls else "") + case.get("name")
        seconds[nodeid] = round(float(case.get("time", 0)), 2)
    DURATIONS.write_text(json.dumps({"how": "python -m tests.schedule JUNIT_XML (see tests/schedule.py)",
                                     "seconds": dict(sorted(seconds.items()))}, indent=0) + "\n")
    print(f"wrote {DURATIONS}: {len(seconds)} tests, {sum(seconds.values()):.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
