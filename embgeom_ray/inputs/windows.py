"""Documents -> model windows -> length-bucketed, right-padded batches.

Windows follow docs/design.md's conventions: each document is tokenized with the tokenizer's
defaults (``add_special_tokens=True``), and a document longer than ``max_length`` is split
into consecutive windows, as a fast tokenizer's overflow (stride 0) splits it (made here:
:func:`tokenize_windows`), each window wrapped in the special tokens the model saw in training
([CLS] … [SEP], BOS, …). Content
tokens are partitioned exactly: nothing is dropped, nothing is counted twice. Positions
restart at 0 in each window; batches are right-padded, so every real token keeps its position.

Batching (:func:`plan_batches`). A batch of ``B`` windows, the longest ``T`` tokens, runs
``B × T`` positions; the real ones are the windows' lengths, the rest is padding the model
computes for nothing. Windows are gathered into *pools* of about ``pool_tokens`` real tokens
(:func:`pools`, :data:`POOL_BATCHES` batches' worth by default) and each pool is packed so that

    padded positions ≤ (1 + max_padding) × real positions        (every pool, hence in total)

with as few batches as that allows: windows of one length fill batches of
``⌊batch_tokens / length⌋`` rows (no padding at all); what is left of each length (fewer rows
than a full batch) is merged with the leftovers of neighbouring lengths, cheapest merge first
(a merge pads the narrower rows to the wider width), while the pool's padding stays within
the budget ``max_padding × real tokens``; a batch still smaller than
:data:`MIN_BATCH_POSITIONS` positions is then merged into a neighbour (tiny pools only). The
plan depends only on the pool's window lengths and order, so the same shard always gives the
same batches, whatever the machine or the number of workers.

Batching never changes what is measured: the statistics are sums over tokens (the same up to
float rounding in any order), and the sample's keys are hashes of (document, window,
position) (:func:`embgeom_ray.core.samples.occurrence_keys`), blind to batches. The forward's
own float32 rounding is another matter: a window's hidden states may differ in the last bits
with the batch it shares, and on some CPUs with the number of torch threads (on an AVX-512
Xeon, MiniLM on 1 thread against 2 moved layer 6's per-type mean norms by up to 1.2e-6
relative). Since a shard always gets the same batches, two runs of the same corpus differ only
where their extractors run different thread counts (``--cpus-per-worker``).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

#: A pool holds about ``POOL_BATCHES × batch_tokens`` real tokens of windows, sorted together.
POOL_BATCHES = 32
#: Padding budget: padded positions ≤ (1 + MAX_PADDING) × real positions in every pool.
MAX_PADDING = 0.02
#: Batches of fewer positions are merged into a neighbour even past the budget (see
#: :func:`plan_batches`).
MIN_BATCH_POSITIONS = 64


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

    @property
    def num_positions(self) -> int:
        """Real (unpadded) positions: the windows' lengths, special tokens included."""
        return int(self.attention_mask.sum())

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


#: a text whose tokens the special tokens surround (:func:`special_tokens_around`)
_PROBE = "a"


def special_tokens_around(tokenizer) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after one text's tokens (BERT:
    ([CLS], [SEP]); RoBERTa: (<s>, </s>); Llama: (BOS, none); GPT-2: none): a probe text
    tokenized with and without them, the difference found around it."""
    bare = list(tokenizer(_PROBE, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(_PROBE, add_special_tokens=True)["input_ids"])
    count = getattr(tokenizer, "num_special_tokens_to_add", None)
    for i in range(len(full) - len(bare) + 1):
        if full[i : i + len(bare)] == bare:
            if callable(count) and count(pair=False) != len(full) - len(bare):
                raise ValueError(
                    f"the tokenizer adds {count(pair=False)} special tokens to a text, but "
                    f"{_PROBE!r} gains {len(full) - len(bare)}; windows cannot be cut"
                )
            return full[:i], full[i + len(bare) :]
    raise ValueError(
        f"the tokenizer's special tokens do not surround a text's own tokens ({_PROBE!r} gives "
        f"{bare} alone and {full} with special tokens); windows cannot be cut"
    )


def tokenize_windows(
    tokenizer, doc_ids: Sequence[int], texts: Sequence[str], max_length: int
) -> list[Window]:
    """Split ``texts`` into windows of at most ``max_length`` tokens (special tokens included).

    Each text is tokenized once without special tokens; its tokens are cut into consecutive
    runs of ``max_length − s`` (s special tokens a window) and each run is wrapped in the
    tokenizer's own special tokens (:func:`special_tokens_around`): the windows a fast
    tokenizer's overflow (``return_overflowing_tokens``, stride 0) gives, made here because
    transformers 5.17.0 returned truncated overflow windows (a 173-token document gave windows
    of 128 and 4 tokens: 85% of a long document's tokens were lost, silently). A text that
    tokenizes to nothing (only characters the tokenizer drops, such as U+200B for BERT's
    WordPiece) gives no window: the overflow's window of special tokens alone would hold no
    text, and would count as a window that never runs.
    """
    if not texts:
        return []
    before, after = special_tokens_around(tokenizer)
    run = max_length - len(before) - len(after)
    if run < 1:
        raise ValueError(
            f"max_length {max_length} leaves no room for a token beside the tokenizer's "
            f"{len(before) + len(after)} special tokens"
        )
    enc = tokenizer(
        list(texts),
        add_special_tokens=False,
        return_attention_mask=False,
        return_token_type_ids=False,
        verbose=False,  # texts longer than the model's maximum are cut here
    )
    windows = []
    for doc, ids in zip(doc_ids, enc["input_ids"], strict=True):
        for k, a in enumerate(range(0, len(ids), run)):
            windows.append(Window(int(doc), k, before + list(ids[a : a + run]) + after))
    return windows


def counted_windows(
    windows: Sequence[Window], special_ids: Sequence[int], keep_special: bool
) -> list[Window]:
    """The windows that hold a counted token, the only ones the model runs: any token with
    ``keep_special``, else one that is not special (a window of [UNK]s alone holds none)."""
    if keep_special:
        return [w for w in windows if w.input_ids]
    special_set = set(special_ids)
    return [w for w in windows if any(i not in special_set for i in w.input_ids)]


def pools(chunks: Iterable[Sequence[Window]], pool_tokens: int) -> Iterator[list[Window]]:
    """Regroup chunks of windows into pools of at least ``pool_tokens`` tokens (the last: less).

    A pool is closed as soon as it reaches ``pool_tokens`` tokens (special tokens included), so
    it holds fewer than ``pool_tokens`` plus one chunk's tokens. Order is kept.
    """
    if pool_tokens < 1:
        raise ValueError(f"pool_tokens must be positive, got {pool_tokens}")
    pool: list[Window] = []
    size = 0
    for chunk in chunks:
        pool.extend(chunk)
        size += sum(len(w.input_ids) for w in chunk)
        if size >= pool_tokens:
            yield pool
            pool, size = [], 0
    if pool:
        yield pool


@dataclass
class _Segment:
    """Leftover windows of one or more neighbouring lengths, to become one batch."""

    members: list[int]  # indices into the lengths, ascending (length, index)
    width: int  # the longest member's length


def plan_batches(
    lengths: Sequence[int],
    *,
    batch_tokens: int,
    max_padding: float = MAX_PADDING,
    min_positions: int = MIN_BATCH_POSITIONS,
) -> list[list[int]]:
    """Group windows (given by their lengths) into batches; returns lists of indices.

    Guarantees, with ``R = Σ lengths`` and a batch's positions ``rows × its longest length``:

    * every index appears in exactly one batch;
    * a batch holds at most ``batch_tokens`` positions, unless it is a single window longer
      than that;
    * padded positions (Σ over batches of positions − real tokens) ≤ ``max_padding × R + E``,
      where ``E`` (below) is 0 unless a batch of fewer than ``min_positions`` positions is left
      after the budgeted merges (in pools of the default size small leftovers are the cheapest
      merges, so they go first), and always below ``min_positions`` times the number of
      distinct lengths.

    Method: the windows of each length ``ℓ`` (in index order) fill batches of
    ``⌊batch_tokens / ℓ⌋`` rows, which need no padding. The rest of each length (fewer rows
    than that) starts as its own batch; two neighbouring leftover batches (in length order) ``a``
    (narrower, ``rows_a`` rows, width ``w_a``) and ``b`` (width ``w_b``) may merge when
    ``(rows_a + rows_b) × w_b ≤ batch_tokens``, at the cost of ``rows_a × (w_b − w_a)`` more
    padded positions; merges are taken cheapest first (ties: narrower first) while the total
    stays within the budget. Each merge saves one batch, so this spends the budget where it
    saves most batches per padded position.

    Then a leftover batch of fewer than ``min_positions`` positions is merged into the
    neighbour where that costs less (if it fits and costs fewer than ``min_positions`` padded
    positions; these costs are ``E``), narrowest first. Such matrix products run at per-call
    overhead, and CPU BLAS kernels take thread-count-dependent paths for them: MiniLM's
    hidden states for 5–11 positions differ in the last bits between 1 and 2 threads
    (measured), which would make results depend on the CPUs per worker; 12 to 200 positions
    were bit-identical.

    Time ``O(n log n)``; the merge steps work on at most one leftover batch per distinct
    length.

    Batches come out ordered by width, then by their first index; within a batch, indices
    are in (length, index) order.
    """
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be positive, got {batch_tokens}")
    if not max_padding >= 0:
        raise ValueError(f"max_padding must be >= 0, got {max_padding}")
    full, leftovers = _full_batches(lengths, batch_tokens)
    merging = _Leftovers(leftovers, batch_tokens)
    merging.merge_within_budget(max_padding * float(sum(lengths)))
    merging.merge_small(min_positions)
    batches = full + merging.batches()
    batches.sort(key=lambda members: (lengths[members[-1]], members[0]))
    return batches


def _full_batches(
    lengths: Sequence[int], batch_tokens: int
) -> tuple[list[list[int]], list[_Segment]]:
    """The windows of each length ℓ (ascending; within one, in index order) as full batches
    of ⌊batch_tokens / ℓ⌋ rows (at least one), and the rest of each length as one leftover
    segment, in length order."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    full: list[list[int]] = []
    segments: list[_Segment] = []
    for length, run_iter in itertools.groupby(order, key=lengths.__getitem__):
        run = list(run_iter)
        rows = max(1, batch_tokens // max(1, length))
        whole = len(run) - len(run) % rows
        full.extend(run[s : s + rows] for s in range(0, whole, rows))
        if whole < len(run):
            segments.append(_Segment(run[whole:], length))
    return full, segments


class _Leftovers:
    """The leftover segments of :func:`plan_batches` in length order, as a doubly linked list
    whose neighbours merge (the narrower into the wider) into batches of at most
    ``batch_tokens`` positions."""

    def __init__(self, segments: list[_Segment], batch_tokens: int) -> None:
        n = len(segments)
        self.segments = segments
        self.batch_tokens = batch_tokens
        self.nxt = list(range(1, n + 1))  # the next live segment (n: none)
        self.prv = list(range(-1, n - 1))  # the previous live segment (-1: none)
        self.alive = [True] * n

    def fits(self, a: int, b: int) -> bool:
        """Whether segments a and b (the wider) together fit one batch."""
        rows = len(self.segments[a].members) + len(self.segments[b].members)
        return rows * self.segments[b].width <= self.batch_tokens

    def cost(self, a: int, b: int) -> int:
        """The padded positions of merging a into its wider neighbour b: rows_a × (w_b − w_a)."""
        return len(self.segments[a].members) * (self.segments[b].width - self.segments[a].width)

    def merge(self, a: int, into: int) -> None:
        """Merge segment a into its next live segment ``into`` (a's members first)."""
        self.segments[into].members = self.segments[a].members + self.segments[into].members
        self.alive[a] = False
        self.prv[into] = self.prv[a]
        if self.prv[a] >= 0:
            self.nxt[self.prv[a]] = into

    def merge_within_budget(self, budget: float) -> None:
        """Merge neighbours that fit one batch, cheapest first (ties: narrower first), while
        the padded positions they add stay within ``budget`` (a heap of offers; an offer is
        stale once either side has merged since)."""
        n = len(self.segments)
        heap: list[tuple[int, int, int, int, int]] = []

        def offer(a: int) -> None:
            b = self.nxt[a]
            if b < n and self.fits(a, b):
                ra, rb = len(self.segments[a].members), len(self.segments[b].members)
                heapq.heappush(heap, (self.cost(a, b), a, b, ra, rb))

        for a in range(n):
            offer(a)
        spent = 0
        while heap:
            cost, a, b, ra, rb = heapq.heappop(heap)
            if not (
                self.alive[a]
                and self.alive[b]
                and self.nxt[a] == b
                and len(self.segments[a].members) == ra
                and len(self.segments[b].members) == rb
            ):
                continue  # stale: a or b has merged since this offer
            if spent + cost > budget:
                break  # the cheapest possible merge no longer fits, so none does
            spent += cost
            self.merge(a, b)
            if self.prv[b] >= 0:
                offer(self.prv[b])
            offer(b)

    def merge_small(self, min_positions: int) -> None:
        """Merge each segment of fewer than ``min_positions`` positions, narrowest first, into
        the neighbour where that costs less, if it fits and costs fewer than ``min_positions``
        padded positions (ties: into the previous one), past the budget."""
        n = len(self.segments)
        s = 0
        while s < n:
            if not self.alive[s]:
                s += 1
                continue
            if len(self.segments[s].members) * self.segments[s].width >= min_positions:
                s = self.nxt[s]
                continue
            p, b = self.prv[s], self.nxt[s]
            options = []
            if p >= 0 and self.fits(p, s):
                options.append((self.cost(p, s), 0, p, s))
            if b < n and self.fits(s, b):
                options.append((self.cost(s, b), 1, s, b))
            options = [o for o in options if o[0] < min_positions]
            if not options:
                s = b
                continue
            _, _, a, into = min(options)
            self.merge(a, into)
            s = into

    def batches(self) -> list[list[int]]:
        """The live segments' members, in length order."""
        return [s.members for s, ok in zip(self.segments, self.alive, strict=True) if ok]


def make_batches(
    windows: Sequence[Window],
    *,
    batch_tokens: int,
    pad_id: int,
    special_ids: Sequence[int],
    keep_special: bool,
    max_padding: float = MAX_PADDING,
    min_positions: int = MIN_BATCH_POSITIONS,
) -> Iterator[Batch]:
    """The windows of one pool as right-padded batches planned by :func:`plan_batches`.

    Windows without a single counted token (:func:`counted_windows`) contribute nothing and
    are dropped before planning, so they are never run.
    """
    specials = torch.tensor(sorted(set(special_ids)), dtype=torch.long)
    windows = counted_windows(windows, special_ids, keep_special)
    plan = plan_batches(
        [len(w.input_ids) for w in windows],
        batch_tokens=batch_tokens,
        max_padding=max_padding,
        min_positions=min_positions,
    )
    for members in plan:
        chosen = [windows[i] for i in members]
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
        yield Batch(
            input_ids=input_ids,
            attention_mask=attention,
            keep=keep,
            doc_ids=torch.tensor([w.doc_id for w in chosen], dtype=torch.int64),
            window_index=torch.tensor([w.index for w in chosen], dtype=torch.int64),
        )
