"""Who is calling, and the TLS of every gRPC hop: part of the contract between remesh's components.

Every component presents a certificate signed by the job's CA. Its identity is a SPIFFE-style URI
in the certificate's subject alternative names, ``spiffe://<trust domain>/<role>/<name>``:

- ``host/<host id>``: an agent, which may register, heartbeat, acknowledge and report **for that
  host only**, and read the topology;
- ``operator/<name>``: may drain hosts and read everything;
- ``reader/<name>``: may read (members, topology, events);
- ``coordinator/<name>``: a coordinator replica. Every coordinator certificate also carries the DNS
  name ``COORDINATOR_NAME``, and every client checks it: an agent sent to another address (a forged
  leader hint) finds no coordinator there unless that server holds a coordinator certificate.

Without certificates a component runs only when told ``--insecure`` (local experiments), and says so.
"""

from __future__ import annotations

import enum
import os
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

__all__ = [
    "COORDINATOR_NAME",
    "TRUST_DOMAIN",
    "Identity",
    "Role",
    "Tls",
    "aio_channel",
    "channel",
]

# The DNS name in every coordinator certificate, checked by every client instead of the address it
# dialled (addresses come from flags and leader hints; this name comes from the CA).
COORDINATOR_NAME = "coordinator.remesh"
TRUST_DOMAIN = "remesh.local"

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


class Role(enum.StrEnum):
    HOST = "host"
    OPERATOR = "operator"
    READER = "reader"
    COORDINATOR = "coordinator"


@dataclass(frozen=True)
class Identity:
    role: Role
    name: str

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"identity name {self.name!r}: 1-128 characters of A-Z a-z 0-9 . _ -")

    def uri(self, trust_domain: str = TRUST_DOMAIN) -> str:
        return f"spiffe://{trust_domain}/{self.role.value}/{self.name}"

    def __str__(self) -> str:
        return f"{self.role.value}/{self.name}"

    @classmethod
    def parse(cls, uri: str, trust_domain: str = TRUST_DOMAIN) -> Identity | None:
        """The identity a SAN URI names in ``trust_domain``; None for anything else."""
        prefix = f"spiffe://{trust_domain}/"
        if not uri.startswith(prefix):
            return None
        role, _, name = uri.removeprefix(prefix).partition("/")
        try:
            return cls(Role(role), name)
        except ValueError:
            return None


def _env(env: Mapping[str, str], name: str) -> str:
    return env.get(name, "").strip()


@dataclass(frozen=True)
class Tls:
    """A component's certificate, its key and the CA it trusts (PEM files; re-read on rotation)."""

    ca_file: Path
    cert_file: Path
    key_file: Path

    ENV_CA = "REMESH_TLS_CA"
    ENV_CERT = "REMESH_TLS_CERT"
    ENV_KEY = "REMESH_TLS_KEY"

    @classmethod
    def of(cls, ca: str | None, cert: str | None, key: str | None) -> Tls | None:
        """From flags: all three or none (None: no TLS). Raises ValueError naming what is missing."""
        given = {"--tls-ca": ca, "--tls-cert": cert, "--tls-key": key}
        if not any(given.values()):
            return None
        missing = [flag for flag, value in given.items() if not value]
        if missing:
            raise ValueError(f"TLS needs a CA, a certificate and its key: {', '.join(missing)} missing")
        tls = cls(Path(str(ca)), Path(str(cert)), Path(str(key)))
        for path in (tls.ca_file, tls.cert_file, tls.key_file):
            if not path.is_file():
                raise ValueError(f"{path}: no such file (write a development set with `remesh certs`)")
        return tls

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Tls | None:
        env = os.environ if env is None else env
        return cls.of(_env(env, cls.ENV_CA), _env(env, cls.ENV_CERT), _env(env, cls.ENV_KEY))

    def env(self) -> dict[str, str]:
        """The environment that gives a child process these files."""
        return {
            self.ENV_CA: str(self.ca_file),
            self.ENV_CERT: str(self.cert_file),
            self.ENV_KEY: str(self.key_file),
        }

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return self.ca_file.read_bytes(), self.cert_file.read_bytes(), self.key_file.read_bytes()

    def _stamp(self) -> tuple[int, ...]:
        """What changes when a file is replaced: a rename brings a new inode, a rewrite a new mtime."""
        stats = [p.stat() for p in (self.ca_file, self.cert_file, self.key_file)]
        return tuple(x for st in stats for x in (st.st_ino, st.st_mtime_ns, st.st_size))

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A client's credentials, read now: a channel opened later reads rotated files again."""
        ca, cert, key = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def server_credentials(self) -> grpc.ServerCredentials:
        """A server's credentials that require a client certificate signed by the CA, and pick up
        rotated files (checked at each new handshake, re-read when a file changed)."""
        lock = threading.Lock()
        stamp = [self._stamp()]

        def config() -> Any:
            ca, cert, key = self._read()
            return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

        def fetch() -> Any:
            try:
                now = self._stamp()
            except OSError:
                return None  # a rotation in progress: keep serving the last good files
            with lock:
                if now == stamp[0]:
                    return None
                stamp[0] = now
            try:
                return config()
            except OSError:
                return None

        return grpc.dynamic_ssl_server_credentials(config(), fetch, require_client_authentication=True)


def _options(tls: Tls | None, options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    if tls is None:
        return list(options)
    return [*options, ("grpc.ssl_target_name_override", COORDINATOR_NAME)]


def channel(address: str, tls: Tls | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A channel to a coordinator: mutual TLS checking ``COORDINATOR_NAME``, or plain (``tls`` None)."""
    if tls is None:
        return grpc.insecure_channel(address, options=_options(tls, options))
    return grpc.secure_channel(address, tls.channel_credentials(), options=_options(tls, options))


def aio_channel(address: str, tls: Tls | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """``channel`` for asyncio."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=_options(tls, options))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=_options(tls, options))
