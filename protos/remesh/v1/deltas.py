"""A topology said as its difference from the previous one on a heartbeat stream.

A new epoch of N members goes to N agents. Sent whole, that is N x N member entries per epoch: at
2000 hosts 120 MB through TLS for one replaced host, and the fan-out's largest cost. A hot spare
taking a dead host's rank changes one member, so the coordinator sends each stream the difference
from the topology it sent that stream before (``delta``), and the agent rebuilds the whole topology
from the one it holds (``apply``). Both sides use these two functions: what one writes the other
reads, and ``apply(base, delta(base, new)) == new`` is checked by the sender before it sends.
"""

from __future__ import annotations

from remesh.v1 import coordinator_pb2 as pb

__all__ = ["DeltaMismatch", "apply", "delta"]


class DeltaMismatch(ValueError):
    """A delta that does not apply to the topology held: the stream is out of step (start it again)."""


def delta(base: pb.Topology, new: pb.Topology) -> pb.TopologyDelta | None:
    """``new`` as its difference from ``base``; None where the whole topology says it in no more
    (the delta would name as many members as ``new`` holds: a shrink that renumbers every rank, the
    first topology of a job) or the difference would not rebuild ``new`` exactly."""
    held = {m.host_id: m for m in base.members}
    current = {m.host_id for m in new.members}
    changed = [m for m in new.members if held.get(m.host_id) != m]
    removed = [h for h in held if h not in current]
    if len(changed) + len(removed) >= max(1, len(new.members)):
        return None
    header = pb.Topology()
    header.CopyFrom(new)
    del header.members[:]
    d = pb.TopologyDelta(
        base_epoch=base.epoch,
        topology=header,
        removed=removed,
        changed=changed,
        member_count=len(new.members),
    )
    try:
        rebuilt = apply(base, d)
    except DeltaMismatch:
        return None
    return d if rebuilt == new else None


def apply(base: pb.Topology, d: pb.TopologyDelta) -> pb.Topology:
    """The topology ``d`` says, rebuilt from ``base`` (the previous topology on the same stream).
    Raises ``DeltaMismatch`` when ``base`` is not the topology ``d`` was made from."""
    if d.base_epoch != base.epoch:
        raise DeltaMismatch(f"a delta from epoch {d.base_epoch} arrived while epoch {base.epoch} is held")
    members = {m.host_id: m for m in base.members}
    for host in d.removed:
        if members.pop(host, None) is None:
            raise DeltaMismatch(
                f"the delta to epoch {d.topology.epoch} removes {host}, not in epoch {base.epoch}"
            )
    for m in d.changed:
        members[m.host_id] = m
    if len(members) != d.member_count:
        raise DeltaMismatch(
            f"epoch {d.topology.epoch} rebuilt from epoch {base.epoch} has {len(members)} members, "
            f"not {d.member_count}"
        )
    topology = pb.Topology()
    topology.CopyFrom(d.topology)
    topology.members.extend(sorted(members.values(), key=lambda m: (m.rank, m.host_id)))
    return topology
