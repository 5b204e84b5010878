"""NIXL READs of GPU memory between two agents in one process (what a one-GPU P/D test with both
engines in one process does; `benchmarks/pd_e2e.py` now runs them in two): the bytes arrive with
the transport's default progress thread; the case without it is printed, not asserted (it
documents why the default is on where CUDA is); a READ landed by polling alone, as the P/D
consumer's steps do."""

from __future__ import annotations

import pytest
import torch

from dsaserve.disagg import transport
from dsaserve.disagg.transport import NixlTransport, TransferTimeout

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not transport.nixl_available(), reason="nixl not installed")]

NBYTES = 64 << 20


def _random_bytes() -> torch.Tensor:
    """[NBYTES] uint8 on the GPU, the same every run."""
    g = torch.Generator(device="cuda").manual_seed(0)
    return torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, device="cuda", generator=g)


def _read(progress_thread: bool | None, timeout_s: float) -> bool:
    with NixlTransport("vram-src", progress_thread) as src, \
            NixlTransport("vram-dst", progress_thread) as dst:
        a = src.register("kv", _random_bytes())
        b = dst.register("kv", torch.zeros(NBYTES, dtype=torch.uint8, device="cuda"))
        peer = dst.add_peer(src.metadata())
        try:
            dst.wait(dst.read(peer, "kv", "kv"), timeout_s)
        except TransferTimeout:
            return False
        torch.cuda.synchronize()
        assert torch.equal(a, b)
        return True


def test_vram_read_with_the_default_progress_thread() -> None:
    assert _read(None, timeout_s=30)


def test_vram_read_without_a_progress_thread_is_reported() -> None:
    print("VRAM READ without a progress thread:", "done" if _read(False, 5) else "stalled")


def test_vram_read_lands_by_polling() -> None:
    """What the P/D consumer does each step (disagg/receiving.py): `poll` never blocks, and
    polling alone (no `wait`) lands the READ; how many polls it took is printed."""
    import time

    with NixlTransport("poll-src") as src, NixlTransport("poll-dst") as dst:
        a = src.register("kv", _random_bytes())
        b = dst.register("kv", torch.zeros(NBYTES, dtype=torch.uint8, device="cuda"))
        peer = dst.add_peer(src.metadata())
        xfer = dst.read(peer, "kv", "kv")
        polls, deadline = 1, time.monotonic() + 30
        while not dst.poll(xfer):
            assert time.monotonic() < deadline, "the READ did not land by polling"
            polls += 1
            time.sleep(0.001)
        torch.cuda.synchronize()
        assert torch.equal(a, b)
        print(f"VRAM READ of {NBYTES >> 20} MiB landed after {polls} poll(s)")
