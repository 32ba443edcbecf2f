"""The Kubernetes manifests under ``deploy/``: valid YAML with the fields KubeRay requires.

No cluster is needed. The checks follow KubeRay's ray.io/v1 types (RayJobSpec, RayClusterSpec,
HeadGroupSpec, WorkerGroupSpec: ``rayStartParams`` is a map of strings, every group has a pod
template whose first container names an image, a worker group has ``groupName``, ``replicas``,
``minReplicas`` <= ``replicas`` <= ``maxReplicas``) and Kubernetes' batch/v1 CronJob. The
entrypoints must name modules of this repository, with options those modules accept (checked
against their ``--help``); a module that does not exist yet (``jobs.reanalyze`` before it is
written) skips its check instead of failing.

Secure by default: every Ray container, the RayJob's submitter pod and the CronJob's submitter
run with Ray's token authentication (``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN`` from one
Kubernetes Secret, key ``auth_token``), no token is ever written in a manifest, and each
manifest says how to create the Secret and how a client reads the token.
"""

from __future__ import annotations

import copy
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
RAYJOB = DEPLOY / "rayjob.yaml"
CRONJOB = DEPLOY / "reanalyze-cronjob.yaml"
WATCHLIST = DEPLOY / "models.yaml"

IMAGE_RE = re.compile(r"^rayproject/ray:(\d+\.\d+\.\d+)(-py3\d+)?(-cpu|-gpu|-cu\d+)?$")
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
CRON_FIELD = r"(\*|\d+(-\d+)?)(/\d+)?(,(\*|\d+(-\d+)?)(/\d+)?)*"
CRON_RE = re.compile(rf"^{CRON_FIELD}( {CRON_FIELD}){{4}}$")
SUBMISSION_MODES = {"K8sJobMode", "HTTPMode", "InteractiveMode"}


def _docs(path: Path) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path} holds no YAML document"
    for d in docs:
        assert isinstance(d, dict), f"{path}: every document must be a mapping"
    return docs


def _one(path: Path, kind: str) -> dict:
    found = [d for d in _docs(path) if d.get("kind") == kind]
    assert len(found) == 1, f"{path}: expected one {kind}, found {len(found)}"
    return found[0]


def _check_metadata(obj: dict) -> None:
    name = obj.get("metadata", {}).get("name")
    assert isinstance(name, str) and DNS1123.match(name) and len(name) <= 63, name


def _containers(template: dict, where: str) -> list[dict]:
    containers = template.get("spec", {}).get("containers")
    assert isinstance(containers, list) and containers, f"{where}: template.spec.containers"
    for c in containers:
        assert isinstance(c.get("name"), str) and DNS1123.match(c["name"]), f"{where}: name"
        assert isinstance(c.get("image"), str) and c["image"], f"{where}: containers[].image"
    return containers


def _check_ray_start_params(params, where: str) -> None:
    assert isinstance(params, dict), f"{where}: rayStartParams must be a mapping"
    for k, v in params.items():
        assert isinstance(k, str) and isinstance(v, str), (
            f"{where}: rayStartParams values must be strings (got {k}: {v!r})"
        )


def _image_version(image: str, where: str) -> str:
    m = IMAGE_RE.match(image)
    assert m, f"{where}: {image} is not a rayproject/ray image"
    return m.group(1)


def check_cluster_spec(spec: dict, where: str) -> None:
    """A RayClusterSpec: head group, worker groups with a GPU group that autoscales."""
    assert isinstance(spec, dict), f"{where}: missing"
    ray_version = spec.get("rayVersion")
    head = spec.get("headGroupSpec")
    assert isinstance(head, dict), f"{where}.headGroupSpec"
    _check_ray_start_params(head.get("rayStartParams"), f"{where}.headGroupSpec")
    head_containers = _containers(head.get("template", {}), f"{where}.headGroupSpec")
    images = [head_containers[0]["image"]]
    for c in head_containers:
        limits = c.get("resources", {}).get("limits", {})
        assert "nvidia.com/gpu" not in limits, f"{where}: the head is CPU only"
    assert head["rayStartParams"].get("num-cpus") == "0", f"{where}: keep actors off the head"

    groups = spec.get("workerGroupSpecs")
    assert isinstance(groups, list) and groups, f"{where}.workerGroupSpecs"
    names = set()
    gpu_groups = 0
    for i, g in enumerate(groups):
        w = f"{where}.workerGroupSpecs[{i}]"
        assert isinstance(g.get("groupName"), str) and DNS1123.match(g["groupName"]), w
        names.add(g["groupName"])
        for key in ("replicas", "minReplicas", "maxReplicas"):
            assert isinstance(g.get(key), int) and g[key] >= 0, f"{w}.{key}"
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], w
        _check_ray_start_params(g.get("rayStartParams"), w)
        containers = _containers(g.get("template", {}), w)
        images.append(containers[0]["image"])
        limits = containers[0].get("resources", {}).get("limits", {})
        gpus = int(limits.get("nvidia.com/gpu", 0))
        if gpus:
            gpu_groups += 1
            assert g["minReplicas"] == 0 and g["maxReplicas"] >= 1, f"{w}: autoscale from 0"
            assert "gpu" in containers[0]["image"] or "-cu" in containers[0]["image"], (
                f"{w}: a GPU group needs a CUDA image"
            )
    assert len(names) == len(groups), f"{where}: groupNames must be unique"
    assert gpu_groups, f"{where}: a worker group with nvidia.com/gpu limits is required"
    assert spec.get("enableInTreeAutoscaling") is True, f"{where}: GPU groups scale from 0"
    versions = {_image_version(img, where) for img in images}
    assert len(versions) == 1, f"{where}: one Ray version across the cluster, got {versions}"
    if ray_version is not None:
        assert versions == {str(ray_version)}, f"{where}: rayVersion {ray_version} != images"


# ----------------------------------------------------------------- entrypoints


def _commands_after_python_m(command: str) -> list[tuple[str, list[str]]]:
    """(module, [--options]) for every ``python -m MODULE ...`` in a shell command."""
    tokens = shlex.split(command)
    out = []
    for i, tok in enumerate(tokens[:-2]):
        if re.fullmatch(r"python(3(\.\d+)?)?", tok) and tokens[i + 1] == "-m":
            module = tokens[i + 2]
            options = []
            for t in tokens[i + 3 :]:
                if t in {"&&", "||", ";", "|"}:
                    break
                if t.startswith("--"):
                    options.append(t.split("=", 1)[0])
            out.append((module, options))
    return out


def _module_file(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__main__.py"):
        if candidate.is_file():
            return candidate
    return None


@cache
def _help(module: str) -> str:
    res = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, f"python -m {module} --help failed:\n{res.stderr}"
    return res.stdout


def _check_entrypoint(command: str, where: str) -> list[str]:
    """Assert the command's modules exist and accept its options; returns the modules."""
    found = _commands_after_python_m(command)
    assert found, f"{where}: no `python -m MODULE` in {command!r}"
    modules = []
    for module, options in found:
        assert module.startswith("jobs."), f"{where}: {module} is not a job of this repository"
        if _module_file(module) is None:
            if module == "jobs.reanalyze":
                continue  # not written yet; checked as soon as it exists
            pytest.fail(f"{where}: module {module} does not exist in this repository")
        text = _help(module)
        unknown = [o for o in options if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text)]
        assert not unknown, f"{where}: python -m {module} does not accept {unknown}"
        modules.append(module)
    return modules


# ----------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def rayjob() -> dict:
    return _one(RAYJOB, "RayJob")


def test_rayjob_fields(rayjob) -> None:
    assert rayjob["apiVersion"] == "ray.io/v1"
    _check_metadata(rayjob)
    spec = rayjob["spec"]
    assert isinstance(spec.get("entrypoint"), str) and spec["entrypoint"].strip()
    assert spec.get("submissionMode", "K8sJobMode") in SUBMISSION_MODES
    assert spec.get("shutdownAfterJobFinishes") is True
    assert isinstance(spec.get("ttlSecondsAfterFinished", 0), int)
    check_cluster_spec(spec.get("rayClusterSpec"), "spec.rayClusterSpec")


def test_rayjob_runtime_env(rayjob) -> None:
    """runtimeEnvYAML ships the code (working_dir) and every dependency of pyproject (pip)."""
    env = yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])
    assert isinstance(env, dict)
    assert isinstance(env.get("working_dir"), str) and env["working_dir"]
    pip = env.get("pip")
    packages = pip.get("packages") if isinstance(pip, dict) else pip
    assert isinstance(packages, list) and packages
    names = {re.split(r"[<>=!~\[ ;@]", p, maxsplit=1)[0].lower() for p in packages}
    assert not _missing_dependencies(names)


def _missing_dependencies(names: set[str]) -> list[str]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = {re.split(r"[<>=!~\[ ;@]", d, maxsplit=1)[0].lower() for d in deps}
    return sorted(wanted - {"ray"} - names)  # ray comes with the rayproject/ray image


def test_the_manifests_install_the_s3_extra_with_its_floors(rayjob) -> None:
    """Both run in object storage (BUCKET) and take its run lock, whose If-Match needs the
    [s3] extra's botocore floor: each manifest's pip installs every requirement of that
    extra, with the same bounds (a bare s3fs lets pip keep an image's older botocore)."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wanted = {r.replace(" ", "") for r in extras["s3"]}
    rayjob_env = yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])
    cron = _one(CRONJOB, "CronJob")
    container = _containers(cron["spec"]["jobTemplate"]["spec"]["template"], "CronJob")[0]
    cron_env = yaml.safe_load({e["name"]: e.get("value") for e in container.get("env", [])}
                              ["RUNTIME_ENV"])  # fmt: skip
    for where, env in (("RayJob", rayjob_env), ("CronJob", cron_env)):
        packages = {p.replace(" ", "") for p in env["pip"]["packages"]}
        assert wanted <= packages, (where, sorted(wanted - packages))


def test_rayjob_entrypoint_runs_analyze(rayjob) -> None:
    modules = _check_entrypoint(rayjob["spec"]["entrypoint"], "RayJob.spec.entrypoint")
    assert "jobs.analyze" in modules


def test_reanalyze_cluster() -> None:
    cluster = _one(CRONJOB, "RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1"
    _check_metadata(cluster)
    check_cluster_spec(cluster["spec"], "RayCluster.spec")


def test_reanalyze_cronjob() -> None:
    cron = _one(CRONJOB, "CronJob")
    cluster = _one(CRONJOB, "RayCluster")
    assert cron["apiVersion"] == "batch/v1"
    _check_metadata(cron)
    spec = cron["spec"]
    assert CRON_RE.match(spec["schedule"]), spec["schedule"]
    assert spec.get("concurrencyPolicy") == "Forbid", "two re-analyses must not overlap"
    pod = spec["jobTemplate"]["spec"]["template"]["spec"]
    assert pod.get("restartPolicy") in {"Never", "OnFailure"}
    container = _containers(spec["jobTemplate"]["spec"]["template"], "CronJob")[0]
    command = " ".join([*container.get("command", []), *container.get("args", [])])
    script = " ".join(container.get("args", [])) or command

    # it submits to the cluster above, through the head service KubeRay creates for it
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert "ray job submit" in script
    address = env.get("RAY_ADDRESS", "")
    assert address == f"http://{cluster['metadata']['name']}-head-svc:8265", address
    runtime_env = yaml.safe_load(env["RUNTIME_ENV"])  # JSON is YAML
    assert runtime_env.get("working_dir")
    assert not _missing_dependencies(
        {
            re.split(r"[<>=!~\[ ;@]", p, maxsplit=1)[0].lower()
            for p in runtime_env["pip"]["packages"]
        }
    )

    # the entrypoint reads the watch list the Ray head mounts from the ConfigMap
    found = _commands_after_python_m(script)
    assert [m for m, _ in found] == ["jobs.reanalyze"]
    argv = shlex.split(script)
    watchlist = argv[argv.index("--watchlist") + 1]
    assert watchlist == "/config/models.yaml"
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in head["containers"][0].get("volumeMounts", [])}
    volumes = {v["name"]: v for v in head.get("volumes", [])}
    name = next(n for n, path in mounts.items() if path == "/config")
    config_map = volumes[name]["configMap"]
    keys = [item["path"] for item in config_map.get("items", [])] or [WATCHLIST.name]
    assert "models.yaml" in keys


def test_reanalyze_module_checked_once_it_exists() -> None:
    if _module_file("jobs.reanalyze") is None:
        pytest.skip("jobs.reanalyze does not exist yet; the CronJob's options are checked then")
    cron = _one(CRONJOB, "CronJob")
    container = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    assert _check_entrypoint(" ".join(container["args"]), "CronJob") == ["jobs.reanalyze"]


def test_watchlist() -> None:
    data = yaml.safe_load(WATCHLIST.read_text())
    assert isinstance(data, dict) and isinstance(data.get("models"), list) and data["models"]
    for i, entry in enumerate(data["models"]):
        assert isinstance(entry, dict) and isinstance(entry.get("model"), str), i
        assert set(entry) <= {"model", "revision", "options"}, entry
        assert isinstance(entry.get("revision", "latest"), str), entry
        assert isinstance(entry.get("options", {}), dict), entry


# ------------------------------------------------------------- token authentication

AUTH_SECRET_KEY = "auth_token"  # KubeRay's convention (RAY_AUTH_TOKEN_SECRET_KEY)


def _token_secret(container: dict, where: str) -> str:
    """Assert ``container`` runs with RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from a Secret;
    returns the Secret's name."""
    env = {e["name"]: e for e in container.get("env", [])}
    assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", f"{where}: RAY_AUTH_MODE=token"
    token = env.get("RAY_AUTH_TOKEN")
    assert token is not None, f"{where}: RAY_AUTH_TOKEN is missing"
    assert "value" not in token, f"{where}: a token must come from a Secret, never the manifest"
    ref = token.get("valueFrom", {}).get("secretKeyRef", {})
    assert ref.get("key") == AUTH_SECRET_KEY, f"{where}: secretKeyRef.key {ref.get('key')!r}"
    assert isinstance(ref.get("name"), str) and DNS1123.match(ref["name"]), where
    assert not ref.get("optional", False), f"{where}: the token Secret must not be optional"
    return ref["name"]


def _cluster_token_secrets(spec: dict, where: str) -> set[str]:
    """Every Ray container of a RayClusterSpec has token auth; the Secrets they name."""
    secrets = {
        _token_secret(c, f"{where}.headGroupSpec")
        for c in _containers(spec["headGroupSpec"]["template"], where)[:1]
    }
    for i, g in enumerate(spec["workerGroupSpecs"]):
        w = f"{where}.workerGroupSpecs[{i}]"
        secrets.add(_token_secret(_containers(g["template"], w)[0], w))
    return secrets


def _documents_the_secret(path: Path, secret: str) -> None:
    """The manifest says how to create the Secret and how a client reads the token."""
    text = path.read_text()
    assert f"kubectl create secret generic {secret}" in text, f"{path.name}: creating {secret}"
    assert f"kubectl get secret {secret}" in text, f"{path.name}: reading the token"
    assert "RAY_AUTH_MODE=token" in text, f"{path.name}: what a client sets"
    assert not [d for d in _docs(path) if d.get("kind") == "Secret"], (
        f"{path.name}: never ship a Secret (a token) in the repository"
    )


def test_rayjob_token_authentication(rayjob) -> None:
    spec = rayjob["spec"]
    secrets = _cluster_token_secrets(spec["rayClusterSpec"], "spec.rayClusterSpec")
    # the submitter pod sends the token too (KubeRay fills in its `ray job submit` command)
    template = spec.get("submitterPodTemplate")
    assert isinstance(template, dict), "spec.submitterPodTemplate: the submitter needs the token"
    submitter = _containers(template, "spec.submitterPodTemplate")[0]
    assert not submitter.get("command"), "leave the command to KubeRay (ray job submit ...)"
    assert template["spec"].get("restartPolicy") == "Never"
    head_image = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert _image_version(submitter["image"], "submitter") == _image_version(
        head_image["image"], "head"
    )
    secrets.add(_token_secret(submitter, "spec.submitterPodTemplate"))
    assert len(secrets) == 1, f"one token for the whole cluster, got Secrets {secrets}"
    _documents_the_secret(RAYJOB, secrets.pop())


def test_reanalyze_token_authentication() -> None:
    cluster = _one(CRONJOB, "RayCluster")
    cron = _one(CRONJOB, "CronJob")
    secrets = _cluster_token_secrets(cluster["spec"], "RayCluster.spec")
    submit = _containers(cron["spec"]["jobTemplate"]["spec"]["template"], "CronJob")[0]
    secrets.add(_token_secret(submit, "CronJob submitter"))
    assert len(secrets) == 1, f"one token for the cluster and its submitter, got {secrets}"
    _documents_the_secret(CRONJOB, secrets.pop())


def test_token_checks_are_not_vacuous(rayjob) -> None:
    bad = copy.deepcopy(rayjob["spec"]["rayClusterSpec"])
    worker = bad["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    worker["env"] = [e for e in worker["env"] if e["name"] != "RAY_AUTH_MODE"]
    with pytest.raises(AssertionError, match="RAY_AUTH_MODE=token"):
        _cluster_token_secrets(bad, "bad")
    literal = copy.deepcopy(rayjob["spec"]["rayClusterSpec"])
    head = literal["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["env"] = [
        {"name": "RAY_AUTH_MODE", "value": "token"},
        {"name": "RAY_AUTH_TOKEN", "value": "hunter2"},
    ]
    with pytest.raises(AssertionError, match="never the manifest"):
        _cluster_token_secrets(literal, "literal")


def test_every_manifest_is_checked() -> None:
    """A new file under deploy/ gets a test too."""
    assert {p.name for p in DEPLOY.glob("*.y*ml")} == {RAYJOB.name, CRONJOB.name, WATCHLIST.name}


def test_the_shipped_watch_list_names_models_every_cluster_can_load() -> None:
    """deploy/models.yaml, as shipped, holds hub models only: a local directory would have to
    exist on every node of the user's cluster, and the nightly run would fail on it until
    then (its example stays a comment)."""
    from embgeom_ray.runs.reanalyze import load_watchlist

    entries = load_watchlist(str(WATCHLIST))
    assert len(entries) >= 3
    for entry in entries:
        assert not entry.model.startswith(("/", ".", "~")), entry.model
        assert entry.model.count("/") <= 1, entry.model
