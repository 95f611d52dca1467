"""Pieces of the training state moved between trainers, host to host, over plain TCP.

Every trainer of an epoch of more than one process runs a ``PieceServer`` (an epoch of one fetches
nothing and opens no socket): it serves the pieces its process holds (its own snapshots and the buddy
copies it keeps) to any member that asks, by restore point and key. A restore fetches the
cells a process lacks from the members ``cells.plan_fetch`` picked; a buddy refresh fetches a
peer's own pieces of a step. Not the JAX coordination service's key-value
store: it holds every value in process 0 and compresses it (seconds for tens of megabytes here).

Wire format, one request per connection: the client sends one JSON line
``{"step": S, "layout": E, "keys": [[leaf, cell], ...], "pin": bool}``; the server answers one JSON
line, either ``{"ok": true, "arrays": [[dtype, shape], ...]}`` followed by the raw bytes of each
array in order (C order, this machine's byte order), or ``{"ok": false, "error": "..."}``. A dtype
goes by its name ('bfloat16', 'float8_e4m3fn', 'int4', ...: ``remesh.elastic.dtypes``) and its
bytes as they are, so every dtype JAX uses arrives bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import structlog

from remesh.elastic.cells import Cell, RestorePoint, decode_key, encode_key
from remesh.elastic.dtypes import as_bytes, dtype_name, dtype_of

__all__ = [
    "FetchFailed",
    "PieceServer",
    "Pieces",
    "RestorePoint",
    "advertised_host",
    "beside_training",
    "demote_threads",
    "fetch",
    "lower_priority",
]

log = structlog.get_logger("remesh.elastic")

# (leaf index, cell) -> values
Pieces = dict[tuple[int, Cell], np.ndarray]
_CHUNK = 4 << 20
_HEADER_MAX = 64 << 20


class PieceServer:
    """Serves the pieces ``lookup(point)`` returns, from a background thread, until ``close``."""

    def __init__(
        self,
        lookup: Callable[[RestorePoint], Mapping[tuple[int, Cell], np.ndarray]],
        on_copied: Callable[[int], None] | None = None,
    ) -> None:
        self._lookup = lookup
        self._on_copied = on_copied
        self._listener = socket.create_server(("", 0), family=socket.AF_INET)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._serve, name="remesh-pieces", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept
        with contextlib.suppress(OSError):
            self._listener.close()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), name="remesh-piece", daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(30.0)
            reader = conn.makefile("rb")
            request = json.loads(reader.readline(_HEADER_MAX))
            point = (int(request["step"]), int(request["layout"]))
            held = self._lookup(point)
            keys = [decode_key(k) for k in request["keys"]]
            missing = [k for k in keys if k not in held]
            if missing:
                header = {"ok": False, "error": f"{len(missing)} of {len(keys)} pieces not held at {point}"}
                conn.sendall(json.dumps(header).encode() + b"\n")
                return
            arrays = [held[k] for k in keys]
            try:
                described = [[dtype_name(a.dtype), list(a.shape)] for a in arrays]
            except ValueError as exc:
                conn.sendall(json.dumps({"ok": False, "error": str(exc)}).encode() + b"\n")
                return
            if request.get("pin"):
                lower_priority()  # a buddy copy, beside training (a restore's fetch goes first)
            if request.get("pin") and self._on_copied is not None:
                # A buddy copies this step whole: keep it until a newer one is copied. Pinned before
                # the bytes go, so the step is kept by the time the copier holds its copy.
                self._on_copied(point[0])
            header = {"ok": True, "arrays": described}
            conn.sendall(json.dumps(header).encode() + b"\n")
            for a in arrays:
                conn.sendall(as_bytes(a))


class FetchFailed(Exception):
    """A member could not serve the pieces asked for (gone, or no longer holds them)."""


def fetch(
    address: str, point: RestorePoint, keys: Iterable[tuple[int, Cell]], timeout_s: float, pin: bool = False
) -> Pieces:
    """The pieces ``keys`` of restore point ``point`` from the member serving at ``address``.

    ``pin``: the caller keeps this as its buddy copy, so the server keeps the step (``on_copied``).
    """
    keys = list(keys)
    if not keys:
        return {}
    host, _, port = address.rpartition(":")
    request = {"step": point[0], "layout": point[1], "keys": [encode_key(k) for k in keys], "pin": pin}
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as conn:
            conn.sendall(json.dumps(request).encode() + b"\n")
            reader = conn.makefile("rb")
            header = json.loads(reader.readline(_HEADER_MAX))
            if not header.get("ok"):
                raise FetchFailed(f"{address}: {header.get('error', 'refused')}")
            out: Pieces = {}
            for key, (dtype, shape) in zip(keys, header["arrays"], strict=True):
                array = np.empty(shape, dtype=dtype_of(dtype))
                _read_into(reader, as_bytes(array))  # a view of the array: filled in place
                out[key] = array
            return out
    except (OSError, ValueError) as exc:
        raise FetchFailed(f"{address}: {exc}") from exc


def lower_priority(by: int = 9) -> None:
    """Lower the calling thread's CPU priority (Linux: a thread's niceness is its own): for copies
    made beside training. The step's collectives wait for the slowest process, so a core taken from
    one trainer by its background copies slows every trainer down; at the lowest priority they run
    in the step's idle moments instead. A no-op where the platform has no per-thread priority."""
    try:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + by))
    except (AttributeError, OSError):
        pass


def beside_training(name: str) -> ThreadPoolExecutor:
    """One thread for work beside training (snapshots, buddy copies, checkpoints), at a lower CPU
    priority than the loop (``lower_priority``)."""
    return ThreadPoolExecutor(1, name, initializer=lower_priority)


def demote_threads(prefix: str) -> None:
    """Give every thread of this process whose name starts with ``prefix`` at least the calling
    thread's niceness (Linux only; elsewhere, and where a thread is gone meanwhile, nothing
    happens).

    For pools that C++ libraries start on first use: their workers keep the priority of the thread
    that happened to start them. Tensorstore's (Orbax's I/O) started by a restore on the training
    loop's thread would otherwise run every later background save at the step's priority."""
    try:
        mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        tasks = os.listdir("/proc/self/task")
    except (AttributeError, OSError):
        return
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if not f.read().startswith(prefix):
                    continue
            tid = int(task)
            if os.getpriority(os.PRIO_PROCESS, tid) < mine:
                os.setpriority(os.PRIO_PROCESS, tid, mine)
        except (OSError, ValueError):
            continue


def advertised_host(peer: str, override: str | None = None) -> str:
    """The address of this machine that ``peer`` (host:port) reaches it on: ``override`` where given
    (``Policy.peer_host``), else the source address the kernel picks for a route to it."""
    if override:
        return override
    host = peer.rpartition(":")[0].strip("[]") or "127.0.0.1"
    try:
        # Opening the socket may fail too: some hosts allow no TCP/UDP socket at all.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(host), 9))
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _read_into(reader: Any, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = reader.readinto(view[got : got + _CHUNK])
        if not n:
            raise ConnectionError("connection closed in the middle of a piece")
        got += n
