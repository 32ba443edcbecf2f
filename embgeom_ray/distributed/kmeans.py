"""The thin Ray layer of the sampled metrics: per-layer K-means and metric tasks, partitions.

Geometry lives in :mod:`embgeom_ray.core.kmeans_selection`, :mod:`embgeom_ray.core.kmeans` and :mod:`embgeom_ray.core.sampled_metrics`; this
module only decides where it runs. :func:`fit_layers_on_ray` (or :func:`submit_layers_on_ray`,
which does not wait) runs :func:`~embgeom_ray.core.kmeans_selection.select_k` for every layer, by the size of
the layer's sample:

- small (n·d ≤ ``local_max_elements``, default
  :data:`~embgeom_ray.core.kmeans_selection.LOCAL_FIT_MAX_ELEMENTS`: the default 4096-point
  samples of any model up to d = 8192): one Ray task per layer runs the model selection, whose
  fits are Lloyd's from k-means++ seedings and warm starts in one process
  (:func:`~embgeom_ray.core.kmeans_selection.fit_many`, float32 distances on the centred
  points unless ``local_dtype`` says otherwise). Each task reserves ``cpus_per_task`` CPUs and
  caps its OpenMP/BLAS threads at that number (``threadpoolctl``), so concurrent tasks never
  run more threads than the CPUs Ray gave them. One thread per task is the default: at
  n = 4096 a second thread does not speed a fit up, a second layer does. The seedings of a k
  are independent, so :class:`RayFits` spreads them over tasks of the same shape (the warm
  starts, each k's from the previous k's partition, stay in the layer's task): the layer's
  task fits one share itself and waits for the others (a task blocked in ``ray.get`` lends its
  CPU back). The scan's seedings (every k's at once) are split where the
  cluster has more CPUs free, C, as the stage starts than the layers take
  (``C // (L · cpus_per_task)`` shares), and where CPUs are free when the layer's seedings
  start (the last layers of a stage with more layers than CPUs); the stability refits, which
  come when other layers may be done, into as many shares as CPUs are free then; either at
  most ``C // cpus_per_task`` (:func:`fit_shares`). Shares are
  balanced by k (a fit's cost grows with it). The result is the one a single task computes.
- large: the sample is centred, split into partitions and put in the object store once
  (``ray.put``); every pass of the fit (k-means|| distance rounds, Lloyd partial sums, the
  final assignment) is one :func:`_apply` task per partition, whose results the layer's driver
  task reduces. A task blocked in ``ray.get`` lends its CPU back to Ray, so the nested tasks
  cannot deadlock the pool. This is for samples too big for one node; for small ones its
  thousands of tiny tasks cost far more than the arithmetic.

Each layer's task asks Ray for its peak memory
(:func:`~embgeom_ray.sizing.sampled_tasks.kmeans_task_bytes`: the n × n matrices of its
silhouettes, its points, its fits), so that a node runs no more of them at once than its memory
holds. :func:`call_on_ray` runs any function as one such thread-capped task; given a layer's ref from
:func:`submit_layers_on_ray` it starts as soon as that layer's clusters are ready, so the
sampled metrics of early layers overlap the K-means of later ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from ..core.distinct import distinct_rows
from ..core.kmeans import MAX_ITER, TOL, KMeansResult, fit, partition
from ..core.kmeans_selection import (
    K_MAX,
    LOCAL_DTYPE,
    LOCAL_FIT_MAX_ELEMENTS,
    MIN_SILHOUETTE,
    N_INIT,
    SILHOUETTE_MAX_POINTS,
    STABILITY_SEEDS,
    FitMany,
    SelectKResult,
    select_k,
    serial_fits,
)
from ..sizing.sampled_tasks import kmeans_task_bytes, share_task_bytes

#: the least a selection waits for its fit-share tasks, once its own share is fitted, before it
#: fits those not done itself (:class:`RayFits`): a share task starts in a worker process that
#: may have to start first (seconds)
SHARE_WAIT_MIN_S = 30.0


def balanced_shares(costs: Sequence[int], shares: int) -> list[list[int]]:
    """Indices of fits of ``costs`` (each fit's k) in ≤ ``shares`` non-empty groups of similar cost.

    A fit's cost is taken as k (Lloyd's distance computations grow with it): longest first,
    each to the group with the least cost so far (Graham's LPT rule, within 4/3 of the best
    split). Each group lists its indices in ascending order; the first group is the costliest.
    """
    shares = max(1, min(int(shares), len(costs)))
    groups: list[list[int]] = [[] for _ in range(shares)]
    cost = [0] * shares
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        g = cost.index(min(cost))
        groups[g].append(i)
        cost[g] += costs[i]
    order = sorted(range(shares), key=lambda g: -cost[g])
    return [sorted(groups[g]) for g in order if groups[g]]


@dataclass(frozen=True)
class RayFits:
    """A ``map_fits`` of :func:`~embgeom_ray.core.kmeans_selection.select_k` that spreads a step's fits over Ray tasks.

    For the stability refits, one more group than the CPUs free at that moment allow tasks of
    ``threads`` CPUs (``ray.available_resources()``), at most ``later_shares``
    (:func:`balanced_shares`): a layer that refits while others still hold every CPU is not
    split (its share tasks would only queue behind them, each in a new worker process), one
    that refits last is. For the scan's seedings (every k's at once), as many groups, and at
    least ``initial_shares``: the last layers of a stage with more layers than CPUs, which
    start when other CPUs fall idle, lend them their seedings. The calling
    process fits the costliest group itself; each other group is a task of ``threads`` CPUs
    and threads (the caller's own thread cap, so every fit runs as it would in the caller: the
    same result), reading the points from one ``ray.put``. One share: all fits here, no task.
    Each share task asks Ray for its peak (:func:`~embgeom_ray.sizing.sampled_tasks.share_task_bytes`
    of its fits), and a step has no more share tasks than Ray's free memory holds as it
    splits (``ray.available_resources()``). That memory is read once, and other selections
    starting at the same moment read the same: their share tasks may then wait for memory
    that the selections hold, each waiting for its shares (Ray lends a task blocked in
    ``ray.get`` its CPU back, not its memory), or for a node with that much memory free that
    never comes. So a selection never waits on a share for ever: once its own share is
    fitted, it waits for the others as long as it took, at least :data:`SHARE_WAIT_MIN_S`,
    then fits each one not done itself (the same fits: the same result) and cancels its task.
    """

    initial_shares: int = 1
    later_shares: int = 1
    threads: int = 1

    def __call__(
        self,
        fit: FitMany,
        X: Any,
        inits: Sequence[np.ndarray],
        *,
        initial: bool = True,
    ) -> list[KMeansResult]:
        available = ray.available_resources() if max(self.initial_shares, self.later_shares) > 1 else {}
        free = available.get("CPU", 0.0) if self.later_shares > 1 else 0.0
        shares = min(self.later_shares, 1 + int(free // self.threads))
        if initial:  # the seedings: no fewer shares than planned, more where CPUs are idle
            shares = max(self.initial_shares, shares)
        costs = [len(ids) for ids in inits]
        n, d = np.shape(getattr(X, "X", X))
        groups = balanced_shares(costs, shares)
        # each share task asks Ray for its peak; no more of them than Ray's free memory holds
        # now, so that none waits for memory that this task, waiting for it, holds
        room = available.get("memory", 0.0)
        while len(groups) > 1 and sum(share_task_bytes(n, d, [costs[i] for i in g])
                                      for g in groups[1:]) > room:  # fmt: skip
            groups = balanced_shares(costs, len(groups) - 1)
        if len(groups) <= 1:
            return serial_fits(fit, X, inits)
        X_ref = ray.put(X)
        refs = [
            call_on_ray(serial_fits, fit, X_ref, [inits[i] for i in g], cpus=self.threads,
                        memory=share_task_bytes(n, d, [costs[i] for i in g]))
            for g in groups[1:]
        ]  # fmt: skip
        start = time.monotonic()
        own = serial_fits(fit, X, [inits[i] for i in groups[0]])  # while the tasks run
        results = [own, *_shares_or_here(fit, X, inits, groups[1:], refs,
                                         max(SHARE_WAIT_MIN_S, time.monotonic() - start))]  # fmt: skip
        out: list[KMeansResult | None] = [None] * len(inits)
        for g, fitted in zip(groups, results, strict=True):
            for i, res in zip(g, fitted, strict=True):
                out[i] = res
        return out


def _shares_or_here(
    fit: FitMany,
    X: Any,
    inits: Sequence[np.ndarray],
    groups: Sequence[Sequence[int]],
    refs: Sequence[Any],
    wait_s: float,
) -> list[list[KMeansResult]]:
    """The fits of each group of ``groups``: its share task's (``refs``) where it is done within
    ``wait_s`` seconds, else fitted here, the last submitted first (the least likely to have
    started), its task cancelled (:class:`RayFits`: a share may wait for memory for ever)."""
    results: dict[int, list[KMeansResult]] = {}
    pending = list(range(len(groups)))
    while pending:
        done, _ = ray.wait([refs[j] for j in pending], num_returns=len(pending), timeout=wait_s)
        for j in [j for j in pending if refs[j] in done]:
            results[j] = ray.get(refs[j])
        pending = [j for j in pending if j not in results]
        if pending:  # not done in time: fit the last here, then look again at once
            j = pending.pop()
            ray.cancel(refs[j])
            results[j] = serial_fits(fit, X, [inits[i] for i in groups[j]])
            wait_s = 0.0
    return [results[j] for j in range(len(groups))]


def fit_shares(layers: int, cpus_per_task: int, cpus: float | None = None) -> tuple[int, int]:
    """(first range's, later steps') shares of a layer's fits on a cluster of ``cpus`` CPUs.

    ``max(1, C // (layers · cpus_per_task))`` while every layer scans its k, and at most
    ``max(1, C // cpus_per_task)`` for the stability refits
    (:class:`RayFits`). ``cpus`` defaults to the CPUs the running cluster has free now
    (``ray.available_resources()``: not those reducer actors, say, still hold).
    """
    if cpus is None:
        cpus = float(ray.available_resources().get("CPU", 1))
    per_task = max(1, int(cpus_per_task))
    total = int(cpus) // per_task
    return max(1, total // max(1, int(layers))), max(1, total)


@ray.remote
def _apply(fn: Callable[[Any], Any], part: Any) -> Any:
    """``fn(part)`` on a worker (``part`` arrives resolved from its object ref)."""
    return fn(part)


def ray_map(fn: Callable[[Any], Any], parts: Sequence[Any]) -> list[Any]:
    """``[fn(p) for p in parts]`` as one Ray task per partition (``parts``: object refs)."""
    return ray.get([_apply.remote(fn, p) for p in parts])


def put_partitions(X: np.ndarray, n_partitions: int) -> list[ray.ObjectRef]:
    """Object refs of :func:`~embgeom_ray.core.kmeans.partition` blocks of ``X`` (put once)."""
    return [ray.put(p) for p in partition(np.ascontiguousarray(X), n_partitions)]


def default_partitions(n: int, rows_per_partition: int = 2048, max_partitions: int = 16) -> int:
    """Partitions for n points: one per ``rows_per_partition`` rows, 1 ≤ P ≤ ``max_partitions``."""
    return int(min(max(1, -(-n // rows_per_partition)), max_partitions))


def fit_on_ray(
    X: np.ndarray,
    k: int,
    n_init: int = N_INIT,
    max_iter: int = MAX_ITER,
    tol: float = TOL,
    seed: int = 0,
    *,
    n_partitions: int | None = None,
) -> KMeansResult:
    """One distributed K-means fit (:func:`embgeom_ray.core.kmeans.fit`) from the driver."""
    X = np.asarray(X, dtype=np.float64)
    shift = X.mean(axis=0)
    Xc = X - shift
    parts = put_partitions(Xc, n_partitions or default_partitions(len(X)))
    res = fit(Xc, k, n_init, max_iter, tol, seed, ray_map, parts=parts)
    res.centers = res.centers + shift
    return res


@ray.remote(num_cpus=1)
def _select_k_task(
    Xc: np.ndarray,
    parts: list[ray.ObjectRef],
    options: dict[str, Any],
    shift: np.ndarray,
    inverse: np.ndarray | None,
) -> SelectKResult:
    # ``parts`` arrive as refs (nested in a list), so each partition moves only to its tasks;
    # they hold the distinct points, ``inverse`` gives every input row its point's label
    res = select_k(Xc, map_fn=ray_map, parts=parts, **options)
    res.centers = res.centers + shift  # back to the input coordinates
    return res if inverse is None else res.expanded(inverse)


@ray.remote(num_cpus=1)
def _capped_call(fn: Callable[..., Any], threads: int, *args: Any, **kwargs: Any) -> Any:
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=threads):
        return fn(*args, **kwargs)


def call_on_ray(
    fn: Callable[..., Any],
    *args: Any,
    cpus: int = 1,
    returns: int = 1,
    memory: int = 0,
    **kwargs: Any,
) -> Any:
    """``fn(*args, **kwargs)`` as one Ray task of ``cpus`` CPUs and at most ``cpus`` threads,
    asking Ray for ``memory`` bytes (its peak, so that a node runs no more such tasks at once
    than its memory holds; 0: none asked).

    Returns its object ref at once (``returns`` > 1: a list of that many refs, one per item of
    the tuple ``fn`` returns, each fetched alone). Arguments that are object refs (e.g. a
    layer's from :func:`submit_layers_on_ray`) arrive resolved: the task starts when they are
    ready.
    """
    if cpus < 1:
        raise ValueError(f"cpus must be >= 1, got {cpus}")
    asked = {"memory": memory} if memory else {}
    task = _capped_call.options(num_cpus=cpus, num_returns=returns, **asked)
    return task.remote(fn, cpus, *args, **kwargs)


def fit_layers_on_ray(
    samples_by_layer: Mapping[int, np.ndarray], **options: Any
) -> dict[int, SelectKResult]:
    """Cai et al.'s K-means model selection for every layer, layers in parallel on Ray.

    Waits for :func:`submit_layers_on_ray` (same arguments) and returns layer ->
    :class:`~embgeom_ray.core.kmeans_selection.SelectKResult` (centres in the input coordinates).
    """
    refs = submit_layers_on_ray(samples_by_layer, **options)
    return dict(zip(refs, ray.get(list(refs.values())), strict=True))


def submit_layers_on_ray(
    samples_by_layer: Mapping[int, np.ndarray],
    *,
    groups: Mapping[int, np.ndarray | None] | None = None,
    k_max: int = K_MAX,
    min_silhouette: float = MIN_SILHOUETTE,
    n_init: int | None = None,
    max_iter: int = MAX_ITER,
    tol: float = TOL,
    seed: int = 0,
    silhouette_max_points: int | None = SILHOUETTE_MAX_POINTS,
    stability_seeds: int = STABILITY_SEEDS,
    n_partitions: int | None = None,
    local_max_elements: int | None = LOCAL_FIT_MAX_ELEMENTS,
    local_dtype: type[np.floating] = LOCAL_DTYPE,
    cpus_per_task: int = 1,
    shares: tuple[int, int] | None = None,
    memory_cap: int | None = None,
) -> dict[int, ray.ObjectRef]:
    """Start Cai et al.'s K-means model selection for every layer, layers in parallel on Ray.

    Pass a layer's ref to :func:`call_on_ray` to run what needs its clusters as soon as they
    are ready, while other layers are still being fitted.

    Args:
        samples_by_layer: layer -> (n, d) sample points (e.g.
            ``sample.points(layer).vectors``); labels in the result follow these rows.
        groups: layer -> the rows' content keys (``sample.points(layer).content_keys``): rows
            with equal keys are one point (:func:`~embgeom_ray.core.distinct.distinct_rows`);
            a layer left out, or None: rows are one point when bit-identical.
        k_max, min_silhouette, n_init, max_iter, tol, seed, silhouette_max_points,
            stability_seeds: as :func:`embgeom_ray.core.kmeans_selection.select_k` (the same
            seed for every layer).
        n_partitions: partitions per layer on the distributed path (default
            :func:`default_partitions`).
        local_max_elements: a layer with n·d at most this is fitted in one task from
            k-means++ chains; larger ones, or all with None, on the distributed k-means|| path
            (see the module docstring).
        local_dtype: the dtype of those one-task fits' Lloyd iterations (float32).
        cpus_per_task: CPUs each one-task layer reserves, and its thread cap.
        shares: (scan's, refits') shares of each one-task layer's fits (:class:`RayFits`);
            default :func:`fit_shares` of the running cluster's CPUs.
        memory_cap: the most Ray memory a layer's task asks for (None: its peak,
            :func:`~embgeom_ray.sizing.sampled_tasks.kmeans_task_bytes`; 0: none), where
            actors that live beside it hold the rest
            (:func:`~embgeom_ray.distributed.sampled_stage.task_memory_cap`).

    Returns:
        layer -> object ref of its :class:`~embgeom_ray.core.kmeans_selection.SelectKResult`
        (centres in the input coordinates); :func:`fit_layers_on_ray` waits for them.
    """
    if not ray.is_initialized():
        raise RuntimeError("fit_layers_on_ray needs a running Ray (ray.init or connect first)")
    if cpus_per_task < 1:
        raise ValueError(f"cpus_per_task must be >= 1, got {cpus_per_task}")
    options = {
        "k_max": k_max,
        "min_silhouette": min_silhouette,
        "n_init": n_init,
        "max_iter": max_iter,
        "tol": tol,
        "seed": seed,
        "silhouette_max_points": silhouette_max_points,
        "stability_seeds": stability_seeds,
    }
    groups = groups or {}
    if shares is None:
        shares = fit_shares(len(samples_by_layer), cpus_per_task)
    map_fits = RayFits(*shares, threads=cpus_per_task)
    refs = {}
    for layer, X in samples_by_layer.items():
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2 or len(X) == 0:
            raise ValueError(f"layer {layer}: sample must be a non-empty (n, d) array")
        memory = kmeans_task_bytes(len(X), X.shape[1], silhouette_max_points, k_max, n_init)
        if memory_cap is not None:
            memory = min(memory, memory_cap)
        if local_max_elements is not None and X.size <= local_max_elements:
            refs[layer] = call_on_ray(
                select_k,
                X,
                cpus=cpus_per_task,
                memory=memory,
                groups=groups.get(layer),
                local_max_elements=local_max_elements,
                local_dtype=local_dtype,
                map_fits=map_fits,
                **options,
            )
            continue
        first, inverse = distinct_rows(X, groups.get(layer))
        if len(first) < len(X):
            X = X[first]
        else:
            inverse = None
        shift = X.mean(axis=0)
        Xc = np.ascontiguousarray(X - shift)
        parts = put_partitions(Xc, n_partitions or default_partitions(len(Xc)))
        task = _select_k_task.options(**({"memory": memory} if memory else {}))
        refs[layer] = task.remote(ray.put(Xc), parts, options, shift, inverse)
    return refs
