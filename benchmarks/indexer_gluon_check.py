"""The Gluon indexer logits kernel against the Triton one on an H200: correctness, then time.

    PYTHONPATH=. python benchmarks/indexer_gluon_check.py [--quick]

1. Correctness on one prefill shape (T = 4096 queries at the end of a 128K context, 64 heads)
   and one decode shape (b = 64 × 64K keys, s_q = 1): the largest |Δ| of the logits and group
   maxima over the largest |logit| (expected ≤ 1e-5: only the fp32 order of the head sum
   differs), and whether −inf stands in the same places.
2. Timing (medians of `triton.testing.do_bench`, L2 flushed) of `indexer._logits` (Triton, its
   default configuration) and the same call with `IndexerConfig(gluon=True)` on the shapes of
   benchmarks/kernels.py:
   prefill T = 4096 × 128K keys with 64 and 32 heads (FLOPs = Σ_t visible keys · H · 128 · 2)
   and decode b = 64 × 64K keys, s_q = 1 (bytes = 64 · 65536 · 132); the Gluon kernel at a few
   pages per program (the best is the one to keep). A markdown table of µs, TFLOP/s or TB/s
   and the Gluon / Triton speed ratio.
Each case catches its own exception and prints it, so one failure does not hide the others.
"""

from __future__ import annotations

import argparse
import traceback
from collections.abc import Callable
from functools import partial

import torch

from benchmarks.kernels import CONTEXT, DEV, index_meta, timed
from dsaserve.kernels.triton import indexer

CONFIG = indexer.IndexerConfig(gluon=False)
PREFILL_TOKENS, DECODE_BATCH, DECODE_KEYS = 4096, 64, 65536


def prefill_case(heads: int):
    """T = 4096 new tokens at the end of one 128K-token request → (q, w, cache, meta, FLOPs)."""
    meta, cache = index_meta([CONTEXT], [PREFILL_TOKENS])
    q = torch.randn(PREFILL_TOKENS, heads, 128, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(PREFILL_TOKENS, heads, device=DEV) * heads**-0.5 * 128**-0.5
    flops = float((meta.positions + 1).sum()) * heads * 128 * 2
    return q, w, cache, meta, flops


def decode_case(heads: int = 64):
    """b = 64 requests of 64K keys, one new token each → (q, w, cache, meta, bytes read)."""
    meta, cache = index_meta([DECODE_KEYS] * DECODE_BATCH, [1] * DECODE_BATCH)
    q = torch.randn(DECODE_BATCH, heads, 128, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(DECODE_BATCH, heads, device=DEV) * heads**-0.5 * 128**-0.5
    return q, w, cache, meta, float(DECODE_BATCH * DECODE_KEYS * 132)


def _gluon(pages: int | None) -> indexer.IndexerConfig:
    return indexer.IndexerConfig(gluon=True, pages_per_prog=pages)


def _error(ours: torch.Tensor, ref: torch.Tensor) -> str:
    same_inf = torch.equal(ours.isneginf(), ref.isneginf())
    finite = ref.isfinite() & ours.isfinite()
    scale = ref[finite].abs().max().clamp_min(1e-30)
    err = float((ours[finite] - ref[finite]).abs().max() / scale)
    nan = bool(ours.isnan().any())
    return f"max |Δ| / max |ref| = {err:.2e}, −inf same: {same_inf}, NaN: {nan}"


def check(label: str, case: Callable[[], tuple]) -> None:
    try:
        q, w, cache, meta, _ = case()
        ref_logits, ref_gmax, _ = indexer._logits(q, w, cache, meta, CONFIG)
        logits, gmax, _ = indexer._logits(q, w, cache, meta, _gluon(None))
        torch.cuda.synchronize()
        print(f"{label}: logits {_error(logits, ref_logits)}; group maxima "
              f"{_error(gmax, ref_gmax)}", flush=True)
    except Exception:  # noqa: BLE001  (report and go on with the other cases)
        print(f"{label}: FAILED\n{traceback.format_exc()}", flush=True)


def bench(label: str, case: Callable[[], tuple], unit: str, per_prog: tuple[int, ...],
          rows: list[str]) -> None:
    """Time both kernels on one shape; one table row per Gluon pages-per-program value."""
    try:
        q, w, cache, meta, amount = case()
        scale = 1e9  # FLOPs or bytes per ms → tera per second
        ms_triton = timed(partial(indexer._logits, q, w, cache, meta, CONFIG))
        rows.append(f"| {label} | Triton (default config) | {ms_triton * 1e3:.1f} | "
                    f"{amount / ms_triton / scale:.0f} {unit} | 1.00 |")
        for pages in per_prog:
            ms = timed(partial(indexer._logits, q, w, cache, meta, _gluon(pages)))
            rows.append(f"| {label} | Gluon, {pages} pages per program | {ms * 1e3:.1f} | "
                        f"{amount / ms / scale:.0f} {unit} | {ms_triton / ms:.2f} |")
        print(rows[-1], flush=True)
    except Exception:  # noqa: BLE001
        rows.append(f"| {label} | FAILED | | | |")
        print(f"{label}: FAILED\n{traceback.format_exc()}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one pages-per-program value each")
    args = parser.parse_args()
    prefill_pages = (64,) if args.quick else (32, 64, 128)
    decode_pages = (16,) if args.quick else (8, 16, 32)

    check("prefill T=4096 S=128K H=64", partial(prefill_case, 64))
    check("decode b=64 S=64K H=64", decode_case)

    rows: list[str] = []
    for heads in (64, 32):
        bench(f"prefill T=4096 S=128K H={heads}", partial(prefill_case, heads), "TFLOP/s",
              prefill_pages, rows)
        torch.cuda.empty_cache()
    bench("decode b=64 S=64K H=64 s_q=1", decode_case, "TB/s", decode_pages, rows)
    print("\n| shape | kernel | µs | rate | Gluon / Triton speed |\n|---|---|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
