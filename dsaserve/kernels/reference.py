"""Reference kernels in plain PyTorch: sparse MLA (absorbed/MQA form), indexer logits, top-k.

These are the oracle the GPU kernels are tested against, and the "reference" backend on any device.
Everything is computed in fp32 (inputs may be fp32 or bf16; FP8 is upcast before any arithmetic)
and processed in chunks of query tokens so that gathered rows never exceed a fixed element budget.
Formulas: MODEL_SPEC §2.3 (absorbed MLA), §2.4 (indexer), §2.5 (sparse attention).
"""

from __future__ import annotations

import torch

from dsaserve.kernels.formats import read_mla_cache

# Elements (fp32) one chunk may materialise: gathered rows [C, K, D] or indexer scores [C, H, S].
CHUNK_ELEMENTS = 1 << 24  # 64 MiB of fp32


def _chunk_tokens(per_token_elements: int, chunk_tokens: int | None) -> int:
    """Query tokens per chunk: the caller's choice, or as many as fit CHUNK_ELEMENTS (≥ 1)."""
    if chunk_tokens is not None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens: must be >= 1, got {chunk_tokens}")
        return chunk_tokens
    return max(1, CHUNK_ELEMENTS // max(1, per_token_elements))


# --------------------------------------------------------------------------------------------
# Sparse MLA
# --------------------------------------------------------------------------------------------
def _attend(q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, scale: float,
            v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each query over its own K gathered rows.

    q [C, H, D] fp32, rows [C, K, D] fp32, valid [C, K] bool → o [C, H, v_dim], lse [C, H].
    A query with no valid row gets o = 0 and lse = −inf, never NaN.
    """
    logits = torch.einsum("chd,ckd->chk", q, rows) * scale  # [C, H, K]
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [C, H]; −inf when the row is empty
    # Subtracting a finite stand-in for an empty row's −inf keeps exp(−inf − x) = 0, not NaN.
    p = torch.exp(logits - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))  # [C, H, K]
    o = torch.einsum("chk,ckv->chv", p, rows[..., :v_dim])  # [C, H, v_dim]
    return o, lse


def _check_sparse_args(q: torch.Tensor, indices: torch.Tensor, name: str) -> None:
    if q.dim() != 3:
        raise ValueError(f"{name}: q must be [T, H, Dqk], got {tuple(q.shape)}")
    if indices.dim() != 2 or indices.shape[0] != q.shape[0]:
        raise ValueError(
            f"{name}: indices must be [T, K] with T = {q.shape[0]}, got {tuple(indices.shape)}"
        )
    if indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise ValueError(f"{name}: indices must be an integer tensor, got {indices.dtype}")


def sparse_mla_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float,
                   v_dim: int = 512, *,
                   chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention of each query over the kv rows its indices name (FlashMLA sparse prefill).

    q [T, H, Dqk] (Dqk = L + R = 576), kv [S, Dqk] rows, indices [T, K] rows of kv (−1: skip)
    → o [T, H, v_dim] float32 with o = softmax(q·kvᵀ·scale)·kv[:, :v_dim] over the named rows,
      lse [T, H] float32 natural-log sum of exp(logits); no valid index → o = 0, lse = −inf.
    Indices must be distinct within a row (a repeated row would be counted twice).
    """
    _check_sparse_args(q, indices, "sparse_mla_fwd")
    if kv.dim() != 2 or kv.shape[1] != q.shape[2]:
        raise ValueError(
            f"sparse_mla_fwd: kv must be [S, {q.shape[2]}] (q's last dim), got {tuple(kv.shape)}"
        )
    if not 0 < v_dim <= q.shape[2]:
        raise ValueError(f"sparse_mla_fwd: v_dim must be in [1, {q.shape[2]}], got {v_dim}")
    num_tokens, num_heads, _ = q.shape
    o = torch.empty(num_tokens, num_heads, v_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    step = _chunk_tokens(indices.shape[1] * kv.shape[1], chunk_tokens)
    for start in range(0, num_tokens, step):
        idx = indices[start : start + step].long()  # [C, K]
        rows = kv[idx.clamp_min(0)].float()  # [C, K, Dqk]
        o[start : start + step], lse[start : start + step] = _attend(
            q[start : start + step].float(), rows, idx >= 0, scale, v_dim
        )
    return o, lse


def sparse_mla_paged(q: torch.Tensor, kv_cache: torch.Tensor, slot_indices: torch.Tensor,
                     scale: float, kv_lora_rank: int = 512, rope_dim: int = 64, *,
                     chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """sparse_mla_fwd over a paged MLA cache (FlashMLA sparse decode with_kvcache).

    q [T, H, L+R], kv_cache as in formats (float rows or fp8_ds_mla bytes), slot_indices [T, K]
    cache slots (−1: skip) → o [T, H, L] float32, lse [T, H] float32; V is the latent c itself.
    Rows are read (and dequantized) per chunk of query tokens.
    """
    _check_sparse_args(q, slot_indices, "sparse_mla_paged")
    width = kv_lora_rank + rope_dim
    if q.shape[2] != width:
        raise ValueError(
            f"sparse_mla_paged: q's last dim {q.shape[2]} must be L+R = {width}"
        )
    num_tokens, num_heads, _ = q.shape
    o = torch.empty(num_tokens, num_heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device)
    step = _chunk_tokens(slot_indices.shape[1] * width, chunk_tokens)
    for start in range(0, num_tokens, step):
        slots = slot_indices[start : start + step]  # [C, K]
        rows = read_mla_cache(kv_cache, slots, kv_lora_rank, rope_dim)  # [C, K, L+R], −1 → 0
        o[start : start + step], lse[start : start + step] = _attend(
            q[start : start + step].float(), rows, slots >= 0, scale, kv_lora_rank
        )
    return o, lse


# --------------------------------------------------------------------------------------------
# Lightning indexer
# --------------------------------------------------------------------------------------------
def _weighted_relu_scores(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor,
                          chunk_tokens: int | None) -> torch.Tensor:
    """[T, S] = Σ_h weights[t, h] · ReLU(q[t, h] · k[s]), fp32, chunked over T."""
    num_tokens, num_heads, head_dim = q.shape
    if weights.shape != (num_tokens, num_heads):
        raise ValueError(
            f"indexer logits: weights must be [T, H] = [{num_tokens}, {num_heads}], "
            f"got {tuple(weights.shape)}"
        )
    if k.dim() != 2 or k.shape[1] != head_dim:
        raise ValueError(f"indexer logits: k must be [S, {head_dim}], got {tuple(k.shape)}")
    out = torch.empty(num_tokens, k.shape[0], dtype=torch.float32, device=q.device)
    step = _chunk_tokens(num_heads * k.shape[0], chunk_tokens)
    for start in range(0, num_tokens, step):
        dots = torch.einsum("thd,sd->ths", q[start : start + step], k)  # [C, H, S]
        w = weights[start : start + step].float().unsqueeze(-1)  # [C, H, 1]
        out[start : start + step] = (dots.relu() * w).sum(dim=1)
    return out


def indexer_logits(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, *,
                   chunk_tokens: int | None = None) -> torch.Tensor:
    """Indexer scores I[t, s] = Σ_h w[t, h] · ReLU(q[t, h] · k[s]) in fp32 → [T, S].

    q [T, H, D], weights [T, H] (the caller folds softmax_scale · H^-0.5 and any quantization
    scales into them; w is signed), k [S, D]. ReLU is taken per head before weighting.
    """
    if q.dim() != 3:
        raise ValueError(f"indexer_logits: q must be [T, H, D], got {tuple(q.shape)}")
    return _weighted_relu_scores(q.float(), weights, k.float(), chunk_tokens)


def indexer_logits_fp8(q8: torch.Tensor, q_scale: torch.Tensor, weights: torch.Tensor,
                       k8: torch.Tensor, k_scale: torch.Tensor, *,
                       chunk_tokens: int | None = None) -> torch.Tensor:
    """FP8 indexer scores, the DeepGEMM / reference `fp8_index` formula (MODEL_SPEC §2.4 step 7):

        I[t, s] = Σ_h ReLU(q8[t, h] · k8[s]) · (w[t, h] · q_scale[t, h]) · k_scale[s]

    q8 [T, H, D] e4m3, q_scale [T, H] fp32, weights [T, H], k8 [S, D] e4m3, k_scale [S] fp32
    → [T, S] fp32 (e4m3 upcast to fp32, fp32 accumulation). Scales are positive, so this equals
    indexer_logits on the dequantized q and k up to fp32 rounding.
    """
    if q8.dim() != 3 or q_scale.shape != q8.shape[:2]:
        raise ValueError(
            f"indexer_logits_fp8: expected q8 [T, H, D] and q_scale [T, H], "
            f"got {tuple(q8.shape)} and {tuple(q_scale.shape)}"
        )
    if k8.dim() != 2 or k_scale.shape != k8.shape[:1]:
        raise ValueError(
            f"indexer_logits_fp8: expected k8 [S, D] and k_scale [S], "
            f"got {tuple(k8.shape)} and {tuple(k_scale.shape)}"
        )
    folded = weights.float() * q_scale.float()  # [T, H]
    scores = _weighted_relu_scores(q8.float(), folded, k8.float(), chunk_tokens)  # [T, S]
    return scores * k_scale.float().unsqueeze(0)


# --------------------------------------------------------------------------------------------
# Top-k
# --------------------------------------------------------------------------------------------
def topk_causal(logits: torch.Tensor, limits: torch.Tensor, k: int) -> torch.Tensor:
    """Best k eligible keys per query: logits [T, S], limits [T] → [T, k] int32.

    Key s is eligible for query t iff s < limits[t]:

        keys    0 1 2 3 4 5 6 7          limits[t] = 5, k = 8
        t       ✓ ✓ ✓ ✓ ✓ · · ·   →  5 indices by descending score, then −1 −1 −1

    Every eligible key ranks above every ineligible one (an eligible −inf logit is still
    returned), so the first min(max(limits[t], 0), S, k) entries are keys and the rest are −1.
    Tie order among equal scores is unspecified.
    """
    if logits.dim() != 2:
        raise ValueError(f"topk_causal: logits must be [T, S], got {tuple(logits.shape)}")
    if limits.shape != logits.shape[:1]:
        raise ValueError(
            f"topk_causal: limits must be [T] with T = {logits.shape[0]}, "
            f"got {tuple(limits.shape)}"
        )
    if k < 0:
        raise ValueError(f"topk_causal: k must be >= 0, got {k}")
    num_tokens, num_keys = logits.shape
    device = logits.device
    limits = limits.to(device=device, dtype=torch.long)
    eligible = torch.arange(num_keys, device=device).unsqueeze(0) < limits.unsqueeze(1)  # [T, S]
    scores = logits.float().clamp_min(torch.finfo(torch.float32).min)  # eligible −inf → finite
    scores = torch.where(eligible, scores, float("-inf"))
    if num_keys < k:  # torch.topk needs k ≤ S: pad with ineligible columns
        pad = torch.full((num_tokens, k - num_keys), float("-inf"), device=device)
        scores = torch.cat((scores, pad), dim=1)
    idx = torch.topk(scores, k, dim=1, sorted=True).indices  # [T, k]
    num_valid = limits.clamp(0, num_keys)  # [T]
    keep = torch.arange(k, device=device).unsqueeze(0) < num_valid.unsqueeze(1)  # [T, k]
    return torch.where(keep, idx, -1).to(torch.int32)
