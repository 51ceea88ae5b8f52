"""deploy/kubernetes against the project, without a cluster: every overlay renders with
``kubectl kustomize``; every resource validates against Kubernetes 1.32's schemas (the
kubernetes-validate package) or, for KEDA's and the Prometheus Operator's, against the CRDs
vendored in tests/fixtures/kubernetes/crds; settings, images, commands, probes, security
contexts, budgets and network policies agree with the code. The autoscaler's query and the
migration Job's and schema wait's commands are read out of the rendered manifests and run
against a real Postgres."""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
KUBERNETES = REPO / "deploy" / "kubernetes"
CRDS = Path(__file__).resolve().parent / "fixtures" / "kubernetes" / "crds"
SECRETS_TEMPLATE = KUBERNETES / "secrets.env.example"
#: The Kubernetes release whose schemas the resources are checked against (docs/kubernetes.md).
KUBERNETES_VERSION = "1.32"
OVERLAYS = ("cpu", "gpu", "upstream")
SECRET = "batchd-secrets"
CONFIG = "batchd-config"
WORKER_ROLES = {"model": "model-worker", "dispatch": "dispatch-worker"}

_COMMON = {
    ("Namespace", "batchd"),
    ("ConfigMap", CONFIG),
    ("ConfigMap", "batchd-grafana-dashboard"),
    ("Job", "batchd-migrate"),
    ("Deployment", "batchd-api"),
    ("Service", "batchd-api"),
    ("HorizontalPodAutoscaler", "batchd-api"),
    ("PodDisruptionBudget", "batchd-api"),
    ("Deployment", "batchd-control-worker"),
    ("PodDisruptionBudget", "batchd-control-worker"),
    ("Deployment", "batchd-beat"),
    ("TriggerAuthentication", "batchd-postgres"),
    ("ServiceMonitor", "batchd-api"),
    ("PodMonitor", "batchd-workers"),
    ("NetworkPolicy", "batchd-default-deny"),
    ("NetworkPolicy", "batchd-backends"),
    ("NetworkPolicy", "batchd-api-ingress"),
    ("NetworkPolicy", "batchd-metrics-ingress"),
    ("NetworkPolicy", "batchd-webhooks-egress"),
}


def _workers(component: str, model: str) -> set[tuple[str, str]]:
    name = f"batchd-{component}-{model}"
    return {("Deployment", name), ("ScaledObject", name), ("PodDisruptionBudget", name)}


EXPECTED = {
    "cpu": _COMMON | _workers("model-worker", "batchd-demo"),
    "gpu": _COMMON
    | _workers("model-worker", "llama-3-8b")
    | {("PersistentVolumeClaim", "batchd-models")},
    "upstream": _COMMON
    | _workers("dispatch-worker", "llama-8b")
    | {("NetworkPolicy", "batchd-upstream-egress")},
}


# -- the rendered manifests ---------------------------------------------------------------------


@cache
def _render(overlay: str) -> tuple[dict[str, Any], ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the overlays cannot be rendered here")
    out = subprocess.run(
        [kubectl, "kustomize", str(KUBERNETES / "overlays" / overlay)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def rendered(overlay: str) -> list[dict[str, Any]]:
    return list(_render(overlay))


def name_of(doc: dict[str, Any]) -> str:
    """A resource's name, the generated settings ConfigMap's without its hash suffix."""
    name = doc["metadata"]["name"]
    if doc["kind"] == "ConfigMap" and name.startswith(f"{CONFIG}-"):
        return CONFIG
    return name


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and (name is None or name_of(d) == name)]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = find(docs, kind, name)
    return found


def pods(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, its pod spec) of every Deployment and Job."""
    for doc in docs:
        if doc["kind"] in ("Deployment", "Job"):
            yield doc, doc["spec"]["template"]["spec"]


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def settings_config(docs: list[dict[str, Any]]) -> dict[str, str]:
    return one(docs, "ConfigMap", CONFIG)["data"]


def literal_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def component(doc: dict[str, Any]) -> str:
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


def launched(role: str, names: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> list[str]:
    """``python -m worker role [NAME…] -- extra`` as core.launch builds it, with the image's
    ``python`` for this interpreter: the manifests' commands are compared with it."""
    from core import launch

    return ["python", *launch.worker_module_command(role, names, extra=extra)[1:]]


#: The options every worker Deployment passes to Celery.
WORKER_OPTIONS = ("--loglevel", "INFO")


def worker_of(doc: dict[str, Any]) -> tuple[str, str] | None:
    """(role, served model) of a model or dispatch worker Deployment, else None."""
    if doc["kind"] != "Deployment":
        return None
    main = doc["spec"]["template"]["spec"]["containers"][0]
    args = main.get("args", [])
    if args[:1] not in (["model"], ["dispatch"]):
        return None
    assert main["command"] + args == launched(args[0], (args[1],), WORKER_OPTIONS)
    return args[0], args[1]


def secret_template() -> dict[str, str]:
    """secrets.env.example: KEY=value lines (comments and blank lines skipped)."""
    values = {}
    for raw in SECRETS_TEMPLATE.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"secrets.env.example: not KEY=value: {raw!r}"
            values[key] = value
    return values


def served(docs: list[dict[str, Any]]) -> dict[str, str]:
    from core.settings import Settings

    return Settings(models=settings_config(docs)["BATCHD_MODELS"]).models


def project_version() -> str:
    match = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert match
    return match.group(1)


# -- rendering and schemas ----------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_renders_its_resources(overlay: str) -> None:
    docs = rendered(overlay)
    found = [(d["kind"], name_of(d)) for d in docs]
    assert len(found) == len(set(found)), "a resource rendered twice"
    assert set(found) == EXPECTED[overlay]
    for doc in docs:  # one namespace, set by the overlay
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "batchd", (doc["kind"], name_of(doc))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_builtin_resource_validates_against_the_kubernetes_schemas(overlay: str) -> None:
    """Strict: a field the schema does not declare is an error, as the API server's strict
    field validation makes it."""
    import kubernetes_validate

    checked = 0
    for doc in rendered(overlay):
        if doc["kind"] in _CRD_FILES:
            continue
        version = kubernetes_validate.validate(doc, f"{KUBERNETES_VERSION}.0", strict=True)
        assert version == KUBERNETES_VERSION
        checked += 1
    assert checked >= len(EXPECTED[overlay]) - 4


def test_the_schema_check_refuses_an_unknown_field() -> None:
    import kubernetes_validate

    api = json.loads(json.dumps(one(rendered("cpu"), "Deployment", "batchd-api")))
    api["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(api, f"{KUBERNETES_VERSION}.0", strict=True)


_CRD_FILES = {
    "ScaledObject": "keda.sh_scaledobjects.yaml",
    "TriggerAuthentication": "keda.sh_triggerauthentications.yaml",
    "ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml",
    "PodMonitor": "monitoring.coreos.com_podmonitors.yaml",
}


@cache
def crd_schema(kind: str, api_version: str) -> dict[str, Any]:
    """The openAPIV3Schema of ``kind`` at ``api_version`` from its vendored CRD."""
    crd = yaml.safe_load((CRDS / _CRD_FILES[kind]).read_text())
    group, _, version = api_version.partition("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert entry["served"], f"{kind} {api_version} is not served"
    return entry["schema"]["openAPIV3Schema"]


def undeclared(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Fields of ``value`` that ``schema`` does not declare: the API server prunes them from a
    custom resource without a word, so a misspelled field would silently do nothing."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(value, dict):
        properties = schema.get("properties")
        if properties is None:
            more = schema.get("additionalProperties")
            if isinstance(more, dict):
                return [p for k, v in value.items() for p in undeclared(v, more, f"{path}.{k}")]
            return []
        found = []
        for key, item in value.items():
            if key not in properties:
                found.append(f"{path}.{key}")
            else:
                found += undeclared(item, properties[key], f"{path}.{key}")
        return found
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [
            p for i, v in enumerate(value) for p in undeclared(v, schema["items"], f"{path}[{i}]")
        ]
    return []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_custom_resource_validates_against_its_vendored_crd(overlay: str) -> None:
    import jsonschema

    kinds = set()
    for doc in rendered(overlay):
        if doc["kind"] not in _CRD_FILES:
            continue
        schema = crd_schema(doc["kind"], doc["apiVersion"])
        jsonschema.Draft7Validator(schema).validate(doc)
        assert undeclared(doc, schema) == [], (doc["kind"], name_of(doc))
        kinds.add(doc["kind"])
    assert kinds == set(_CRD_FILES)


def test_the_crd_check_refuses_a_misspelled_field() -> None:
    import jsonschema

    scaled = json.loads(json.dumps(find(rendered("gpu"), "ScaledObject")[0]))
    schema = crd_schema("ScaledObject", scaled["apiVersion"])
    scaled["spec"]["minReplicas"] = 0
    assert undeclared(scaled, schema) == [".spec.minReplicas"]
    scaled["spec"]["minReplicaCount"] = "zero"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(scaled)


def test_vendored_crds_are_the_releases_named_in_their_readme() -> None:
    import hashlib

    readme = (CRDS / "README.md").read_text()
    for name in _CRD_FILES.values():
        digest = hashlib.sha256((CRDS / name).read_bytes()).hexdigest()
        assert f"{digest}  {name}" in readme, name


# -- settings and secrets -----------------------------------------------------------------------


def _setting_names() -> set[str]:
    from core.settings import Settings

    return {f"BATCHD_{name.upper()}" for name in Settings.model_fields}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_batchd_variable_is_a_setting(overlay: str) -> None:
    docs = rendered(overlay)
    names = set(settings_config(docs)) | set(secret_template())
    for _, pod in pods(docs):
        for c in containers(pod):
            names |= {e["name"] for e in c.get("env", [])}
    unknown = {n for n in names if n.startswith("BATCHD_")} - _setting_names()
    assert unknown == set(), f"not settings (core/settings.py): {sorted(unknown)}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_settings_validate(overlay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every process's settings, as its pod gets them (the ConfigMap, the Secret from its
    template, the container's own variables), pass core.settings' validation."""
    from core.settings import Settings

    docs = rendered(overlay)
    for _, pod in pods(docs):
        for c in containers(pod):
            for name in [n for n in os.environ if n.startswith("BATCHD_")]:
                monkeypatch.delenv(name)
            env = {**settings_config(docs), **secret_template(), **literal_env(c)}
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            Settings()


def test_the_secret_template_names_what_the_manifests_read() -> None:
    template = secret_template()
    assert {"BATCHD_DATABASE_URL", "BATCHD_BROKER_URL", "BATCHD_API_KEYS"} <= set(template)
    # KEDA's PostgreSQL scaler (pgx) takes it as it is: a plain postgresql:// URL.
    assert template["BATCHD_DATABASE_URL"].startswith("postgresql://")
    for overlay in OVERLAYS:
        docs = rendered(overlay)
        for auth in find(docs, "TriggerAuthentication"):
            for ref in auth["spec"]["secretTargetRef"]:
                assert (ref["name"], ref["key"]) == (SECRET, "BATCHD_DATABASE_URL")
                assert ref["parameter"] == "connection"
        for monitor in find(docs, "ServiceMonitor"):
            for endpoint in monitor["spec"]["endpoints"]:
                credentials = endpoint["authorization"]["credentials"]
                assert credentials["name"] == SECRET and credentials["key"] in template
        for _, pod in pods(docs):
            for c in containers(pod):
                config = one(docs, "ConfigMap", CONFIG)["metadata"]["name"]
                assert {"configMapRef": {"name": config}} in c["envFrom"]
                assert {"secretRef": {"name": SECRET}} in c["envFrom"]
        # The generated Secret is not part of the manifests: it never holds placeholders.
        assert not find(docs, "Secret")


# -- images -------------------------------------------------------------------------------------


def compose_images() -> dict[str, str]:
    """Image name -> the Dockerfile that builds it, as docker-compose.yml builds them."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    images = {}
    for service in compose["services"].values():
        build = service.get("build")
        if build is None:
            continue
        dockerfile = (
            "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
        )
        images[service["image"].rpartition(":")[0]] = dockerfile
    return images


def dockerfile_uid(dockerfile: str) -> int:
    """The uid of the user a Dockerfile's image runs as: ``useradd --uid N``, or 1000, the
    first one useradd gives on a python:*-slim base (Debian, no user of its own there)."""
    text = (REPO / dockerfile).read_text()
    (useradd,) = re.findall(r"useradd [^\n]*", text)
    if match := re.search(r"--uid (\d+)", useradd):
        return int(match.group(1))
    base = re.search(r"^FROM (\S+)", text, re.M)
    assert base and re.match(r"python:[\d.]+-slim", base.group(1)), dockerfile
    return 1000


def test_the_gpu_dockerfile_is_a_target_named_as_its_image() -> None:
    text = (REPO / "Dockerfile.gpu").read_text()
    stages = re.findall(r"^FROM \S+ AS (\S+)$", text, re.M)
    assert stages[-1:] == ["batchd-gpu"]
    assert compose_images()["batchd-gpu"] == "Dockerfile.gpu"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_the_dockerfiles_targets_at_this_version(overlay: str) -> None:
    """The CPU image everywhere but in a pod with a GPU, which runs the CUDA image alone; each
    pod runs as the uid its image's user has."""
    images = compose_images()
    for doc, pod in pods(rendered(overlay)):
        gpu = any("nvidia.com/gpu" in c["resources"].get("limits", {}) for c in pod["containers"])
        expected = "batchd-gpu" if gpu else "batchd"
        for c in containers(pod):
            name, _, tag = c["image"].rpartition(":")
            assert (name, tag) == (expected, project_version()), (name_of(doc), c["name"])
            assert pod["securityContext"]["runAsUser"] == dockerfile_uid(images[name])
    gpu_pods = [
        d for d, p in pods(rendered(overlay)) if "batchd-gpu" in p["containers"][0]["image"]
    ]
    assert bool(gpu_pods) == (overlay == "gpu")


# -- the processes ------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_served_model_has_its_workers_and_their_queue(
    overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local model's queue is consumed by a model worker Deployment of its own, an upstream
    model's by a dispatch worker Deployment; each worker's command resolves in this code
    (worker/__main__.py) to exactly its model's queue."""
    import worker.__main__ as worker_main
    from core.broker.queue import model_queue
    from core.llms import specs
    from core.settings import get_settings

    docs = rendered(overlay)
    models = served(docs)
    monkeypatch.setenv("BATCHD_MODELS", settings_config(docs)["BATCHD_MODELS"])
    get_settings.cache_clear()
    try:
        workers: dict[str, list[str]] = {}
        for doc in docs:
            found = worker_of(doc)
            if found is None:
                continue
            role, model = found
            assert component(doc) == WORKER_ROLES[role]
            assert doc["metadata"]["labels"]["batchd/model"] == model
            assert doc["metadata"]["name"] == f"batchd-{WORKER_ROLES[role]}-{model}"
            cmd = worker_main.command(role, [model])
            assert cmd[cmd.index("-Q") + 1] == model_queue(model)
            workers.setdefault(model, []).append(role)
        expected = {m: ["dispatch" if specs.is_upstream(s) else "model"] for m, s in models.items()}
        assert workers == expected
    finally:
        get_settings.cache_clear()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_other_commands_run_in_this_code(overlay: str) -> None:
    from celery.bin.celery import celery as celery_cli

    from cli.main import app

    docs = rendered(overlay)
    api = one(docs, "Deployment", "batchd-api")["spec"]["template"]["spec"]["containers"][0]
    assert api["command"][:4] == ["python", "-m", "cli", "api"]
    assert "api" in {c.name for c in app.registered_commands}
    control = one(docs, "Deployment", "batchd-control-worker")["spec"]["template"]["spec"]
    main = control["containers"][0]
    assert main["command"] + main["args"] == launched("control", extra=WORKER_OPTIONS)
    beat = one(docs, "Deployment", "batchd-beat")["spec"]["template"]["spec"]["containers"][0]
    assert beat["command"] == launched("beat")
    assert "beat" in celery_cli.commands
    job = one(docs, "Job", "batchd-migrate")["spec"]["template"]["spec"]["containers"][0]
    assert job["command"] == ["alembic", "upgrade", "head"]  # test_compose: one head


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_grace(overlay: str) -> None:
    """The API: /livez for liveness (no I/O), /readyz for readiness. The workers: their own
    liveness file (`python -m worker health`), which needs no broker, in a writable place. A
    worker's grace period covers its drain on SIGTERM."""
    from core.settings import Settings

    docs = rendered(overlay)
    api = one(docs, "Deployment", "batchd-api")["spec"]["template"]["spec"]["containers"][0]
    assert api["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    assert api["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert {"name": "http", "containerPort": 8000} in api["ports"]
    liveness_file = settings_config(docs)["BATCHD_WORKER_LIVENESS_FILE"]
    for doc, pod in pods(docs):
        if not component(doc).endswith("-worker"):
            continue
        main = pod["containers"][0]
        for probe in ("livenessProbe", "startupProbe"):
            assert main[probe]["exec"]["command"] == launched("health")
        assert writable(pod, main, liveness_file)
        if worker_of(doc) is not None:  # shards run here: the drain's time, and its bound
            from worker.infra.drain import HAND_BACK_S

            drain = Settings.model_fields["worker_drain_s"].default
            drain = float(settings_config(docs).get("BATCHD_WORKER_DRAIN_S", drain))
            assert pod["terminationGracePeriodSeconds"] >= drain + HAND_BACK_S


def writable(pod: dict[str, Any], container: dict[str, Any], path: str) -> bool:
    """Whether ``path`` lies in an emptyDir mounted into ``container`` (the root is read-only)."""
    kinds = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        root = mount["mountPath"].rstrip("/")
        if (path == root or path.startswith(root + "/")) and "emptyDir" in kinds[mount["name"]]:
            return not mount.get("readOnly", False)
    return False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_paths_each_process_writes_are_emptydirs(overlay: str) -> None:
    docs = rendered(overlay)
    for doc, pod in pods(docs):
        for c in containers(pod):
            env = {**settings_config(docs), **literal_env(c)}
            paths = ["/tmp"]
            if c in pod["containers"]:
                paths += [
                    env["HOME"],
                    *(env[k] for k in ("PROMETHEUS_MULTIPROC_DIR", "BATCHD_HOME") if k in env),
                ]
            for path in paths:
                assert writable(pod, c, path), (name_of(doc), c["name"], path)


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_the_kernel_cache_is_one_the_engine_accepts(
    overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """engine/cpu/kernels.py refuses a cache directory that group or others may write (unless
    sticky); an emptyDir's own directory is 0777. A model worker's HOME is an emptyDir, so the
    process creates ~/.cache itself, private, and its kernel cache is accepted; had the cache
    been the emptyDir's directory, it would have been refused."""
    from engine.cpu import kernels

    for doc, pod in pods(rendered(overlay)):
        if worker_of(doc) is None:
            continue
        main = pod["containers"][0]
        root = tmp_path / name_of(doc)
        volumes = {v["name"]: v for v in pod["volumes"]}
        for mount in main["volumeMounts"]:  # as the kubelet makes an emptyDir
            if "emptyDir" in volumes[mount["name"]]:
                where = root / mount["mountPath"].lstrip("/")
                where.mkdir(parents=True)
                where.chmod(0o777)
        env = literal_env(main)
        assert "XDG_CACHE_HOME" not in env
        home = root / env["HOME"].lstrip("/")
        monkeypatch.setenv("HOME", str(home))
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        cache_dir = kernels.cache_dir()
        assert cache_dir.is_relative_to(home)
        assert kernels._prepare(cache_dir) is None
        assert oct(cache_dir.parent.parent.stat().st_mode & 0o777) == "0o700"
        monkeypatch.setenv("XDG_CACHE_HOME", str(home))
        refused = kernels._prepare(kernels.cache_dir())
        assert refused is not None and "writable by group or others" in refused


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_beat_runs_once(overlay: str) -> None:
    docs = rendered(overlay)
    beat = one(docs, "Deployment", "batchd-beat")
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"] == {"type": "Recreate"}
    main = beat["spec"]["template"]["spec"]["containers"][0]
    probe = " ".join(main["livenessProbe"]["exec"]["command"])
    assert f"{literal_env(main)['BATCHD_HOME']}/celerybeat-schedule" in probe  # worker/__main__
    scaled = {
        d["spec"]["scaleTargetRef"]["name"] for d in docs if "scaleTargetRef" in d.get("spec", {})
    }
    assert "batchd-beat" not in scaled


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_schema_first(overlay: str) -> None:
    """Every pod but the Job's waits for the schema at head with the same command."""
    docs = rendered(overlay)
    waits = []
    for doc, pod in pods(docs):
        if doc["kind"] == "Job":
            assert not pod.get("initContainers")
            continue
        (init,) = pod["initContainers"]
        assert init["name"] == "wait-for-schema"
        waits.append(init["command"])
    assert len(waits) >= 4 and all(w == waits[0] for w in waits)


# -- security -----------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_is_locked_down(overlay: str) -> None:
    """The restricted Pod Security Standard, which the namespace enforces, and more: no service
    account token, a read-only root, requests and limits on every container."""
    docs = rendered(overlay)
    labels = one(docs, "Namespace", "batchd")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    for doc, pod in pods(docs):
        where = name_of(doc)
        assert pod["automountServiceAccountToken"] is False, where
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True, where
        assert isinstance(context["runAsUser"], int) and context["runAsUser"] > 0, where
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        for volume in pod.get("volumes", []):
            kinds = set(volume) - {"name"}
            assert kinds <= {"emptyDir", "persistentVolumeClaim", "configMap", "secret"}, where
        for c in containers(pod):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (where, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (where, c["name"])
            assert sc["capabilities"] == {"drop": ["ALL"]}, (where, c["name"])
            assert not sc.get("privileged") and sc.get("runAsUser", 1) != 0
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][bound]), (where, c["name"], bound)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_cover_the_api_and_every_worker(overlay: str) -> None:
    docs = rendered(overlay)
    budgets = find(docs, "PodDisruptionBudget")
    for doc, _ in pods(docs):
        if doc["kind"] == "Job" or component(doc) == "beat":
            continue
        labels = doc["spec"]["template"]["metadata"]["labels"]
        matching = [
            b for b in budgets
            if b["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ]  # fmt: skip
        assert len(matching) == 1, name_of(doc)
        assert matching[0]["metadata"]["name"] == name_of(doc)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies(overlay: str) -> None:
    """Default deny for every batchd pod; DNS and the backends for all; the API open on its
    port; dispatch workers reach their upstream's namespace on its port, read from
    BATCHD_MODELS."""
    from core.llms import specs

    docs = rendered(overlay)
    policies = {name_of(p): p["spec"] for p in find(docs, "NetworkPolicy")}
    deny = policies["batchd-default-deny"]
    assert deny["policyTypes"] == ["Ingress", "Egress"] and "ingress" not in deny
    assert "egress" not in deny
    selector = deny["podSelector"]["matchLabels"]
    for doc, _ in pods(docs):
        assert selector.items() <= doc["spec"]["template"]["metadata"]["labels"].items()
    ports = {(p["protocol"], p["port"]) for rule in policies["batchd-backends"]["egress"] for p in rule["ports"]}  # fmt: skip
    assert {("UDP", 53), ("TCP", 53), ("TCP", 5432), ("TCP", 6379)} <= ports
    assert policies["batchd-api-ingress"]["ingress"] == [
        {"ports": [{"protocol": "TCP", "port": 8000}]}
    ]
    metrics_port = int(settings_config(docs)["BATCHD_WORKER_METRICS_PORT"])
    (rule,) = policies["batchd-metrics-ingress"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": metrics_port}]
    for model, spec in served(docs).items():
        if not specs.is_upstream(spec):
            continue
        url = urlsplit(specs.upstream_spec(spec, model).base_url)
        host = (url.hostname or "").split(".")
        assert host[2:3] == ["svc"], f"{url.hostname}: not <service>.<namespace>.svc"
        reached = [
            rule for p in policies.values()
            if p["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/component") == "dispatch-worker"
            for rule in p.get("egress", [])
            if {"protocol": "TCP", "port": url.port} in rule["ports"]
            and any(t.get("namespaceSelector", {}).get("matchLabels") == {"kubernetes.io/metadata.name": host[1]} for t in rule["to"])
        ]  # fmt: skip
        assert reached, f"no policy lets the dispatch workers reach {url.netloc}"


# -- scaling ------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_worker_scales_on_its_models_query_down_to_zero(overlay: str) -> None:
    """One ScaledObject per model or dispatch worker Deployment, on KEDA's PostgreSQL scaler,
    whose query is core.observability.metrics.pending_tokens_sql for that Deployment's model, to the
    character; the Deployment leaves its replica count to it."""
    from core.observability.metrics import pending_tokens_sql

    docs = rendered(overlay)
    deployments = {name_of(d): d for d in find(docs, "Deployment")}
    auths = {name_of(a) for a in find(docs, "TriggerAuthentication")}
    targets = []
    for scaled in find(docs, "ScaledObject"):
        spec = scaled["spec"]
        target = deployments[spec["scaleTargetRef"]["name"]]
        found = worker_of(target)
        assert found is not None
        model = found[1]
        assert scaled["metadata"]["labels"]["batchd/model"] == model
        assert spec["minReplicaCount"] == 0 and spec["maxReplicaCount"] >= 1
        assert "replicas" not in target["spec"]
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "postgresql"
        assert trigger["authenticationRef"]["name"] in auths
        metadata = trigger["metadata"]
        assert metadata["query"] == pending_tokens_sql(model)
        assert int(metadata["targetQueryValue"]) > 0
        assert metadata["activationTargetQueryValue"] == "0"
        targets.append(name_of(target))
    workers = [n for n, d in deployments.items() if worker_of(d) is not None]
    assert sorted(targets) == sorted(workers)
    # The release window holds a shard for every thread of every worker it may scale to.
    config = settings_config(docs)
    most = max(s["spec"]["maxReplicaCount"] for s in find(docs, "ScaledObject"))
    threads = int(config["BATCHD_WORKER_SHARD_CONCURRENCY"])
    assert int(config["BATCHD_MAX_RELEASED_SHARDS_PER_MODEL"]) >= most * threads


# -- monitoring ---------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_monitors_select_the_api_and_the_workers_exporters(overlay: str) -> None:
    docs = rendered(overlay)
    (monitor,) = find(docs, "ServiceMonitor")
    service = one(docs, "Service", "batchd-api")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["http"] and "http" in port_names
    (podmonitor,) = find(docs, "PodMonitor")
    selector = podmonitor["spec"]["selector"]
    (expression,) = selector["matchExpressions"]
    metrics_port = int(settings_config(docs)["BATCHD_WORKER_METRICS_PORT"])
    for doc, pod in pods(docs):
        labels = doc["spec"]["template"]["metadata"]["labels"]
        selected = (
            selector["matchLabels"].items() <= labels.items()
            and labels.get(expression["key"]) in expression["values"]
        )
        assert selected == component(doc).endswith("-worker"), name_of(doc)
        if selected:
            ports = pod["containers"][0]["ports"]
            assert {"name": "metrics", "containerPort": metrics_port} in ports
    assert [e["port"] for e in podmonitor["spec"]["podMetricsEndpoints"]] == ["metrics"]


def test_the_dashboard_configmap_is_the_dashboard() -> None:
    """Kustomize reads no file outside its folder, so the component keeps a copy of
    deploy/grafana/batchd.json: the two stay the same."""
    copy = KUBERNETES / "components" / "monitoring" / "batchd.json"
    original = REPO / "deploy" / "grafana" / "batchd.json"
    assert copy.read_bytes() == original.read_bytes(), "cp deploy/grafana/batchd.json " + str(
        copy.relative_to(REPO)
    )
    for overlay in OVERLAYS:
        config = one(rendered(overlay), "ConfigMap", "batchd-grafana-dashboard")
        assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(config["data"]["batchd.json"]) == json.loads(original.read_text())


# -- against Postgres ---------------------------------------------------------------------------


def _env_without_settings(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHD_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **extra}


@pytest.mark.services
def test_the_migration_job_and_the_schema_wait_as_written() -> None:
    """On an empty database the pods' wait-for-schema command waits; the Job's command, run
    twice at once and once more, brings the schema to head; then the wait ends. As the
    manifests run them (in /app, where the image keeps alembic.ini)."""
    from sqlalchemy import create_engine, text

    from tests.conftest import PG_ADMIN_URL, PG_HOST, PG_PORT

    docs = rendered("gpu")
    job = one(docs, "Job", "batchd-migrate")["spec"]["template"]["spec"]["containers"][0]
    api = one(docs, "Deployment", "batchd-api")["spec"]["template"]["spec"]
    wait_cmd = api["initContainers"][0]["command"]
    name = f"batchd_k8s_{os.getpid()}_{secrets.token_hex(3)}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    env = _env_without_settings(
        BATCHD_DATABASE_URL=f"postgresql://postgres@{PG_HOST}:{PG_PORT}/{name}"
    )
    wait = subprocess.Popen(
        wait_cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert wait.stdout is not None
        first = wait.stdout.readline()
        assert first.startswith("waiting for the schema at head"), first
        assert wait.poll() is None
        both = [
            subprocess.Popen(job["command"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
            for _ in range(2)
        ]  # fmt: skip
        codes = [p.wait(timeout=300) for p in both]
        again = subprocess.run(job["command"], cwd=REPO, env=env, capture_output=True, text=True)
        print(f"\nmigration Job twice at once: exit codes {codes}; once more: {again.returncode}")
        assert 0 in codes and again.returncode == 0, [p.stdout.read() for p in both if p.stdout]
        assert wait.wait(timeout=120) == 0
    finally:
        if wait.poll() is None:
            wait.kill()
            wait.wait()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def gpu_model_env(
    service_env: dict[str, str], redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """The gpu overlay's model, served here by the tiny demo model, with small checkpoints; the
    Celery app's broker pointed at the test Redis. Yields the model's name."""
    from core.settings import get_settings
    from worker.infra.celery import app

    (scaled,) = find(rendered("gpu"), "ScaledObject")
    target = one(rendered("gpu"), "Deployment", scaled["spec"]["scaleTargetRef"]["name"])
    found = worker_of(target)
    assert found is not None
    model = found[1]
    monkeypatch.setenv("BATCHD_MODELS", json.dumps({model: "demo:llama-tiny"}))
    monkeypatch.setenv("BATCHD_CHECKPOINT_EVERY", "1")
    monkeypatch.setenv("BATCHD_CHECKPOINT_INTERVAL_S", "60")
    get_settings.cache_clear()
    old_broker = app.conf.broker_url
    app.conf.broker_url = redis_url
    yield model
    import redis

    client = redis.Redis.from_url(redis_url)
    for key in client.keys("batchd.*"):
        client.delete(key)
    app.conf.broker_url = old_broker
    get_settings.cache_clear()


@pytest.mark.services
@pytest.mark.slow
def test_the_scaled_objects_query_follows_the_work_of_its_model(
    gpu_model_env: str, pg_url: str
) -> None:
    """KEDA's query, as the gpu overlay renders it, read while two batches arrive, run shard by
    shard (and chunk by chunk) and end: it rises with the work queued, falls as results
    commit, is 0 once nothing waits, and equals the batchd_pending_tokens gauge (rounded up)
    at every step."""
    from sqlalchemy import create_engine, text

    from core.llms.demo import build
    from core.observability.metrics import ServiceCollector
    from engine import Engine, EngineHost
    from testkit.builders.worker import batch_row, chat_line, shard_rows, validated_batch
    from worker.batches.finalize import finalize
    from worker.shards.task import ShardEnd, run_shard

    model = gpu_model_env
    (scaled,) = find(rendered("gpu"), "ScaledObject")
    query = scaled["spec"]["triggers"][0]["metadata"]["query"]
    engine = create_engine(pg_url)
    readings: list[tuple[str, int, float]] = []

    def read(moment: str) -> int:
        with engine.connect() as conn:
            value = conn.execute(text(query)).scalar_one()
        gauge = sum(
            sample.value
            for family in ServiceCollector(pg_url, [model]).collect()
            if family.name == "batchd_pending_tokens"
            for sample in family.samples
            if sample.labels["model"] == model
        )
        readings.append((moment, value, gauge))
        assert value == math.ceil(gauge), (moment, value, gauge)
        return int(value)

    def lines(prefix: str, n: int) -> list[dict[str, Any]]:
        return [chat_line(f"{prefix}{i}", f"say {prefix} {i}", max_tokens=6, model=model) for i in range(n)]  # fmt: skip

    host = EngineHost(Engine(str(build("llama-tiny")))).start()
    try:
        assert read("no batch") == 0
        first = validated_batch(lines("a", 6), shard_max_requests=3)
        queued_first = read("batch A queued (2 shards)")
        assert queued_first > 0
        second = validated_batch(lines("b", 3), shard_max_requests=3)
        queued_both = read("batch B queued (1 shard)")
        assert queued_both > queued_first
        before = queued_both
        for batch_id, label in ((first, "A"), (second, "B")):
            for shard in shard_rows(batch_id):
                during: list[int] = []

                def chunk(
                    index: int, label: str = label, shard: Any = shard, during: list[int] = during
                ) -> None:
                    during.append(read(f"{label} shard {shard.index} running, chunk {index} committed"))  # fmt: skip

                assert run_shard(shard.id, host=host, after_commit=chunk).end == ShardEnd.DONE
                assert during == sorted(during, reverse=True) and during[0] < before
                after = read(f"{label} shard {shard.index} done")
                assert after < before
                before = after
        assert before == 0
        for batch_id in (first, second):
            assert batch_row(batch_id).status == "finalizing"
            assert finalize(batch_id) == "completed"
        assert read("both batches completed") == 0
    finally:
        host.shutdown(wait=True, abort_pending=True, timeout=30)
        engine.dispose()
        print(f"\nKEDA query of ScaledObject {name_of(scaled)} (model {model}):")
        for moment, value, gauge in readings:
            print(f"  {value:>6}  (batchd_pending_tokens {gauge:9.2f})  {moment}")
