"""A rank names its peers by the ends of their TCP sockets (_processes/sockets): real sockets on
loopback, IPv4 and IPv4 inside IPv6, read back from /proc."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from enot_nb._processes import sockets


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6], ids=["ipv4", "ipv6-dual-stack"])
def test_a_connection_is_found_by_the_other_ends_listed_for_it(family):
    server = socket.socket(family)
    server.bind(("::" if family == socket.AF_INET6 else "127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    try:
        mine = sockets.ends_of([os.getpid()])
        assert ("127.0.0.1", port) in mine and client.getsockname()[:2] in mine
        # The server's side of the connection holds the client's end as its other end, and the
        # client's side the server's (listed in tcp6 as ::ffff:127.0.0.1 when dual-stack).
        assert sockets.connections_to([client.getsockname()[:2]]) == [accepted.fileno()]
        assert sockets.connections_to([("127.0.0.1", port)]) == [client.fileno()]
        assert sockets.connections_to([("127.0.0.2", port)]) == []
    finally:
        for s in (client, accepted, server):
            s.close()


def test_the_ends_of_another_process_are_read_and_a_gone_one_has_none():
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
            "print(s.getsockname()[1], flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(child.stdout.readline())
        assert ("127.0.0.1", port) in sockets.ends_of([child.pid])
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert sockets.ends_of([child.pid]) == ()
