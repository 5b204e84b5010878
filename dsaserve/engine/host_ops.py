"""Counting a step's host operations: the torch ops it dispatches and the Triton kernels it
launches, per call site and per decoder layer.

An eager step costs the host one dispatch per torch op and one launch per kernel, so its host
time is mostly (ops + launches) × a few µs, and what grows with the model's layers is what each
layer dispatches. The counter works on any device:

    with OpCounter(model.model.layers) as ops:
        runner.execute(scheduler_output)
    ops.total(), ops.per_layer(), ops.report()

On a CPU the triton backend's kernels cannot run, but its host code can: `gpu_branches()` takes
the branches a GPU takes on CPU tensors (kernels/triton's host code and the model's fused
norm and rotary, which `use_kernels` opens under TRITON_INTERPRET=1; the MoE's grouped GEMM,
torch._grouped_mm running on the CPU), and `OpCounter(stub_launches=True)` replaces every
Triton launch by its count (and zeroes its integer tensors, so that indices it would write are
valid ones). A step then runs its GPU path's host code end to end: the outputs are garbage,
the counts are real. What it cannot take: kernels chosen only on a GPU (the Gluon
and CUDA-extension kernels in place of Triton ones, one launch each either way; the CUDA top-k
is one launch where the Triton row_topk is three) and the runner's CUDA-only steps (pinned
staging, CUDA graphs).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

Site = str  # "model/dsa.py:154 forward"
OUTSIDE = -1  # the layer key of ops outside every decoder layer (the step's own)


def _zero_indices(args: Sequence[object]) -> None:
    """A stubbed launch's integer tensors zeroed, uncounted: a kernel's integer outputs (a
    sort's order, a layout's tokens) may index a later torch op, which on a CPU checks its
    indices; zeros are valid ones. Float outputs stay garbage."""
    with _disable_current_modes():
        for a in args:
            if isinstance(a, torch.Tensor) and a.dtype in (torch.int32, torch.int64):
                a.zero_()


def _site() -> Site:
    """The innermost dsaserve frame on the stack, outside this module (file:line function)."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if "/dsaserve/" in name and not name.endswith("engine/host_ops.py"):
            return f"{name.rsplit('/dsaserve/', 1)[1]}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return "(outside dsaserve)"


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside its context (views included: each is a host call)
    and, with triton imported, the Triton kernels launched, keyed by (decoder layer, site).
    `layers` are the model's decoder layers (`DsaModel.layers`); a layer's index is its
    position there (the MTP layer last). With stub_launches, launches are counted, not run."""

    def __init__(self, layers: Sequence[nn.Module] = (), stub_launches: bool = False) -> None:
        super().__init__()
        # (decoder layer, site, the aten op's or the kernel's name) → count
        self.ops: Counter[tuple[int, Site, str]] = Counter()
        self.launches: Counter[tuple[int, Site, str]] = Counter()
        self._layers = list(layers)
        self._stub = stub_launches
        self._layer = OUTSIDE
        self._exit: contextlib.ExitStack | None = None

    # ---- context ---------------------------------------------------------------------------
    def __enter__(self) -> OpCounter:
        stack = contextlib.ExitStack()
        for i, layer in enumerate(self._layers):
            stack.callback(layer.register_forward_pre_hook(self._enter_layer(i)).remove)
            stack.callback(layer.register_forward_hook(self._leave_layer).remove)
        stack.enter_context(self._launch_hook())
        self._exit = stack
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._exit.close()

    def _enter_layer(self, i: int):
        def hook(module, args) -> None:
            self._layer = i
        return hook

    def _leave_layer(self, module, args, out) -> None:
        self._layer = OUTSIDE

    @contextlib.contextmanager
    def _launch_hook(self) -> Iterator[None]:
        """Every Triton launch is `kernel[grid](...)` (KernelInterface.__getitem__, autotuned
        kernels included): counted there, then run unless stubbed."""
        if "triton" not in sys.modules and not self._stub:
            yield  # no triton, no Triton launches
            return
        from triton.runtime.jit import KernelInterface

        original = KernelInterface.__getitem__
        counter = self

        def getitem(kernel, grid):
            run = None if counter._stub else original(kernel, grid)

            def launch(*args, **kwargs):
                fn = getattr(kernel, "fn", kernel)
                name = getattr(fn, "__name__", type(kernel).__name__)
                counter.launches[(counter._layer, _site(), name)] += 1
                if run is None:
                    _zero_indices(args)
                    return None
                return run(*args, **kwargs)
            return launch

        KernelInterface.__getitem__ = getitem
        try:
            yield
        finally:
            KernelInterface.__getitem__ = original

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[(self._layer, _site(), func.__name__)] += 1
        return func(*args, **(kwargs or {}))

    # ---- results ---------------------------------------------------------------------------
    def total(self) -> tuple[int, int]:
        """(torch ops, Triton launches) of everything counted."""
        return sum(self.ops.values()), sum(self.launches.values())

    def per_layer(self) -> dict[int, tuple[int, int]]:
        """Layer index (OUTSIDE: the step's own) → (torch ops, Triton launches)."""
        out: dict[int, list[int]] = {}
        for (layer, _, _), n in self.ops.items():
            out.setdefault(layer, [0, 0])[0] += n
        for (layer, _, _), n in self.launches.items():
            out.setdefault(layer, [0, 0])[1] += n
        return {k: (v[0], v[1]) for k, v in sorted(out.items())}

    def sites(self, layer: int | None = None, names: bool = False) -> Counter[Site]:
        """Ops + launches per site, of one layer (None: all); with names, per site and op
        (\"site  aten-op\" or \"site  launch kernel\")."""
        out: Counter[Site] = Counter()
        for kind, counts in (("", self.ops), ("launch ", self.launches)):
            for (lay, site, name), n in counts.items():
                if layer is None or lay == layer:
                    out[f"{site}  {kind}{name}" if names else site] += n
        return out

    def report(self, layer: int | None = None, top: int = 25, names: bool = False) -> str:
        """The busiest sites (ops + launches), most first."""
        return "\n".join(f"{n:5d}  {site}"
                         for site, n in self.sites(layer, names).most_common(top))


@contextlib.contextmanager
def gpu_branches() -> Iterator[None]:
    """On CPU tensors, the branches a GPU takes: kernels/triton's host code and the model's
    fused glue (TRITON_INTERPRET=1, read by `use_kernels` at each call) and the MoE's grouped
    GEMM. Pair it with OpCounter(stub_launches=True): the kernels themselves do not run."""
    from dsaserve.model import moe_compute

    saved_env = os.environ.get("TRITON_INTERPRET")
    saved_grouped = moe_compute.grouped_mm_available
    os.environ["TRITON_INTERPRET"] = "1"
    moe_compute.grouped_mm_available = lambda x, w: hasattr(torch, "_grouped_mm")
    try:
        yield
    finally:
        moe_compute.grouped_mm_available = saved_grouped
        if saved_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved_env


def ops_per_layer(small: OpCounter, large: OpCounter, layers: tuple[int, int],
                  names: bool = False) -> tuple[float, float, Counter[Site]]:
    """The same step counted on models of layers[0] and layers[1] decoder layers → (torch ops
    per layer, launches per layer, per-site growth per layer × (layers[1] − layers[0])): what a
    layer adds, the step's fixed part and the first layer's one-off plan cancelling out."""
    (o0, l0), (o1, l1) = small.total(), large.total()
    span = layers[1] - layers[0]
    growth = large.sites(names=names)
    growth.subtract(small.sites(names=names))
    return (o1 - o0) / span, (l1 - l0) / span, +growth
