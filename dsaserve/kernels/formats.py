"""KV cache byte formats: FlashMLA's `fp8_ds_mla` rows and DeepGEMM's FP8 indexer-key pages.

Two caches per layer, each either "auto" (plain float rows in the model dtype) or FP8 bytes:

    MLA cache      auto: [num_blocks, block_size, L + R] float
                   fp8:  [num_blocks, block_size, mla_row_bytes(L, R)] uint8   (656 B for 512/64)
    indexer cache  auto: [num_blocks, block_size, D] float
                   fp8:  [num_blocks, block_size * (D + 4)] uint8              (132 B/token, D=128)

The cache kind is told by `cache.dtype == torch.uint8`; nothing else is stored beside it. A slot is
`block * block_size + offset`; slot −1 means "this rank does not own the token": writes skip it and
reads return zeros. Every access is vectorised index arithmetic on byte views; multi-byte fields
are little-endian (the byte order of every CUDA and x86 host). FP8 is only ever converted, never
computed with, because CPU torch has no e4m3 arithmetic. Layout and scale rules: MODEL_SPEC §4.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
MLA_TILE = 128  # latent values sharing one fp32 scale in an fp8_ds_mla row
MLA_MIN_SCALE = 1e-4  # floor on amax/448 before power-of-two rounding (FlashMLA ue8m0 rule)
INDEX_MIN_AMAX = 1e-4  # floor on amax before /448 and power-of-two rounding (DeepSeek act_quant)
_SCALE_BYTES = 4  # one fp32 scale


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------
def mla_row_bytes(kv_lora_rank: int = 512, rope_dim: int = 64) -> int:
    """Bytes of one fp8_ds_mla token row: L e4m3 + 4 per 128-tile fp32 scales + 2·R bf16."""
    _check_mla_dims(kv_lora_rank, rope_dim)
    return kv_lora_rank + _SCALE_BYTES * (kv_lora_rank // MLA_TILE) + 2 * rope_dim


def index_token_bytes(head_dim: int = 128) -> int:
    """Bytes one token takes in an FP8 indexer page: D e4m3 values + one fp32 scale."""
    return head_dim + _SCALE_BYTES


def index_page_bytes(block_size: int, head_dim: int = 128) -> int:
    """Bytes of one FP8 indexer page (`block_size` tokens)."""
    return block_size * index_token_bytes(head_dim)


def mla_cache_shape(num_blocks: int, block_size: int, fp8: bool, kv_lora_rank: int = 512,
                    rope_dim: int = 64) -> tuple[int, int, int]:
    """Shape of an MLA cache of either kind (see the module docstring)."""
    width = mla_row_bytes(kv_lora_rank, rope_dim) if fp8 else kv_lora_rank + rope_dim
    return (num_blocks, block_size, width)


def index_cache_shape(num_blocks: int, block_size: int, fp8: bool,
                      head_dim: int = 128) -> tuple[int, ...]:
    """Shape of an indexer-key cache of either kind (see the module docstring)."""
    if fp8:
        return (num_blocks, index_page_bytes(block_size, head_dim))
    return (num_blocks, block_size, head_dim)


def _check_mla_dims(kv_lora_rank: int, rope_dim: int) -> None:
    if kv_lora_rank <= 0 or kv_lora_rank % MLA_TILE:
        raise ValueError(
            f"kv_lora_rank: fp8_ds_mla needs a positive multiple of {MLA_TILE}, got {kv_lora_rank}"
        )
    if rope_dim < 0:
        raise ValueError(f"rope_dim: must be >= 0, got {rope_dim}")


# --------------------------------------------------------------------------------------------
# Power-of-two ("ue8m0") scales and e4m3 conversion
# --------------------------------------------------------------------------------------------
def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(x)) for positive finite fp32 x, exact (from the float's exponent, not log2).

    frexp gives x = m·2^e with m in [0.5, 1); x is a power of two iff m == 0.5, and then
    ceil(log2 x) = e − 1, otherwise it is e.
    """
    mantissa, exponent = torch.frexp(x.float())
    exponent = exponent.to(torch.int32) - (mantissa == 0.5).to(torch.int32)
    # Build the float from its bits (biased exponent, zero mantissa): exact on every device.
    return ((exponent.clamp(-126, 127) + 127) << 23).view(torch.float32)


def mla_tile_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp8_ds_mla scale of a 128-tile: 2^ceil(log2(max(amax/448, 1e-4))) (MODEL_SPEC §4.1)."""
    return pow2_ceil(torch.clamp_min(amax.float() / FP8_MAX, MLA_MIN_SCALE))


def index_scale(amax: torch.Tensor) -> torch.Tensor:
    """Indexer q/k scale: 2^ceil(log2(max(amax, 1e-4)/448)) (MODEL_SPEC §2.4 step 5, §4.2)."""
    return pow2_ceil(torch.clamp_min(amax.float(), INDEX_MIN_AMAX) / FP8_MAX)


def _to_e4m3(scaled: torch.Tensor) -> torch.Tensor:
    """Saturating round-to-nearest-even cast; the clamp matters because torch maps |x| > 448 to
    NaN instead of saturating."""
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _quantize_last_dim(x: torch.Tensor, scale_rule: Callable[[torch.Tensor], torch.Tensor],
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per vector along the last dim: x [..., D] → (e4m3 [..., D], fp32 scale [...])."""
    x = x.float()
    scale = scale_rule(x.abs().amax(dim=-1))  # [...]
    return _to_e4m3(x / scale.unsqueeze(-1)), scale


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """[..., n] of a k-byte dtype → [..., n·k] uint8 (native = little-endian order)."""
    return x.contiguous().view(torch.uint8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., n·k] uint8 → [..., n] of a k-byte dtype; copies first so any alignment works."""
    return b.contiguous().view(dtype)


# --------------------------------------------------------------------------------------------
# fp8_ds_mla rows
# --------------------------------------------------------------------------------------------
def quantize_mla_rows(c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """Pack latent c [N, L] and RoPE key k_pe [N, R] into fp8_ds_mla rows [N, row_bytes] uint8.

    One token row (L = 512, R = 64 → 656 bytes):

        byte 0          L=512        L+4·L/128=528                 528+2·R=656
        | e4m3 c[0:512]  | fp32 s0 s1 s2 s3 | bf16 k_pe[0:64] (order as given) |
          tile j = c[128j : 128j+128] is stored as e4m3(clamp(c / s_j, ±448)), RNE
          s_j = 2^ceil(log2(max(amax_j / 448, 1e-4)))   (power of two, stored as fp32)

    k_pe is kept verbatim in bf16 (interleaved RoPE pairs stay interleaved: no reordering here).
    """
    if c.dim() != 2 or k_pe.dim() != 2 or c.shape[0] != k_pe.shape[0]:
        raise ValueError(
            f"quantize_mla_rows: expected c [N, L] and k_pe [N, R] with the same N, "
            f"got c {tuple(c.shape)} and k_pe {tuple(k_pe.shape)}"
        )
    n, lora = c.shape
    rope = k_pe.shape[1]
    _check_mla_dims(lora, rope)
    tiles = lora // MLA_TILE
    # values [N, T, 128] e4m3, scales [N, T] fp32 (T = L/128 tiles)
    values, scales = _quantize_last_dim(c.reshape(n, tiles, MLA_TILE), mla_tile_scale)
    return torch.cat(
        (
            values.view(torch.uint8).reshape(n, lora),  # [N, L]
            _as_bytes(scales),  # [N, 4·T]
            _as_bytes(k_pe.to(torch.bfloat16)),  # [N, 2·R]
        ),
        dim=1,
    )  # [N, row_bytes]


def dequantize_mla_rows(rows: torch.Tensor, kv_lora_rank: int = 512,
                        rope_dim: int = 64) -> torch.Tensor:
    """fp8_ds_mla rows [..., row_bytes] uint8 → [..., L + R] float32 (c = e4m3 · s_tile, k_pe)."""
    row_bytes = mla_row_bytes(kv_lora_rank, rope_dim)
    if rows.dtype != torch.uint8 or rows.shape[-1] != row_bytes:
        raise ValueError(
            f"dequantize_mla_rows: rows must be uint8 [..., {row_bytes}] for L={kv_lora_rank}, "
            f"R={rope_dim}, got {rows.dtype} {tuple(rows.shape)}"
        )
    lead = rows.shape[:-1]
    tiles = kv_lora_rank // MLA_TILE
    scale_end = kv_lora_rank + _SCALE_BYTES * tiles
    values = rows[..., :kv_lora_rank].view(torch.float8_e4m3fn).float()  # [..., L]
    scales = _from_bytes(rows[..., kv_lora_rank:scale_end], torch.float32)  # [..., T]
    c = (values.reshape(*lead, tiles, MLA_TILE) * scales.unsqueeze(-1)).reshape(*lead, -1)
    k_pe = _from_bytes(rows[..., scale_end:], torch.bfloat16).float()  # [..., R]
    return torch.cat((c, k_pe), dim=-1)


# --------------------------------------------------------------------------------------------
# Indexer q/k quantization
# --------------------------------------------------------------------------------------------
def quantize_index_k(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer keys k [N, D] → (e4m3 [N, D], fp32 scale [N]): one power-of-two scale per token."""
    if k.dim() != 2:
        raise ValueError(f"quantize_index_k: expected k [N, D], got {tuple(k.shape)}")
    return _quantize_last_dim(k, index_scale)


def quantize_index_q(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer queries q [T, H, D] → (e4m3 [T, H, D], fp32 scale [T, H]): one power-of-two scale
    per (token, head), the same rule as the keys (block = 128 = one head)."""
    if q.dim() != 3:
        raise ValueError(f"quantize_index_q: expected q [T, H, D], got {tuple(q.shape)}")
    return _quantize_last_dim(q, index_scale)


def dequantize_index(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3 values [..., D] and fp32 scales [...] → float32 [..., D]."""
    if values.shape[:-1] != scales.shape:
        raise ValueError(
            f"dequantize_index: scales {tuple(scales.shape)} must match values "
            f"{tuple(values.shape)} without its last dim"
        )
    return values.float() * scales.float().unsqueeze(-1)


# --------------------------------------------------------------------------------------------
# Slots
# --------------------------------------------------------------------------------------------
def split_slots(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """slot → (block, offset) with slot = block·block_size + offset; −1 slots map to (0, 0), so
    callers must mask them (reads) or drop them (writes)."""
    safe = slots.long().clamp_min(0)
    return safe // block_size, safe % block_size


def _valid_write_rows(slots: torch.Tensor, n: int, num_slots: int,
                      name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a write batch that have a slot, and those slots. Syncs with the device (the masked
    select); the reference writer accepts that, the Triton writer does not need it."""
    if slots.dim() != 1 or slots.shape[0] != n:
        raise ValueError(f"{name}: slots must be [N] with N = {n} rows, got {tuple(slots.shape)}")
    if slots.dtype.is_floating_point or slots.dtype == torch.bool:
        raise ValueError(f"{name}: slots must be an integer tensor, got {slots.dtype}")
    rows = torch.nonzero(slots >= 0).squeeze(1)  # [n_valid]
    valid = slots[rows].long()
    if valid.numel() and int(valid.max()) >= num_slots:
        raise ValueError(
            f"{name}: slot {int(valid.max())} is outside the cache ({num_slots} slots)"
        )
    return rows, valid


def _check_read_slots(slots: torch.Tensor, name: str) -> None:
    if slots.dtype.is_floating_point or slots.dtype == torch.bool:
        raise ValueError(f"{name}: slots must be an integer tensor, got {slots.dtype}")


# --------------------------------------------------------------------------------------------
# MLA cache
# --------------------------------------------------------------------------------------------
def write_mla_cache(cache: torch.Tensor, slots: torch.Tensor, c: torch.Tensor,
                    k_pe: torch.Tensor) -> None:
    """Store c [N, L] and k_pe [N, R] at slots [N] (−1: skip; valid slots must be distinct).

    uint8 caches get fp8_ds_mla rows (quantized here); float caches get [c | k_pe] in their dtype.
    Only the bytes of the written rows change.
    """
    if cache.dim() != 3:
        raise ValueError(f"write_mla_cache: cache must be 3-D, got {tuple(cache.shape)}")
    if c.dim() != 2 or k_pe.dim() != 2 or c.shape[0] != k_pe.shape[0]:
        raise ValueError(
            f"write_mla_cache: expected c [N, L] and k_pe [N, R], "
            f"got c {tuple(c.shape)} and k_pe {tuple(k_pe.shape)}"
        )
    num_blocks, block_size, width = cache.shape
    if cache.dtype == torch.uint8:
        expected = mla_row_bytes(c.shape[1], k_pe.shape[1])
    elif cache.dtype.is_floating_point:
        expected = c.shape[1] + k_pe.shape[1]
    else:
        raise ValueError(f"write_mla_cache: cache dtype must be uint8 or float, got {cache.dtype}")
    if width != expected:
        raise ValueError(
            f"write_mla_cache: cache rows are {width} wide but c/k_pe of widths "
            f"{c.shape[1]}/{k_pe.shape[1]} need {expected} ({cache.dtype})"
        )
    rows, valid = _valid_write_rows(slots, c.shape[0], num_blocks * block_size, "write_mla_cache")
    if cache.dtype == torch.uint8:
        data = quantize_mla_rows(c[rows], k_pe[rows])  # [n_valid, row_bytes]
    else:
        data = torch.cat((c[rows], k_pe[rows]), dim=1).to(cache.dtype)  # [n_valid, L+R]
    block, offset = split_slots(valid, block_size)
    cache[block, offset] = data.to(cache.device)


def read_mla_cache(cache: torch.Tensor, slots: torch.Tensor, kv_lora_rank: int = 512,
                   rope_dim: int = 64) -> torch.Tensor:
    """Rows at slots [...] (any shape; −1 → zeros) → [..., L + R] float32, dequantized for uint8.

    Does not sync with the device; a slot past the cache end is an indexing error.
    """
    _check_read_slots(slots, "read_mla_cache")
    if cache.dim() != 3:
        raise ValueError(f"read_mla_cache: cache must be 3-D, got {tuple(cache.shape)}")
    block_size = cache.shape[1]
    block, offset = split_slots(slots, block_size)
    gathered = cache[block, offset]  # [..., width]
    if cache.dtype == torch.uint8:
        rows = dequantize_mla_rows(gathered, kv_lora_rank, rope_dim)
    elif cache.shape[2] == kv_lora_rank + rope_dim:
        rows = gathered.float()
    else:
        raise ValueError(
            f"read_mla_cache: float cache rows are {cache.shape[2]} wide, "
            f"expected L+R = {kv_lora_rank + rope_dim}"
        )
    # Gathered −1 rows are slot 0's bytes (possibly NaN patterns): select, don't multiply.
    return torch.where((slots >= 0).unsqueeze(-1), rows, 0.0)


# --------------------------------------------------------------------------------------------
# Indexer-key cache
# --------------------------------------------------------------------------------------------
def _index_page_views(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split uint8 pages [num_blocks, block_size·(D+4)] into byte views (no copy):

        page b:  | token 0: D e4m3 | token 1: D e4m3 | ... | s_0 (4 B) | s_1 | ... | s_{bs-1} |
                 0                                    bs·D                              bs·(D+4)
        value (o, d) at page_base + o·D + d;  scale of token o at page_base + bs·D + 4·o

    → (values [num_blocks, bs, D] uint8, scales [num_blocks, bs, 4] uint8).
    """
    if cache.dim() != 2:
        raise ValueError(
            f"index cache: a uint8 cache must be [num_blocks, block_size*(D+4)], "
            f"got {tuple(cache.shape)}"
        )
    num_blocks, page = cache.shape
    token_bytes = index_token_bytes(head_dim)
    if page % token_bytes:
        raise ValueError(
            f"index cache: page of {page} bytes is not a whole number of {token_bytes}-byte "
            f"tokens (head_dim={head_dim})"
        )
    block_size = page // token_bytes
    values = cache[:, : block_size * head_dim].view(num_blocks, block_size, head_dim)
    scales = cache[:, block_size * head_dim :].view(num_blocks, block_size, _SCALE_BYTES)
    return values, scales


def write_index_cache(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor) -> None:
    """Store indexer keys k [N, D] at slots [N] (−1: skip; valid slots must be distinct).

    uint8 caches get e4m3 values plus one fp32 scale per token in the page layout above.
    """
    if k.dim() != 2:
        raise ValueError(f"write_index_cache: expected k [N, D], got {tuple(k.shape)}")
    head_dim = k.shape[1]
    if cache.dtype == torch.uint8:
        values, scales = _index_page_views(cache, head_dim)
        num_blocks, block_size = values.shape[:2]
    elif cache.dtype.is_floating_point:
        if cache.dim() != 3 or cache.shape[2] != head_dim:
            raise ValueError(
                f"write_index_cache: float cache must be [num_blocks, block_size, {head_dim}], "
                f"got {tuple(cache.shape)}"
            )
        num_blocks, block_size = cache.shape[:2]
    else:
        raise ValueError(
            f"write_index_cache: cache dtype must be uint8 or float, got {cache.dtype}"
        )
    rows, valid = _valid_write_rows(slots, k.shape[0], num_blocks * block_size,
                                    "write_index_cache")
    block, offset = split_slots(valid, block_size)
    if cache.dtype == torch.uint8:
        k8, s = quantize_index_k(k[rows])  # [n_valid, D], [n_valid]
        values[block, offset] = k8.view(torch.uint8).to(cache.device)
        scales[block, offset] = _as_bytes(s.unsqueeze(-1)).to(cache.device)  # [n_valid, 4]
    else:
        cache[block, offset] = k[rows].to(device=cache.device, dtype=cache.dtype)


def read_index_cache(cache: torch.Tensor, slots: torch.Tensor,
                     head_dim: int = 128) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Keys at slots [...] (any shape; −1 → zero key, scale 0).

    float cache → (keys [..., D] float32, None);
    uint8 cache → (e4m3 values [..., D], fp32 scales [...]), left quantized for the FP8 logits.
    """
    _check_read_slots(slots, "read_index_cache")
    valid = slots >= 0  # [...]
    if cache.dtype == torch.uint8:
        values, scales = _index_page_views(cache, head_dim)
        block, offset = split_slots(slots, values.shape[1])
        v = torch.where(valid.unsqueeze(-1), values[block, offset], 0)  # [..., D] uint8
        s = torch.where(valid.unsqueeze(-1), scales[block, offset], 0)  # [..., 4] uint8
        return v.view(torch.float8_e4m3fn), _from_bytes(s, torch.float32).squeeze(-1)
    if cache.dim() != 3 or cache.shape[2] != head_dim:
        raise ValueError(
            f"read_index_cache: float cache must be [num_blocks, block_size, {head_dim}], "
            f"got {tuple(cache.shape)}"
        )
    block, offset = split_slots(slots, cache.shape[1])
    return torch.where(valid.unsqueeze(-1), cache[block, offset].float(), 0.0), None
