"""KV transports between two processes on 127.0.0.1: this test is the producer (prefill side), a
spawned process the consumer (decode side). Bytes compared; a dead peer is an error in bounded
time. One spawn per backend (CI time)."""

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
    """Pull the producer's region, then receive a write into our inbox; report both; then wait
    to be killed (the test's dead peer)."""
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
        time.sleep(120)


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
def test_two_processes_read_write_then_dead_peer(backend: str) -> None:
    """The consumer pulls (READ), the producer pushes (WRITE, two segments), notifications
    complete both; then the consumer is killed and using it is an error in bounded time."""
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
            assert type(t) is transport.TRANSPORTS[backend]
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

            # The decode side dies: a transfer to it and a wait on it fail, neither hangs.
            proc.kill()
            proc.join()
            start = time.monotonic()
            with pytest.raises(TransferError):
                t.wait(t.write(peer, "src", "inbox", notify=b"req-9"), timeout_s=3)
            with pytest.raises(TransferError):
                t.wait_notification(peer, b"never", timeout_s=3)
            assert time.monotonic() - start < 15
        finally:
            side.close()
            if proc.is_alive():
                proc.kill()
                proc.join()
            # A killed shm agent cannot unlink its files: sweep them for it.
            for path in transport._shm_dir().glob("dsaserve-kv-decode-0-*"):
                path.unlink(missing_ok=True)


def test_timeout_type() -> None:
    assert issubclass(TransferTimeout, TransferError) and issubclass(TransferTimeout, TimeoutError)
