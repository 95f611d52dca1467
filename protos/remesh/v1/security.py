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

What a server accepts as a client certificate is narrower than what TLS verifies
(``peer_identity``): a leaf (not a CA certificate) issued directly by a CA the server trusts (no
intermediate), allowed for client authentication (extended key usage clientAuth), naming exactly one
identity of the trust domain, with no control character in it. A certificate of the same CA that is
none of these identifies nobody.
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
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID

__all__ = [
    "COORDINATOR_NAME",
    "TRUST_DOMAIN",
    "Identity",
    "Role",
    "Tls",
    "aio_channel",
    "channel",
    "load_cas",
    "peer_identity",
]

# The DNS name in every coordinator certificate, checked by every client instead of the address it
# dialled (addresses come from flags and leader hints; this name comes from the CA).
COORDINATOR_NAME = "coordinator.remesh"
TRUST_DOMAIN = "remesh.local"

_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
# Characters no identity URI holds: a NUL would cut the URI short where the TLS library reports it.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


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
        if not _NAME.fullmatch(self.name):
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


def load_cas(pem: bytes) -> list[x509.Certificate]:
    """Every certificate of a CA bundle (PEM)."""
    return x509.load_pem_x509_certificates(pem)


def peer_identity(pem: bytes, cas: Sequence[x509.Certificate], trust_domain: str = TRUST_DOMAIN) -> Identity:
    """The identity a client certificate (PEM, as TLS verified it) stands for, or ``ValueError`` saying
    why it stands for none: a CA certificate, one not allowed for client authentication, one issued
    by anything but one of ``cas`` itself (an intermediate CA, however it chains), or one that does
    not name exactly one well-formed identity of ``trust_domain``."""
    cert = x509.load_pem_x509_certificate(pem)
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        constraints = None
    if constraints is not None and constraints.ca:
        raise ValueError("the client certificate is a CA certificate (CA:TRUE): a client presents a leaf")
    try:
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        usage = None
    if usage is None or ExtendedKeyUsageOID.CLIENT_AUTH not in usage:
        raise ValueError(
            "the client certificate is not allowed for client authentication (extended key usage "
            "clientAuth): issue it with `remesh certs`, or with that usage"
        )
    if cas and not any(_issued_by(cert, ca) for ca in cas):
        raise ValueError(
            "the client certificate was not issued by the remesh CA itself (a certificate issued by an "
            "intermediate CA identifies nobody)"
        )
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = names.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    ours = [u for u in uris if u.startswith(f"spiffe://{trust_domain}/")]
    if len(ours) != 1:
        raise ValueError(
            f"the client certificate names {len(ours)} remesh identities (spiffe://{trust_domain}/<role>/"
            "<name>); it must name exactly one"
        )
    if _CONTROL.search(ours[0]):
        raise ValueError("the client certificate's identity holds control characters")
    identity = Identity.parse(ours[0], trust_domain)
    if identity is None:
        raise ValueError(f"the client certificate's identity {ours[0][:160]!r} is no remesh role and name")
    return identity


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


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
