"""The extractor: shards of text in, folded into :class:`EmbeddingStatistics`. No Ray here.

An extractor loads the tokenizer and model once, then for each shard reads documents in
chunks, splits them into windows, runs length-bucketed batches through the model with
``output_hidden_states=True`` and folds the selected layers' hidden states into the shard's
statistics on the model's device. Memory is bounded by ``docs_per_chunk``, ``batch_tokens``
and the sorting pool (:meth:`ShardProcessor.batches`), never by the shard or corpus size (the
statistics themselves are bounded by the vocabulary seen). :meth:`ShardProcessor.fold_shard`
folds a shard into accumulators that may hold earlier shards; :meth:`ShardProcessor.process`
folds one shard into fresh ones.
:mod:`embgeom_ray.distributed.actor_pool` wraps this in Ray actors; tests and benchmarks use it directly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..core.options import sample_entries
from ..core.samples import ActivationSample
from ..core.sketch import finite_layers
from ..core.split_statistics import SplitStatistics
from ..core.statistics import EmbeddingStatistics
from ..counts import Counts
from ..sizing import DEFAULT_BATCH_TOKENS, cpu_batch_tokens, gpu_budgets, lanes_for, run_shape
from .corpus import CorpusSpec, Document, ReadReport, Shard, read_shard
from .lanes import in_lanes
from .model_loading import (
    balanced_device_map,
    content_rule,
    load_model,
    load_tokenizer,
    unknown_token_id,
)
from .options import ExtractionOptions
from .windows import (
    MAX_PADDING,
    MIN_BATCH_POSITIONS,
    POOL_BATCHES,
    Batch,
    Window,
    counted_windows,
    make_batches,
    pools,
    tokenize_windows,
)

log = logging.getLogger(__name__)

#: a batch (or part of one) run through the model: its hidden states and the forward's seconds
_Forwarded = tuple[Batch, list[torch.Tensor], float]


def count_batch(counts: Counts, batch: Batch, special_ids: Sequence[int], unk_id: int | None) -> None:
    """Add one batch that ran to ``counts``: its positions, counted tokens, special and [UNK]
    tokens (:class:`~embgeom_ray.counts.Counts` says what each counts)."""
    real = batch.attention_mask.bool()
    counts.padded_tokens += int(batch.input_ids.numel())
    counts.positions += int(real.sum())
    counts.tokens += batch.num_tokens
    if special_ids:
        specials = torch.tensor(sorted(set(special_ids)), dtype=batch.input_ids.dtype)
        counts.special_tokens += int((torch.isin(batch.input_ids, specials) & real).sum())
    if unk_id is not None:
        counts.unk_tokens += int(((batch.input_ids == unk_id) & real).sum())
    counts.batches += 1


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        from ..errors import ConfigError

        raise ConfigError("--device cuda was asked for, but torch sees no CUDA device here")
    return device


def gpu_device_map(options: ExtractionOptions, device: str) -> dict[str, int] | None:
    """The device map of a model split over ``--gpus-per-worker`` GPUs (None for one
    device): the GPUs Ray gave this actor (``CUDA_VISIBLE_DEVICES``), each filled to 90% of its
    memory at most, blocks balanced between them."""
    gpus = options.gpus_per_worker or 1
    if gpus <= 1:
        return None
    from ..errors import ConfigError

    visible = torch.cuda.device_count() if device == "cuda" else 0
    if visible < gpus:
        raise ConfigError(
            f"--gpus-per-worker {gpus} needs {gpus} GPUs in each extractor, but this one sees "
            f"{visible} (device {device})"
        )
    return device_map_over_gpus(options, gpus)


def device_map_over_gpus(options: ExtractionOptions, gpus: int) -> dict[str, int]:
    """The model's device map over GPUs 0..``gpus`` − 1 of this process, each filled to 90% of
    its memory at most, blocks balanced between them (:func:`balanced_device_map`)."""
    budget = {i: int(0.9 * torch.cuda.get_device_properties(i).total_memory) for i in range(gpus)}
    return balanced_device_map(
        options.model, options.revision, options.dtype, options.trust_remote_code, budget
    )


def _chunks(docs: Iterator[Document], size: int) -> Iterator[list[Document]]:
    chunk: list[Document] = []
    for doc in docs:
        chunk.append(doc)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


class ShardProcessor:
    """Model + tokenizer loaded once; :meth:`process` folds one shard.

    Args:
        options: the extraction options (:class:`~.options.ExtractionOptions`).
        layers: resolved HF hidden-state indices to keep.
        metadata: identity strings stamped on every statistics object (model and tokenizer
            fingerprints, …), so shards of different measurements can never be merged.
        clip_dims: dimensions whose clipped cosine statistics are folded too (``--clip-dims``).
    """

    def __init__(
        self,
        options: ExtractionOptions,
        layers: list[int],
        metadata: dict[str, str],
        clip_dims: list[int] | None = None,
    ) -> None:
        self.options = options
        self.clip_dims = clip_dims
        self.layers = list(layers)
        self.metadata = dict(metadata)
        self.device = resolve_device(options.device)
        self.tokenizer = load_tokenizer(options.model, options.revision, options.trust_remote_code)
        self.device_map = gpu_device_map(options, self.device)
        self.model = load_model(
            options.model, options.revision, options.dtype, self.device,
            options.trust_remote_code, self.device_map,
        )  # fmt: skip
        text_config = self.model.config.get_text_config()
        self.dim = int(text_config.hidden_size)
        #: padded tokens per batch, and the bytes the running statistics may hold before they
        #: spill (None: no bound)
        self.batch_tokens, self.statistics_budget = self._budgets(text_config)
        #: the host tier's bytes (``--host-statistics-memory``; None: no tier)
        self.host_budget = self._host_budget()
        #: what the running statistics may hold before a flush (checked after each shard):
        #: the host tier's budget where there is one, else the statistics budget
        self.flush_budget = self.statistics_budget if self.host_budget is None else self.host_budget
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = 0  # masked out by attention_mask and keep; never counted
        self.special_ids = list(self.tokenizer.all_special_ids)
        #: read once: a lane folding must not call into the tokenizer while another tokenizes
        self.unk_id = unknown_token_id(self.tokenizer)
        self.corpus = CorpusSpec(options.corpus, options.text_column, options.split)
        if self.device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False  # the model's own matmuls stay fp32

    def _budgets(self, text_config: Any) -> tuple[int, int | None]:
        """The batch tokens and the statistics budget: the options' (``--batch-tokens``, and
        the ``--statistics-memory`` the job decided, :mod:`embgeom_ray.sizing`) on a CPU or a
        model split over GPUs, the batch where not given from the model's shape on a CPU
        (:func:`~embgeom_ray.sizing.cpu_batch_tokens`) and :data:`DEFAULT_BATCH_TOKENS`
        over GPUs; on one GPU, decided from the memory the model leaves free
        (:func:`~embgeom_ray.sizing.gpu_budgets`: the batch, then the statistics, no more than
        the options' budget)."""
        options = self.options
        sample = sum(sample_entries(options.sample_size, options.sample_type_size))
        shape = run_shape(
            text_config, layers=len(self.layers), positions=options.max_length,
            vocab=len(self.tokenizer), clip=len(self.clip_dims or []), sample_entries=sample,
            weight_bytes=0, dtype=options.dtype,
        )  # fmt: skip
        if self.device != "cuda" or self.device_map is not None:
            default = cpu_batch_tokens(shape) if self.device == "cpu" else DEFAULT_BATCH_TOKENS
            return options.batch_tokens or default, options.statistics_memory
        free, _ = torch.cuda.mem_get_info()
        return gpu_budgets(shape, free, options.batch_tokens, options.statistics_memory)

    def _host_budget(self) -> int | None:
        """The host tier's bytes (``--host-statistics-memory``), where the statistics have a
        budget to spill past and the tier exceeds it; None otherwise. The sizing refuses a tier
        no larger than a budget it knows; a GPU's budget is decided here, and a tier it
        outgrows (a GPU with more memory than its type says) is left out, with a warning: one
        spill would fill it, and it would only copy every spill."""
        host, sigma = self.options.host_statistics_memory, self.statistics_budget
        if host is None or sigma is None:
            return None
        if int(host) <= sigma:
            log.warning(
                "no host tier: --host-statistics-memory %s bytes does not exceed this "
                "extractor's statistics budget of %s bytes (what its GPU holds)",
                f"{int(host):,}", f"{sigma:,}",
            )
            return None
        return int(host)

    def new_statistics(self) -> EmbeddingStatistics | SplitStatistics:
        """The running statistics: on the model's device, or one part per GPU holding the
        layers computed there when the model is split (:class:`SplitStatistics`)."""
        options = {
            "max_positions": self.options.max_length,
            "metadata": self.metadata,
            "clip_dims": self.clip_dims,
            "comoment_precision": self.options.comoment_precision,
            # no more slots than the tokenizer has tokens (the doubling would overshoot)
            "max_types": len(self.tokenizer),
        }
        if self.device_map is not None:
            return SplitStatistics(self.layers, self.dim, **options)
        if self.device == "cuda" and self.statistics_budget is None:
            # the sizing found room on the device for every type: all the slots at once, no
            # doubling (whose last step would hold a field's old and new arrays together)
            options["initial_types"] = len(self.tokenizer)
        return EmbeddingStatistics(self.layers, self.dim, device=self.device, **options)

    def new_sample(self) -> ActivationSample | None:
        cfg = self.options
        if cfg.sample_size == 0:
            return None
        return ActivationSample(
            self.layers,
            self.dim,
            size=cfg.sample_size,
            seed=cfg.sample_seed,
            type_size=cfg.sample_type_size,
            device=self.device,
            metadata=self.metadata,
            content_rule=content_rule(self.model.config),
        )

    @torch.inference_mode()
    def forward(self, batch: Batch) -> list[torch.Tensor]:
        """Hidden states of the selected layers, each (B, T, d), on the model's device."""
        out = self.model(
            input_ids=batch.input_ids.to(self.device),
            attention_mask=batch.attention_mask.to(self.device),
            output_hidden_states=True,
            use_cache=False,
        )
        hs = out.hidden_states
        return [hs[layer] for layer in self.layers]

    def batches(self, docs: Iterator[Document], counts: Counts) -> Iterator[Batch]:
        """Windows of ``docs`` packed into batches, pool by pool (bounded memory).

        Documents are tokenized ``docs_per_chunk`` at a time; windows gather into pools of
        ``POOL_BATCHES × batch_tokens`` tokens, each packed by :func:`make_batches` with padded
        positions ≤ (1 + ``MAX_PADDING``) × real ones (a tiny pool, such as a small shard's,
        may add merges of batches under ``MIN_BATCH_POSITIONS`` positions).

        Held at once: one chunk's texts; the windows of one pool, fewer than
        ``POOL_BATCHES × batch_tokens`` tokens plus those of one chunk of ``docs_per_chunk``
        documents, as lists of Python ints (about 45 bytes a token with the window objects,
        measured: about 12 MB for the pool's 262,144 tokens at the defaults); one batch of
        ``batch_tokens`` positions.
        """
        cfg = self.options

        def chunks() -> Iterator[list[Window]]:
            for chunk in _chunks(docs, cfg.docs_per_chunk):
                windows = counted_windows(
                    tokenize_windows(
                        self.tokenizer,
                        [d.doc_id for d in chunk],
                        [d.text for d in chunk],
                        cfg.max_length,
                    ),
                    self.special_ids,
                    cfg.keep_special,
                )
                counts.windows += len(windows)  # each runs: make_batches drops none of these
                counts.documents_without_tokens += len(chunk) - len({w.doc_id for w in windows})
                yield windows

        for pool in pools(chunks(), POOL_BATCHES * self.batch_tokens):
            yield from make_batches(
                pool,
                batch_tokens=self.batch_tokens,
                pad_id=self.pad_id,
                special_ids=self.special_ids,
                keep_special=cfg.keep_special,
                max_padding=MAX_PADDING,
                min_positions=MIN_BATCH_POSITIONS,
            )

    def fold_batch(
        self,
        stats: EmbeddingStatistics,
        sample: ActivationSample | None,
        batch: Batch,
        counts: Counts,
    ) -> None:
        """Forward + fold one batch; if the forward runs out of device memory, split and retry
        (:meth:`_forwards`): each part is folded before the next one runs."""
        splits = [0]
        for part, hidden, seconds in self._forwards(batch, splits):
            self._fold(stats, sample, part, hidden, seconds, counts)
            del hidden
        counts.oom_batch_splits += splits[0]

    def _forwards(self, batch: Batch, splits: list[int]) -> Iterator[_Forwarded]:
        """(part, its hidden states, the forward's seconds): the whole batch, or, where its
        forward runs out of device memory, its halves (recursively, each split counted in
        ``splits[0]``), each run when the previous one has been taken.

        Only the forward pass is retried: it has no side effects, and a part is folded once.
        A single window that still does not fit raises an error that says what to change.
        """
        t1 = time.perf_counter()
        try:
            hidden = self.forward(batch)
        except torch.OutOfMemoryError:
            hidden = None  # retried below, outside the handler (its traceback holds memory)
        if hidden is None:
            if self.device == "cuda":
                torch.cuda.empty_cache()
            if batch.input_ids.shape[0] == 1:
                raise torch.OutOfMemoryError(
                    f"one window of {batch.input_ids.shape[1]} tokens does not fit in device "
                    "memory; lower --max-length or --batch-tokens, or use a larger device"
                )
            splits[0] += 1
            for half in batch.split():
                for part, h, seconds in self._forwards(half, splits):
                    yield part, h, seconds
                    del h
            return
        self._synchronize()  # on a GPU the forward's kernels are its time, not the fold's
        yield batch, hidden, time.perf_counter() - t1

    def _fold(
        self,
        stats: EmbeddingStatistics,
        sample: ActivationSample | None,
        batch: Batch,
        hidden: list[torch.Tensor],
        forward_seconds: float,
        counts: Counts,
    ) -> None:
        """Fold one batch's hidden states into ``stats`` and ``sample`` and count it."""
        t2 = time.perf_counter()
        finite = finite_layers(hidden)  # once for the statistics and the sample
        stats.update(hidden, batch.input_ids, batch.keep, finite=finite)
        if sample is not None:
            sample.update(
                hidden, batch.input_ids, batch.keep, batch.doc_ids, batch.window_index,
                finite=finite, attention_mask=batch.attention_mask,
            )
        self._synchronize()
        counts.forward_seconds += forward_seconds
        counts.fold_seconds += time.perf_counter() - t2
        count_batch(counts, batch, self.special_ids, self.unk_id)

    def lanes(self) -> int:
        """The forward lanes this extractor runs (:mod:`.lanes`): on a CPU ``--cpu-lanes``,
        else one a CPU thread torch has; one on GPUs."""
        if self.device != "cpu":
            return 1
        return lanes_for(self.options.cpu_lanes, torch.get_num_threads())

    def _fold_in_lanes(
        self,
        stats: EmbeddingStatistics,
        sample: ActivationSample | None,
        batches: Iterator[Batch],
        counts: Counts,
    ) -> None:
        """Fold ``batches`` as :meth:`fold_batch` does, in :meth:`lanes` lanes on a CPU (the
        forwards at once, the intra-op threads shared out, the folds in batch order:
        :func:`~.lanes.in_lanes`)."""
        lanes = self.lanes()
        if lanes == 1:
            for batch in batches:
                self.fold_batch(stats, sample, batch, counts)
            return

        def work(batch: Batch) -> tuple[list[_Forwarded], int]:
            splits = [0]
            return list(self._forwards(batch, splits)), splits[0]

        def finish(_: Batch, done: tuple[list[_Forwarded], int]) -> None:
            parts, splits = done
            for part, hidden, seconds in parts:
                self._fold(stats, sample, part, hidden, seconds, counts)
            counts.oom_batch_splits += splits
            parts.clear()  # the hidden states go now, not when the lane takes its next batch

        in_lanes(batches, work, finish, lanes)

    def _synchronize(self) -> None:
        """Wait for the GPUs this extractor uses (all of them when the model is split), so
        that a clock read after it counts the work launched before it."""
        if self.device == "cuda":
            for gpu in range(torch.cuda.device_count() if self.device_map is not None else 1):
                torch.cuda.synchronize(gpu if self.device_map is not None else None)

    @torch.inference_mode()
    def fold_shard(
        self, shard: Shard, stats: EmbeddingStatistics, sample: ActivationSample | None
    ) -> Counts:
        """Fold every document of ``shard`` into ``stats`` and ``sample`` (in place).

        The accumulators may already hold other shards: an extractor actor keeps one running
        pair across the shards it processes and flushes it as one checkpoint group. Returns
        this shard's counts. If it raises, the accumulators hold part of the shard and must
        be discarded.
        """
        t0 = time.perf_counter()
        counts = Counts()
        report = ReadReport()
        docs = read_shard(shard, self.corpus, report)
        self._fold_in_lanes(stats, sample, self.batches(docs, counts), counts)
        counts.documents = report.documents
        counts.duplicates = report.duplicates
        counts.skipped = dict(report.skipped)
        counts.seconds = time.perf_counter() - t0
        return counts

    @torch.inference_mode()
    def process(
        self, shard: Shard
    ) -> tuple[EmbeddingStatistics, ActivationSample | None, Counts]:
        """Fold every document of ``shard``; returns its own statistics, sample and counts."""
        stats = self.new_statistics()
        sample = self.new_sample()
        counts = self.fold_shard(shard, stats, sample)
        return stats, sample, counts
