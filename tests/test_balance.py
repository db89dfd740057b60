"""Document-aware load balancing (parallel/balance.py): the work model equals the ring plan's own pair
count, the balancer evens out real-looking packed layouts, and ring attention gives the one-process results under
any chunk assignment (gloo, N = 2..4, odd N included). The tiny model under the balancer's assignment, with ring
(N = 2) and Ulysses x ring (N = 4), is in tests/test_cp_model.py (`..._balance_docs` cases)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from longstride.parallel.balance import balanced_assignment, imbalance, rank_work, token_work
from longstride.parallel.blocks import ring_plan
from longstride.parallel.ring import RingComm, ring_attention
from longstride.parallel.zigzag import Assignment, shard, unshard, zigzag
from longstride.parallel.spawn import gather_cat, run_gloo
from tests.test_ring import B, D, HEADS, L, inputs, layouts, reference


def random_assignment(n: int, k: int, seed: int) -> Assignment:
    perm = np.random.default_rng(seed).permutation(n * k)
    return Assignment(tuple(tuple(sorted(perm[r * k:(r + 1) * k].tolist())) for r in range(n)))


def packed_rows(length: int, rows: int, seed: int, longest: int) -> np.ndarray:
    """Document ids of rows packed from documents of 1..longest tokens (heavy-tailed lengths)."""
    rng, out = np.random.default_rng(seed), []
    for _ in range(rows):
        lens, left = [], length
        while left:
            lens.append(int(min(left, max(1, rng.pareto(1.2) * longest / 8), longest)))
            left -= lens[-1]
        out.append(np.repeat(np.arange(len(lens)), lens))
    return np.stack(out)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_work_model_equals_the_ring_plans_pair_count(n):
    docs = layouts()["docs_random"]
    odd_k = {2: 3, 3: 5, 4: 3}[n]  # L = 120 divides into n x k chunks
    for a in (zigzag(n), random_assignment(n, odd_k, seed=n), balanced_assignment(docs.numpy(), n)):
        a.validate()
        pairs = [ring_plan(docs, B, L, n, r, a).pairs() for r in range(n)]
        assert pairs == rank_work(token_work(docs.numpy()), a).tolist(), a


def test_balancer_evens_out_packed_layouts_and_keeps_zigzag_where_it_is_exact():
    for length, longest in ((4608, 4608), (18432, 18432), (18432, 2048)):  # divisible by 2 x 8 x N for N = 3
        for seed in range(4):
            docs = packed_rows(length, 1, seed, longest)
            for n in (2, 3, 4, 8, 16):
                a = balanced_assignment(docs, n)
                a.validate()
                assert a == balanced_assignment(docs, n), "deterministic: every rank computes the same"
                work = token_work(docs)
                got, zz = imbalance(rank_work(work, a)), imbalance(rank_work(work, zigzag(n)))
                assert got <= min(1.05, zz), f"L={length} seed {seed} N={n}: {got:.3f} (zig-zag {zz:.3f})"
    one = np.zeros((1, 4096), dtype=np.int64)
    assert balanced_assignment(one, 4) == zigzag(4), "one document: zig-zag is exact and kept"
    assert balanced_assignment(None, 4) == zigzag(4)
    with pytest.raises(ValueError, match="not a chunk assignment"):
        Assignment(((0, 1), (1, 2))).validate()
    with pytest.raises(ValueError, match=r"not divisible by 3 x cp = 6"):
        shard(torch.zeros(1, 100), 2, 0, assignment=random_assignment(2, 3, 0))


def _ring_worker(rank: int, n: int, path: str) -> None:
    import torch.distributed as dist

    comm = RingComm(dist.group.WORLD)
    h, hkv = HEADS["gqa4"]
    results = {}
    for lname, doc in layouts().items():
        for rname, rows in (("both_rows", slice(0, 2)), ("row1", slice(1, 2))):
            d = None if doc is None else doc[rows]
            for aname, a in (("random", random_assignment(n, 5 if n == 4 else 4, seed=n)),
                             ("balanced", balanced_assignment(None if d is None else d.numpy(), n))):
                for kernel in ("sdpa", "math"):
                    q, k, v, dout = (x[rows] for x in inputs(h, hkv, torch.float32))
                    plan = ring_plan(d, q.shape[0], L, n, rank, a)
                    ql, kl, vl = (shard(x, n, rank, dim=2, assignment=a).requires_grad_(True) for x in (q, k, v))
                    out = ring_attention(ql, kl, vl, plan, kernel, D ** -0.5, comm)
                    out.backward(shard(dout, n, rank, dim=2, assignment=a))
                    got = [out.detach(), ql.grad, kl.grad, vl.grad]
                    results[lname, rname, aname, kernel] = [unshard(gather_cat(x), dim=2, assignment=a) for x in got]
    if rank == 0:
        torch.save(results, path)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_under_any_assignment_matches_the_reference(n, tmp_path):
    path = str(tmp_path / "balance.pt")
    run_gloo(_ring_worker, n, path)
    results = torch.load(path)
    h, hkv = HEADS["gqa4"]
    for (lname, rname, aname, kernel), got in results.items():
        rows = slice(0, 2) if rname == "both_rows" else slice(1, 2)
        doc = layouts()[lname]
        ref = reference(*(x[rows] for x in inputs(h, hkv, torch.float64)), None if doc is None else doc[rows])
        for name, g, want in zip(("out", "dq", "dk", "dv"), got, [ref[0], *ref[2:]]):
            err = (g.double() - want).abs().max().item()
            assert err <= 1e-5, f"N={n} {lname} {rname} {aname} {kernel} {name}: max |ring - fp64 ref| = {err:.2e}"
