"""Who may call what: the coordinator's authorization, in one place.

The caller's identity comes from its client certificate (mutual TLS, ``remesh.v1.security``): a leaf
the job's CA issued itself, for client authentication, naming one identity
(``security.peer_identity``); any other certificate TLS let through identifies nobody. The
policy is a table: each RPC names the roles that may call it, and whether the caller must be the host
the request is about (an agent acts for its own host only). Every refusal is logged, counted and
answered UNAUTHENTICATED (no remesh identity) or PERMISSION_DENIED (an identity without the right),
before anything is read or changed.

In insecure mode (``remesh coordinator --insecure``: no certificates) every caller may do anything.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from cryptography import x509

from remesh.coordinator.errors import PermissionDenied, Unauthenticated
from remesh.coordinator.metrics import Refusals
from remesh.v1.security import TRUST_DOMAIN, Identity, Role, load_cas, peer_identity

__all__ = ["POLICY", "Authorizer", "Rule", "decide", "identity_of"]

log = structlog.get_logger("remesh.coordinator")

_READERS = frozenset({Role.OPERATOR, Role.READER, Role.COORDINATOR})
_EVERYONE = _READERS | {Role.HOST}


@dataclass(frozen=True)
class Rule:
    roles: frozenset[Role]
    # The request's host_id must be the caller's own (a host identity acts for its host only).
    own_host: bool = False


_AGENT = Rule(frozenset({Role.HOST}), own_host=True)

POLICY: Mapping[str, Rule] = {
    # What an agent does, for its own host only.
    "Register": _AGENT,
    "Heartbeat": _AGENT,
    "Leave": _AGENT,
    "AckEpoch": _AGENT,
    "ReportFault": _AGENT,
    "Observe": _AGENT,
    "CommitCheckpoint": _AGENT,
    "Finish": _AGENT,
    # The topology is what every agent follows.
    "GetTopology": Rule(_EVERYONE),
    "WatchTopology": Rule(_EVERYONE),
    # Served by a relay (`remesh relay`), which runs with a coordinator certificate: an agent
    # follows the topology there for its own host only.
    "FollowTopology": _AGENT,
    # Member addresses and the event log: operators and readers.
    "ListMembers": Rule(_READERS),
    "GetMember": Rule(_READERS),
    "ReplayEvents": Rule(_READERS),
    # Changing someone else's membership: operators only.
    "Drain": Rule(frozenset({Role.OPERATOR})),
}


def decide(identity: Identity | None, method: str, host_id: str | None) -> str | None:
    """Why ``identity`` may not call ``method`` about ``host_id``; None when it may."""
    rule = POLICY.get(method)
    if rule is None:
        return f"{method} is not in the coordinator's access policy"
    if identity is None:
        return "the client certificate names no remesh identity (spiffe://<trust domain>/<role>/<name>)"
    if identity.role not in rule.roles:
        allowed = ", ".join(sorted(r.value for r in rule.roles))
        return f"{identity} may not call {method} (allowed: {allowed})"
    if rule.own_host and host_id is not None and host_id != identity.name:
        return f"{identity} may act for host {identity.name!r} only, not {host_id!r}"
    return None


def identity_of(
    auth_context: Mapping[str, Iterable[bytes]], trust_domain: str = TRUST_DOMAIN
) -> Identity | None:
    """The remesh identity among the peer certificate's URI SANs (the first in ``trust_domain``)."""
    for uri in auth_context.get("peer_uri", ()):
        identity = Identity.parse(uri.decode(errors="replace"), trust_domain)
        if identity is not None:
            return identity
    return None


# Client certificates whose verdict is kept (a fleet's hosts each present one, for every call).
_VERDICTS_KEPT = 65_536


class Authorizer:
    """``ca_file``: the CA bundle the server's TLS trusts (re-read when it changes), which a client
    certificate must be issued by directly."""

    def __init__(
        self,
        metrics: Refusals,
        *,
        secure: bool,
        trust_domain: str = TRUST_DOMAIN,
        ca_file: Path | None = None,
    ) -> None:
        self.secure = secure
        self.trust_domain = trust_domain
        self._metrics = metrics
        self._ca_file = ca_file
        self._ca_stamp: tuple[float, int] | None = None
        self._cas: list[x509.Certificate] = []
        # PEM -> the identity it stands for, or why none.
        self._verdicts: dict[bytes, Identity | str] = {}

    def _trusted(self) -> list[x509.Certificate]:
        if self._ca_file is None:
            return []
        try:
            stat = os.stat(self._ca_file)
        except OSError:
            return self._cas
        stamp = (stat.st_mtime, stat.st_size)
        if stamp != self._ca_stamp:
            try:
                self._cas = list(load_cas(self._ca_file.read_bytes()))
            except (OSError, ValueError):
                return self._cas
            self._ca_stamp, self._verdicts = stamp, {}
        return self._cas

    def identify(self, auth_context: Mapping[str, Iterable[bytes]]) -> tuple[Identity | None, str | None]:
        """The caller's identity, and where it has none, why (None: the certificate names no
        identity at all, as ``decide`` says)."""
        pems = list(auth_context.get("x509_pem_cert", ()))
        if not pems:
            return identity_of(auth_context, self.trust_domain), None
        pem = pems[0]
        cas = self._trusted()
        verdict = self._verdicts.get(pem)
        if verdict is None:
            try:
                verdict = peer_identity(pem, cas, self.trust_domain)
            except ValueError as exc:
                verdict = str(exc)
            if len(self._verdicts) >= _VERDICTS_KEPT:
                self._verdicts.clear()
            self._verdicts[pem] = verdict
        return (verdict, None) if isinstance(verdict, Identity) else (None, verdict)

    def check(
        self, context: grpc.aio.ServicerContext, method: str, host_id: str | None = None
    ) -> Identity | None:
        """The caller's identity if it may call ``method`` about ``host_id`` (None in insecure mode);
        raises ``Unauthenticated`` or ``PermissionDenied`` after logging and counting the refusal."""
        if not self.secure:
            return None
        identity, refused = self.identify(context.auth_context())
        reason = refused or decide(identity, method, host_id)
        if reason is None:
            return identity
        kind = "unauthenticated" if identity is None else "permission_denied"
        self._metrics.refusals.labels(method=method, kind=kind).inc()
        log.warning(
            "call refused",
            method=method,
            kind=kind,
            peer=context.peer(),
            identity=str(identity),
            reason=reason,
        )
        if identity is None:
            raise Unauthenticated(reason)
        raise PermissionDenied(reason)
