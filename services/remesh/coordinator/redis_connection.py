"""How the coordinator reaches Redis: a URL, credentials and TLS, for one server or a Redis Cluster.

The URL's scheme picks the client (the ``redis`` library's own clients; nothing here speaks RESP):

=============================  ==============================================================
``redis://HOST:PORT/DB``       one server (``redis.asyncio.Redis``)
``rediss://HOST:PORT/DB``      the same over TLS
``redis+cluster://HOST:PORT``  a Redis Cluster, any node as the seed (``redis.asyncio.RedisCluster``);
                               every key of a job shares the hash tag ``{JOB}``, so a job lives in
                               one slot and its Lua scripts run there
``rediss+cluster://HOST:PORT`` a Redis Cluster over TLS
``unix:///PATH?db=DB``         one server on this machine, over its Unix socket (no TCP at all)
=============================  ==============================================================

An ACL user and password come from the URL (``redis://user:secret@host``) or, so that secrets stay
out of process listings, from ``username`` / ``password`` (the command line reads them from the
environment). ``ca_file`` is the CA bundle that verifies the server's certificate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis

__all__ = ["RedisClient", "RedisConnection"]

RedisClient = aioredis.Redis | aioredis.RedisCluster

_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster", "unix")


@dataclass(frozen=True)
class RedisConnection:
    url: str = "redis://127.0.0.1:6379/0"
    # ACL user and password; None keeps what the URL says (or the default user without a password).
    username: str | None = None
    password: str | None = None
    # CA bundle (PEM) that verifies the server's TLS certificate; only for rediss:// URLs.
    ca_file: str | None = None

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in _SCHEMES:
            raise ValueError(
                f"Redis URL {self.redacted_url!r} has scheme {scheme!r}; use one of "
                + ", ".join(f"{s}://" for s in _SCHEMES)
            )
        if self.ca_file and not self.tls:
            raise ValueError(f"a CA file is given but {self.redacted_url!r} is not a rediss:// URL")

    @property
    def cluster(self) -> bool:
        return urlsplit(self.url).scheme.endswith("+cluster")

    @property
    def tls(self) -> bool:
        return urlsplit(self.url).scheme.startswith("rediss")

    @property
    def redacted_url(self) -> str:
        """The URL as logs and error messages show it: never with the password."""
        parts = urlsplit(self.url)
        if parts.password is None:
            return self.url
        host = parts.hostname or ""  # none in unix://user:secret@/path
        netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))

    def client_url(self) -> str:
        """The URL the ``redis`` library understands (it knows no ``+cluster`` scheme)."""
        if not self.cluster:
            return self.url  # as given: urlunsplit would turn unix:///path into unix:/path
        parts = urlsplit(self.url)
        return urlunsplit(parts._replace(scheme=parts.scheme.removesuffix("+cluster")))

    def client_kwargs(self, socket_timeout: float, connect_timeout: float | None = None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": socket_timeout if connect_timeout is None else connect_timeout,
            "decode_responses": True,
        }
        if self.username is not None:
            kwargs["username"] = self.username
        if self.password is not None:
            kwargs["password"] = self.password
        if self.tls:
            # Verified, and for the host the URL names, whatever the redis library's defaults (their
            # hostname check was off before redis-py 6).
            kwargs["ssl_cert_reqs"] = "required"
            kwargs["ssl_check_hostname"] = True
        if self.ca_file:
            kwargs["ssl_ca_certs"] = self.ca_file
        return kwargs

    def connect(self, socket_timeout: float = 1.0, connect_timeout: float | None = None) -> RedisClient:
        """A client (no I/O yet: it connects on first use)."""
        kwargs = self.client_kwargs(socket_timeout, connect_timeout)
        if self.cluster:
            return aioredis.RedisCluster.from_url(self.client_url(), **kwargs)
        return aioredis.Redis.from_url(self.client_url(), **kwargs)
