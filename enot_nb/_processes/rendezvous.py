"""Where the workers of a launch meet, and what they expose.

* One node (the default): a FileStore in a private temporary folder (mode 0700). torch 2.13's
  TCP store stalled ``init_process_group`` for 5 s in about 2% of launches here; the file store
  never did. With ``master_port`` given, a TCP store bound to loopback (127.0.0.1, or ::1).
* Several nodes: a TCP store bound to ``master_addr`` (an IP literal, or the address its host
  name resolved to once, in the launching process), not to every interface.

torch's own ``env://`` store listens on every interface whatever ``MASTER_ADDR`` says, so
global rank 0 binds the listening socket itself and hands it to the store (``master_listen_fd``),
through the ``enot-tcp://`` rendezvous registered here. On one node the collectives stay on
loopback too: ``GLOO_SOCKET_IFNAME=lo`` unless the user chose an interface.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlparse

from enot_nb._defaults import DEFAULT_TIMEOUT

SCHEME = "enot-tcp"
_LISTENING: list[socket.socket] = []
LOOPBACK_INTERFACE = "lo"


def resolve(address: str) -> str:
    """An IP literal for ``address``, resolved once; OSError if it cannot be."""
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        pass
    infos = socket.getaddrinfo(address, None, proto=socket.IPPROTO_TCP)
    return str(infos[0][4][0])  # an IPv4 or IPv6 sockaddr's host: already a str


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def loopback_for(address: str) -> str:
    """The loopback address of ``address``'s family."""
    return "::1" if ipaddress.ip_address(address).version == 6 else "127.0.0.1"


def url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"{SCHEME}://{host}:{port}"


def listen(address: str, port: int) -> socket.socket:
    """A socket listening on ``address:port`` only (SO_REUSEADDR, as torch's store sets)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(512)
    except BaseException:
        sock.close()
        raise
    return sock


def free_port(address: str) -> int:
    """A port on ``address`` that nothing listens on now."""
    with listen(address, 0) as sock:
        return sock.getsockname()[1]


def _handler(
    address_url: str, timeout: datetime.timedelta = DEFAULT_TIMEOUT, **_: Any
) -> Iterator[tuple[Any, int, int]]:
    from torch.distributed import TCPStore

    parsed = urlparse(address_url)
    query = {k: v[0] for k, v in parse_qs(parsed.query).items()}
    rank, world_size = int(query["rank"]), int(query["world_size"])
    host, port = parsed.hostname or "", int(parsed.port or 0)
    if rank == 0:
        sock = listen(host, port)
        try:
            store = TCPStore(host, port, world_size, True, timeout, master_listen_fd=sock.fileno())
        except NotImplementedError:  # torch 2.4's libuv store (its default) serves on no given socket
            store = TCPStore(host, port, world_size, True, timeout, master_listen_fd=sock.fileno(), use_libuv=False)
        _LISTENING.append(sock)  # the store serves on it for the life of the process
    else:
        store = TCPStore(host, port, world_size, False, timeout)
    yield (store, rank, world_size)
    raise RuntimeError(f"{SCHEME}:// cannot rendezvous again")


def register() -> None:
    """Make ``enot-tcp://`` known to torch.distributed (in a worker, before init_torch)."""
    import importlib

    # The module, not torch.distributed.rendezvous (a function of the same name).
    module = importlib.import_module("torch.distributed.rendezvous")
    if SCHEME not in module._rendezvous_handlers:
        module.register_rendezvous_handler(SCHEME, _handler)
