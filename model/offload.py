"""Offload of checkpointed activations to pinned host memory, with the copies overlapped with compute.

Under activation checkpointing each decoder layer keeps only its inputs (L x hidden per layer).
`ActivationOffload` is a pair of saved-tensor hooks that moves them to pinned host memory as they
are saved and brings them back ahead of need:
  forward   the device-to-host copy of a layer's input is queued on a side stream once the compute
            stream has produced it; the compute stream goes on with the next layer at once, and the
            device memory is released when the copy is done (the caching allocator is told that the
            side stream uses it).
  backward  when layer i's input is unpacked for its recompute, the copy back of the input saved just
            before it (layer i-1's) is queued on the side stream, so it travels while layer i
            recomputes and back-propagates; the compute stream waits only on the event of the
            tensor it needs now.
Tensors under `min_bytes` stay on the device. On a CPU run there is nowhere to offload to and the
hooks are not installed; `simulate=True` (tests) runs the same bookkeeping on CPU tensors, with
copies standing in for the transfers and no streams.
"""
from __future__ import annotations

import weakref
from typing import Optional, Union

import torch


def pinned_bytes(n: int) -> int:
    """Host memory an n-byte offloaded tensor takes: torch's pinned host allocator rounds each block up to a power
    of two and keeps it cached for reuse (up to 2x the tensor: 1.78x for SmolLM2-135M's 576-wide layer inputs)."""
    return 1 << max(n - 1, 0).bit_length()


class ActivationOffload:
    def __init__(self, min_bytes: int = 1 << 20, simulate: bool = False):
        self.min_bytes, self.simulate = min_bytes, simulate
        self.stream: Optional[torch.cuda.Stream] = None if simulate else torch.cuda.Stream()
        self.items: dict[int, dict] = {}  # packed id -> host copy, device copy (once fetched), its event, refs
        self.live: dict[int, int] = {}  # a tensor saved by several layers (RoPE cos/sin) is copied once
        self.next_id = 0
        self.armed = True  # attach(module, until=...) limits offload to part of a forward
        self.handles: list = []  # attach's hooks, removed by detach
        # ("pack"|"fetch"|"unpack", id) in simulate mode, for tests; never kept in a real run
        self.trace: Optional[list[tuple[str, int]]] = [] if simulate else None

    def pack(self, t: torch.Tensor) -> Union[torch.Tensor, int]:
        small = t.numel() * t.element_size() < self.min_bytes
        off_device = not self.simulate and t.device.type != "cuda"
        if not self.armed or small or isinstance(t, torch.nn.Parameter) or off_device:
            return t
        key = id(t)  # the same tensor object (its weak reference tells a reused id apart)
        if key in self.live and self.items[self.live[key]]["tensor"]() is t:
            self.items[self.live[key]]["refs"] += 1
            return self.live[key]
        i, self.next_id = self.next_id, self.next_id + 1
        if self.simulate:
            host = t.detach().clone()
        else:
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            self.stream.wait_stream(torch.cuda.current_stream())  # t is written before it is copied
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)  # its memory is reused only after the copy
        self.items[i] = {"host": host, "device": None, "event": None, "to": t.device, "refs": 1, "key": key,
                         "tensor": weakref.ref(t)}
        self.live[key] = i
        self._record("pack", i)
        return i

    def _record(self, op: str, i: int) -> None:
        if self.trace is not None:
            self.trace.append((op, i))

    def _fetch(self, i: int) -> None:
        item = self.items[i]
        if item["device"] is not None:
            return
        self._record("fetch", i)
        if self.simulate:
            item["device"] = item["host"].clone()
            return
        with torch.cuda.stream(self.stream):  # after this item's own device-to-host copy (same stream)
            item["device"] = item["host"].to(item["to"], non_blocking=True)
            item["event"] = torch.cuda.Event()
            item["event"].record(self.stream)

    def unpack(self, packed: Union[torch.Tensor, int]) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if packed not in self.items:
            raise RuntimeError("an offloaded activation was read twice (backward with retain_graph=True); "
                               "set model.offload_activations=false for such use")
        self._fetch(packed)
        earlier = [j for j in self.items if j < packed]
        if earlier:  # backward goes in reverse order: the next tensor it needs was saved just before
            self._fetch(max(earlier))
        item = self.items[packed]
        item["refs"] -= 1
        if item["refs"] == 0:  # the last reader: forget it, so its device copy goes with autograd's use
            del self.items[packed]
            if self.live.get(item["key"]) == packed:
                del self.live[item["key"]]
        self._record("unpack", packed)
        t = item["device"]
        if item["event"] is not None:
            torch.cuda.current_stream().wait_event(item["event"])
            t.record_stream(torch.cuda.current_stream())
        return t

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def detach(self) -> None:
        """Removes the hooks `attach` installed."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def attach(self, module: torch.nn.Module, until: Optional[torch.nn.Module] = None) -> list:
        """The hooks around every forward of `module`, through its forward pre-hook and forward hook (both
        public torch module hooks); with `until` (a submodule), only what is saved before that submodule's
        forward ends is offloaded. Returns the hooks' handles."""
        active = []

        def enter(mod, args) -> None:
            self.armed = True
            active.append(self.hooks())
            active[-1].__enter__()

        def leave(mod, args, out) -> None:
            active.pop().__exit__(None, None, None)

        def disarm(mod, args, out) -> None:
            self.armed = False

        handles = [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]
        if until is not None:
            handles.append(until.register_forward_hook(disarm))
        self.handles += handles
        return handles
