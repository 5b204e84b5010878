"""The shared-memory transport's copy thread (disagg/shmcopy.py): a READ returns at once and
lands on the copy thread while the poster goes on; a cancel is exact (a queued READ never
starts, a running one stops at its next chunk and nothing of it lands after `cancel` returns);
`close` cancels what is in flight and leaves no thread behind."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dsaserve.disagg import shmcopy
from dsaserve.disagg.shmcopy import CopyState, CopyThread
from dsaserve.disagg.transport import ShmTransport, TransferTimeout, make_transport

N = 1 << 16  # bytes of each region


class ChunkGate:
    """Every chunk the copy threads copy from now on waits for a permit (`allow(n)`); counts the
    chunks that reached the gate and those copied."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.permits = threading.Semaphore(0)
        self.reached = self.copied = 0
        real = CopyThread._copy_chunk

        def gated(thread: CopyThread, dst: torch.Tensor, src: torch.Tensor) -> None:
            self.reached += 1
            assert self.permits.acquire(timeout=30), "the test never let this chunk through"
            real(thread, dst, src)
            self.copied += 1

        monkeypatch.setattr(CopyThread, "_copy_chunk", gated)

    def allow(self, n: int = 1) -> None:
        for _ in range(n):
            self.permits.release()

    def wait_reached(self, n: int) -> None:
        deadline = time.monotonic() + 10
        while self.reached < n:
            assert time.monotonic() < deadline, "the copy thread never reached the gate"
            time.sleep(0.001)


def _pair() -> tuple[ShmTransport, ShmTransport, str, str, torch.Tensor, torch.Tensor]:
    prod, cons = make_transport("shm", "p-copy"), make_transport("shm", "d-copy")
    assert isinstance(prod, ShmTransport) and isinstance(cons, ShmTransport)
    src = prod.allocate("src", N)
    src.copy_(torch.randint(1, 256, (N,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(0)))
    dst = cons.allocate("dst", N)
    peer, back = cons.add_peer(prod.metadata()), prod.add_peer(cons.metadata())
    return prod, cons, peer, back, src, dst


def _copy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("shm-copy-")]


def test_a_read_returns_at_once_and_lands_on_the_copy_thread(monkeypatch) -> None:
    gate = ChunkGate(monkeypatch)
    prod, cons, peer, back, src, dst = _pair()
    try:
        t0 = time.monotonic()
        xfer = cons.read(peer, "dst", "src", [(0, 0, 1000), (2000, 2000, 3000)], notify=b"r1")
        assert time.monotonic() - t0 < 5  # posting did not copy (the gate holds every chunk)
        for _ in range(3):  # polled over "steps": in flight, nothing landed, nobody notified
            assert not cons.poll(xfer)
        assert not bool(dst.any())
        with pytest.raises(TransferTimeout):
            prod.wait_notification(back, b"r1", timeout_s=0.05)
        gate.allow(2)
        cons.wait(xfer, timeout_s=10)
        assert torch.equal(dst[:1000], src[:1000]) and torch.equal(dst[2000:5000], src[2000:5000])
        assert not bool(dst[1000:2000].any()) and not bool(dst[5000:].any())
        prod.wait_notification(back, b"r1", timeout_s=10)  # sent once the bytes moved
    finally:
        gate.allow(100)
        cons.close()
        prod.close()


def test_cancel_is_exact(monkeypatch) -> None:
    """A READ cancelled while queued never copies; one cancelled mid-way stops at its next chunk
    (the cancel waits for the chunk being copied); no notification for either; the READs after
    them still land."""
    monkeypatch.setattr(shmcopy, "CHUNK", 1024)
    gate = ChunkGate(monkeypatch)
    prod, cons, peer, back, src, dst = _pair()
    try:
        running = cons.read(peer, "dst", "src", [(0, 0, 4096)], notify=b"running")  # 4 chunks
        queued = cons.read(peer, "dst", "src", [(8192, 8192, 1024)], notify=b"queued")
        after = cons.read(peer, "dst", "src", [(16384, 16384, 1024)])
        gate.allow(1)  # the first chunk of `running` lands; the thread waits inside the second
        gate.wait_reached(2)

        cons.cancel(queued)
        assert queued.handle.state is CopyState.CANCELLED and cons.poll(queued)
        cancelled = threading.Event()
        canceller = threading.Thread(target=lambda: (cons.cancel(running), cancelled.set()))
        canceller.start()
        assert not cancelled.wait(0.2)  # the thread is inside `running`: the cancel waits
        gate.allow(1)  # the chunk in progress lands; the rest of `running` never starts
        assert cancelled.wait(10)
        canceller.join()
        assert running.handle.state is CopyState.CANCELLED and gate.copied == 2
        assert torch.equal(dst[:2048], src[:2048]) and not bool(dst[2048:16384].any())

        gate.allow(1)
        cons.wait(after, timeout_s=10)
        assert torch.equal(dst[16384:17408], src[16384:17408]) and gate.copied == 3
        with pytest.raises(TransferTimeout):
            prod.wait_notification(back, b"running", timeout_s=0.05)
        with pytest.raises(TransferTimeout):
            prod.wait_notification(back, b"queued", timeout_s=0.05)
    finally:
        gate.allow(100)
        cons.close()
        prod.close()


def test_close_cancels_what_is_in_flight_and_joins_the_thread(monkeypatch) -> None:
    monkeypatch.setattr(shmcopy, "CHUNK", 1024)
    gate = ChunkGate(monkeypatch)
    prod, cons, peer, _, src, dst = _pair()
    try:
        first = cons.read(peer, "dst", "src", [(0, 0, 4096)])
        second = cons.read(peer, "dst", "src", [(8192, 8192, 4096)])
        thread = cons.copies.thread
        assert thread is not None and thread in _copy_threads()
        gate.wait_reached(1)  # the thread is inside `first`
        closing = threading.Thread(target=cons.close)
        closing.start()
        time.sleep(0.1)
        gate.allow(1)  # the chunk the thread was waiting in lands; nothing after it
        closing.join(10)
        assert not closing.is_alive() and not thread.is_alive()
        assert thread not in _copy_threads()
        assert first.handle.state is second.handle.state is CopyState.CANCELLED
        assert gate.copied == 1 and not bool(dst[1024:].any())
        assert torch.equal(dst[:1024], src[:1024])
    finally:
        gate.allow(100)
        cons.close()
        prod.close()


def test_a_transport_that_never_copied_has_no_thread() -> None:
    before = set(_copy_threads())
    with make_transport("shm", "idle") as t:
        t.allocate("x", 10)
        assert isinstance(t, ShmTransport) and t.copies.thread is None
    assert set(_copy_threads()) == before


def test_cancel_of_a_multi_region_read(monkeypatch) -> None:
    """A READ over several regions is one copy job: cancelled mid-way (inside its second item),
    nothing more of any item lands, and no notification goes."""
    monkeypatch.setattr(shmcopy, "CHUNK", 1024)
    gate = ChunkGate(monkeypatch)
    prod, cons, peer, back, src, dst = _pair()
    src2 = prod.allocate("src2", N)
    src2.fill_(7)
    dst2 = cons.allocate("dst2", N)
    peer = cons.add_peer(prod.metadata())  # src2 is known to the consumer now
    try:
        xfer = cons.read_regions(peer, [("dst", "src", [(0, 0, 1024)]),
                                        ("dst2", "src2", [(0, 0, 3072)])], notify=b"multi")
        gate.allow(2)  # the first item and the first chunk of the second land
        gate.wait_reached(3)
        assert not cons.poll(xfer)
        cancelled = threading.Event()
        canceller = threading.Thread(target=lambda: (cons.cancel(xfer), cancelled.set()))
        canceller.start()
        gate.allow(1)  # the chunk in progress lands; the rest never starts
        assert cancelled.wait(10)
        canceller.join()
        assert xfer.handle.state is CopyState.CANCELLED and cons.poll(xfer)
        assert gate.copied == 3
        assert torch.equal(dst[:1024], src[:1024]) and not bool(dst[1024:].any())
        assert bool((dst2[:2048] == 7).all()) and not bool(dst2[2048:].any())
        with pytest.raises(TransferTimeout):
            prod.wait_notification(back, b"multi", timeout_s=0.05)
    finally:
        gate.allow(100)
        cons.close()
        prod.close()
