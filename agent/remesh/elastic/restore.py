"""Restoring an epoch's state: the members agree on a plan, and every member carries it out.

Every member tells the others what it holds (``restore_plan.MemberOffer``, through the coordination
service's key-value store), and every member chooses the same plan from the same offers
(``restore_plan.choose``: the restore order lives there). This module is the I/O around that
choice: gathering the offers, fetching the pieces a process lacks from the members that hold them
(``exchange``: host to host, over plain TCP), reading a checkpoint (rank 0 chooses the step, every
member checks its share of the files before anyone reads them), building the leaves on the new mesh,
and serving this process's own pieces to the others (its ``PieceServer``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import structlog
from jax.sharding import NamedSharding

from remesh.elastic import restore_plan
from remesh.elastic.agent_client import Assignment
from remesh.elastic.cells import Cell, RestorePoint, whole
from remesh.elastic.checkpointing import INPUT_KEY, CheckpointStore
from remesh.elastic.checkpoints import CheckpointError, Trusted
from remesh.elastic.data import DataPosition
from remesh.elastic.errors import PeerFailure, RestartProcess, StateLost
from remesh.elastic.exchange import FetchFailed, Pieces, PieceServer, advertised_host, fetch
from remesh.elastic.exits import Why
from remesh.elastic.restore_plan import FromMembers, Held, MemberOffer, ReadCheckpoint
from remesh.elastic.runtime import Runtime, peer_failures
from remesh.elastic.sharding import build, first_replicas, needed_cells
from remesh.elastic.snapshots import Snapshots
from remesh.elastic.template import StateTemplate

__all__ = ["Restored", "Restorer", "on_device"]

log = structlog.get_logger("remesh.elastic")

PyTree = Any


@dataclass
class Restored:
    """The state an epoch starts from: its leaves on the mesh, its step, where it came from (a label
    for the acknowledgement: "memory", "peer+buddy", "local", "scratch", ...), the bytes per source,
    where the restore's time went (agreeing, fetching, reading, building), and every host's input
    position after the step where one was kept with it (``IteratorData``)."""

    leaves: list[jax.Array]
    step: int
    source: str
    restored_bytes: dict[str, int]
    phases: dict[str, float] = field(default_factory=dict)
    data: DataPosition | None = None


def on_device(leaves: list[jax.Array]) -> None:
    """Wait until ``leaves`` are on their devices. Host-to-device copies are asynchronous: a restore's
    phase timed without this ends before the data arrives (2.2 GB onto a TPU: 7 ms timed, 2 s in
    truth), and the first step pays for it unseen."""
    with peer_failures():
        jax.block_until_ready(leaves)


class Restorer:
    """Restores the state of every epoch this process joins, from ``snapshots`` and ``buddies`` (its
    own and its buddy's pieces in host memory), the members' memory, ``checkpoints`` (in order), or
    ``init_state``; and serves its pieces to the other members while they restore or copy."""

    def __init__(
        self,
        runtime: Runtime,
        template: StateTemplate,
        init_state: Callable[[], PyTree],
        snapshots: Snapshots,
        buddies: Snapshots,
        checkpoints: Sequence[CheckpointStore],
        *,
        timeout_s: float,
        peer_host: str | None = None,
    ) -> None:
        self.runtime = runtime
        self.template = template
        self.init_state = init_state
        self.snapshots = snapshots
        self.buddies = buddies
        self.checkpoints = list(checkpoints)
        self.timeout_s = timeout_s
        self.peer_host = peer_host
        # Where each member of the current epoch serves its pieces, by rank.
        self.peers: list[str] = []
        # Every piece this process offered for the restore under way, by restore point: what its
        # piece server hands to the members that fetch from it.
        self._offered: dict[RestorePoint, Pieces] = {}
        # The input positions this process holds at each restore point it offered (JSON text).
        self._positions: dict[RestorePoint, str] = {}
        # Started by the first epoch of more than one process (``_address``): a world of one
        # fetches nothing, and its host may allow no TCP socket.
        self._server: PieceServer | None = None

    @property
    def serving(self) -> bool:
        """Whether this process's piece server was started."""
        return self._server is not None

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._offered = {}

    def restore(self, assignment: Assignment, shardings: list[NamedSharding]) -> Restored:
        """Agree with every member on the state to start the epoch from (``restore_plan.choose``)
        and build it on the mesh."""
        t = time.monotonic()
        offer = self._offer(assignment.restore_step >= 0)
        with peer_failures():
            gathered = self.runtime.allgather_text("offers", offer.to_json(), self.timeout_s)
        offers = [MemberOffer.from_json(g) for g in gathered]
        phases = {"restore_agree": time.monotonic() - t}
        self.peers = [o.address for o in offers]
        shapes = self.template.shapes()
        need = restore_plan.Need(
            assignment.rank,
            {
                i: needed_cells(s, shape)
                for i, (s, (shape, _)) in enumerate(zip(shardings, shapes, strict=True))
            },
            [s for s, _ in shapes],
            [d.itemsize for _, d in shapes],
        )
        plan = restore_plan.choose(offers, need, assignment.restore_step, assignment.commits)
        for step, layout in plan.incomplete:
            log.info("the members do not hold every piece of this step", step=step, layout=layout)
        otherwise = plan.otherwise
        if plan.first is not None:
            if isinstance(otherwise, FromMembers):
                # Replaying the steps between them would cost more than reading the checkpoint.
                log.info(
                    "a committed checkpoint is newer than the newest step the members hold",
                    held=otherwise.step,
                    commit=max(s for s, _ in assignment.commits),
                )
            found = self._from_storage(assignment, shardings, plan.first, phases)
            if found is not None:
                return found
            if isinstance(otherwise, FromMembers):
                log.info(
                    "no newer checkpoint is readable: restoring the step held in memory", step=otherwise.step
                )
        if isinstance(otherwise, FromMembers):
            return self._from_members(otherwise, assignment.rank, shardings, phases)
        if isinstance(otherwise, restore_plan.StateGone):
            raise StateLost(
                assignment.epoch,
                assignment.restore_step,
                f"no member holds any step of the job in memory, and no committed checkpoint is "
                f"readable (tiers: {', '.join(s.name for s in self.checkpoints) or 'none configured'})",
            )
        assert isinstance(otherwise, restore_plan.FromScratch)
        log.info("starting from scratch: the job has not completed a step", target=assignment.restore_step)
        self.snapshots.clear()
        self.buddies.clear()
        tree_shardings = self.template.tree(shardings)
        init = jax.tree_util.tree_leaves(jax.jit(self.init_state, out_shardings=tree_shardings)())
        on_device(init)
        return Restored(init, 0, "scratch", {}, phases)

    # ---- what this process offers and serves ------------------------------------------------------

    def _offer(self, any_step: bool) -> MemberOffer:
        """This process's pieces at every restore point it holds (none unless ``any_step``), as it
        tells the others."""
        self._offered, self._positions = {}, {}
        points: dict[RestorePoint, Held] = {}
        if any_step:
            shapes = self.template.shapes()
            for snap in self.snapshots.all(shapes):
                point = (snap.step, snap.layout)
                self._offered[point] = snap.pieces
                data = restore_plan.NO_DATA
                if snap.data is not None:
                    self._positions[point] = snap.data
                    whole = DataPosition.from_json(snap.data).whole
                    data = restore_plan.ALL_DATA if whole else restore_plan.SOME_DATA
                points[point] = Held(point, snap.tier, frozenset(snap.pieces), data=data)
            for copy in self.buddies.all(shapes):
                point = (copy.step, copy.layout)
                self._offered[point] = {**copy.pieces, **self._offered.get(point, {})}
                held = points.get(point, Held(point))
                points[point] = Held(point, held.tier, held.own, frozenset(copy.pieces), held.data)
        return MemberOffer(self._address(), tuple(points[p] for p in sorted(points)))

    def _address(self) -> str:
        """Where the other members of this epoch fetch this process's pieces ("" in a world of one,
        which fetches nothing): its piece server, started by the first epoch that has others."""
        assignment = self.runtime.assignment
        if assignment is None or assignment.world_size < 2:
            return ""
        if self._server is None:
            self._server = PieceServer(self._serve, on_copied=self.snapshots.pin)
        host = advertised_host(assignment.jax_coordinator or "127.0.0.1:0", self.peer_host)
        return f"{host}:{self._server.port}"

    def _serve(self, point: RestorePoint) -> Mapping[tuple[int, Cell], np.ndarray]:
        """What this process's piece server hands out for ``point``."""
        return {**self.buddies.held(*point), **self.snapshots.held(*point), **self._offered.get(point, {})}

    # ---- from the members' memory ----------------------------------------------------------------

    def _from_members(
        self, plan: FromMembers, rank: int, shardings: list[NamedSharding], phases: dict[str, float]
    ) -> Restored:
        """The state of ``plan.point`` on the new mesh: this process's pieces from memory, the rest
        fetched as the plan says."""
        t = time.monotonic()
        pieces = self._gather(rank, plan.point, plan.fetch.holders)
        phases["restore_fetch"] = time.monotonic() - t
        t = time.monotonic()
        leaves = self._build(pieces, shardings)
        phases["restore_build"] = time.monotonic() - t
        self.snapshots.drop_after(plan.step)
        self.buddies.drop_after(plan.step)
        restored_bytes = plan.fetch.bytes_by_source
        source = "+".join(sorted(restored_bytes)) or "memory"
        data = None
        if plan.data_from is not None:
            # One member that holds every host's position hands it to all (one value in the store).
            mine = self._positions.get(plan.point, "")
            shared = self.runtime.share_text(f"input-{plan.step}", mine, plan.data_from, self.timeout_s)
            data = DataPosition.from_json(shared)
        return Restored(leaves, plan.step, source, restored_bytes, phases, data)

    def _gather(
        self, me: int, point: RestorePoint, holders: Mapping[tuple[int, Cell], tuple[int, str]]
    ) -> Pieces:
        """The pieces of ``holders``: this process's own from memory, the rest from their holders,
        every holder at once."""
        local = self._offered.get(point, {})
        pieces: Pieces = {k: local[k] for k, (rank, _) in holders.items() if rank == me}
        wanted: dict[int, list[tuple[int, Cell]]] = {}
        for key, (rank, _) in holders.items():
            if rank != me:
                wanted.setdefault(rank, []).append(key)
        if not wanted:
            return pieces
        with ThreadPoolExecutor(max_workers=len(wanted), thread_name_prefix="remesh-fetch") as pool:
            futures = {
                rank: pool.submit(fetch, self.peers[rank], point, keys, self.timeout_s)
                for rank, keys in wanted.items()
            }
            for rank, future in futures.items():
                try:
                    pieces.update(future.result())
                except FetchFailed as exc:
                    raise PeerFailure(
                        f"rank {rank} could not serve its pieces of step {point[0]}: {exc}"
                    ) from exc
        return pieces

    def _build(self, pieces: Pieces, shardings: list[NamedSharding]) -> list[jax.Array]:
        """The state's leaves on the new mesh, each device's part assembled from ``pieces``, once
        they are on the devices."""
        leaves = build(pieces, self.template.shapes(), shardings)
        on_device(leaves)
        return leaves

    # ---- from storage ------------------------------------------------------------------------------

    def _from_storage(
        self,
        assignment: Assignment,
        shardings: list[NamedSharding],
        read: ReadCheckpoint,
        phases: dict[str, float],
    ) -> Restored | None:
        """The newest committed checkpoint newer than ``read.newer_than``, chosen by rank 0 so every
        member loads the same one; None where none is readable by every member."""
        above = read.newer_than
        # The commits the coordinator accepted in this job. None where it accepted none yet: a job
        # launched again (the full restart) resumes from what an earlier run committed, guarded by
        # the epoch fence only; once this job commits, only its own accepted commits count.
        trusted: Trusted = assignment.commits or None
        sharded = any(not s.is_fully_replicated for s in shardings)
        bound: int | None = None
        template = self.template.leaves()
        replicated: tuple[PyTree, CheckpointStore] | None = None
        for attempt in itertools.count():
            # Rank 0 chooses, so that every member loads the same step. A sharded state's files are
            # checked by every member, a share each, before anyone restores; a replicated state is
            # read by each member from the first tier it reaches that holds it. One member that
            # cannot sends every member to the step before it (past ``above`` only: a step the
            # members hold is not read from storage, and is restored where none newer is readable).
            candidate, tier = (
                self._newest_checkpoint(bound, trusted, above=above)
                if assignment.rank == 0 and (bound is None or bound >= 0)
                else (-1, -1)
            )
            chosen = self.runtime.allgather_int(f"checkpoint-{attempt}", candidate, self.timeout_s)[0]
            if chosen < 0:
                return None
            if sharded:
                tier = self.runtime.allgather_int(f"checkpoint-tier-{attempt}", tier, self.timeout_s)[0]
                ok = self.checkpoints[tier].verify_share(
                    chosen, assignment.rank, assignment.world_size, trusted
                )
            else:
                replicated = self._read_replicated(chosen, template, trusted)
                ok = replicated is not None
            verdicts = self.runtime.allgather_int(f"checkpoint-verified-{attempt}", int(ok), self.timeout_s)
            if all(verdicts):
                break
            log.warning(
                "checkpoint not readable by every member: every member falls back to an earlier one",
                step=chosen,
                source=self.checkpoints[tier].name if sharded else "any tier",
                found_by=[rank for rank, v in enumerate(verdicts) if not v],
            )
            replicated = None
            bound = chosen - 1
        self.snapshots.clear()
        self.buddies.clear()
        if sharded:
            # A sharded state is in a tier every host reaches (the one rank 0 chose it from), its
            # files checked against the marker already, a share by each member.
            store = self.checkpoints[tier]
            abstract = self.template.tree(
                [
                    jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                    for x, s in zip(template, shardings, strict=True)
                ]
            )
            t = time.monotonic()
            try:
                with peer_failures():
                    tree = store.restore_global(chosen, abstract, trusted, verified=True)
            except CheckpointError as exc:  # gone or cut short since the members checked it
                raise RestartProcess(
                    f"checkpoint of step {chosen} chosen by rank 0: {exc}", Why.CHECKPOINT_GONE
                ) from exc
            leaves = jax.tree_util.tree_leaves(tree)
            on_device(leaves)
            phases["restore_read"] = time.monotonic() - t
        else:
            assert replicated is not None  # every member read the chosen step
            tree, store = replicated
            host = jax.tree_util.tree_leaves(tree)
            t = time.monotonic()
            leaves = self._build({(i, whole(x.shape)): np.asarray(x) for i, x in enumerate(host)}, shardings)
            phases["restore_build"] = time.monotonic() - t
        nbytes = sum(int(x.nbytes) for x in first_replicas(leaves).values())
        committed = store.extra_of(chosen, trusted).get(INPUT_KEY)
        data = None if committed is None else DataPosition.from_dict(committed)
        return Restored(leaves, chosen, store.name, {store.name: nbytes}, phases, data)

    def _read_replicated(
        self, step: int, template: list[Any], trusted: Trusted
    ) -> tuple[PyTree, CheckpointStore] | None:
        """Committed step ``step`` of a replicated state from the first tier this host reaches whose
        files of it are all there (restoring reads them against the marker, once); one that differs
        here sends this host to the next tier. None where no tier it reaches holds a readable copy."""
        structure = self.template.tree(template)
        for store in (s for s in self.checkpoints if s.latest_present(step, trusted) == step):
            try:
                return store.restore_state(step, structure, trusted), store
            except CheckpointError as exc:
                log.warning("checkpoint not readable here", step=step, source=store.name, error=str(exc))
        return None

    def _newest_checkpoint(
        self, bound: int | None, trusted: Trusted, above: int | None = None
    ) -> tuple[int, int]:
        """The newest checkpoint at or below ``bound`` (None: any) and past ``above`` whose commit the
        coordinator accepted and whose files are all there at the sizes its marker says (the members
        then read them against its digests: each its share of a sharded state, each the whole of a
        replicated one), and the index of the tier holding it (-1, -1: none)."""
        best, tier = -1, -1
        for i, store in enumerate(self.checkpoints):
            step = store.latest_present(bound, trusted, above)
            if step is not None and step > best:
                best, tier = step, i
        return best, tier
