"""A job on this machine as real processes: coordinators and agents started as ``python -m remesh.cli``.

Mutual TLS is on unless asked otherwise: the cluster makes a throwaway CA in its directory and gives
each coordinator, agent and client the certificate of its identity, so the secure path is the path
the tests, the benchmarks and the demo take.

Used by the tests, the benchmarks and the demo. Every process starts in its own session; a signal to
a host reaches its process group and every process it started (an agent's trainers run in sessions
of their own, see remesh.agent.supervisor), and ``close()`` kills every process this object started
and their descendants (by pid, nothing else).
"""

from __future__ import annotations

__all__ = ["LocalCluster", "Proc", "cpu_seconds", "descendants", "wait_for"]

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc

from remesh.embedded._process import bound_to_parent
from remesh.embedded.certs import DevPki
from remesh.v1 import coordinator_pb2 as pb
from remesh.v1 import coordinator_pb2_grpc as pb_grpc
from remesh.v1.security import Role, Tls
from remesh.v1.security import channel as secure_channel

# The identity ``stub()`` and ``client_env()`` use: may read and drain.
OPERATOR = "operator"


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.02) -> object:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last value: {last!r})")


def cpu_seconds(pid: int) -> float | None:
    """CPU time ``pid`` has used so far (user + system), from /proc; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (children, their children...), from /proc; none elsewhere."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(name))
    found, todo = [], list(children.get(pid, ()))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, ()))
    return found


class Proc:
    def __init__(self, args: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        self.popen = subprocess.Popen(
            bound_to_parent(self.args),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the process and everything it started (the whole host)."""
        if not self.alive():
            return
        # Listed before the signal: a killed agent's trainers are handed to init at once.
        below = descendants(self.popen.pid)
        os.killpg(self.popen.pid, sig)  # first: a stopped agent starts nothing new meanwhile
        for pid in below:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def kill(self) -> None:
        self.signal_group(signal.SIGKILL)
        self.popen.wait(10)

    def terminate(self, timeout: float = 10) -> int:
        if self.alive():
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                return self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.popen.returncode

    def close(self) -> None:
        # The whole group, even when its leader is gone: a stopped (SIGSTOP) one needs SIGCONT to die.
        below = descendants(self.popen.pid)
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, sig)
            for pid in below:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)
        self._log.close()

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")


class LocalCluster:
    """Starts and tracks the processes of one job."""

    def __init__(
        self, tmp_path: Path, redis_url: str, job: str, *, secure: bool = True, launcher: Sequence[str] = ()
    ) -> None:
        """``launcher``: a command every process of the job runs under, which must exec it (such as
        ``nsenter --net=PATH --``: a network namespace of the caller's)."""
        self.tmp = tmp_path
        self.secure = secure
        self.launcher = list(launcher)
        # The coordinator's Unix socket (``start_coordinator(listen=...)``); "": it listens on TCP.
        self.unix_address = ""
        self._pki: DevPki | None = None
        self.redis_url = redis_url
        self.job = job
        self.procs: list[Proc] = []
        self.coordinator: Proc | None = None
        self.port = 0
        # Every coordinator replica's address, given to agents (several with --ha); empty: ``address``.
        self.addresses: list[str] = []
        self.agents: dict[str, Proc] = {}
        self._channel: grpc.Channel | None = None
        self._channels: dict[tuple[Role, str], grpc.Channel] = {}

    @property
    def address(self) -> str:
        return self.unix_address or f"127.0.0.1:{self.port}"

    @property
    def pki(self) -> DevPki | None:
        """The job's CA, made in ``tmp_path/pki`` on first use (None: every process runs --insecure)."""
        if self.secure and self._pki is None:
            self._pki = DevPki(self.tmp / "pki")
        return self._pki

    def tls(self, role: Role, name: str) -> Tls | None:
        """The files of identity ``role/name`` (issued on first use); None when the cluster is insecure."""
        return self.pki.tls(role, name) if self.pki is not None else None

    def tls_args(self, role: Role, name: str) -> list[str]:
        """The flags that give a ``remesh`` process identity ``role/name``."""
        tls = self.tls(role, name)
        if tls is None:
            return ["--insecure"]
        return [
            "--tls-ca",
            str(tls.ca_file),
            "--tls-cert",
            str(tls.cert_file),
            "--tls-key",
            str(tls.key_file),
        ]

    def client_env(self, role: Role = Role.OPERATOR, name: str = OPERATOR) -> dict[str, str]:
        """Environment for a ``remesh`` command run against this cluster as ``role/name``."""
        tls = self.tls(role, name)
        return {"REMESH_INSECURE": "1"} if tls is None else {**tls.env(), "REMESH_INSECURE": ""}

    def channel(
        self, role: Role = Role.OPERATOR, name: str = OPERATOR, address: str | None = None
    ) -> grpc.Channel:
        """A new channel to ``address`` (default: the coordinator) as identity ``role/name``."""
        return secure_channel(address or self.address, self.tls(role, name))

    def start_coordinator(
        self, *extra: str, port: int = 0, env: dict[str, str] | None = None, listen: str = ""
    ) -> Proc:
        """A coordinator on 127.0.0.1:``port`` (0: a free one), or on ``listen`` (``unix:/path``)."""
        port_file = self.tmp / f"coordinator-{len(self.procs)}.port"
        args = [
            *self.launcher, sys.executable, "-m", "remesh.cli", "coordinator",
            "--redis", self.redis_url, "--job", self.job,
            "--listen", listen or f"127.0.0.1:{port}", "--port-file", str(port_file), *extra,
            *self._identity(extra, Role.COORDINATOR, f"coordinator-{len(self.procs)}"),
        ]  # fmt: skip
        name = f"coordinator-{len(self.procs)}"
        proc, self.port = self._serving("the coordinator", args, port_file, name, env)
        self.coordinator = proc
        self.unix_address = listen if listen.startswith("unix:") else ""
        return proc

    def _serving(
        self, what: str, args: list[str], port_file: Path, name: str, env: dict[str, str] | None = None
    ) -> tuple[Proc, int]:
        """Start a serving ``remesh`` process; it, and the port it wrote to ``port_file`` once serving."""
        proc = Proc(args, self.tmp / f"{name}.log", env=env)
        self.procs.append(proc)
        wait_for(lambda: port_file.exists() or not proc.alive(), 30, f"{what} to serve")
        if not proc.alive():
            raise RuntimeError(f"{what} exited with code {proc.popen.returncode}:\n{proc.output()[-4000:]}")
        return proc, int(port_file.read_text())

    def start_relay(self, *extra: str, name: str = "") -> tuple[Proc, str]:
        """A ``remesh relay`` following this cluster's coordinators (identity coordinator/``name``);
        the process and the address agents reach it at."""
        name = name or f"relay-{len(self.procs)}"
        port_file = self.tmp / f"{name}.port"
        args = [
            *self.launcher, sys.executable, "-m", "remesh.cli", "relay",
            "--coordinator", ",".join(self.addresses) or self.address,
            "--listen", "127.0.0.1:0", "--port-file", str(port_file), *extra,
            *self._identity(extra, Role.COORDINATOR, name),
        ]  # fmt: skip
        proc, port = self._serving(f"relay {name}", args, port_file, name)
        return proc, f"127.0.0.1:{port}"

    def start_agent(
        self,
        host_id: str,
        *,
        spare: bool = False,
        trainer: Sequence[str] | None = None,
        extra: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> Proc:
        trainer_cmd = (
            list(trainer) if trainer is not None else [sys.executable, "-m", "remesh.embedded.standin"]
        )
        args = [
            *self.launcher, sys.executable, "-m", "remesh.cli", "agent",
            "--coordinator", ",".join(self.addresses) or self.address, "--host-id", host_id, "--devices", "2", "--job", self.job,
            *(["--spare"] if spare else []), *extra, *self._identity(extra, Role.HOST, host_id),
            "--", *trainer_cmd,
        ]  # fmt: skip
        proc = Proc(args, self.tmp / f"agent-{host_id}-{len(self.procs)}.log", env=env)
        self.procs.append(proc)
        self.agents[host_id] = proc
        return proc

    def _identity(self, extra: Sequence[str], role: Role, name: str) -> list[str]:
        # A caller that says how this process authenticates (a test of TLS itself) is not overridden.
        if any(a == "--insecure" or a.startswith("--tls-") for a in extra):
            return []
        return self.tls_args(role, name)

    def stub(self) -> pb_grpc.CoordinatorStub:
        """A stub of the coordinator, as the cluster's operator."""
        if self._channel is None:
            self._channel = self.channel()
        return pb_grpc.CoordinatorStub(self._channel)

    def stub_as(self, role: Role, name: str) -> pb_grpc.CoordinatorStub:
        """A stub of the coordinator as identity ``role/name`` (a channel of its own, closed by
        ``reset_channel``)."""
        if (role, name) not in self._channels:
            self._channels[role, name] = self.channel(role, name)
        return pb_grpc.CoordinatorStub(self._channels[role, name])

    def reset_channel(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels = {}
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def topology(self) -> pb.Topology:
        return self.stub().GetTopology(pb.GetTopologyRequest(), timeout=5)

    def members(self) -> dict[str, pb.Member]:
        return {m.host_id: m for m in self.stub().ListMembers(pb.ListMembersRequest(), timeout=5).members}

    def events(self) -> list[pb.Event]:
        return list(self.stub().ReplayEvents(pb.ReplayEventsRequest(), timeout=10))

    def wait_epoch(self, epoch: int, timeout: float = 30) -> pb.Topology:
        def reached() -> pb.Topology | None:
            try:
                t = self.topology()
            except grpc.RpcError:
                return None
            return t if t.epoch >= epoch else None

        return wait_for(reached, timeout, f"epoch {epoch}")  # type: ignore[return-value]

    def log_tails(self, lines: int = 15) -> str:
        """The last lines of every process's log: what to read when the job did not do what it should."""
        return "\n".join(
            f"==> {proc.log_path} <==\n" + "\n".join(proc.output().splitlines()[-lines:])
            for proc in self.procs
        )

    def close(self) -> None:
        self.reset_channel()
        for proc in reversed(self.procs):
            try:
                proc.close()
            except Exception as exc:  # keep going: every other process must still be stopped
                print(f"could not stop pid {proc.pid}: {exc}", file=sys.stderr)
        self.clear_snapshots()
        if self._pki is not None:
            # The throwaway CA's key, and every identity's, go with the job: whoever reads what it
            # left (the demo's --out) afterwards cannot issue or hold an identity it trusted.
            for key in self._pki.directory.glob("*-key.pem"):
                key.unlink(missing_ok=True)

    def clear_snapshots(self) -> None:
        """Remove the host-memory snapshots this job's trainers left in /dev/shm (they outlive them)."""
        for path in Path("/dev/shm").glob(f"remesh-{self.job}-*"):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
