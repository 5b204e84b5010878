"""Exact top-k of long score rows without sorting them: a threshold, then a short list.

The indexer's logits rows are as long as the context (128K keys and more) and k is 2,048. A
general top-k (torch.topk) makes several radix passes over every full row and sorts the result;
this module reads each row once more than the logits kernel writes it, and never sorts. The
logits kernel also writes the maximum of every GROUP consecutive keys, and three kernels follow:

    _threshold_kernel  (a program per row)
        τ = the k-th largest of the row's group maxima. At least k groups have a maximum ≥ τ,
        each holds a key ≥ τ, so count(x ≥ τ) ≥ k: the top k keys all score ≥ τ. (A row of at
        most NA keys is searched directly instead, so τ is its exact k-th score.)
    _compact_kernel    (a program per row segment)
        keys scoring ≥ τ go to the row's list of C slots, claimed by atomics on a per-row
        count. Mostly that is k plus a few: a group whose maximum clears τ rarely has a second
        key that does.
    _finish_kernel     (a program per row)
        the exact k best of the list, written in list order. If more than C keys cleared τ
        (clustered or tied scores), the row's k-th score is first found by a radix select
        over the whole row (4 histogram passes) and the list rebuilt with exactly k keys.

List entries are int64 (score key << 32 | inverted key index), so they are distinct, ties go to
the smaller key index, and the result does not depend on the order atomics filled the list. The
k-th largest of an array is found bit by bit over order-preserving integer keys of the floats:
up to 32 counting passes over registers, no sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 8  # keys per group maximum written by the logits kernel
INT_MIN = tl.constexpr(-(2**31))


@triton.jit
def _sortable(x):
    """fp32 → int32 with the same order (−0.0 just below +0.0); an involution on negatives."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _unsortable(key):
    """Inverse of _sortable."""
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _kth_largest_key(keys, K, BITS: tl.constexpr = 32):
    """The K-th largest of an int32 tensor (K ≤ its size): the largest v with count(keys ≥ v)
    ≥ K, decided from the sign bit down. With BITS < 32 only the top BITS bits are decided: the
    result is ≤ the K-th largest, within 2^(32 − BITS) of it (count(keys ≥ result) ≥ K holds).
    (Two bits per step, three counts packed into one int64 reduction, measured slower on an
    H200: 595 vs 427 µs for the threshold of [4096, 128K].)"""
    prefix = tl.where(tl.sum((keys >= 0).to(tl.int32)) >= K, 0, INT_MIN)
    for bit in tl.static_range(30, 31 - BITS, -1):
        cand = prefix | (1 << bit)
        prefix = tl.where(tl.sum((keys >= cand).to(tl.int32)) >= K, cand, prefix)
    return prefix


@triton.jit
def _list_key(key, j):
    """(score key, key index) → one int64, larger = better score, then smaller index: the list
    entries sort the same whatever order they were written in (deterministic ties)."""
    return (key.to(tl.int64) << 32) | (0x7FFFFFFF - j.to(tl.int64))


@triton.jit
def _kth_largest_in_row(row_ptr, limit, K, BLOCK: tl.constexpr):
    """The K-th largest sortable key of row[:limit] (K ≤ limit), by a radix select over the
    key's four bytes, most significant first: one 256-bin histogram pass over the row per
    byte (4 passes, where a bit-by-bit search would take 32)."""
    prefix = tl.full([], 0, tl.uint32)  # the bytes decided so far (key with its sign flipped)
    remaining = K  # rank of the wanted key among the keys that share those bytes
    b = tl.arange(0, 256)
    for d in tl.static_range(4):  # the byte at bits 24 − 8d … 31 − 8d
        hist = tl.zeros([256], tl.int32)
        for start in range(0, limit, BLOCK):
            j = start + tl.arange(0, BLOCK)
            v = tl.load(row_ptr + j, mask=j < limit, other=float("-inf"))
            u = (_sortable(v) ^ INT_MIN).to(tl.uint32, bitcast=True)  # unsigned, same order
            ok = j < limit
            if d > 0:
                ok = ok & ((u >> (32 - 8 * d)) == (prefix >> (32 - 8 * d)))
            hist += tl.histogram(((u >> (24 - 8 * d)) & 0xFF).to(tl.int32), 256, mask=ok)
        above = tl.sum(hist) - tl.cumsum(hist, axis=0)  # [256] keys in higher bins
        byte = tl.max(tl.where((above < remaining) & (above + hist >= remaining), b, -1))
        remaining -= tl.sum(tl.where(b == byte, above, 0))
        prefix = prefix | (byte.to(tl.uint32) << (24 - 8 * d))
    return prefix.to(tl.int32, bitcast=True) ^ INT_MIN


@triton.jit
def _threshold_kernel(
    logits_ptr,  # [T, S] fp32, −inf past each row's limit
    gmax_ptr,  # [T, ceil(S / GROUP)] fp32: max of each GROUP consecutive keys
    limit_ptr,  # [T] int32: keys j < limit are visible
    tau_ptr,  # [T] int32 out: the threshold's sortable key
    count_ptr,  # [T] int32 out: zeroed here, counted by _compact_kernel
    stride_l, stride_g,
    K: tl.constexpr, GROUP: tl.constexpr, NA: tl.constexpr,
):
    """τ = the K-th largest of the row (≤ NA keys) or of its group maxima, merged r at a time so
    that at most NA remain (NA ≥ GROUP·K, so a row longer than NA keeps ≥ K of them)."""
    row = tl.program_id(0).to(tl.int64)
    limit = tl.load(limit_ptr + row)
    a = tl.arange(0, NA)
    if limit <= NA:
        x = tl.load(logits_ptr + row * stride_l + a, mask=a < limit, other=float("-inf"))
    else:
        num_groups = tl.cdiv(limit, GROUP)
        r = tl.cdiv(num_groups, NA)
        x = tl.full([NA], float("-inf"), tl.float32)
        for i in range(r):
            g = a * r + i
            x = tl.maximum(x, tl.load(gmax_ptr + row * stride_g + g, mask=g < num_groups,
                                      other=float("-inf")))
    # 20 bits (sign, exponent, 11 mantissa bits) of the K-th key: τ may sit up to 2^-11
    # relative below it, which admits a few more keys to the list for 12 fewer passes.
    tl.store(tau_ptr + row, _kth_largest_key(_sortable(x), K, 20))
    tl.store(count_ptr + row, 0)


@triton.jit
def _compact_kernel(
    logits_ptr, limit_ptr, tau_ptr,
    count_ptr,  # [T] int32: list entries claimed so far (may pass C: overflow)
    list_ptr,  # [T, C] int64 out: _list_key of the keys scoring ≥ τ
    stride_l, stride_c,
    C: tl.constexpr, SEG: tl.constexpr, SLOT_PER_KEY: tl.constexpr,
):
    """One segment of SEG keys of one row: its keys ≥ τ go to the row's list (list order is
    arbitrary; _list_key makes it irrelevant). Slots are claimed with one atomic add per
    segment and a prefix sum, or (SLOT_PER_KEY) one atomic per kept key: a few percent of the
    keys are kept, and the prefix sum over all of them is what this kernel spends most on."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * SEG + tl.arange(0, SEG)
    limit = tl.load(limit_ptr + row)
    if tl.program_id(1) * SEG >= limit:
        return
    key = _sortable(tl.load(logits_ptr + row * stride_l + j, mask=j < limit,
                            other=float("-inf")))
    keep = (key >= tl.load(tau_ptr + row)) & (j < limit)
    # Relaxed atomics: only the count itself must be atomic; the list is read by a later kernel.
    if SLOT_PER_KEY:
        pos = tl.atomic_add(count_ptr + row + tl.zeros_like(j), 1, mask=keep, sem="relaxed")
    else:
        n = tl.sum(keep.to(tl.int32))
        if n == 0:
            return
        base = tl.atomic_add(count_ptr + row, n, sem="relaxed")
        pos = base + tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(list_ptr + row * stride_c + pos, _list_key(key, j), mask=keep & (pos < C))


@triton.jit
def _finish_kernel(
    logits_ptr, limit_ptr, count_ptr,
    list_ptr,  # [T, C] int64: count[t] entries (more than C: overflow)
    val_ptr, idx_ptr,  # [T, K] fp32 / int64 or int32 out
    stride_l, stride_c, stride_o,
    K: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr,
):
    """The row's K best list entries → (score, key index), in list order, then (−inf, −1).

    A row whose keys ≥ τ overflowed the list (clustered or tied scores) is redone exactly
    first: its K-th score by a radix select over the whole row (4 histogram passes), then every
    key above it and the first ties, K entries."""
    row = tl.program_id(0).to(tl.int64)
    limit = tl.load(limit_ptr + row)
    count = tl.load(count_ptr + row)
    logits = logits_ptr + row * stride_l
    entries = list_ptr + row * stride_c
    if count > C:
        prefix = _kth_largest_in_row(logits, limit, K, BLOCK)
        count = 0
        for tie in tl.static_range(2):  # 0: keys above the K-th score; 1: keys equal to it
            for start in range(0, limit, BLOCK):
                j = start + tl.arange(0, BLOCK)
                key = _sortable(tl.load(logits + j, mask=j < limit, other=float("-inf")))
                keep = (key > prefix) if tie == 0 else (key == prefix)
                keep = keep & (j < limit)
                pos = count + tl.cumsum(keep.to(tl.int32), axis=0) - 1
                keep = keep & (pos < K)
                tl.store(entries + pos, _list_key(key, j), mask=keep)
                count += tl.sum(keep.to(tl.int32))
        tl.debug_barrier()  # the list is read back below by other threads
    # The K best entries: every score above the K-th score, then as many of the ties at it as
    # fit, smallest key index first (a second search, over the ties' index bits, only when
    # there are more ties than room: rare).
    p = tl.arange(0, C)
    live = p < count
    entry = tl.load(entries + p, mask=live, other=0)
    score = tl.where(live, (entry >> 32).to(tl.int32), INT_MIN)
    inv_index = (entry & 0x7FFFFFFF).to(tl.int32)  # 0x7FFFFFFF − index, ≥ 0 for live entries
    kth = _kth_largest_key(score, K)
    above = live & (score > kth)
    tie = live & (score == kth)
    n = tl.minimum(count, K)
    room = n - tl.sum(above.to(tl.int32))
    if tl.sum(tie.to(tl.int32)) > room:
        tie = tie & (inv_index >= _kth_largest_key(tl.where(tie, inv_index, -1), room))
    keep = above | tie
    pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(val_ptr + row * stride_o + pos, _unsortable(score), mask=keep)
    index = 0x7FFFFFFF - inv_index.to(tl.int64)
    tl.store(idx_ptr + row * stride_o + pos, index.to(idx_ptr.dtype.element_ty), mask=keep)
    for start in range(n // BLOCK * BLOCK, K, BLOCK):
        q = start + tl.arange(0, BLOCK)
        pad = (q >= n) & (q < K)
        tl.store(val_ptr + row * stride_o + q, tl.full([BLOCK], float("-inf"), tl.float32),
                 mask=pad)
        tl.store(idx_ptr + row * stride_o + q, tl.full([BLOCK], -1, idx_ptr.dtype.element_ty),
                 mask=pad)


def list_size(k: int) -> int:
    """Default C: room for 2k keys scoring ≥ τ before a row takes the exact (slow) search."""
    return triton.next_power_of_2(2 * k)


def topk_rows(logits: torch.Tensor, group_max: torch.Tensor, limits: torch.Tensor, k: int, *,
              list_len: int | None = None, segment: int | None = None, block: int = 1024,
              slot_per_key: bool | None = None, index_dtype: torch.dtype = torch.int64,
              threshold_warps: int | None = None, finish_warps: int | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of each row's visible prefix, in no particular order.

    logits [T, S] fp32 (−inf at j ≥ limits[t]), group_max [T, ceil(S / GROUP)] (max over keys
    GROUP·g … GROUP·g + GROUP − 1), limits [T] (int32 or int64) → (values [T, k] fp32, indices
    [T, k] of index_dtype, int64 or int32):
    min(k, limits[t]) chosen keys first, then (−inf, −1). Among equal scores the smaller key
    index wins, so the chosen set does not depend on thread timing.
    """
    num_rows, seq = logits.shape
    if group_max.shape != (num_rows, triton.cdiv(seq, GROUP)):
        raise ValueError(f"topk_rows: group_max must be [{num_rows}, {triton.cdiv(seq, GROUP)}], "
                         f"got {tuple(group_max.shape)}")
    if not 0 < k <= seq:
        raise ValueError(f"topk_rows: k={k} must be in [1, {seq}]")
    list_len = list_len or list_size(k)
    if list_len < k or list_len & (list_len - 1):
        raise ValueError(f"topk_rows: list_len {list_len} must be a power of two >= k = {k}")
    device = logits.device
    values = torch.empty(num_rows, k, dtype=torch.float32, device=device)
    if index_dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_rows: index_dtype must be int32 or int64, got {index_dtype}")
    if limits.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_rows: limits must be int32 or int64, got {limits.dtype}")
    indices = torch.empty(num_rows, k, dtype=index_dtype, device=device)
    if num_rows == 0:
        return values, indices
    # Measured on an H200 (docs/kernels.md): per-key slots win with many rows (4096 rows × 128K:
    # 1.74 vs 2.45 ms for the whole top-k) and lose with few, whose counters the atomics then
    # queue on (64 rows × 64K: 97 vs 46 µs).
    # Finish warps, same source: 4 with many rows (1726 vs 1827 µs), 8 with few (47 vs 59 µs).
    if slot_per_key is None:
        slot_per_key = num_rows >= 1024
    segment = segment or (1024 if slot_per_key else 2048)
    tau = torch.empty(num_rows, dtype=torch.int32, device=device)
    count = torch.empty(num_rows, dtype=torch.int32, device=device)
    lists = torch.empty(num_rows, list_len, dtype=torch.int64, device=device)
    na = max(triton.next_power_of_2(GROUP * k), 1024)
    _threshold_kernel[(num_rows,)](
        logits, group_max, limits, tau, count, logits.stride(0), group_max.stride(0),
        K=k, GROUP=GROUP, NA=na, num_warps=threshold_warps or (16 if na >= 16384 else 4),
    )
    _compact_kernel[(num_rows, triton.cdiv(seq, segment))](
        logits, limits, tau, count, lists, logits.stride(0), lists.stride(0),
        C=list_len, SEG=segment, SLOT_PER_KEY=slot_per_key, num_warps=4,
    )
    _finish_kernel[(num_rows,)](
        logits, limits, count, lists, values, indices, logits.stride(0), lists.stride(0),
        values.stride(0), K=k, C=list_len, BLOCK=block,
        num_warps=finish_warps or (4 if num_rows >= 1024 else 8),
    )
    return values, indices


# A row's chosen keys are put in key order by one sort per row (benchmarks/key_order.py, on an
# H200 from CUDA graphs, k = 2,048; docs/decode.md "The top-k's key order"): an int32 sort
# of the key index above the entry's place in the list where the row is at most
# pack32_max_keys(k) keys long (16.4–16.8 µs from 1 to 128 rows, 28.9 at 256, 1,527 at 16,384),
# else an int64 sort of the key index above the score's bits (28.8–29.2, 52.5, 2,942: the
# kernel before). A rank count over many programs per row (each key's place = the number of
# the row's keys below it, 32 programs a row) was no faster even at one row (17.9 µs; 155 at
# 64 rows): deleted.


def pack32_max_keys(k: int) -> int:
    """The longest rows whose key indices, shifted above a list place of log2(next_pow2(k))
    bits, fit a positive int32 with one value to spare for the padding."""
    return (1 << (31 - (triton.next_power_of_2(k) - 1).bit_length())) - 1


@triton.jit(do_not_specialize=["num_rows"])
def _key_sort32_kernel(
    values_ptr,  # [T, K] fp32, rows stride_v apart
    local_ptr,  # [T, K] int32 or int64 (−1: none; keys < 2^(31 − LOG_BLOCK) − 1)
    out_values_ptr,  # [T, K] fp32 contiguous
    out_local_ptr,  # [T, K] local's dtype, contiguous
    num_rows, K, stride_v, stride_l,
    BLOCK: tl.constexpr,  # ≥ K, a power of two
    LOG_BLOCK: tl.constexpr,
):
    """A row in key order by one int32 sort: the key index in the high bits, the entry's place
    in the list in the low LOG_BLOCK; each score read back from its place."""
    r = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    live = j < K
    local = tl.load(local_ptr + r * stride_l + j, mask=live, other=-1)
    pad: tl.constexpr = (1 << (31 - LOG_BLOCK)) - 1  # padding after every key
    high = tl.where(local >= 0, local.to(tl.int32), pad)
    key = tl.sort(tl.where(live, (high << LOG_BLOCK) | j, 2147483647))  # past K: last
    place = key & (BLOCK - 1)
    high = key >> LOG_BLOCK
    value = tl.load(values_ptr + r * stride_v + place, mask=live)
    tl.store(out_values_ptr + r * K + j, value, mask=live)
    tl.store(out_local_ptr + r * K + j,
             tl.where(high == pad, -1, high).to(out_local_ptr.dtype.element_ty), mask=live)


@triton.jit(do_not_specialize=["num_rows"])
def _key_sort64_kernel(
    values_ptr,  # [T, K] fp32, rows stride_v apart
    local_ptr,  # [T, K] int32 or int64 (−1: none), rows stride_l apart
    out_values_ptr,  # [T, K] fp32 contiguous
    out_local_ptr,  # [T, K] local's dtype, contiguous
    num_rows, K, stride_v, stride_l,
    BLOCK: tl.constexpr,  # ≥ K, a power of two
):
    """A row's chosen keys in ascending key order, padding last, each score with its key: the
    key in the high 32 bits of an int64 and the score's bits in the low ones, one sort."""
    r = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    live = j < K
    local = tl.load(local_ptr + r * stride_l + j, mask=live, other=-1).to(tl.int64)
    bits = tl.load(values_ptr + r * stride_v + j, mask=live, other=0.0).to(tl.int32,
                                                                            bitcast=True)
    high = tl.where(local >= 0, local, 2**31 - 1)  # padding after every key
    key = (high << 32) | (bits.to(tl.int64) & 0xFFFFFFFF)
    key = tl.sort(tl.where(live, key, 2**63 - 1))  # past K: after the padding too
    high = key >> 32
    value = (key & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
    tl.store(out_values_ptr + r * K + j, value, mask=live)
    tl.store(out_local_ptr + r * K + j,
             tl.where(high == 2**31 - 1, -1, high).to(out_local_ptr.dtype.element_ty), mask=live)


def in_key_order(values: torch.Tensor, local: torch.Tensor, keys: int | None = None,
                 method: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A top-k's (scores [T, K] fp32, local key indices [T, K], −1: none) with each row's keys
    in ascending key order, padding (−1, its score) last, in one launch (PyTorch: a select, a
    sort and two gathers). Keys of a row are distinct, so the order is unique (the paddings'
    scores are taken as equal). keys: every key index is below it (the rows' length; None:
    unknown). method: "sort32" or "sort64" (None: sort32 where the rows are at most
    pack32_max_keys(K) keys long)."""
    rows, k = local.shape
    out_values = torch.empty(rows, k, dtype=torch.float32, device=values.device)
    out_local = torch.empty(rows, k, dtype=local.dtype, device=local.device)
    if not rows or not k:
        return out_values, out_local
    block = triton.next_power_of_2(k)
    if method is None:
        method = "sort32" if keys is not None and keys <= pack32_max_keys(k) else "sort64"
    if method == "sort32":
        if keys is None or keys > pack32_max_keys(k):
            raise ValueError(f"in_key_order: sort32 takes rows of at most {pack32_max_keys(k)} "
                             f"keys, got {keys}")
        _key_sort32_kernel[(rows,)](
            values, local, out_values, out_local, rows, k, values.stride(0), local.stride(0),
            BLOCK=block, LOG_BLOCK=block.bit_length() - 1, num_warps=max(1, min(8, block // 256)),
        )
    elif method == "sort64":
        _key_sort64_kernel[(rows,)](
            values, local, out_values, out_local, rows, k, values.stride(0), local.stride(0),
            BLOCK=block, num_warps=max(1, min(8, block // 256)),
        )
    else:
        raise ValueError(f"in_key_order: method must be sort32 or sort64, got {method!r}")
    return out_values, out_local


def in_key_order_reference(values: torch.Tensor, local: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """in_key_order in PyTorch (what the indexer ran before the kernel)."""
    pad = torch.iinfo(local.dtype).max
    order = torch.where(local >= 0, local, pad).sort(dim=1).indices  # [T, K]
    return values.gather(1, order), local.gather(1, order)
