"""The connector's two READ paths with GPU caches over NIXL (VRAM → VRAM, one process): two
prefill ranks (DCP 2) and a decode rank as `ConnectorWorker`s. Interleave 1 READs staged (a VRAM
staging buffer registered with NIXL, scattered on the device), interleave = block size zero-copy;
either way every moved row equals its source row byte for byte, bytes = `plan.nbytes`, the
staging buffer is given back. The time of each path is printed (fp8_ds_mla-shaped rows, 4
layers, 8K tokens)."""

from __future__ import annotations

import time

import pytest
import torch

from dsaserve.config import DisaggConfig
from dsaserve.core import KVRecv, KVTransferParams
from dsaserve.disagg import kvio, transport
from dsaserve.disagg.connector import ConnectorWorker
from dsaserve.disagg.relayout import KVLayout, plan_transfer
from dsaserve.kernels import formats
from dsaserve.model.dsa import LayerCache

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not transport.nixl_available(), reason="nixl not installed")]

L, R, D = 512, 64, 128  # GLM-5.3 latent, RoPE and indexer widths
B, TOKENS, LAYERS = 64, 8192, 4


def _caches(num_blocks: int, seed: int) -> list[LayerCache]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        kv = torch.randint(0, 256, formats.mla_cache_shape(num_blocks, B, True, L, R),
                           dtype=torch.uint8, device="cuda", generator=g)
        index = torch.randint(0, 256, formats.index_cache_shape(num_blocks, B, True, D),
                              dtype=torch.uint8, device="cuda", generator=g)
        out.append(LayerCache(kv=kv, index=index))
    return out


@pytest.mark.parametrize("interleave,path", [(1, "staged"), (B, "zero-copy")])
def test_staged_and_zero_copy_reads_of_vram(interleave: int, path: str) -> None:
    src = KVLayout(tuple(range(TOKENS // (2 * B))), B, 2, interleave)
    dst = KVLayout(tuple(range(TOKENS // B)), B)
    plan = plan_transfer(src, dst, 0, TOKENS - 1)
    prefill = [ConnectorWorker(DisaggConfig(kv_role="kv_producer", backend="nixl",
                                            side_channel_port=0),
                               rank=r, dcp_rank=r, world_size=2, block_size=B, dcp_size=2,
                               interleave=interleave) for r in range(2)]
    decode = ConnectorWorker(DisaggConfig(kv_role="kv_consumer", backend="nixl",
                                          side_channel_port=0),
                             rank=0, dcp_rank=0, world_size=1, block_size=B, dcp_size=1,
                             interleave=1)
    try:
        src_caches = [w.register(_caches(len(src.block_ids), r))
                      for r, w in enumerate(prefill)]
        dst_caches = decode.register(_caches(len(dst.block_ids), 7))
        params = KVTransferParams(remote_request_id="req", remote_block_ids=src.block_ids,
                                  remote_block_size=B, remote_dcp_size=2,
                                  remote_interleave=interleave, remote_num_tokens=TOKENS)
        recv = KVRecv("req", dst.block_ids, 0, TOKENS - 1, params,
                      tuple(w.metadata() for w in prefill))
        torch.cuda.synchronize()
        start = time.perf_counter()
        decode.start_receives([recv])
        while True:
            done, failed = decode.poll_receives()
            if done or failed:
                break
        torch.cuda.synchronize()
        took = time.perf_counter() - start
        assert (done, failed) == (("req",), {})
        nbytes = plan.nbytes(kvio.row_bytes(dst_caches))
        print(f"I = {interleave}: {path}, {nbytes / 1e6:.1f} MB in {took * 1e3:.2f} ms "
              f"({nbytes / took / 1e9:.1f} GB/s, posting and scattering included)")
        staged = 2 if path == "staged" else 0
        assert (decode.pairs_staged, decode.pairs_zero_copy) == (staged, 2 - staged)
        assert decode.bytes_received == nbytes
        assert decode.staging is not None and not decode.staging.in_use
        for pair in plan.pairs:
            s, t = pair.src_slots().cuda(), pair.dst_slots().cuda()
            for sc, dc in zip(src_caches[pair.src_rank], dst_caches, strict=True):
                for a, b in zip(kvio.part_views(sc), kvio.part_views(dc), strict=True):
                    if a.dim() == 2:
                        assert torch.equal(a[s], b[t])
                    else:  # an FP8 page half [blocks, B, w]
                        assert torch.equal(a[s // B, s % B], b[t // B, t % B])
    finally:
        for w in [decode, *prefill]:
            w.close()
