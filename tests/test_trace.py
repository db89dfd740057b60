"""The GPU program checked without a GPU (recipes/memory/trace.py, parallel/flash_contract.py).

Every CP method's training step (the real transformers model, longstride's patches, the chunked loss, AdamW)
is traced for one rank of N under a fake process group, with torch's CUDA flash ops (`torch_flash`) on the
meta device standing for the GPU: each aten call is parsed against its schema by torch's dispatcher, each flash
call checked as the CUDA kernel checks its inputs, and a host tensor meeting a GPU one fails. The mutation
tests put one mistake at a time into that path and assert that the trace stops on it.
"""
from __future__ import annotations

import pytest
import torch
from transformers import SmolLM3Config

from longstride.parallel import heads, ulysses, varlen
from longstride.parallel.config import CPDegrees, ParallelConfig
from longstride.parallel.cp import cp_degrees
from longstride.parallel.flash_contract import ContractError
from longstride.recipes.memory.trace import StepProgram, trace_step
from longstride.recipes.run.step import StepSpec


def _config(hidden, inter, layers, heads_, kv, head_dim, vocab, nope_every=0):
    return SmolLM3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads_, num_key_value_heads=kv, head_dim=head_dim,
                         no_rope_layers=[int(nope_every == 0 or (i + 1) % nope_every) for i in range(layers)],
                         use_cache=False, pad_token_id=0, bos_token_id=0, eos_token_id=0)


# the tiny model (4 layers, NoPE on the 4th, GQA 4:2) and SmolLM2-135M's widths (9:3 heads x 64, hidden 576,
# 49K vocabulary) with 2 of its 30 layers: every layer runs the same program
SHAPES = {"tiny": (_config(128, 384, 4, 4, 2, 32, 512, nope_every=4), 480),
          "smollm2": (_config(576, 1536, 2, 9, 3, 64, 49152), 576)}
CASES = [("tiny", "none", 1), ("tiny", "ring", 2), ("tiny", "ring", 3), ("tiny", "ulysses", 2), ("tiny", "upipe", 2),
         ("tiny", "hybrid", 4), ("smollm2", "none", 1), ("smollm2", "ring", 2), ("smollm2", "ring", 3),
         ("smollm2", "ulysses", 3), ("smollm2", "upipe", 3), ("smollm2", "hybrid", 6)]


def program(shape: str, method: str, cp: int, **step) -> StepProgram:
    config, length = SHAPES[shape]
    heads_ = config.num_attention_heads
    par = ParallelConfig(cp_impl="ring" if method == "none" else method,
                         ulysses=cp // 2 if method == "hybrid" else 0,
                         upipe_heads=heads_ // 2 if method == "upipe" and heads_ % 2 == 0 else 0)
    degrees = cp_degrees(par, cp, heads_) if cp > 1 else CPDegrees()
    spec = StepSpec(**{"checkpointing": "full", "mlp_tile": 128, "loss_tile": 256, **step})
    return StepProgram(config, seq_len=length, world=cp, cp=cp, cp_impl=par.cp_impl, degrees=degrees, step=spec,
                       docs=3)


def gpu_trace(prog: StepProgram, rank: int = 0) -> dict:
    return trace_step(prog, rank=rank, device="meta")


@pytest.mark.parametrize("shape,method,cp", CASES, ids=[f"{s}-{m}-{n}" for s, m, n in CASES])
def test_gpu_step_traces_for_every_method(shape, method, cp):
    prog = program(shape, method, cp)
    if method == "upipe":
        assert prog.degrees.stage_heads, "the UPipe case must run several head stages"
    for rank in sorted({0, cp - 1}):
        r = gpu_trace(prog, rank)
        assert r["flash_calls"] > 0, "the GPU kernel path was not taken"
        assert r["gradients"] == r["parameters"], "every parameter gets a gradient"
        assert r["optimizer"] == 2 * r["parameters"], "AdamW keeps two moments shaped like the parameters"
        assert r["peak"] >= r["parameters"] + r["gradients"] + r["optimizer"]


def test_gpu_step_traces_with_offload_and_selective_checkpointing():
    r = gpu_trace(program("smollm2", "none", 1, offload=True).at(1024))  # layer inputs of 1 MiB and more move
    assert r["host"] > 0, "the checkpointed layer inputs were offloaded"
    assert gpu_trace(program("tiny", "ring", 2, checkpointing="selective"))["flash_calls"] > 0


def test_selective_checkpointing_keeps_plain_ulysses_exchange_as_the_estimate_counts():
    """Under selective checkpointing plain Ulysses' op keeps the head-layout q and K/V (its recompute exchanges
    nothing): the traced GPU step keeps ulysses_keeps more per layer and local token than the ring's, which the
    estimate adds; UPipe keeps what the ring keeps."""
    from longstride.model.memory import ulysses_keeps

    kept = {m: gpu_trace(program("tiny", m, 2, checkpointing="selective", mlp_tile=0)) for m in ("ring", "ulysses",
                                                                                              "upipe")}
    assert all(r["flash_calls"] > 0 for r in kept.values())
    config, length = SHAPES["tiny"]
    more = config.num_hidden_layers * length // 2 * ulysses_keeps(config, 2, 2)
    assert more > 0 and program("tiny", "ulysses", 2).degrees.plain_ulysses(config.num_attention_heads) == 2
    assert kept["ulysses"]["activations"] - kept["ring"]["activations"] == pytest.approx(more, rel=0.01)
    assert kept["upipe"]["activations"] == pytest.approx(kept["ring"]["activations"], rel=0.001)


def test_plain_ulysses_keeps_the_ring_s_layer_set_plus_its_replicated_k_v():
    """Without checkpointing plain Ulysses' saved head-layout q and K/V replace the local q, k, v byte for byte, and
    its output is token-major as the ring's (the caller's transpose a view, not a second copy): the traced step keeps
    the ring's activations at cp 2 (4:2 heads), and at cp 4 the 2 K/V heads' replicas more (ulysses_replicas)."""
    from longstride.model.memory import ulysses_replicas

    config, length = SHAPES["tiny"]
    for cp in (2, 4):
        acts = {m: gpu_trace(program("tiny", m, cp, checkpointing="none", mlp_tile=0))["activations"]
                for m in ("ring", "ulysses")}
        more = config.num_hidden_layers * length // cp * ulysses_replicas(config, 2, cp)
        assert (more > 0) == (cp == 4)
        assert acts["ulysses"] - acts["ring"] == pytest.approx(more, abs=4096), (cp, acts, more)


def test_memory_trace_is_linear_in_length_with_flash_attention():
    """Full checkpointing, tiles and a flash kernel keep no L x L term: the activations of 2L are twice L's."""
    config, _ = SHAPES["tiny"]
    base = StepProgram(config, seq_len=1024, step=StepSpec("full", mlp_tile=256, loss_tile=256), docs=1)
    a1, a2 = (trace_step(base.at(L))["activations"] for L in (1024, 2048))
    assert a2 == pytest.approx(2 * a1, rel=0.02)


# ---- each mistake stops the trace ----

def _mutated_forward(mistake: str):
    orig = varlen.VARLEN["torch_flash"]

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window=None, softcap=None):
        if mistake == "scale positional":  # lands in return_debug_mask; the kernel would use the default scale
            out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal,
                                                                    scale)
            return out, lse
        if mistake == "tensor for max_q":
            return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, cu_q, max_k, 0.0, causal, False,
                                                           scale=scale)[:2]
        if mistake == "int64 lengths":
            return orig.forward(q, k, v, cu_q.long(), cu_k.long(), max_q, max_k, scale, causal)
        raise AssertionError(mistake)

    return varlen.Varlen(forward, orig.backward)


@pytest.mark.parametrize("mistake,error,match", [("scale positional", ContractError, "scale=None"),
                                                 ("tensor for max_q", RuntimeError, "argument 'max_q'"),
                                                 ("int64 lengths", ContractError, "int32")])
def test_a_wrong_aten_argument_fails(monkeypatch, mistake, error, match):
    """Caught by torch's schema (a tensor for an int) or by the kernel's own checks (flash_contract)."""
    monkeypatch.setitem(varlen.VARLEN, "torch_flash", _mutated_forward(mistake))
    with pytest.raises(error, match=match):
        gpu_trace(program("tiny", "ring", 2))


def test_a_wrong_lse_layout_fails(monkeypatch):
    """The merged log-sum-exp handed to the backward as (tokens, heads) instead of (heads, tokens)."""
    orig = varlen.VarlenCall.backward

    def backward(self, kernel, dout, q, k, v, out, lse, scale, softcap=None):
        wrong = varlen.Varlen(kernel.forward,
                              lambda *a, **kw: kernel.backward(*a[:5], a[5].t().contiguous(), *a[6:], **kw))
        return orig(self, wrong, dout, q, k, v, out, lse, scale, softcap)

    monkeypatch.setattr(varlen.VarlenCall, "backward", backward)
    with pytest.raises(ContractError, match="log-sum-exp"):
        gpu_trace(program("tiny", "ring", 2))


def test_a_host_tensor_in_the_gpu_path_fails(monkeypatch):
    """Cumulative lengths made on the host instead of the attention's device."""
    def lengths(self, device):
        cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in (self.cu_q, self.cu_k))
        return {"cu_q": cu_q, "cu_k": cu_k, "max_q": self.max_q, "max_k": self.max_k}

    monkeypatch.setattr(varlen.VarlenCall, "_lengths", lengths)
    with pytest.raises(ContractError, match="cu_seqlens_q is on cpu"):
        gpu_trace(program("tiny", "none", 1))


def test_host_head_indices_in_ulysses_fail(monkeypatch):
    """The head schedule's index tensors left on the host (found by this trace: index_copy_ takes no host index
    for a GPU tensor). UPipe's stages index the heads; plain Ulysses keeps them in order and indexes nothing."""
    monkeypatch.setattr(ulysses, "head_schedule", lambda *a: heads.head_schedule(*a[:4]))
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device, .* meta and cpu"):
        gpu_trace(program("tiny", "upipe", 2))


def test_the_trace_in_a_child_returns_its_result_and_is_stopped_at_its_timeout(monkeypatch):
    """The stage-start trace runs in a child process on rank 0 while the other ranks wait: within its timeout the
    child's result comes back, and past it the child is killed (SIGKILL), not waited for."""
    import multiprocessing
    import signal
    from types import SimpleNamespace

    from longstride.recipes.memory.trace import trace_in_child

    prog = program("tiny", "none", 1)
    r = trace_in_child(prog)
    assert r["peak"] > r["parameters"] > 0 and r["batch_keys"]
    made, spawn = [], multiprocessing.get_context("spawn")

    def process(*args, **kwargs):
        made.append(spawn.Process(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(multiprocessing, "get_context", lambda method: SimpleNamespace(Pipe=spawn.Pipe,
                                                                                          Process=process))
    with pytest.raises(TimeoutError, match="longer than 0.5 s"):
        trace_in_child(prog, timeout_s=0.5)  # a spawned process importing torch alone takes longer
    assert made[0].exitcode == -signal.SIGKILL, "the timed-out child is killed, not waited for"


def test_the_attention_op_runs_on_fake_tensors_and_the_flash_check_sees_inside_it():
    """longstride's attention op (parallel/attention_call.py) under FakeTensorMode alone runs its call on fake
    tensors (the op's fake implementation), and a flash contract check entered alone (no memory count above it,
    which would open the op first) still sees the flash kernel call inside the op."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from longstride.parallel.flash_contract import FlashOpCheck
    from longstride.parallel.kernels import doc_attention, doc_bounds

    bounds = doc_bounds(torch.tensor([[0] * 40 + [1] * 24]))
    with FakeTensorMode(allow_non_fake_inputs=True):  # the cumulative lengths are real, as in the trace
        q, k = torch.empty(1, 4, 64, 32, dtype=torch.bfloat16), torch.empty(1, 2, 64, 32, dtype=torch.bfloat16)
        out = doc_attention(q, k, k, None, 0.2, kernel="torch_flash", bounds=bounds)
        assert isinstance(out, FakeTensor) and out.shape == q.shape
        with FlashOpCheck() as check:
            doc_attention(q, k, k, None, 0.2, kernel="torch_flash", bounds=bounds)
    assert check.calls == 1, "the one varlen call for both documents"
