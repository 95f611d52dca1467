"""``remesh certs``: a development CA and the certificates of a small job, for trying it on a few machines."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path
from typing import Any

from remesh.embedded.certs import DevPki
from remesh.v1.security import TRUST_DOMAIN, Role


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "certs",
        help="write a development CA and certificates (mutual TLS) for a coordinator, hosts and operators",
        description=(
            "Write a development CA (made once, reused on later runs) and a certificate and key for each "
            "identity asked for. Each prints as the flags that use it. For a real cluster, issue the same "
            "identities from your own CA (deploy/k8s/base/certs.yaml does it with cert-manager)."
        ),
    )
    p.add_argument("--out", required=True, type=Path, help="directory for ca.pem and the certificates")
    p.add_argument("--coordinator", action="append", default=[], metavar="NAME", help="a coordinator replica")
    p.add_argument(
        "--dns",
        action="append",
        default=[],
        metavar="NAME",
        help="a DNS name the coordinators are also reached by (loopback is always included)",
    )
    p.add_argument("--host", action="append", default=[], metavar="HOST_ID", help="an agent's host id")
    p.add_argument("--operator", action="append", default=[], metavar="NAME", help="may drain and read")
    p.add_argument("--reader", action="append", default=[], metavar="NAME", help="may read")
    p.add_argument("--trust-domain", default=TRUST_DOMAIN, help="the SPIFFE trust domain of the identities")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    asked = [
        *((Role.COORDINATOR, n) for n in args.coordinator),
        *((Role.HOST, n) for n in args.host),
        *((Role.OPERATOR, n) for n in args.operator),
        *((Role.READER, n) for n in args.reader),
    ]
    if not asked:
        print("error: name at least one identity (--coordinator, --host, --operator or --reader)")
        return 2
    refused = _unsafe(args.out)
    if refused:
        print(f"error: refusing to keep private keys in {args.out}: {refused}")
        return 2
    try:
        pki = DevPki(args.out, trust_domain=args.trust_domain)
        for role, name in asked:
            tls = pki.tls(role, name, dns=("localhost", *args.dns))
            print(
                f"{role.value}/{name}: --tls-ca {tls.ca_file} --tls-cert {tls.cert_file} --tls-key {tls.key_file}"
            )
    except (OSError, ValueError) as exc:
        print(f"error: {exc}")
        return 2
    return 0


def _unsafe(out: Path) -> str | None:
    """Why ``out`` is no place for private keys (None: it is, or it was made now for this user
    alone): a directory another user owns or may write to could swap the CA this writes under, or
    read the keys; a CA key already there that others may read is no secret any more."""
    if not out.exists():
        out.mkdir(mode=0o700, parents=True)
        return None
    info = out.stat()
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a directory"
    if info.st_uid != os.getuid():
        return f"another user (uid {info.st_uid}) owns it: use a directory of your own"
    if stat.S_IMODE(info.st_mode) & 0o022:
        return (
            f"others may write to it (mode {oct(stat.S_IMODE(info.st_mode))}): chmod go-w it, or use another"
        )
    for key in out.glob("*-key.pem"):
        if stat.S_IMODE(key.stat().st_mode) & 0o077:
            return (
                f"{key.name} may be read by others: it is no secret any more; start from an empty directory"
            )
    return None
