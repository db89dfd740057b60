"""The document-masked attention kernel at real lengths: its errors against an fp32 reference beside torch's own
bf16 SDPA error on the same inputs, and its speed.

    python -m benchmarks.gpu_kernel_figures --out DIR            # on a GPU: 4K, 16K, 32K; heads 32:8 and 9:3, dim 64
    python -m benchmarks.gpu_kernel_figures --smoke --out DIR    # tiny, on any device: checks the script

Inputs: one packed row of documents with length-1 documents among them. The reference is fp32 attention per
document (fp32 inputs upcast from the same bf16 values, K/V expanded to the query heads); "sdpa_bf16" is torch's
SDPA per document in bf16 (flash on CUDA), what a user of plain transformers gets with a document mask. Errors are
relative norms ||x - ref|| / ||ref|| for out, dQ, dK, dV, and the largest absolute LSE error. TFLOP/s counts the
matmul work the document mask allows: 4 * D * H * pairs forward, 2.5x that backward (pairs = sum d (d + 1) / 2).
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from benchmarks.gpu_bench import time_steps


def doc_lengths(length: int, seed: int) -> list[int]:
    """Document lengths summing to `length`: mostly log-uniform from 1 to length / 2, every fifth one of length 1."""
    g = torch.Generator().manual_seed(seed)
    out, left = [], length
    while left:
        if len(out) % 5 == 4:
            n = 1
        else:
            n = int(torch.exp(torch.rand(1, generator=g) * torch.log(torch.tensor(length / 2.0))).item()) + 1
        out.append(min(n, left))
        left -= out[-1]
    return out


def reference(q, k, v, dout, lens, scale):
    """fp32 per-document causal attention: (out, lse, dq, dk, dv) with q/k/v (1, H, L, D) fp32."""
    rep = q.shape[1] // k.shape[1]
    x = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    outs, lses, s = [], [], 0
    for n in lens:
        qs, ks, vs = x[0][:, :, s:s + n], x[1][:, :, s:s + n], x[2][:, :, s:s + n]
        ks, vs = (t.repeat_interleave(rep, dim=1) for t in (ks, vs))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale))
        with torch.no_grad():  # the LSE in query blocks: a block's scores at most 1024 x n per head
            parts = []
            for a in range(0, n, 1024):
                sc = (qs[:, :, a:a + 1024] @ ks.transpose(-1, -2)) * scale
                rows = torch.arange(a, min(a + 1024, n), device=q.device)[:, None]
                sc = sc.masked_fill(torch.arange(n, device=q.device)[None, :] > rows, float("-inf"))
                parts.append(torch.logsumexp(sc, dim=-1))
            lses.append(torch.cat(parts, dim=-1))
        s += n
    out = torch.cat(outs, dim=2)
    out.backward(dout)
    return [out.detach(), torch.cat(lses, dim=-1), *(t.grad for t in x)]


def run_kernel(kernel, q, k, v, dout, doc, scale=None):
    """(out, lse, dq, dk, dv) of the single-device attention (tests/gpu checks the kernels with it too); q/k/v
    (B, H, L, D) laid out in memory as transformers does, (B, L, H, D); doc: (B, L) document ids or None. lse is
    None for per-document SDPA on CUDA, which keeps none."""
    from longstride.parallel.kernels import doc_attention, doc_attention_forward, doc_bounds

    scale = scale if scale is not None else q.shape[-1] ** -0.5
    x = [t.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True) for t in (q, k, v)]
    out = doc_attention(*x, doc, scale, kernel)
    out.backward(dout)
    lse = None
    if not (kernel == "sdpa" and q.is_cuda):
        bounds = doc_bounds(doc) if doc is not None else [[(0, q.shape[2])]] * q.shape[0]
        with torch.no_grad():
            _, lse = doc_attention_forward(*(t.detach() for t in x), bounds, kernel, scale)
    return [out.detach(), lse, *(t.grad for t in x)]


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def figures(length: int, heads: tuple[int, int], device: torch.device, kernel: str, reps: int, seed: int = 0) -> dict:
    from longstride.parallel.kernels import doc_attention

    h, hkv = heads
    D, dtype, scale = 64, torch.bfloat16, 64 ** -0.5
    lens = doc_lengths(length, seed)
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[None].to(device)
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(1, length, n, D, generator=g).to(device, dtype).transpose(1, 2)
                     for n in (h, hkv, hkv, h))
    ref = reference(*(t.float() for t in (q, k, v, dout)), lens, scale)
    mine = run_kernel(kernel, q, k, v, dout, doc, scale)
    # torch's own bf16 SDPA per document (K/V expanded): the error a plain-transformers user gets
    sdpa = run_kernel("sdpa", q, k, v, dout, doc, scale) if device.type == "cuda" else None
    row = {"seq_len": length, "heads": f"{h}:{hkv}", "head_dim": D, "docs": len(lens),
           "length1_docs": sum(n == 1 for n in lens), "kernel": kernel, "dtype": "bfloat16",
           "nan": any(bool(t.isnan().any()) for t in mine if t is not None)}
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        if name == "lse":
            row["lse_max_abs_err"] = (mine[1].float() - ref[1].view_as(mine[1])).abs().max().item()
            continue
        row[f"{name}_rel_err"] = rel(mine[i], ref[i])
        if sdpa is not None:
            row[f"{name}_rel_err_sdpa_bf16"] = rel(sdpa[i], ref[i])
            row[f"{name}_vs_sdpa"] = row[f"{name}_rel_err"] / max(row[f"{name}_rel_err_sdpa_bf16"], 1e-30)
    del ref, mine, sdpa
    pairs = sum(n * (n + 1) // 2 for n in lens)
    causal_pairs = length * (length + 1) // 2
    x = [t.detach().requires_grad_(True) for t in (q, k, v)]

    def fwd(ids):
        with torch.no_grad():
            doc_attention(*x, ids, scale, kernel)

    def fwd_bwd(ids):
        doc_attention(*x, ids, scale, kernel).backward(dout)

    flops = 4 * D * h
    for name, ids, p in (("masked", doc, pairs), ("causal", None, causal_pairs)):
        tf = time_steps(lambda: fwd(ids), device, 2, reps)
        tfb = time_steps(lambda: fwd_bwd(ids), device, 2, reps)
        row[f"{name}_fwd_ms"], row[f"{name}_fwd_bwd_ms"] = tf * 1e3, tfb * 1e3
        row[f"{name}_fwd_tflops"] = flops * p / tf / 1e12
        row[f"{name}_fwd_bwd_tflops"] = 3.5 * flops * p / tfb / 1e12
    row["time_ratio_fwd_bwd"] = row["masked_fwd_bwd_ms"] / row["causal_fwd_bwd_ms"]
    row["ideal_ratio"] = pairs / causal_pairs  # sum d(d+1)/2 over L(L+1)/2: the work the mask leaves
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny lengths and heads, any device")
    p.add_argument("--out", required=True, help="folder for kernel_figures.json")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    from benchmarks.common import machine

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("no CUDA device: use --smoke on CPU")
        return 2
    kernel = "torch_flash" if device.type == "cuda" else "sdpa"
    lengths = [256, 512] if args.smoke else [4096, 16384, 32768]
    heads = [(4, 2), (3, 1)] if args.smoke else [(32, 8), (9, 3)]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "kernel_figures.json")
    rows, failed = [], []
    for length in lengths:
        for hh in heads:
            try:
                rows.append(figures(length, hh, device, kernel, 2 if args.smoke else args.reps))
                print(json.dumps(rows[-1]), flush=True)
            except Exception as e:  # keep the other shapes' figures
                failed.append({"seq_len": length, "heads": f"{hh[0]}:{hh[1]}", "error": repr(e)[:2000]})
                print("FAILED", failed[-1], flush=True)
            with open(path, "w") as f:  # after every shape, so a window cut short keeps what it measured
                json.dump({"machine": machine(), "cuda": torch.version.cuda, "what": __doc__, "rows": rows,
                           "failed": failed}, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
