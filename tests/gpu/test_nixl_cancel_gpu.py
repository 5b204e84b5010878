"""Cancelling NIXL READs of GPU memory (what an abort while receiving, a READ timeout and a
shutdown rely on, disagg/receiving.py): once `cancel` (the handle released) returns, nothing of
the READ lands any more, so the engine may give its blocks to another request at once; a
transport closed with a READ in flight returns and leaves the process working. Whether the READ
was still in flight when cancelled is printed (a fast link may land it first)."""

from __future__ import annotations

import time

import pytest
import torch

from dsaserve.disagg import transport
from dsaserve.disagg.transport import NixlTransport

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not transport.nixl_available(), reason="nixl not installed")]

NBYTES = 1 << 30  # large enough to be in flight for a while on the links measured so far
SENTINEL = 0x5A


def _random_bytes() -> torch.Tensor:
    """[NBYTES] uint8 on the GPU, the same every run."""
    g = torch.Generator(device="cuda").manual_seed(0)
    return torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, device="cuda", generator=g)


def test_nothing_lands_after_a_vram_read_is_cancelled() -> None:
    with NixlTransport("cancel-src") as src, NixlTransport("cancel-dst") as dst:
        src.register("kv", _random_bytes())
        b = dst.register("kv", torch.zeros(NBYTES, dtype=torch.uint8, device="cuda"))
        peer = dst.add_peer(src.metadata())
        xfer = dst.read(peer, "kv", "kv")
        in_flight = not dst.poll(xfer)
        dst.cancel(xfer)
        b.fill_(SENTINEL)  # the blocks are "another request's" from here on
        torch.cuda.synchronize()
        time.sleep(3.0)  # far longer than the whole READ takes at the rates measured
        torch.cuda.synchronize()
        changed = int((b != SENTINEL).sum())
        print(f"READ in flight when cancelled: {in_flight}; bytes changed after: {changed}")
        assert changed == 0


def test_closing_with_a_vram_read_in_flight() -> None:
    src = NixlTransport("close-src")
    dst = NixlTransport("close-dst")
    try:
        a = src.register("kv", _random_bytes())
        dst.register("kv", torch.zeros(NBYTES, dtype=torch.uint8, device="cuda"))
        peer = dst.add_peer(src.metadata())
        dst.read(peer, "kv", "kv")
        t0 = time.monotonic()
        dst.close()  # cancels the READ before deregistering the memory it moves
        assert time.monotonic() - t0 < 30
    finally:
        dst.close()
        src.close()
    # the process still moves bytes: a fresh pair of agents READs correctly
    with NixlTransport("after-src") as s2, NixlTransport("after-dst") as d2:
        x = s2.register("kv", a[: 1 << 20].clone())
        y = d2.register("kv", torch.zeros(1 << 20, dtype=torch.uint8, device="cuda"))
        d2.wait(d2.read(d2.add_peer(s2.metadata()), "kv", "kv"), 30)
        torch.cuda.synchronize()
        assert torch.equal(x, y)
