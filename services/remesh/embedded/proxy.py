"""An HTTP CONNECT proxy on loopback that cuts one agent off from its coordinators, with no privilege.

An agent started with ``grpc_proxy=http://127.0.0.1:PORT`` in its environment opens every gRPC
connection through this proxy: to each configured coordinator address and also to the leader a
follower names in its refusal. A plain TCP relay in front of each replica would be bypassed by that
hint (the agent would dial the leader's advertised address directly); a CONNECT proxy sees every
connection the agent makes, whatever address it dials. The trainer the agent starts must not
inherit the variable (run it under ``env -u grpc_proxy``): its own connections are not the link
being cut.

``cut()`` partitions the agent, as a pulled cable would: the connections that are open stay open
but carry nothing either way (what arrives is read and discarded, so neither end is told anything;
only its own keepalives and deadlines show the link is gone), and new connections are accepted but
never answered. ``restore()`` heals it: the connections that lived through the cut are closed (their
byte streams have a hole in them) and new ones are forwarded again.

Run as a process (``python -m remesh.embedded.proxy --port-file F``) it is cut by SIGUSR1, restored
by SIGUSR2 and stopped by SIGTERM, so a process that injects faults needs no control channel. Only
loopback targets are forwarded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import os
import signal
import sys
from pathlib import Path

__all__ = ["ConnectProxy", "main"]

_CHUNK = 65536
# A CONNECT request is one line and a few headers; anything longer is not a gRPC client's.
_MAX_REQUEST = 8192
_REQUEST_TIMEOUT_S = 5.0
_CONNECT_TIMEOUT_S = 5.0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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
    """The proxy's state and its asyncio server; run it inside an event loop with ``start()``."""

    def __init__(self, port: int = 0) -> None:
        self.port = port
        self.is_cut = False
        self._tunnels: set[_Tunnel] = set()
        self._server: asyncio.Server | None = None
        # Counters, for logs and tests: tunnels opened, and connections held unanswered while cut.
        self.opened = 0
        self.held = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def cut(self) -> None:
        self.is_cut = True
        for tunnel in self._tunnels:
            tunnel.severed = True

    def restore(self) -> None:
        self.is_cut = False
        for tunnel in [t for t in self._tunnels if t.severed]:
            tunnel.close()
            self._tunnels.discard(tunnel)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for tunnel in list(self._tunnels):
            tunnel.close()
        self._tunnels.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tunnel = _Tunnel(writer)
        self._tunnels.add(tunnel)
        try:
            await self._serve(tunnel, reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
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
            await self._discard(tunnel, reader)
            return
        request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _REQUEST_TIMEOUT_S)
        if len(request) > _MAX_REQUEST:
            return
        parts = request.split(b"\r\n", 1)[0].decode("latin-1").split()
        if len(parts) != 3 or parts[0] != "CONNECT":
            writer.write(b"HTTP/1.1 405 Method Not Allowed\r\n\r\n")
            return
        host, _, port = parts[1].rpartition(":")
        if not _is_loopback(host) or not port.isdigit():
            writer.write(b"HTTP/1.1 403 Forbidden\r\n\r\n")
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(host.strip("[]"), int(port)), _CONNECT_TIMEOUT_S
            )
        except (OSError, TimeoutError):
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\n\r\n")
            return
        tunnel.writers.append(up_writer)
        if tunnel.severed:  # cut while connecting
            await self._discard(tunnel, reader)
            return
        self.opened += 1
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.drain()
        await asyncio.gather(
            self._pump(tunnel, reader, up_writer),
            self._pump(tunnel, up_reader, writer),
            return_exceptions=True,
        )

    async def _pump(
        self, tunnel: _Tunnel, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
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
    async def _discard(tunnel: _Tunnel, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(ConnectionError, OSError):  # see _pump
            while await reader.read(_CHUNK):
                pass


async def _run(port: int, port_file: Path | None) -> None:
    proxy = ConnectProxy(port)
    await proxy.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def say(what: str) -> None:
        print(f"proxy {proxy.address}: {what}", flush=True)

    def cut() -> None:
        proxy.cut()
        say("cut")

    def restore() -> None:
        proxy.restore()
        say("restored")

    loop.add_signal_handler(signal.SIGUSR1, cut)
    loop.add_signal_handler(signal.SIGUSR2, restore)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    if port_file is not None:
        # Written whole, then renamed: whoever polls for the file never reads half of it.
        tmp = port_file.with_name(port_file.name + ".tmp")
        tmp.write_text(str(proxy.port))
        os.replace(tmp, port_file)
    say("serving")
    await stop.wait()
    await proxy.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1; 0 picks a free one")
    parser.add_argument("--port-file", type=Path, help="write the port here once serving")
    args = parser.parse_args(argv)
    asyncio.run(_run(args.port, args.port_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
