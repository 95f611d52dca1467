"""The deployment (deploy/): every kustomization renders and validates offline, and what it renders
is what remesh needs: flags the CLI really has, probes on the port the coordinator serves health on,
a Redis that persists, traffic limited to what remesh uses, and nothing running privileged. The
wheel the images install holds the product and nothing only the tests or benchmarks use.

Rendering needs kubectl (or kustomize) on PATH; machines of this project's kind have it. Where neither
is found the tests are skipped with that reason; ``deploy/validate.py --install`` tries to install it.
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
import re
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis

from remesh.cli import build_parser
from remesh.embedded import RedisServer
from remesh.v1 import coordinator_pb2 as pb
from tests.procs import Cluster, wait_for

ROOT = Path(__file__).resolve().parent.parent


def _load_validate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deploy_validate", ROOT / "deploy" / "validate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


validate = _load_validate()
Objects = list[dict[str, Any]]


@pytest.fixture(scope="module")
def rendered() -> dict[str, Objects]:
    renderer = validate.find_renderer()
    if renderer is None:
        pytest.skip("neither kubectl nor kustomize on PATH (deploy/validate.py --install)")
    rendered: dict[str, Objects] = validate.render_all(renderer)
    return rendered


def one(objects: Objects, kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def pod_specs(objects: Objects) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every pod template rendered, the JobSet's included."""
    for o in objects:
        name = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in ("Deployment", "StatefulSet"):
            yield name, o["spec"]["template"]["spec"]
        elif o["kind"] == "JobSet":
            for rjob in o["spec"]["replicatedJobs"]:
                yield f"{name}/{rjob['name']}", rjob["template"]["spec"]["template"]["spec"]


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return dict(workload["spec"]["template"]["metadata"]["labels"])


def settings(objects: Objects) -> dict[str, str]:
    return dict(one(objects, "ConfigMap", "remesh-settings")["data"])


def expand(args: list[str], env: list[dict[str, Any]], config: dict[str, str]) -> list[str]:
    """The arguments as the kubelet hands them over: $(VAR) replaced by the container's variables
    (a variable's value may name those defined before it)."""
    values: dict[str, str] = {}

    def substitute(text: str) -> str:
        return re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], text)

    for var in env:
        ref = var.get("valueFrom", {}).get("configMapKeyRef")
        if ref:
            values[var["name"]] = config[ref["key"]]
        elif "value" in var:
            values[var["name"]] = substitute(var["value"])
        else:
            values[var["name"]] = f"<{var['name']}>"  # a field of the pod, known only at run time
    return [substitute(a) for a in args]


def test_every_object_renders_and_validates_against_the_kubernetes_schemas(
    rendered: dict[str, Objects],
) -> None:
    findings = [f for target, objects in rendered.items() for f in validate.check(target, objects)]
    errors = [str(f) for f in findings if f.outcome == "error"]
    assert not errors, "\n".join(errors)
    skipped = {f.subject for f in findings if f.outcome == "skipped"}
    assert skipped == {  # custom resources only
        "JobSet/tinylm",
        "PodMonitoring/remesh-coordinator",
        "PodMonitoring/remesh-worker",
        "Issuer/remesh-bootstrap",
        "Issuer/remesh-ca",
        "Certificate/remesh-ca",
        "Certificate/remesh-coordinator",
        "Certificate/remesh-operator",
    }
    # The JobSet's pods are checked all the same, as the Jobs it stands for.
    jobs = [f.subject for f in findings if f.outcome == "ok" and "-> Job/" in f.subject]
    assert len(jobs) == 2, jobs


def test_the_validator_catches_a_wrong_field(rendered: dict[str, Objects]) -> None:
    deployment = one(rendered["overlays/gke"], "Deployment", "remesh-coordinator")
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 3}}
    (finding,) = validate.check("test", [broken])
    assert finding.outcome == "error" and "replica" in finding.message


def test_coordinator_runs_three_replicas_with_grpc_health_probes_and_flags_the_cli_has(
    rendered: dict[str, Objects],
) -> None:
    objects = rendered["overlays/gke"]
    deployment = one(objects, "Deployment", "remesh-coordinator")
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    default_port = int(build_parser().parse_args(["coordinator"]).listen.rsplit(":", 1)[1])
    args = build_parser().parse_args(expand(container["args"], container["env"], settings(objects)))
    # The kubelet cannot do mutual TLS: its probes ask the plaintext health-only port.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == args.health_port != default_port, probe
    # Mutual TLS from the coordinator's certificate (certs.yaml), mounted from its Secret.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert {args.tls_ca, args.tls_cert, args.tls_key} == {
        f"{mounts['tls']}/{f}" for f in ("ca.crt", "tls.crt", "tls.key")
    }
    (secret,) = [v["secret"]["secretName"] for v in pod["volumes"] if v["name"] == "tls"]
    certificate = one(objects, "Certificate", "remesh-coordinator")
    assert certificate["spec"]["secretName"] == secret
    assert "coordinator.remesh" in certificate["spec"]["dnsNames"]
    assert certificate["spec"]["uris"] == ["spiffe://remesh.local/coordinator/remesh-coordinator"]
    assert not args.insecure
    assert args.command == "coordinator" and args.log_json
    assert args.listen == f"0.0.0.0:{default_port}"
    assert args.preset == "production"
    assert args.world_size == int(settings(objects)["world-size"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": default_port, "metrics": args.metrics_port, "health": args.health_port}

    service = one(objects, "Service", "remesh-coordinator")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        k: v for k, v in ports.items() if k != "health"
    }
    assert service["spec"]["selector"].items() <= pod_labels(deployment).items()
    pdb = one(objects, "PodDisruptionBudget", "remesh-coordinator")
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert {c["topologyKey"] for c in pod["topologySpreadConstraints"]} == {
        "topology.kubernetes.io/zone",
        "kubernetes.io/hostname",
    }
    monitoring = one(objects, "PodMonitoring", "remesh-coordinator")
    assert monitoring["spec"]["endpoints"][0]["port"] == "metrics"
    # The kind overlay runs one replica on its one node.
    assert one(rendered["overlays/local"], "Deployment", "remesh-coordinator")["spec"]["replicas"] == 1


def test_the_gke_overlays_provision_the_grafana_dashboard(rendered: dict[str, Objects]) -> None:
    dashboard = (ROOT / "deploy/k8s/components/dashboards/remesh-job.json").read_text()
    for target in ("overlays/gke", "overlays/gke-memorystore"):
        config_map = one(rendered[target], "ConfigMap", "remesh-grafana-dashboard")
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's label
        assert config_map["data"] == {"remesh-job.json": dashboard}


def test_redis_keeps_an_append_only_file_on_a_volume_and_memorystore_replaces_it(
    rendered: dict[str, Objects],
) -> None:
    objects = rendered["overlays/gke"]
    redis = one(objects, "StatefulSet", "remesh-redis")
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    option = {command[i]: command[i + 1] for i in range(1, len(command) - 1) if command[i].startswith("--")}
    assert option["--appendonly"] == "yes"
    assert option["--appendfsync"] == "always"
    # Bounded, never evicting; no user without a password; the coordinator's user on this job's keys
    # (tests/test_redis_production.py runs a coordinator against exactly these rules).
    assert option["--maxmemory-policy"] == "noeviction"
    users = {rule[0]: rule[1:] for rule in redis_users(command)}
    assert users["default"] == ["off"]
    assert {">$(REDIS_PASSWORD)", "~remesh:{$(REMESH_JOB)}:*", "-@dangerous"} <= set(users["remesh"])
    (coordinator,) = one(objects, "Deployment", "remesh-coordinator")["spec"]["template"]["spec"][
        "containers"
    ]
    env = {e["name"]: e for e in coordinator["env"]}
    redis_env = {e["name"]: e for e in container["env"]}
    assert env["REMESH_REDIS_USERNAME"]["value"] == "remesh"
    assert (
        env["REMESH_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        == redis_env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    )
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == "premium-rwo"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == option["--dir"]
    service = one(objects, "Service", redis["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    pod_address = f"{redis['metadata']['name']}-0.{redis['spec']['serviceName']}:6379"
    assert pod_address in settings(objects)["redis-url"]

    memorystore = rendered["overlays/gke-memorystore"]
    assert not [o for o in memorystore if o["metadata"]["name"] == "remesh-redis"]
    assert "remesh-redis" not in settings(memorystore)["redis-url"]
    egress = one(memorystore, "NetworkPolicy", "coordinator")["spec"]["egress"]
    assert [rule["to"][0]["ipBlock"]["cidr"] for rule in egress] == ["10.0.0.0/29"]
    # Memorystore with in-transit encryption and AUTH: TLS verified by the instance's CA, no ACL user.
    assert settings(memorystore)["redis-url"].startswith("rediss://")
    assert [p["port"] for rule in egress for p in rule["ports"]] == [6378]
    (coordinator,) = one(memorystore, "Deployment", "remesh-coordinator")["spec"]["template"]["spec"][
        "containers"
    ]
    args = build_parser().parse_args(expand(coordinator["args"], coordinator["env"], settings(memorystore)))
    mounts = {m["name"]: m["mountPath"] for m in coordinator["volumeMounts"]}
    assert args.redis_ca_file == f"{mounts['redis-ca']}/server-ca.pem"
    env = {e["name"] for e in coordinator["env"]}
    assert "REMESH_REDIS_PASSWORD" in env and "REMESH_REDIS_USERNAME" not in env


def redis_users(command: list[str]) -> list[list[str]]:
    """The ACL rules of a redis-server command line: the words after each --user, up to the next flag."""
    rules: list[list[str]] = []
    for i, word in enumerate(command):
        if word == "--user":
            rule = []
            for w in command[i + 1 :]:
                if w.startswith("--"):
                    break
                rule.append(w)
            rules.append(rule)
    return rules


def test_network_policies_open_only_the_paths_remesh_uses(rendered: dict[str, Objects]) -> None:
    objects = rendered["overlays/gke"]
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}
    assert set(policies) == {
        "default-deny",
        "allow-dns",
        "coordinator",
        "redis",
        "worker",
        "worker-google-apis",
    }
    deny = policies["default-deny"]
    assert deny["podSelector"] == {} and set(deny["policyTypes"]) == {"Ingress", "Egress"}
    assert "ingress" not in deny and "egress" not in deny

    coordinator_labels = pod_labels(one(objects, "Deployment", "remesh-coordinator"))
    redis_labels = pod_labels(one(objects, "StatefulSet", "remesh-redis"))
    worker_labels = [
        rjob["template"]["spec"]["template"]["metadata"]["labels"]
        for rjob in one(rendered["examples/tinylm-jobset"], "JobSet", "tinylm")["spec"]["replicatedJobs"]
    ]

    def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
        return selector.get("matchLabels", {}).items() <= labels.items()

    # Redis: only the coordinator, on 6379.
    (rule,) = policies["redis"]["ingress"]
    assert selects(policies["redis"]["podSelector"], redis_labels)
    assert [p["port"] for p in rule["ports"]] == [6379]
    assert selects(rule["from"][0]["podSelector"], coordinator_labels)
    assert not any(selects(rule["from"][0]["podSelector"], w) for w in worker_labels)
    # The coordinator's gRPC: only the training pods (agents and trainers), every one of them.
    grpc_rule, metrics_rule = policies["coordinator"]["ingress"]
    assert [p["port"] for p in grpc_rule["ports"]] == [50051]
    assert all(selects(grpc_rule["from"][0]["podSelector"], w) for w in worker_labels)
    assert [p["port"] for p in metrics_rule["ports"]] == [9090]
    assert metrics_rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gmp-system"}}}
    ]
    (to_redis,) = policies["coordinator"]["egress"]
    assert selects(to_redis["to"][0]["podSelector"], redis_labels)
    # Workers reach each other on any port (JAX coordination service, collectives); the managed
    # Prometheus reaches their agents' /metrics; nothing else comes in.
    peers, scrape = policies["worker"]["ingress"]
    assert "ports" not in peers and all(selects(peers["from"][0]["podSelector"], w) for w in worker_labels)
    assert [p["port"] for p in scrape["ports"]] == [9100]
    assert scrape["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gmp-system"}}}
    ]
    # DNS for everyone.
    assert {(p["port"], p["protocol"]) for p in policies["allow-dns"]["egress"][0]["ports"]} == {
        (53, "UDP"),
        (53, "TCP"),
    }


def test_every_pod_runs_as_non_root_without_privileges_or_api_access(rendered: dict[str, Objects]) -> None:
    seen = 0
    for target, objects in rendered.items():
        kinds = {o["kind"] for o in objects}
        assert not kinds & {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}, target
        for o in objects:
            if o["kind"] == "ServiceAccount":
                assert o["automountServiceAccountToken"] is False, (target, o["metadata"]["name"])
        for name, pod in pod_specs(objects):
            assert pod["automountServiceAccountToken"] is False, (target, name)
            assert pod["serviceAccountName"].startswith("remesh-"), (target, name)
            for c in pod["containers"] + pod.get("initContainers", []):
                sc = c["securityContext"]
                assert sc.get("runAsNonRoot", pod["securityContext"].get("runAsNonRoot")) is True, (name, c)
                assert pod["securityContext"].get("runAsUser", 0) != 0, (name, c["name"])
                assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
                assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
                assert sc["capabilities"]["drop"] == ["ALL"], (name, c["name"])
                assert "limits" in c["resources"] and "requests" in c["resources"], (name, c["name"])
                seen += 1
    assert seen >= 7  # coordinator and redis in three overlays, workers and spares
    namespace = one(rendered["overlays/gke"], "Namespace", "remesh")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_each_worker_pod_runs_the_agent_supervising_the_trainer_as_its_child(
    rendered: dict[str, Objects],
) -> None:
    config = settings(rendered["overlays/gke"])
    jobset = one(rendered["examples/tinylm-jobset"], "JobSet", "tinylm")
    assert jobset["metadata"]["namespace"] == "remesh"
    rjobs = {r["name"]: r for r in jobset["spec"]["replicatedJobs"]}
    assert set(rjobs) == {"workers", "spares"}
    assert rjobs["workers"]["template"]["spec"]["parallelism"] == int(config["world-size"])
    for name, rjob in rjobs.items():
        job = rjob["template"]["spec"]
        pod = job["template"]["spec"]
        # One container: the agent starts the trainer (`--` COMMAND) as its own child process.
        (container,) = pod["containers"]
        assert not pod.get("initContainers")
        args = build_parser().parse_args(expand(container["args"], container["env"], config))
        assert args.command == "agent"
        assert args.spare is (name == "spares")
        assert args.trainer[:4] == ["--", "python", "-m", "examples.tinylm.train_elastic"]
        assert args.address == "<POD_IP>" and args.host_id == "<HOST_ID>"
        env = {e["name"]: e for e in container["env"]}
        # The host id is the pod's name, which is also the name its certificate gives it.
        assert env["HOST_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        (tls,) = [v for v in pod["volumes"] if v["name"] == "tls"]
        attributes = tls["csi"]["volumeAttributes"]
        assert attributes["csi.cert-manager.io/uri-sans"] == "spiffe://remesh.local/host/${POD_NAME}"
        mount = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["tls"]
        assert {env[f"REMESH_TLS_{k}"]["value"] for k in ("CA", "CERT", "KEY")} == {
            f"{mount}/ca.crt",
            f"{mount}/tls.crt",
            f"{mount}/tls.key",
        }
        # Outlasts the replacement of a coordinator pod, so that stops no trainer (docs/deploy.md).
        assert args.lease >= 15
        # /metrics of the agent and its trainer on the port named `metrics`, which the GKE overlay's
        # PodMonitoring scrapes on every worker pod.
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert args.metrics_port == ports["metrics"] and args.metrics_address == "0.0.0.0"
        monitor = one(rendered["overlays/gke"], "PodMonitoring", "remesh-worker")
        assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
        assert (
            monitor["spec"]["selector"]["matchLabels"].items()
            <= job["template"]["metadata"]["labels"].items()
        )
        env = {e["name"]: e for e in container["env"]}
        assert env["REMESH_COORDINATOR"]["valueFrom"]["configMapKeyRef"]["key"] == "coordinator"
        assert config["coordinator"].split(":")[0] == "remesh-coordinator"
        # The agent's exit codes for "halted" (3) and "refused" (2) end the Job; that needs Never.
        assert pod["restartPolicy"] == "Never"
        codes = [r for r in job["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
        assert codes[0]["onExitCodes"]["containerName"] == container["name"]
        assert codes[0]["onExitCodes"]["values"] == [2, 3]
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {"/tmp", "/dev/shm"} <= mounts  # read-only root: scratch space and snapshots


def test_the_images_run_remesh_as_a_non_root_user_without_build_tools() -> None:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    stages = {
        m.group(1): body
        for m, body in zip(
            re.finditer(r"^FROM \S+ AS (\S+)", text, flags=re.MULTILINE),
            re.split(r"^FROM .*$", text, flags=re.MULTILINE)[1:],
            strict=True,
        )
    }
    assert list(stages)[-1] == "control", "the default image is the control plane's"
    # The control plane's environment is a plain `pip install .`, checked to hold no JAX.
    assert (
        "pip install --no-compile . " in stages["build-control"] and "import jax" in stages["build-control"]
    )
    assert '".[trainer]"' in stages["build-trainer"]
    for image, build in (("control", "build-control"), ("trainer", "build-trainer")):
        runtime = stages["runtime"] + stages[image]
        assert f"COPY --from={build} /opt/venv /opt/venv" in stages[image]
        user = re.findall(r"^USER (\S+)", stages[image], flags=re.MULTILINE)
        assert user and user[-1].split(":")[0] not in ("0", "root"), image
        assert re.search(r'^ENTRYPOINT \[.*"remesh"\]', runtime, flags=re.MULTILINE)
        for tool in ("build-essential", "gcc", "g++", "make "):
            assert tool not in runtime, (image, tool)
    assert "COPY examples" in stages["trainer"] and "examples" not in stages["control"]
    dockerignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert dockerignore[dockerignore.index("**") :][:1] == ["**"]  # everything out, then allow-list
    lint = validate.lint_dockerfile()
    assert lint.outcome != "error", lint.message


# Imports by which nothing in the wheel may depend on the repository's tests or benchmarks.
_NOT_SHIPPED = {"tests", "benchmarks", "pytest", "hypothesis"}


def shipped_imports(source: str, module: str, package: bool) -> tuple[set[str], set[str]]:
    """What ``source`` (module ``module``) imports when it runs (``if TYPE_CHECKING:`` blocks left out),
    each ``from M import n`` as both M and M.n; and what it starts as ``python -m X`` (``"-m", "X"``)."""
    imports: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                imports.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: counted up from the module's own package
                    here = module.split(".")[: len(module.split(".")) + package - node.level]
                    base = ".".join([*here, base] if base else here)
                imports.add(base)
                imports.update(f"{base}.{alias.name}" for alias in node.names)
            visit([child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)])

    tree = ast.parse(source)
    visit(tree.body)
    started = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.List | ast.Tuple):
            values = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            started.update(b for a, b in itertools.pairwise(values) if a == "-m" and isinstance(b, str))
    return imports, started


def test_the_wheel_ships_what_the_product_runs_and_no_test_or_soak_harness(tmp_path: Path) -> None:
    """Every module in the wheel is one the product runs: imported, or started as ``python -m``, by the
    ``remesh`` command or by the trainer library (which training scripts import module by module). A
    harness only tests and benchmarks use (the soak, its proxy, a Redis Cluster for tests) reaches
    none of them and belongs in tests/ or benchmarks/. And the wheel's packages are exactly the ones
    whose layers import-linter checks."""
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    built = subprocess.run(
        [*pip_wheel, "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-4000:]
    (wheel,) = tmp_path.glob("remesh-*.whl")
    modules: dict[str, tuple[str, bool]] = {}
    with zipfile.ZipFile(wheel) as files:
        for name in files.namelist():
            if name.startswith("remesh/") and name.endswith(".py"):
                parts = name.removesuffix(".py").split("/")
                package = parts[-1] == "__init__"
                modules[".".join(parts[:-1] if package else parts)] = (files.read(name).decode(), package)
            elif name.endswith(".dist-info/entry_points.txt"):
                entry_points = files.read(name).decode()

    layers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]
    assert {".".join(m.split(".")[:2]) for m in modules} == set(layers)

    graph = {m: shipped_imports(source, m, package) for m, (source, package) in modules.items()}
    strays = {i.split(".")[0] for imports, _ in graph.values() for i in imports} & _NOT_SHIPPED
    assert not strays, f"the wheel imports what only the tests and benchmarks have: {strays}"

    scripts = re.findall(r"=\s*([\w.]+)", entry_points)
    assert scripts == ["remesh.cli"]
    todo = [*scripts, *(m for m in modules if m.startswith("remesh.elastic"))]
    reached: set[str] = set()
    while todo:
        module = todo.pop()
        if module in reached or module not in modules:
            continue
        reached.add(module)
        parts = module.split(".")
        imports, started = graph[module]
        todo += [".".join(parts[:i]) for i in range(2, len(parts))]  # its packages run first
        todo += [*imports, *started, *(f"{m}.__main__" for m in started)]
    unreached = sorted(set(modules) - reached)
    assert not unreached, f"shipped, but nothing the product runs imports or starts them: {unreached}"


@pytest.mark.integration
def test_the_coordinator_runs_under_exactly_the_redis_users_the_manifests_create(
    rendered: dict[str, Objects], tmp_path: Path, job_id: str
) -> None:
    """The ACL rules of deploy/k8s/base/redis.yaml, word for word, on a real redis-server: the
    coordinator's user is enough for a job (its log cut included), and no more than that."""
    statefulset = one(rendered["overlays/gke"], "StatefulSet", "remesh-redis")
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    password = "a-password-for-tests"
    values = {"REDIS_PASSWORD": password, "REMESH_JOB": job_id}
    rules = [
        [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], word) for word in rule]
        for rule in redis_users(container["command"])
    ]
    with RedisServer(appendonly=False, extra_args=[a for rule in rules for a in ("--user", *rule)]) as server:
        cluster = Cluster(tmp_path, server.url, job_id)
        try:
            cluster.start_coordinator(
                "--world-size", "1", "--redis-username", "remesh", "--max-events", "10",
                env={"REMESH_REDIS_PASSWORD": password},
            )  # fmt: skip
            cluster.start_agent("host-0")
            for spare in range(3):  # events enough to pass --max-events
                cluster.start_agent(f"spare-{spare}", spare=True)
            cluster.wait_epoch(1)
            wait_for(lambda: cluster.events()[0].type == pb.EVENT_TYPE_LOG_COMPACTED, 20, "the log to be cut")
            probe = redis.Redis.from_url(server.url, username="probe", password="probe")
            coordinator = redis.Redis.from_url(server.url, username="remesh", password=password)
            nobody = redis.Redis.from_url(server.url)
            try:
                assert probe.ping()
                for refused in (
                    lambda: probe.get(f"remesh:{{{job_id}}}:topology"),
                    lambda: coordinator.set("remesh:{another-job}:topology", "x"),
                    lambda: coordinator.flushall(),
                    lambda: coordinator.config_get("*"),
                    lambda: nobody.get(f"remesh:{{{job_id}}}:topology"),
                ):
                    with pytest.raises(
                        (redis.exceptions.ResponseError, redis.exceptions.AuthenticationError)
                    ):
                        refused()
            finally:
                for client in (probe, coordinator, nobody):
                    client.close()
        finally:
            cluster.close()
