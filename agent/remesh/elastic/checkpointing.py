"""Checkpoints written beside training, and the interface of a checkpoint tier the session uses.

A checkpoint is due every ``Policy.checkpoint_every`` steps. A replicated state is copied to the host
and saved by rank 0; a sharded one is written by every process for its own shards (Orbax, or plain
files of pieces) and committed by rank 0 once every process wrote. Every commit is approved by the
coordinator, through the agent, for the epoch it was written in (``approve``): a writer of an older
epoch is refused. Saves run on a thread of their own, one at a time, below the loop's priority.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any, Protocol

import jax
import numpy as np
import structlog

from remesh.elastic.agent_client import AgentLink, Assignment
from remesh.elastic.checkpoints import Approve, CheckpointError, StaleEpoch, Trusted
from remesh.elastic.data import Gather
from remesh.elastic.errors import AgentUnreachable, EpochSuperseded
from remesh.elastic.exchange import Pieces, beside_training
from remesh.elastic.host_copies import copies_of
from remesh.elastic.runtime import Runtime
from remesh.elastic.sharding import first_replicas
from remesh.elastic.template import StateTemplate

__all__ = ["INPUT_KEY", "CheckpointSaver", "CheckpointStore"]

# The key of a checkpoint's ``extra`` under which every host's input position after its step is
# committed (``DataPosition.to_dict``), where the input keeps its own position (``IteratorData``).
INPUT_KEY = "input"

log = structlog.get_logger("remesh.elastic")

PyTree = Any


class CheckpointStore(Protocol):
    """A checkpoint tier (``remesh.elastic.checkpoints``): local directory or GCS."""

    name: str

    def save(
        self, step: int, epoch: int, state: PyTree, extra: Mapping[str, Any], approve: Approve | None = None
    ) -> None: ...

    def latest_present(
        self, max_step: int | None = None, trusted: Trusted = None, above: int | None = None
    ) -> int | None: ...

    def verify_share(self, step: int, rank: int, world_size: int, trusted: Trusted = None) -> bool: ...

    def restore_state(self, step: int, template: PyTree, trusted: Trusted = None) -> PyTree: ...

    def fence(self, epoch: int) -> None: ...

    def extra_of(self, step: int, trusted: Trusted = None) -> dict[str, Any]: ...

    # A sharded state: every process writes its own shards (tiers with ``sharded_saves``).
    sharded_saves: bool

    def prepare_global(self, step: int, epoch: int) -> bool: ...

    def write_global(self, step: int, state: PyTree) -> None: ...

    # ... as one plain file of its pieces per process (``write_pieces``) rather than with Orbax.
    writes_pieces: bool
    # Whether ``write_global`` tells the digests of what it wrote (rank 0 commits once all did).
    tells_digests: bool

    def write_pieces(self, step: int, rank: int, layout: int, pieces: Pieces) -> int: ...

    def commit_global(
        self, step: int, epoch: int, extra: Mapping[str, Any] | None = None, approve: Approve | None = None
    ) -> None: ...

    def restore_global(
        self, step: int, target: PyTree, trusted: Trusted = None, verified: bool = False
    ) -> PyTree: ...


class CheckpointSaver:
    """Saves checkpoints to ``stores`` every ``every`` steps (0: never) in the background."""

    def __init__(
        self,
        stores: list[CheckpointStore],
        runtime: Runtime,
        agent: AgentLink,
        template: StateTemplate,
        stats: dict[str, float],
        *,
        every: int,
        timeout_s: float,
    ) -> None:
        self.stores = stores
        self.runtime = runtime
        self.agent = agent
        self.template = template
        self.stats = stats
        self.every = every
        self.timeout_s = timeout_s
        self._pool = beside_training("remesh-ckpt")
        self._saving: Future[None] | None = None

    def close(self) -> None:
        """A save on its way is waited for; the thread ends."""
        self._pool.shutdown(wait=True)

    def due(self, step: int) -> bool:
        """Whether a checkpoint of ``step`` is due."""
        return bool(self.every and self.stores and not step % self.every)

    def maybe_save(
        self, step: int, assignment: Assignment, leaves: list[jax.Array], position: Gather | None = None
    ) -> None:
        """Save ``step`` where it is due (every ``every`` steps), in the background: every process
        writes its own shards of a sharded state, rank 0 a replicated one. One save at a time.
        ``position``: gathers every host's input position after the step (``InputPositions``), which
        rank 0 commits with it."""
        if not self.due(step):
            return
        sharded = any(not x.sharding.is_fully_replicated for x in leaves)
        if not sharded and assignment.rank != 0:
            return
        if self._saving is not None and not self._saving.done():
            if sharded:  # every process takes part in a sharded save: none may go ahead alone
                self.wait()
            else:
                log.warning("previous checkpoint still writing; skipping this one", step=step)
                return
        if sharded:
            tree = self.template.tree(leaves)
            self._saving = self._pool.submit(self._save_sharded, step, assignment, tree, position)
        else:
            self._saving = self._pool.submit(self._save_all, step, assignment.epoch, leaves, position)

    def _extra(self, step: int, epoch: int, position: Gather | None) -> dict[str, Any]:
        """What rank 0 commits with ``step``: the step, and every host's input position after it
        where one is kept (gathered first, while the members' posts are fresh)."""
        extra: dict[str, Any] = {"step": step}
        # Gathered until every member posted, or the epoch moved on (a member died meanwhile).
        found = position(lambda: self.agent.latest.epoch != epoch) if position is not None else None
        if found is not None:
            if found.whole:
                extra[INPUT_KEY] = found.to_dict()
            else:
                log.warning("checkpoint committed without the hosts' input positions", step=step, epoch=epoch)
        return extra

    def _save_sharded(
        self,
        step: int,
        assignment: Assignment,
        tree: PyTree,
        position: Gather | None = None,
    ) -> None:
        """Every process writes its own shards (Orbax), rank 0 commits; tiers that can take a
        sharded state only (a directory every host reaches)."""
        t = time.monotonic()
        try:
            extra = self._extra(step, assignment.epoch, position) if assignment.rank == 0 else {"step": step}
            # The loop is already steps ahead: Orbax must find these arrays computed, or what it
            # does with them queues on the devices among the next steps' collectives, in an order
            # that differs between processes (the step's gloo collectives then time out).
            jax.block_until_ready(tree)
            # This process writes the shards it holds the first replica of.
            firsts = first_replicas(jax.tree_util.tree_leaves(tree))
            nbytes = sum(int(x.nbytes) for x in firsts.values())
            pieces: Pieces | None = None  # host arrays, made only for a tier that writes pieces
            for store in self.stores:
                if not store.sharded_saves:
                    continue
                ok = 1 if assignment.rank != 0 else self._prepare_sharded(store, step, assignment.epoch)
                if not self.runtime.allgather_int(f"ckpt-{store.name}-{step}", ok, self.timeout_s)[0]:
                    continue
                if store.writes_pieces:
                    # No barrier inside a plain write, unlike Orbax's: every process says it wrote
                    # (1) or failed (0) before rank 0 commits.
                    if pieces is None:
                        pieces = {key: np.asarray(data) for key, data in firsts.items()}
                    written = self._write_pieces(store, step, assignment, pieces)
                    if not all(
                        self.runtime.allgather_int(
                            f"ckpt-{store.name}-{step}-written", written, self.timeout_s
                        )
                    ):
                        log.warning("sharded checkpoint not committed: a process could not write", step=step)
                        continue
                else:
                    store.write_global(step, tree)
                    if store.tells_digests:
                        # Every process told the digests of its files before rank 0 commits: it
                        # then reads only its own, not every host's state.
                        self.runtime.allgather_int(f"ckpt-{store.name}-{step}-told", 1, self.timeout_s)
                self.stats["checkpoints"] += 1
                self.stats["checkpoint_bytes"] += nbytes
                if assignment.rank == 0:
                    try:
                        store.commit_global(step, assignment.epoch, extra, approve=self._approve)
                    except StaleEpoch as exc:
                        log.warning("checkpoint not committed: its epoch is over", step=step, error=str(exc))
        except Exception as exc:  # a failed save loses nothing committed; training goes on
            log.warning("sharded checkpoint save failed", step=step, error=str(exc).splitlines()[0])
        finally:
            self.stats["checkpoint_save_s"] += time.monotonic() - t

    @staticmethod
    def _write_pieces(store: CheckpointStore, step: int, assignment: Assignment, pieces: Pieces) -> int:
        try:
            store.write_pieces(step, assignment.rank, assignment.epoch, pieces)
            return 1
        except Exception as exc:  # said to the others, who then do not wait for a commit
            log.warning("sharded checkpoint not written", store=store.name, step=step, error=str(exc))
            return 0

    @staticmethod
    def _prepare_sharded(store: CheckpointStore, step: int, epoch: int) -> int:
        """Rank 0's go (1) or no-go (0) for a sharded save; a failure is a no-go, said at once, so
        the others do not wait for an answer that never comes."""
        try:
            return int(store.prepare_global(step, epoch))
        except Exception as exc:
            log.warning("sharded checkpoint not written", store=store.name, step=step, error=str(exc))
            return 0

    def wait(self) -> None:
        """Wait for the save on its way (the loop waits: ``stats["checkpoint_wait_s"]``)."""
        if self._saving is not None:
            t = time.monotonic()
            self._saving.result()
            self.stats["checkpoint_wait_s"] += time.monotonic() - t

    def fence_later(self, epoch: int) -> None:
        """From now on a writer of an older epoch (a host cut off from the coordinator that has not
        noticed yet) is refused by every tier. In the background, before any save."""
        self._pool.submit(self._fence_all, epoch)

    def _fence_all(self, epoch: int) -> None:
        for store in self.stores:
            try:
                store.fence(epoch)
            except Exception as exc:  # a newer epoch already wrote (StaleEpoch), or the tier is down
                log.warning(
                    "could not raise the checkpoint fence", store=store.name, epoch=epoch, error=str(exc)
                )

    def _save_all(self, step: int, epoch: int, leaves: list[jax.Array], position: Gather | None) -> None:
        """Rank 0 saves the replicated state: copied to the host here, in the background."""
        t = time.monotonic()
        try:
            extra = self._extra(step, epoch, position)
            try:
                # Copies that outlive the device buffers (the loop is steps ahead), made once: on an
                # accelerator np.asarray is one already, on CPU it is a view (``host_copies``).
                copies = copies_of({i: x.addressable_shards[0].data for i, x in enumerate(leaves)})
                host = [copies[i] for i in range(len(leaves))]
            except Exception as exc:  # the step failed (a peer died): nothing to save
                log.info("checkpoint not taken: its step failed", step=step, error=str(exc).splitlines()[0])
                return
            self._save_each(step, epoch, self.template.tree(host), extra)
        finally:
            self.stats["checkpoint_save_s"] += time.monotonic() - t

    def _save_each(self, step: int, epoch: int, tree: PyTree, extra: Mapping[str, Any]) -> None:
        for store in self.stores:
            if self.agent.latest.epoch != epoch:
                log.warning(
                    "epoch moved on; not writing a checkpoint for the old one", step=step, epoch=epoch
                )
                return
            try:
                store.save(step, epoch, tree, extra, approve=self._approve)
                self.stats["checkpoints"] += 1
                self.stats["checkpoint_bytes"] += sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(tree))
            except StaleEpoch as exc:
                log.warning(
                    "checkpoint not committed: its epoch is over", store=store.name, step=step, error=str(exc)
                )
                return
            except Exception as exc:  # a failed save loses nothing committed; training goes on
                log.warning("checkpoint save failed", store=store.name, step=step, error=str(exc))

    def _approve(self, step: int, epoch: int, tier: str) -> None:
        """The coordinator, through the agent, accepts the commit only while ``epoch`` is current."""
        try:
            self.agent.commit(epoch, step, tier)
        except EpochSuperseded as exc:
            raise StaleEpoch(str(exc)) from exc
        except AgentUnreachable as exc:
            raise CheckpointError(f"not committed: {exc}") from exc
