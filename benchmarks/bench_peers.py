"""longstride's context-parallel attention against its peers, on this CPU machine (issue 34).

Peers (installed by the optional extra only: `pip install -e ".[peers]"`; a missing one is a "-" row, not a
failure): axolotl-ringmaster's zig-zag ring, torch's own context parallel (Flex path), DeepSpeed's Ulysses
(DistributedAttention). The implementations and the measuring tools are in benchmarks/peer_impls.py.

Attention: N=2 gloo ranks of 1 thread, fp32, the same seeded q, k, v, dout for every implementation,
SmolLM2-135M's heads (9:3 x 64) and a GQA 8:2 x 128 shape, 8K / 16K / 32K tokens, two masks: plain causal,
and packed real documents (one sequence of the stdlib corpus through data/packing.py, as bench_ring). Per
implementation and case:
  time     forward + backward, slowest rank, median of `--reps` (5) after one checked call; the
           implementations alternate within each repetition (forward order, then reversed), since this
           shared machine's speed drifts over minutes
  peak     the largest rank's resident-memory high-water mark over the timed call minus its resident
           memory before it (glibc's mmap threshold fixed at 64 KiB so freed tensors leave at once, as in
           bench_cp_memory): inputs excluded, the output and gradients included
  sent     bytes a rank hands to the collectives in one forward + backward: counted by wrapping
           torch.distributed's collectives, or computed from the algorithm where the implementation calls
           torch's functional collectives (torch CP), labelled
  error    max |got - fp64 reference| over out, dq, dk, dv, relative to the reference's max |value|; the
           reference is one process in fp64 (peer_impls.reference), and a row must be within `--tol`
           before its time counts
A case an implementation cannot run is "-" with the reason. Each finished (implementation, case) is one
JSON under benchmarks/results/bench_peers/, skipped when present (--force redoes it); every run assembles
whatever pieces exist into benchmarks/results/bench_peers.json and prints the tables (--report: only that).

    pip install -e ".[peers]"
    python -m benchmarks.bench_peers [--lengths 8192 16384 32768] [--shapes smollm2 gqa8] [--masks causal docs]
                                     [--impls ...] [--reps 5] [--force] [--report]
    python -m benchmarks.bench_peers --model    # part 2: SmolLM2-135M's shape, benchmarks/peer_model.py
"""
from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.common import RESULTS, proc_status_bytes, write_results
from benchmarks.peer_impls import (IMPLS, SHAPES, ByteCounter, build, computed_bytes, local_index, make_inputs,
                                   reference)
from longstride.recipes.run.tracking import reset_peak_rss

PIECES = os.path.join(RESULTS, "bench_peers")
CACHE = os.path.join(".cache", "bench_peers")
PEERS = ("ringmaster_zigzag", "torch_cp_flex", "deepspeed_ulysses")
OURS = ("longstride_ring", "longstride_ulysses", "longstride_upipe")


def case_name(shape: str, length: int, mask: str, n: int) -> str:
    return f"{shape}-{length // 1024}k-{mask}-n{n}"


def piece_path(impl: str, case: str) -> str:
    return os.path.join(PIECES, f"{impl}-{case}.json")


def versions() -> dict:
    out = {"torch": torch.__version__}
    for dist_name in ("transformers", "deepspeed", "axolotl-ringmaster"):
        try:
            out[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            out[dist_name] = None
    try:
        out["longstride_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                  text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        out["longstride_commit"] = None
    return out


def write_piece(impl: str, case: str, row: dict) -> None:
    os.makedirs(PIECES, exist_ok=True)
    with open(piece_path(impl, case), "w") as f:
        json.dump({"impl": impl, "case": case, "date": time.strftime("%Y-%m-%d %H:%M"), "versions": versions(), **row},
                  f, indent=1)


# ---------------------------------------------------------------------------------------------- inputs

def doc_ids(length: int) -> torch.Tensor:
    """(L,) document ids of one best-fit packed sequence of the stdlib corpus (cached)."""
    path = os.path.join(CACHE, f"docs-{length}.pt")
    if not os.path.exists(path):
        from benchmarks.bench_ring import packed_doc_ids

        os.makedirs(CACHE, exist_ok=True)
        torch.save(packed_doc_ids(length, 1)[0][0], path)
    return torch.load(path)


def reference_path(shape: str, length: int, mask: str) -> str:
    """fp64 out, dq, dk, dv of the whole sequence, computed once per (shape, length, mask) and cached."""
    path = os.path.join(CACHE, f"ref-{shape}-{length}-{mask}.pt")
    if not os.path.exists(path):
        os.makedirs(CACHE, exist_ok=True)
        s = SHAPES[shape]
        t0 = time.perf_counter()
        q, k, v, dout = make_inputs(s, length)
        ref = reference(q, k, v, dout, doc_ids(length) if mask == "docs" else None, s.head_dim ** -0.5)
        torch.save(ref, path)
        print(f"  fp64 reference {shape} {length} {mask}: {time.perf_counter() - t0:.0f} s", flush=True)
    return path


# ---------------------------------------------------------------------------------------------- one case, N ranks

def _call(fn, leaves, dout, counter=None):
    """One forward + backward on fresh leaves: (wall s, peak bytes over the call, out, grads)."""
    import torch.distributed as dist

    q, k, v = (x.detach().requires_grad_() for x in leaves)
    dist.barrier()
    gc.collect()
    base = proc_status_bytes("VmRSS")
    reset_peak_rss()
    t0 = time.perf_counter()
    with counter.counting() if counter is not None else _nothing():
        out = fn(q, k, v)
        out.backward(dout)
    wall = time.perf_counter() - t0
    peak = proc_status_bytes("VmHWM") - base
    return wall, peak, out.detach(), [x.grad for x in (q, k, v)]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _slowest(x: float, op="max") -> float:
    import torch.distributed as dist

    t = torch.tensor(float(x), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.item()


def _case_worker(rank, n, shape_name, length, mask, impls, reps, ref_path, doc, progress, results):
    shape = SHAPES[shape_name]
    scale = shape.head_dim ** -0.5
    full = make_inputs(shape, length)
    ref = torch.load(ref_path)
    state, rows = {}, {}
    for name in impls:  # build and check each, one at a time (a crash names its implementation)
        if rank == 0:
            with open(progress, "w") as f:
                f.write(name)
        idx = local_index(IMPLS[name].layout, length, n, rank)
        leaves = [x[:, idx].contiguous() for x in full[:3]]
        dout = full[3][:, idx].contiguous()
        fn = build(name, shape, length, n, rank, doc, scale)
        counter = ByteCounter()
        wall, peak, out, grads = _call(fn, leaves, dout, counter)
        errs = {}
        for key, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), ref):
            local = want[:, idx]
            errs[key] = (_slowest((got.double() - local).abs().max().item()), want.abs().max().item())
        sent = _slowest(counter.bytes)  # the most a rank sent
        state[name] = (fn, leaves, dout)
        rows[name] = {"error": {k: e / m for k, (e, m) in errs.items()}, "max_error": max(e / m for e, m in errs.values()),
                      "sent_bytes": sent if IMPLS[name].bytes_how == "counted" else computed_bytes(name, shape, length, n),
                      "sent_how": IMPLS[name].bytes_how, "check_s": _slowest(wall), "check_peak": _slowest(peak),
                      "times": [], "peaks": []}
        del out, grads
    for rep in range(reps):
        for name in (impls if rep % 2 == 0 else impls[::-1]):
            wall, peak, out, grads = _call(*state[name])
            del out, grads
            rows[name]["times"].append(_slowest(wall))
            rows[name]["peaks"].append(_slowest(peak))
    if rank == 0:
        torch.save(rows, results)


def run_case(shape: str, length: int, mask: str, n: int, impls: list, reps: int, tol: float) -> None:
    from longstride.parallel.spawn import run_gloo

    case = case_name(shape, length, mask, n)
    doc = doc_ids(length) if mask == "docs" else None
    ref = reference_path(shape, length, mask)
    pending = list(impls)
    while pending:
        with tempfile.TemporaryDirectory() as d:
            progress, results = os.path.join(d, "progress"), os.path.join(d, "rows.pt")
            t0 = time.perf_counter()
            try:
                run_gloo(_case_worker, n, shape, length, mask, pending, reps, ref, doc, progress, results)
            except Exception as e:  # a process died: the implementation it was checking gets the reason
                bad = open(progress).read() if os.path.exists(progress) else pending[0]
                write_piece(bad, case, {"reason": f"failed: {type(e).__name__}: {str(e).splitlines()[-1][:300]}"})
                print(f"  {bad} failed on {case}: {e}", flush=True)
                pending.remove(bad)
                continue
            rows = torch.load(results)
        for name, r in rows.items():
            ok = r["max_error"] <= tol
            write_piece(name, case, {
                "time_s": statistics.median(r["times"]) if ok else None, "times_s": r["times"],
                "peak_bytes": max(r["peaks"]), "sent_bytes": r["sent_bytes"], "sent_how": r["sent_how"],
                "max_error": r["max_error"], "error": r["error"], "check_passed": ok, "tol": tol,
                "check_s": r["check_s"], "reps": reps, "n": n,
                **({} if ok else {"reason": f"error {r['max_error']:.2g} over the tolerance {tol:g}"})})
        print(f"  {case}: {', '.join(pending)} in {time.perf_counter() - t0:.0f} s", flush=True)
        pending = []


# ---------------------------------------------------------------------------------------------- the table

def load_pieces() -> dict:
    out = {}
    if os.path.isdir(PIECES):
        for f in sorted(os.listdir(PIECES)):
            if f.endswith(".json") and not f.startswith("model-"):
                with open(os.path.join(PIECES, f)) as fh:
                    p = json.load(fh)
                out[p["case"], p["impl"]] = p
    return out


def load_model_pieces() -> list[dict]:
    out = []
    if os.path.isdir(PIECES):
        for f in sorted(os.listdir(PIECES)):
            if f.startswith("model-") and f.endswith(".json"):
                with open(os.path.join(PIECES, f)) as fh:
                    out.append(json.load(fh))
    return out


def model_markdown(rows: list[dict]) -> str:
    if not rows:
        return ""
    lengths = sorted({int(k) for r in rows for k in r.get("peak_bytes", {})})
    head = ["row", "ranks", "step s"] + [f"peak GiB at {L}" for L in lengths] + \
        ["KiB / token (fit)", "longest context in 8 GiB per rank (extrapolated estimate)", "first-step loss"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        if r.get("reason"):
            lines.append(f"| {r['row']} | {r['ranks']} | - " + "| " * (len(head) - 3) + "|")
            continue
        peaks = [f"{r['peak_bytes'][str(L)] / 2**30:.2f}" if str(L) in r["peak_bytes"] else "" for L in lengths]
        lines.append(f"| {r['row']} | {r['ranks']} | {r['step_s']:.1f} (L={r['step_length']}) | " + " | ".join(peaks)
                     + f" | {r.get('kib_per_token', float('nan')):.0f} | {r.get('max_len_estimate', float('nan')):,.0f} | "
                     + f"{r.get('loss', {}).get(str(r['step_length']), float('nan')):.6f} |")
    reasons = [f"- {r['row']} (n={r['ranks']}): {r['reason']}" for r in rows if r.get("reason")]
    return "\n".join(lines + ([""] + reasons if reasons else []))


def _cell(p: dict | None, key: str, fmt) -> str:
    if p is None:
        return ""
    if p.get(key) is None:
        return "-"
    return fmt(p[key])


def _best(pieces: dict, case: str, names, key: str):
    vals = [(pieces[case, n][key], n) for n in names if (case, n) in pieces and pieces[case, n].get(key) is not None]
    return min(vals) if vals else None


def table_rows(pieces: dict) -> list[dict]:
    cases = sorted({c for c, _ in pieces}, key=lambda c: (c.split("-")[0], int(c.split("-")[1][:-1]), c))
    rows = []
    for case in cases:
        row = {"case": case}
        for key, unit in (("time_s", "s"), ("peak_bytes", "GiB")):
            ours, peer = _best(pieces, case, OURS, key), _best(pieces, case, PEERS, key)
            # ratio < 1: longstride's best is faster / smaller than the best peer of the row
            row[f"{key}_ratio"] = ours[0] / peer[0] if ours and peer else None
            row[f"{key}_best_ours"] = ours[1] if ours else None
            row[f"{key}_best_peer"] = peer[1] if peer else None
        rows.append(row)
    return rows


def markdown(pieces: dict) -> str:
    impls = [i for i in IMPLS if any(k[1] == i for k in pieces)]
    rows = table_rows(pieces)
    lines = []
    for key, title, fmt in (("time_s", "forward + backward, s (median)", lambda v: f"{v:.2f}"),
                            ("peak_bytes", "peak memory per rank, GiB", lambda v: f"{v / 2**30:.2f}"),
                            ("sent_bytes", "sent per rank, MiB", lambda v: f"{v / 2**20:.0f}"),
                            ("max_error", "max error / max |ref| (fp64)", lambda v: f"{v:.1e}")):
        ratio = key in ("time_s", "peak_bytes")
        lines.append(f"| {title} | " + " | ".join(impls) + (" | longstride / best peer |" if ratio else " |"))
        lines.append("|---" * (len(impls) + 1 + ratio) + "|")
        for r in rows:
            cells = []
            for i in impls:
                p = pieces.get((r["case"], i))
                c = _cell(p, key, fmt)
                if key == "sent_bytes" and p is not None and p.get("sent_how") == "computed" and c != "-":
                    c += " (computed)"
                cells.append(c)
            if ratio:
                v = r[f"{key}_ratio"]
                cells.append("" if v is None else f"**{v:.2f}** ({r[f'{key}_best_ours'].split('_')[1]} / "
                                                  f"{r[f'{key}_best_peer'].split('_')[0]})")
            lines.append(f"| {r['case']} | " + " | ".join(cells) + " |")
        lines.append("")
    reasons = sorted({(i, p["reason"]) for (c, i), p in pieces.items() if p.get("reason")})
    if reasons:
        lines.append("Reasons for \"-\":")
        for i, reason in reasons:
            cases = [c for (c, j), p in pieces.items() if j == i and p.get("reason") == reason]
            lines.append(f"- {i} ({', '.join(sorted(cases))}): {reason}")
    return "\n".join(lines)


def measured_with(pieces: list[dict]) -> list[dict]:
    """The distinct package versions the pieces were measured with (each piece records its own: a report alone
    runs where the peers may not be installed)."""
    seen = []
    for p in pieces:
        v = p.get("versions", "not recorded")
        if v not in seen:
            seen.append(v)
    return seen


def report() -> None:
    pieces = load_pieces()
    rows = [dict(p) for p in pieces.values()]
    model = load_model_pieces()
    path = write_results("bench_peers", rows, {"versions": measured_with(rows + model), "ratios": table_rows(pieces),
                                               "model": model})
    print(markdown(pieces))
    print(model_markdown(model))
    print("results:", path)


def main() -> None:
    global PIECES
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--masks", nargs="+", choices=["causal", "docs"], default=["causal", "docs"])
    ap.add_argument("--impls", nargs="+", choices=list(IMPLS), default=list(IMPLS))
    ap.add_argument("--n", type=int, default=2, help="gloo ranks")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tol", type=float, default=1e-4, help="max error / max |reference| for a time to count")
    ap.add_argument("--force", action="store_true", help="redo pieces that exist")
    ap.add_argument("--report", action="store_true", help="only assemble the pieces and print the tables")
    ap.add_argument("--pieces", default=PIECES, help="where the per-case JSON pieces go")
    ap.add_argument("--model", action="store_true", help="part 2: the SmolLM2-135M-shaped model (peer_model.py)")
    args, _ = ap.parse_known_args()
    PIECES = args.pieces
    # in the rank processes spawned below: freed tensors go back to the OS at once (peak RSS follows live
    # tensors), DeepSpeed picks its CPU accelerator
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(2)  # the fp64 reference, in this process while no rank runs
    if args.model:  # its own flags (peer_model.main), read from the command line as given
        from benchmarks import peer_model

        peer_model.main([a for a in sys.argv[1:] if a != "--model"])
        return
    if not args.report:
        for length in args.lengths:  # every shape at a length before the next length: short cases land first
            for shape in args.shapes:
                for mask in args.masks:
                    case = case_name(shape, length, mask, args.n)
                    todo = []
                    for name in args.impls:
                        if os.path.exists(piece_path(name, case)) and not args.force:
                            continue
                        reason = IMPLS[name].reason(SHAPES[shape], length, mask, args.n)
                        if reason:
                            write_piece(name, case, {"reason": reason})
                        else:
                            todo.append(name)
                    if todo:
                        print(f"{case}: {todo}", flush=True)
                        run_case(shape, length, mask, args.n, todo, args.reps, args.tol)
    report()


if __name__ == "__main__":
    main()
