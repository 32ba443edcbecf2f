"""The extractor: shards of text in, folded into :class:`EmbeddingStatistics`. No Ray here.

An extractor loads the tokenizer and model once, then for each shard reads documents in
chunks, splits them into windows, runs length-bucketed batches through the model with
``output_hidden_states=True`` and folds the selected layers' hidden states into the shard's
statistics on the model's device. Memory is bounded by ``docs_per_chunk`` and
``batch_tokens``, never by the shard or corpus size (the statistics themselves are bounded by
the vocabulary seen). :meth:`ShardProcessor.fold_shard` folds a shard into accumulators that
may hold earlier shards; :meth:`ShardProcessor.process` folds one shard into fresh ones.
:mod:`embgeom_ray.distributed.actor_pool` wraps this in Ray actors; tests and benchmarks use it directly.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import JobConfig
from ..core.samples import ActivationSample
from ..core.statistics import EmbeddingStatistics
from .corpus import CorpusSpec, Document, ReadReport, Shard, read_shard
from .model_loading import load_model, load_tokenizer
from .windows import Batch, make_batches, tokenize_windows


@dataclass
class ShardCounts:
    """What one shard contributed; summed over shards into the manifest."""

    documents: int = 0
    windows: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    batches: int = 0
    oom_splits: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    forward_seconds: float = 0.0
    fold_seconds: float = 0.0
    seconds: float = 0.0

    def add(self, other: ShardCounts) -> None:
        for name in ("documents", "windows", "tokens", "padded_tokens", "batches", "oom_splits"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("forward_seconds", "fold_seconds", "seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for k, v in other.skipped.items():
            self.skipped[k] = self.skipped.get(k, 0) + v

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ShardCounts:
        return cls(**d)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        from ..errors import ConfigError

        raise ConfigError("--device cuda was asked for, but torch sees no CUDA device here")
    return device


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
        config: the job's options.
        layers: resolved HF hidden-state indices to keep.
        metadata: identity strings stamped on every statistics object (model and tokenizer
            fingerprints, …), so shards of different measurements can never be merged.
        clip_dims: dimensions whose clipped cosine statistics are folded too (``--clip-dims``).
    """

    def __init__(
        self,
        config: JobConfig,
        layers: list[int],
        metadata: dict[str, str],
        clip_dims: list[int] | None = None,
    ) -> None:
        self.config = config
        self.clip_dims = clip_dims
        self.layers = list(layers)
        self.metadata = dict(metadata)
        self.device = resolve_device(config.device)
        self.tokenizer = load_tokenizer(config.model, config.revision, config.trust_remote_code)
        self.model = load_model(
            config.model, config.revision, config.dtype, self.device, config.trust_remote_code
        )
        hidden = self.model.config.get_text_config().hidden_size
        self.dim = int(hidden)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = 0  # masked out by attention_mask and keep; never counted
        self.special_ids = list(self.tokenizer.all_special_ids)
        self.corpus = CorpusSpec(config.corpus, config.text_column, config.split)
        if self.device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False  # the model's own matmuls stay fp32

    def new_statistics(self) -> EmbeddingStatistics:
        return EmbeddingStatistics(
            self.layers,
            self.dim,
            max_positions=self.config.max_length,
            device=self.device,
            metadata=self.metadata,
            clip_dims=self.clip_dims,
            comoment_precision=self.config.comoment_precision,
        )

    def new_sample(self) -> ActivationSample | None:
        cfg = self.config
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

    def batches(self, docs: Iterator[Document], counts: ShardCounts) -> Iterator[Batch]:
        """Windows of ``docs`` packed into batches, chunk by chunk (bounded memory)."""
        cfg = self.config
        for chunk in _chunks(docs, cfg.docs_per_chunk):
            windows = tokenize_windows(
                self.tokenizer, [d.doc_id for d in chunk], [d.text for d in chunk], cfg.max_length
            )
            counts.windows += len(windows)
            yield from make_batches(
                windows,
                batch_tokens=cfg.batch_tokens,
                pad_id=self.pad_id,
                special_ids=self.special_ids,
                keep_special=cfg.keep_special,
            )

    def fold_batch(
        self,
        stats: EmbeddingStatistics,
        sample: ActivationSample | None,
        batch: Batch,
        counts: ShardCounts,
    ) -> None:
        """Forward + fold one batch; if the forward runs out of device memory, split and retry.

        Only the forward pass is retried: it has no side effects. The fold runs after it, so a
        batch is folded exactly once. A single window that still does not fit raises an error
        that says what to change.
        """
        t1 = time.perf_counter()
        try:
            hidden = self.forward(batch)
        except torch.OutOfMemoryError:
            if self.device == "cuda":
                torch.cuda.empty_cache()
            if batch.input_ids.shape[0] == 1:
                raise torch.OutOfMemoryError(
                    f"one window of {batch.input_ids.shape[1]} tokens does not fit in device "
                    "memory; lower --max-length or --batch-tokens, or use a larger device"
                ) from None
            counts.oom_splits += 1
            for half in batch.split():
                self.fold_batch(stats, sample, half, counts)
            return
        t2 = time.perf_counter()
        stats.update(hidden, batch.input_ids, batch.keep)
        if sample is not None:
            sample.update(hidden, batch.input_ids, batch.keep, batch.doc_ids, batch.window_index)
        del hidden
        if self.device == "cuda":
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        counts.forward_seconds += t2 - t1
        counts.fold_seconds += t3 - t2
        counts.tokens += batch.num_tokens
        counts.padded_tokens += int(batch.input_ids.numel())
        counts.batches += 1

    @torch.inference_mode()
    def fold_shard(
        self, shard: Shard, stats: EmbeddingStatistics, sample: ActivationSample | None
    ) -> ShardCounts:
        """Fold every document of ``shard`` into ``stats`` and ``sample`` (in place).

        The accumulators may already hold other shards: an extractor actor keeps one running
        pair across the shards it processes and flushes it as one checkpoint group. Returns
        this shard's counts. If it raises, the accumulators hold part of the shard and must
        be discarded.
        """
        t0 = time.perf_counter()
        counts = ShardCounts()
        report = ReadReport()
        docs = read_shard(shard, self.corpus, report)
        for batch in self.batches(docs, counts):
            self.fold_batch(stats, sample, batch, counts)
        counts.documents = report.documents
        counts.skipped = dict(report.skipped)
        counts.seconds = time.perf_counter() - t0
        return counts

    @torch.inference_mode()
    def process(
        self, shard: Shard
    ) -> tuple[EmbeddingStatistics, ActivationSample | None, ShardCounts]:
        """Fold every document of ``shard``; returns its own statistics, sample and counts."""
        stats = self.new_statistics()
        sample = self.new_sample()
        counts = self.fold_shard(shard, stats, sample)
        return stats, sample, counts
