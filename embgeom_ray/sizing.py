"""How much memory every process of a job takes, and how many of each: the job sizes itself.

Engine-free: the formulas in L, V, d, P and the corpus, and the decisions made from them, an
option a user gave (which always wins) and a view of the cluster (:class:`Cluster`, read from
Ray by :func:`embgeom_ray.distributed.cluster.read_cluster`). The pipeline only calls
:func:`size_job` before any work and :func:`size_reduce` once the types seen are known; what
cannot fit is refused here, with the option that fixes it (:class:`~embgeom_ray.errors.ConfigError`).
docs/sizing.md states the policy and every formula.

Notation (bytes; numbers are float64 or int64, 8 bytes): L measured layers, d hidden size,
P positions (``--max-length``), V token types (V_seen: those the corpus holds), c clipped
dimensions, s the sample's entries (``--sample-size`` + ``--sample-type-size``), w the
weights' bytes, B batch tokens.

- per-type state S(V) = 8 · L · V · (2d + 2) + 8 · V  (+ 8 · L · V · d with ``--clip-dims``)
- per-layer state F = 8 · L · (d² + 3d + P · (d + 1) + 2)
- sample Q = 4 · L · s · d + 48 · s
- a type's rows r = 8 · L · (2d + 2) + 8 (+ 8 · L · d)

Processes:

- **driver** (the job's own process): above its memory at the start, what it adds whatever the
  statistics (:data:`DRIVER_RUN_BYTES`: Ray's core worker, the libraries of the sampled
  metrics and the report), one layer's state 8 · (d² + P·d + 3d) at a time, the
  ``type_stats`` rows (:data:`TYPE_ROW_BYTES` each, L · V of them) and two samples (merged and
  being merged): :func:`driver_bytes`; when it reduces the statistics itself,
  :data:`DRIVER_REDUCE_FACTOR` · (S(V) + F) instead of the layer's state. It reduces them
  itself only while all that is within :data:`DRIVER_ALLOWANCE_BYTES`.
- **extractor**: :data:`EXTRACTOR_BASE_BYTES` + w + B · b_tok + 2 · Q + 2 · (σ + g), σ its
  statistics budget, g = min(B, V) · r one batch's new types beyond it, b_tok the batch's bytes
  per token on a CPU (:func:`batch_bytes_per_token`): :func:`extractor_bytes`.
- **reducer** r of R: :data:`REDUCER_BASE_BYTES` + :data:`REDUCER_MERGE_FACTOR` · (its
  ⌈V/R⌉ types' rows + the state of its ⌈L/R⌉ layers): :func:`reducer_budget`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .core.statistics import state_bytes
from .errors import ConfigError

KiB, MiB, GiB = 2**10, 2**20, 2**30

#: what the job's own process may hold above its memory at the start, whatever V · d: it
#: reduces the statistics itself only within this, else on reducer actors
DRIVER_ALLOWANCE_BYTES = 1 * GiB
#: the driver's memory at the start (Python, torch, transformers, pandas, pyarrow): 0.23 GiB
#: measured; kept off what the head node offers actors, with what it may add
DRIVER_BASE_BYTES = 512 * MiB
#: what the driver adds to its start while it runs, whatever the statistics: Ray's core
#: worker, the libraries and arrays of the sampled metrics and the report (0.38–0.57 GiB
#: measured on jobs whose statistics were 23–549 MiB)
DRIVER_RUN_BYTES = 512 * MiB
#: a driver reducing the statistics itself peaks at this many times S(V) + F (the merged
#: statistics, a checkpoint group being merged, the tables; 2.9–2.95 measured, bench.vocabulary)
DRIVER_REDUCE_FACTOR = 3
#: bytes of one ``type_stats`` row as the driver builds the table (eight numbers and the
#: token's string in pandas)
TYPE_ROW_BYTES = 160
#: a reducer process's own memory before it holds any statistics (Python, torch, pyarrow, Ray's
#: worker): 0.2–0.45 GiB private measured, counted in every budget
REDUCER_BASE_BYTES = 512 * MiB
#: a reducer peaks at this many times what it holds while it merges a group's part into its
#: own (its rows, the part read, one field's copy while its arrays grow): 2.5 measured over
#: one checkpoint group, 3.0 over seven
REDUCER_MERGE_FACTOR = 3
#: an extractor process's own memory besides the weights (Python, torch, transformers, the
#: tokenizer, Ray's worker, the tokenized pool): 0.2–0.3 GiB measured
EXTRACTOR_BASE_BYTES = 512 * MiB
#: a self-sized reducer asks for at most this share of the largest node's offer, so that a
#: node holds two and the reduce is spread over the cluster
REDUCER_NODE_SHARE = 0.5
#: reducers start while the extractors run (their processes and imports ready for the
#: reduce, ~5 s saved) only for corpora of at least this many bytes, whose extraction takes
#: minutes; for smaller ones the start would cost more than it saves
EARLY_REDUCERS_MIN_BYTES = 64 * MiB
#: self-sized ``--gpus-per-worker``: the fewest GPUs of one node whose memory holds the
#: weights in this share (the rest: the batch's activations and the statistics)
GPU_WEIGHT_SHARE = 0.5

#: ``--batch-tokens`` when it is not given: on CPUs, and the least on a GPU
DEFAULT_BATCH_TOKENS = 8192
#: the most padded tokens a batch gets on a GPU without ``--batch-tokens``
GPU_BATCH_TOKENS_MAX = 65_536
#: the device memory one batch may take on a GPU without ``--batch-tokens`` (or half the
#: memory left free once the model is loaded, if that is less)
GPU_BATCH_BYTES = 8 * GiB
#: bytes of the fold's scratch per kept token and hidden dimension, at most: the kept rows
#: (model dtype) and three float64/float32 copies (22 bytes with a bf16 model, 24 with
#: float32), plus ≤ 40 bytes of per-type sums and merge scratch (a batch of n tokens holds
#: u ≤ n types); see docs/design.md, Memory
FOLD_BYTES_PER_TOKEN_DIM = 64
#: of a GPU's memory left once the model and a batch are placed, the share an extractor's
#: statistics may take (the allocator's fragmentation and CUDA's own take the rest)
GPU_STATISTICS_SHARE = 0.8

#: the memory of one GPU by Ray's accelerator type (the node's ``accelerator_type:…``
#: resource), the smallest model sold under the name (bytes)
GPU_MEMORY_BY_TYPE: dict[str, int] = {
    "V100": 16 * 10**9, "P100": 16 * 10**9, "T4": 16 * 10**9, "P4": 8 * 10**9,
    "K80": 12 * 10**9, "A10G": 24 * 10**9, "L4": 24 * 10**9, "L40S": 48 * 10**9,
    "A100": 40 * 10**9, "A100-40G": 40 * 10**9, "A100-80G": 80 * 10**9,
    "H100": 80 * 10**9, "H200": 141 * 10**9, "H20": 96 * 10**9, "B200": 180 * 10**9,
}  # fmt: skip


def gib(n: float | None) -> str:
    """``n`` bytes in GiB (MiB below 1 GiB), for messages and the plan."""
    if n is None:
        return "unbounded"
    if abs(n) < KiB:
        return f"{n:,.0f} B"
    if abs(n) < MiB:
        return f"{n / KiB:,.0f} KiB"
    if abs(n) < GiB:
        return f"{n / MiB:,.0f} MiB"
    return f"{n / GiB:,.1f} GiB"


# ------------------------------------------------------------------------------------ shapes


@dataclass(frozen=True)
class Shape:
    """What the memory of a run's processes depends on: the model, the layers measured, the
    windows and the sample (module docstring's notation)."""

    #: L: the layers measured
    layers: int
    #: d
    dim: int
    #: P: ``--max-length``
    positions: int
    #: the tokenizer's entries (the most types a corpus can hold)
    vocab: int
    #: c: clipped dimensions (0 without ``--clip-dims``)
    clip: int = 0
    #: s: ``--sample-size`` + ``--sample-type-size`` (0: no sample)
    sample_entries: int = 0
    #: hidden states the forward returns: the model's blocks + 1
    hidden_states: int = 0
    #: the feed-forward's width d_ff
    intermediate: int = 0
    #: attention heads
    heads: int = 0
    #: w: the weights' bytes in the run's dtype
    weight_bytes: int = 0
    #: bytes of one number in the model's dtype
    dtype_bytes: int = 4
    #: the model's name, for the plan
    name: str = ""

    def type_bytes(self, types: int) -> int:
        """S(V): the per-type rows of ``types`` types in every measured layer."""
        return state_bytes(self.layers, self.dim, types, 0, self.clip) - state_bytes(
            self.layers, self.dim, 0, 0
        )

    def layer_state_bytes(self, layers: int | None = None) -> int:
        """F: the per-layer state (n, μ, co-moment, tails, positions) of ``layers`` layers."""
        return state_bytes(self.layers if layers is None else layers, self.dim, 0, self.positions)

    def statistics_bytes(self, types: int) -> int:
        """S(V) + F: the whole statistics (the artefact's size)."""
        return self.type_bytes(types) + self.layer_state_bytes()

    @property
    def row_bytes(self) -> int:
        """r: one type's rows in every measured layer."""
        return self.type_bytes(1)

    @property
    def sample_bytes(self) -> int:
        """Q: the sample, 4 · L · s · d float32 numbers and six int64 per entry."""
        return 4 * self.layers * self.sample_entries * self.dim + 48 * self.sample_entries

    def with_layers(self, layers: int) -> Shape:
        return replace(self, layers=layers)


def run_shape(
    model_config: Any,
    *,
    layers: int,
    positions: int,
    vocab: int,
    clip: int,
    sample_entries: int,
    weight_bytes: int,
    dtype: str,
    name: str = "",
) -> Shape:
    """The :class:`Shape` of a run from the model's (text) config, read for its blocks,
    feed-forward width and heads, and the run's options."""
    def attr(*names: str) -> int:
        return next((int(getattr(model_config, n)) for n in names
                     if getattr(model_config, n, None)), 0)  # fmt: skip

    dim = attr("hidden_size", "n_embd", "d_model")
    return Shape(
        layers=layers,
        dim=dim,
        positions=positions,
        vocab=vocab,
        clip=clip,
        sample_entries=sample_entries,
        hidden_states=attr("num_hidden_layers", "n_layer", "num_layers") + 1,
        intermediate=attr("intermediate_size", "n_inner", "ffn_dim") or 4 * dim,
        heads=attr("num_attention_heads", "n_head"),
        weight_bytes=weight_bytes,
        dtype_bytes={"float32": 4, "bfloat16": 2, "float16": 2}[dtype],
        name=name,
    )


def types_bound(vocab: int, text_bytes: int | None, special: int = 0) -> tuple[int, str]:
    """V_seen before the corpus is read: at most the tokenizer's entries, and at most one type
    per byte of plain text (every token but a special one stands for at least one byte of
    text; ``special``: the special ids counted with ``--keep-special``, and one for a
    SentencePiece prefix); the bound and why."""
    if text_bytes is not None and text_bytes + special + 1 < vocab:
        bound = text_bytes + special + 1
        return bound, (
            f"V_seen ≤ {bound:,}: the corpus's {text_bytes:,} bytes of plain text hold at most "
            "one type per byte (the tokenizer has "
            f"{vocab:,} entries)"
        )
    return vocab, (
        f"V_seen ≤ V = {vocab:,}, the tokenizer's entries (assumed all seen: the corpus is not "
        "read before the run)"
    )


@dataclass(frozen=True)
class Node:
    """One live node as Ray reports it."""

    node_id: str
    #: Ray's ``memory`` resource: what actors and tasks may reserve
    memory: int
    cpus: int = 0
    gpus: int = 0
    head: bool = False
    #: Ray's accelerator type of its GPUs (``accelerator_type:H100`` → ``H100``)
    gpu_type: str | None = None

    @property
    def gpu_memory(self) -> int | None:
        """One GPU's memory, from :data:`GPU_MEMORY_BY_TYPE` (None: unknown)."""
        return GPU_MEMORY_BY_TYPE.get(self.gpu_type or "")


@dataclass(frozen=True)
class Cluster:
    """The live nodes of the cluster (:func:`~embgeom_ray.distributed.cluster.read_cluster`)."""

    nodes: tuple[Node, ...]

    @property
    def cpus(self) -> int:
        return sum(n.cpus for n in self.nodes)

    @property
    def gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    def offers(self, driver: int) -> list[int]:
        """The memory each node offers the job's actors: Ray's ``memory`` resource, on the head
        node less ``driver`` (the job's own process lives there, outside Ray's accounting)."""
        return [max(0, n.memory - (driver if n.head else 0)) for n in self.nodes]

    def describe(self) -> str:
        heads = sum(n.head for n in self.nodes)
        gpu_types = sorted({n.gpu_type for n in self.nodes if n.gpus and n.gpu_type})
        gpus = f", {self.gpus} GPUs" + (f" ({', '.join(gpu_types)})" if gpu_types else "")
        memory = sorted({n.memory for n in self.nodes})
        each = gib(memory[0]) if len(memory) == 1 else f"{gib(memory[0])}–{gib(memory[-1])}"
        return (
            f"{len(self.nodes)} node{'s' if len(self.nodes) != 1 else ''} "
            f"({heads} head), {self.cpus} CPUs{gpus if self.gpus else ''}, Ray memory {each} "
            f"a node"
        )


# ----------------------------------------------------------------------------------- formulas


def batch_bytes_per_token(
    hidden_states: int, dim: int, intermediate: int, dtype_bytes: int, scores: int = 0
) -> int:
    """A batch's memory per padded token, beyond the model's weights: every hidden state the
    forward returns ((L + 1) · d values in the model's dtype), the fold's scratch
    (:data:`FOLD_BYTES_PER_TOKEN_DIM` · d), the feed-forward's intermediate activations
    (three of ``intermediate`` values: gate, up and their product in gated MLPs) and one
    layer's attention scores (``scores`` = heads × window length values a token, where the
    attention implementation materialises them; fused attention does not):
    ((L + 1) · d + 3 · d_ff + heads · T) · b + 64 · d bytes."""
    values = hidden_states * dim + 3 * intermediate + scores
    return values * dtype_bytes + FOLD_BYTES_PER_TOKEN_DIM * dim


def default_batch_tokens(per_token_bytes: int, free_bytes: int | None) -> int:
    """``--batch-tokens`` when it is not given: :data:`DEFAULT_BATCH_TOKENS` on a CPU
    (``free_bytes`` None); on a GPU as many tokens as :data:`GPU_BATCH_BYTES` (or half of
    ``free_bytes``, the memory left once the model is loaded, if less) hold at
    ``per_token_bytes`` each, in multiples of 1,024, between :data:`DEFAULT_BATCH_TOKENS` and
    :data:`GPU_BATCH_TOKENS_MAX`.

    Why: a GPU folds the hidden states with some ninety kernels per layer and batch, whose
    launch cost (~1.5 ms) does not depend on the batch's size; at 8,192 tokens it is most of
    the fold for d ≤ 768 and about half at d = 2,048 (H200, bf16: the extractor at 0.45–0.49
    of the bare forward for MiniLM, 0.66–0.71 at 65,536 tokens). The statistics and the
    sample do not depend on the batching (``--batch-tokens`` is a scheduling option)."""
    if free_bytes is None:
        return DEFAULT_BATCH_TOKENS
    budget = min(GPU_BATCH_BYTES, free_bytes // 2)
    tokens = budget // max(per_token_bytes, 1) // 1024 * 1024
    return int(min(GPU_BATCH_TOKENS_MAX, max(DEFAULT_BATCH_TOKENS, tokens)))


def shape_batch_bytes_per_token(shape: Shape) -> int:
    """:func:`batch_bytes_per_token` of ``shape`` (scores of every head over P positions)."""
    return batch_bytes_per_token(
        shape.hidden_states or shape.layers,
        shape.dim,
        shape.intermediate or 4 * shape.dim,
        shape.dtype_bytes,
        shape.heads * shape.positions,
    )


def gpu_budgets(
    shape: Shape, free_bytes: int, batch_tokens: int | None, host_statistics: int | None
) -> tuple[int, int | None]:
    """An extractor's batch tokens and statistics budget on a GPU with ``free_bytes`` left
    once the model is loaded: the batch first (``batch_tokens``, or
    :func:`default_batch_tokens`), then the statistics get :data:`GPU_STATISTICS_SHARE` of
    what the batch leaves, and no more than ``host_statistics`` (what the host's
    ``--worker-memory`` holds of their serialised copies; None: no bound there)."""
    per_token = shape_batch_bytes_per_token(shape)
    tokens = batch_tokens or default_batch_tokens(per_token, free_bytes)
    on_gpu = int(GPU_STATISTICS_SHARE * max(0, free_bytes - tokens * per_token))
    budget = on_gpu if host_statistics is None else min(on_gpu, host_statistics)
    if budget >= shape.statistics_bytes(shape.vocab):
        return tokens, None  # every type of the vocabulary fits: no bound needed
    return tokens, budget


def extractor_own_bytes(shape: Shape, batch_tokens: int, gpus: int) -> int:
    """What an extractor holds besides its statistics and their serialised copy:
    :data:`EXTRACTOR_BASE_BYTES` + w (the weights, on the host while they load; over N > 1
    GPUs accelerate's device map places them one GPU's share, w / N, at a time) + B · b_tok
    (a CPU batch's activations; on a GPU they are in device memory) + 2 · Q (the sample and
    its serialised copy at a flush)."""
    batch = 0 if gpus else batch_tokens * shape_batch_bytes_per_token(shape)
    weights = shape.weight_bytes // max(gpus, 1)
    return EXTRACTOR_BASE_BYTES + weights + batch + 2 * shape.sample_bytes


def batch_growth_bytes(shape: Shape, types: int, batch_tokens: int) -> int:
    """g = min(B, V) · r: one batch's new types beyond the statistics budget (the budget is
    checked after every batch)."""
    return min(batch_tokens, types) * shape.row_bytes


def extractor_bytes(
    shape: Shape, types: int, batch_tokens: int, statistics: int | None, gpus: int = 0
) -> int:
    """An extractor's memory (host, private): :func:`extractor_own_bytes` + 2 · (σ + g), σ its
    statistics budget (None: the whole S(V) + F) and one serialised copy of them. On a GPU the
    statistics are in device memory; the host holds their serialised copies."""
    held = shape.statistics_bytes(types) if statistics is None else statistics
    growth = 0 if statistics is None else batch_growth_bytes(shape, types, batch_tokens)
    return extractor_own_bytes(shape, batch_tokens, gpus) + 2 * (held + growth)


def statistics_for(
    shape: Shape, types: int, batch_tokens: int, memory: int, gpus: int = 0
) -> int:
    """The largest statistics budget σ an extractor of ``memory`` bytes holds
    (:func:`extractor_bytes` solved for σ)."""
    own = extractor_own_bytes(shape, batch_tokens, gpus)
    return (memory - own) // 2 - batch_growth_bytes(shape, types, batch_tokens)


def reducer_bytes(
    reducers: int, layers: int, dim: int, types: int, positions: int, clip: int = 0
) -> int:
    """What the largest of ``reducers`` reducers holds: its share of the per-type rows,
    ⌈types / R⌉ of them (:func:`~embgeom_ray.core.statistics.state_bytes` of the types alone),
    and the per-layer state of its ⌈L / R⌉ layers."""
    share = math.ceil(types / reducers)
    rows = state_bytes(layers, dim, share, 0, clip) - state_bytes(layers, dim, 0, 0)
    return rows + state_bytes(math.ceil(layers / reducers), dim, 0, positions)


def reducer_budget(
    reducers: int, layers: int, dim: int, types: int, positions: int, clip: int = 0
) -> int:
    """The memory the largest of ``reducers`` reducers needs: :data:`REDUCER_BASE_BYTES` plus
    :data:`REDUCER_MERGE_FACTOR` times what it holds (:func:`reducer_bytes`)."""
    held = reducer_bytes(reducers, layers, dim, types, positions, clip)
    return REDUCER_BASE_BYTES + math.ceil(REDUCER_MERGE_FACTOR * held)


def reducers_for(
    budget: int, layers: int, dim: int, types: int, positions: int, clip: int = 0
) -> int:
    """The fewest reducers whose largest needs at most ``budget`` bytes (:func:`reducer_budget`).
    Raises :class:`ConfigError` when even one layer's state per reducer needs more than that."""
    most = max(types, layers, 1)  # one type and one layer each: no cut holds less
    low, high = 1, most
    if reducer_budget(most, layers, dim, types, positions, clip) > budget:
        need = reducer_budget(most, layers, dim, types, positions, clip)
        raise ConfigError(
            f"--reducer-memory {budget:,} bytes cannot hold a reducer's part: one layer's "
            f"state alone needs {need:,} bytes: the process's own {REDUCER_BASE_BYTES // MiB} "
            f"MiB and {REDUCER_MERGE_FACTOR:g} · 8·(d² + 3d + P·(d+1) + 2) for d = {dim}, "
            f"P = {positions} (the merge's headroom); give at least that"
        )
    while low < high:  # reducer_budget falls as R grows
        mid = (low + high) // 2
        if reducer_budget(mid, layers, dim, types, positions, clip) <= budget:
            high = mid
        else:
            low = mid + 1
    return low


def shape_reducer_budget(shape: Shape, reducers: int, types: int) -> int:
    return reducer_budget(reducers, shape.layers, shape.dim, types, shape.positions, shape.clip)


def driver_bytes(shape: Shape, types: int, in_process: bool) -> int:
    """The driver's memory above its start: :data:`DRIVER_RUN_BYTES`; reducing in process
    :data:`DRIVER_REDUCE_FACTOR` · (S(V) + F), else one layer's state 8 · (d² + P·d + 3d)
    fetched at a time; the ``type_stats`` rows (L · V of :data:`TYPE_ROW_BYTES`) and two
    samples (2 · Q)."""
    d, p = shape.dim, shape.positions
    reduce = (
        DRIVER_REDUCE_FACTOR * shape.statistics_bytes(types)
        if in_process
        else 8 * (d * d + p * d + 3 * d)
    )
    rows = shape.layers * types * TYPE_ROW_BYTES
    return DRIVER_RUN_BYTES + reduce + rows + 2 * shape.sample_bytes


def driver_formula(in_process: bool) -> str:
    reduce = (
        f"{DRIVER_REDUCE_FACTOR} · (S(V) + F)" if in_process else "one layer's state 8·(d² + P·d + 3d)"
    )
    return (
        f"{gib(DRIVER_RUN_BYTES)} (Ray, the metrics' and report's libraries) + {reduce} + L · V "
        f"type_stats rows of {TYPE_ROW_BYTES} B + 2 · sample"
    )


def fits(count: int, each: int, offers: Sequence[int], taken: Sequence[int] = ()) -> bool:
    """Whether ``count`` actors of ``each`` bytes fit the nodes' ``offers`` (less ``taken``
    there already), each actor on one node."""
    room = [o - (taken[i] if i < len(taken) else 0) for i, o in enumerate(offers)]
    return (each > 0 and sum(max(0, r) // each for r in room) >= count) or count == 0


# ------------------------------------------------------------------------------------ decisions


@dataclass
class Pool:
    """The extractor actors: how many, what each asks Ray for, and what each may hold."""

    num_workers: int
    num_cpus: int
    num_gpus: float
    #: bytes of memory each asks Ray for and stays within (``--worker-memory``)
    memory: int
    #: bytes its running statistics may hold before they spill (None: no bound needed; on a
    #: GPU the actor lowers it to what its device holds)
    statistics: int | None
    #: padded tokens per batch (None: decided on each GPU once the model is loaded)
    batch_tokens: int | None
    formula: str
    reason: str


@dataclass
class Reduce:
    """Where the statistics are reduced: in the job's process (``count`` 0) or on ``count``
    reducer actors of ``memory`` bytes each."""

    count: int
    memory: int | None
    types: int
    formula: str
    reason: str
    #: reducers started while the extractors run (their processes ready for the reduce)
    early: int = 0
    #: the node each reducer is placed on (:func:`place`), and each early one
    nodes: list[str] = field(default_factory=list)
    early_nodes: list[str] = field(default_factory=list)

    @property
    def partitioned(self) -> bool:
        return self.count > 0

    def describe(self) -> str:
        """One line: where the reduce runs, and why."""
        if not self.partitioned:
            return f"reduce in the job's own process: {self.reason}"
        early = f"; {self.early} started with the extractors" if self.early else ""
        return f"reducers: {self.count} × {gib(self.memory)}: {self.reason}{early}"


@dataclass
class Sizing:
    """Every decision of a run, made before any work (:func:`size_job`), with its reason."""

    shape: Shape
    cluster: Cluster
    types: int
    types_reason: str
    pool: Pool
    reduce: Reduce
    driver: int
    driver_formula: str
    extras: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The manifest's ``sizing`` (what ``--plan`` prints, as numbers)."""
        return {
            "types_bound": self.types,
            "types_reason": self.types_reason,
            "extractors": asdict(self.pool),
            "reducers": asdict(self.reduce),
            "driver_bytes": self.driver,
            "driver_formula": self.driver_formula,
            **self.extras,
        }

    def lines(self) -> list[str]:
        """The decisions, one line each, printed once when the job starts."""
        p = self.pool
        gpus = f", {p.num_gpus:g} GPU{'s' if p.num_gpus != 1 else ''}" if p.num_gpus else ""
        batch = "decided on its GPU" if p.batch_tokens is None else f"{p.batch_tokens:,}"
        stats = "the whole state" if p.statistics is None else gib(p.statistics)
        out = [
            f"sizing: {self.types_reason}",
            f"sizing: extractors: {p.num_workers} × ({p.num_cpus} CPU{gpus}) × {gib(p.memory)}"
            f" (statistics ≤ {stats}, batch {batch} tokens): {p.reason}",
        ]
        out.append(f"sizing: {self.reduce.describe()}")
        out.append(f"sizing: job's own process ≤ {gib(self.driver)} above its start: "
                   f"{self.driver_formula}")  # fmt: skip
        if self.driver > DRIVER_ALLOWANCE_BYTES:
            out.append(f"sizing: warning: {self.driver_warning()}")
        return out

    def driver_warning(self) -> str:
        """Why the job's own process needs more than :data:`DRIVER_ALLOWANCE_BYTES`."""
        shape = self.shape
        return (
            f"the job's own process needs {gib(self.driver)} above its start, more than "
            f"{gib(DRIVER_ALLOWANCE_BYTES)}: the sample (2 · Q = "
            f"{gib(2 * shape.sample_bytes)}) and the type_stats rows "
            f"({gib(shape.layers * self.types * TYPE_ROW_BYTES)}) are held there; "
            "--sample-size, --sample-type-size and --layers lower them"
        )


def plan_pool(
    cluster: Cluster,
    shape: Shape,
    *,
    device: str,
    num_shards: int,
    num_workers: int | None = None,
    cpus_per_worker: int | None = None,
    gpus_per_worker: int | None = None,
) -> tuple[int, int, int]:
    """(actors, CPUs each, GPUs each): one actor per ``--gpus-per-worker`` GPUs of a node (self
    sized: the fewest GPUs of one node whose memory holds the weights in
    :data:`GPU_WEIGHT_SHARE`, 1 where Ray's accelerator type does not give the GPU's memory),
    else CPU actors of ``--cpus-per-worker`` CPUs (default min(4, the largest node's CPUs)).

    With ``--device cuda`` GPU actors are asked for even if the cluster shows no GPU yet, so
    an autoscaling cluster whose GPU workers start at 0 adds them (``--num-workers`` of them,
    default 1 until GPUs are visible).
    """
    alive = cluster.nodes
    cpus = max(cluster.cpus, 1)
    largest = max([n.cpus for n in alive if n.cpus > 0], default=cpus)
    if device == "cuda" or (cluster.gpus and device == "auto"):
        most = max((n.gpus for n in alive), default=0)
        per_gpu = gpus_per_worker or gpus_for_weights(cluster, shape)
        if cluster.gpus and per_gpu > most:
            raise ConfigError(
                f"--gpus-per-worker {per_gpu} exceeds the GPUs of the largest node ({most}); "
                "an extractor actor, and the model it loads, lives on one node"
            )
        fit = sum(n.gpus // per_gpu for n in alive)
        n = num_workers or max(fit, 1)
        return min(n, num_shards), per_gpu, cpus_per_worker or 1
    if (gpus_per_worker or 1) > 1:
        raise ConfigError(
            f"--gpus-per-worker {gpus_per_worker} needs GPUs, but the cluster has none and "
            f"--device is {device}"
        )
    if num_workers:
        per = cpus_per_worker or max(1, min(largest, cpus // num_workers))
        n = num_workers
    else:
        per = cpus_per_worker or min(4, largest)
        n = max(1, cpus // per)
    if per > largest:
        raise ConfigError(
            f"--cpus-per-worker {per} exceeds the CPUs of the largest node ({largest}); "
            "an extractor actor runs on one node"
        )
    return max(1, min(n, num_shards)), 0, per


def gpus_for_weights(cluster: Cluster, shape: Shape) -> int:
    """The fewest GPUs of one node whose memory holds the weights in
    :data:`GPU_WEIGHT_SHARE`; all of the largest node's when none is enough (the device map
    then decides, and refuses weights beyond 90% of them); 1 when the GPUs' memory is unknown."""
    gpu_nodes = [n for n in cluster.nodes if n.gpus and n.gpu_memory]
    if not gpu_nodes or not shape.weight_bytes:
        return 1
    node = max(gpu_nodes, key=lambda n: n.gpus * (n.gpu_memory or 0))
    per = node.gpu_memory or 1
    need = math.ceil(shape.weight_bytes / (GPU_WEIGHT_SHARE * per))
    return max(1, min(need, node.gpus))


def _hosts(cluster: Cluster, cpus: int, gpus: int) -> list[int]:
    """How many extractors of ``cpus`` CPUs and ``gpus`` GPUs each node holds."""
    out = []
    for n in cluster.nodes:
        by_cpu = n.cpus // cpus if cpus else 10**9
        by_gpu = n.gpus // gpus if gpus else 10**9
        out.append(min(by_cpu, by_gpu))
    return out


def slot_memory(count: int, hosts: Sequence[int], offers: Sequence[int]) -> int:
    """The most memory each of ``count`` actors may ask for with all of them placed at once,
    node n holding at most ``hosts[n]`` (by its CPUs and GPUs) and ``offers[n]`` bytes: the
    ``count``-th largest of the shares offer_n / j, j = 1..hosts[n] (0 when they do not fit)."""
    shares = sorted(
        (o // j for o, h in zip(offers, hosts, strict=True) for j in range(1, min(h, count) + 1)),
        reverse=True,
    )
    return shares[count - 1] if 0 < count <= len(shares) else 0


def size_extractors(
    shape: Shape,
    types: int,
    cluster: Cluster,
    options: Any,
    num_shards: int,
    driver: int,
) -> Pool:
    """The extractor pool and each actor's memory (``--worker-memory``) and statistics budget
    (``--statistics-memory``); explicit options win. Otherwise each actor asks for what its
    statistics need unbounded, or, where the nodes do not hold that many of those, the most
    that lets the whole pool be placed at once (:func:`slot_memory`), its statistics bounded
    by what is left of it; a pool the nodes' memory cannot hold at the least an extractor
    needs is made smaller (not below one) unless ``--num-workers`` names it."""
    count, gpus, cpus = plan_pool(
        cluster, shape, device=options.device, num_shards=num_shards,
        num_workers=options.num_workers, cpus_per_worker=options.cpus_per_worker,
        gpus_per_worker=options.gpus_per_worker,
    )  # fmt: skip
    batch = options.batch_tokens or (None if gpus else DEFAULT_BATCH_TOKENS)
    b = batch or DEFAULT_BATCH_TOKENS  # the least a GPU batch is: for the growth bound
    floor = shape.layer_state_bytes()
    formula = (
        f"{gib(EXTRACTOR_BASE_BYTES)} own + w {gib(shape.weight_bytes)}"
        + (f" / {gpus} GPUs" if gpus > 1 else "")
        + ("" if gpus else f" + batch {b:,} × {shape_batch_bytes_per_token(shape):,} B")
        + f" + 2 · sample {gib(shape.sample_bytes)} + 2 · (σ + g)"
    )
    explicit_s = options.statistics_memory
    if explicit_s is not None and explicit_s <= floor:
        raise ConfigError(
            f"--statistics-memory {explicit_s:,} bytes is not more than the fixed per-layer "
            f"state of the statistics, {floor:,} bytes for {shape.layers} layers of d = "
            f"{shape.dim} and {shape.positions} positions (8·L·(d² + 3d + P·(d+1) + 2)); give "
            "more, or measure fewer --layers"
        )
    whole = extractor_bytes(shape, types, b, None, gpus)
    least = extractor_bytes(shape, types, b, floor + 1, gpus)
    if explicit_s is not None:
        least = whole = extractor_bytes(shape, types, b, explicit_s, gpus)
    hosts = _hosts(cluster, cpus, gpus)
    offers = cluster.offers(driver)
    if options.worker_memory is not None:
        memory = int(options.worker_memory)
        if memory < least:
            what = "the fixed per-layer state" if explicit_s is None else "--statistics-memory"
            raise ConfigError(
                f"--worker-memory {memory:,} bytes cannot hold an extractor: {least:,} bytes "
                f"({gib(least)}) at least, with {what} ({formula}); give more, or measure "
                "fewer --layers"
            )
        if max(offers, default=0) < memory:
            raise ConfigError(
                f"--worker-memory {memory:,} bytes is more than any node of the cluster offers "
                f"Ray's actors ({max(offers, default=0):,} bytes on the largest); give less, or "
                "add nodes with more memory"
            )
        reason = f"--worker-memory {gib(memory)}"
    else:
        fitted = count
        while fitted > 1 and slot_memory(fitted, hosts, offers) < least:
            fitted -= 1
        room = slot_memory(fitted, hosts, offers) if any(hosts) else whole
        if room < least or (options.num_workers and fitted < count):
            raise ConfigError(
                f"an extractor needs at least {least:,} bytes ({gib(least)}: {formula} with σ "
                f"the {'--statistics-memory' if explicit_s else 'fixed per-layer state'}), "
                f"but the nodes (offering {_offers(offers)}) hold {count} such extractor(s) "
                f"at most {gib(slot_memory(count, hosts, offers))} each; measure fewer "
                "--layers, lower --sample-size and --sample-type-size, give fewer "
                "--num-workers or more --cpus-per-worker, or add nodes with more memory"
            )
        memory = min(whole, room)
        fewer = (
            f"; {fitted} of the {count} extractors the CPUs/GPUs hold, so that each has that"
            if fitted < count
            else ""
        )
        count = fitted
        if explicit_s is not None:
            reason = f"--statistics-memory {gib(explicit_s)}{fewer}"
        elif memory >= whole:
            reason = (
                f"the whole statistics S(V) + F = {gib(shape.statistics_bytes(types))} fit "
                f"(the nodes hold {count} extractor(s) of {gib(room)}){fewer}"
            )
        else:
            reason = (
                f"S(V) + F = {gib(shape.statistics_bytes(types))} do not fit the {gib(room)} "
                f"the nodes hold for each of {count} extractor(s): they spill past σ{fewer}"
            )
    statistics = explicit_s or statistics_for(shape, types, b, memory, gpus)
    if (explicit_s is None and memory >= whole) or statistics >= shape.statistics_bytes(types):
        statistics = None  # the whole statistics fit: no bound needed
    return Pool(count, cpus, float(gpus), memory, statistics, batch, formula, reason)


def size_reducers(
    shape: Shape,
    types: int,
    cluster: Cluster,
    options: Any,
    driver: int,
    *,
    beside: tuple[int, int, int, int] | None = None,
) -> Reduce:
    """Where the statistics of ``types`` types are reduced (explicit options win):

    - ``--reducers 1``: in the job's own process; ``--reducers R > 1``: R reducers, each
      asking for what its share needs; ``--reducer-memory B``: the fewest reducers of B each
      (at least ``--reducers``);
    - otherwise in the job's process while :data:`DRIVER_REDUCE_FACTOR` · (S(V) + F) ≤
      :data:`DRIVER_ALLOWANCE_BYTES`, else on the fewest reducers each needing at most
      :data:`REDUCER_NODE_SHARE` of the largest node's offer that the nodes hold together.

    ``beside`` (extractors, CPUs, GPUs, memory each): the extractor pool, to start as many
    reducers as fit beside it while it runs (``early``).
    """
    state = shape.statistics_bytes(types)
    rows = f"8·L·V·(2d+2) + F = {gib(state)}"
    offers = cluster.offers(driver)
    largest = max(offers, default=0)
    explicit_r, explicit_b = options.reducers, options.reducer_memory

    def budget(r: int) -> int:
        return shape_reducer_budget(shape, r, types)

    formula = f"{gib(REDUCER_BASE_BYTES)} + {REDUCER_MERGE_FACTOR:g} · (⌈V/R⌉ types' rows + ⌈L/R⌉ layers' state)"
    if explicit_b is None and explicit_r == 1:
        return Reduce(0, None, types, f"{DRIVER_REDUCE_FACTOR} · (S(V) + F)", "--reducers 1", 0)
    if explicit_b is None and explicit_r is None:
        in_driver = driver_bytes(shape, types, in_process=True)
        if in_driver <= DRIVER_ALLOWANCE_BYTES:
            return Reduce(
                0, None, types, f"{DRIVER_REDUCE_FACTOR} · (S(V) + F)",
                f"the job's process would take {gib(in_driver)} above its start with "
                f"{rows} ({driver_formula(True)}), within its "
                f"{gib(DRIVER_ALLOWANCE_BYTES)}",
            )  # fmt: skip
    if explicit_b is not None:
        memory = int(explicit_b)
        count = max(explicit_r or 1, reducers_for(memory, shape.layers, shape.dim, types,
                                                  shape.positions, shape.clip))  # fmt: skip
        if memory > largest:
            raise ConfigError(
                f"--reducer-memory {memory:,} bytes is more than any node of the cluster offers "
                f"Ray's actors ({largest:,} bytes on the largest); give less, or add nodes "
                "with more memory"
            )
        reason = f"--reducer-memory {gib(memory)}: {rows} over reducers of that"
    elif explicit_r is not None:
        count, memory = explicit_r, budget(explicit_r)
        if not fits(count, memory, offers):
            raise ConfigError(
                f"--reducers {count}: each needs {memory:,} bytes ({gib(memory)}: {formula} "
                f"for {rows}), and the nodes, offering {_offers(offers)}, do not hold "
                f"{count} of them; give more --reducers, measure fewer --layers, or add nodes"
            )
        reason = f"--reducers {count}: {rows} over {count}"
    else:
        cap = int(REDUCER_NODE_SHARE * largest)
        most = max(types, shape.layers, 1)
        first = reducers_for_cap(shape, types, cap)
        count = next(
            (r for r in range(max(first, 1), most + 1) if first and fits(r, budget(r), offers)),
            0,
        )
        if not count:
            raise ConfigError(
                f"the statistics, {rows}, do not fit the cluster: reducers of at most "
                f"{gib(cap)} (half the largest node's offer; nodes offer {_offers(offers)}) "
                "cannot hold them; measure fewer --layers, or add nodes with more memory "
                "(or give --reducer-memory)"
            )
        memory = budget(count)
        reason = (
            f"{rows} over reducers of ≤ {gib(cap)} ({REDUCER_NODE_SHARE:g} of the largest "
            f"node's {gib(largest)}; nodes offer {_offers(offers)})"
        )
    early: list[str] = []
    if beside is not None:
        n_ext, cpus, gpus, each = beside
        taken = _placed(cluster, offers, n_ext, cpus, gpus, each)
        early = place(cluster, offers, count, memory, taken, partial=True)
    nodes = place(cluster, offers, count, memory)
    return Reduce(count, memory, types, formula, reason, len(early), nodes, early)


def place(
    cluster: Cluster,
    offers: Sequence[int],
    count: int,
    each: int,
    taken: Sequence[int] = (),
    *,
    partial: bool = False,
) -> list[str]:
    """The node of each of ``count`` actors of ``each`` bytes: one at a time on the node with
    the most memory left of its offer (less ``taken`` there already; a worker node before the
    head at equal room), so the reduce spreads over the cluster and the head keeps its room
    for the job's own process. ``partial``: as many as fit (else all, or a :class:`ValueError`)."""
    room = [o - (taken[i] if i < len(taken) else 0) for i, o in enumerate(offers)]
    nodes: list[str] = []
    for _ in range(count):
        best = max(range(len(room)), key=lambda i: (room[i], not cluster.nodes[i].head), default=None)
        if best is None or room[best] < each:
            if partial:
                break
            raise ValueError(f"{count} actors of {each:,} bytes do not fit offers {list(offers)}")
        nodes.append(cluster.nodes[best].node_id)
        room[best] -= each
    return nodes


def reducers_for_cap(shape: Shape, types: int, cap: int) -> int:
    """The fewest reducers within ``cap`` bytes each (0 when none is)."""
    try:
        return reducers_for(cap, shape.layers, shape.dim, types, shape.positions, shape.clip)
    except ConfigError:
        return 0


def _placed(
    cluster: Cluster, offers: Sequence[int], count: int, cpus: int, gpus: int, each: int
) -> list[int]:
    """Memory the extractor pool takes on each node, placed greedily in node order (at most
    what each node's CPUs, GPUs and memory hold)."""
    taken = [0] * len(offers)
    left = count
    for i, hold in enumerate(_hosts(cluster, cpus, gpus)):
        k = min(left, hold, offers[i] // each if each else hold)
        taken[i] = k * each
        left -= k
    return taken


def _offers(offers: Sequence[int]) -> str:
    distinct = sorted(set(offers), reverse=True)
    return ", ".join(f"{offers.count(o)} × {gib(o)}" for o in distinct)


def driver_reserve(shape: Shape, types: int = 0) -> int:
    """What the head node keeps for the job's own process: its start
    (:data:`DRIVER_BASE_BYTES`) and its allowance (:data:`DRIVER_ALLOWANCE_BYTES`), or what it
    needs with the statistics on reducers where that is more (:func:`driver_bytes`)."""
    need = driver_bytes(shape, types, in_process=False)
    return DRIVER_BASE_BYTES + max(DRIVER_ALLOWANCE_BYTES, need)


def size_job(
    shape: Shape, corpus: CorpusShape, cluster: Cluster, options: Any, *, special: int = 0
) -> Sizing:
    """Every decision of a run before any work (module docstring; explicit options win), at the
    most types the corpus can hold (:func:`types_bound`; ``special``: the special ids counted
    with ``--keep-special``). Raises :class:`ConfigError` for what cannot fit, naming the
    option that fixes it."""
    types, types_reason = types_bound(shape.vocab, corpus.text_bytes, special)
    reserve = driver_reserve(shape, types)
    pool = size_extractors(shape, types, cluster, options, corpus.shards, reserve)
    beside = (pool.num_workers, pool.num_cpus, int(pool.num_gpus), pool.memory)
    if options.reducers is None and corpus.bytes < EARLY_REDUCERS_MIN_BYTES:
        beside = None  # self-sized reducers start early only for a long extraction
    reduce = size_reducers(shape, types, cluster, options, reserve, beside=beside)
    driver = driver_bytes(shape, types, not reduce.partitioned)
    head = max((n.memory for n in cluster.nodes if n.head), default=0)
    if head and DRIVER_BASE_BYTES + driver > head:
        raise ConfigError(
            f"the job's own process would need {gib(DRIVER_BASE_BYTES + driver)} "
            f"({gib(DRIVER_BASE_BYTES)} at its start + {driver_formula(not reduce.partitioned)}"
            f": the sample Q = {gib(shape.sample_bytes)}, the type_stats rows "
            f"{gib(shape.layers * types * TYPE_ROW_BYTES)}), more than the head node's "
            f"{gib(head)}; lower --sample-size and --sample-type-size, or measure fewer --layers"
        )
    sizing = Sizing(
        shape, cluster, types, types_reason, pool, reduce, driver,
        driver_formula(not reduce.partitioned),
    )  # fmt: skip
    sizing.extras["io"] = io_sizes(sizing, corpus)
    return sizing


def size_reduce(shape: Shape, types: int, cluster: Cluster, options: Any) -> Reduce:
    """Where ``types`` token types (known now: V_seen, at most the bound the run was sized
    for) are reduced, by the rule of :func:`size_reducers`: self-sized, the same or fewer
    reducers, each asking for what its share of V_seen needs, or the job's own process."""
    return size_reducers(shape, types, cluster, options, driver_reserve(shape, types))


# ------------------------------------------------------------------------- the corpus and I/O


@dataclass(frozen=True)
class CorpusShape:
    """What the plan needs of the corpus: its size and shards (nothing of it is read)."""

    source: str
    files: int
    bytes: int
    shards: int
    #: each shard's bytes of plain text (None: compressed, Parquet or a dataset, where the
    #: bytes do not bound the text)
    shard_text_bytes: tuple[int | None, ...] = ()

    @property
    def text_bytes(self) -> int | None:
        """The corpus's bytes of plain text (None when a shard's are unknown)."""
        if not self.shard_text_bytes or any(b is None for b in self.shard_text_bytes):
            return None
        return sum(b for b in self.shard_text_bytes if b is not None)


#: bytes of one ``type_stats`` row on disk, at most (eight numbers and the token, before
#: Parquet's compression)
TYPE_ROW_DISK_BYTES = 80


def io_sizes(sizing: Sizing, corpus: CorpusShape) -> dict[str, Any]:
    """Bytes that move and are stored: a flush's pieces, the checkpoint groups on disk (at
    most one group per shard, each at most the statistics of that shard's types), the
    artefact and the tables."""
    shape, types, pool = sizing.shape, sizing.types, sizing.pool
    whole = shape.statistics_bytes(types)
    piece = whole if pool.statistics is None else min(
        whole,
        pool.statistics + batch_growth_bytes(shape, types, pool.batch_tokens or DEFAULT_BATCH_TOKENS),
    )
    per_shard = [
        shape.statistics_bytes(types if b is None else min(types, b + 1)) + shape.sample_bytes
        for b in (corpus.shard_text_bytes or (None,) * corpus.shards)
    ]
    tables = {
        "type_stats": shape.layers * types * TYPE_ROW_DISK_BYTES,
        "dims": shape.layers * shape.dim * TYPE_ROW_DISK_BYTES,
        "positions": shape.layers * shape.positions * TYPE_ROW_DISK_BYTES,
        "samples": shape.layers * shape.sample_entries * (4 * shape.dim + 64),
    }
    return {
        "flush_piece_bytes": piece,
        "flush_formula": "a piece ≤ σ + g (spilled or last); a flush: the pieces of one interval"
        if pool.statistics is not None
        else "≤ S(V) + F, one piece",
        "checkpoint_bytes_bound": sum(per_shard),
        "artefact_bytes": whole + shape.sample_bytes,
        "tables_bytes": tables,
    }


def reducer_ranges(count: int, types: int) -> list[tuple[int, int | None]]:
    """Equal ranges of token ids over [0, ``types``) (the last open), the reducers' ranges
    before the ids seen are known (the run cuts them at the ids' quantiles)."""
    width = max(1, math.ceil(types / count))
    return [(r * width, (r + 1) * width if r + 1 < count else None) for r in range(count)]


def describe_plan(
    sizing: Sizing, corpus: CorpusShape, *, checkpoint_interval: float, total_layers: int
) -> list[str]:
    """What ``--plan`` prints: what runs where, every process's memory as number and formula,
    the bytes that move and are stored, and what measuring fewer layers saves."""
    shape, types, pool, red = sizing.shape, sizing.types, sizing.pool, sizing.reduce
    io = sizing.extras.get("io") or io_sizes(sizing, corpus)
    d, L, P = shape.dim, shape.layers, shape.positions
    gpus = f"{pool.num_gpus:g} GPU(s) + " if pool.num_gpus else ""
    batch = (
        f"{pool.batch_tokens:,} padded tokens a batch"
        if pool.batch_tokens
        else "batch tokens decided on each GPU once the model is loaded: min(8 GiB, half the "
        f"free memory) at {shape_batch_bytes_per_token(shape):,} B a token, 8,192 to 65,536"
    )
    stats = (
        "the whole S(V) + F (no bound needed)"
        if pool.statistics is None
        else f"σ = {gib(pool.statistics)} (spills past it; on a GPU no more than "
        f"{GPU_STATISTICS_SHARE:g} of what the model and a batch leave)"
    )
    lines = [
        f"model: {shape.name}: {shape.hidden_states - 1} blocks, d = {d:,}, d_ff = "
        f"{shape.intermediate:,}, {shape.heads} heads, V = {shape.vocab:,} tokenizer entries, "
        f"weights w = {gib(shape.weight_bytes)}",
        f"measured: L = {L} of {total_layers} layers, P = {P} positions, sample s = "
        f"{shape.sample_entries:,} entries" + (f", {shape.clip} clipped dims" if shape.clip else ""),
        f"corpus: {corpus.source}: {corpus.files:,} file(s), {gib(corpus.bytes)}, "
        f"{corpus.shards:,} shards",
        f"cluster: {sizing.cluster.describe()}",
        f"types: {sizing.types_reason}",
        "",
        f"extractors: {pool.num_workers} actor(s), each {gpus}{pool.num_cpus} CPU(s), {batch}",
        f"  memory each: {gib(pool.memory)} asked of Ray ({pool.reason})",
        f"    = {pool.formula}",
        f"  statistics budget: {stats}",
    ]
    if red.partitioned:
        ranges = reducer_ranges(red.count, types)
        shown = ", ".join(f"[{lo:,}, {'∞' if hi is None else f'{hi:,}'})" for lo, hi in ranges[:4])
        more = f", … ({len(ranges)} ranges)" if len(ranges) > 4 else ""
        per = reducer_bytes(red.count, L, d, types, P, shape.clip)
        lines += [
            f"reducers: {red.count} actor(s) × {gib(red.memory)} asked of Ray ({red.reason})",
            f"    = {red.formula}: holds {gib(per)}",
            f"  token ranges: equal numbers of the ids seen, cut at the reduce; over [0, V): "
            f"{shown}{more}",
            f"  layers' state: reducer r holds layers r, r + R, … (⌈L/R⌉ = "
            f"{math.ceil(L / red.count)} at most)",
            f"  placed: {_placement(sizing.cluster, red.nodes)}; started with the extractors: "
            f"{red.early} (the rest at the reduce)",
        ]
    else:
        lines.append(f"reduce: in the job's own process ({red.reason})")
    lines += [
        f"driver (the job's own process): ≤ {gib(sizing.driver)} above its start = "
        f"{sizing.driver_formula}",
        *([f"  warning: {sizing.driver_warning()}"] if sizing.driver > DRIVER_ALLOWANCE_BYTES else []),
        "",
        f"per-type state S(V) = 8·L·V·(2d+2) + 8V = {gib(shape.type_bytes(types))}; per-layer "
        f"state F = 8·L·(d² + 3d + P·(d+1) + 2) = {gib(shape.layer_state_bytes())}; sample Q = "
        f"4·L·s·d + 48s = {gib(shape.sample_bytes)}",
        f"flush: pieces of ≤ {gib(io['flush_piece_bytes'])} ({io['flush_formula']}), one "
        f"checkpoint group per flush (every {checkpoint_interval:g} s of an extractor's work, "
        "and when the queue drains)",
        f"checkpoint groups on disk: ≤ {gib(io['checkpoint_bytes_bound'])} (at most one group "
        "a shard, each ≤ the statistics of its types + Q; removed when the run completes)",
        f"artefact: statistics S(V) + F + sample Q = {gib(io['artefact_bytes'])}",
        "tables (before compression): "
        + ", ".join(f"{k} {gib(v)}" for k, v in io["tables_bytes"].items()),
    ]
    lever = layers_lever(sizing, total_layers)
    if lever:
        lines.append(lever)
    return lines


def _placement(cluster: Cluster, nodes: Sequence[str]) -> str:
    """``"2 on node 1 (worker, 64 GiB), 1 on node 0 (head, 16 GiB)"``."""
    index = {n.node_id: i for i, n in enumerate(cluster.nodes)}
    parts = []
    for node_id in dict.fromkeys(nodes):
        i = index[node_id]
        n = cluster.nodes[i]
        kind = "head" if n.head else "worker"
        parts.append(f"{nodes.count(node_id)} on node {i} ({kind}, {gib(n.memory)})")
    return ", ".join(parts)


def layers_lever(sizing: Sizing, total_layers: int) -> str | None:
    """What measuring every 4th layer would save (``--layers``, the cheapest lever)."""
    shape = sizing.shape
    fewer = len(range(0, total_layers, 4))
    if fewer >= shape.layers:
        return None
    small = shape.with_layers(fewer)
    state = small.statistics_bytes(sizing.types)
    try:
        red = size_reducers(
            small, sizing.types, sizing.cluster, _NoOptions(), driver_reserve(small, sizing.types)
        )
        where = (
            f"{red.count} reducer(s) × {gib(red.memory)}" if red.partitioned else "the job's process"
        )
    except ConfigError:
        where = "still too large for this cluster"
    return (
        f"--layers every 4th layer (L = {fewer}): S(V) + F = {gib(state)} instead of "
        f"{gib(shape.statistics_bytes(sizing.types))} (÷{shape.layers / fewer:.1f}), reduced "
        f"on {where}"
    )


@dataclass(frozen=True)
class _NoOptions:
    """No explicit option: every decision self-sized."""

    reducers: int | None = None
    reducer_memory: int | None = None
