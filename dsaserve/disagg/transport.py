"""Moving KV bytes between processes: one interface, two backends (shared memory, NIXL).

    producer (prefill rank)                         consumer (decode rank)
    ───────────────────────                         ──────────────────────
    t = make_transport("nixl" | "shm", name)        t = make_transport(..., name)
    buf = t.allocate("kv", nbytes)  # registered    dst = t.allocate("kv", nbytes)
    side = SideChannel(t.metadata)  # 127.0.0.1 ──► peer = t.add_peer(fetch_metadata(port))
                                                    h = t.read(peer, "kv", "kv", notify=b"req-1")
                                                    (or over several regions, one transfer:
                                                    h = t.read_regions(peer, [("L0.kv", "L0.kv",
                                                            segs0), ("L1.kv", …)], b"req-1"))
                                                    t.wait(h, timeout_s)      # bytes are here
                                                    (or t.poll(h) once a step: True when done)
    t.wait_notification(peer, b"req-1", timeout_s)  ◄── the notification: the producer may free
    (or the producer writes: t.write(...), and the consumer waits for the notification instead)

A transfer moves `segments` [(local offset, remote offset, nbytes)] between two registered
regions (the whole region by default), so a plan's runs can later become descriptors without a
staging copy; `read_regions` / `write_regions` post one transfer over several (local region,
remote region, segments) items, with one handle and one notification (`read` / `write` are its
one-item case): a request's READs cost one posting per peer, not one per layer and part. The
notification goes to the peer once the data has moved (NIXL's semantics: READ notifies the
data's owner, WRITE the receiver). Posting never moves the bytes itself: NIXL hands
them to UCX, shared memory to the transport's copy thread (`CopyThread`); `cancel` returns once
nothing more of that transfer can land, and `close` cancels whatever is still in flight.

Metadata travels over our own side channel bound to one address (127.0.0.1 by default, never a
wildcard); NIXL's metadata listener (which binds 0.0.0.0) stays off. A peer that dies gives a
`TransferError` when it is used, and a wait gives `TransferTimeout` after `timeout_s`: never a hang.
"""

from __future__ import annotations

import abc
import base64
import json
import logging
import mmap
import os
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dsaserve.disagg.shmcopy import CopyState, CopyThread

logger = logging.getLogger(__name__)

Segments = Sequence[tuple[int, int, int]]  # (local offset, remote offset, nbytes)
Item = tuple[str, str, Segments | None]  # (local region, remote region, segments) of a transfer


class TransferError(RuntimeError):
    """A transfer or a notification failed (dead peer, bad region, backend error)."""


class TransferTimeout(TransferError, TimeoutError):
    """Nothing arrived within the timeout (the peer may be dead or stuck)."""


@dataclass(frozen=True)
class Region:
    """A registered, contiguous byte range: ours (`tensor` set) or a peer's (from metadata)."""

    name: str
    nbytes: int
    address: int  # NIXL: the base address; shm: unused (0)
    path: str = ""  # shm: the backing file
    mem: str = "DRAM"  # NIXL memory type: "DRAM" (host) or "VRAM" (a GPU's)
    device: int = 0  # NIXL device id (the GPU index for VRAM)
    tensor: torch.Tensor | None = None  # [nbytes] uint8, local regions only


@dataclass
class Peer:
    name: str
    regions: dict[str, Region]
    notify_port: int = 0  # shm: the peer's notification listener on 127.0.0.1


class Transfer:
    """A posted transfer; `KVTransport.poll` (without blocking) or `wait` completes it."""

    def __init__(self, peer: str, notify: bytes, handle: object = None) -> None:
        self.peer, self.notify, self.handle = peer, notify, handle
        self.done = handle is None


class KVTransport(abc.ABC):
    """Register memory, tell peers about it, move bytes to or from their memory, notify."""

    backend: str

    def __init__(self, name: str) -> None:
        self.name = name
        self.regions: dict[str, Region] = {}
        self.peers: dict[str, Peer] = {}
        self._pending: dict[str, list[bytes]] = {}  # notifications polled, not yet waited for

    # ---- memory ------------------------------------------------------------------------------
    @abc.abstractmethod
    def allocate(self, name: str, nbytes: int) -> torch.Tensor:
        """A new registered region of `nbytes` >= 1 (a [nbytes] uint8 CPU tensor, zeroed)."""

    def register(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Register an existing contiguous tensor (e.g. a KV cache) as region `name`; returns
        its bytes as a flat uint8 view. Backends that can only move their own memory refuse."""
        raise TransferError(f"{self.backend} transport: it can only move memory it allocated "
                            "(allocate(), or descriptors.register_caches)")

    def _new_region(self, name: str, nbytes: int) -> None:
        if name in self.regions:
            raise TransferError(f"{self.name}: region {name!r} exists")
        if nbytes < 1:
            raise TransferError(f"{self.name}: region {name!r} needs >= 1 byte, got {nbytes}")

    def _region(self, name: str) -> Region:
        if name not in self.regions:
            raise TransferError(
                f"{self.name}: no local region {name!r} (have {list(self.regions)})")
        return self.regions[name]

    # ---- peers -------------------------------------------------------------------------------
    @abc.abstractmethod
    def metadata(self) -> bytes:
        """What a peer needs to reach this agent and its regions (call after allocating)."""

    @abc.abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Connect to the agent that produced `metadata`; returns its name."""

    def _peer_region(self, peer: str, name: str) -> Region:
        if peer not in self.peers:
            raise TransferError(f"{self.name}: unknown peer {peer!r} (add_peer first)")
        regions = self.peers[peer].regions
        if name not in regions:
            raise TransferError(f"{self.name}: peer {peer!r} has no region {name!r}")
        return regions[name]

    def _segments(self, local: Region, remote: Region, segments: Segments | None) -> Segments:
        if segments is None:
            if local.nbytes != remote.nbytes:
                raise TransferError(f"regions {local.name!r} ({local.nbytes} B) and "
                                    f"{remote.name!r} ({remote.nbytes} B) differ in size")
            return [(0, 0, local.nbytes)]
        for lo, ro, n in segments:
            if lo < 0 or ro < 0 or n < 0 or lo + n > local.nbytes or ro + n > remote.nbytes:
                raise TransferError(f"segment ({lo}, {ro}, {n}) is outside {local.name!r} "
                                    f"({local.nbytes} B) or {remote.name!r} ({remote.nbytes} B)")
        return segments

    def _items(self, peer: str, items: Sequence[Item]
               ) -> list[tuple[Region, Region, list[tuple[int, int, int]]]]:
        """Each item's regions and its non-empty segments, every item checked before any is
        posted (a bad one posts nothing)."""
        out = []
        for local, remote, segments in items:
            mine, theirs = self._region(local), self._peer_region(peer, remote)
            out.append((mine, theirs,
                        [s for s in self._segments(mine, theirs, segments) if s[2] > 0]))
        return out

    # ---- transfers ---------------------------------------------------------------------------
    def read(self, peer: str, local: str, remote: str, segments: Segments | None = None,
             notify: bytes = b"") -> Transfer:
        """Pull the peer's region `remote` into our region `local`; the peer gets `notify`."""
        return self._post("READ", peer, [(local, remote, segments)], notify)

    def write(self, peer: str, local: str, remote: str, segments: Segments | None = None,
              notify: bytes = b"") -> Transfer:
        """Push our region `local` into the peer's region `remote`; the peer gets `notify`."""
        return self._post("WRITE", peer, [(local, remote, segments)], notify)

    def read_regions(self, peer: str, items: Sequence[Item], notify: bytes = b"") -> Transfer:
        """One READ over several (local region, remote region, segments) items: one handle,
        done once every item landed, and one notification then. NIXL: the items' local regions
        share one memory kind (DRAM or VRAM), and their remote regions one (group by kind)."""
        return self._post("READ", peer, items, notify)

    def write_regions(self, peer: str, items: Sequence[Item], notify: bytes = b"") -> Transfer:
        """One WRITE over several items (as `read_regions`, the other way)."""
        return self._post("WRITE", peer, items, notify)

    @abc.abstractmethod
    def _post(self, op: str, peer: str, items: Sequence[Item], notify: bytes) -> Transfer:
        """Post one transfer ("READ": theirs → ours, "WRITE": ours → theirs) over `items`."""

    @abc.abstractmethod
    def poll(self, xfer: Transfer) -> bool:
        """Without blocking: True once `xfer` completed (its handle released), False while it is
        in flight; TransferError if it failed (NIXL's check_xfer_state)."""

    def cancel(self, xfer: Transfer) -> None:  # noqa: B027 (optional hook)
        """Give up on `xfer` still in flight; on return none of its bytes land any more (shm:
        exactly; NIXL: its handle released, which aborts the transfer)."""

    def wait(self, xfer: Transfer, timeout_s: float) -> None:
        """Block until `xfer` completed (polled until done); TransferError if it failed,
        TransferTimeout after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not self.poll(xfer):
            if time.monotonic() > deadline:
                raise TransferTimeout(
                    f"{self.name}: transfer with {xfer.peer!r} not done within {timeout_s} s "
                    "(is the peer alive?)")
            time.sleep(0.0002)

    @abc.abstractmethod
    def send_notification(self, peer: str, msg: bytes) -> None:
        """A notification not tied to a transfer (e.g. "nothing to read, free the blocks")."""

    @abc.abstractmethod
    def _poll_notifications(self) -> dict[str, list[bytes]]:
        """Notifications that arrived since the last call, by sender name."""

    def wait_notification(self, peer: str, msg: bytes, timeout_s: float) -> None:
        """Block until `peer` sent exactly `msg` (consumed); TransferTimeout otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            for sender, msgs in self._poll_notifications().items():
                self._pending.setdefault(sender, []).extend(msgs)
            pending = self._pending.get(peer, [])
            if msg in pending:
                pending.remove(msg)
                return
            self._check_peer_alive(peer)
            if time.monotonic() > deadline:
                raise TransferTimeout(
                    f"{self.name}: no notification {msg!r} from {peer!r} within {timeout_s} s")
            time.sleep(0.0005)

    def take_notifications(self) -> dict[str, list[bytes]]:
        """Every notification not yet waited for, by sender (consumed)."""
        for sender, msgs in self._poll_notifications().items():
            self._pending.setdefault(sender, []).extend(msgs)
        out, self._pending = self._pending, {}
        return out

    def _check_peer_alive(self, peer: str) -> None:  # noqa: B027 (optional hook)
        """Raise TransferError early when the backend knows `peer` is gone."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every region and connection (idempotent)."""

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- the side channel ------------------------------------------------------------------------
_WILDCARDS = {"", "0.0.0.0", "::", "*"}


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack("!Q", len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _recv_frame(sock: socket.socket) -> bytes:
    (n,) = struct.unpack("!Q", _recv_exact(sock, 8))
    return _recv_exact(sock, n)


def _listen(host: str, port: int) -> socket.socket:
    if host in _WILDCARDS:
        raise ValueError(f"side channel: refusing to listen on the wildcard address {host!r}; "
                         "bind one interface (127.0.0.1 on one machine)")
    sock = socket.create_server((host, port))
    return sock


class SideChannel:
    """Serves `payload()` (this agent's metadata) to whoever connects, on one address only.
    A client sends one frame first: empty for the payload, or a question that `ask` answers
    (the P/D producer's claim of a held request, disagg/connector.py)."""

    ASK_TIMEOUT_S = 5.0  # a client that connects and sends nothing is dropped after this
    MAX_QUESTION = 1 << 16  # bytes; a longer question is dropped unanswered

    def __init__(self, payload: Callable[[], bytes], host: str = "127.0.0.1",
                 port: int = 0, ask: Callable[[bytes], bytes] | None = None) -> None:
        self._payload, self._ask = payload, ask
        self._sock = _listen(host, port)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True, name="kv-side-channel")
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            with conn:
                try:
                    conn.settimeout(self.ASK_TIMEOUT_S)
                    (n,) = struct.unpack("!Q", _recv_exact(conn, 8))
                    if n > self.MAX_QUESTION:
                        continue
                    question = _recv_exact(conn, n)
                    answer = (self._ask(question) if question and self._ask is not None
                              else self._payload())
                    _send_frame(conn, answer)
                except (OSError, TransferError):
                    pass

    def close(self) -> None:
        """Stop serving: a bare close does not wake a thread blocked in accept (Linux), which
        would go on answering from a closed engine's state; shutdown does."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected / already closed
            pass
        self._sock.close()
        self._thread.join(timeout=1.0)


def fetch_metadata(port: int, host: str = "127.0.0.1", timeout_s: float = 10.0,
                   question: bytes = b"") -> bytes:
    """A peer's metadata from its SideChannel (or its answer to `question`); TransferError if
    it cannot be reached in time."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            _send_frame(sock, question)
            return _recv_frame(sock)
    except OSError as e:
        raise TransferError(f"side channel {host}:{port}: {e}") from e


# ---- shared memory ---------------------------------------------------------------------------
def _shm_dir() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def remove_shm_files(agent: str) -> int:
    """Unlink the /dev/shm files of a shm agent that died without closing (a killed process
    cannot); the number removed. For launchers and tests, once the agent is known dead."""
    removed = 0
    for path in _shm_dir().glob(f"dsaserve-kv-{agent}-*"):
        path.unlink(missing_ok=True)
        removed += 1
    return removed


class ShmTransport(KVTransport):
    """Regions are files in /dev/shm that a peer maps; a transfer is a memcpy by the initiator's
    copy thread (`shmcopy.CopyThread`: posted at once, polled, cancelled exactly). Notifications
    go over a 127.0.0.1 TCP connection per peer, which also tells when a peer died (its end
    closes). Single machine only."""

    backend = "shm"

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._maps: list[mmap.mmap] = []
        self._files: list[Path] = []
        self._remote: dict[tuple[str, str], torch.Tensor] = {}  # (peer, region) → mapped bytes
        self._out: dict[str, socket.socket] = {}  # peer → connection we send notifications on
        self._inbox: dict[str, list[bytes]] = {}
        self._gone: set[str] = set()  # peers whose notification connection closed
        self._pids: dict[str, int] = {}  # peer → process id (same machine)
        self._senders: set[str] = set()  # peers that opened a notification connection to us
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # the copy thread notifies too
        self.copies = CopyThread(f"shm-copy-{name}")
        self._listener = _listen("127.0.0.1", 0)
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="shm-notify").start()

    # notification plumbing: one reader thread per incoming connection
    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._read_notifications, args=(conn,), daemon=True).start()

    def _read_notifications(self, conn: socket.socket) -> None:
        sender = None
        try:
            sender = _recv_frame(conn).decode()
            with self._lock:
                self._senders.add(sender)
            while True:
                msg = _recv_frame(conn)
                with self._lock:
                    self._inbox.setdefault(sender, []).append(msg)
        except (OSError, ConnectionError):
            if sender is not None:
                with self._lock:
                    self._gone.add(sender)
        finally:
            conn.close()

    def allocate(self, name: str, nbytes: int) -> torch.Tensor:
        self._new_region(name, nbytes)
        path = _shm_dir() / f"dsaserve-kv-{self.name}-{name}-{uuid.uuid4().hex[:8]}"
        with open(path, "w+b") as f:
            f.truncate(nbytes)
            mapped = mmap.mmap(f.fileno(), nbytes)
        self._files.append(path)
        self._maps.append(mapped)
        tensor = torch.frombuffer(mapped, dtype=torch.uint8)  # [nbytes]
        self.regions[name] = Region(name, nbytes, 0, str(path), tensor=tensor)
        return tensor

    def metadata(self) -> bytes:
        return json.dumps({
            "backend": self.backend, "agent": self.name, "pid": os.getpid(),
            "notify_port": self._listener.getsockname()[1],
            "regions": {r.name: [r.nbytes, r.path] for r in self.regions.values()},
        }).encode()

    def add_peer(self, metadata: bytes) -> str:
        meta = json.loads(metadata)
        if meta.get("backend") != self.backend:
            raise TransferError(f"peer metadata is for {meta.get('backend')!r}, not shm")
        regions = {n: Region(n, nbytes, 0, path) for n, (nbytes, path) in meta["regions"].items()}
        self.peers[meta["agent"]] = Peer(meta["agent"], regions, meta["notify_port"])
        self._pids[meta["agent"]] = int(meta["pid"])
        return meta["agent"]

    def _remote_bytes(self, peer: str, name: str) -> torch.Tensor:
        region = self._peer_region(peer, name)
        key = (peer, name)
        if key not in self._remote:
            try:
                with open(region.path, "r+b") as f:
                    mapped = mmap.mmap(f.fileno(), region.nbytes)
            except OSError as e:
                raise TransferError(f"{self.name}: peer {peer!r} region {name!r}: {e} "
                                    "(is the peer alive?)") from e
            self._maps.append(mapped)
            self._remote[key] = torch.frombuffer(mapped, dtype=torch.uint8)[: region.nbytes]
        return self._remote[key]

    def _post(self, op: str, peer: str, items: Sequence[Item], notify: bytes) -> Transfer:
        """Checked here, copied on the copy thread as one job over every item (the
        notification once all their bytes moved)."""
        self._check_peer_alive(peer)
        pairs = []  # (destination, source) byte ranges, every item's
        for mine, theirs, segs in self._items(peer, items):
            remote = self._remote_bytes(peer, theirs.name)
            for lo, ro, n in segs:
                a, b = mine.tensor[lo: lo + n], remote[ro: ro + n]
                pairs.append((a, b) if op == "READ" else (b, a))

        def on_done() -> None:
            if notify:
                self.send_notification(peer, notify)
        return Transfer(peer, notify, self.copies.submit(pairs, on_done))

    def poll(self, xfer: Transfer) -> bool:
        if xfer.done:
            return True
        job = xfer.handle
        if job.state is CopyState.FAILED:
            xfer.done = True
            raise TransferError(f"{self.name}: transfer with {xfer.peer!r}: {job.error}")
        if job.state is not CopyState.DONE:
            return False  # queued or copying
        xfer.done = True
        return True

    def cancel(self, xfer: Transfer) -> None:
        if not xfer.done:
            self.copies.cancel(xfer.handle)  # exact: nothing of it lands after this
            xfer.done = True

    def send_notification(self, peer: str, msg: bytes) -> None:
        if peer not in self.peers:
            raise TransferError(f"{self.name}: unknown peer {peer!r} (add_peer first)")
        try:
            with self._send_lock:
                if peer not in self._out:
                    sock = socket.create_connection(
                        ("127.0.0.1", self.peers[peer].notify_port), timeout=5.0)
                    _send_frame(sock, self.name.encode())
                    self._out[peer] = sock
                _send_frame(self._out[peer], msg)
        except OSError as e:
            self._out.pop(peer, None)
            raise TransferError(f"{self.name}: cannot notify peer {peer!r}: {e} "
                                "(is the peer alive?)") from e

    def _poll_notifications(self) -> dict[str, list[bytes]]:
        with self._lock:
            inbox, self._inbox = self._inbox, {}
        return inbox

    def _check_peer_alive(self, peer: str) -> None:
        """A peer is gone when its process is (same machine), or when it closed the connection
        it notifies us on; notifications it sent before remain readable. A peer whose process
        exited while its connection is still being drained is given a moment, so that what it
        sent is read first (the reader thread marks the connection closed)."""
        deadline = time.monotonic() + 1.0
        while True:
            with self._lock:
                if self._inbox.get(peer):  # unread mail: read it before declaring the peer gone
                    return
                gone = peer in self._gone  # its connection closed, every frame before read
                connected = peer in self._senders
            if not gone:
                if not self._process_exited(peer):
                    return
                gone = not connected or time.monotonic() > deadline
            if gone:
                raise TransferError(f"{self.name}: peer {peer!r} is gone (its process exited)")
            time.sleep(0.01)

    def _process_exited(self, peer: str) -> bool:
        try:
            os.kill(self._pids[peer], 0)
        except ProcessLookupError:
            return True
        except (KeyError, PermissionError):  # unknown pid, or alive as another user
            pass
        return False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.copies.close()  # first: no copy or notification runs after this
        self._listener.close()
        for sock in self._out.values():
            sock.close()
        self._remote.clear()
        for path in self._files:
            path.unlink(missing_ok=True)
        # The maps stay open until garbage collection: a tensor a caller still holds keeps
        # pointing at valid memory (the file is already unlinked).
        self.regions.clear()


# ---- NIXL ------------------------------------------------------------------------------------
def nixl_available() -> bool:
    return _import_nixl() is not None


def _import_nixl():
    """nixl's agent API: the `nixl` meta package, or `nixl_cu12` / `nixl_cu13` installed alone."""
    for module in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return __import__(module, fromlist=["nixl_agent"])
        except ImportError:
            continue
    return None


# UCX settings the transport applies unless the user set them (read when the backend is made).
# A consumer pulls (READ = a UCX GET). UCX's cuda_ipc serves GETs only where it detects NVLink
# ("auto"); elsewhere (GPUs on PCIe, or both engines on one GPU) a GET of GPU memory falls back
# to a staged path: a READ of VRAM between two processes on one H100 ran at 0.69 GB/s, and at
# 271 GB/s with this setting (docs/disagg.md). A GET over cuda_ipc is a device copy from the
# mapped peer allocation, the same copy a PUT makes, so it is turned on.
UCX_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}


def apply_ucx_defaults(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set each of UCX_DEFAULTS the environment lacks → the ones set (a user's value wins)."""
    applied = {k: v for k, v in UCX_DEFAULTS.items() if k not in environ}
    environ.update(applied)
    return applied


class NixlTransport(KVTransport):
    """NIXL agent with the UCX backend on host (DRAM) or GPU (VRAM) memory. UCX's peer error
    handling is off ("none"), which shared-memory transports need; a dead peer then surfaces as
    a timeout. UCX_DEFAULTS are applied to the environment first."""

    backend = "nixl"
    CANCEL_WAIT_S = 10.0  # `cancel` waits this long at most for a transfer to end

    def __init__(self, name: str, progress_thread: bool | None = None) -> None:
        api = _import_nixl()
        if api is None:
            raise TransferError("nixl is not installed (pip install 'dsaserve[nixl]')")
        super().__init__(name)
        # No listener thread: NIXL's own metadata listener binds every interface.
        # The progress thread (`progress_thread`; default: on where CUDA is, as vLLM runs NIXL)
        # polls UCX without pause, a core per agent. Without it transfers progress only when
        # this agent is polled (wait, notifications): enough for host memory, where a READ is
        # one-sided, but a READ of GPU memory stalled on the H200 while the source agent was
        # not polled (UCX's GPU protocols need the target's progress too).
        if progress_thread is None:
            progress_thread = torch.cuda.is_available()
        config = api.nixl_agent_config(enable_prog_thread=progress_thread,
                                       enable_listen_thread=False, backends=[])
        apply_ucx_defaults()
        self._agent = api.nixl_agent(name, config)
        self._agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
        self._reg: list[object] = []
        self._in_flight: set[Transfer] = set()  # posted, handle not yet released: close cancels
        self._closed = False

    def allocate(self, name: str, nbytes: int) -> torch.Tensor:
        self._new_region(name, nbytes)  # refuses nbytes < 1 before allocating
        return self.register(name, torch.zeros(nbytes, dtype=torch.uint8))  # [nbytes]

    def register(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_contiguous():
            raise TransferError(f"{self.name}: region {name!r} must be a contiguous tensor")
        flat = tensor.reshape(-1).view(torch.uint8)  # [nbytes], the same memory
        self._new_region(name, flat.numel())
        self._reg.append(self._agent.register_memory(flat))
        mem = "VRAM" if flat.is_cuda else "DRAM"
        self.regions[name] = Region(name, flat.numel(), flat.data_ptr(), mem=mem,
                                    device=flat.device.index or 0, tensor=flat)
        return flat

    def metadata(self) -> bytes:
        return json.dumps({
            "backend": self.backend, "agent": self.name,
            "nixl": base64.b64encode(self._agent.get_agent_metadata()).decode(),
            "regions": {r.name: [r.nbytes, r.address, r.mem, r.device]
                        for r in self.regions.values()},
        }).encode()

    def add_peer(self, metadata: bytes) -> str:
        meta = json.loads(metadata)
        if meta.get("backend") != self.backend:
            raise TransferError(f"peer metadata is for {meta.get('backend')!r}, not nixl")
        name = self._agent.add_remote_agent(base64.b64decode(meta["nixl"]))
        # add_remote_agent returns bytes while notifications are keyed by str: one name, as str.
        name = name.decode() if isinstance(name, bytes) else name
        regions = {n: Region(n, nbytes, addr, mem=mem, device=dev)
                   for n, (nbytes, addr, mem, dev) in meta["regions"].items()}
        self.peers[name] = Peer(name, regions)
        return name

    def _post(self, op: str, peer: str, items: Sequence[Item], notify: bytes) -> Transfer:
        """One descriptor list per side over every item's segments, one NIXL request."""
        checked = [(mine, theirs, segs) for mine, theirs, segs in self._items(peer, items)
                   if segs]
        if not checked:
            if notify:
                self.send_notification(peer, notify)
            return Transfer(peer, notify)
        # a descriptor list has one memory type: a transfer over DRAM and VRAM is two
        kinds = ({mine.mem for mine, _, _ in checked}, {theirs.mem for _, theirs, _ in checked})
        if len(kinds[0]) > 1 or len(kinds[1]) > 1:
            raise TransferError(
                f"{self.name}: one {op} over local memory {sorted(kinds[0])} and remote memory "
                f"{sorted(kinds[1])}: a transfer's regions share one kind on each side; post "
                "one transfer per (local kind, remote kind)")
        local_descs = self._agent.get_xfer_descs(
            [(mine.address + lo, n, mine.device)
             for mine, _, segs in checked for lo, _, n in segs], checked[0][0].mem)
        remote_descs = self._agent.get_xfer_descs(
            [(theirs.address + ro, n, theirs.device)
             for _, theirs, segs in checked for _, ro, n in segs], checked[0][1].mem)
        try:
            handle = self._agent.initialize_xfer(op, local_descs, remote_descs, peer, notify)
            state = self._agent.transfer(handle)
        except Exception as e:  # nixl raises its own exception types
            raise TransferError(f"{self.name}: {op} with {peer!r} failed to start: {e}") from e
        if state == "ERR":
            raise TransferError(f"{self.name}: {op} with {peer!r} failed to start")
        xfer = Transfer(peer, notify, handle)
        self._in_flight.add(xfer)
        return xfer

    def poll(self, xfer: Transfer) -> bool:
        if xfer.done:
            return True
        try:
            state = self._agent.check_xfer_state(xfer.handle)
        except Exception as e:
            raise TransferError(f"{self.name}: transfer with {xfer.peer!r}: {e}") from e
        if state == "ERR":
            self.cancel(xfer)  # its handle released
            raise TransferError(f"{self.name}: transfer with {xfer.peer!r} failed")
        if state != "DONE":
            return False
        xfer.done = True
        self._in_flight.discard(xfer)
        self._agent.release_xfer_handle(xfer.handle)
        return True

    def cancel(self, xfer: Transfer) -> None:
        """Returns once the transfer is over (DONE or ERR), then releases its handle. Releasing
        alone does not stop it: on the H100 a 1 GiB VRAM READ over cuda_ipc, its handle
        released while in flight, still landed afterwards (tests/gpu/test_nixl_cancel_gpu.py),
        since the device copies UCX queued cannot be recalled. At the rates measured (hundreds
        of GB/s) the wait is milliseconds; past CANCEL_WAIT_S (a stuck peer) the handle is
        released anyway and a warning says that bytes may still land."""
        if xfer.done:
            return
        xfer.done = True
        self._in_flight.discard(xfer)
        deadline = time.monotonic() + self.CANCEL_WAIT_S
        try:
            while self._agent.check_xfer_state(xfer.handle) == "PROC":
                if time.monotonic() > deadline:
                    logger.warning("%s: a cancelled transfer with %r is still in progress after "
                                   "%.0f s; its handle is released, bytes may still land",
                                   self.name, xfer.peer, self.CANCEL_WAIT_S)
                    break
                time.sleep(0.0005)
        except Exception:  # the state is unknown (failed transfer, agent gone): release it
            pass
        try:
            self._agent.release_xfer_handle(xfer.handle)
        except Exception:  # best effort: the transfer may have failed already
            pass

    def send_notification(self, peer: str, msg: bytes) -> None:
        if peer not in self.peers:
            raise TransferError(f"{self.name}: unknown peer {peer!r} (add_peer first)")
        try:
            self._agent.send_notif(peer, msg)
        except Exception as e:
            raise TransferError(f"{self.name}: cannot notify {peer!r}: {e}") from e

    def _poll_notifications(self) -> dict[str, list[bytes]]:
        notifs = self._agent.get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else k): list(v) for k, v in notifs.items()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for xfer in list(self._in_flight):  # before the memory they move goes
            self.cancel(xfer)
        for peer in list(self.peers):
            try:
                self._agent.remove_remote_agent(peer)
            except Exception:  # best effort: the peer may already be gone
                pass
        for reg in self._reg:
            self._agent.deregister_memory(reg)
        self._reg.clear()
        self.regions.clear()


# ---- the registry ----------------------------------------------------------------------------
TRANSPORTS: dict[str, type[KVTransport]] = {"shm": ShmTransport, "nixl": NixlTransport}


def make_transport(backend: str, name: str) -> KVTransport:
    """`backend`: "shm", "nixl", or "auto" (NIXL when importable, else shared memory)."""
    if backend == "auto":
        backend = "nixl" if nixl_available() else "shm"
    if backend not in TRANSPORTS:
        raise ValueError(f"kv transport: unknown backend {backend!r}; known: "
                         f"{sorted(TRANSPORTS)} or 'auto'")
    return TRANSPORTS[backend](name)
