"""Counting host syncs: the places where the host waits to see device data.

A decode step that reads device values on the host (`.item()`, `.tolist()`, a tensor in an `if`,
a data-dependent output shape such as `nonzero`) waits for the GPU queue to drain at each one,
and the host then launches the rest of the step late: the step becomes host-bound. The counter
works on any device, the CPU included, so CI can hold the decode step to its budget of one sync
(the copy of the sampled tokens):

    with SyncCounter() as syncs:
        runner.execute(scheduler_output)
    assert syncs.count == 1, syncs.report()

On a GPU `cuda_sync_debug("error")` makes every synchronising CUDA call raise instead, catching
syncs inside kernels' host code (e.g. a pageable host→device copy) that the counter cannot see.
"""

from __future__ import annotations

import contextlib
import traceback
import weakref
from collections import Counter
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

# Methods that return device data to the host, and functions whose output shape depends on
# device data (the host must wait for the values to size the result).
_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
    torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__float__,
    torch.Tensor.__complex__,
    torch.Tensor.nonzero, torch.nonzero, torch.Tensor.unique, torch.unique,
    torch.Tensor.unique_consecutive, torch.unique_consecutive, torch.masked_select,
    torch.Tensor.masked_select, torch.Tensor.equal, torch.equal, torch.Tensor.allclose,
    torch.allclose, torch.Tensor.is_nonzero, torch.is_nonzero,
    torch.repeat_interleave,  # without output_size: sizes the output from the repeats
}
# Functions whose output size depends on device data only for some arguments.
_COPIES = {torch.Tensor.to, torch.Tensor.copy_}


def _host_read(func, args, kwargs) -> bool:
    if func in _READS:
        if func is torch.repeat_interleave:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
        return True
    if func is torch.Tensor.__getitem__:  # boolean-mask indexing sizes its output from the mask
        idx = args[1] if len(args) > 1 else None
        idx = idx if isinstance(idx, tuple) else (idx,)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)
    if func in _COPIES:  # a device → host copy (the destination is the host, the source not)
        src = args[0] if func is torch.Tensor.to else (args[1] if len(args) > 1 else None)
        dst = args[0] if func is torch.Tensor.copy_ else None
        if func is torch.Tensor.to:
            target = next((a for a in args[1:] if isinstance(a, (torch.device, str))),
                          kwargs.get("device"))
            return (isinstance(src, torch.Tensor) and src.device.type != "cpu"
                    and target is not None and torch.device(target).type == "cpu")
        # a non-blocking copy into pinned memory does not wait: the host reads it later
        # (counted there), after an event says it landed
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)
                and src.device.type != "cpu" and dst.device.type == "cpu"
                and not (non_blocking and dst.is_pinned()))
    return False


class SyncCounter(TorchFunctionMode):
    """Counts host reads of tensor data inside its context (all devices: on the CPU they cost
    nothing but are the same code that stalls a GPU). `count` is the total, `sites` where they
    happened (function name and the calling line in dsaserve).

    A tensor that a counted `.cpu()` / `.to("cpu")` returned is on the host already: reading it
    is free. Calls made while a frame of a path in `exclude` is on the stack are not counted
    (e.g. "kernels/": the attention backend's own host code, checked on the GPU instead)."""

    def __init__(self, exclude: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.count = 0
        self.sites: Counter[str] = Counter()
        self.exclude = exclude
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}  # id → tensor copied to the host

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        read = _host_read(func, args, kwargs) and not (args and self._on_host(args[0]))
        if read and self.exclude and _excluded(self.exclude):
            read = False
        out = func(*args, **kwargs)
        if read:
            self.count += 1
            self.sites[f"{getattr(func, '__name__', func)} at {_caller()}"] += 1
            if isinstance(out, torch.Tensor) and out.device.type == "cpu":
                self._host[id(out)] = weakref.ref(out)
        return out

    def _on_host(self, t: object) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def report(self) -> str:
        """One line per sync site, most frequent first."""
        return "\n".join(f"{n} × {site}" for site, n in self.sites.most_common())


def _excluded(paths: tuple[str, ...]) -> bool:
    return any("/dsaserve/" in f.filename
               and f.filename.rsplit("/dsaserve/", 1)[1].startswith(paths)
               for f in traceback.extract_stack())


def _caller() -> str:
    """The innermost dsaserve frame that made the call (file:line), else the innermost frame."""
    frames = traceback.extract_stack()[:-2]
    for f in reversed(frames):
        if "/dsaserve/" in f.filename and not f.filename.endswith("engine/syncs.py"):
            return f"{f.filename.rsplit('/dsaserve/', 1)[1]}:{f.lineno}"
    f = frames[-1]
    return f"{f.filename}:{f.lineno}"


@contextlib.contextmanager
def cuda_sync_debug(mode: str = "warn") -> Iterator[None]:
    """torch.cuda.set_sync_debug_mode for the block ("warn" or "error"); a no-op without CUDA."""
    if not torch.cuda.is_available():
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)
