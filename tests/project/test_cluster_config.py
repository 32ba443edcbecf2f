"""``cluster.yaml`` against Ray's own cluster-launcher schema, with no cloud account.

The schema is the one ``ray up`` validates with (``ray/autoscaler/ray-schema.json`` inside the
installed ray package); Ray's ``prepare_config`` + ``validate_config`` then fill in the AWS
defaults and run the launcher's own consistency checks. On top of that, the things this
project needs: a CPU head, an autoscaling spot GPU worker type, a rayproject/ray GPU image,
set-up commands that install this project, and start commands that join the head; and secure
defaults: the dashboard (whose job API runs any code) on the head's localhost only, since its
documented way in is the SSH tunnel of ``ray dashboard cluster.yaml``, and Ray's token
authentication on for every node, with the token file copied where Ray reads it.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[2]
CLUSTER_YAML = REPO / "cluster.yaml"
IMAGE_RE = re.compile(r"^rayproject/ray:(\d+)\.(\d+)\.(\d+)-py3(\d+)-(gpu|cu\d+)$")


def _ray_schema() -> dict:
    import ray.autoscaler

    path = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
    assert path.is_file(), f"Ray's cluster-config schema is missing at {path}"
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _commands(value) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def test_valid_against_ray_schema(config) -> None:
    validator = jsonschema.Draft7Validator(_ray_schema())
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_schema_catches_mistakes(config) -> None:
    """The schema check is not vacuous: a misspelt key or a float GPU count fails it."""
    validator = jsonschema.Draft7Validator(_ray_schema())
    typo = copy.deepcopy(config) | {"max_worker": 3}
    assert list(validator.iter_errors(typo))
    bad = copy.deepcopy(config)
    worker = next(t for t in bad["available_node_types"].values() if "GPU" in t["resources"])
    worker["resources"]["GPU"] = 0.5
    assert list(validator.iter_errors(bad))


def test_ray_launcher_accepts_it(config) -> None:
    """What `ray up` does before touching the cloud: fill defaults, then validate."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    assert prepared["provider"]["type"] == "aws"


def test_cpu_head_and_spot_gpu_workers(config) -> None:
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    assert head["resources"].get("CPU") == 0, "no extractor should be scheduled on the head"

    gpu_types = {name: t for name, t in types.items() if t["resources"].get("GPU", 0) >= 1}
    assert gpu_types, "a worker type with GPU resources is required"
    for name, t in gpu_types.items():
        assert name != config["head_node_type"]
        assert t.get("min_workers", 0) == 0, f"{name}: autoscale from zero"
        assert t["max_workers"] >= 1, name
        assert t["max_workers"] <= config["max_workers"], name
        assert t["resources"].get("CPU", 0) >= 1, f"{name}: the actors also need CPUs"
        market = t["node_config"].get("InstanceMarketOptions", {})
        assert market.get("MarketType") == "spot", f"{name}: spot instances"


def test_current_ray_gpu_image(config, pyproject) -> None:
    image = config["docker"]["image"]
    m = IMAGE_RE.match(image)
    assert m, f"{image} is not a rayproject/ray GPU image tag (rayproject/ray:X.Y.Z-py3NN-gpu)"
    version = tuple(int(x) for x in m.groups()[:3])
    pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("ray"))
    floor = tuple(int(x) for x in re.search(r">=\s*([\d.]+)", pin).group(1).split("."))
    assert version >= floor, f"image Ray {version} is older than the project's {pin}"
    py_minor = int(m.group(4))
    req = re.search(r">=\s*3\.(\d+)", pyproject["project"]["requires-python"])
    assert py_minor >= int(req.group(1)), f"image Python 3.{py_minor} is not supported"


def test_setup_installs_the_project(config, pyproject) -> None:
    setup = _commands(config.get("setup_commands"))
    for node_type in config["available_node_types"].values():
        setup += _commands(node_type.get("worker_setup_commands"))
    setup += _commands(config.get("head_setup_commands"))
    setup += _commands(config.get("worker_setup_commands"))
    # the checkout the launcher copies to the nodes: a file mount of the repository root
    mounts = {
        remote: local
        for remote, local in (config.get("file_mounts") or {}).items()
        if (REPO / local).resolve() == REPO
    }
    name = pyproject["project"]["name"]
    installs = [c for c in setup if "pip install" in c]
    assert any(
        any(remote.rstrip("/") in shlex.split(c) for remote in mounts)
        or re.search(rf"{re.escape(name)}\s*@\s*git\+", c)
        for c in installs
    ), f"no set-up command pip-installs this project: {installs}"
    excluded = " ".join(config.get("rsync_exclude") or [])
    assert ".venv" in excluded and ".git" in excluded, "do not sync the virtualenv or .git"


def test_start_commands_join_the_head(config) -> None:
    head = " ".join(_commands(config["head_start_ray_commands"]))
    worker = " ".join(_commands(config["worker_start_ray_commands"]))
    assert "ray start --head" in head
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head
    port = re.search(r"--port[= ](\d+)", head).group(1)
    assert f"--address=$RAY_HEAD_IP:{port}" in worker


# ------------------------------------------------------------- secure by default

LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}


def _ray_start(config: dict, key: str) -> list[str]:
    """The ``ray start`` commands of ``key``, each with the shell text that precedes it in its
    list entry (``ulimit ...; RAY_AUTH_MODE=token ray start ...``)."""
    return [c for c in _commands(config[key]) if "ray start" in c]


def _start_env(command: str) -> dict[str, str]:
    """Variables set for ``ray start`` in ``command``: ``export A=B`` or a ``A=B`` prefix."""
    segment = command.split("ray start", 1)[0].split(";")
    env = {}
    for part in segment:
        for token in shlex.split(part):
            if token == "export":
                continue
            m = re.fullmatch(r"([A-Z_][A-Z0-9_]*)=(.*)", token)
            if m:
                env[m.group(1)] = m.group(2)
    return env


def _docker_env(config: dict) -> dict[str, str]:
    """``--env``/``-e`` variables of the docker run options (the whole container's)."""
    tokens = [
        t for option in config.get("docker", {}).get("run_options", []) for t in shlex.split(option)
    ]
    env = {}
    for i, t in enumerate(tokens):
        value = None
        if t in {"-e", "--env"} and i + 1 < len(tokens):
            value = tokens[i + 1]
        elif t.startswith("--env="):
            value = t.split("=", 1)[1]
        if value and "=" in value:
            k, v = value.split("=", 1)
            env[k] = v
    return env


def _dashboard_hosts(config: dict) -> list[str]:
    hosts = []
    for command in _ray_start(config, "head_start_ray_commands"):
        m = re.search(r"--dashboard-host[= ](\S+)", command)
        hosts.append(m.group(1) if m else "localhost")  # ray start's default
    return hosts


def _auth_modes(config: dict, key: str) -> list[str | None]:
    docker = _docker_env(config)
    return [
        _start_env(c).get("RAY_AUTH_MODE", docker.get("RAY_AUTH_MODE"))
        for c in _ray_start(config, key)
    ]


def test_dashboard_only_on_the_heads_localhost(config) -> None:
    """The documented way in is the SSH tunnel of `ray dashboard cluster.yaml`: the job API
    (remote code execution for whoever reaches it) listens on the head's loopback only."""
    assert "ray dashboard cluster.yaml" in CLUSTER_YAML.read_text()
    hosts = _dashboard_hosts(config)
    assert hosts and set(hosts) <= LOOPBACK, hosts
    # the check is not vacuous: the former 0.0.0.0 is caught
    bad = copy.deepcopy(config)
    bad["head_start_ray_commands"] = [
        c.replace("--dashboard-host=127.0.0.1", "--dashboard-host=0.0.0.0")
        for c in _commands(bad["head_start_ray_commands"])
    ]
    assert not set(_dashboard_hosts(bad)) <= LOOPBACK


def test_token_authentication_on_every_node(config) -> None:
    """RAY_AUTH_MODE=token for the head's and the workers' `ray start`, explicitly in the start
    commands and for the whole container; the token file copied to where Ray reads it."""
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert _auth_modes(config, key) == ["token"], key
        for command in _ray_start(config, key):
            assert _start_env(command).get("RAY_AUTH_MODE") == "token", command
    assert _docker_env(config).get("RAY_AUTH_MODE") == "token"
    # ~/.ray/auth_token of the image's user (ray) on every node, from the launching machine's
    mounts = config.get("file_mounts") or {}
    assert mounts.get("/home/ray/.ray/auth_token") == "~/.ray/auth_token", mounts
    # never a token in the repository
    text = CLUSTER_YAML.read_text()
    # the header says how the token is made, kept private, and given to a client
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    for step in (
        "ray get-auth-token --generate",
        "chmod 600 ~/.ray/auth_token",
        "export RAY_AUTH_MODE=token",
    ):
        assert step in header, step
    assert not re.search(r"RAY_AUTH_TOKEN\s*[=:]\s*\S", text)
    # the check is not vacuous
    bad = copy.deepcopy(config)
    bad["docker"]["run_options"] = [o for o in bad["docker"]["run_options"] if "AUTH" not in o]
    bad["worker_start_ray_commands"] = [
        c.replace("RAY_AUTH_MODE=token", "") for c in _commands(bad["worker_start_ray_commands"])
    ]
    assert _auth_modes(bad, "worker_start_ray_commands") == [None]


def test_start_env_parsing() -> None:
    assert _start_env("ulimit -n 1; RAY_AUTH_MODE=token ray start --head") == {
        "RAY_AUTH_MODE": "token"
    }
    assert _start_env("export RAY_AUTH_MODE=token; ray start --address=h:1") == {
        "RAY_AUTH_MODE": "token"
    }
    assert _start_env("ray start --head --env=RAY_AUTH_MODE=token") == {}
