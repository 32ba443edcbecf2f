"""The Python API: start a run, open a finished one, merge, compare and report, in a line or two.

::

    import embgeom_ray as eg

    run = eg.analyze(model="bert-base-uncased", corpus="texts.jsonl", out="runs/bert",
                     max_length=128, layers=[0, 6, -1])
    run.layers                         # pandas DataFrame, one row per layer
    run.figures()["cosine_isotropy"]   # a matplotlib figure
    eg.open_run("s3://bucket/runs/bert").type_stats

Every function takes the options of its command (``embgeom analyze|merge|compare|report``) by
their names (``max_length`` for ``--max-length``), validated by the same code, so a bad value
fails before any work with the message the command would print, raised as a
:class:`~embgeom_ray.errors.UserError` (its subclass says what kind: ``ConfigError``,
``CorpusError``, ``ModelError``, ``StorageError``, ``RunDirError``, …). Where the command
exits with status 2, the function raises one of these; anything else is a bug.

A run is read through :class:`~embgeom_ray.run_dir.RunDir`, the one reader of run directories
(local paths and fsspec URLs alike); :class:`Run` keeps what it has read. The tables and columns
are documented in ``docs/outputs.md``; this API in ``docs/python.md``.
"""

from __future__ import annotations

import contextlib
import json
import numbers
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pandas as pd

from .errors import ConfigError
from .progress import routed
from .run_dir import Manifest, RunDir, RunDirError, format_summary
from .storage import as_user_error, require_filesystems

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .config import JobConfig
    from .core.statistics import EmbeddingStatistics

__all__ = ["Comparison", "LayerSample", "Run", "RunDirError", "analyze", "compare", "merge",
           "open_run", "plan", "plan_merge", "store_runs", "write_report"]  # fmt: skip

Echo = Callable[[str], None]


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    """Within: an object store's fault (or any error a user can cause that a library raised)
    becomes the :class:`~embgeom_ray.errors.UserError` the commands report; the rest passes."""
    try:
        yield
    except Exception as exc:
        error = as_user_error(exc)
        if error is None or error is exc:
            raise
        raise error from exc


def _quiet(_line: str) -> None:
    """An ``echo`` that prints nothing."""


def _progress(echo: Echo | None) -> contextlib.AbstractContextManager[None]:
    """Where the job's progress goes: the commands' bars and lines on stderr where ``echo`` is
    ``print``; else those lines to ``echo`` (None: nowhere) and no bars, Ray's own lines
    included (:func:`~embgeom_ray.progress.routed`). A non-callable ``echo`` is a
    :class:`ConfigError` before any work (not a TypeError at the job's first line)."""
    if echo is not None and not callable(echo):
        raise ConfigError(
            f"echo must be a callable taking one line (print, a logger's method) or None, "
            f"got {echo!r}"
        )
    return contextlib.nullcontext() if echo is print else routed(echo)


#: held by each call that may run a job (:func:`_call`), so that calls from several threads run
#: one after another: what a call sets up is the process's, not the thread's (the Ray it starts
#: and shuts down, ``ray.init``'s environment variables, where progress goes), so a call that
#: ended while another ran would shut down the other's Ray. Reentrant: a call made within one
#: (an ``echo`` that calls the API) does not wait on itself.
_ONE_CALL_AT_A_TIME = threading.RLock()


@contextlib.contextmanager
def _call(echo: Echo | None) -> Iterator[None]:
    """Within: one call of the API that may run a job, after any such call in progress in
    another thread has ended (:data:`_ONE_CALL_AT_A_TIME`). Its progress goes to ``echo``
    (:func:`_progress`); an error a user can cause is a :class:`UserError`
    (:func:`_user_errors`); Ray is left as found
    (:func:`~embgeom_ray.distributed.cluster.leave_ray_as_found`): a Ray the call started or
    joined is shut down when it returns, raises or is interrupted (Ctrl-C: the caller's
    ``KeyboardInterrupt``), and one the caller had initialised is used and left up."""
    from .distributed.cluster import leave_ray_as_found

    with _one_at_a_time(echo), _user_errors(), _progress(echo), leave_ray_as_found():
        yield


#: the line of a call that waits for another thread's (:func:`_one_at_a_time`)
WAITING = (
    "waiting for the embgeom_ray call running in another thread to end: calls run one after "
    "another"
)


@contextlib.contextmanager
def _one_at_a_time(echo: Echo | None) -> Iterator[None]:
    """Within: :data:`_ONE_CALL_AT_A_TIME` held. A call that finds it held by another thread
    first says so (:data:`WAITING`), to ``echo`` (on stderr where it is ``print``, as the
    commands' notices; nothing where None): it may wait for hours behind an analysis, and
    without a word it looked hung. Said here, not through the progress routing, which is
    the other call's until it ends."""
    if not _ONE_CALL_AT_A_TIME.acquire(blocking=False):
        if echo is print:
            print(WAITING, file=sys.stderr, flush=True)
        elif callable(echo):
            echo(WAITING)
        _ONE_CALL_AT_A_TIME.acquire()
    try:
        yield
    finally:
        _ONE_CALL_AT_A_TIME.release()


class LayerSample(NamedTuple):
    """One layer's rows of a run's sample: ``rows`` (a DataFrame: ``layer``, ``sample``,
    ``token_id``, ``token``, the occurrence's keys and its K-means ``cluster``; see
    ``samples.parquet`` in ``docs/outputs.md``) and their ``vectors``, ``(len(rows), d)``
    float64 (stored float32, exact), in the same order."""

    rows: pd.DataFrame
    vectors: np.ndarray


class Run:
    """A complete run directory (local path or fsspec URL), read lazily and once.

    Tables as pandas DataFrames: :attr:`layers`, :attr:`type_stats`, :attr:`dims`,
    :attr:`positions`, :attr:`kmeans` (any other by :meth:`table`); the typed
    :attr:`manifest`; a layer's sample (:meth:`sample`); the mergeable statistics
    (:meth:`statistics`); the report's figures as matplotlib figures (:meth:`figures`).
    Opening a run that is not complete raises :class:`~embgeom_ray.run_dir.RunDirError`
    (rerun its command to finish it).
    """

    def __init__(self, url: str | Path) -> None:
        self.dir = RunDir(str(url))
        with _user_errors():
            #: the run's ``manifest.json``, typed (:class:`~embgeom_ray.run_dir.Manifest`)
            self.manifest: Manifest = self.dir.complete_manifest("opening it")

    @property
    def url(self) -> str:
        """Where the run is: its local path or URL."""
        return self.dir.url

    def __repr__(self) -> str:
        m = self.manifest
        model = m.model.id if m.model else "?"
        tokens = f", {m.counts.tokens:,} tokens" if m.counts else ""
        return f"Run({self.url!r}: {model}, layers {m.layers}{tokens})"

    # ------------------------------------------------------------------ tables
    def table(
        self, name: str, columns: Sequence[str] | None = None, filters: Any = None
    ) -> pd.DataFrame:
        """The run's table ``name`` (``layers``, ``samples``, …), only ``columns`` and, with
        ``filters`` (pyarrow's, e.g. ``[("layer", "=", 3)]``), only the matching rows."""
        with _user_errors():
            return self.dir.read_table(name, columns, filters)

    @cached_property
    def layers(self) -> pd.DataFrame:
        """``layers.parquet``: one row per layer, the exact, clipping and sampled metrics."""
        return self.table("layers")

    @cached_property
    def type_stats(self) -> pd.DataFrame:
        """``type_stats.parquet``: one row per (layer, token type)."""
        return self.table("type_stats")

    @cached_property
    def dims(self) -> pd.DataFrame:
        """``dims.parquet``: one row per (layer, dimension): the rogue-dimension scores."""
        return self.table("dims")

    @cached_property
    def positions(self) -> pd.DataFrame:
        """``positions.parquet``: one row per (layer, position in the window)."""
        return self.table("positions")

    @cached_property
    def kmeans(self) -> pd.DataFrame:
        """``kmeans.parquet``: each layer's K-means scan (silhouette and inertia of every k)."""
        return self.table("kmeans")

    def summary(self) -> str:
        """The per-layer summary the command prints at the end of a run."""
        return format_summary(self.layers)

    # ------------------------------------------------------------------ the sample, statistics
    @cached_property
    def sample_layers(self) -> list[int]:
        """The layers the run's sample holds vectors of (``[]`` without a sample)."""
        with _user_errors():
            return self.dir.sample_layers()

    def sample(self, layer: int, which: str = "uniform") -> LayerSample:
        """Layer ``layer``'s sample: the uniform sample of occurrences (``which="uniform"``)
        or one occurrence per token type (``"type_uniform"``), with its rows and vectors
        (:class:`LayerSample`). Only that layer is read."""
        if which not in ("uniform", "type_uniform"):
            raise ConfigError(f"which must be 'uniform' or 'type_uniform', got {which!r}")
        with _user_errors():
            got = self.dir.sample_vectors(int(layer), which, columns=None)
        if got is None:
            held = self.sample_layers
            raise RunDirError(
                f"run {self.url} has no {which} sample of layer {layer}"
                + (f" (the sample holds layers {held})" if held else " (it has no sample)")
            )
        rows, vectors = got
        return LayerSample(rows, vectors)

    def statistics(self) -> EmbeddingStatistics:
        """The run's mergeable statistics, whole
        (:class:`~embgeom_ray.core.statistics.EmbeddingStatistics`): every exact table is a
        function of it. Its size is the artefact's (``docs/sizing.md``)."""
        with _user_errors():
            return self.dir.load_statistics()

    # ------------------------------------------------------------------ figures, report
    def figures(self, names: Sequence[str] | None = None) -> dict[str, Figure]:
        """The report's figures (``names``: those only, of
        :data:`~embgeom_ray.report.plots.PLOTS`), drawn from the run's files as matplotlib
        figures, by name in report order; nothing is written. A figure the run lacks the
        inputs of (an optional table, ``--sample-size 0``) is left out."""
        from .report.figures.common import kept
        from .report.plots import PLOTS, draw_figures
        from .run_view import RunView

        with _user_errors(), kept() as drawn:
            draw_figures(RunView(self.dir), list(names or [n for n, _, _ in PLOTS]))
        return dict(drawn)

    def report(self) -> str:
        """Draw the run's figures and write its ``report.html`` (as ``embgeom report``);
        returns the report's path or URL."""
        return write_report(self.url)


class Comparison:
    """A comparison written by :func:`compare` (its ``out`` directory): the summary
    (``comparison.json``) and the tables as DataFrames (``docs/outputs.md``, "Comparisons")."""

    def __init__(self, url: str | Path) -> None:
        from .integrity import digests_from_json, unseal
        from .io_utils import read_bytes
        from .runs.compare import SUMMARY

        where = RunDir(str(url))
        with _user_errors():
            if not where.has(SUMMARY):
                raise RunDirError(f"{where.url} holds no comparison (no {SUMMARY})")
            path = where.path(SUMMARY)
            #: ``comparison.json``: the runs, the layer matching, the largest changes, notes
            self.summary: dict[str, Any] = unseal(json.loads(read_bytes(path)), path)
        # its tables are read checked against the digests it records (none: an earlier version's)
        self.dir = RunDir(where.url, digests_from_json(self.summary.get("digests")))

    @property
    def url(self) -> str:
        return self.dir.url

    def __repr__(self) -> str:
        labels = [r.get("label") for r in self.summary.get("runs", [])]
        return f"Comparison({self.url!r}: {labels})"

    @cached_property
    def changes(self) -> pd.DataFrame:
        """``changes.parquet``: every metric's change per layer against the baseline, ranked."""
        return self._table("CHANGES")

    @cached_property
    def metrics(self) -> pd.DataFrame:
        """``comparison_wide.parquet``: every per-layer metric, one column per run."""
        return self._table("WIDE")

    @cached_property
    def long(self) -> pd.DataFrame:
        """``comparison.parquet``: one row per (run, layer, metric)."""
        return self._table("LONG")

    @cached_property
    def rogue_dims(self) -> pd.DataFrame:
        """``rogue_dims.parquet``: rogue dimensions that appeared or vanished."""
        return self._table("ROGUE")

    @property
    def report_path(self) -> str:
        """The comparison's ``report.html``."""
        from .io_utils import is_local, local_path
        from .run_dir import REPORT

        path = self.dir.path(REPORT)
        return local_path(path) if is_local(path) else path

    def _table(self, constant: str) -> pd.DataFrame:
        from .runs import compare as module

        with _user_errors():
            return self.dir.read_table(getattr(module, constant))


# ---------------------------------------------------------------------------------- functions


def _config(config: str | Path | None, values: Mapping[str, Any]) -> JobConfig:
    """The job's validated options: the YAML file ``config``, then ``values`` (None: not
    given) on top, as ``embgeom analyze --config FILE --flags`` does."""
    from .config import JobConfig, build_config, did_you_mean

    unknown = sorted(set(values) - set(JobConfig.model_fields))
    if unknown:
        raise ConfigError(
            f"unknown option(s) {unknown}{did_you_mean(unknown, list(JobConfig.model_fields))}: "
            "the options are those of `embgeom analyze --help`, with underscores (max_length "
            "for --max-length)"
        )
    given = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in values.items()}
    return build_config(str(config) if config is not None else None, given)


def _refuse_plan(options: Mapping[str, Any], where: str, planner: str = "plan") -> None:
    """A :class:`ConfigError` where ``options`` ask for the plan (``plan``, ``plan_json``):
    :func:`analyze` or :func:`merge` would print it, run nothing and then fail to open a run
    never written (a ``config`` file's ``plan_json:`` ended so, in 'OUT does not exist');
    ``planner``: the function that gives the plan."""
    asked = [f"{key}={options[key]!r}" for key in ("plan", "plan_json") if options.get(key)]
    if asked:
        raise ConfigError(
            f"{' and '.join(asked)}{where} runs nothing: call embgeom_ray.{planner}(...) for "
            "the plan"
        )


def analyze(
    model: str | Path | None = None,
    corpus: str | Path | None = None,
    out: str | Path | None = None,
    *,
    config: str | Path | None = None,
    echo: Echo | None = print,
    **options: Any,
) -> Run:
    """Measure ``model``'s embeddings over ``corpus`` into the run directory ``out``, as
    ``embgeom analyze`` does, and open the run (:class:`Run`).

    ``options``: any option of ``embgeom analyze --help`` by its name (``max_length=128``,
    ``layers=[0, -1]``, ``device="cuda"``, ``address="HOST:6379"``); ``config``: a YAML file
    of options, which the arguments override. The same validation and the same behaviour:
    a private local Ray unless ``address``, ``RAY_ADDRESS`` or a submitted job names a
    cluster (or the caller initialised Ray: then that one, left up); a finished run with the
    same inputs is reused; an interrupted one is resumed. A Ray the call started is stopped
    when it returns, raises or is interrupted (Ctrl-C: ``KeyboardInterrupt``, the run left
    incomplete).
    ``echo``: where the job's lines go: ``print`` (the default) prints them as the command
    does, its progress bars and notices on stderr; any other callable gets every line, the
    notices included, and no bar is drawn; None: nowhere, Ray's own lines and its workers'
    output included. For ``--plan``, see :func:`plan`.
    """
    values = {"model": model, "corpus": corpus, "out": out}
    _refuse_plan(options, "")
    from .runs.pipeline import analyze as run_analysis

    with _call(echo):
        job = _config(config, values | options)
        _refuse_plan({"plan": job.plan, "plan_json": job.plan_json}, f" (set in {config})")
        require_filesystems(job.corpus, job.out)
        run_analysis(job, echo=echo or _quiet)
    return Run(job.out)


def plan(
    model: str | Path | None = None,
    corpus: str | Path | None = None,
    out: str | Path | None = None,
    *,
    config: str | Path | None = None,
    echo: Echo | None = print,
    **options: Any,
) -> dict[str, Any]:
    """What :func:`analyze` with these arguments would do (``embgeom analyze --plan``): how
    many extractors and reducers, how much memory each, and why; nothing is run or written.
    Returns the decisions (what the manifest's ``sizing`` would record); ``echo`` gets the
    plan in words."""
    from .runs.pipeline import analyze as run_analysis

    values = {"model": model, "corpus": corpus, "out": out}
    with _call(echo):
        job = _config(config, values | options | {"plan": True})
        return run_analysis(job, echo=echo or _quiet)


def open_run(url: str | Path) -> Run:
    """The complete run at ``url`` (a local path or an fsspec URL such as ``s3://…``)."""
    return Run(url)


def _run_list(runs: Any, what: str) -> list[str]:
    """``runs`` as a list of URLs; a single path or URL given where a list is expected is a
    :class:`ConfigError` (iterated, it would be its characters)."""
    if isinstance(runs, str | Path | Run):
        raise ConfigError(
            f"{what} takes a list of runs, got one ({str(runs)!r}): e.g. "
            f"{what}(['runs/a', 'runs/b'], 'runs/out')"
        )
    return [r.url if isinstance(r, Run) else str(r) for r in runs]


def _merge(
    runs: Sequence[str | Path | Run], out: str | Path, tokenizer: str | None, echo: Echo | None,
    options: dict[str, Any],
) -> Any:
    """``embgeom merge`` with ``options`` checked against its options (``MERGE_OPTIONS``):
    what :func:`~embgeom_ray.runs.merge.merge_runs` returns (the plan's dict where it plans)."""
    from .config import MERGE_OPTIONS, did_you_mean
    from .runs.merge import merge_runs

    unknown = sorted(set(options) - set(MERGE_OPTIONS))
    if unknown:
        known = [o for o in MERGE_OPTIONS if o != "out"]
        raise ConfigError(
            f"unknown merge option(s) {unknown}{did_you_mean(unknown, known)}; the options are "
            f"{known}"
        )
    if options.get("plan_json") is not None:
        options["plan_json"] = os.fspath(options["plan_json"])
    urls = _run_list(runs, "merge")
    with _call(echo):
        return merge_runs(urls, str(out), tokenizer=tokenizer, echo=echo or _quiet, **options)


def merge(
    runs: Sequence[str | Path | Run],
    out: str | Path,
    *,
    tokenizer: str | None = None,
    echo: Echo | None = print,
    **options: Any,
) -> Run:
    """Merge complete ``runs`` of one model over disjoint corpora into ``out``, the run over
    their union (``embgeom merge``), and open it. ``options``: ``embgeom merge``'s
    (``min_count``, ``reducers``, ``overwrite``, …; table options left out are the first
    run's). For ``--plan``, see :func:`plan_merge`."""
    _refuse_plan(options, "", "plan_merge")
    _merge(runs, out, tokenizer, echo, options)
    return Run(out)


def plan_merge(
    runs: Sequence[str | Path | Run],
    out: str | Path,
    *,
    tokenizer: str | None = None,
    echo: Echo | None = print,
    **options: Any,
) -> dict[str, Any]:
    """What :func:`merge` with these arguments would do (``embgeom merge --plan``): nothing
    is merged or written (but the ``plan_json=FILE`` where given), ``echo`` gets the plan in
    words. Returns the dict ``embgeom merge --plan-json`` writes: the runs' types, where they
    would be merged, the sampled stage's tasks, Ray's object store, under the keys of
    :func:`plan`'s dict for an analysis."""
    return _merge(runs, out, tokenizer, echo, dict(options) | {"plan": True})


def compare(
    runs: Sequence[str | Path | Run],
    out: str | Path,
    *,
    labels: Sequence[str] | str | None = None,
    top: int = 20,
    echo: Echo | None = print,
) -> Comparison:
    """Compare complete ``runs`` layer by layer against the first (``embgeom compare``):
    writes ``out`` and returns the :class:`Comparison`. ``labels``: one a run, a list or the
    command line's comma-separated string."""
    from .runs.compare import CompareError, compare_runs

    if isinstance(top, bool) or not isinstance(top, numbers.Integral) or top < 1:
        raise CompareError(f"top must be an integer of at least 1, got {top!r}")
    urls = _run_list(runs, "compare")
    if isinstance(labels, str):
        labels = [label.strip() for label in labels.split(",")]
    with _call(echo):
        compare_runs(urls, str(out), labels=labels, top=top, echo=echo or _quiet)
    return Comparison(out)


def write_report(run: str | Path | Run) -> str:
    """Draw ``run``'s figures and write its ``report.html`` (``embgeom report``); returns the
    report's path (or URL). (Not ``report``: that is the package's ``embgeom_ray.report``.)"""
    from .report.html import write_report as write

    with _call(print):  # its lines as the command prints them
        return write(run.url if isinstance(run, Run) else str(run))


def store_runs(store: str | Path, *, latest: bool = False) -> pd.DataFrame:
    """The runs a re-analysis store holds (``embgeom reanalyze --store STORE --list``):
    ``STORE/runs.parquet`` sorted by model and start, with a boolean column ``latest`` (each
    model's complete run that finished last); ``latest=True``: those rows only, whose ``out``
    :func:`compare` takes. :class:`~embgeom_ray.errors.OutputError` if the store has no index."""
    from .runs.store_listing import store_runs as read

    with _user_errors():
        return read(str(store), latest=latest)
