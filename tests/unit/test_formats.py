"""Byte formats of the KV caches: fp8_ds_mla rows and FP8 indexer pages, byte for byte."""

from __future__ import annotations

import struct

import pytest
import torch

from dsaserve.kernels import formats as F

L, R, D = 512, 64, 128

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _e4m3_byte(x: float) -> int:
    return int(torch.tensor([x], dtype=torch.float8_e4m3fn).view(torch.uint8)[0])


def _f32_bytes(x: float) -> list[int]:
    return list(struct.pack("<f", x))


def _bf16_bytes(x: float) -> list[int]:
    """Little-endian bf16 of an exactly representable x: the high half of its fp32 bytes."""
    return list(struct.pack("<f", x)[2:4])


def _row_bound(c: torch.Tensor, scale_per_elem: torch.Tensor) -> torch.Tensor:
    """Max |dequant − c| for e4m3 RNE of c/scale: 2^-4 relative in the normal range (3 mantissa
    bits), half a subnormal step (2^-10) of the scaled value below it."""
    return torch.maximum(c.abs() * 2.0**-4, scale_per_elem * 2.0**-10)


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------
def test_row_and_page_sizes() -> None:
    assert F.mla_row_bytes() == 656 == F.mla_row_bytes(512, 64)
    assert F.mla_row_bytes(128, 0) == 132
    assert F.mla_row_bytes(256, 32) == 256 + 8 + 64
    assert F.index_token_bytes() == 132
    assert F.index_page_bytes(64) == 64 * 132
    assert F.mla_cache_shape(3, 64, True) == (3, 64, 656)
    assert F.mla_cache_shape(3, 64, False) == (3, 64, 576)
    assert F.index_cache_shape(3, 64, True) == (3, 64 * 132)
    assert F.index_cache_shape(3, 64, False) == (3, 64, 128)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        F.mla_row_bytes(500, 64)
    with pytest.raises(ValueError, match="rope_dim"):
        F.mla_row_bytes(512, -1)


def test_known_e4m3_bytes() -> None:
    """The conversion the formats rely on: hand-derived e4m3 encodings (bias 7, 3 mantissa bits),
    round-to-nearest-even at the halfway points."""
    assert _e4m3_byte(1.0) == 0x38
    assert _e4m3_byte(448.0) == 0x7E
    assert _e4m3_byte(-2.0) == 0xC0
    assert _e4m3_byte(0.5) == 0x30
    assert _e4m3_byte(1.0625) == 0x38  # halfway 1.0 / 1.125 → even mantissa 000
    assert _e4m3_byte(1.1875) == 0x3A  # halfway 1.125 / 1.25 → even mantissa 010


# --------------------------------------------------------------------------------------------
# Scales
# --------------------------------------------------------------------------------------------
def test_scale_rules_are_exact_powers_of_two() -> None:
    amax = torch.tensor([0.0, 448.0, 896.0, 0.3 * 448, 1e6, 1e-9, 448.0 * (1 + 2**-20)])
    mla = F.mla_tile_scale(amax)
    # MLA: 2^ceil(log2(max(amax/448, 1e-4))); log2(1e-4) = -13.29 → floor scale 2^-13.
    assert mla.tolist() == [2.0**-13, 1.0, 2.0, 0.5, 4096.0, 2.0**-13, 2.0]
    idx = F.index_scale(torch.tensor([0.0, 112.0, 448.0, 449.0, 1e-7]))
    # Indexer: 2^ceil(log2(max(amax, 1e-4)/448)); 1e-4/448 = 2.23e-7 → 2^-22.
    assert idx.tolist() == [2.0**-22, 0.25, 1.0, 2.0, 2.0**-22]
    # Random amax over 40 octaves: a power of two, and the smallest one ≥ the raw scale.
    g = torch.Generator().manual_seed(0)
    amax = torch.exp2(torch.empty(4000).uniform_(-20, 20, generator=g))
    for scale, raw in ((F.mla_tile_scale(amax), (amax / 448).clamp_min(1e-4)),
                       (F.index_scale(amax), amax.clamp_min(1e-4) / 448)):
        mantissa, _ = torch.frexp(scale)
        assert torch.all(mantissa == 0.5)
        assert torch.all(scale >= raw) and torch.all(scale / 2 < raw)


# --------------------------------------------------------------------------------------------
# fp8_ds_mla rows
# --------------------------------------------------------------------------------------------
def test_mla_row_bytes_by_hand() -> None:
    """One row with values chosen so every byte is known: scales 1, 2, 0.5, 2^-13 (zero tile)."""
    c = torch.zeros(1, L)
    c[0, 0], c[0, 1], c[0, 2], c[0, 3], c[0, 127] = 448.0, 1.0, -2.0, 1.0625, 1.1875  # scale 1
    c[0, 128], c[0, 129] = 896.0, 1.0  # amax 896 → scale 2
    c[0, 256], c[0, 300] = 0.3 * 448, 0.25  # amax 134.4 → 0.3 → scale 0.5
    k_pe = torch.zeros(1, R)
    k_pe[0, 0], k_pe[0, 1], k_pe[0, 63] = 1.0, -2.0, 0.5
    row = F.quantize_mla_rows(c, k_pe)[0].tolist()
    assert len(row) == 656

    expected = [0] * 656
    expected[0:4] = [0x7E, 0x38, 0xC0, 0x38]
    expected[127] = 0x3A
    expected[128], expected[129] = 0x7E, 0x30  # 896/2 = 448, 1/2 = 0.5
    expected[256] = _e4m3_byte(0.3 * 448 / 0.5)  # 268.8 → 256 (e4m3 step 32 there)
    assert expected[256] == _e4m3_byte(256.0)
    expected[300] = _e4m3_byte(0.5)
    expected[512:528] = _f32_bytes(1.0) + _f32_bytes(2.0) + _f32_bytes(0.5) + _f32_bytes(2.0**-13)
    expected[528:530] = _bf16_bytes(1.0)
    expected[530:532] = _bf16_bytes(-2.0)
    expected[528 + 2 * 63 : 656] = _bf16_bytes(0.5)
    assert expected[528:530] == [0x80, 0x3F]  # bf16 1.0 = 0x3F80
    assert row == expected

    back = F.dequantize_mla_rows(torch.tensor([row], dtype=torch.uint8))[0]
    assert back[:4].tolist() == [448.0, 1.0, -2.0, 1.0]
    assert back[127].item() == 1.25
    assert back[256].item() == 128.0 and back[300].item() == 0.25
    assert back[L:].tolist() == k_pe[0].tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_mla_round_trip_within_e4m3_error(device: str) -> None:
    g = torch.Generator().manual_seed(0)
    n = 24
    # Row magnitudes spread over 2^-30 .. 2^30, so both the 1e-4 floor and huge scales occur.
    mag = torch.exp2(torch.linspace(-30, 30, n)).unsqueeze(1)
    c = torch.randn(n, L, generator=g) * mag
    c[3] = 0.0  # a zero row
    c[5, 200:256] = 0.0  # a partly zero tile
    k_pe = torch.randn(n, R, generator=g) * 3
    rows = F.quantize_mla_rows(c.to(device), k_pe.to(device))
    assert rows.dtype == torch.uint8 and rows.shape == (n, 656)
    back = F.dequantize_mla_rows(rows).cpu()
    assert back.shape == (n, L + R) and back.dtype == torch.float32

    scales = rows[:, L:528].cpu().contiguous().view(torch.float32)  # [n, 4]
    assert torch.equal(scales, F.mla_tile_scale(c.reshape(n, 4, 128).abs().amax(-1)))
    per_elem = scales.repeat_interleave(128, dim=1)  # [n, L]
    assert torch.all((back[:, :L] - c).abs() <= _row_bound(c, per_elem))
    assert torch.equal(back[3, :L], torch.zeros(L))
    assert torch.equal(back[:, L:], k_pe.to(torch.bfloat16).float())
    # Same bytes from bf16 inputs that hold the same values.
    c16 = c.to(torch.bfloat16)
    assert torch.equal(F.quantize_mla_rows(c16, k_pe), F.quantize_mla_rows(c16.float(), k_pe))


def test_mla_rows_bad_shapes_name_the_tensor() -> None:
    with pytest.raises(ValueError, match="k_pe"):
        F.quantize_mla_rows(torch.zeros(2, L), torch.zeros(3, R))
    with pytest.raises(ValueError, match="rows"):
        F.dequantize_mla_rows(torch.zeros(2, 655, dtype=torch.uint8))


# --------------------------------------------------------------------------------------------
# MLA cache
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_fp8_mla_cache_writes_only_its_rows(device: str) -> None:
    g = torch.Generator().manual_seed(1)
    num_blocks, block_size = 3, 4
    cache = torch.randint(0, 256, (num_blocks, block_size, 656), generator=g, dtype=torch.uint8)
    before = cache.clone()
    cache = cache.to(device)
    slots = torch.tensor([5, -1, 0, 11, 7])
    c = torch.randn(5, L, generator=g)
    k_pe = torch.randn(5, R, generator=g)
    F.write_mla_cache(cache, slots.to(device), c.to(device), k_pe.to(device))
    cache = cache.cpu()

    rows = F.quantize_mla_rows(c, k_pe)
    expected = before.clone().view(-1, 656)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            expected[s] = rows[i]
    assert torch.equal(cache.view(-1, 656), expected)  # untouched rows keep their bytes

    read_slots = torch.tensor([[7, -1, 5], [0, 11, -1]])
    got = F.read_mla_cache(cache.to(device), read_slots.to(device)).cpu()
    assert got.shape == (2, 3, L + R) and got.dtype == torch.float32
    want = F.dequantize_mla_rows(rows)
    assert torch.equal(got[0, 0], want[4]) and torch.equal(got[0, 2], want[0])
    assert torch.equal(got[1, 0], want[2]) and torch.equal(got[1, 1], want[3])
    assert torch.equal(got[0, 1], torch.zeros(L + R)) and torch.equal(got[1, 2], torch.zeros(L + R))


def test_fp8_mla_cache_minus_one_reads_zero_even_over_nan_bytes() -> None:
    cache = torch.full((1, 2, 656), 0x7F, dtype=torch.uint8)  # 0x7F is e4m3 NaN; scale bytes NaN
    got = F.read_mla_cache(cache, torch.tensor([-1, -1]))
    assert torch.equal(got, torch.zeros(2, L + R))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_mla_cache_round_trip(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    cache = torch.zeros(2, 8, L + R, dtype=dtype)
    slots = torch.tensor([9, 3, -1, 15])
    c, k_pe = torch.randn(4, L, generator=g), torch.randn(4, R, generator=g)
    F.write_mla_cache(cache, slots, c, k_pe)
    got = F.read_mla_cache(cache, torch.tensor([3, 15, 9, -1, 0]))
    full = torch.cat((c, k_pe), dim=1).to(dtype).float()
    assert torch.equal(got[:3], full[[1, 3, 0]])
    assert torch.equal(got[3:], torch.zeros(2, L + R))  # −1, and slot 0 never written
    assert torch.count_nonzero(cache.view(-1, L + R).abs().sum(1)) == 3


def test_mla_cache_errors_name_the_argument() -> None:
    c, k_pe = torch.zeros(2, L), torch.zeros(2, R)
    with pytest.raises(ValueError, match="cache rows are 600 wide"):
        F.write_mla_cache(torch.zeros(1, 4, 600, dtype=torch.uint8), torch.tensor([0, 1]), c, k_pe)
    with pytest.raises(ValueError, match="slots must be"):
        F.write_mla_cache(torch.zeros(1, 4, 656, dtype=torch.uint8), torch.tensor([0]), c, k_pe)
    with pytest.raises(ValueError, match="slot 4 is outside"):
        F.write_mla_cache(torch.zeros(1, 4, 576), torch.tensor([0, 4]), c, k_pe)
    with pytest.raises(ValueError, match="expected L\\+R = 576"):
        F.read_mla_cache(torch.zeros(1, 4, 500), torch.tensor([0]))


# --------------------------------------------------------------------------------------------
# Indexer quantization and pages
# --------------------------------------------------------------------------------------------
def test_index_page_bytes_by_hand() -> None:
    """Page layout: value (o, d) at page_base + o·D + d, scale at page_base + bs·D + 4·o."""
    num_blocks, block_size = 2, 4
    page = F.index_page_bytes(block_size)
    cache = torch.zeros(num_blocks, page, dtype=torch.uint8)
    k = torch.zeros(2, D)
    k[0, 0], k[0, 1], k[0, 127] = 112.0, -0.5, 0.25  # amax 112 → scale 0.25
    k[1, 5] = 448.0  # scale 1
    slots = torch.tensor([1 * block_size + 2, 0 * block_size + 3])  # (block 1, o 2), (block 0, o 3)
    F.write_index_cache(cache, slots, k)

    flat = cache.view(-1).tolist()
    expected = [0] * (num_blocks * page)
    base = 1 * page
    expected[base + 2 * D + 0] = _e4m3_byte(448.0)  # 112 / 0.25
    expected[base + 2 * D + 1] = _e4m3_byte(-2.0)
    expected[base + 2 * D + 127] = _e4m3_byte(1.0)
    scale_at = base + block_size * D + 4 * 2
    expected[scale_at : scale_at + 4] = _f32_bytes(0.25)
    expected[0 * page + 3 * D + 5] = _e4m3_byte(448.0)
    scale_at = 0 * page + block_size * D + 4 * 3
    expected[scale_at : scale_at + 4] = _f32_bytes(1.0)
    assert flat == expected

    values, scales = F.read_index_cache(cache, torch.tensor([[6, -1], [3, 0]]))
    assert values.dtype == torch.float8_e4m3fn and values.shape == (2, 2, D)
    assert scales.tolist() == [[0.25, 0.0], [1.0, 0.0]]
    keys = F.dequantize_index(values, scales)
    assert torch.equal(keys[0, 0], k[0]) and torch.equal(keys[1, 0], k[1])
    assert torch.equal(keys[0, 1], torch.zeros(D)) and torch.equal(keys[1, 1], torch.zeros(D))


@pytest.mark.parametrize("device", DEVICES)
def test_index_cache_round_trip_and_untouched_bytes(device: str) -> None:
    g = torch.Generator().manual_seed(3)
    num_blocks, block_size, n = 3, 8, 10
    cache = torch.randint(0, 256, (num_blocks, F.index_page_bytes(block_size)), generator=g,
                          dtype=torch.uint8)
    before = cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    slots[4] = -1
    k = torch.randn(n, D, generator=g) * torch.exp2(torch.linspace(-12, 12, n)).unsqueeze(1)
    cache = cache.to(device)
    F.write_index_cache(cache, slots.to(device), k.to(device))
    values, scales = F.read_index_cache(cache, slots.to(device))
    back = F.dequantize_index(values, scales).cpu()

    k8, s = F.quantize_index_k(k)
    assert torch.equal(scales.cpu()[slots >= 0], s[slots >= 0])
    assert torch.equal(values.cpu().view(torch.uint8)[slots >= 0],
                       k8.view(torch.uint8)[slots >= 0])
    bound = _row_bound(k, s.unsqueeze(1).expand_as(k))
    ok = slots >= 0
    assert torch.all((back[ok] - k[ok]).abs() <= bound[ok])
    assert torch.equal(back[4], torch.zeros(D)) and scales[4].item() == 0.0

    # Bytes of tokens not written are unchanged: rebuild the expected pages by hand.
    expected = before.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, block_size)
        expected[b, o * D : (o + 1) * D] = k8[i].view(torch.uint8)
        at = block_size * D + 4 * o
        expected[b, at : at + 4] = torch.tensor(_f32_bytes(s[i].item()), dtype=torch.uint8)
    assert torch.equal(cache.cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_index_cache_round_trip(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    cache = torch.zeros(2, 4, D, dtype=dtype)
    k = torch.randn(3, D, generator=g)
    F.write_index_cache(cache, torch.tensor([7, -1, 2]), k)
    keys, scales = F.read_index_cache(cache, torch.tensor([2, 7, -1, 0]))
    assert scales is None and keys.dtype == torch.float32
    want = k.to(dtype).float()
    assert torch.equal(keys[0], want[2]) and torch.equal(keys[1], want[0])
    assert torch.equal(keys[2:], torch.zeros(2, D))


def test_quantize_index_q_is_per_token_head() -> None:
    g = torch.Generator().manual_seed(5)
    q = torch.randn(5, 3, D, generator=g) * torch.exp2(torch.randint(-8, 8, (5, 3, 1),
                                                                     generator=g).float())
    q8, qs = F.quantize_index_q(q.to(torch.bfloat16))
    assert q8.shape == (5, 3, D) and qs.shape == (5, 3) and q8.dtype == torch.float8_e4m3fn
    k8, ks = F.quantize_index_k(q.to(torch.bfloat16).reshape(15, D))
    assert torch.equal(q8.view(torch.uint8).reshape(15, D), k8.view(torch.uint8))
    assert torch.equal(qs.reshape(15), ks)
    assert torch.equal(qs, F.index_scale(q.to(torch.bfloat16).float().abs().amax(-1)))


def test_index_cache_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="whole number of 132-byte"):
        F.write_index_cache(torch.zeros(2, 500, dtype=torch.uint8), torch.tensor([0]),
                            torch.zeros(1, D))
    with pytest.raises(ValueError, match="float cache must be"):
        F.read_index_cache(torch.zeros(2, 4, 64), torch.tensor([0]))
    with pytest.raises(ValueError, match="scales"):
        F.dequantize_index(torch.zeros(2, D).to(torch.float8_e4m3fn), torch.zeros(3))
    with pytest.raises(ValueError, match="integer"):
        F.read_index_cache(torch.zeros(2, 4, D), torch.tensor([0.0]))
