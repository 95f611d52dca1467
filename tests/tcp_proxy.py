"""A TCP proxy on loopback that a test can cut and restore: a network partition that needs no privilege.

Put it between one agent and the coordinator (the agent is given ``proxy.address``) and call
``cut()``: every connection through it is dropped, and new ones are accepted but never answered, as
behind a link whose packets vanish. Two ways to drop the connections that are open at the cut:

- ``"reset"`` closes them: both ends see the connection end at once (a link that resets);
- ``"silent"`` keeps them open but forwards nothing and discards what arrives: neither end hears
  anything again, and only its own timeouts (keepalives, heartbeat deadlines) tell it the link is gone
  (a pulled cable).

``restore()`` lets new connections through again. A connection that was open during a cut never
carries bytes again (its byte stream has a hole in it): it is closed at the restore, and the peers
connect afresh, as they would after a real partition.

The proxy runs an asyncio loop in a daemon thread; ``close()`` stops it and closes every socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, Literal

__all__ = ["TcpProxy"]

CutMode = Literal["reset", "silent"]

_CHUNK = 65536


class _Connection:
    """One client connection and, once the link is up, its upstream."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.writers: list[asyncio.StreamWriter] = [client]
        # Set at a cut: from then on, nothing is forwarded either way.
        self.severed = False

    def close(self) -> None:
        for writer in self.writers:
            with contextlib.suppress(Exception):
                writer.close()


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``upstream`` (host:port) until cut."""

    def __init__(self, upstream: str, connect_timeout: float = 5.0) -> None:
        host, _, port = upstream.rpartition(":")
        self._upstream = (host, int(port))
        self._connect_timeout = connect_timeout
        self._loop = asyncio.new_event_loop()
        self._connections: set[_Connection] = set()
        self._cut = False
        self._server: asyncio.Server | None = None
        # Connections accepted so far, and those accepted while cut (never forwarded).
        self.accepted = 0
        self.blackholed = 0
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-proxy", daemon=True)
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.port: int = self._server.sockets[0].getsockname()[1]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self, mode: CutMode = "reset") -> None:
        """Partition: drop every open connection (``mode``) and answer no new one until ``restore()``."""
        self._call(self._do_cut(mode))

    def restore(self) -> None:
        """Heal the partition: close what the cut left open; new connections are forwarded again."""
        self._call(self._do_restore())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- in the proxy's loop ---------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    async def _do_cut(self, mode: CutMode) -> None:
        self._cut = True
        for conn in list(self._connections):
            conn.severed = True
            if mode == "reset":
                conn.close()

    async def _do_restore(self) -> None:
        for conn in list(self._connections):
            if conn.severed:
                conn.close()
        self._cut = False

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.close()
        # Closed sockets end their pumps; whatever is still running after that is cancelled.
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=2)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.CancelledError):  # cancelled only by close()
            await self._serve(reader, writer)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        conn = _Connection(writer)
        self._connections.add(conn)
        try:
            if self._cut:
                # Behind the cut: accepted, never answered. (A real partition would leave the SYN
                # unanswered instead; either way the client hears nothing back.)
                self.blackholed += 1
                conn.severed = True
                await self._pump(reader, None, conn)
                return
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection(*self._upstream), self._connect_timeout
                )
            except (OSError, TimeoutError):
                return
            conn.writers.append(up_writer)
            if conn.severed:  # cut while connecting
                await self._pump(reader, None, conn)
                return
            await asyncio.gather(self._pump(reader, up_writer, conn), self._pump(up_reader, writer, conn))
        finally:
            conn.close()
            self._connections.discard(conn)

    @staticmethod
    async def _pump(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None, conn: _Connection
    ) -> None:
        """Copy ``reader`` to ``writer`` until either end closes; once severed, read and discard."""
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(_CHUNK):
                if conn.severed or writer is None:
                    continue
                writer.write(data)
                await writer.drain()
        # One direction ended: end the other too (unless severed silently: then only a close ends it).
        if not conn.severed:
            conn.close()
