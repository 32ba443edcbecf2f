"""The memory of the sampled stage's per-layer Ray tasks: a layer's K-means model selection and
its sampled metrics (:mod:`embgeom_ray.distributed.sampled_stage`).

Both hold distance matrices of the layer's distinct points, n × n float64 where there are at
most m = ``--silhouette-max-points`` of them, and the points themselves. What each holds at its
peak, above its worker process's start (the libraries), counting the arrays the code allocates
(n: the layer's uniform points, which bound its distinct ones; d; k_max; F: the seedings per k):

- **K-means** (:func:`~embgeom_ray.core.tables.sampled_selection`,
  :func:`~embgeom_ray.core.kmeans_selection.select_k`): with n ≤ m, the Gram matrix and the
  distances (8n² each, kept for the metrics task) and the distances' float32 copy in
  :func:`~embgeom_ray.core.kmeans_selection.point_silhouettes` (4n²): 20n²; with n > m (or a
  layer too large for one process: the partitioned fit), no Gram matrix, scikit-learn's
  distances of the min(n, m) points scored and their float32 copy: 12·min(n, m)². Beside
  them, the silhouettes' indicators and sums, (min(n, m), W) float32 each, W = Σ of the k scanned
  (582 at k_max = 60): 8·min(n, m)·W; the points: 40·n·d (the centred copies of
  :func:`~embgeom_ray.core.kmeans_selection.distinct_distances` and ``select_k``, Lloyd's
  float32 copy, :func:`~embgeom_ray.core.distinct.distinct_rows`' copy and scratch of the
  rows, 20–34 · n · d measured beside the matrices); the warm starts' products and distances
  (F, k_max + 1, n) float64, twice, and a gathered block of them: 24·F·(k_max + 1)·n (without
  the Gram matrix, n > m, cold fits' distances and products: 8·(F + 1)·(k_max + 1)·n);
  the seedings' distances, (F, n, k) float32 for every k ≤ 15 at once, and their labels:
  4·F·n·Σ_{k≤15} k + 8·F·n·14; the support's 200 bootstrap weights: 1,600·n.
- **metrics** (:func:`~embgeom_ray.core.tables.sampled_row`,
  :func:`~embgeom_ray.core.sampled_metrics.sampled_metrics_of_points`): with n ≤ m, the
  chord distances of the unit vectors (8n²), the block of the distances the token-type
  silhouette scores (≤ 8n²) and its sums by type (n × at most n/2 types with two points:
  ≤ 4n²): 20n², + 8n² where it computes the distances itself (the K-means task did not hand
  them over: a partitioned selection, a sample read by Ray tasks); with n > m, a
  silhouette's m × m distances, their block and sums, 20m², and the neighbour tables'
  Euclidean and chord distances of a block of rows (at most 32 MiB each): 2·min(8n², 32 MiB).
  Beside them, the silhouette's label indices and sums a block of ~2²⁰ distances at a time:
  16·min(n², 2²⁰); the points (the distinct points, centred, their unit vectors and its
  centred copy, the occurrences centred): 40·n·d, 64·n·d with n > m (the neighbour tables'
  own copies, and those of the half-samples; 37 and 59 · n · d measured); the two neighbour
  tables (indices and distances of 3(lid_k + 1) neighbours a point): 96·(lid_k + 1)·n; IsoScore's
  and the partition isotropies' Gram or covariance matrix, its eigenvectors and LAPACK's
  copy: 24·min(n, d)².
  The distances it reads from the K-means task are in Ray's object store, not in the task.

- **fit shares** (:class:`~embgeom_ray.distributed.kmeans.RayFits`: where CPUs are free, a
  selection hands groups of one step's fits, the seedings of every k ≤ 15 or the stability
  refits at the chosen k, to tasks of their own, reading the points from one ``ray.put``):
  the points' float64 and float32 copies out of the object store (Ray hands them over
  read-only), 12·n·d (10.5–10.8 · n · d measured), and for each fit of its group, of k
  centres, its products and distances with the points (float32) and its labels, 8·n·k + 8·n;
  beside them 4 MiB of small arrays. At most the whole step's fits: the seedings,
  Σ_{k≤15} F · (8·n·k + 8·n), or the S = ``--kmeans-stability-seeds`` refits at k ≤ k_max.
  Measured (``python -m bench.sampled_task_memory --tasks share``, the whole seedings step,
  n = 2,048..8,192, d = 64..1,024): 81–87% of the formula.

Measured (``python -m bench.sampled_task_memory``; docs/sizing.md: the peak RSS growth of a
process of one BLAS thread whose libraries are loaded, from a trimmed heap; n = 512..8,192,
d = 64..4,096, m = 1,024 and 4,096): 50–97% of the formula, 72–97% with n ≤ m, 89–97% at the
default sample of MiniLM (n = m = 4,096, d = 384).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from .units import gib

#: every k ≤ this is seeded by k-means++ chains
#: (:data:`~embgeom_ray.core.kmeans_selection.K_DENSE`)
K_DENSE = 15
#: bootstrap resamples of the K-means decision's support
#: (:data:`~embgeom_ray.core.kmeans_selection.SUPPORT_RESAMPLES`)
SUPPORT_RESAMPLES = 200
#: distances a silhouette's sums by label take at once
#: (:func:`~embgeom_ray.core.kmeans_selection.silhouette_from_distances`)
SILHOUETTE_BLOCK = 1 << 20


def scan_width(k_max: int, n: int) -> int:
    """W: Σ of the k a layer's scan fits (:func:`~embgeom_ray.core.kmeans_selection.scan_ks`
    up to min(k_max, n − 1)), the silhouettes' indicator columns."""
    from ..core.kmeans_selection import scan_ks

    return sum(scan_ks(min(int(k_max), int(n) - 1)))


def seedings(k_max: int, n_init: int | None) -> int:
    """F: the seedings and warm starts per k (``--kmeans-n-init``, else
    :func:`~embgeom_ray.core.kmeans_selection.default_n_init` of a one-process fit)."""
    from ..core.kmeans_selection import default_n_init

    return int(n_init) if n_init is not None else default_n_init(int(k_max), True)


def kmeans_task_terms(
    n: int, d: int, m: int | None, k_max: int, n_init: int | None = None
) -> dict[str, int]:
    """The terms of :func:`kmeans_task_bytes` (module docstring): ``matrices`` (the n × n or
    m × m ones), ``silhouettes`` (their indicators and sums), ``points``, ``warm`` (the warm
    starts), ``seedings`` (the cold fits of every k ≤ 15) and ``support``."""
    from ..core.kmeans_selection import LOCAL_FIT_MAX_ELEMENTS

    s = n if m is None else min(n, m)
    gram = n * d <= LOCAL_FIT_MAX_ELEMENTS and s == n
    F = seedings(k_max, n_init)
    dense = sum(range(2, min(K_DENSE, n - 1) + 1))
    return {
        "matrices": 20 * n * n if gram else 12 * s * s,
        "silhouettes": 8 * s * scan_width(k_max, n),
        "points": 40 * n * d,
        # from the Gram matrix, (F, k_max + 1, n) float64 products, distances and a gathered
        # block; without it, cold fits' (F, n, k_max) float32 distances and products
        "warm": 24 * F * (k_max + 1) * n if gram else 8 * (F + 1) * (k_max + 1) * n,
        "seedings": 4 * F * n * dense + 8 * F * n * (K_DENSE - 1),
        "support": 8 * SUPPORT_RESAMPLES * n,
    }


def kmeans_task_bytes(n: int, d: int, m: int | None, k_max: int, n_init: int | None = None) -> int:
    """What a layer's K-means selection task holds at its peak for n points of dimension d
    (module docstring; ``m`` None: no subsample)."""
    return sum(kmeans_task_terms(n, d, m, k_max, n_init).values())


def metrics_task_terms(
    n: int, d: int, m: int | None, lid_k: int, own_distances: bool
) -> dict[str, int]:
    """The terms of :func:`metrics_task_bytes` (module docstring): ``matrices``,
    ``silhouette_blocks`` (the sums by label's scratch), ``points``, ``neighbours`` (the
    two tables) and ``isotropy``."""
    from ..core.neighbours import BLOCK_BYTES

    s = n if m is None else min(n, m)
    matrices = 20 * s * s + (8 * n * n if own_distances and s == n else 0)
    if s < n:  # the neighbour tables' Euclidean and chord distances, a block of rows at a time
        matrices += 2 * min(8 * n * n, BLOCK_BYTES)
    return {
        "matrices": matrices,
        "silhouette_blocks": 16 * min(s * s, SILHOUETTE_BLOCK),
        "points": (40 if s == n else 64) * n * d,
        "neighbours": 96 * (lid_k + 1) * n,
        # IsoScore's and the partition isotropies' min(n, d)² Gram or covariance matrix, its
        # eigenvectors and LAPACK's copy
        "isotropy": 24 * min(n, d) ** 2,
    }


def metrics_task_bytes(n: int, d: int, m: int | None, lid_k: int, own_distances: bool) -> int:
    """What a layer's sampled-metrics task holds at its peak for n points of dimension d
    (module docstring); ``own_distances``: it computes the n × n distances itself."""
    return sum(metrics_task_terms(n, d, m, lid_k, own_distances).values())


#: a fit-share task's small arrays beside its points and fits (Lloyd's, the unpickling's):
#: 1–3 MiB measured at n = 2,048..8,192
SHARE_BASE_BYTES = 4 << 20


def share_task_bytes(n: int, d: int, ks: Sequence[int]) -> int:
    """What a fit-share task of :class:`~embgeom_ray.distributed.kmeans.RayFits` holds at its
    peak for n points of dimension d fitting one start of each k of ``ks`` (module
    docstring): 12·n·d + Σ_k (8·n·k + 8·n) + :data:`SHARE_BASE_BYTES`."""
    return 12 * n * d + sum(8 * n * int(k) + 8 * n for k in ks) + SHARE_BASE_BYTES


def share_step_bytes(n: int, d: int, k_max: int, n_init: int | None, stability_seeds: int) -> int:
    """The most one fit-share task holds: its group at most the whole step's fits, the
    seedings of every k ≤ 15 (F of each) or the S stability refits at the chosen k ≤ k_max."""
    F = seedings(k_max, n_init)
    dense = [k for k in range(2, min(K_DENSE, n - 1) + 1) for _ in range(F)]
    refits = [min(int(k_max), n - 1)] * int(stability_seeds)
    return max(share_task_bytes(n, d, dense), share_task_bytes(n, d, refits))


@dataclass(frozen=True)
class SampledTasks:
    """The sampled stage's per-layer tasks for a layer of n uniform points of dimension d: what
    each asks Ray for (:func:`kmeans_task_bytes`, :func:`metrics_task_bytes`)."""

    n: int
    d: int
    m: int | None
    k_max: int
    n_init: int | None
    lid_k: int
    own_distances: bool = False

    @property
    def kmeans(self) -> int:
        return kmeans_task_bytes(self.n, self.d, self.m, self.k_max, self.n_init)

    @property
    def metrics(self) -> int:
        return metrics_task_bytes(self.n, self.d, self.m, self.lid_k, self.own_distances)

    @property
    def largest(self) -> int:
        return max(self.kmeans, self.metrics)

    def with_m(self, m: int) -> SampledTasks:
        return replace(self, m=m)

    def fitting_m(self, memory: int, least: int = 10) -> int | None:
        """The largest ``--silhouette-max-points`` (≥ ``least``, ≤ m) whose tasks fit in
        ``memory`` bytes; None where none does (the points alone are too many)."""
        high = min(self.n if self.m is None else self.m, self.n)
        if self.with_m(least).largest > memory:
            return None
        low = least
        while low < high:  # the bytes grow with m
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.with_m(mid).largest <= memory else (low, mid - 1)
        return low

    def refusal(self, most: int, where: str, drawn: bool = False) -> str | None:
        """The one line refusing these tasks where the node they may run on offers Ray
        ``most`` bytes; None where they fit. ``drawn``: n is the layer's uniform points as
        drawn (the stage's), else ``--sample-size``, the most it can be (the plan's); the
        line says which."""
        if self.largest <= most:
            return None
        which = "K-means" if self.kmeans >= self.metrics else "metrics"
        which_n = "drawn" if drawn else "(--sample-size, the most a layer can hold)"
        m = self.fitting_m(most)
        fix = (f"lower --silhouette-max-points (at most {m:,} fits) or --sample-size" if m
               else "lower --sample-size (its points alone do not fit)")  # fmt: skip
        return (
            f"the sampled stage's per-layer {which} tasks need ≈ {gib(self.largest)} each at "
            f"their peak (n = {self.n:,} points {which_n} of d = {self.d:,}, n × n distances for n ≤ "
            f"--silhouette-max-points = {self.m or self.n:,}: docs/sizing.md), more than the "
            f"{gib(most)} of Ray memory of {where}; {fix}"
        )
