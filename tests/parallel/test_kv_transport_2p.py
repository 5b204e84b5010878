"""KV transports between two processes on 127.0.0.1: this test is the producer (prefill side), a
spawned process the consumer (decode side). Bytes compared; a dead peer is an error in bounded
time."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from dsaserve.disagg import transport
from dsaserve.disagg.transport import (
    SideChannel,
    TransferError,
    TransferTimeout,
    fetch_metadata,
    make_transport,
)

pytestmark = pytest.mark.parallel

NBYTES = 1 << 20
NO_NIXL = "nixl not installed (pip install 'dsaserve[nixl]')"
BACKENDS = [
    "shm",
    pytest.param("nixl", marks=pytest.mark.skipif(not transport.nixl_available(), reason=NO_NIXL)),
]


def _consumer(backend: str, producer_port: int, q: mp.Queue) -> None:
    """Pull the producer's region, then receive a write into our inbox; report both."""
    with make_transport(backend, "decode-0") as t:
        dst = t.allocate("dst", NBYTES)
        inbox = t.allocate("inbox", NBYTES)
        side = SideChannel(t.metadata)
        q.put(("port", side.port, t.backend))
        peer = t.add_peer(fetch_metadata(producer_port))
        t.wait(t.read(peer, "dst", "src", notify=b"req-7 read"), timeout_s=30)
        q.put(("read", dst.clone()))
        t.wait_notification(peer, b"req-8 written", timeout_s=30)
        q.put(("inbox", inbox.clone()))
        t.wait_notification(peer, b"bye", timeout_s=30)  # keep our memory until they are done
        side.close()


def _get(q: mp.Queue, proc: mp.Process, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=0.2)
        except Exception:
            if not proc.is_alive():
                raise RuntimeError(f"consumer exited with {proc.exitcode}") from None
    raise TimeoutError("consumer did not report")


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_processes_read_then_write(backend: str) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    src_bytes = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(1))
    with make_transport(backend, "prefill-0") as t:
        t.allocate("src", NBYTES).copy_(src_bytes)
        side = SideChannel(t.metadata)
        proc = ctx.Process(target=_consumer, args=(backend, side.port, q))
        proc.start()
        try:
            tag, port, their_backend = _get(q, proc)
            assert (tag, their_backend, t.backend) == ("port", backend, backend)
            peer = t.add_peer(fetch_metadata(port))
            t.wait_notification(peer, b"req-7 read", timeout_s=30)  # the pull has completed
            tag, got = _get(q, proc)
            assert tag == "read" and torch.equal(got, src_bytes)
            segs = [(0, 0, 4096), (NBYTES - 8192, 8192, 8192)]
            t.wait(t.write(peer, "src", "inbox", segs, notify=b"req-8 written"), timeout_s=30)
            tag, inbox = _get(q, proc)
            assert tag == "inbox"
            assert torch.equal(inbox[:4096], src_bytes[:4096])
            assert torch.equal(inbox[8192:16384], src_bytes[-8192:])
            assert not bool(inbox[16384:].any())
            t.send_notification(peer, b"bye")
            proc.join(30)
            assert proc.exitcode == 0
        finally:
            side.close()
            if proc.is_alive():
                proc.kill()
                proc.join()


def _short_lived_producer(backend: str, q: mp.Queue) -> None:
    """Registers memory, publishes its metadata, then waits to be killed."""
    t = make_transport(backend, "prefill-dies")
    t.allocate("src", NBYTES)
    side = SideChannel(t.metadata)
    q.put(side.port)
    time.sleep(120)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dead_peer_is_an_error_not_a_hang(backend: str) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_short_lived_producer, args=(backend, q))
    proc.start()
    try:
        port = _get(q, proc)
        with make_transport(backend, "decode-alone") as t:
            t.allocate("dst", NBYTES)
            peer = t.add_peer(fetch_metadata(port))
            proc.kill()  # the prefill engine dies before the decode side pulls
            proc.join()
            start = time.monotonic()
            with pytest.raises(TransferError):
                t.wait(t.read(peer, "dst", "src", notify=b"req-9 read"), timeout_s=3)
                t.wait_notification(peer, b"never", timeout_s=3)
            assert time.monotonic() - start < 10
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        # A killed shm producer cannot unlink its files: sweep them for it.
        for path in transport._shm_dir().glob("dsaserve-kv-prefill-dies-*"):
            path.unlink(missing_ok=True)


def test_timeout_type() -> None:
    assert issubclass(TransferTimeout, TransferError) and issubclass(TransferTimeout, TimeoutError)
