"""The TLS flags every command that speaks gRPC to a coordinator takes, said once."""

from __future__ import annotations

import argparse
import os
import stat

import structlog

from remesh.v1.security import Tls

__all__ = ["add_tls_arguments", "tls_from_args"]

log = structlog.get_logger("remesh.cli")

ENV_INSECURE = "REMESH_INSECURE"


def add_tls_arguments(p: argparse.ArgumentParser, whose: str) -> None:
    g = p.add_argument_group(
        "mutual TLS",
        f"{whose} certificate, its key and the job's CA (PEM; `remesh certs` writes a development set)",
    )
    g.add_argument("--tls-ca", default=os.environ.get(Tls.ENV_CA), help=f"CA bundle (env {Tls.ENV_CA})")
    g.add_argument(
        "--tls-cert", default=os.environ.get(Tls.ENV_CERT), help=f"certificate (env {Tls.ENV_CERT})"
    )
    g.add_argument("--tls-key", default=os.environ.get(Tls.ENV_KEY), help=f"private key (env {Tls.ENV_KEY})")
    g.add_argument(
        "--insecure",
        action="store_true",
        default=os.environ.get(ENV_INSECURE, "") not in ("", "0"),
        help=f"no TLS and no identities, for a local experiment only (env {ENV_INSECURE}=1)",
    )


def tls_from_args(args: argparse.Namespace) -> Tls | None:
    """The TLS files given, or None with ``--insecure``. Raises ValueError (with what to do) when
    neither is given, or both."""
    tls = Tls.of(args.tls_ca, args.tls_cert, args.tls_key)
    if tls is not None and args.insecure:
        raise ValueError("--insecure and TLS files both given: choose one")
    if tls is None and not args.insecure:
        raise ValueError(
            "no TLS files given: pass --tls-ca, --tls-cert and --tls-key (or set REMESH_TLS_CA, "
            "REMESH_TLS_CERT, REMESH_TLS_KEY; `remesh certs --out DIR` writes a development set), "
            "or --insecure for a local experiment"
        )
    if tls is not None:
        try:
            mode = stat.S_IMODE(os.stat(tls.key_file).st_mode)
        except OSError:
            mode = 0
        if mode & 0o077:
            log.warning(
                "the private key may be read by other users: anyone who reads it holds this identity",
                key=str(tls.key_file),
                mode=oct(mode),
                hint=f"chmod 600 {tls.key_file}",
            )
    return tls
