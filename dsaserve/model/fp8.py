"""FP8 matrices kept in FP8: block-quantized weights, activations in the model dtype.

DeepSeek-V3.2 and GLM-5.x checkpoints store their matrices as float8_e4m3fn with one fp32 scale
per 128 × 128 block (`X.weight`, `X.weight_scale_inv`; W ≈ Wq · S[r // 128, c // 128]). The
modules here hold both exactly as stored, so the weights take one byte per value in memory (the
real models fit, decode reads half the bytes). Up to 64 rows (decode), and for fp32 activations,
the product uses the weight value dequantized(r, c) = x.dtype(fp32(Wq[r, c]) · S[...]) — the
value dequantizing at load gave, so outputs are unchanged: on CUDA the kernel
(kernels/triton/fp8_linear.py) forms it per tile; elsewhere the reference dequantizes the
matrix, then F.linear (bit-equal to dequantizing at load). Above 64 rows of bf16 / fp16 on CUDA
(prefill, MTP verification of large batches) it is W8A8 (kernels/triton/fp8_w8a8.py): the
activations quantized per row and 128 columns, FP8 tensor cores, as DeepSeek-V3's inference,
vLLM, SGLang and transformers run these checkpoints.

Tensor parallelism keeps a contiguous range of a matrix's rows (or columns), which may start inside
a block; the module keeps the scale blocks that cover its range and where the range starts in the
first of them:

    global rows   r0 ............ r1          one block = 128 rows
    blocks        |  b0  |  ...  |  b_last |   kept: b0 = r0 // 128 .. ⌈r1 / 128⌉
    offset        r0 − 128·b0  (n_off; k_off for columns)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsaserve.kernels import fp8_weights

BLOCK = fp8_weights.FP8_BLOCK


@dataclass(frozen=True)
class BlockRange:
    """The global range [start, stop) of one dimension a module keeps, on a 128-block grid."""

    start: int
    stop: int

    @property
    def offset(self) -> int:
        """Where the range starts inside its first block."""
        return self.start % BLOCK

    @property
    def blocks(self) -> slice:
        """The scale blocks covering the range."""
        return slice(self.start // BLOCK, -(-self.stop // BLOCK))

    @property
    def num_blocks(self) -> int:
        return fp8_weights.num_blocks(self.stop - self.start, self.offset)

    def sub(self, start: int, stop: int) -> BlockRange:
        """The part [start, stop) of this range, in its own coordinates (0 = self.start)."""
        if not 0 <= start <= stop <= self.stop - self.start:
            raise ValueError(f"[{start}, {stop}) outside a range of {self.stop - self.start}")
        return BlockRange(self.start + start, self.start + stop)


def _fp8_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.float8_e4m3fn), requires_grad=False)


def _scale_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)


class Fp8Linear(nn.Module):
    """y = x · Wᵀ with W kept as float8_e4m3fn [out, in] and its block scales
    `weight_scale_inv` [⌈out/128⌉, ⌈in/128⌉] fp32 (fewer blocks, offset, when sharded)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = _fp8_param(n_out, n_in)
        self.weight_scale_inv = _scale_param(-(-n_out // BLOCK), -(-n_in // BLOCK))
        self.rows = BlockRange(0, n_out)
        self.cols = BlockRange(0, n_in)

    def shard_(self, rows: tuple[int, int] | None = None,
               cols: tuple[int, int] | None = None) -> None:
        """Keep rows [start, stop) and/or columns (of the current ranges) only; the scale keeps
        the blocks that cover them. Made on the meta device, before the loader fills both."""
        if rows is not None:
            self.weight.data = self.weight.data[rows[0] : rows[1]].contiguous()
            self.rows = self.rows.sub(*rows)
        if cols is not None:
            self.weight.data = self.weight.data[:, cols[0] : cols[1]].contiguous()
            self.cols = self.cols.sub(*cols)
        self.weight_scale_inv.data = self.weight_scale_inv.data.new_empty(
            self.rows.num_blocks, self.cols.num_blocks)

    def narrow_scale(self, full: torch.Tensor) -> torch.Tensor:
        """The checkpoint's whole scale [⌈out/128⌉, ⌈in/128⌉] → the blocks this module keeps."""
        rows, _ = fp8_weights.shard_scale(full, 0, self.rows.start, self.rows.stop)
        return fp8_weights.shard_scale(rows, 1, self.cols.start, self.cols.stop)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)  # [M, in]
        if x2.is_cuda:
            from dsaserve.kernels.triton import fp8_linear

            y = fp8_linear.fp8_linear(x2.contiguous(), self.weight, self.weight_scale_inv,
                                      self.rows.offset, self.cols.offset)
        else:
            y = fp8_weights.linear_reference(x2, self.weight, self.weight_scale_inv,
                                             self.rows.offset, self.cols.offset)
        return y.view(*lead, y.shape[-1])

    def forward_glu(self, h: torch.Tensor) -> torch.Tensor:
        """This projection of silu(gate) · up, h [..., 2·in] = [gate | up] (an MLP's fused
        gate and up): on CUDA the activation is formed while quantized where the product is
        W8A8 (fp8_linear.fp8_glu_linear, rounded as the unfused ops round)."""
        lead = h.shape[:-1]
        h2 = h.reshape(-1, h.shape[-1])  # [M, 2·in]
        if h2.is_cuda:
            from dsaserve.kernels.triton import fp8_linear

            y = fp8_linear.fp8_glu_linear(h2.contiguous(), self.weight, self.weight_scale_inv,
                                          self.rows.offset, self.cols.offset)
            return y.view(*lead, y.shape[-1])
        gate, up = h.chunk(2, dim=-1)
        return self(torch.nn.functional.silu(gate) * up)

    def extra_repr(self) -> str:
        return (f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, fp8 128x128 blocks, "
                f"rows {self.rows.start}:{self.rows.stop}, cols {self.cols.start}:{self.cols.stop}")


def linear(n_in: int, n_out: int, fp8: bool) -> nn.Module:
    """A bias-free projection: FP8-kept when the checkpoint stores it in FP8, else nn.Linear."""
    if fp8:
        return Fp8Linear(n_in, n_out)
    layer = nn.Linear(n_in, n_out, bias=False)
    layer.weight.requires_grad_(False)
    return layer


def shard_linear(layer: nn.Module, rows: tuple[int, int] | None = None,
                 cols: tuple[int, int] | None = None) -> None:
    """Keep rows and/or columns [start, stop) of either kind of projection."""
    if isinstance(layer, Fp8Linear):
        layer.shard_(rows, cols)
        return
    w = layer.weight
    view = w.data if rows is None else w.data[rows[0] : rows[1]]
    view = view if cols is None else view[:, cols[0] : cols[1]]
    w.data = view.contiguous().clone()


@dataclass(frozen=True)
class Fp8Experts:
    """The FP8 form of stacked routed experts, as moe_compute reads it: w13 [E, 2I, H] (gate
    rows, then up rows) and w2 [E, H, I] in float8_e4m3fn; scales s13 [E, 2·Ib, Hb] (gate's Ib
    block rows, then up's) and s2 [E, Hb, Ib]; `inter`, the intermediate range kept (TP: a part
    of the model's, offset in its first block)."""

    w13: torch.Tensor
    w2: torch.Tensor
    s13: torch.Tensor
    s2: torch.Tensor
    inter: BlockRange

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def aligned(self) -> bool:
        """Whether w13 is one block grid: the gate/up halves start on a block (I a multiple of
        128, no offset), so one grouped product covers both."""
        size = self.inter.stop - self.inter.start
        return self.inter.offset == 0 and size % BLOCK == 0

    def gate_up(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's [2I, H] in dtype (each half dequantized on its own block grid)."""
        i, ib, off = self.w2.shape[2], self.s13.shape[1] // 2, self.inter.offset
        gate = fp8_weights.dequantize(self.w13[e, :i], self.s13[e, :ib], dtype, off, 0)
        up = fp8_weights.dequantize(self.w13[e, i:], self.s13[e, ib:], dtype, off, 0)
        return torch.cat((gate, up))

    def down(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's [H, I] in dtype."""
        return fp8_weights.dequantize(self.w2[e], self.s2[e], dtype, 0, self.inter.offset)

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every expert in dtype: (w13, w2) as the bf16 path holds them."""
        e = self.num_experts
        return (torch.stack([self.gate_up(j, dtype) for j in range(e)]),
                torch.stack([self.down(j, dtype) for j in range(e)]))
