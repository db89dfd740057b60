"""Re-splitting streamed data positions when a stage resumes on another number of data-parallel ranks.

A streamed source's rows (past its held-out ones) come in one order in each epoch, the same for every layout (a walked
source's files in data/sources.walked_order, others as datasets orders them for the epoch), and data-parallel rank r
of W reads the rows at positions r, r + W, r + 2W, ... of it. Each rank's
checkpoint counts the rows it read in the epoch, so the rows every rank of the old layout read are known, and a
resume on W' ranks shares out the rest of the epoch: the unread rows below the furthest one read (`gaps`) and every
row from there (`tail`), new rank r' taking positions r', r' + W', ... of that list (a `split`: plain data, stored in
the stream's state until the source's next epoch, which every layout reads from its start again). No row of the
epoch is read twice and none is left out; the documents an old rank had drawn but not yet trained on (its packer's
open and ready sequences) go to new rank (old rank mod W'); the old ranks' token counts are shared evenly by the new
ranks' mixers, so the mixture's shares hold. Where the old ranks were in different epochs of a source, the new ranks
continue the furthest one and the lagging ranks' rest of the earlier epoch is left out (named in the log).

Not re-split (refused, naming the source): a source whose ranks read whole shards (a `disk` or `files` source with
nothing held out whose shard count divides by the ranks) and checkpoints written before the row counts were kept.
Costs: each new process reads every old data-parallel rank's state (their packers' pending tokens too), and a source
read through a split with nothing held out reads its epoch from the start up to its rows (datasets may reorder its
shards by the epoch, so no row can be skipped unread; a `hub` source streams that part again).
"""
from __future__ import annotations

from collections import Counter


def _row(split: dict, p: int) -> int:
    """The row at position `p` of `split`'s list: its gaps, then every row from its tail."""
    gaps = split["gaps"]
    return gaps[p] if p < len(gaps) else split["tail"] + p - len(gaps)


def split_rows(split: dict, count: int) -> list[int]:
    """The positions among `count` rows (a walked source's files) that `split` gives its rank."""
    order = [g for g in split["gaps"] if g < count] + list(range(split["tail"], count))
    return order[split["way"]::split["ways"]]


def first_row(split: dict) -> int:
    """The first row `split` gives its rank (the rows before it can be skipped unread)."""
    return _row(split, split["way"])


def keeps(split: dict, offset: int = 0):
    """A datasets filter (row, index) -> bool: whether the row at `index` + `offset` of the stream is this rank's
    (`offset`: the rows skipped before the filter)."""
    gaps, tail, way, ways = {g: p for p, g in enumerate(split["gaps"])}, split["tail"], split["way"], split["ways"]

    def mine(_row, index: int) -> bool:
        g = index + offset
        p = gaps.get(g, len(gaps) + g - tail if g >= tail else None)
        return p is not None and p % ways == way
    return mine


def _rest(split: dict, read: list[int]) -> tuple[list[int], int]:
    """(gaps, tail) of what no rank has read, given how many positions each way of `split` read."""
    ways, gaps = split["ways"], split["gaps"]
    end = max((w + (k - 1) * ways + 1 for w, k in enumerate(read) if k), default=0)  # past the furthest read
    # way w read positions w, w + ways, ... up to its count; the unread ones below `end` (a few per way)
    unread = sorted(p for w in range(ways) for p in range(w + read[w] * ways, end, ways))
    return [_row(split, p) for p in unread] + list(gaps[end:]), split["tail"] + max(0, end - len(gaps))


def splittable(states: list[dict]) -> set:
    """The sources of `states` (every data-parallel rank's loader state) that resplit can share out."""
    streams = [s["dataset_state"] for s in states]
    return {n for n in streams[0]["counters"]["epoch"] if all(
        s["counters"].get("epoch_rows", {}).get(n) is not None and s.get("by_rows", {}).get(n) for s in streams)}


def resplit(states: list[dict], way: int, ways: int, names: dict, sources=None) -> tuple[dict, list[str]]:
    """(the stream loader state of data-parallel rank `way` of `ways`, notes for the log) from `states`, the loader
    states of every data-parallel rank of the layout that wrote them (in rank order); `sources`: only those (default:
    all of the states'). `names`: each source's config field, for errors. Raises ValueError naming the source when
    the states cannot be re-split."""
    streams = [s["dataset_state"] for s in states]
    old, notes = len(streams), []
    sources = list(streams[0]["counters"]["epoch"]) if sources is None else list(sources)
    names = {n: names.get(n, f"data.sources.{n}") for n in sources}  # a source since removed from the config too
    for n in sources:
        # None: a rank resumed from such a checkpoint and has not started an epoch of the source since
        if any(s["counters"].get("epoch_rows", {}).get(n) is None or s.get("by_rows", {}).get(n) is None
               for s in streams):
            raise ValueError(f"{names[n]}: the checkpoint was written by a longstride that kept no per-epoch row "
                             "counts, so what each rank read cannot be re-split")
        if not all(s["by_rows"][n] for s in streams):
            raise ValueError(f"{names[n]}: its {old} data-parallel ranks read whole shards of it (its shard count "
                             f"divides by {old} and none of its rows is held out), not every {old}-th row, so what "
                             "they read cannot be re-split")
    mine = [s for i, s in enumerate(streams) if i % ways == way]
    counters = {"epoch": {}, "epoch_rows": {}, "epoch_docs": {}, "tokens": {}, "rows": {}, "skipped": {}}
    splits = {}
    for n in sources:
        epochs = [s["counters"]["epoch"][n] for s in streams]
        epoch = max(epochs)
        at = [i for i, e in enumerate(epochs) if e == epoch]
        if len(at) < old:
            behind = {i: e for i, e in enumerate(epochs) if e < epoch}
            notes.append(f"{names[n]}: data-parallel ranks of {old} in an earlier epoch than {epoch} ({behind}, rank: "
                         f"epoch); the rest of their share of those epochs is left out and epoch {epoch} goes on")
        recorded = streams[at[0]]["splits"].get(n)
        split = recorded or {"gaps": [], "tail": 0, "ways": old}
        read = [0] * split["ways"]
        for i in at:
            s = streams[i]
            read[(s["splits"].get(n) or {"way": i})["way"]] = s["counters"]["epoch_rows"][n]
        gaps, tail = _rest(split, read)
        splits[n] = {"gaps": gaps, "tail": tail, "ways": ways, "way": way}
        counters["epoch"][n], counters["epoch_rows"][n] = epoch, 0
        # a part of an epoch: its "no usable document in a whole pass" check waits for the next whole one
        counters["epoch_docs"][n] = max(1, sum(streams[i]["counters"]["epoch_docs"][n] for i in at))
        counters["tokens"][n] = round(sum(s["counters"]["tokens"][n] for s in streams) / ways)
        counters["rows"][n] = sum(s["counters"]["rows"][n] for s in mine)
        counters["skipped"][n] = dict(sum((Counter(s["counters"]["skipped"][n]) for s in mine), Counter()))
    stream = {"sources": {n: None for n in splits}, "counters": counters, "splits": splits,
              "by_rows": dict(streams[0]["by_rows"]), "packer": [s["packer"] for s in mine]}
    return {**states[way % old], "dataset_state": stream}, notes
