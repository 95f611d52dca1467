"""The JAX distributed runtime for one epoch: start, agree, stop — and the one place JAX errors are
translated into ``remesh.elastic`` errors.

Facts this module is built on (CPU, JAX 0.10): processes join with ``jax.distributed.initialize`` and
gloo collectives; a collective with a dead peer hangs until ``--xla_cpu_collective_timeout_seconds``
and then raises ``JaxRuntimeError``; after ``jax.distributed.shutdown()``, ``jax.clear_caches()`` and
``jax.extend.backend.clear_backends()`` the runtime can be initialised again in the same process for a
new process count, on a new port (the epoch's address). Arrays from before are invalid afterwards.

An epoch of one process has no runtime at all: nothing to join, nothing to agree with, and no socket
(an accelerator host may allow no TCP/UDP socket, and ``jax.distributed.initialize`` crashes where it
cannot bind). See ``Runtime``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator

import jax
import jax.extend
import structlog
from jax.errors import JaxRuntimeError

from remesh.elastic.agent_client import Assignment
from remesh.elastic.errors import AddressInUse, PeerFailure, TopologyChanged

__all__ = ["Runtime", "configure_backend", "peer_failures"]

log = structlog.get_logger("remesh.elastic")


def configure_backend(devices_per_host: int, collective_timeout_s: float, cache_dir: str | None) -> str:
    """Set the process-wide backend options; returns the platform. Must run before JAX creates its
    first backend.

    The platform is ``JAX_PLATFORMS``' first entry when set, else ``cpu`` unless this machine has an
    accelerator plugin JAX can load (``jax_plugins``: CUDA, ROCm, TPU). CPU only: as many virtual
    devices as the host is given, gloo collectives, and the collective timeout that turns a dead
    peer into a ``JaxRuntimeError``. On GPU and TPU neither flag exists: a dead peer surfaces as
    the coordination service's error, or as the agent's new epoch at the next step boundary (the
    watchdog ends a step stuck past ``stuck_step_exit_s``).
    """
    platform = _platform()
    if platform == "cpu":
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            flags += f" --xla_force_host_platform_device_count={devices_per_host}"
        if "xla_cpu_collective_timeout_seconds" not in flags:
            flags += f" --xla_cpu_collective_timeout_seconds={max(1, round(collective_timeout_s))}"
        os.environ["XLA_FLAGS"] = flags.strip()
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    else:
        log.info("accelerator backend: CPU collective flags not set", platform=platform)
    # A recoverable coordination service does not turn one task's death into an error pushed to every
    # other task, and lets survivors shut down without waiting for the dead at the shutdown barrier.
    jax.config.update("jax_enable_recoverability", True)
    # The preemption sync manager is one more component bound to every peer; remesh has its own signal.
    jax.config.update("jax_enable_preemption_service", False)
    if cache_dir:
        # Re-initialising clears the in-memory cache; the persistent one makes re-compiles cheap.
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        _cache_from_every_process()
    return platform


def _platform() -> str:
    """The platform JAX will pick, without starting a backend (that would fix its options)."""
    chosen = (os.environ.get("JAX_PLATFORMS") or "").split(",")[0].strip().lower()
    if chosen:
        return "gpu" if chosen in ("cuda", "rocm") else chosen
    import importlib.util

    for plugin, platform in (("jax_cuda12_plugin", "gpu"), ("jax_cuda13_plugin", "gpu"), ("libtpu", "tpu")):
        if importlib.util.find_spec(plugin) is not None:
            return platform
    return "cpu"


def _cache_from_every_process() -> None:
    """Let every JAX process write its own persistent-cache entries, not only process 0.

    JAX writes cache entries from process 0 alone (to spare shared filesystems from contention), but
    on CPU the cache key differs per process, so every other rank misses every time and a process
    that re-joins at rank 1 compiles from cold (seconds, most of a recovery). Keys differ, so
    processes never write the same entry. Private JAX API: if it moves, this does nothing.
    """
    try:
        from jax._src import compiler, distributed
    except ImportError:  # pragma: no cover
        return
    original = getattr(compiler, "_cache_write", None)
    if original is None or getattr(original, "_remesh", False):
        return

    def write(*args: object, **kwargs: object) -> object:
        own = distributed.global_state.process_id
        distributed.global_state.process_id = 0
        try:
            return original(*args, **kwargs)
        finally:
            distributed.global_state.process_id = own

    write._remesh = True  # type: ignore[attr-defined]
    compiler._cache_write = write  # type: ignore[assignment]


def as_peer_failure(exc: JaxRuntimeError) -> PeerFailure:
    """A failed collective, said as what it almost always means here."""
    return PeerFailure(f"a collective failed, a peer is probably gone: {str(exc).splitlines()[0]}")


@contextlib.contextmanager
def peer_failures() -> Iterator[None]:
    """Translate a failed collective into ``PeerFailure``."""
    try:
        yield
    except JaxRuntimeError as exc:
        raise as_peer_failure(exc) from exc


class Runtime:
    """The JAX distributed runtime of one epoch; an epoch of one process has none.

    A world of one (``world_size == 1``) joins nothing: no rendezvous, no port probe, no
    ``jax.distributed.initialize``, so no socket opens (on an accelerator host none may). Its
    barriers return at once, its gathers return its own value, and what it posts stays in this
    process.

    The backend outlives epochs of one: ``stop`` leaves it (and JAX's compiled programs) in place,
    so an in-process recovery of a one-host job neither opens the devices again (6-11 s on a TPU
    chip) nor compiles again. Between epochs:

    - one -> one: the backend stays;
    - many -> one or many: ``stop`` shuts the distributed runtime down and clears the backend (an
      epoch of one after it makes the next as process 0 of 1, whatever rank this process held);
    - one -> many: ``start`` clears the backend the epochs of one kept, before ``initialize`` (JAX
      refuses to initialise once a backend exists); that epoch's arrays are invalid afterwards, as
      after any re-mesh.

    Rank 0's process hosts the epoch's coordination service, and every other member disconnects
    from it as it leaves the epoch: one that finds it gone is ended by JAX ("Failed to disconnect
    from coordination service"). After a failure the members leave at different moments (a survivor
    still in its collective leaves when that times out), so rank 0's ``stop`` leaves the service
    running, retired, and shuts it down once the next epoch's members met (every one of them left
    this epoch by then), or when the runtime closes.
    """

    def __init__(self, init_timeout_s: float, shutdown_timeout_s: float = 2.0) -> None:
        self.init_timeout_s = init_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.assignment: Assignment | None = None
        # What a world of one posted (``post_int``, ``post_text``), by key: it has no coordination
        # service.
        self._posted: dict[str, int] = {}
        self._posted_texts: dict[str, str] = {}
        # Coordination services of epochs this process left as rank 0, still serving the members
        # that have not disconnected yet (see the class).
        self._retired: list[object] = []

    @property
    def solo(self) -> bool:
        """Whether the current epoch is a world of one (no distributed runtime)."""
        return self.assignment is not None and self.assignment.world_size == 1

    def start(self, assignment: Assignment, latest_epoch: Callable[[], int] = lambda: 0) -> None:
        """Join the epoch's runtime (the mesh over its devices is ``sharding.build_mesh``'s).

        Every member first meets the others at a rendezvous that plain sockets hold on the epoch's
        port (``_Rendezvous``): JAX's own join cannot be left once begun (a missing member aborts the
        process after the timeout), while this one can. When ``latest_epoch()`` names a newer epoch
        before all members arrived (a member of this epoch died and was replaced), it raises
        ``TopologyChanged`` and the process moves to the next epoch as it is: no restart, and the
        agent's warm standby is not spent. A world of one joins nothing (see the class).
        """
        log.info(
            "joining the JAX runtime",
            epoch=assignment.epoch,
            rank=assignment.rank,
            world_size=assignment.world_size,
            address=assignment.jax_coordinator if assignment.world_size > 1 else None,
        )
        if assignment.world_size == 1:
            _forget_distributed()
            self._posted, self._posted_texts = {}, {}
            self.assignment = assignment
            self._shut_retired()
            return
        if _backend_exists():
            # The epochs of one before kept theirs (or the user's code made one): JAX initialises
            # only before any backend exists.
            _drop_backend()
        if assignment.rank == 0 and _port_taken(assignment.jax_coordinator):
            # JAX would crash binding it, and the others would dial whatever listens there.
            raise AddressInUse(assignment.jax_coordinator, assignment.epoch)
        _Rendezvous(assignment, latest_epoch, self.init_timeout_s).meet()
        # Every member of this epoch left the one before: its service has nobody left to serve.
        self._shut_retired()
        if assignment.rank != 0:
            _wait_reachable(assignment.jax_coordinator, self.init_timeout_s)
        with peer_failures():
            jax.distributed.initialize(
                coordinator_address=assignment.jax_coordinator,
                num_processes=assignment.world_size,
                process_id=assignment.rank,
                initialization_timeout=max(1, int(self.init_timeout_s)),
                # We re-initialise long before the coordination service would give up on a dead peer;
                # a short shutdown timeout keeps a teardown with dead peers from hanging.
                shutdown_timeout_seconds=max(1, int(self.shutdown_timeout_s)),
            )
        self.assignment = assignment

    def _client(self):  # type: ignore[no-untyped-def]
        from jax._src import distributed

        return distributed.global_state.client

    def barrier(self, name: str, timeout_s: float) -> None:
        """Wait for every process of the epoch, through the coordination service (no collective)."""
        assert self.assignment is not None
        if self.solo:
            return
        with peer_failures():
            self._client().wait_at_barrier(self._key(name), int(timeout_s * 1000))

    def _key(self, name: str) -> str:
        """Where this epoch's values for ``name`` live in the coordination service's store."""
        assert self.assignment is not None
        return f"remesh/e{self.assignment.epoch}/{name}"

    def allgather_int(self, name: str, value: int, timeout_s: float) -> list[int]:
        """Every process's ``value``, in rank order, through the coordination service's key-value store."""
        assert self.assignment is not None
        if self.solo:
            return [value]
        prefix = self._key(name)
        client = self._client()
        with peer_failures():
            client.key_value_set(f"{prefix}/{self.assignment.rank}", str(value))
            return [
                int(client.blocking_key_value_get(f"{prefix}/{r}", int(timeout_s * 1000)))
                for r in range(self.assignment.world_size)
            ]

    def post_int(self, name: str, value: int) -> None:
        """Offer this process's ``value`` for ``name``; ``posted_ints`` reads every one once all are in."""
        assert self.assignment is not None
        if self.solo:
            self._posted[self._key(name)] = value
            return
        with peer_failures():
            self._client().key_value_set(f"{self._key(name)}/{self.assignment.rank}", str(value))

    def posted_ints(self, name: str) -> list[int] | None:
        """Every process's ``value`` for ``name`` (``post_int``), in rank order; None while some are
        missing. Never waits: the caller decides how long to, and what ends the wait."""
        assert self.assignment is not None
        if self.solo:
            mine = self._posted.get(self._key(name))
            return None if mine is None else [mine]
        with peer_failures():
            posted = dict(self._client().key_value_dir_get(f"{self._key(name)}/"))
        values = {int(key.rpartition("/")[2]): int(value) for key, value in posted.items()}
        ranks = range(self.assignment.world_size)
        return [values[r] for r in ranks] if all(r in values for r in ranks) else None

    def post_text(self, name: str, value: str) -> None:
        """Offer this process's ``value`` for ``name`` (small: the store keeps it in rank 0's
        process); ``posted_texts`` reads what every process offered."""
        assert self.assignment is not None
        if self.solo:
            self._posted_texts[self._key(name)] = value
            return
        with peer_failures():
            self._client().key_value_set(f"{self._key(name)}/{self.assignment.rank}", value)

    def posted_texts(self, name: str) -> dict[int, str]:
        """What the processes offered for ``name`` so far (``post_text``), by rank. Never waits."""
        assert self.assignment is not None
        if self.solo:
            mine = self._posted_texts.get(self._key(name))
            return {} if mine is None else {0: mine}
        with peer_failures():
            posted = self._client().key_value_dir_get(f"{self._key(name)}/")
        return {int(key.rpartition("/")[2]): str(value) for key, value in posted}

    def withdraw_text(self, name: str) -> None:
        """Take back what this process offered for ``name`` (nobody reads it any more)."""
        assert self.assignment is not None
        if self.solo:
            self._posted_texts.pop(self._key(name), None)
            return
        with peer_failures():
            self._client().key_value_delete(f"{self._key(name)}/{self.assignment.rank}")

    def share_text(self, name: str, value: str, source: int, timeout_s: float) -> str:
        """Rank ``source``'s ``value`` for ``name``, on every process: it offers it, the others wait
        for it. One value through the store, not one per process."""
        assert self.assignment is not None
        if self.solo or self.assignment.rank == source:
            if not self.solo:
                self.post_text(name, value)
            return value
        with peer_failures():
            return str(
                self._client().blocking_key_value_get(f"{self._key(name)}/{source}", int(timeout_s * 1000))
            )

    def allgather_text(self, name: str, value: str, timeout_s: float) -> list[str]:
        """Every process's ``value``, in rank order, through the coordination service's key-value
        store (small values: it keeps them all in rank 0's process)."""
        assert self.assignment is not None
        if self.solo:
            return [value]
        prefix = self._key(name)
        client = self._client()
        with peer_failures():
            client.key_value_set(f"{prefix}/{self.assignment.rank}", value)
            return [
                str(client.blocking_key_value_get(f"{prefix}/{r}", int(timeout_s * 1000)))
                for r in range(self.assignment.world_size)
            ]

    def leave_together(self, timeout_s: float) -> float:
        """Leave the runtime at the end of the job, every process at once and rank 0 last.

        Rank 0 hosts the coordination service: a process that disconnects after it went away aborts
        ("Failed to disconnect from coordination service"). So every process meets at a barrier, the
        others leave, and rank 0 waits until the service sees none of them live (bounded by
        ``timeout_s``) before it leaves. Returns the seconds it took.
        """
        assert self.assignment is not None
        t0 = time.monotonic()
        self.barrier("leaving", timeout_s)
        if self.assignment.rank == 0 and not self.solo:
            client = self._client()
            everyone = list(range(self.assignment.world_size))
            deadline = t0 + timeout_s
            while len(client.get_live_nodes(everyone)) > 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        self.stop()
        self._shut_retired()  # every member left: the service goes now, not at the next epoch
        return time.monotonic() - t0

    def stop(self) -> float:
        """Leave the epoch's runtime; returns the seconds it took. Arrays from this epoch are invalid,
        except after an epoch of one: its backend, arrays and compiled programs stay (see the class)."""
        t0 = time.monotonic()
        if self.solo:
            self.assignment = None
            return time.monotonic() - t0
        self._retire_service()
        try:
            jax.distributed.shutdown()
        except Exception as exc:  # a dead peer can fail the shutdown barrier: the runtime is gone anyway
            log.warning("JAX shutdown reported an error", error=str(exc).splitlines()[0])
        _drop_backend()
        self.assignment = None
        return time.monotonic() - t0

    def close(self) -> None:
        """The process is done with JAX's runtime: the services it retired go."""
        self._shut_retired()

    def _retire_service(self) -> None:
        """Take the coordination service this process hosts (rank 0) out of JAX's hands, still
        serving: ``jax.distributed.shutdown`` then disconnects this process's client only. Private JAX
        API: if it moves, the service is shut down with the client, as before."""
        try:
            from jax._src import distributed
        except ImportError:  # pragma: no cover
            return
        state = distributed.global_state
        service = getattr(state, "service", None)
        if service is not None:
            self._retired.append(service)
            state.service = None

    def _shut_retired(self) -> None:
        """Shut the retired services down, in the background: one whose dead member never
        disconnected waits out its shutdown timeout, and nothing here needs to wait for it."""
        retired, self._retired = self._retired, []
        for service in retired:
            threading.Thread(
                target=_shut_service, args=(service,), name="remesh-retired-service", daemon=True
            ).start()


def _shut_service(service: object) -> None:
    try:
        service.shutdown()  # type: ignore[attr-defined]
    except Exception as exc:  # it served an epoch that is over; nothing depends on it any more
        log.warning("a retired JAX coordination service reported an error", error=str(exc).splitlines()[0])


def _drop_backend() -> None:
    """Clear JAX's backends and what was compiled for them: their arrays are invalid afterwards."""
    jax.clear_caches()
    jax.extend.backend.clear_backends()


def _backend_exists() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # pragma: no cover - private JAX API moved: assume one
        return True


def _forget_distributed() -> None:
    """After an epoch of many, make the next backend a single process's: JAX builds it from the
    distributed state's process id and count, which its shutdown leaves as they were (a process that
    was rank 1 of 2 would make a CPU client of node 1 of 2, with no peers). Private JAX API: if it
    moves, this does nothing."""
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover
        return
    state = distributed.global_state
    if getattr(state, "client", None) is None and getattr(state, "num_processes", 1) != 1:
        state.process_id = 0
        state.num_processes = 1


class _Rendezvous:
    """Every member of an epoch meets on rank 0's port before anyone enters JAX's join.

    Rank 0 listens on the epoch's port (the JAX coordination service takes it right after), each
    other member connects and names its epoch and rank; once all have come, rank 0 closes the
    listener and answers each "go". Everyone waits in slices of ``_POLL_S`` and gives up with
    ``TopologyChanged`` as soon as ``latest_epoch()`` names a newer epoch: a member that will never
    come (it died after the epoch was planned) costs the others a moment, not a process restart.
    """

    _POLL_S = 0.05

    def __init__(self, assignment: Assignment, latest_epoch: Callable[[], int], timeout_s: float) -> None:
        self.assignment = assignment
        self.latest_epoch = latest_epoch
        self.deadline = time.monotonic() + timeout_s
        host, _, port = assignment.jax_coordinator.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.hello = f"remesh {assignment.epoch} {assignment.rank}\n".encode()

    def _check(self, waiting_for: str) -> None:
        latest = self.latest_epoch()
        if latest > self.assignment.epoch:
            raise TopologyChanged(self.assignment.epoch, latest)
        if time.monotonic() > self.deadline:
            raise PeerFailure(f"epoch {self.assignment.epoch}: {waiting_for} did not come in time")

    def meet(self) -> None:
        t0 = time.monotonic()
        if self.assignment.rank == 0:
            self._gather()
        else:
            self._report()
        log.info("every member came", epoch=self.assignment.epoch, seconds=round(time.monotonic() - t0, 3))

    def _gather(self) -> None:
        expected = set(range(1, self.assignment.world_size))
        arrived: dict[int, socket.socket] = {}
        with self._listen() as listener:
            listener.settimeout(self._POLL_S)
            try:
                while set(arrived) != expected:
                    self._check(f"members {sorted(expected - set(arrived))}")
                    for rank in _hung_up(arrived):
                        # It came, then died (its socket closed): it is not here any more.
                        arrived.pop(rank).close()
                    try:
                        conn, _ = listener.accept()
                    except TimeoutError:
                        continue
                    rank = self._hello_of(conn)
                    if rank in expected:
                        arrived.setdefault(rank, conn)
                    else:
                        conn.close()  # a stray or late connection: not a member of this epoch
            except BaseException:
                for conn in arrived.values():
                    conn.close()
                raise
        # The listener is closed: JAX's service may bind the port now. Then release everyone.
        for conn in arrived.values():
            with contextlib.suppress(OSError), conn:
                conn.sendall(b"go\n")

    def _listen(self) -> socket.socket:
        """A listener on every interface, like the coordination service that takes the port next."""
        try:
            if socket.has_dualstack_ipv6():
                return socket.create_server(("", self.port), family=socket.AF_INET6, dualstack_ipv6=True)
            return socket.create_server(("", self.port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise AddressInUse(self.assignment.jax_coordinator, self.assignment.epoch) from exc
            raise

    def _hello_of(self, conn: socket.socket) -> int:
        conn.settimeout(1.0)
        try:
            words = conn.recv(64).decode(errors="replace").split()
        except OSError:
            return -1
        if len(words) != 3 or words[0] != "remesh" or words[1] != str(self.assignment.epoch):
            return -1
        return int(words[2]) if words[2].isdigit() else -1

    def _report(self) -> None:
        while True:
            self._check("rank 0")
            try:
                conn = socket.create_connection((self.host, self.port), timeout=self._POLL_S)
            except OSError:
                time.sleep(0.01)
                continue
            with conn:
                try:
                    conn.sendall(self.hello)
                except OSError:
                    continue
                if self._await_go(conn):
                    return

    def _await_go(self, conn: socket.socket) -> bool:
        conn.settimeout(self._POLL_S)
        while True:
            self._check("the others")
            try:
                data = conn.recv(8)
            except TimeoutError:
                continue
            except OSError:
                return False
            # "go": everyone came. Empty: rank 0 left the rendezvous (it moved on, or restarts).
            if data.startswith(b"go"):
                return True
            time.sleep(self._POLL_S)
            return False


def _hung_up(conns: dict[int, socket.socket]) -> list[int]:
    """The ranks whose connection closed: a member sends nothing after its hello, so a readable
    socket means the other end went away."""
    readable, _, _ = select.select(list(conns.values()), [], [], 0)
    gone = []
    for rank, conn in conns.items():
        if conn in readable:
            try:
                data = conn.recv(1, socket.MSG_PEEK)
            except OSError:
                data = b""
            if not data:
                gone.append(rank)
    return gone


def _port_taken(address: str) -> bool:
    """Whether another process listens on the port of ``address`` (the coordination service binds
    it on every interface). A bind with SO_REUSEADDR fails only for a listener, not for connections
    in TIME_WAIT; a service that sets SO_REUSEPORT (gRPC does) is found as well."""
    port = int(address.rpartition(":")[2])
    for family, any_address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((any_address, port))
                return False
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            # No IPv6 on this host: try IPv4.
    return False


def _wait_reachable(address: str, timeout_s: float) -> None:
    """Wait until rank 0's coordination service accepts connections.

    A JAX client that finds no service backs off for up to a second between attempts; rank 0's
    process often starts its service a few hundred milliseconds after the others are ready, so
    polling here (every 10 ms) joins as soon as it is up.
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=0.05):
                return
        except OSError:
            time.sleep(0.01)
