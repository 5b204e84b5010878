"""The Gluon sparse MLA kernels against the Triton one on an H200: correctness, then time.

    PYTHONPATH=. python benchmarks/sparse_mla_gluon_check.py [--quick | --prefill]

1. Correctness against `reference.sparse_mla_paged` on a slice of one prefill shape (bf16
   workspace), an FP8-cache prefill (T = 512 rows, one split: 64 blocks per program, the long
   run through the raw and K rings) and one FP8 decode shape (small batch: split + merge path);
   prints the maximum relative error of o over the rows and of lse.
2. Timing (medians of `triton.testing.do_bench`, L2 flushed) of `sparse_mla.sparse_mla_fwd`
   with the Triton kernel, the Gluon choice (bf16 rows: the ping-pong kernel) and the 32-row
   Gluon kernel (KERNELS) on the shapes of benchmarks/kernels.py (--prefill: the bf16 prefill
   at T = 4096 and 16384 only): prefill
   T = 4096 from a 128K-row bf16 workspace and from a 128K-row fp8_ds_mla cache, FP8 decode
   b = 128 and b = 32 (s_q = 1), 64 heads, top-2048; a markdown table of µs and TFLOP/s (2176
   flops per selected row and head).
Each case catches its own exception and prints it, so one failure does not hide the others.
"""

from __future__ import annotations

import argparse
import traceback
from collections.abc import Callable
from functools import partial

import torch

from benchmarks.kernels import (
    CONTEXT,
    DEV,
    FLOP_PER_ROW_HEAD,
    HEADS,
    SCALE,
    TOPK,
    L,
    R,
    decode_case,
    fill_mla_cache,
    timed,
    topk_positions,
)
from dsaserve.kernels import reference
from dsaserve.kernels.triton import sparse_mla

# The Triton kernel, whatever the automatic choice would pick.
TRITON = partial(sparse_mla.sparse_mla_fwd, config=sparse_mla.SparseMlaConfig(gluon=False))
# The Gluon kernels: the default choice (bf16 rows: the ping-pong kernel), and
# sparse_mla_gluon.py's kernel for bf16 rows too.
GLUON = partial(sparse_mla.sparse_mla_fwd, config=sparse_mla.SparseMlaConfig(gluon=True))
GLUON_32 = partial(sparse_mla.sparse_mla_fwd,
                   config=sparse_mla.SparseMlaConfig(gluon=True, pingpong=False))
KERNELS = (("triton", TRITON), ("gluon", GLUON), ("gluon 32-row", GLUON_32))

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q, cache, idx


def prefill_inputs(num_tokens: int = 4096) -> Inputs:
    """Queries at the end of a 128K context over a bf16 workspace [1, 128K, 576]."""
    cache = torch.randn(1, CONTEXT, L + R, device=DEV, dtype=torch.bfloat16)
    positions = torch.arange(CONTEXT - num_tokens, CONTEXT, device=DEV)
    idx = topk_positions(positions + 1, TOPK).int()  # [T, 2048] workspace rows
    q = torch.randn(num_tokens, HEADS, L + R, device=DEV, dtype=torch.bfloat16)
    return q, cache, idx


_FP8_PREFILL_CACHE: list[torch.Tensor] = []


def fp8_prefill_inputs(num_tokens: int = 4096) -> Inputs:
    """prefill_inputs over an fp8_ds_mla cache instead: 128K rows [2048, 64, 656] (pages of 64,
    in order), the same top-2048 rows below each query's position."""
    if not _FP8_PREFILL_CACHE:
        cache = torch.empty(CONTEXT // 64, 64, 656, dtype=torch.uint8, device=DEV)
        fill_mla_cache(cache)
        _FP8_PREFILL_CACHE.append(cache)
    cache = _FP8_PREFILL_CACHE[0]
    positions = torch.arange(CONTEXT - num_tokens, CONTEXT, device=DEV)
    idx = topk_positions(positions + 1, TOPK).int()  # [T, 2048] cache slots
    q = torch.randn(num_tokens, HEADS, L + R, device=DEV, dtype=torch.bfloat16)
    return q, cache, idx


_DECODE_CACHE: list[torch.Tensor] = []


def decode_inputs(batch: int) -> Inputs:
    """FP8 paged decode, s_q = 1: 128K-token requests mapped randomly into a shared pool."""
    if not _DECODE_CACHE:
        pool = torch.empty(65536, 64, 656, dtype=torch.uint8, device=DEV)  # 4M slots
        fill_mla_cache(pool)
        _DECODE_CACHE.append(pool)
    cache = _DECODE_CACHE[0]
    q, idx = decode_case(batch, 1, cache.shape[0], cache)
    return q, cache, idx


def max_rel_err(o: torch.Tensor, lse: torch.Tensor, ref_o: torch.Tensor,
                ref_lse: torch.Tensor) -> tuple[float, float]:
    """Largest per-row ‖o − ref‖ / ‖ref‖ and largest |lse − ref| / max(1, |ref|)."""
    diff = (o.float() - ref_o).flatten(1).norm(dim=1)
    rel_o = diff / ref_o.flatten(1).norm(dim=1).clamp_min(1e-30)
    rel_lse = (lse - ref_lse).abs() / ref_lse.abs().clamp_min(1.0)
    return float(rel_o.max()), float(rel_lse.max())


def check(label: str, inputs: Inputs, rows: int, num_splits: int | None = None) -> None:
    """num_splits: passed to the Gluon kernel (None: its own choice)."""
    q, cache, idx = inputs
    q, idx = q[:rows], idx[:rows]
    ref_o, ref_lse = reference.sparse_mla_paged(q, cache, idx, SCALE, L, R)
    for name, fn in KERNELS:
        if num_splits is not None and name != "triton":
            fn = partial(sparse_mla.sparse_mla_fwd, config=sparse_mla.SparseMlaConfig(
                gluon=True, pingpong=name == "gluon", num_splits=num_splits))
        try:
            o, lse = fn(q, cache, idx, SCALE, L)
            torch.cuda.synchronize()
            err_o, err_lse = max_rel_err(o, lse, ref_o, ref_lse)
            verdict = "ok" if err_o <= 1e-2 and err_lse <= 1e-2 else "FAIL"
            print(f"  {label} {name}: max rel err o {err_o:.2e}, lse {err_lse:.2e} {verdict}",
                  flush=True)
        except Exception:
            print(f"  {label} {name}: failed\n{traceback.format_exc()}", flush=True)


def time_case(label: str, make: Callable[[], Inputs], table: list[str]) -> None:
    try:
        q, cache, idx = make()
    except Exception:
        print(f"  {label}: inputs failed\n{traceback.format_exc()}", flush=True)
        return
    flops = q.shape[0] * q.shape[1] * idx.shape[1] * FLOP_PER_ROW_HEAD
    cells = []
    for name, fn in KERNELS:
        try:
            ms = timed(partial(fn, q, cache, idx, SCALE, L))
            cells.append(f"{ms * 1e3:.1f} | {flops / ms / 1e9:.1f}")
        except Exception:
            print(f"  {label} {name}: failed\n{traceback.format_exc()}", flush=True)
            cells.append("failed | –")
    table.append(f"| {label} | {' | '.join(cells)} |")
    print(table[-1], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="correctness only")
    parser.add_argument("--prefill", action="store_true", help="time the bf16 prefill only")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("sparse_mla_gluon_check: needs an sm_90 GPU (H100 / H200)")

    print("correctness (against reference.sparse_mla_paged)", flush=True)
    for label, make, rows, splits in (
            ("prefill T=4096 bf16", prefill_inputs, 64, None),
            ("prefill T=512 fp8 cache, 1 split", partial(fp8_prefill_inputs, 512), 512, 1),
            ("decode b=32 fp8", partial(decode_inputs, 32), 32, None)):
        try:
            check(label, make(), rows, splits)
        except Exception:
            print(f"  {label}: failed\n{traceback.format_exc()}", flush=True)
    if args.quick:
        return

    table = ["| case | triton µs | TFLOP/s | gluon µs | TFLOP/s | gluon 32-row µs | TFLOP/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(table), flush=True)
    time_case("prefill T=4096, bf16 workspace", prefill_inputs, table)
    if args.prefill:
        time_case("prefill T=16384, bf16 workspace", partial(prefill_inputs, 16384), table)
        print("\n" + "\n".join(table))
        return
    time_case("prefill T=4096, fp8_ds_mla cache", fp8_prefill_inputs, table)
    time_case("FP8 decode b=128 s_q=1", partial(decode_inputs, 128), table)
    time_case("FP8 decode b=32 s_q=1", partial(decode_inputs, 32), table)
    print("\n" + "\n".join(table))


if __name__ == "__main__":
    main()
