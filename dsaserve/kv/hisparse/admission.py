"""How many requests a HiSparse host pool admits: one function for the engine's scheduler and
`dsaserve plan`, so that the plan's concurrency is what the engine admits.

Admission reserves a request's whole window (`max_model_len` tokens, whole blocks) in the host
pool, as vLLM does: a request admitted can always be mirrored to the end, and GPU pages and hot
buffers are only a cache of it. Host blocks that the prefix cache keeps (spilled blocks of
ended requests) use only the room the admitted windows leave and are evicted before a window
would not fit (`host_blocks_to_evict`). Pure integer maths (no torch).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from dsaserve.config import ConfigError


@dataclass(frozen=True)
class HiSparseAdmission:
    num_host_blocks: int  # blocks of `block_size` tokens the pool holds
    blocks_per_request: int  # one request's reserved window
    max_requests: int  # requests admitted at once (the host-memory bound)


def hisparse_admission(host_pool_bytes: int, mla_bytes_per_token: int, max_model_len: int,
                       block_size: int) -> HiSparseAdmission:
    """host_pool_bytes of MLA rows (every layer, the MTP layer's included: `mla_bytes_per_token`
    per token) in blocks of block_size tokens; each request reserves ceil(max_model_len / B)."""
    num = host_pool_bytes // (block_size * mla_bytes_per_token)
    per_request = -(-max_model_len // block_size)
    return HiSparseAdmission(num_host_blocks=num, blocks_per_request=per_request,
                             max_requests=num // per_request)


def host_blocks_to_evict(adm: HiSparseAdmission, num_windows: int, num_kept: int) -> int:
    """Kept host blocks (a spilled block's rows kept by its prefix hash after its request
    ended, kv/hisparse/mla_pages.py) to give back so that `num_windows` admitted windows and
    the rest of the kept ones fit the pool. Kept blocks live only in the room the admitted
    windows leave, so they never lower `max_requests`: what the engine admits and `dsaserve
    plan` prints stay this module's one function."""
    return max(num_kept + num_windows * adm.blocks_per_request - adm.num_host_blocks, 0)


def min_mla_pages(window_tokens: int, block_size: int) -> int:
    """The fewest GPU MLA pages spilling runs with (`hisparse_config.device_mla_pages`): a
    prefill reads its GPU pages, so one request's whole window (max_model_len and the MTP
    lookahead) must fit."""
    return -(-window_tokens // block_size)


def mla_pages_for(concurrency: int, window_tokens: int, block_size: int,
                  tail_pages: int) -> int:
    """GPU MLA pages for `concurrency` long decoders, each keeping its write tail of
    `tail_pages` resident, beside one prefill of `window_tokens` (a whole window; a P/D
    decode engine's `pd_decode_prefill_tokens`): what `dsaserve plan` suggests for
    `device_mla_pages` (the rest of every decoder's MLA rows spill)."""
    return min_mla_pages(window_tokens, block_size) + concurrency * tail_pages


def pd_decode_prefill_tokens(buffer_rows: int, lookahead: int) -> int:
    """The longest prompt whose pages a P/D decode engine (kv_role kv_consumer) must hold:
    what it receives long arrives spilled (rows in the host pool, the write tail on pages),
    so only prompts it prefills itself and short arrivals read their pages; it takes prompts
    of the hot buffer's rows, and refuses longer local ones (they belong to the prefill
    engine). With one write tail beside it, the fewest pages such an engine runs with."""
    return buffer_rows + lookahead


def spilling_holds(num_requests: int, prefill_tokens: int, window_blocks: int, *,
                   block_size: int, tail_pages: int, num_mla_pages: int, num_blocks: int,
                   pinned_pages: int = 0) -> bool:
    """Whether `num_requests` requests run at once on spilling pages without a preemption: each
    keeps its write tail's `tail_pages` resident beside the longest prefill among them
    (`prefill_tokens`, MTP lookahead included: a prefill reads its GPU pages), which is
    `mla_pages_for` them, and their windows (prompt and outputs to the end) need
    `window_blocks` KV blocks (indexer pages) in all. `pinned_pages`: blocks of a shared
    prefix, which never spill (`shared_windows`; 0 without sharing, as `dsaserve plan`
    assumes). The engine's scheduler admits a request only while this holds; for requests
    of max_model_len it holds up to `size_mla_pages`'s concurrency, which `dsaserve plan`
    prints. A lone request always fits (the pages and blocks hold one window, checked at
    start-up)."""
    return num_requests <= 1 or (
        mla_pages_for(num_requests, prefill_tokens, block_size, tail_pages) + pinned_pages
        <= num_mla_pages and window_blocks <= num_blocks)


@dataclass(frozen=True)
class SharedBlocks:
    """Blocks several requests hold at once (a cached prefix), as `shared_windows` counts them:
    they change only when the set of requests does (a request's later blocks are its own), so
    the scheduler keeps them between steps."""

    repeats: int  # table entries beyond the first of each shared block
    pinned: int  # shared blocks outside the prefill's table: pages that never spill


def shared_blocks(tables: Sequence[Sequence[int]], prefill: int | None) -> SharedBlocks:
    """The shared blocks of requests holding block tables `tables` now; `prefill`: the index of
    the prefill among them (None: none), whose window of pages is counted whole already."""
    held = Counter(b for table in tables for b in table)
    shared = {b for b, n in held.items() if n > 1}
    repeats = sum(held[b] - 1 for b in shared)
    if prefill is not None:
        shared.difference_update(tables[prefill])
    return SharedBlocks(repeats, len(shared))


def shared_windows(tables: Sequence[Sequence[int]], window_blocks: Sequence[int],
                   prefill: int | None, shared: SharedBlocks | None = None) -> tuple[int, int]:
    """(`window_blocks` for `spilling_holds`, its `pinned_pages`) of requests holding block
    tables `tables` now, whose windows end at `window_blocks` blocks each. A block several of
    them hold (a cached prefix) is one block: their later blocks are new, one each. It is
    also a page none of them may spill (a spilled block is held by one request alone), so it
    is pinned, unless it is in the prefill's table (`tables[prefill]`), whose window of
    pages `mla_pages_for` counts whole already:

        a (prefill)  | s0 s1 a2 . . . |        window 6 blocks
        b            | s0 s1 b2 b3 . . . |     window 7
        c            | c0 . . . |              window 4

        held now: s0 s1 a2 b2 b3 c0 = 6, later: 3 + 3 + 3 → 15 blocks, not 6 + 7 + 4 = 17;
        pinned: none (s0, s1 are in the prefill's window); 2 were c the prefill

    Without sharing it is the sum of the windows and no page pinned, as `dsaserve plan` has it.
    `shared`: `shared_blocks(tables, prefill)` if known (it walks every table).
    """
    shared = shared_blocks(tables, prefill) if shared is None else shared
    windows = sum(max(w, len(t)) for t, w in zip(tables, window_blocks, strict=True))
    return windows - shared.repeats, shared.pinned


def check_admits_one(adm: HiSparseAdmission, mla_bytes_per_token: int, block_size: int) -> None:
    """Start-up error naming the flag when the pool cannot hold one max-length request."""
    if adm.max_requests < 1:
        need = adm.blocks_per_request * block_size * mla_bytes_per_token
        raise ConfigError(
            f"--kv-transfer-config: host_pool_gib holds {adm.num_host_blocks} blocks of "
            f"{block_size} tokens, less than one request of --max-model-len needs "
            f"({adm.blocks_per_request} blocks, {need / 2**30:.4f} GiB)")


def write_tail_pages(num_speculative_tokens: int, block_size: int) -> int:
    """Pages a decoder's write tail can span: the block of num_computed_tokens onwards, holding
    this step's 1 + k rows and the k − 1 lookahead slots of the draft steps (2k positions, one
    without drafts), at any offset in its first block; the worst offset is the last:

        pages    | .  .  .  c | c  c  c  c | c  .  .  . |    c: the tail (k = 3, B = 4)
                            └───────── 2k ─────────┘         ceil((2k − 1) / B) + 1 pages
    """
    tokens = max(2 * num_speculative_tokens, 1)
    return -(-(tokens - 1) // block_size) + 1


def hot_region_rows(buffer_rows: int, block_size: int) -> int:
    """Rows of one request's hot region: its S slots and a trash slot, in whole pages."""
    return -(-(buffer_rows + 1) // block_size) * block_size


@dataclass(frozen=True)
class MlaPageSizing:
    num_mla_pages: int  # GPU MLA pages; 0: no spilling (one page per KV block holds as much)
    num_blocks: int  # KV blocks (indexer pages) beside them
    concurrency: int  # max-length requests decoding at once that the pages are sized for


def size_mla_pages(*, max_requests: int, window_tokens: int, block_size: int, tail_pages: int,
                   mla_page_bytes: int, index_page_bytes: int, hot_bytes_per_request: int,
                   kv_bytes: int | None = None, num_blocks: int | None = None,
                   prefill_tokens: int | None = None) -> MlaPageSizing:
    """`hisparse_config.device_mla_pages: "auto"`: the engine's choice and `dsaserve plan`'s
    suggestion (one function, so they agree). The pages are `mla_pages_for` the requests
    decoding at once: the host pool's admitted requests (`max_requests`), fewer where the GPU
    cannot hold each one's window of KV blocks (indexer pages), its write tail's MLA pages and
    its hot buffer beside one prefill's MLA pages: a whole window, or for a P/D decode engine
    `prefill_tokens` (`pd_decode_prefill_tokens`: a 1M window of MLA pages would not fit a GPU
    at all). The GPU is `kv_bytes` of KV budget, split here between MLA pages and blocks:

        kv_bytes ≥ pages · mla_page + c · hot + blocks · index_page,
        pages = min_mla_pages(prefill) + c · tail_pages,   blocks ≥ c · window blocks

    or a fixed `num_blocks` (--num-gpu-blocks-override; the hot buffers then come apart, as
    without spilling), where spilling saves the MLA pages beyond `pages`. From a budget,
    spilling pays only when it holds more requests than one MLA page per block would:
    otherwise `num_mla_pages` is 0 and the budget is all-GPU blocks. Raises a ConfigError
    naming the flag when not one request fits."""
    flag = '--attention-config: hisparse_config.device_mla_pages "auto"'
    window_blocks = -(-window_tokens // block_size)
    prefill = window_tokens if prefill_tokens is None else min(prefill_tokens, window_tokens)
    least = min_mla_pages(prefill, block_size)
    all_gpu = 0  # requests one MLA page per block holds, from the budget
    if num_blocks is not None:
        fits = num_blocks // window_blocks
    else:
        assert kv_bytes is not None
        per_request = window_blocks * index_page_bytes + tail_pages * mla_page_bytes \
            + hot_bytes_per_request
        fits = max(kv_bytes - least * mla_page_bytes, 0) // per_request
        all_gpu = kv_bytes // ((mla_page_bytes + index_page_bytes) * window_blocks)
    concurrency = min(max_requests, fits)
    if concurrency < 1:
        room = (f"{num_blocks} KV blocks (--num-gpu-blocks-override)" if num_blocks is not None
                else f"a KV budget of {kv_bytes / 2**30:.3f} GiB (--gpu-memory-utilization)")
        raise ConfigError(
            f"{flag}: {room} cannot hold one request of --max-model-len: {least} MLA pages and "
            f"{window_blocks} KV blocks of {block_size} tokens")
    pages = mla_pages_for(concurrency, prefill, block_size, tail_pages)
    if num_blocks is not None:  # the blocks are given: spilling saves their MLA pages' HBM
        return MlaPageSizing(num_mla_pages=pages if pages < num_blocks else 0,
                             num_blocks=num_blocks, concurrency=concurrency)
    if concurrency <= min(max_requests, all_gpu):  # one MLA page per block admits as many
        return MlaPageSizing(num_mla_pages=0, concurrency=concurrency,
                             num_blocks=kv_bytes // (mla_page_bytes + index_page_bytes))
    blocks = (kv_bytes - pages * mla_page_bytes - concurrency * hot_bytes_per_request) \
        // index_page_bytes
    return MlaPageSizing(num_mla_pages=pages, num_blocks=blocks, concurrency=concurrency)
