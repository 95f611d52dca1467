"""A development CA and certificates for every remesh identity (``remesh certs``; the embedded
cluster, so the demo, the tests and the benchmarks).

For trying remesh on a few machines and for the embedded cluster, where the secure path must be the
tested path. Production identities come from the cluster's own issuer (``deploy/k8s/base/certs.yaml``
shows cert-manager issuing them); the names and SANs are the same (``remesh.v1.security``).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from remesh.v1.security import COORDINATOR_NAME, TRUST_DOMAIN, Identity, Role, Tls

__all__ = ["DevPki"]

_KEY = ec.SECP256R1()


_CA_USAGE = x509.KeyUsage(
    digital_signature=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Named for this writer: two writers of the same file must not rename each other's.
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644), "wb") as f:
        f.write(data)
    tmp.replace(path)  # a reader (a server re-reading on rotation) sees the old file or the new one


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@dataclass
class DevPki:
    """A CA in ``directory`` (made on first use, reused after) that issues certificates on request."""

    directory: Path
    trust_domain: str = TRUST_DOMAIN
    days: int = 30
    # Threads asking for the same identity at once (the demo's event follower and its status poller)
    # get one key and one certificate, issued once: not a key of one and a certificate of the other.
    _issuing: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        ca_cert, ca_key = self.directory / "ca.pem", self.directory / "ca-key.pem"
        if ca_cert.is_file() and ca_key.is_file():
            self._ca = x509.load_pem_x509_certificate(ca_cert.read_bytes())
            loaded = serialization.load_pem_private_key(ca_key.read_bytes(), password=None)
            if not isinstance(loaded, ec.EllipticCurvePrivateKey):
                raise ValueError(f"{ca_key}: not an EC key written by `remesh certs`")
            self._ca_key = loaded
            return
        self._ca_key = ec.generate_private_key(_KEY)
        name = x509.Name(
            [x509.NameAttribute(NameOID.COMMON_NAME, f"remesh development CA ({self.trust_domain})")]
        )
        now = datetime.datetime.now(datetime.UTC)
        self._ca = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=self.days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_CA_USAGE, critical=True)
            .sign(self._ca_key, hashes.SHA256())
        )
        _write(ca_key, _pem(self._ca_key), private=True)
        _write(ca_cert, self._ca.public_bytes(serialization.Encoding.PEM))

    @property
    def ca_file(self) -> Path:
        return self.directory / "ca.pem"

    def tls(self, role: Role, name: str, dns: tuple[str, ...] = ("localhost",)) -> Tls:
        """The files of ``role/name``, issued now if this CA has not issued them yet."""
        identity = Identity(role, name)
        cert_file = self.directory / f"{role.value}-{name}.pem"
        key_file = self.directory / f"{role.value}-{name}-key.pem"
        with self._issuing:
            if not (cert_file.is_file() and key_file.is_file()):
                self.issue(identity, cert_file, key_file, dns)
        return Tls(self.ca_file, cert_file, key_file)

    def issue(self, identity: Identity, cert_file: Path, key_file: Path, dns: tuple[str, ...] = ()) -> None:
        """Write a certificate for ``identity`` (and its key). A coordinator's also serves TLS: it
        carries ``COORDINATOR_NAME`` and ``dns`` (plus loopback) as names clients may check."""
        key = ec.generate_private_key(_KEY)
        names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity.uri(self.trust_domain))]
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        if identity.role is Role.COORDINATOR:
            names += [x509.DNSName(d) for d in (COORDINATOR_NAME, *dns)]
            names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(identity))]))
            .issuer_name(self._ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=self.days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(self._ca_key, hashes.SHA256())
        )
        _write(key_file, _pem(key), private=True)
        _write(cert_file, cert.public_bytes(serialization.Encoding.PEM))
