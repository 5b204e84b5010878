"""The GPU path's host code timed on a CPU: what benchmarks/prefill_host_cpu.py and
decode_host_cpu.py share.

The triton backend's steps take the GPU path's branches on CPU tensors
(engine/host_ops.gpu_branches); `stubbed()` keeps its kernels from running, so what is timed is
the host code around them. `tiny_glm53` writes the checkpoint both run: GLM-5.3's attention
widths where the host plans depend on them (512 + 64 latent, top-2048, every layer a full
indexer layer) and tiny matrices, so that the CPU's own compute stays small beside the host
work. `function_times` and `median_lines` turn cProfile runs into per-step tables.
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats
import statistics
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

from dsaserve.kernels.triton import indexer
from dsaserve.model.make_model import make_model

SMALL = 1 << 20  # stubbed launches zero integer tensors below this many elements


@contextlib.contextmanager
def stubbed() -> Iterator[None]:
    """Triton launches do nothing but zero their small integer tensors (indices a later torch
    op reads); the indexer's top-k gives zeros."""
    from triton.runtime.jit import KernelInterface

    def getitem(kernel, grid):
        def launch(*args, **kwargs):
            for a in args:
                if isinstance(a, torch.Tensor) and a.dtype in (torch.int32, torch.int64) \
                        and a.numel() < SMALL:
                    a.zero_()
        return launch

    def select(scored, k, config, index_dtype):
        rows = scored[0].shape[0]
        return torch.empty(rows, k), torch.zeros(1, k, dtype=index_dtype).expand(rows, k)

    saved = KernelInterface.__getitem__, indexer._select
    KernelInterface.__getitem__, indexer._select = getitem, select
    try:
        yield
    finally:
        KernelInterface.__getitem__, indexer._select = saved


def tiny_glm53(root: Path, layers: int, max_position_embeddings: int,
               with_mtp: bool = False) -> Path:
    """A tiny-glm5 checkpoint under `root` with GLM-5.3's attention widths (top-2048, every
    layer a full indexer layer) and 64-wide matrices; `with_mtp`: its MTP layer too."""
    return make_model("tiny-glm5", root / "m", with_mtp=with_mtp, overrides={
        "num_hidden_layers": layers, "indexer_types": ["full"] * layers, "index_topk": 2048,
        "max_position_embeddings": max_position_embeddings, "hidden_size": 64,
        "intermediate_size": 64, "moe_intermediate_size": 32, "num_attention_heads": 2,
        "num_key_value_heads": 2, "q_lora_rank": 32, "index_n_heads": 4})


def function_key(path: str, line: int, name: str, with_line: bool = False) -> str:
    """'engine/runner.py _prepare' for dsaserve's functions ('engine/runner.py:1107 _prepare'
    `with_line`: methods of one name in one file apart), 'file:line name' for others (torch's,
    the standard library's; builtins keep cProfile's '{...}' name)."""
    if "/dsaserve/" in path:
        where = path.rsplit("/dsaserve/", 1)[1]
        return f"{where}:{line} {name}" if with_line else f"{where} {name}"
    if path == "~":
        return name
    return f"{path.rsplit('/', 1)[-1]}:{line} {name}"


def function_times(profile: cProfile.Profile, dsaserve_only: bool = False,
                   with_line: bool = False) -> dict[str, tuple[float, float]]:
    """Each profiled function's (own, cumulative) seconds, keyed by `function_key`;
    `dsaserve_only`: dsaserve's functions alone."""
    out: dict[str, tuple[float, float]] = {}
    for (path, line, name), (_, _, own, cum, _) in pstats.Stats(profile).stats.items():
        if dsaserve_only and "/dsaserve/" not in path:
            continue
        key = function_key(path, line, name, with_line)
        o, c = out.get(key, (0.0, 0.0))  # two functions may share a key (lambdas)
        out[key] = (o + own, c + cum)
    return out


def median_lines(samples: Mapping[str, Sequence[float]], top: int | None = None,
                 scale: float = 1e3) -> list[str]:
    """'  median×scale  key' per key, largest median first (the first `top` of them); the
    median over the runs that sampled it (a function absent from a run counts as 0 there only
    if the caller put a 0)."""
    rows = sorted(((statistics.median(v), k) for k, v in samples.items()), key=lambda r: -r[0])
    return [f"  {scale * m:7.3f}  {k}" for m, k in rows[:top]]
