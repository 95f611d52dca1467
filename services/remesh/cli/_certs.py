"""``remesh certs``: a development CA and the certificates of a small job, for trying it on a few machines."""

from __future__ import annotations

import argparse
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
