"""Which client certificates stand for an identity (``security.peer_identity``): a leaf the job's CA
issued itself, for client authentication, naming exactly one well-formed identity. The certificates
an attacker tried that TLS let through (same CA, wrong kind) stand for none: first the pure check,
then over the wire against a real coordinator with mutual TLS, where each is refused
UNAUTHENTICATED with the reason and changes nothing."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import coordinator_pb2_grpc as pb_grpc
from remesh.v1.security import Identity, Role, Tls, peer_identity
from remesh.v1.security import channel as secure_channel
from tests.procs import Cluster, wait_for

CLIENT = ExtendedKeyUsageOID.CLIENT_AUTH
SERVER = ExtendedKeyUsageOID.SERVER_AUTH


@dataclass
class Signer:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def _name(text: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])


def make_ca(name: str = "test CA", signer: Signer | None = None, path_length: int | None = 0) -> Signer:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    issuer = signer.cert.subject if signer else _name(name)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=path_length), critical=True)
        .sign(signer.key if signer else key, hashes.SHA256())
    )
    return Signer(cert, key)


def make_leaf(
    signer: Signer,
    uris: Sequence[str] = ("spiffe://remesh.local/host/host-1",),
    *,
    usages: Sequence[x509.ObjectIdentifier] | None = (CLIENT,),
    ca: bool = False,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name("a client"))
        .issuer_name(signer.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if uris:
        sans = [x509.UniformResourceIdentifier(u) for u in uris]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if usages is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
    return builder.sign(signer.key, hashes.SHA256()), key


def pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


# Each certificate an attacker holding the CA's trust (or one of its certificates) could present, and
# the words of the refusal. ``root`` is the job's CA.
def variants(root: Signer) -> dict[str, tuple[x509.Certificate, ec.EllipticCurvePrivateKey, str]]:
    intermediate = make_ca("an intermediate", root, path_length=None)
    return {
        "a CA certificate as a client": (*make_leaf(root, ca=True), "CA:TRUE"),
        "no extended key usage": (*make_leaf(root, usages=None), "clientAuth"),
        "server authentication only": (*make_leaf(root, usages=(SERVER,)), "clientAuth"),
        "issued by an intermediate": (*make_leaf(intermediate), "intermediate"),
        "no remesh identity": (*make_leaf(root, uris=("spiffe://elsewhere/host/host-1",)), "names 0"),
        "two identities": (
            *make_leaf(root, uris=("spiffe://remesh.local/host/host-1", "spiffe://remesh.local/operator/x")),
            "names 2",
        ),
        "a NUL in the identity": (
            *make_leaf(root, uris=("spiffe://remesh.local/host/host-1\x00evil",)),
            "control",
        ),
        "a newline after the name": (
            *make_leaf(root, uris=("spiffe://remesh.local/host/host-1\n",)),
            "control",
        ),
    }


def test_a_leaf_of_the_ca_for_client_authentication_naming_one_identity_stands_for_it() -> None:
    root = make_ca()
    cert, _ = make_leaf(root)
    assert peer_identity(pem(cert), [root.cert]) == Identity(Role.HOST, "host-1")
    # A bundle during a CA rotation: issued by either CA is issued by the CA.
    assert peer_identity(pem(cert), [make_ca("next CA").cert, root.cert]) == Identity(Role.HOST, "host-1")
    # A coordinator's certificate serves and calls: both usages.
    both, _ = make_leaf(root, uris=("spiffe://remesh.local/coordinator/c0",), usages=(SERVER, CLIENT))
    assert peer_identity(pem(both), [root.cert]) == Identity(Role.COORDINATOR, "c0")


@pytest.mark.parametrize("variant", sorted(variants(make_ca())))
def test_certificates_of_the_wrong_kind_stand_for_no_one(variant: str) -> None:
    root = make_ca()
    cert, _, words = variants(root)[variant]
    with pytest.raises(ValueError, match=words):
        peer_identity(pem(cert), [root.cert])


def test_an_identity_name_is_matched_whole() -> None:
    assert Identity.parse("spiffe://remesh.local/host/host-1\n") is None
    assert Identity.parse("spiffe://remesh.local/host/host-1") == Identity(Role.HOST, "host-1")


@pytest.mark.integration
def test_over_the_wire_certificates_of_the_wrong_kind_are_refused_and_change_nothing(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start_coordinator("--world-size", "1")
    cluster.start_agent("host-0")
    cluster.wait_epoch(1)
    pki = cluster.pki
    assert pki is not None
    ca_key = serialization.load_pem_private_key((pki.directory / "ca-key.pem").read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    root = Signer(x509.load_pem_x509_certificate(pki.ca_file.read_bytes()), ca_key)
    before = len(cluster.events())

    def call_with(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey, name: str) -> Callable[[], object]:
        cert_file, key_file = tmp_path / f"{name}.pem", tmp_path / f"{name}-key.pem"
        cert_file.write_bytes(pem(cert))
        key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        tls = Tls(pki.ca_file, cert_file, key_file)

        def call() -> object:
            with secure_channel(cluster.address, tls) as channel:
                stub = pb_grpc.CoordinatorStub(channel)
                return stub.Register(pb.RegisterRequest(host_id="host-1", device_count=2), timeout=5)

        return call

    for i, (variant, (cert, key, words)) in enumerate(sorted(variants(root).items())):
        with pytest.raises(grpc.RpcError) as refused:
            call_with(cert, key, f"v{i}")()
        code, details = refused.value.code(), refused.value.details() or ""
        # A handshake TLS itself refuses is a refusal too; one it lets through is ours to refuse.
        assert code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE), (
            variant,
            code,
            details,
        )
        if code is grpc.StatusCode.UNAUTHENTICATED:
            assert words in details, (variant, details)
    assert "host-1" not in cluster.members()
    assert len(cluster.events()) == before
    # The same call with a certificate of the right kind registers.
    good, key = make_leaf(root)
    wait_for(lambda: call_with(good, key, "good")(), 10, "a good certificate to register")
    assert "host-1" in cluster.members()
