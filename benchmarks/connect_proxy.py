"""An HTTP CONNECT proxy on loopback that cuts one agent off from its coordinators: a network partition
that needs no privilege. The soak (``benchmarks/chaos.py``) puts one in front of every agent;
``tests/test_partition.py`` cuts one host off with it.

An agent started with ``grpc_proxy=http://127.0.0.1:PORT`` in its environment opens every gRPC
connection through this proxy: to each configured coordinator address and also to the leader a
follower names in its refusal. A plain TCP relay in front of each replica would be bypassed by that
hint (the agent would dial the leader's advertised address directly); a CONNECT proxy sees every
connection the agent makes, whatever address it dials. The trainer the agent starts must not
inherit the variable (run it under ``env -u grpc_proxy``): its own connections are not the link
being cut.

It forwards to the addresses it is given (the coordinators') and refuses every other target, so a
process that reaches its port gets no way to the machine's other loopback services.

``cut(mode)`` partitions the agent. The connections that are open at the cut

- ``"silent"`` (a pulled cable): stay open but carry nothing either way (what arrives is read and
  discarded), so neither end is told anything; only its own keepalives and deadlines show the link
  is gone;
- ``"reset"`` (a link that resets): are closed, so both ends see the connection end at once.

Either way new connections are accepted but never answered. ``restore()`` heals it: the connections
that lived through the cut are closed (their byte streams have a hole in them) and new ones are
forwarded again.

The proxy runs its event loop in a daemon thread, so synchronous code drives it; ``close()`` stops it.
Run as a process (``python benchmarks/connect_proxy.py --target HOST:PORT [--target ...] --port-file
F``) it is cut silently by SIGUSR1, restored by SIGUSR2 and stopped by SIGTERM, so a process that
injects faults needs no control channel. It imports nothing but the standard library, so it runs by
its path from any working directory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Coroutine, Iterable
from pathlib import Path
from types import FrameType
from typing import Any, Literal

__all__ = ["ConnectProxy", "CutMode", "main"]

CutMode = Literal["silent", "reset"]

_CHUNK = 65536
# A CONNECT request is one line and a few headers; anything longer is not a gRPC client's.
_MAX_REQUEST = 8192
_REQUEST_TIMEOUT_S = 5.0
_CONNECT_TIMEOUT_S = 5.0
# How long a caller waits for the proxy's loop to carry out a cut, a restore or a close.
_CALL_TIMEOUT_S = 10.0


def _endpoint(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT`` too) as the pair a CONNECT request is matched against."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


class _Tunnel:
    """One client connection and, once established, its upstream connection."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.writers = [client]
        # Set by a cut: from then on nothing is forwarded either way; closed at the restore.
        self.severed = False

    def close(self) -> None:
        for writer in self.writers:
            with contextlib.suppress(Exception):
                writer.close()


class ConnectProxy:
    """Serves CONNECT tunnels to ``targets`` on ``127.0.0.1:port`` (0: a free port) until cut."""

    def __init__(self, targets: Iterable[str], port: int = 0) -> None:
        self.targets = frozenset(_endpoint(t) for t in targets)
        if not self.targets:
            raise ValueError("a proxy with no target forwards nothing: give it the coordinators' addresses")
        self.is_cut = False
        # Counters, for logs and tests: tunnels opened, and connections held unanswered while cut.
        self.opened = 0
        self.held = 0
        self._tunnels: set[_Tunnel] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="connect-proxy", daemon=True)
        self._thread.start()
        try:
            self._server: asyncio.Server = self._call(asyncio.start_server(self._accept, "127.0.0.1", port))
        except BaseException:
            self.close()
            raise
        self.port = int(self._server.sockets[0].getsockname()[1])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self, mode: CutMode = "silent") -> None:
        """Partition: the open connections go silent or are closed (``mode``); new ones get no answer."""
        self._call(self._cut(mode))

    def restore(self) -> None:
        """Heal the partition: close what the cut left open; new connections are forwarded again."""
        self._call(self._restore())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(_CALL_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> ConnectProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- in the proxy's loop ---------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=_CALL_TIMEOUT_S)

    async def _cut(self, mode: CutMode) -> None:
        self.is_cut = True
        for tunnel in self._tunnels:
            tunnel.severed = True
            if mode == "reset":
                tunnel.close()

    async def _restore(self) -> None:
        self.is_cut = False
        for tunnel in [t for t in self._tunnels if t.severed]:
            tunnel.close()
            self._tunnels.discard(tunnel)

    async def _shutdown(self) -> None:
        if hasattr(self, "_server"):
            self._server.close()
        for tunnel in list(self._tunnels):
            tunnel.close()
        self._tunnels.clear()
        # Closed sockets end their pumps; whatever is still running after that is cancelled.
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=2)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tunnel = _Tunnel(writer)
        self._tunnels.add(tunnel)
        try:
            await self._serve(tunnel, reader, writer)
        except (
            OSError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            TimeoutError,
            asyncio.CancelledError,  # cancelled only by close()
        ):
            pass
        finally:
            tunnel.close()
            self._tunnels.discard(tunnel)

    async def _serve(
        self, tunnel: _Tunnel, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if self.is_cut:
            # Behind a pulled cable the request never arrives anywhere: hold the connection, answer
            # nothing, until the client gives up or the link is restored (then it is closed).
            tunnel.severed = True
            self.held += 1
            await self._discard(reader)
            return
        request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _REQUEST_TIMEOUT_S)
        if len(request) > _MAX_REQUEST:
            return
        parts = request.split(b"\r\n", 1)[0].decode("latin-1").split()
        if len(parts) != 3 or parts[0] != "CONNECT":
            writer.write(b"HTTP/1.1 405 Method Not Allowed\r\n\r\n")
            return
        try:
            target = _endpoint(parts[1])
        except ValueError:
            target = None
        if target not in self.targets:
            writer.write(b"HTTP/1.1 403 Forbidden\r\n\r\n")
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*target), _CONNECT_TIMEOUT_S
            )
        except (OSError, TimeoutError):
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\n\r\n")
            return
        tunnel.writers.append(up_writer)
        if tunnel.severed:  # cut while connecting
            await self._discard(reader)
            return
        self.opened += 1
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.drain()
        await asyncio.gather(
            self._pump(tunnel, reader, up_writer),
            self._pump(tunnel, up_reader, writer),
            return_exceptions=True,
        )

    @staticmethod
    async def _pump(tunnel: _Tunnel, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data:
                    break
                if tunnel.severed:
                    continue  # the cable is pulled: what arrives goes nowhere
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            # A side reset the connection: the same as closing it. Raised, it would sit unretrieved
            # in a task whose gather was cancelled, and be logged with a traceback whenever the
            # garbage collector finds it: on CPython 3.11 that formatting parses source (ast), and
            # inside another ast.parse it fails that one ("AST constructor recursion depth mismatch").
            pass
        if not tunnel.severed:
            tunnel.close()  # one side closed: close the other (a severed tunnel stays silent)

    @staticmethod
    async def _discard(reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(ConnectionError, OSError):  # see _pump
            while await reader.read(_CHUNK):
                pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--target",
        action="append",
        required=True,
        metavar="HOST:PORT",
        help="an address to forward to (once per coordinator replica)",
    )
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1; 0 picks a free one")
    parser.add_argument("--port-file", type=Path, help="write the port here once serving")
    args = parser.parse_args(argv)
    stop = threading.Event()
    with ConnectProxy(args.target, args.port) as proxy:

        def say(what: str) -> None:
            print(f"proxy {proxy.address}: {what}", flush=True)

        def on_signal(signum: int, frame: FrameType | None) -> None:
            if signum == signal.SIGUSR1:
                proxy.cut()
                say("cut")
            elif signum == signal.SIGUSR2:
                proxy.restore()
                say("restored")
            else:
                stop.set()

        for signum in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, on_signal)
        if args.port_file is not None:
            # Written whole, then renamed: whoever polls for the file never reads half of it.
            tmp = args.port_file.with_name(args.port_file.name + ".tmp")
            tmp.write_text(str(proxy.port))
            os.replace(tmp, args.port_file)
        say("serving")
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
