"""The sizing formulas: what every process of a job holds, in L, V, d, P and the corpus, and
the constants measured behind them (docs/sizing.md, with the commands that measured them).

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
  metrics and the report), the ``dims`` rows of every layer (:data:`DIMS_ROW_BYTES` each,
  L·d of them: each layer is analysed by the reducer that holds its state), the
  ``type_stats`` rows of one layer at a time (:data:`TYPE_ROW_BYTES` each, V of them) and
  the sample: one layer of it at a time, or, from a one-layer sample of
  :data:`SAMPLE_ON_WORKERS_BYTES`, pieces of its rows while Ray tasks do the rest
  (:func:`driver_sample_bytes`, :mod:`embgeom_ray.core.sample_layers`):
  :func:`driver_bytes`; when it reduces the statistics itself,
  :data:`DRIVER_REDUCE_FACTOR` · (S(V) + F) instead of the dims rows. It reduces them
  itself only while all that is within :data:`DRIVER_ALLOWANCE_BYTES`.
- **extractor**: :data:`EXTRACTOR_BASE_BYTES` + w + B · b_tok + 2 · Q + u + 2 · (σ + g), σ its
  statistics budget, g = min(B, V) · r one batch's new types beyond it, b_tok the batch's bytes
  per token on a CPU, k lanes' batches (:func:`batch_bytes_per_token`), u what writing its
  largest object holds beside it where the run is in object storage
  (:func:`~embgeom_ray.io_utils.upload_buffer_bytes`; 0 on a disk): :func:`extractor_bytes`.
- **reducer** r of R: :data:`REDUCER_BASE_BYTES` + :data:`REDUCER_MERGE_FACTOR` · (its
  ⌈V/R⌉ types' rows + the state of its ⌈L/R⌉ layers) + u of what it writes:
  :func:`reducer_budget`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..core.options import header_entries
from ..core.statistics_fields import STREAM_BLOCK_BYTES, state_bytes
from ..errors import ConfigError
from ..io_utils import is_local, upload_buffer_bytes
from .sampled_tasks import SampledTasks
from .units import GiB, MiB, gib

if TYPE_CHECKING:  # the sample's modules import torch; the formulas read its header only
    from ..core.sample_layers import SampleLayers

#: glibc's largest mmap threshold on 64-bit systems (``DEFAULT_MMAP_THRESHOLD_MAX``): blocks
#: this large or smaller can come from the heap
#: (:func:`~embgeom_ray.inputs.malloc_tuning.reuse_freed_memory` fixes the threshold there)
MMAP_THRESHOLD_MAX = 32 << 20

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
#: the driver's peak for the sample, in one-layer samples Q_l = 4·s·d + 48·s, whatever L: the
#: layer's merge and a part being read and merged into it, the layer's float64 points for the
#: sampled stage, the layer's rows of samples.parquet as pandas, as Arrow and encoded
#: (8.3 · Q_l measured between d = 256 and d = 1024 at s = 2048, L = 40, above a fixed part of the
#: libraries loaded on first use that DRIVER_RUN_BYTES holds; tests/runs/test_sample_layers.py)
DRIVER_SAMPLE_LAYERS = 10
#: bytes per sampled entry the driver adds to each one-layer sample's as it writes the
#: layer's rows (pandas' row objects: the vector's array, the token's string)
DRIVER_SAMPLE_ROW_BYTES = 256
#: a one-layer sample Q_l of at least this many bytes is merged, widened for the sampled
#: stage and turned into rows of samples.parquet by Ray tasks, one per layer, that read it
#: themselves (:mod:`embgeom_ray.distributed.sample_tasks`); the driver then holds none of
#: its vectors, only the pieces of samples.parquet it writes, one at a time
SAMPLE_ON_WORKERS_BYTES = 16 * MiB
#: the most bytes of rows of samples.parquet in one piece a task hands the driver
SAMPLE_PIECE_BYTES = 8 * MiB
#: the driver's peak for the sample handled by Ray tasks, in pieces of
#: :data:`SAMPLE_PIECE_BYTES`: the piece being written and its Parquet encoding (the piece
#: itself is read from the object store without a copy). Measured above a warmed start:
#: 2.7 MiB for an 8B-shaped sample (d = 4,096, s = 8,192, L = 3, the whole sampled stage)
#: and 3.8 MiB for a 70B-shaped one (d = 8,192), against 643 MiB with the driver doing it
#: (tests/distributed/test_sample_tasks.py checks it at d = 2,048)
DRIVER_SAMPLE_PIECES = 4
#: bytes of one ``dims`` row as the driver holds that table until it is written (L·d rows:
#: nine numbers, a flag and the rule's string in pandas): 146 B measured (RssAnon) while the
#: layers' rows are concatenated, 92 B once they are
DIMS_ROW_BYTES = 160
#: bytes of one ``type_stats`` row as the driver builds the table (eight numbers and the
#: token's string in pandas)
TYPE_ROW_BYTES = 160
#: bytes of one ``type_stats`` row on disk, at most (eight numbers and the token, before
#: Parquet's compression)
TYPE_ROW_DISK_BYTES = 80
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
#: ``--batch-tokens`` when it is not given: the least on a GPU, and a model split over GPUs
DEFAULT_BATCH_TOKENS = 8192
#: the fewest and the most padded tokens a CPU batch gets without ``--batch-tokens``
#: (:func:`cpu_batch_tokens`)
CPU_BATCH_TOKENS_MIN = 1024
CPU_BATCH_TOKENS_MAX = 8192
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
    #: k: the forward lanes of a CPU extractor (:mod:`~embgeom_ray.inputs.lanes`), each
    #: holding one batch; 1 on GPUs
    lanes: int = 1
    #: the run's URL (``--out``), which the processes write to: "" (or a local path) for a
    #: disk, where a write holds nothing beside its data (:meth:`upload_bytes`)
    store: str = ""
    #: n: ``--sample-size``, the uniform points a layer's K-means and sampled metrics take
    #: (they bound its distinct points; 0: no sample)
    sample_points: int = 0
    #: the sampled stage's options that its tasks' memory depends on
    #: (``--silhouette-max-points``, ``--kmeans-k-max``, ``--kmeans-n-init``, ``--lid-k``:
    #: :mod:`.sampled_tasks`); None: the defaults
    sampled: Any = field(default=None, compare=False)
    #: where the sample's per-layer tasks read it, where not from ``store`` (a run's sample is
    #: in its checkpoint groups there): a merge's runs, one of them local where any is
    #: (:func:`~embgeom_ray.distributed.sample_tasks.placement` keeps the tasks on the job's
    #: node where any part is read from local files); None: ``store``
    sample_source: str | None = None

    @property
    def sample_local(self) -> bool:
        """Whether the sample's tasks read local files, on the job's own node (:attr:`sample_source`,
        else :attr:`store`; "": a local run)."""
        url = self.store if self.sample_source is None else self.sample_source
        return not url or is_local(url)

    def sampled_tasks(self) -> SampledTasks | None:
        """The sampled stage's per-layer Ray tasks (:mod:`.sampled_tasks`) of a layer of
        ``sample_points`` points; None without the stage (a sample too small for it). Their
        metrics task computes the distances itself where the sample is handled by Ray tasks
        or is too large for one process (the K-means task then hands none over)."""
        from ..core.kmeans_selection import LOCAL_FIT_MAX_ELEMENTS
        from ..core.options import SampledOptions
        from ..core.tables import MIN_SAMPLE_POINTS

        n = self.sample_points
        if n < MIN_SAMPLE_POINTS:
            return None
        o = self.sampled or SampledOptions()
        own = (sample_on_workers(self.sample_entries, self.dim)
               or n * self.dim > LOCAL_FIT_MAX_ELEMENTS)  # fmt: skip
        return SampledTasks(n, self.dim, o.silhouette_max_points, o.kmeans_k_max,
                            o.kmeans_n_init, min(o.lid_k, n - 1), own)  # fmt: skip

    def upload_bytes(self, size: int) -> int:
        """u: what writing an object of ``size`` bytes to the run holds beside its data
        (:func:`~embgeom_ray.io_utils.upload_buffer_bytes`; 0 on a disk)."""
        return upload_buffer_bytes(self.store, size)

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

    @property
    def driver_sample_bytes(self) -> int:
        """What the driver holds of the sample (:func:`driver_sample_bytes`)."""
        return driver_sample_bytes(self.layers, self.sample_entries, self.dim)

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
    store: str = "",
    sample_points: int = 0,
    sampled: Any = None,
) -> Shape:
    """The :class:`Shape` of a run from the model's (text) config, read for its blocks,
    feed-forward width and heads, and the run's options (``store``: its ``--out``;
    ``sample_points``: ``--sample-size``; ``sampled``: its sampled metrics' options)."""
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
        store=store,
        sample_points=sample_points,
        sampled=sampled,
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
class CorpusShape:
    """What the plan needs of the corpus: its size and shards (nothing of it is read)."""

    source: str
    files: int
    bytes: int
    shards: int
    #: each shard's bytes of plain text (None: compressed, Parquet or a dataset, where the
    #: bytes do not bound the text)
    shard_text_bytes: tuple[int | None, ...] = ()
    #: the shards' size (the plan's ``shard_bytes``; 0: not known) and how it was chosen
    shard_bytes: int = 0
    shard_rule: str = ""

    @property
    def text_bytes(self) -> int | None:
        """The corpus's bytes of plain text (None when a shard's are unknown)."""
        if not self.shard_text_bytes or any(b is None for b in self.shard_text_bytes):
            return None
        return sum(b for b in self.shard_text_bytes if b is not None)


def batch_bytes_per_token(
    hidden_states: int,
    dim: int,
    intermediate: int,
    dtype_bytes: int,
    scores: int = 0,
    lanes: int = 1,
) -> int:
    """A batch's memory per padded token, beyond the model's weights: every hidden state the
    forward returns ((blocks + 1) · d values in the model's dtype), the fold's scratch
    (:data:`FOLD_BYTES_PER_TOKEN_DIM` · d), the feed-forward's intermediate activations
    (three of ``intermediate`` values: gate, up and their product in gated MLPs) and one
    layer's attention scores (``scores`` = heads × window length values a token, where the
    attention implementation materialises them; fused attention does not); a CPU extractor
    of k ``lanes`` (:mod:`~embgeom_ray.inputs.lanes`) holds k batches' hidden states and
    activations and one fold's scratch:
    k · ((blocks + 1) · d + 3 · d_ff + heads · T) · b + 64 · d bytes."""
    values = hidden_states * dim + 3 * intermediate + scores
    return lanes * values * dtype_bytes + FOLD_BYTES_PER_TOKEN_DIM * dim


def default_batch_tokens(per_token_bytes: int, free_bytes: int | None) -> int:
    """``--batch-tokens`` on GPUs when it is not given: :data:`DEFAULT_BATCH_TOKENS` for a
    model split over several GPUs (``free_bytes`` None); on one GPU as many tokens as
    :data:`GPU_BATCH_BYTES` (or half of ``free_bytes``, the memory left once the model is
    loaded, if less) hold at ``per_token_bytes`` each, in multiples of 1,024, between
    :data:`DEFAULT_BATCH_TOKENS` and :data:`GPU_BATCH_TOKENS_MAX` (on a CPU:
    :func:`cpu_batch_tokens`).

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


def layer_bytes_per_token(shape: Shape) -> int:
    """Bytes a token takes in one layer's largest tensor on a CPU: the feed-forward's inner
    activations (d_ff values) or the hidden state (d), max(d_ff, d) · b. The attention
    scores are not counted: torch's CPU attention (sdpa, the default of every architecture
    that has it) runs in blocks and never holds them (an eager one would hold heads × T a
    token, and pay in page faults where they pass 32 MiB)."""
    return max(shape.intermediate or 4 * shape.dim, shape.dim) * shape.dtype_bytes


def cpu_batch_tokens(shape: Shape) -> int:
    """``--batch-tokens`` on a CPU when it is not given: as many tokens as keep one layer's
    largest tensor (:func:`layer_bytes_per_token`) within glibc's largest mmap threshold,
    32 MiB (:data:`MMAP_THRESHOLD_MAX`), in multiples of
    1,024 between :data:`CPU_BATCH_TOKENS_MIN` and :data:`CPU_BATCH_TOKENS_MAX`: MiniLM
    (d_ff = 1,536, float32: 6 KiB a token) gets 5,120 tokens, a BERT-base-sized model
    (d_ff = 3,072) 2,048, an 8B Llama (d_ff = 14,336) 1,024.

    Why: a tensor within the threshold comes from the heap, where a CPU extractor's allocator
    keeps it for the next batch once freed
    (:func:`~embgeom_ray.inputs.malloc_tuning.reuse_freed_memory`); a larger one is a fresh
    mapping every batch, faulted in page by page. MiniLM's bare forward with 8,192-token
    batches spent 34–39 µs a position in the kernel (glibc's defaults) and 9–19 µs (tuned),
    against 0.1–1.8 µs at 2,048–5,120 tokens tuned, beside ~270 µs of its own work, which
    did not change with the batch size (265–281 µs from 2,048 to 8,192 tokens: the caches
    do not decide here; one thread, 2-core VM, ``python -m bench.bare_forward``). Smaller
    batches cost the fold more (~20 ms a batch for MiniLM's 7 layers whatever its size),
    hence the largest batch within the threshold. Nothing computed depends on the batching
    (``--batch-tokens`` is a scheduling option). The same in an extractor of several lanes
    (:mod:`~embgeom_ray.inputs.lanes`): MiniLM's in two lanes took 13.8 s at 2,048 tokens
    and 13.9 s at 5,120 (docs/benchmarks.md)."""
    tokens = MMAP_THRESHOLD_MAX // max(layer_bytes_per_token(shape), 1) // 1024 * 1024
    return int(min(CPU_BATCH_TOKENS_MAX, max(CPU_BATCH_TOKENS_MIN, tokens)))


def shape_batch_bytes_per_token(shape: Shape) -> int:
    """:func:`batch_bytes_per_token` of ``shape`` (scores of every head over P positions)."""
    return batch_bytes_per_token(
        shape.hidden_states or shape.layers,
        shape.dim,
        shape.intermediate or 4 * shape.dim,
        shape.dtype_bytes,
        shape.heads * shape.positions,
        shape.lanes,
    )


def gpu_budgets(
    shape: Shape, free_bytes: int, batch_tokens: int | None, host_statistics: int | None
) -> tuple[int, int | None]:
    """An extractor's batch tokens and statistics budget on a GPU with ``free_bytes`` left
    once the model is loaded: the batch first (``batch_tokens``, or
    :func:`default_batch_tokens`), then the statistics get :data:`GPU_STATISTICS_SHARE` of
    what the batch leaves, and no more than ``host_statistics`` (what the host's
    ``--worker-memory`` holds of their serialised copies; None: no bound there).

    The host's memory holds σ + g, g one batch's new types beyond σ, sized at the least GPU
    batch, :data:`DEFAULT_BATCH_TOKENS`, when ``--batch-tokens`` is not given (the batch is
    decided here); a larger batch may add min(B, V) · r, so σ gives up the difference
    (min(B, V) − min(8,192, V)) · r and the copy stays within what was asked: 10.3 GiB of an
    8B model's 44.6 GiB at its 13,312 tokens on an H100."""
    per_token = shape_batch_bytes_per_token(shape)
    tokens = batch_tokens or default_batch_tokens(per_token, free_bytes)
    on_gpu = int(GPU_STATISTICS_SHARE * max(0, free_bytes - tokens * per_token))
    if host_statistics is not None and not batch_tokens:
        host_statistics -= batch_growth_bytes(shape, shape.vocab, tokens) - batch_growth_bytes(
            shape, shape.vocab, DEFAULT_BATCH_TOKENS
        )
    budget = on_gpu if host_statistics is None else min(on_gpu, host_statistics)
    if budget >= shape.statistics_bytes(shape.vocab):
        return tokens, None  # every type of the vocabulary fits: no bound needed
    return tokens, budget


def extractor_own_bytes(shape: Shape, batch_tokens: int, gpus: int) -> int:
    """What an extractor holds besides its statistics and their serialised copy:
    :data:`EXTRACTOR_BASE_BYTES` + w (the weights, on the host while they load; over N > 1
    GPUs accelerate's device map places them one GPU's share, w / N, at a time) + B · b_tok
    (a CPU batch's activations; on a GPU they are in device memory) + 2 · Q (the sample and
    its serialised copy at a flush) + u (:func:`extractor_upload_bytes`: writing a flush's
    largest object, where the run is in object storage)."""
    batch = 0 if gpus else batch_tokens * shape_batch_bytes_per_token(shape)
    weights = shape.weight_bytes // max(gpus, 1)
    upload = extractor_upload_bytes(shape)
    return EXTRACTOR_BASE_BYTES + weights + batch + 2 * shape.sample_bytes + upload


def extractor_upload_bytes(shape: Shape) -> int:
    """u of an extractor: what writing the largest object of its flush holds beside it
    (:meth:`Shape.upload_bytes`), bounded by a piece of the whole statistics of the
    vocabulary, S(V) + F (a piece is at most σ, H or S(V_seen) + F; the sample's part, Q, is
    written after it, not beside it; u does not fall as the object grows)."""
    return shape.upload_bytes(max(shape.statistics_bytes(shape.vocab), shape.sample_bytes))


def batch_growth_bytes(shape: Shape, types: int, batch_tokens: int) -> int:
    """g = min(B, V) · r: one batch's new types beyond the statistics budget (the budget is
    checked after every batch)."""
    return min(batch_tokens, types) * shape.row_bytes


def extractor_bytes(
    shape: Shape,
    types: int,
    batch_tokens: int,
    statistics: int | None,
    gpus: int = 0,
    host: int | None = None,
) -> int:
    """An extractor's memory (host, private): :func:`extractor_own_bytes` + 2 · (σ + g), σ its
    statistics budget (None: the whole S(V) + F) and one serialised copy of them; on a GPU the
    statistics are in device memory and the host holds their serialised copy alone: + (σ + g).
    With a host tier of H bytes (``host``, ``--host-statistics-memory``): + :func:`tier_bytes`."""
    held = shape.statistics_bytes(types) if statistics is None else statistics
    growth = 0 if statistics is None else batch_growth_bytes(shape, types, batch_tokens)
    own = extractor_own_bytes(shape, batch_tokens, gpus)
    return own + copies(gpus) * (held + growth) + tier_bytes(host)


def tier_bytes(host: int | None) -> int:
    """A host tier's memory: H + b, the merged statistics and one block of their file, which
    is written (or put in the object store) a block at a time
    (:data:`~embgeom_ray.core.statistics_fields.STREAM_BLOCK_BYTES`, b); 0 without a tier."""
    return 0 if host is None else host + STREAM_BLOCK_BYTES


def copies(gpus: int) -> int:
    """The copies of its statistics an extractor holds in host memory: the running statistics
    and one serialised copy on a CPU; the serialised copy alone on a GPU."""
    return 1 if gpus else 2


def statistics_for(
    shape: Shape, types: int, batch_tokens: int, memory: int, gpus: int = 0
) -> int:
    """The largest statistics budget σ an extractor of ``memory`` bytes holds
    (:func:`extractor_bytes` solved for σ)."""
    own = extractor_own_bytes(shape, batch_tokens, gpus)
    return (memory - own) // copies(gpus) - batch_growth_bytes(shape, types, batch_tokens)


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
    reducers: int, layers: int, dim: int, types: int, positions: int, clip: int = 0,
    store: str = "",
) -> int:  # fmt: skip
    """The memory the largest of ``reducers`` reducers needs: :data:`REDUCER_BASE_BYTES` plus
    :data:`REDUCER_MERGE_FACTOR` times what it holds (:func:`reducer_bytes`), plus u, what
    writing that part to the run at ``store`` (its ``--out``; "": a disk) holds beside it
    (:func:`~embgeom_ray.io_utils.upload_buffer_bytes`)."""
    held = reducer_bytes(reducers, layers, dim, types, positions, clip)
    upload = upload_buffer_bytes(store, held)
    return REDUCER_BASE_BYTES + math.ceil(REDUCER_MERGE_FACTOR * held) + upload


def reducers_for(
    budget: int, layers: int, dim: int, types: int, positions: int, clip: int = 0,
    store: str = "",
) -> int:  # fmt: skip
    """The fewest reducers whose largest needs at most ``budget`` bytes (:func:`reducer_budget`).
    Raises :class:`ConfigError` when even one layer's state per reducer needs more than that."""
    most = max(types, layers, 1)  # one type and one layer each: no cut holds less
    low, high = 1, most
    if reducer_budget(most, layers, dim, types, positions, clip, store) > budget:
        need = reducer_budget(most, layers, dim, types, positions, clip, store)
        raise ConfigError(
            f"--reducer-memory {budget:,} bytes cannot hold a reducer's part: one layer's "
            f"state alone needs {need:,} bytes: the process's own {REDUCER_BASE_BYTES // MiB} "
            f"MiB and {REDUCER_MERGE_FACTOR:g} · 8·(d² + 3d + P·(d+1) + 2) for d = {dim}, "
            f"P = {positions} (the merge's headroom); give at least that"
        )
    while low < high:  # reducer_budget falls as R grows
        mid = (low + high) // 2
        if reducer_budget(mid, layers, dim, types, positions, clip, store) <= budget:
            high = mid
        else:
            low = mid + 1
    return low


def shape_reducer_budget(shape: Shape, reducers: int, types: int) -> int:
    return reducer_budget(
        reducers, shape.layers, shape.dim, types, shape.positions, shape.clip, shape.store
    )


def sample_layer_bytes(entries: int, dim: int) -> int:
    """Q_l = 4·s·d + 48·s: one layer of a sample of ``entries`` entries."""
    return 4 * entries * dim + 48 * entries


def sample_task_bytes(entries: int, dim: int) -> int:
    """What one of the sample's per-layer Ray tasks (:mod:`embgeom_ray.distributed.sample_tasks`)
    holds at its peak, and asks Ray for: :data:`DRIVER_SAMPLE_LAYERS` · Q_l (the layer's
    sample merged from its parts, its points widened for the sampled stage, its rows of
    ``samples.parquet``; the factor measured on the driver's same work)."""
    return DRIVER_SAMPLE_LAYERS * sample_layer_bytes(entries, dim)


def sample_entries_fitting(memory: int, dim: int, at_once: int = 1) -> int:
    """The most sample entries s whose ``at_once`` tasks fit in ``memory`` bytes:
    at_once · :data:`DRIVER_SAMPLE_LAYERS` · (4·d + 48) · s ≤ memory."""
    return max(0, memory) // (max(at_once, 1) * DRIVER_SAMPLE_LAYERS * (4 * dim + 48))


def sample_on_workers(entries: int, dim: int) -> bool:
    """Whether the sample's per-layer work runs in Ray tasks (:data:`SAMPLE_ON_WORKERS_BYTES`)."""
    return sample_layer_bytes(entries, dim) >= SAMPLE_ON_WORKERS_BYTES


def on_workers(sample: SampleLayers) -> bool:
    """Whether ``sample``'s per-layer work (the sampled stage's inputs, the rows of
    ``samples.parquet``) runs in Ray tasks that read it themselves
    (:mod:`embgeom_ray.distributed.sample_tasks`): when its one-layer sample can reach
    :data:`SAMPLE_ON_WORKERS_BYTES` (from its header's sizes: :func:`sample_on_workers`)."""
    entries = sum(header_entries(sample.header))
    return sample_on_workers(entries, int(sample.header["dim"]))


def driver_sample_bytes(layers: int, entries: int, dim: int) -> int:
    """What the driver holds of the sample: with Q_l = 4·s·d + 48·s at least
    :data:`SAMPLE_ON_WORKERS_BYTES`, :data:`DRIVER_SAMPLE_PIECES` pieces of
    :data:`SAMPLE_PIECE_BYTES` and every layer's K-means labels (8·L·s); below it,
    :data:`DRIVER_SAMPLE_LAYERS` one-layer samples and :data:`DRIVER_SAMPLE_ROW_BYTES` a
    sampled entry, whatever L (the sample is merged, planned and written a layer at a time
    in the driver; ``layers`` only bounds it by the whole sample's multiple for a sample of
    fewer layers)."""
    if sample_on_workers(entries, dim):
        return DRIVER_SAMPLE_PIECES * SAMPLE_PIECE_BYTES + 8 * max(layers, 1) * entries
    one = sample_layer_bytes(entries, dim)
    return min(DRIVER_SAMPLE_LAYERS, max(layers, 1)) * one + DRIVER_SAMPLE_ROW_BYTES * entries


def driver_bytes(shape: Shape, types: int, in_process: bool) -> int:
    """The driver's memory above its start: :data:`DRIVER_RUN_BYTES`; reducing in process
    :data:`DRIVER_REDUCE_FACTOR` · (S(V) + F), else the ``dims`` rows of every layer (L·d of
    :data:`DIMS_ROW_BYTES`: each layer is analysed where its state lives, and only O(d + P)
    of it comes here); one layer's ``type_stats`` rows (V of :data:`TYPE_ROW_BYTES`: they are
    written a layer at a time), what it holds of the sample (:func:`driver_sample_bytes`) and,
    where the run is in object storage, u of its largest upload (:func:`driver_upload_bytes`)."""
    reduce = (
        DRIVER_REDUCE_FACTOR * shape.statistics_bytes(types)
        if in_process
        else shape.layers * shape.dim * DIMS_ROW_BYTES
    )
    rows = types * TYPE_ROW_BYTES
    upload = driver_upload_bytes(shape, types, in_process)
    return DRIVER_RUN_BYTES + reduce + rows + shape.driver_sample_bytes + upload


def driver_upload_bytes(shape: Shape, types: int, in_process: bool) -> int:
    """u of the driver (:meth:`Shape.upload_bytes`; 0 on a disk): its largest object, the
    artefact where it reduces in process (S(V) + F), else ``type_stats.parquet`` (L·V rows of
    at most :data:`TYPE_ROW_DISK_BYTES`) or ``samples.parquet`` (at most Q), each uploaded
    from a staged file in parts (:func:`~embgeom_ray.io_utils.upload_buffer_bytes`)."""
    largest = max(shape.layers * types * TYPE_ROW_DISK_BYTES, shape.sample_bytes)
    if in_process:
        largest = max(largest, shape.statistics_bytes(types))
    return shape.upload_bytes(largest)


def driver_formula(in_process: bool, shape: Shape | None = None) -> str:
    """:func:`driver_bytes` in words (``shape``: the sample's part as it is handled for it;
    None: in the driver)."""
    reduce = (
        f"{DRIVER_REDUCE_FACTOR} · (S(V) + F)"
        if in_process
        else f"the dims rows L·d × {DIMS_ROW_BYTES} B (each layer analysed by its reducer)"
    )
    if shape is not None and sample_on_workers(shape.sample_entries, shape.dim):
        sample = (
            f"the sample on Ray tasks ({gib(SAMPLE_ON_WORKERS_BYTES)} ≤ 4·s·d + 48s a layer): "
            f"{DRIVER_SAMPLE_PIECES} pieces of {gib(SAMPLE_PIECE_BYTES)} + the K-means labels 8·L·s"
        )
    else:  # min(10, L) one-layer samples (driver_sample_bytes): the factor it counts
        factor = (
            f"min({DRIVER_SAMPLE_LAYERS}, L)"
            if shape is None
            else f"{min(DRIVER_SAMPLE_LAYERS, max(shape.layers, 1))}"
        )
        sample = (
            f"the sample a layer at a time {factor} · (4·s·d + 48s) + "
            f"{DRIVER_SAMPLE_ROW_BYTES} B · s"
        )
    upload = (
        " + u (its largest upload's buffers)"
        if shape is not None and shape.upload_bytes(1)
        else ""
    )
    return (
        f"{gib(DRIVER_RUN_BYTES)} (Ray, the metrics' and report's libraries) + {reduce} + a "
        f"layer's V type_stats rows of {TYPE_ROW_BYTES} B + {sample}{upload}"
    )


def reducer_ranges(count: int, types: int) -> list[tuple[int, int | None]]:
    """Equal ranges of token ids over [0, ``types``) (the last open), the reducers' ranges
    before the ids seen are known (the run cuts them at the ids' quantiles)."""
    width = max(1, math.ceil(types / count))
    return [(r * width, (r + 1) * width if r + 1 < count else None) for r in range(count)]
