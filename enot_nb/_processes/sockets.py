"""The TCP connections of a process, read from ``/proc``: how a session rank finds the connections
it shares with its peers, to shut them down when it aborts its groups (a peer waiting in a gloo
collective is then released).

A peer is named by the ends of its own TCP sockets, ``(address, port)``: its host (the kernel for
local ranks, a Ray node's agent for its rank) reads them from ``/proc/<pid>``, and a rank shuts
down each of its connections whose other end is one of them. Ends, not pids, so that a rank on
another node, whose pid means nothing here, is named too. Addresses are parsed (IPv4 inside IPv6
unwrapped), as two sides of a connection may list it in ``/proc/net/tcp`` and ``tcp6``.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Iterable

End = tuple[str, int]
"""One end of a TCP connection: its address (as ``ipaddress`` writes it) and port."""


def ends_of(pids: Iterable[int]) -> tuple[End, ...]:
    """The local ends of every TCP socket the processes ``pids`` hold (nothing for a pid that
    ``/proc`` cannot tell about: gone, or another user's)."""
    table = _tcp_connections()
    found: set[End] = set()
    for pid in pids:
        for inode in _socket_inodes(pid):
            if inode in table:
                found.add(table[inode][0])
    return tuple(sorted(found))


def connections_to(ends: Iterable[End]) -> list[int]:
    """This process's descriptors of TCP connections whose other end is one of ``ends``."""
    wanted = set(ends)
    table = _tcp_connections()
    return [fd for inode, fd in _socket_inodes(os.getpid()).items() if inode in table and table[inode][1] in wanted]


def _socket_inodes(pid: int) -> dict[int, int]:
    """inode -> descriptor of each socket ``pid`` holds (nothing if /proc cannot tell)."""
    inodes = {}
    folder = f"/proc/{pid}/fd"
    try:
        names = os.listdir(folder)
    except OSError:
        return {}
    for name in names:
        try:
            target = os.readlink(f"{folder}/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes[int(target[8:-1])] = int(name)
    return inodes


def _tcp_connections() -> dict[int, tuple[End, End]]:
    """inode -> (local end, remote end) of every TCP socket in this network namespace."""
    table = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as lines:
                next(lines)
                for line in lines:
                    fields = line.split()
                    table[int(fields[9])] = (_end(fields[1]), _end(fields[2]))
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return table


def _end(text: str) -> End:
    """``/proc/net/tcp``'s ``0100007F:1F90`` (the address as the kernel stores it: 32-bit words
    in this machine's byte order) as ``("127.0.0.1", 8080)``."""
    address, port = text.split(":")
    words = bytes.fromhex(address)
    if _LITTLE:
        words = b"".join(words[i : i + 4][::-1] for i in range(0, len(words), 4))
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address
    if len(words) == 4:
        ip = ipaddress.IPv4Address(words)
    else:
        ip = ipaddress.IPv6Address(words)
        ip = ip.ipv4_mapped or ip
    return str(ip), int(port, 16)


_LITTLE = sys.byteorder == "little"
