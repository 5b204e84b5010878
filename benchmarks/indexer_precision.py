"""How far each indexer logits kernel is from an fp32 reference on the same e4m3 inputs (H200).

    PYTHONPATH=. python benchmarks/indexer_precision.py [--heads 64,32] [--seeds 2]

Per head count and seed: random bf16 queries, weights and keys (the keys written to the FP8
cache, the queries quantized by the indexer's rule), a ragged step of a 512-token prefill at
the end of a 16K-token context beside decode rows (s_q 1..4) of shorter contexts. Each kernel's
logits (the Triton kernel and every CUDA block shape, `indexer_logits.SHAPES`) against
`reference.indexer_logits_fp8` (fp32 arithmetic on the same e4m3 values and scales), over the
visible keys of every row: the largest |Δ| over the row's largest |score|, and over the
linear shapes' bound (the same scores from |q|, |w| and |k|: `indexer_logits.abs_inputs`;
the linear shapes may differ from the ReLU form by `LINEAR_REL_ERROR` of it). A markdown table,
one line per (heads, kernel), the worst over the seeds. docs/kernels.md quotes it.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.kernels import DEV, head_counts, index_meta
from dsaserve.kernels import formats, reference
from dsaserve.kernels.cuda import indexer_logits as cuda_logits
from dsaserve.kernels.triton import indexer
from dsaserve.kv import layout

SEQ_LENS, NEW = [16384, 4000, 77, 3001], [512, 1, 4, 3]


def kernels() -> dict[str, indexer.IndexerConfig]:
    """The Triton logits kernel and each CUDA block shape."""
    found = {"Triton": indexer.IndexerConfig(cuda_logits=False, gluon=False)}
    for shape in cuda_logits.SHAPES:
        label = f"CUDA {shape.consumers} x {shape.rows}, depth {shape.depth}" + \
            (", linear" if shape.linear else "")
        found[label] = indexer.IndexerConfig(cuda_logits=True, cuda_shape=shape)
    return found


def errors(heads: int, seed: int) -> dict[str, tuple[float, float]]:
    """Kernel → (largest |Δ| / the row's largest |score|, largest |Δ| / the bound)."""
    torch.manual_seed(seed)
    meta, cache = index_meta(SEQ_LENS, NEW)
    q = torch.randn(meta.num_tokens, heads, 128, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(meta.num_tokens, heads, device=DEV) * heads**-0.5 * 128**-0.5
    q8, q_scale = formats.quantize_index_q(q)
    ref_rows, bound_rows = [], []
    for r in range(meta.num_reqs):
        a, b = meta.query_range(r)
        slots, _ = layout.context_slots(meta.seq_lens[r], meta.block_table[r], meta.block_size,
                                        1, 0)
        k8, k_scale = formats.read_index_cache(cache, slots)
        ref_rows.append(reference.indexer_logits_fp8(q8[a:b], q_scale[a:b], w[a:b], k8, k_scale))
        bound_rows.append(reference.indexer_logits_fp8(q8[a:b].float().abs(), q_scale[a:b],
                                                       w[a:b].abs(), k8.float().abs(), k_scale))
    worst = {}
    for label, config in kernels().items():
        logits, limits = indexer.indexer_logits_paged(q, w, cache, meta, config)
        rel_max = rel_bound = 0.0
        for r in range(meta.num_reqs):
            a, b = meta.query_range(r)
            for t in range(a, b):
                n = int(limits[t])
                if n == 0:
                    continue
                ref, bound = ref_rows[r][t - a, :n], bound_rows[r][t - a, :n]
                delta = (logits[t, :n] - ref).abs()
                rel_max = max(rel_max, float(delta.max()) / float(ref.abs().max()))
                rel_bound = max(rel_bound, float((delta / bound).max()))
        worst[label] = (rel_max, rel_bound)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=head_counts, default=(64, 32))
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    print("| heads | kernel | largest error / the row's largest score | largest error / bound |")
    print("|---:|---|---:|---:|")
    for heads in args.heads:
        per_seed = [errors(heads, seed) for seed in range(args.seeds)]
        for label in per_seed[0]:
            rel_max = max(e[label][0] for e in per_seed)
            rel_bound = max(e[label][1] for e in per_seed)
            print(f"| {heads} | {label} | {rel_max:.2e} | {rel_bound:.2e} |", flush=True)


if __name__ == "__main__":
    main()
