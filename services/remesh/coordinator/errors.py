"""The coordinator's errors: one root, split by what the caller should do.

::

    CoordinatorError
    ├── InvalidRequest      the request is malformed: fix it, do not retry   -> INVALID_ARGUMENT
    ├── NotFound            an unknown host or id                             -> NOT_FOUND
    ├── Rejected            valid but refused in this state (stale
    │   │                   incarnation or epoch, dead member, halted job)    -> FAILED_PRECONDITION
    │   └── JobFinished     the job reached its last step: nothing to join;   -> FAILED_PRECONDITION,
    │                       an agent exits 0                                     with the last step in
    │                                                                            ``remesh-finished``
    └── TemporaryError      try again with backoff
        ├── StoreUnavailable  Redis cannot be reached                       -> UNAVAILABLE
        ├── Conflict          another writer changed the state first        -> ABORTED
        └── NotLeader         this replica does not lead: ask the leader    -> UNAVAILABLE, with the
            │                 (its address, when known, is in ``leader``)      leader's address in the
            └── Fenced        the store refused a write: another replica       trailing metadata
                              holds a newer lease (this one steps down)        ``remesh-leader``

The gRPC status of each is chosen in one place, ``remesh.coordinator.rpc``.
"""

from __future__ import annotations

__all__ = [
    "Conflict",
    "CoordinatorError",
    "Fenced",
    "InvalidRequest",
    "JobFinished",
    "NotFound",
    "NotLeader",
    "PermissionDenied",
    "Rejected",
    "ResourceExhausted",
    "StoreUnavailable",
    "TemporaryError",
    "Unauthenticated",
]


class CoordinatorError(Exception):
    """Root of every error the coordinator raises on purpose."""


class InvalidRequest(CoordinatorError):
    pass


class NotFound(CoordinatorError):
    pass


class Rejected(CoordinatorError):
    pass


class Unauthenticated(CoordinatorError):
    """The caller presented no remesh identity (mutual TLS: no URI SAN of the job's trust domain)."""


class PermissionDenied(CoordinatorError):
    """The caller's identity may not do this (its role, or another host than its own)."""


class ResourceExhausted(CoordinatorError):
    """A limit that keeps the state bounded was reached (members of a job, streams of a client)."""


class JobFinished(Rejected):
    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


class TemporaryError(CoordinatorError):
    pass


class StoreUnavailable(TemporaryError):
    pass


class Conflict(TemporaryError):
    pass


class NotLeader(TemporaryError):
    def __init__(self, message: str, leader: str = "") -> None:
        super().__init__(message)
        self.leader = leader


class Fenced(NotLeader):
    pass
