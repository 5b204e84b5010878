"""How the routed experts held on this rank are computed, without the host seeing the routing.

Three formulations of the same sum `out[t] = Σ_j w[t, j] · expert_{ids[t, j]}(x[t])`:

* **grouped** (CUDA, bf16, `torch._grouped_mm` present): the (token, choice) pairs sorted by
  expert, one grouped GEMM per projection over contiguous groups whose ends are computed on the
  device; no host sync, one launch per projection whatever the routing (decode-sized groups:
  the Triton kernel, `triton_grouped`; larger ones: torch._grouped_mm).
* **dense** (small batches elsewhere): every held expert on every token, weighted by a
  [N, E] matrix that is zero off the chosen experts; no host sync, E× the FLOPs, which a decode
  batch on the CPU can afford.
* **looped** (large batches elsewhere: prefill): the sorted pairs, one GEMM per expert that
  received tokens; the per-expert counts are read on the host (one sync per layer, in prefill).

Pairs routed to experts held on another rank (EP) are dropped (weight 0); each path adds the
experts' contributions in fp32 in an order fixed by the routing (dense and looped: ascending
expert; grouped: per token, the router's choice order, without atomics), so a batch gives the
same bits every run. Experts kept in FP8 (model/fp8.py) take
the same three paths: grouped through the FP8 grouped kernel (kernels/triton/fp8_linear.py) where
their blocks line up with the gate/up halves (at 17–64 rows per expert in W8A8 for bf16 / fp16:
kernels/triton/fp8_w8a8.py), else every expert dequantized first; dense and looped through each
expert's dequantized matrices.

    pairs (t, j) flattened:  p = t·k + j          expert e(p) = ids[t, j] − first
    sorted by e (stable):    order [P]            group ends: ends[e] = #pairs with expert ≤ e
    rows of group e:         order[ends[e−1] : ends[e]]
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dsaserve.kernels.registry import use_kernels
from dsaserve.model.fp8 import Fp8Experts

# Either form of the stacked experts: (w13 [E, 2I, H], w2 [E, H, I]) or their FP8 form.
ExpertWeights = tuple[torch.Tensor, torch.Tensor] | Fp8Experts

# Dense path up to this many (token × held expert) products: decode batches, not prefill.
DENSE_MAX_TOKEN_EXPERTS = 4096


def grouped_mm_available(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm runs bf16 on CUDA (sm90+); dims must be multiples of 16 bytes. w: the
    stacked w13, bf16 or float8_e4m3fn (dequantized first or through the FP8 kernel)."""
    return (x.is_cuda and x.dtype == torch.bfloat16
            and w.dtype in (torch.bfloat16, torch.float8_e4m3fn)
            and hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(x.device)[0] >= 9
            and x.shape[-1] % 8 == 0 and w.shape[1] % 8 == 0)


def _sort_pairs(ids: torch.Tensor, first: int, count: int, held_all: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [N, k] → (the pairs' order by local expert [P], group ends [count] int64)."""
    local = ids.flatten() if held_all else (ids - first).flatten()  # [P]
    if not held_all:
        local = torch.where((local >= 0) & (local < count), local, count)
    order = local.argsort(stable=True)  # [P]
    ends = torch.searchsorted(local[order], torch.arange(count, device=ids.device), right=True)
    return order, ends


def sorted_pairs(ids: torch.Tensor, weights: torch.Tensor, first: int, count: int,
                 held_all: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids/weights [N, k] → (token of each sorted pair [P], its weight [P] fp32, group ends
    [count] int32): pairs sorted by local expert, all on the device. Pairs of experts held
    elsewhere sort last, past ends[-1], in no group; held_all (first = 0 and this rank holds
    every expert: no EP) says there are none, and skips the ops that find them."""
    order, ends = _sort_pairs(ids, first, count, held_all)
    w = weights.flatten()
    w = w if w.dtype == torch.float32 else w.float()
    return order // ids.shape[1], w[order], ends.to(torch.int32)


def pair_positions(order: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The sorted pairs' order [P] → where each token's pairs sit in it, [N, k] (shape) int64:
    the inverse permutation, what the combine reads."""
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv.view(shape)


def combine_reference(y: torch.Tensor, pos: torch.Tensor, w: torch.Tensor,
                      limit: torch.Tensor | None = None,
                      shared: torch.Tensor | None = None) -> torch.Tensor:
    """y [P, H] (sorted pair rows), pos [N, k] (pair_positions), w [N, k] fp32, limit [1] or
    None → [N, H] fp32: out[t] = Σ_j w[t, j] · y[pos[t, j]] over the j with pos[t, j] < limit
    (rows past it belong to experts held elsewhere and were never written), added in fp32 in
    ascending j (the router's choice order); with `shared` (the shared experts' output [N, H]),
    plus it, cast to its dtype. kernels/triton/moe_combine.py runs the same on the GPU."""
    out = torch.zeros(pos.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
    for j in range(pos.shape[1]):
        p = pos[:, j]
        term = w[:, j, None] * y[p].float()
        out += term if limit is None else torch.where((p < limit)[:, None], term, 0.0)
    return _plus(out, shared)


def _plus(out: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """The routed experts' fp32 sum, or with the shared experts' output added, in its dtype."""
    return out if shared is None else (out + shared.float()).to(shared.dtype)


def pair_layout(ids: torch.Tensor, first: int, count: int, held_all: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [N, k] → what the grouped paths read: the token of each pair in expert order [P],
    each pair's place in that order [N, k] (pair_positions), the group ends [count] int32 (the
    grouped GEMMs' offsets). Decode batches on the GPU: one launch
    (kernels/triton/moe_pairs.py); otherwise PyTorch's sort."""
    if use_kernels(ids):
        from dsaserve.kernels.triton import moe_pairs

        if ids.numel() <= moe_pairs.MAX_PAIRS:
            return moe_pairs.moe_pairs(ids, first, count)
    return pair_layout_reference(ids, first, count, held_all)


def pair_layout_reference(ids: torch.Tensor, first: int, count: int, held_all: bool
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pair_layout through PyTorch's stable sort (prefill batches; moe_pairs's contract)."""
    order, ends = _sort_pairs(ids, first, count, held_all)
    return order // ids.shape[1], pair_positions(order, ids.shape), ends.to(torch.int32)


def combine(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor,
            held_all: bool, shared: torch.Tensor | None = None) -> torch.Tensor:
    """The grouped paths' output rows y [P, H] back to their tokens, weighted: [N, H] fp32, or
    plus `shared` in its dtype (the Triton kernel on the GPU, its reference elsewhere).
    Deterministic: no atomics."""
    w = weights if weights.dtype == torch.float32 else weights.float()
    limit = None if held_all else ends[-1:]
    if use_kernels(y):
        from dsaserve.kernels.triton import moe_combine

        return moe_combine.moe_combine(y, pos, w, limit, shared)
    return combine_reference(y, pos, w, limit, shared)


# bf16 experts take the Triton grouped kernel (kernels/triton/fp8_linear.grouped_linear) up to
# this many pairs per held expert on average: decode, where torch._grouped_mm (CUTLASS) streams
# the experts' weights at 46–69 % of the copy rate; larger groups (prefill chunks) keep
# CUTLASS. benchmarks/moe_grouped.py on an H100 (docs/decode.md), w13 with its activation + w2
# over 8 experts: 1.37× CUTLASS at 0.25 rows per expert, 1.24× at 1, 1.16× at 16 (b = 64 of the
# GLM-5.3-shaped model, top 2 of 8), 1.04× at 64 (its MTP3 verify); above 64 not measured.
TRITON_GROUPED_MAX_MEAN_ROWS = 64


# FP8 experts take W8A8 (kernels/triton/fp8_w8a8.w8a8_grouped: activations quantized per row
# and 128 columns, FP8 tensor cores) above this many pairs per held expert on average, up to
# TRITON_GROUPED_MAX_MEAN_ROWS: the weight-only FP8 kernel streams the experts at 68–78 % of
# the copy rate at 16 rows per expert but 41–44 % at 64, where its in-kernel dequantization and
# bf16 MMAs bound it (benchmarks/moe_grouped.py, an H100, docs/decode.md: the MTP3 verify of
# b = 64 over 8 experts, top 2).
W8A8_GROUPED_MIN_MEAN_ROWS = 16


def w8a8_experts(num_pairs: int, num_experts: int, dtype: torch.dtype) -> bool:
    """Whether P sorted pairs over E held FP8 experts take W8A8 (host sizes only)."""
    return (dtype != torch.float32 and num_pairs > W8A8_GROUPED_MIN_MEAN_ROWS * max(1, num_experts)
            and triton_grouped(num_pairs, num_experts))


def triton_grouped(num_pairs: int, num_experts: int) -> bool:
    """Whether P sorted pairs over E held bf16 experts take the Triton grouped kernel rather
    than torch._grouped_mm: mean rows per expert ≤ TRITON_GROUPED_MAX_MEAN_ROWS. Host-known
    sizes only (a CUDA graph of a batch size always takes the same kernel)."""
    return num_pairs <= TRITON_GROUPED_MAX_MEAN_ROWS * max(1, num_experts)


def held_pairs(num_pairs: int, held: int, num_experts: int | None) -> int:
    """The pairs of a batch's P = N·k that this rank's `held` experts take, from host sizes
    alone: all of them without EP (num_experts None: unknown, or every expert here), else
    their share under even routing, P · held / num_experts (EP8 at b = 64, top 8 of 256: 64
    of 512 pairs, 2 per held expert; counting all 512 over the 32 held reads 16, 8× too many,
    and at b = 512 sends the batch to CUTLASS). The grouped kernels still take every pair
    (those held elsewhere sort past the last group and are skipped); this only picks the
    kernel and its tiles."""
    if num_experts is None or num_experts <= held:
        return num_pairs
    return -(-num_pairs * held // num_experts)


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor, first: int, held_all: bool = False,
                    shared: torch.Tensor | None = None, num_experts: int | None = None
                    ) -> torch.Tensor:
    """x [N, H], w13 [E, 2I, H], w2 [E, H, I] → [N, H] fp32 through two grouped GEMMs (plus
    `shared`, in its dtype, when given): at decode sizes on CUDA the Triton kernel (silu(gate)
    · up fused into the first), else torch._grouped_mm. num_experts: the model's routed
    experts, when known (under EP the pairs these E take are estimated from it: held_pairs)."""
    token_of, pos, offs = pair_layout(ids, first, w13.shape[0], held_all)
    xs = x[token_of]  # [P, H]
    held = held_pairs(xs.shape[0], w13.shape[0], num_experts)
    if (x.is_cuda and triton_grouped(held, w13.shape[0]) and w13.is_contiguous()
            and w2.is_contiguous()):
        from dsaserve.kernels.triton import fp8_linear

        # the tiles follow the rows per held expert and the weight bytes: one config for both
        cfg = fp8_linear.choose_grouped_config(held, w2.shape[2], x.shape[1], w13.shape[0], 2)
        act = fp8_linear.grouped_linear(xs, w13, offs, glu=True, config=cfg)  # [P, I]
        y = fp8_linear.grouped_linear(act, w2, offs, config=cfg)  # [P, H]
        return combine(y, pos, weights, offs, held_all, shared)
    gate, up = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)  # [P, H]
    return combine(y, pos, weights, offs, held_all, shared)


def grouped_fp8_experts(x: torch.Tensor, experts: Fp8Experts, ids: torch.Tensor,
                        weights: torch.Tensor, first: int, held_all: bool = False,
                        shared: torch.Tensor | None = None, num_experts: int | None = None
                        ) -> torch.Tensor:
    """grouped_experts on FP8 experts: the FP8 grouped kernel reads one byte per weight. Experts
    whose gate/up halves do not start on a block (I not a multiple of 128, or a TP shard
    starting inside one: tiny models) are dequantized first and take the bf16 path."""
    if not experts.aligned:
        w13, w2 = experts.dequantized(x.dtype)
        return grouped_experts(x, w13, w2, ids, weights, first, held_all, shared, num_experts)
    from dsaserve.kernels.triton import fp8_linear

    e = experts.num_experts
    token_of, pos, offs = pair_layout(ids, first, e, held_all)
    held = held_pairs(token_of.shape[0], e, num_experts)
    w13, s13 = experts.w13, experts.s13
    if w8a8_experts(held, e, x.dtype):
        from dsaserve.kernels.triton import fp8_w8a8

        # each row quantized once, then its bytes gathered per pair (the quantization is per
        # row: the same bytes as quantizing the gathered rows, a third of the gather's bytes)
        xq, xsc = fp8_w8a8.act_quant(x.contiguous())  # [N, H] e4m3, [N, Hb]
        xq = xq.view(torch.uint8)[token_of].view(xq.dtype)  # [P, H]
        h13 = fp8_w8a8.w8a8_grouped(xq, xsc[token_of], w13, s13, offs, x.dtype)  # [P, 2I]
        act = fp8_w8a8.act_quant(h13, glu=True)  # silu(gate) · up quantized: [P, I], [P, Ib]
        y = fp8_w8a8.w8a8_grouped(*act, experts.w2, experts.s2, offs, x.dtype)  # [P, H]
        return combine(y, pos, weights, offs, held_all, shared)
    xs = x[token_of]  # [P, H]
    # the tiles follow the rows per held expert (one config for all three products)
    cfg = fp8_linear.choose_grouped_config(held, experts.w2.shape[2], x.shape[1], e)
    if triton_grouped(held, e):
        # decode sizes: silu(gate) · up fused into the first projection (its tiles are 16 rows,
        # so two accumulators fit; prefill tiles of 128 × 128 would not, and keep the split)
        act = fp8_linear.fp8_grouped(xs, w13, s13, offs, config=cfg, glu=True)  # [P, I]
    else:
        gate, up = fp8_linear.fp8_grouped(xs, w13, s13, offs, config=cfg).chunk(2, dim=-1)
        act = (F.silu(gate) * up).contiguous()  # [P, I]
    y = fp8_linear.fp8_grouped(act, experts.w2, experts.s2, offs, config=cfg)  # [P, H]
    return combine(y, pos, weights, offs, held_all, shared)


def _per_expert(experts: ExpertWeights, dtype: torch.dtype
                ) -> tuple[int, Callable[[int], torch.Tensor], Callable[[int], torch.Tensor]]:
    """(count, expert e's w13 [2I, H], expert e's w2 [H, I]) in dtype, either form."""
    if isinstance(experts, Fp8Experts):
        return (experts.num_experts, lambda e: experts.gate_up(e, dtype),
                lambda e: experts.down(e, dtype))
    w13, w2 = experts
    return w13.shape[0], w13.__getitem__, w2.__getitem__


def dense_experts(x: torch.Tensor, experts: ExpertWeights, ids: torch.Tensor,
                  weights: torch.Tensor, first: int) -> torch.Tensor:
    """Every held expert on every token; the unchosen ones weighted 0."""
    count, w13, w2 = _per_expert(experts, x.dtype)
    local = ids - first  # [N, k]
    held = (local >= 0) & (local < count)
    mix = torch.zeros(x.shape[0], count + 1, dtype=torch.float32, device=x.device)  # [N, E+1]
    # experts held elsewhere land in the spare column E, which is never read
    mix.scatter_add_(1, torch.where(held, local, count), weights.float())
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(count):  # ascending expert order, as the looped path adds them
        gate, up = F.linear(x, w13(e)).chunk(2, dim=-1)
        out += F.linear(F.silu(gate) * up, w2(e)).float() * mix[:, e, None]
    return out


def looped_experts(x: torch.Tensor, experts: ExpertWeights, ids: torch.Tensor,
                   weights: torch.Tensor, first: int) -> torch.Tensor:
    """One GEMM per expert that received tokens; reads the group ends on the host."""
    count, w13, w2 = _per_expert(experts, x.dtype)
    token_of, w_sorted, ends = sorted_pairs(ids, weights, first, count)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    for expert, end in enumerate(ends.tolist()):  # the one host read (prefill)
        if end == start:
            continue
        tok = token_of[start:end]
        gate, up = F.linear(x[tok], w13(expert)).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2(expert))
        out.index_add_(0, tok, y.float() * w_sorted[start:end, None])
        start = end
    return out


def routed_experts(x: torch.Tensor, experts: ExpertWeights, ids: torch.Tensor,
                   weights: torch.Tensor, first: int, num_experts: int | None = None,
                   shared: torch.Tensor | None = None) -> torch.Tensor:
    """The formulation for this batch (chosen from host-known shapes, never from routing):
    [N, H] fp32, or plus `shared` (the shared experts' output [N, H]) in its dtype: the
    grouped path adds it in its combine's one pass. num_experts: the model's routed experts,
    when known (this rank holding all of them skips the grouped path's masking of experts held
    elsewhere)."""
    fp8 = isinstance(experts, Fp8Experts)
    w13 = experts.w13 if fp8 else experts[0]
    if grouped_mm_available(x, w13):
        held_all = first == 0 and w13.shape[0] == num_experts
        if fp8:
            return grouped_fp8_experts(x, experts, ids, weights, first, held_all, shared,
                                       num_experts)
        return grouped_experts(x, *experts, ids, weights, first, held_all, shared, num_experts)
    if x.shape[0] * w13.shape[0] <= DENSE_MAX_TOKEN_EXPERTS:
        return _plus(dense_experts(x, experts, ids, weights, first), shared)
    return _plus(looped_experts(x, experts, ids, weights, first), shared)
