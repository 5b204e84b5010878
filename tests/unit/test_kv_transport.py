"""KV transports in one process: two agents, READ / WRITE with segments, notifications, errors.
The two-process tests (spawned peers, a dead peer) are in tests/parallel/test_kv_transport_2p.py."""

from __future__ import annotations

import socket

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

NO_NIXL = "nixl not installed (pip install 'dsaserve[nixl]')"
BACKENDS = [
    "shm",
    pytest.param("nixl", marks=pytest.mark.skipif(not transport.nixl_available(), reason=NO_NIXL)),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_write_and_notifications(backend: str) -> None:
    gen = torch.Generator().manual_seed(0)
    with make_transport(backend, f"p-{backend}") as prod, \
            make_transport(backend, f"d-{backend}") as cons:
        assert type(prod) is transport.TRANSPORTS[backend] and prod.backend == backend
        src = prod.allocate("src", 1 << 16)
        src.copy_(torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=gen))
        dst = cons.allocate("dst", 1 << 16)
        inbox = cons.allocate("inbox", 1000)
        side = SideChannel(prod.metadata)
        try:
            peer = cons.add_peer(fetch_metadata(side.port))
        finally:
            side.close()
        back = prod.add_peer(cons.metadata())
        assert isinstance(peer, str) and peer == prod.name and back == cons.name

        # READ: the consumer pulls; the producer is told it may free.
        cons.wait(cons.read(peer, "dst", "src", notify=b"req-1 read"), timeout_s=10)
        assert torch.equal(dst, src)
        prod.wait_notification(back, b"req-1 read", timeout_s=10)

        # WRITE with segments: two runs of the source land at two offsets of the inbox.
        segs = [(100, 0, 300), (5000, 600, 400)]  # (local, remote, nbytes)
        prod.wait(prod.write(back, "src", "inbox", segs, notify=b"req-2"), timeout_s=10)
        cons.wait_notification(peer, b"req-2", timeout_s=10)
        assert torch.equal(inbox[:300], src[100:400])
        assert torch.equal(inbox[600:1000], src[5000:5400])
        assert not bool(inbox[300:600].any())

        # A notification without data (nothing to read: free the blocks), and one never sent.
        cons.send_notification(peer, b"req-3 nothing")
        prod.wait_notification(back, b"req-3 nothing", timeout_s=10)
        with pytest.raises(TransferTimeout, match="no notification b'never'"):
            prod.wait_notification(back, b"never", timeout_s=0.2)


@pytest.mark.skipif(not transport.nixl_available(), reason=NO_NIXL)
def test_nixl_registers_existing_tensors() -> None:
    """A cache tensor the runner already has (any dtype and shape) is registered in place and
    read by a peer; shared memory refuses, it moves only what it allocated."""
    cache = torch.randn(3, 4, 8, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    with make_transport("nixl", "reg-p") as prod, make_transport("nixl", "reg-d") as cons:
        flat = prod.register("L0.kv", cache)
        assert flat.data_ptr() == cache.data_ptr() and flat.numel() == cache.numel() * 2
        dst = cons.allocate("L0.kv", flat.numel())
        peer = cons.add_peer(prod.metadata())
        cons.wait(cons.read(peer, "L0.kv", "L0.kv", [(16, 32, 64)]), timeout_s=10)
        assert torch.equal(dst[16:80], flat[32:96]) and not bool(dst[:16].any())
    with make_transport("shm", "reg-shm") as t, pytest.raises(TransferError, match="allocated"):
        t.register("x", cache)


def test_bad_requests_are_clear_errors() -> None:
    with make_transport("shm", "a") as a, make_transport("shm", "b") as b:
        a.allocate("x", 100)
        b.allocate("y", 50)
        peer = a.add_peer(b.metadata())
        with pytest.raises(TransferError, match="differ in size"):
            a.read(peer, "x", "y")
        with pytest.raises(TransferError, match="outside"):
            a.read(peer, "x", "y", [(0, 40, 20)])
        with pytest.raises(TransferError, match="no region 'z'"):
            a.read(peer, "x", "z")
        with pytest.raises(TransferError, match="unknown peer"):
            a.read("nobody", "x", "y")
        with pytest.raises(TransferError, match="exists"):
            a.allocate("x", 10)
        with pytest.raises(TransferError, match="not shm"):
            a.add_peer(b'{"backend": "nixl"}')
    with pytest.raises(ValueError, match="wildcard"):
        SideChannel(lambda: b"", host="0.0.0.0")
    with pytest.raises(ValueError, match="unknown backend"):
        make_transport("rdma", "x")
    # Nothing listens on a port we just closed: a clear error, not a hang.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TransferError, match="side channel"):
        fetch_metadata(port, timeout_s=1)


def test_side_channel_answers_a_question(monkeypatch) -> None:
    """An empty frame gets the payload, a question `ask`'s answer; a client that sends nothing
    or an oversized question is dropped without stalling the next one."""
    monkeypatch.setattr(SideChannel, "ASK_TIMEOUT_S", 0.2)
    side = SideChannel(lambda: b"payload", ask=lambda q: b"answer to " + q)
    try:
        assert fetch_metadata(side.port) == b"payload"
        assert fetch_metadata(side.port, question=b"who") == b"answer to who"
        with socket.create_connection(("127.0.0.1", side.port)):  # silent: dropped in 0.2 s
            assert fetch_metadata(side.port, timeout_s=5) == b"payload"
        with pytest.raises(TransferError, match="side channel"):  # too long: no answer
            fetch_metadata(side.port, timeout_s=5, question=b"x" * (SideChannel.MAX_QUESTION + 1))
        assert fetch_metadata(side.port, question=b"again") == b"answer to again"
    finally:
        side.close()


def test_auto_picks_nixl_when_importable() -> None:
    with make_transport("auto", "auto-agent") as t:
        assert t.backend == ("nixl" if transport.nixl_available() else "shm")


def test_ucx_defaults_leave_the_users_settings() -> None:
    """The transport turns cuda_ipc GETs on (a consumer READs) unless the user chose."""
    env: dict[str, str] = {}
    assert transport.apply_ucx_defaults(env) == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    assert env == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    env = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto"}
    assert transport.apply_ucx_defaults(env) == {}
    assert env == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto"}


class _StateAgent:
    """A NIXL agent whose transfer reports `states` in turn (then the last one forever)."""

    def __init__(self, states: list[str]) -> None:
        self.states, self.calls = list(states), []

    def check_xfer_state(self, handle: object) -> str:
        self.calls.append("check")
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def release_xfer_handle(self, handle: object) -> None:
        self.calls.append("release")


@pytest.mark.skipif(not transport.nixl_available(), reason=NO_NIXL)
def test_nixl_cancel_waits_for_the_transfer_to_end(monkeypatch, caplog) -> None:
    """Releasing a handle does not stop device copies already queued (measured on the GPU):
    cancel returns once the transfer is DONE or ERR, then releases it; a transfer stuck past
    CANCEL_WAIT_S is released with a warning."""
    with transport.NixlTransport("cancel-wait") as t:
        real = t._agent
        try:
            t._agent = agent = _StateAgent(["PROC", "PROC", "DONE"])
            t.cancel(transport.Transfer("peer", b"", handle=object()))
            assert agent.calls == ["check"] * 3 + ["release"]
            t._agent = agent = _StateAgent(["PROC"])
            monkeypatch.setattr(transport.NixlTransport, "CANCEL_WAIT_S", 0.01)
            t.cancel(transport.Transfer("peer", b"", handle=object()))
            assert agent.calls[-1] == "release" and "bytes may still land" in caplog.text
        finally:
            t._agent = real


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_regions_is_one_transfer_over_every_item(backend: str) -> None:
    """One READ over items of three region pairs (layers and parts, as a request's READs): each
    item's segments land, nothing else is written, one handle, one notification once all
    landed; an item with no segment and a bad item (posting nothing) are handled."""
    gen = torch.Generator().manual_seed(1)
    with make_transport(backend, f"p-multi-{backend}") as prod, \
            make_transport(backend, f"d-multi-{backend}") as cons:
        srcs = {name: prod.allocate(name, n) for name, n in
                (("L0.kv", 4096), ("L0.index", 1024), ("L1.kv", 4096))}
        for t in srcs.values():
            t.copy_(torch.randint(1, 256, t.shape, dtype=torch.uint8, generator=gen))
        dsts = {name: cons.allocate(name, n) for name, n in (("a", 4096), ("b", 2048))}
        peer, back = cons.add_peer(prod.metadata()), prod.add_peer(cons.metadata())
        items = [("a", "L0.kv", [(0, 100, 300), (1000, 3000, 96)]),
                 ("b", "L0.index", [(0, 0, 1024)]),
                 ("a", "L1.kv", [(2000, 0, 500)]),
                 ("b", "L1.kv", [])]  # nothing of it: skipped
        xfer = cons.read_regions(peer, items, notify=b"req-multi")
        cons.wait(xfer, timeout_s=10)
        want = {name: torch.zeros_like(t) for name, t in dsts.items()}
        for local, remote, segs in items:
            for lo, ro, n in segs:
                want[local][lo: lo + n] = srcs[remote][ro: ro + n]
        for name, t in dsts.items():
            assert torch.equal(t, want[name]), name
        prod.wait_notification(back, b"req-multi", timeout_s=10)
        with pytest.raises(TransferTimeout):  # one notification, not one per item
            prod.wait_notification(back, b"req-multi", timeout_s=0.2)

        # every item checked before anything is posted: a bad one moves nothing
        dsts["a"].zero_()
        with pytest.raises(TransferError, match="outside"):
            cons.read_regions(peer, [("a", "L0.kv", [(0, 0, 8)]), ("b", "L1.kv", [(0, 0, 4096)])])
        # nothing of it in flight: a later transfer on the same agent lands alone
        cons.wait(cons.read_regions(peer, [("a", "L1.kv", [(8, 8, 8)])]), timeout_s=10)
        assert not bool(dsts["a"][:8].any()) and torch.equal(dsts["a"][8:16], srcs["L1.kv"][8:16])
        # nothing to move at all: done, the notification still goes
        cons.wait(cons.read_regions(peer, [("a", "L0.kv", [])], notify=b"empty"), timeout_s=10)
        prod.wait_notification(back, b"empty", timeout_s=10)


@pytest.mark.skipif(not transport.nixl_available(), reason=NO_NIXL)
def test_nixl_refuses_one_transfer_over_two_memory_kinds() -> None:
    """A NIXL descriptor list has one memory type: items into DRAM and VRAM are two transfers
    (the connector groups them by kind); mixing them is a clear error, before any posting."""
    import dataclasses

    with make_transport("nixl", "p-kinds") as prod, make_transport("nixl", "d-kinds") as cons:
        prod.allocate("src", 64)
        cons.allocate("host", 64)
        cons.allocate("gpu", 64)
        # a VRAM region's bookkeeping (no GPU here): refused before NIXL is asked anything
        cons.regions["gpu"] = dataclasses.replace(cons.regions["gpu"], mem="VRAM")
        peer = cons.add_peer(prod.metadata())
        with pytest.raises(TransferError, match="share one kind"):
            cons.read_regions(peer, [("host", "src", None), ("gpu", "src", None)])
