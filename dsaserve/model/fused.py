"""Projections of one input, stored as one matrix after loading (vLLM's merged linears).

Several projections of a layer read the same activations: q_a, the indexer's wk and kv_a read
the normalised hidden state; q_b and the indexer's wq_b read the normalised q latent; an MLP's
gate and up read its input. Run apart, each is a GEMM launch (and on the weight-only FP8 path a
split-K reduction), and on the W8A8 path each quantizes the same activations again. Fused, the
group's rows are one matrix: one launch, one quantization, and narrow ones (kv_a, wk) ride on a
product wide enough to fill the GPU.

    merged weight   [q_a rows | wk rows | kv_a rows]     (each module's weight a view of it)
    output          y [M, Σ n_i] → views y[:, a_i : b_i] (row stride Σ n_i)

The modules keep their parameters and names, re-pointed to views of the merged storage, so the
loader, the tensor-parallel cuts and the state dict see what they did; a weight loaded again in
place lands in the merged matrix. An FP8 group needs every member but the last to end on a
128-row scale block and none to start inside one (a TP shard may): the merged scale is then the
members' scales stacked. Groups that cannot be fused (mixed kinds, such blocks) stay apart.

`whole_blocks`: an FP8 group whose last member ends inside a block (GLM-5.3's q_a + wk + kv_a:
2,048 + 128 + 576 = 21.5 blocks) gets zero rows up to the block's end, so that its product is
whole blocks, the shape cuBLAS's block-scaled GEMM takes at prefill sizes (fp8_w8a8.cublas_takes:
N a multiple of 128) instead of a dequantized bf16 copy of the matrix; the zero rows' output
columns are dropped. The last block's scale is the partial member's (its zero rows change no
maximum); decode reads the padding too (64 rows of 6,144 bytes here, 2 % of the group).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dsaserve.model import fp8


class FusedProjections:
    """The merged module of a group and where each member's output columns are. A plain
    object, not an nn.Module: the merged parameters are not registered twice."""

    def __init__(self, merged: nn.Module, bounds: Sequence[tuple[int, int]]) -> None:
        self.merged = merged
        self.bounds = tuple(bounds)  # member i's columns [a, b) of the merged output, call order
        stored = sorted(range(len(bounds)), key=lambda i: bounds[i][0])
        self._sizes = [bounds[i][1] - bounds[i][0] for i in stored]  # storage order
        padding = merged.weight.shape[0] - sum(self._sizes)  # whole_blocks' zero rows
        if padding:
            self._sizes.append(padding)  # a last piece, never returned
        self._slot = [stored.index(i) for i in range(len(bounds))]  # call i → storage slot

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [M, K] → each member's output [M, n_i], views of one [M, Σ n_i] product (one
        split: one host op for all the views)."""
        parts = self.merged(x).split(self._sizes, dim=-1)
        return tuple(parts[j] for j in self._slot)


def _storage_order(layers: Sequence[nn.Module]) -> list[int] | None:
    """The members' order in the merged matrix (call order where it fits the FP8 block grid,
    else the block-aligned members first), or None when they cannot be fused."""
    first = layers[0]
    if len(layers) < 2 or any(type(m) is not type(first) for m in layers):
        return None
    if any(m.weight.shape[1] != first.weight.shape[1] or m.weight.dtype != first.weight.dtype
           or m.weight.device != first.weight.device for m in layers):
        return None
    if isinstance(first, nn.Linear):
        return None if any(m.bias is not None for m in layers) else list(range(len(layers)))
    if not isinstance(first, fp8.Fp8Linear):
        return None
    if any(m.cols != first.cols or m.rows.offset for m in layers):
        return None
    whole = [i for i, m in enumerate(layers) if m.weight.shape[0] % fp8.BLOCK == 0]
    partial = [i for i in range(len(layers)) if i not in whole]
    return whole + partial if len(partial) <= 1 else None


def fuse(layers: Sequence[nn.Module], whole_blocks: bool = False) -> FusedProjections | None:
    """Merge projections of one input into one matrix; their weights (and FP8 scales) become
    views of it. None, and nothing changed, when the group cannot be fused. `whole_blocks`: an
    FP8 group's rows padded with zeros to a whole scale block (the module's story)."""
    order = _storage_order(layers)
    if order is None:
        return None
    members = [layers[i] for i in order]
    with torch.no_grad():
        parts = [m.weight for m in members]
        rows = sum(w.shape[0] for w in parts)
        if whole_blocks and isinstance(members[0], fp8.Fp8Linear) and rows % fp8.BLOCK:
            parts.append(parts[0].new_zeros(fp8.BLOCK - rows % fp8.BLOCK, parts[0].shape[1]))
        weight = torch.cat(parts)  # [Σ n_i (+ padding), K]
        with torch.device("meta"):  # shapes only: the storage is the merged one
            merged = (fp8.Fp8Linear(weight.shape[1], weight.shape[0])
                      if isinstance(members[0], fp8.Fp8Linear)
                      else nn.Linear(weight.shape[1], weight.shape[0], bias=False))
        merged.weight = nn.Parameter(weight, requires_grad=False)
        if isinstance(merged, fp8.Fp8Linear):
            merged.weight_scale_inv = nn.Parameter(
                torch.cat([m.weight_scale_inv for m in members]), requires_grad=False)
            merged.cols = members[0].cols
        starts, at, block_at = {}, 0, 0
        for i, m in zip(order, members, strict=True):
            n = m.weight.shape[0]
            m.weight.data = weight[at : at + n]
            if isinstance(m, fp8.Fp8Linear):
                nb = m.weight_scale_inv.shape[0]
                m.weight_scale_inv.data = merged.weight_scale_inv.data[block_at : block_at + nb]
                block_at += nb
            starts[i] = (at, at + n)
            at += n
    return FusedProjections(merged, [starts[i] for i in range(len(layers))])


def fuse_model(model: nn.Module) -> int:
    """Fuse every group of projections that read one input (model/dsa.py's `fuse_projections`
    on each module that has it); returns how many groups were merged."""
    return sum(m.fuse_projections() for m in model.modules() if hasattr(m, "fuse_projections"))
