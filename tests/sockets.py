"""What the kernel says about this process's TCP connections on loopback (from /proc/net/tcp{,6}).

A test uses it to know that a request it sent sits unread in a stopped process's socket, instead of
sleeping and hoping it got there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["unread_bytes_from_me"]

_ESTABLISHED = "01"


@dataclass(frozen=True)
class _Socket:
    local_port: int
    remote_port: int
    state: str
    rx_queue: int
    inode: int


def _sockets() -> list[_Socket]:
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            # sl local_address rem_address st tx_queue:rx_queue tr:when retrnsmt uid timeout inode ...
            fields = line.split()
            local, remote, state, queues, inode = fields[1], fields[2], fields[3], fields[4], fields[9]
            found.append(
                _Socket(
                    local_port=int(local.rsplit(":", 1)[1], 16),
                    remote_port=int(remote.rsplit(":", 1)[1], 16),
                    state=state,
                    rx_queue=int(queues.split(":")[1], 16),
                    inode=int(inode),
                )
            )
    return found


def _my_socket_inodes() -> set[int]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def unread_bytes_from_me(server_port: int) -> int:
    """Bytes that connections of this process to ``server_port`` (on loopback) have sent and the server
    has not read yet: what waits in its sockets' receive queues."""
    sockets = _sockets()
    mine = _my_socket_inodes()
    my_ports = {s.local_port for s in sockets if s.inode in mine and s.remote_port == server_port}
    return sum(
        s.rx_queue
        for s in sockets
        if s.local_port == server_port and s.remote_port in my_ports and s.state == _ESTABLISHED
    )
