"""Free TCP ports on 127.0.0.1 for servers this process starts (the P/D launcher, benchmarks).

Each port is free when picked; another process may still take it before the server binds. Ports
picked together are distinct: their sockets are all held until the last one is bound (a socket
closed before the next bind lets the kernel hand out the same port again, which once gave the
P/D launcher's prefill server its own side channel's port).
"""

from __future__ import annotations

import socket
from contextlib import ExitStack


def free_ports(n: int) -> tuple[int, ...]:
    """`n` distinct ports free on 127.0.0.1 now."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                 for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return tuple(s.getsockname()[1] for s in socks)


def free_port() -> int:
    """One port free on 127.0.0.1 now."""
    return free_ports(1)[0]
