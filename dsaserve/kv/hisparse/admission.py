"""How many requests a HiSparse host pool admits: one function for the engine's scheduler and
`dsaserve plan`, so that the plan's concurrency is what the engine admits.

Admission reserves a request's whole window (`max_model_len` tokens, whole blocks) in the host
pool, as vLLM does: a request admitted can always be mirrored to the end, and GPU pages and hot
buffers are only a cache of it. Host blocks that the prefix cache keeps (spilled blocks of
ended requests) use only the room the admitted windows leave and are evicted before a window
would not fit (`host_blocks_to_evict`). Pure integer maths (no torch).
"""

from __future__ import annotations

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
    `tail_pages` resident, beside one prefill of a whole window: what `dsaserve plan` suggests
    for `device_mla_pages` (the rest of every decoder's MLA rows spill)."""
    return min_mla_pages(window_tokens, block_size) + concurrency * tail_pages


def check_admits_one(adm: HiSparseAdmission, mla_bytes_per_token: int, block_size: int) -> None:
    """Start-up error naming the flag when the pool cannot hold one max-length request."""
    if adm.max_requests < 1:
        need = adm.blocks_per_request * block_size * mla_bytes_per_token
        raise ConfigError(
            f"--kv-transfer-config: host_pool_gib holds {adm.num_host_blocks} blocks of "
            f"{block_size} tokens, less than one request of --max-model-len needs "
            f"({adm.blocks_per_request} blocks, {need / 2**30:.4f} GiB)")
