"""Documents -> model windows -> length-bucketed, right-padded batches.

Windows follow DESIGN.md's conventions: each document is tokenized with the tokenizer's
defaults (``add_special_tokens=True``), and a document longer than ``max_length`` is split
into consecutive windows by the fast tokenizer's overflow mechanism (stride 0), each window
wrapped in the special tokens the model saw in training ([CLS] … [SEP], BOS, …). Content
tokens are partitioned exactly: nothing is dropped, nothing is counted twice. Positions
restart at 0 in each window; batches are right-padded, so every real token keeps its position.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Window:
    doc_id: int
    index: int  # window number within its document
    input_ids: list[int]


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) long, right-padded
    attention_mask: torch.Tensor  # (B, T) long
    keep: torch.Tensor  # (B, T) bool: counted tokens (not padding, not special unless kept)
    doc_ids: torch.Tensor  # (B,) int64
    window_index: torch.Tensor  # (B,) int64

    @property
    def num_tokens(self) -> int:
        return int(self.keep.sum())

    def split(self) -> tuple[Batch, Batch]:
        """Two halves by rows (used to retry a batch that ran out of device memory)."""
        h = self.input_ids.shape[0] // 2
        parts = [
            Batch(
                input_ids=self.input_ids[sl],
                attention_mask=self.attention_mask[sl],
                keep=self.keep[sl],
                doc_ids=self.doc_ids[sl],
                window_index=self.window_index[sl],
            )
            for sl in (slice(0, h), slice(h, None))
        ]
        return parts[0], parts[1]


def tokenize_windows(
    tokenizer, doc_ids: Sequence[int], texts: Sequence[str], max_length: int
) -> list[Window]:
    """Split ``texts`` into windows of at most ``max_length`` tokens (special tokens included)."""
    if not texts:
        return []
    enc = tokenizer(
        list(texts),
        add_special_tokens=True,
        truncation=True,
        max_length=max_length,
        return_overflowing_tokens=True,
        stride=0,
        return_attention_mask=False,
        return_token_type_ids=False,
    )
    mapping = enc["overflow_to_sample_mapping"]
    windows, last, k = [], -1, 0
    for ids, sample in zip(enc["input_ids"], mapping, strict=True):
        k = k + 1 if sample == last else 0
        last = sample
        windows.append(Window(int(doc_ids[sample]), k, list(ids)))
    return windows


def make_batches(
    windows: Sequence[Window],
    *,
    batch_tokens: int,
    pad_id: int,
    special_ids: Sequence[int],
    keep_special: bool,
) -> Iterator[Batch]:
    """Length-bucketed batches: windows sorted by length, packed while B × T ≤ batch_tokens.

    Sorting keeps padding small; the order is deterministic (length, then input order).
    Windows without a single counted token are dropped here (they contribute nothing).
    """
    specials = torch.tensor(sorted(set(special_ids)), dtype=torch.long)
    order = sorted(range(len(windows)), key=lambda i: (len(windows[i].input_ids), i))
    start = 0
    while start < len(order):
        longest = len(windows[order[start]].input_ids)
        stop = start + 1
        while stop < len(order):
            t = max(longest, len(windows[order[stop]].input_ids))
            if t * (stop - start + 1) > batch_tokens:
                break
            longest, stop = t, stop + 1
        chosen = [windows[i] for i in order[start:stop]]
        start = stop
        width = max(len(w.input_ids) for w in chosen)
        ids = np.full((len(chosen), width), pad_id, dtype=np.int64)
        mask = np.zeros((len(chosen), width), dtype=np.int64)
        for r, w in enumerate(chosen):
            ids[r, : len(w.input_ids)] = w.input_ids
            mask[r, : len(w.input_ids)] = 1
        input_ids = torch.from_numpy(ids)
        attention = torch.from_numpy(mask)
        keep = attention.bool()
        if not keep_special and specials.numel():
            keep &= ~torch.isin(input_ids, specials)
        if not bool(keep.any()):
            continue
        yield Batch(
            input_ids=input_ids,
            attention_mask=attention,
            keep=keep,
            doc_ids=torch.tensor([w.doc_id for w in chosen], dtype=torch.int64),
            window_index=torch.tensor([w.index for w in chosen], dtype=torch.int64),
        )
