"""Ports picked together for servers this process starts are distinct and free (the P/D
launcher once gave its prefill server's HTTP listener the side channel's port)."""

from __future__ import annotations

import socket

from dsaserve.serve.ports import free_port, free_ports


def test_ports_picked_together_are_distinct_and_free() -> None:
    for _ in range(20):  # the kernel reused a released port this often before
        ports = free_ports(3)
        assert len(set(ports)) == 3
    ports = free_ports(16)
    assert len(set(ports)) == 16
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    assert 0 < free_port() < 65536
