"""Is the rendezvous port free? Checked on the master node before any rank starts.

Rank 0 opens torch.distributed's TCPStore on MASTER_PORT. If another process already listens
there, rank 0 fails to bind and the other ranks talk to that process instead, dying with
"Connection reset by peer" and no word about the port; so the node that hosts rank 0 probes the
port first and refuses to start with a message that names the port and --master_port.
"""
from __future__ import annotations

import errno
import os
import socket

# torch's agent-store mode: the ranks join a store someone else already serves on MASTER_PORT
_AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


class MasterPortInUseError(RuntimeError):
    """The rendezvous port cannot be listened on by rank 0 (taken, or not permitted)."""


def _bind_error(family: socket.AddressFamily, host: str, port: int) -> OSError | None:
    """The error binding a listening socket to (host, port) would give, or None."""
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        return None  # this family is not available here (IPv6 off): nothing can listen on it either
    with sock:
        # as the TCPStore does: a port whose last connection lingers in TIME_WAIT counts as free
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind((host, port))
            sock.listen(1)
        except OSError as err:
            if err.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                return None  # no such address on this host (IPv6 without an address)
            return err
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def check_master_port(port: int, master_addr: str) -> None:
    """Raises MasterPortInUseError when rank 0 could not listen on `port` on this node."""
    if os.environ.get(_AGENT_STORE_ENV, "").lower() in ("1", "true"):
        return  # the port is meant to be served already
    # every local address, IPv4 and IPv6: the store listens on all of them
    for family, host in ((socket.AF_INET, ""), (socket.AF_INET6, "::")):
        err = _bind_error(family, host, port)
        if err is None:
            continue
        if err.errno == errno.EADDRINUSE:
            why = "is already in use by another process on this node (another job or test still running?)"
        else:
            why = f"cannot be listened on ({err.strerror or err})"
        raise MasterPortInUseError(
            f"deepspeed_c launcher: the rendezvous port {port} (--master_port; rank 0 listens on it at "
            f"{master_addr}) {why}. Expected a free port: pass another one, e.g. --master_port={_free_port()}, "
            f"or stop whatever holds port {port}. No rank was started.")
