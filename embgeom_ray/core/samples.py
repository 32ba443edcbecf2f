"""Mergeable, bounded random samples of token occurrences, folded next to the statistics.

Some metrics need points, not moments (K-means clusters, LID, silhouette, Cai et al.'s
type-uniform S_inter). :class:`ActivationSample` keeps two bounded samples of the kept token
occurrences, with each sampled occurrence's vector in *every* selected layer (the same
occurrences in all layers):

uniform sample (bottom-k sampling)
    Every occurrence o = (document, window, position-in-window) gets a deterministic 63-bit key
    h(o) = splitmix64-chain(seed, doc_id, window_index, position) (:func:`occurrence_keys`).
    The sample is the ``size`` occurrences with the smallest keys, i.e. a uniform random sample
    without replacement of size min(size, N) (Cohen & Kaplan 2007, bottom-k sketches).
type-uniform sample (Cai et al. 2021's S_inter: one random occurrence per token type)
    Per token type t the occurrence with the smallest key (a min-hash, hence a uniformly random
    occurrence of t). To keep memory bounded whatever the vocabulary, only the ``type_size``
    types with the smallest type keys g(t) = splitmix64-chain(seed, token_id)
    (:func:`type_keys`) are kept: a uniform random subset of the types seen (a KMV / bottom-k
    distinct-value sample, Bar-Yossef et al. 2002), so averages over types stay unbiased.

content keys (which occurrences are the same point)
    Every sampled occurrence also carries a 63-bit *content key* c(o) (:func:`content_keys`): a
    hash of what the model saw for it. With the rule ``"window"`` (bidirectional encoders:
    every position attends to the whole window) that is the window's token ids and the
    position; with ``"prefix"`` (causal decoders: a position sees only the tokens up to it)
    the token ids up to and including the position, and the position. Two occurrences with
    equal content keys had the same input, so their hidden states are the same point up to the
    forward's rounding (which depends on how the windows were batched): the sampled metrics
    count such repeats as one point by their key (:func:`embgeom_ray.core.distinct.distinct_rows`),
    not by float equality, so the point set does not depend on batching, sharding, workers,
    device or dtype. Samples written before content keys existed (format version 1) get the
    rule ``"vectors"`` on loading: a hash of the occurrence's stored vectors in every layer
    (equal keys: bit-identical vectors), the behaviour of those versions.

Both are *exactly* mergeable: ties are broken lexicographically on (key, doc_id, window,
position, content key) (and (type key, token_id)), a repeated occurrence (equal in all five) is
kept once, and the selected set depends only on the set of occurrences seen — never on
batching, sharding, worker count or merge order. Runs over different corpora can give two
documents the same doc_id (ids hash the file's path relative to its corpus root: ``part.jsonl``
in two directories); their occurrences differ in content key and are both kept, so a merge of
such runs is still a uniform sample of the union (the two share their key h(o): each is as
likely to enter as any other occurrence). Stored arrays are written in a canonical order, so
two samples of the same occurrences serialize to the same bytes.

Occurrences whose vector is not finite (NaN/inf) in any selected layer are skipped entirely (a
sampled occurrence must have a vector in every layer). Vectors are stored as float32: exact for
fp32/bf16/fp16 models (the hidden states are at most float32), a rounding for float64 inputs.
Memory: (size + type_size) × len(layers) × dim float32 plus six int64 per entry, whatever the
corpus size (e.g. 4096 + 4096 entries × 13 layers × 768 dims ≈ 330 MB for BERT-base).

The type is a sketch in the Apache DataSketches sense
(:class:`~embgeom_ray.core.sketch.Sketch`, the file format shared with the statistics):
``update`` / ``merge`` / ``save``-``load`` (safetensors, no pickle) / read-only results
(:meth:`ActivationSample.points`, :meth:`ActivationSample.type_points`,
:meth:`ActivationSample.to_table`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from ..errors import StatisticsMismatchError
from ..integrity import FileRef, as_ref, open_verified
from .options import SampleOptions
from .sketch import SafetensorsFile, Sketch, check_array

if TYPE_CHECKING:  # pandas is imported where a table is built: the extractors never build one
    import pandas as pd

_DEFAULTS = SampleOptions()

#: the ``format`` of the header (this name since the first version).
FORMAT = "embgeom_ray.samples"
FORMAT_VERSION = 2
#: format names and versions read (version 1: no content keys; see the module docstring).
_READS = {FORMAT: frozenset({1, 2})}
#: rules of the content keys (:func:`content_keys`); "vectors" only for version-1 samples.
CONTENT_RULES = ("window", "prefix", "vectors")

#: columns of ``samples.parquet`` (:meth:`ActivationSample.to_table`).
SAMPLE_COLUMNS = [
    "layer", "sample", "key", "token_id", "token", "doc_id", "window", "position",
    "content_key", "vector",
]  # fmt: skip

_I64 = torch.int64
_F32 = torch.float32
_U64 = 1 << 64
_MASK63 = (1 << 63) - 1


def _signed64(v: int) -> int:
    """The int64 whose two's-complement bits are ``v mod 2**64``."""
    v %= _U64
    return v - _U64 if v >= 1 << 63 else v


_GOLDEN = _signed64(0x9E3779B97F4A7C15)
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)
_DOMAIN_OCCURRENCE = _signed64(0x6F63637572656E63)  # "occurenc": key domain of occurrences
_DOMAIN_TYPE = _signed64(0x746F6B656E747970)  # "tokentyp": key domain of token types
_DOMAIN_CONTENT = _signed64(0x636F6E74656E7473)  # "contents": key domain of window contents


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """Steele, Lea & Flood's SplitMix64 finaliser on int64 tensors (bits as uint64).

    z ← x + 0x9E3779B97F4A7C15; z ← (z ⊕ z≫30)·0xBF58476D1CE4E5B9; z ← (z ⊕ z≫27)·0x94D049BB133111EB;
    z ← z ⊕ z≫31, all modulo 2⁶⁴. int64 addition and multiplication wrap modulo 2⁶⁴ in torch
    (two's complement, on CPU and CUDA), so the bits equal the uint64 reference; ``≫`` is made
    logical by masking. The tests check the result against a pure-Python implementation.
    """
    z = x.to(_I64) + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def _seed_state(seed: int, domain: int, device: torch.device | str) -> torch.Tensor:
    return splitmix64(torch.tensor(_signed64(int(seed)) ^ domain, dtype=_I64, device=device))


def occurrence_keys(
    seed: int, doc_ids: torch.Tensor, window_index: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """63-bit keys h(o) ∈ [0, 2⁶³) of token occurrences o = (doc_id, window, position).

    h = SM(SM(SM(SM(seed ⊕ D) ⊕ doc) ⊕ window) ⊕ position) ∧ (2⁶³ − 1) with SM =
    :func:`splitmix64`: a deterministic pseudo-random function of the occurrence alone.
    """
    h = _seed_state(seed, _DOMAIN_OCCURRENCE, doc_ids.device)
    h = splitmix64(h ^ doc_ids.to(_I64))
    h = splitmix64(h ^ window_index.to(_I64))
    h = splitmix64(h ^ positions.to(_I64))
    return h & _MASK63


def type_keys(seed: int, token_ids: torch.Tensor) -> torch.Tensor:
    """63-bit keys g(t) = SM(SM(seed ⊕ D') ⊕ t) ∧ (2⁶³ − 1) of token types (ids) t."""
    h = _seed_state(seed, _DOMAIN_TYPE, token_ids.device)
    return splitmix64(h ^ token_ids.to(_I64)) & _MASK63


def content_keys(
    token_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    rule: str = "window",
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, T) 63-bit content keys of the occurrences of a batch of right-padded windows.

    Each real position i of a row (``attention_mask`` 1; all positions when None) contributes
    m(i, t_i) = SM(SM(D ⊕ p_i) ⊕ t_i), SM = :func:`splitmix64`, p_i its position within the
    window (``positions``; default the column index) and t_i its token id; padding contributes
    0. With ``rule="window"`` an occurrence at position p gets c = SM(SM(Σ_i m(i, t_i)) ⊕ p),
    the sum over the whole window; with ``rule="prefix"`` the sum runs over the positions
    p_i ≤ p only (a causal model's input for position p). Sums wrap modulo 2⁶⁴ (int64, as in
    :func:`splitmix64`), so c depends on the window's content, never on the row's padding or on
    the other rows of the batch. Equal keys for different inputs need a 64-bit collision.
    """
    if rule not in ("window", "prefix"):
        raise ValueError(f"rule must be 'window' or 'prefix', got {rule!r}")
    if token_ids.dim() != 2:
        raise ValueError(f"token_ids must be (B, T), got shape {tuple(token_ids.shape)}")
    dev = token_ids.device
    if positions is None:
        positions = torch.arange(token_ids.shape[1], device=dev).expand_as(token_ids)
    positions = positions.to(dev, _I64)
    pos_state = splitmix64(_seed_state(0, _DOMAIN_CONTENT, dev) ^ positions)
    mix = splitmix64(pos_state ^ token_ids.to(_I64))
    if attention_mask is not None:
        mix = torch.where(attention_mask.to(dev).bool(), mix, torch.zeros_like(mix))
    if rule == "prefix":
        # the positions of a right-padded window ascend along the row: a running sum is a prefix
        acc = torch.cumsum(mix, dim=1)
    else:
        acc = mix.sum(dim=1, keepdim=True).expand_as(mix)
    return splitmix64(splitmix64(acc) ^ positions) & _MASK63


def vector_content_keys(vectors: np.ndarray) -> np.ndarray:
    """(n,) 63-bit keys of occurrences from their stored float32 vectors (L, n, d): a BLAKE2b
    hash of each occurrence's bytes in every layer (the ``"vectors"`` rule of version-1
    samples: equal keys for bit-identical vectors)."""
    import hashlib

    vectors = np.ascontiguousarray(np.asarray(vectors, dtype=np.float32).transpose(1, 0, 2))
    out = np.empty(len(vectors), dtype=np.int64)
    for i, v in enumerate(vectors):
        digest = hashlib.blake2b(v.tobytes(), digest_size=8).digest()
        out[i] = int.from_bytes(digest, "little") & _MASK63
    return out


def _lexsort(cols: Sequence[torch.Tensor]) -> torch.Tensor:
    """Permutation ordering rows lexicographically by ``cols`` (first = most significant)."""
    perm = torch.arange(cols[0].numel(), device=cols[0].device)
    for c in reversed(cols):
        perm = perm[torch.sort(c[perm], stable=True).indices]
    return perm


def _first_of_runs(cols: Sequence[torch.Tensor], perm: torch.Tensor) -> torch.Tensor:
    """Mask over ``perm`` marking the first row of each run of equal ``cols`` in that order."""
    first = torch.ones(perm.numel(), dtype=torch.bool, device=perm.device)
    if perm.numel() > 1:
        same = torch.ones(perm.numel() - 1, dtype=torch.bool, device=perm.device)
        for c in cols:
            s = c[perm]
            same &= s[1:] == s[:-1]
        first[1:] = ~same
    return first


def _finite_rows(h: torch.Tensor) -> torch.Tensor:
    """``isfinite(h).all(-1)`` for a layer whose float32 sum is not finite
    (:func:`~embgeom_ray.core.sketch.finite_layers`): a row whose sum is finite is finite; the
    rest (NaN, inf, or a sum that overflowed) are checked element by element."""
    finite = torch.isfinite(h.sum(dim=-1))
    if not bool(finite.all()):
        bad = ~finite
        finite[bad] = torch.isfinite(h[bad]).all(dim=-1)
    return finite


class SamplePoints(NamedTuple):
    """Sampled occurrences of one layer, in canonical order (numpy)."""

    keys: np.ndarray  # (n,) int64 occurrence keys
    token_ids: np.ndarray  # (n,) int64
    doc_ids: np.ndarray  # (n,) int64
    window_index: np.ndarray  # (n,) int64
    positions: np.ndarray  # (n,) int64, position within the window
    vectors: np.ndarray  # (n, d) float64 (stored as float32)
    content_keys: np.ndarray  # (n,) int64: equal for occurrences of the same input (module doc)


# column names of the two tables, and the lexicographic order that defines "smallest"
_OCC = ("key", "doc", "window", "position")
#: what makes two entries the same occurrence when samples merge: its place and its content key.
#: Within one corpus (doc, window, position) is unique; runs over other corpora can repeat a
#: doc id (a file of the same name relative to its corpus root, a row of a dataset), and their
#: occurrences there are other inputs, with other content keys: both are kept, so the merge
#: is the sample of the union of the runs' occurrences (``jobs.merge``).
_IDENTITY = (*_OCC, "content")
_U_COLS = (*_OCC, "token", "content")
_T_COLS = ("token", "type_key", *_OCC, "content")
_ARRAY_NAMES = {
    "key": "key",
    "doc": "doc_id",
    "window": "window",
    "position": "position",
    "token": "token_id",
    "type_key": "type_key",
    "content": "content_key",
}


#: gives the (L, len(sel), d) float32 vectors of the candidate entries ``sel``
_Take = Callable[[torch.Tensor], torch.Tensor]


class _Table:
    """Slot storage: int64 columns and (L, capacity, d) float32 vectors; ``n`` slots used.

    Slots are unordered (an entering entry takes a freed slot, so an update copies only the
    vectors that enter); :meth:`canonical` gives the canonical order.
    """

    def __init__(self, names: Sequence[str], n_layers: int, dim: int, device: torch.device):
        self.names = tuple(names)
        self.n = 0
        self.cols = {k: torch.empty(0, dtype=_I64, device=device) for k in self.names}
        self.vec = torch.empty(n_layers, 0, dim, dtype=_F32, device=device)

    def used(self, name: str) -> torch.Tensor:
        return self.cols[name][: self.n]

    def _reserve(self, needed: int, limit: int) -> None:
        cap = self.vec.shape[1]
        if needed <= cap:
            return
        new_cap = min(max(needed, 2 * cap, 16), max(limit, needed))
        # slots beyond ``n`` are never read: fresh storage need not be zeroed
        for k, c in self.cols.items():
            grown = torch.empty(new_cap, dtype=_I64, device=c.device)
            grown[:cap] = c
            self.cols[k] = grown
        vec = torch.empty(
            self.vec.shape[0], new_cap, self.vec.shape[2], dtype=_F32, device=self.vec.device
        )
        vec[:, :cap] = self.vec
        self.vec = vec

    def replace(
        self,
        keep_slots: torch.Tensor,
        new_cols: Mapping[str, torch.Tensor],
        new_vec: torch.Tensor,
        limit: int,
    ) -> None:
        """Keep the used slots ``keep_slots``; put the new entries in freed or fresh slots."""
        dev = self.vec.device
        c = int(new_vec.shape[1])
        if c == 0:
            if keep_slots.numel() == self.n:
                return
        free = torch.ones(self.n, dtype=torch.bool, device=dev)
        free[keep_slots] = False
        freed = torch.nonzero(free).flatten()
        n_new = int(keep_slots.numel()) + c
        if c <= freed.numel():
            target = freed[:c]
        else:
            target = torch.cat([freed, torch.arange(self.n, n_new, device=dev)])
        self._reserve(n_new, limit)
        for k in self.names:
            self.cols[k][target] = new_cols[k].to(dev)
        self.vec.index_copy_(1, target, new_vec.to(dev))
        if n_new < self.n:
            # compact: move the used slots beyond n_new into the remaining freed ones
            used = torch.zeros(self.n, dtype=torch.bool, device=dev)
            used[keep_slots] = True
            used[target] = True
            high = torch.nonzero(used[n_new:]).flatten() + n_new
            low = torch.nonzero(~used[:n_new]).flatten()
            for k in self.names:
                self.cols[k][low] = self.cols[k][high]
            self.vec.index_copy_(1, low, self.vec.index_select(1, high))
        self.n = n_new

    def canonical(self, order_cols: Sequence[str]) -> torch.Tensor:
        return _lexsort([self.used(k) for k in order_cols])


class ActivationSample(Sketch):
    """Bounded, exactly mergeable uniform and type-uniform samples of token occurrences.

    See the module docstring for the sampling scheme.

    Args:
        layers: HF hidden-state indices, in the order hidden states are passed to :meth:`update`.
        dim: hidden size d.
        size: k of the uniform bottom-k sample (occurrences kept).
        seed: seed of the occurrence and type keys; samples with different seeds cannot merge.
        type_uniform: also keep the type-uniform sample (one occurrence per type).
        device: where the sample lives (the extractor's device).
        metadata: identity strings (model, tokenizer fingerprints, …); :meth:`merge` refuses
            samples whose :attr:`IDENTITY_KEYS` differ (:meth:`Sketch.check_compatible`).
        type_size: how many token types the type-uniform sample keeps (default ``size``).
        content_rule: what makes two occurrences the same point (:func:`content_keys`):
            ``"window"`` for models whose positions attend to the whole window, ``"prefix"``
            for causal ones (:func:`~embgeom_ray.inputs.model_loading.content_rule`).
    """

    FORMAT = FORMAT
    FORMAT_VERSION = FORMAT_VERSION
    READS = _READS
    KIND = "samples"
    HEADER_FIELDS = ("size", "type_size", "seed", "type_uniform", "content_rule")
    MERGE_FIELDS = ("size", "type_size", "seed", "type_uniform")

    def __init__(
        self,
        layers: Sequence[int],
        dim: int,
        size: int = _DEFAULTS.sample_size,
        seed: int = _DEFAULTS.sample_seed,
        type_uniform: bool = True,
        device: str | torch.device = "cpu",
        metadata: Mapping[str, str] | None = None,
        *,
        type_size: int | None = None,
        content_rule: str = "window",
    ) -> None:
        self._init_sketch(layers, dim, device, metadata)
        if content_rule not in CONTENT_RULES:
            raise ValueError(f"content_rule must be one of {CONTENT_RULES}, got {content_rule!r}")
        self.content_rule = content_rule
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        type_size = size if type_size is None else int(type_size)
        if type_size < 1:
            raise ValueError(f"type_size must be >= 1, got {type_size}")
        self.size = int(size)
        self.type_size = type_size
        self.seed = int(seed)
        self.type_uniform = bool(type_uniform)
        n_layers = len(self.layers)
        self._u = _Table(_U_COLS, n_layers, self.dim, self.device)
        self._t = _Table(_T_COLS, n_layers, self.dim, self.device)

    # ------------------------------------------------------------ sizes
    @property
    def num_uniform(self) -> int:
        """Occurrences in the uniform sample (min(size, occurrences seen))."""
        return self._u.n

    @property
    def num_types(self) -> int:
        """Token types in the type-uniform sample (min(type_size, types seen))."""
        return self._t.n

    # ---------------------------------------------------------- folding
    def _fold_uniform(self, cols: Mapping[str, torch.Tensor], take: _Take) -> None:
        """Bottom-``size`` of (current ∪ new) by (key, doc, window, position, content key),
        duplicates (equal in all five: :data:`_IDENTITY`) once.

        ``take(sel)`` gives the (L, len(sel), d) vectors of the new entries ``sel``: only the
        entries that enter are gathered."""
        u, n = self._u, self._u.n
        allc = [torch.cat([u.used(k), cols[k].to(self.device)]) for k in _IDENTITY]
        perm = _lexsort(allc)
        perm = perm[_first_of_runs(allc, perm)][: self.size]
        old = perm[perm < n]
        new = perm[perm >= n] - n
        u.replace(
            old,
            {k: c[new.to(c.device)] for k, c in cols.items()},
            take(new),
            self.size,
        )

    def _fold_types(self, cols: Mapping[str, torch.Tensor], take: _Take) -> None:
        """Per type the smallest occurrence; then the ``type_size`` types of smallest g(t)
        (``take`` as in :meth:`_fold_uniform`)."""
        t, m = self._t, self._t.n
        allc = {k: torch.cat([t.used(k), cols[k].to(self.device)]) for k in _T_COLS}
        order = ("token", *_IDENTITY)
        perm = _lexsort([allc[k] for k in order])
        perm = perm[_first_of_runs([allc["token"]], perm)]  # one (the smallest) per type
        sel = _lexsort([allc["type_key"][perm], allc["token"][perm]])[: self.type_size]
        perm = perm[sel]
        old = perm[perm < m]
        new = perm[perm >= m] - m
        t.replace(
            old,
            {k: c[new.to(c.device)] for k, c in cols.items()},
            take(new),
            self.type_size,
        )

    @torch.no_grad()
    def update(
        self,
        hidden: Sequence[torch.Tensor] | torch.Tensor,
        token_ids: torch.Tensor,
        keep: torch.Tensor | None,
        doc_ids: torch.Tensor,
        window_index: torch.Tensor,
        positions: torch.Tensor | None = None,
        finite: Sequence[bool] | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> None:
        """Fold one batch (the extractor's :class:`~embgeom_ray.inputs.windows.Batch`).

        Args:
            hidden: per layer (in ``self.layers`` order) a (B, T, d) tensor, or one (L, B, T, d).
            token_ids: (B, T) token ids (``batch.input_ids``).
            keep: (B, T) bool, the occurrences to sample (``batch.keep``); None keeps all.
            doc_ids: (B,) int64 document id of each row (``batch.doc_ids``).
            window_index: (B,) int64 window number within its document (``batch.window_index``).
            positions: (B, T) position within the window (default: the column index, which is
                the position for right-padded windows).
            attention_mask: (B, T) the real (non-padding) positions of each window
                (``batch.attention_mask``), for the content keys (:func:`content_keys`, with
                this sample's ``content_rule``); None: every position of a row is real.
        """
        if self.content_rule == "vectors":
            raise ValueError("a sample loaded from a version-1 file takes merges, not batches")
        hidden, keep = self._batch(hidden, token_ids, keep, positions)
        b, tlen = token_ids.shape
        if tuple(doc_ids.shape) != (b,) or tuple(window_index.shape) != (b,):
            raise ValueError(
                f"doc_ids and window_index must be ({b},), got {tuple(doc_ids.shape)} "
                f"and {tuple(window_index.shape)}"
            )
        hdev = hidden[0].device
        valid = keep.to(hdev).bool()
        # an occurrence must be finite in every layer (never in place: keep); the layers are
        # checked together (one host synchronisation), rows only in a layer that is not finite
        for h, ok in zip(hidden, self._finite_flags(hidden, finite), strict=True):
            if not ok:
                valid = valid & _finite_rows(h).to(hdev)
        rows, cols_ = torch.nonzero(valid, as_tuple=True)
        if rows.numel() == 0:
            return
        dev = self.device
        rows, cols_ = rows.to(dev), cols_.to(dev)
        flat = rows * tlen + cols_
        pos = cols_ if positions is None else positions.to(dev)[rows, cols_].long()
        occ = {
            "doc": doc_ids.to(dev).long()[rows],
            "window": window_index.to(dev).long()[rows],
            "position": pos,
            "token": token_ids.to(dev).long()[rows, cols_],
        }
        if int(occ["token"].min()) < 0:
            raise ValueError("token ids must be non-negative")
        occ["key"] = occurrence_keys(self.seed, occ["doc"], occ["window"], occ["position"])
        content = content_keys(
            token_ids.to(dev), attention_mask, self.content_rule,
            None if positions is None else positions.to(dev),
        )  # fmt: skip
        occ["content"] = content[rows, cols_]

        def gather(sel: torch.Tensor) -> torch.Tensor:
            """(L, len(sel), d) float32 vectors on ``dev`` (layers may live on other devices)."""
            idx = flat[sel]
            out = torch.empty(len(hidden), idx.numel(), self.dim, dtype=_F32, device=dev)
            for li, h in enumerate(hidden):  # each layer straight into its slice: no stacking
                out[li] = h.reshape(-1, self.dim).index_select(0, idx.to(h.device))
            return out

        # uniform: candidates that can enter, reduced to the batch's own bottom-size first
        cand = torch.arange(flat.numel(), device=dev)
        if self._u.n >= self.size:
            thr = self._u.used("key").max()
            cand = cand[occ["key"] <= thr]
        if cand.numel():
            cc = [occ[k][cand] for k in _OCC]
            perm = _lexsort(cc)
            cand = cand[perm[_first_of_runs(cc, perm)][: self.size]]
            self._fold_uniform({k: occ[k][cand] for k in _U_COLS}, lambda s, c=cand: gather(c[s]))

        if self.type_uniform:
            occ["type_key"] = type_keys(self.seed, occ["token"])
            cand = torch.arange(flat.numel(), device=dev)
            if self._t.n >= self.type_size:
                cand = cand[occ["type_key"] <= self._t.used("type_key").max()]
            if cand.numel():
                cc = [occ[k][cand] for k in ("token", *_OCC)]
                perm = _lexsort(cc)
                cand = cand[perm[_first_of_runs(cc[:1], perm)]]  # smallest occurrence per type
                sel = _lexsort([occ["type_key"][cand], occ["token"][cand]])[: self.type_size]
                cand = cand[sel]
                self._fold_types({k: occ[k][cand] for k in _T_COLS}, lambda s, c=cand: gather(c[s]))

    # ------------------------------------------------------------ merge
    @torch.no_grad()
    def merge(self, other: ActivationSample) -> ActivationSample:
        """Merge ``other`` into ``self`` (in place; returns ``self``).

        The result is the sample of the union of both occurrence sets: associative,
        commutative and idempotent (an occurrence seen by both, the same place with the same
        content key, is kept once; the same doc id, window and position with another content
        key is another document's occurrence, and is kept too).
        """
        self.check_compatible(other)
        self._adopt_metadata(other)
        vector_rule = self.content_rule != other.content_rule
        if vector_rule:  # keys of different rules do not compare: both fall back to vectors
            self._to_vector_rule()
        u = other._u
        if u.n:
            vu = u.vec[:, : u.n].to(self.device)
            self._fold_uniform(self._merge_cols(u, _U_COLS, vector_rule), lambda s: vu.index_select(1, s))
        t = other._t
        if t.n:
            vt = t.vec[:, : t.n].to(self.device)
            self._fold_types(self._merge_cols(t, _T_COLS, vector_rule), lambda s: vt.index_select(1, s))
        return self

    @staticmethod
    def _merge_cols(table: _Table, names: Sequence[str], vector_rule: bool) -> dict[str, torch.Tensor]:
        """``table``'s used columns ``names``, with content keys of the ``"vectors"`` rule
        (:func:`vector_content_keys`) when ``vector_rule``."""
        cols = {k: table.used(k) for k in names}
        if vector_rule:
            vec = table.vec[:, : table.n].cpu().numpy()
            cols["content"] = torch.from_numpy(vector_content_keys(vec)).to(cols["content"].device)
        return cols

    def _to_vector_rule(self) -> None:
        """Replace the content keys by those of the ``"vectors"`` rule (:func:`vector_content_keys`)."""
        for table in (self._u, self._t):
            if table.n:
                keys = vector_content_keys(table.vec[:, : table.n].cpu().numpy())
                table.cols["content"][: table.n] = torch.from_numpy(keys).to(self.device)
        self.content_rule = "vectors"

    # ------------------------------------------------------------ views
    def _layer_index(self, layer: int) -> int:
        if layer not in self.layers:
            raise KeyError(f"layer {layer} was not sampled; layers are {self.layers}")
        return self.layers.index(layer)

    @staticmethod
    def _points(table: _Table, order: torch.Tensor, li: int) -> SamplePoints:
        def np_(name: str) -> np.ndarray:
            return table.used(name)[order].cpu().numpy()

        vec = table.vec[li, : table.n][order].cpu().numpy().astype(np.float64)
        return SamplePoints(
            np_("key"), np_("token"), np_("doc"), np_("window"), np_("position"), vec,
            np_("content"),
        )  # fmt: skip

    def _uniform_order(self) -> torch.Tensor:
        return self._u.canonical(_IDENTITY)

    def _type_order(self) -> torch.Tensor:
        return self._t.canonical(("token",))

    def points(self, layer: int) -> SamplePoints:
        """The uniform sample at hidden-state layer ``layer``, ordered by key (then doc, …).

        Rows are the same occurrences, in the same order, for every layer; vectors float64.
        """
        return self._points(self._u, self._uniform_order(), self._layer_index(layer))

    def type_points(self, layer: int) -> SamplePoints:
        """The type-uniform sample at ``layer``: one occurrence per type, ordered by token id."""
        return self._points(self._t, self._type_order(), self._layer_index(layer))

    def layer_sample(self, layer: int) -> ActivationSample:
        """The one-layer sample of ``layer``: the same occurrences (both samples, same keys),
        with that layer's vectors only (a copy; Q/L bytes of the whole sample's Q)."""
        li = self._layer_index(layer)
        out = self._empty(self.header() | {"layers": [int(layer)]}, FORMAT_VERSION, self.device)
        for src, dst, limit in ((self._u, out._u, self.size), (self._t, out._t, self.type_size)):
            if src.n:
                empty = torch.empty(0, dtype=_I64, device=self.device)
                cols = {k: src.used(k).clone() for k in src.names}
                dst.replace(empty, cols, src.vec[li : li + 1, : src.n].clone(), limit)
        return out

    def to_table(
        self,
        id_to_token: Callable[[Sequence[int]], Sequence[str]] | None = None,
        layers: Sequence[int] | None = None,
    ) -> pd.DataFrame:
        """``samples.parquet``: one row per (layer, sample, occurrence), :data:`SAMPLE_COLUMNS`.

        ``sample`` is ``"uniform"`` or ``"type_uniform"``; ``key`` the occurrence key;
        ``vector`` a float32 array (Parquet list<float>), exactly as stored. ``layers``: only
        these layers' rows (default all), in the order of :attr:`layers`.
        """
        import pandas as pd

        frames = []
        tables = [("uniform", self._u, self._uniform_order())]
        if self.type_uniform:
            tables.append(("type_uniform", self._t, self._type_order()))
        wanted = set(self.layers if layers is None else (int(x) for x in layers))
        for li, layer in enumerate(self.layers):
            if layer not in wanted:
                continue
            for name, table, order in tables:
                n = table.n

                def col(k: str, table: _Table = table, order: torch.Tensor = order) -> np.ndarray:
                    return table.used(k)[order].cpu().numpy()

                vec = table.vec[li, :n][order].cpu().numpy()
                frames.append(
                    pd.DataFrame(
                        {
                            "layer": np.full(n, layer, dtype=np.int64),
                            "sample": [name] * n,
                            "key": col("key"),
                            "token_id": col("token"),
                            "doc_id": col("doc"),
                            "window": col("window"),
                            "position": col("position"),
                            "content_key": col("content"),
                            "vector": list(vec),
                        }
                    )
                )
        df = pd.concat(frames, ignore_index=True)
        if id_to_token is not None and len(df):
            ids = np.unique(df["token_id"].to_numpy())
            names = dict(zip(ids.tolist(), id_to_token(ids.tolist()), strict=True))
            df["token"] = df["token_id"].map(names).astype("string")
        else:
            df["token"] = pd.Series([None] * len(df), dtype="string")
        df["sample"] = df["sample"].astype("string")
        return df[SAMPLE_COLUMNS]

    # ------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, np.ndarray]:
        """Arrays in canonical order, on CPU: ``u_*`` (uniform) and ``t_*`` (type-uniform)."""
        out: dict[str, np.ndarray] = {}
        for prefix, table, order in (
            ("u", self._u, self._uniform_order()),
            ("t", self._t, self._type_order()),
        ):
            for k in table.names:
                out[f"{prefix}_{_ARRAY_NAMES[k]}"] = np.ascontiguousarray(
                    table.used(k)[order].cpu().numpy()
                )
            out[f"{prefix}_vectors"] = np.ascontiguousarray(
                table.vec[:, : table.n][:, order].cpu().numpy()
            )
        return out

    @classmethod
    def _empty(cls, header: Mapping[str, Any], version: int, device: Any) -> ActivationSample:
        return cls(
            header["layers"],
            int(header["dim"]),
            int(header["size"]),
            int(header["seed"]),
            bool(header["type_uniform"]),
            device,
            header.get("metadata"),
            type_size=int(header["type_size"]),
            content_rule=str(header.get("content_rule", "vectors" if version < 2 else "")),
        )

    def _set_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        n_layers, d = len(self.layers), self.dim
        for prefix, table, limit in (
            ("u", self._u, self.size),
            ("t", self._t, self.type_size),
        ):
            vec_name = f"{prefix}_vectors"
            found = arrays.get(vec_name)
            n = int(found.shape[1]) if found is not None and found.ndim == 3 else 0
            vec = check_array(arrays, vec_name, (n_layers, n, d), np.float32, self.KIND)
            if n > limit:
                raise StatisticsMismatchError(
                    f"samples array {vec_name!r} holds {n} entries, more than the {limit} kept"
                )
            names = list(table.names)
            derived = {}
            if f"{prefix}_content_key" not in arrays and self.content_rule == "vectors":
                names.remove("content")  # a version-1 sample: the keys come from its vectors
                derived["content"] = torch.from_numpy(vector_content_keys(vec))
            cols = derived | {
                k: torch.from_numpy(
                    np.array(
                        check_array(
                            arrays, f"{prefix}_{_ARRAY_NAMES[k]}", (n,), np.int64, self.KIND
                        )
                    )
                )
                for k in names
            }
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            # replace copies the vectors into the table: a writable array needs no copy first
            writable = vec.flags.writeable and vec.flags.c_contiguous
            table.replace(empty, cols, torch.from_numpy(vec if writable else np.array(vec)), limit)

    @classmethod
    def load_layer(
        cls, url: str | FileRef, layer: int, *, device: str | torch.device = "cpu"
    ) -> ActivationSample:
        """The one-layer sample of ``layer`` (:meth:`layer_sample`) of the sample :meth:`save`
        wrote at ``url``, reading only that layer's vectors: the safetensors header gives each
        array's byte range, the ``(L, n, d)`` vectors are layer-major, so layer i's are the
        i-th ``n·d·4`` bytes of their range (ranged reads, local or object store; checked
        against the file's digest where ``url`` is a :class:`~embgeom_ray.integrity.FileRef`
        with one). A sample of the ``"vectors"`` content rule derives its keys from every
        layer: refused here (:class:`StatisticsMismatchError`); load it whole."""
        ref = as_ref(url)
        with open_verified(ref) as f:
            st = SafetensorsFile(f, cls.KIND)
            header = st.header()
            version = cls.check_header(header)
            rule = header.get("content_rule", "vectors" if version < 2 else "")
            if rule == "vectors":
                raise StatisticsMismatchError(f"{ref.url}: a sample of the 'vectors' content rule loads whole")
            li = [int(x) for x in header["layers"]].index(int(layer))
            arrays = {
                name: st.layer(name, li)
                if name.endswith("_vectors") and len(st.shape(name)) == 3
                else st.array(name)
                for name in st.keys()
            }
        return cls.from_state(header | {"layers": [int(layer)]}, arrays, device=device)

    # ------------------------------------------------------ the table form
    @classmethod
    def from_table(
        cls,
        table: Any,
        header: Mapping[str, Any],
        *,
        device: str | torch.device = "cpu",
    ) -> ActivationSample:
        """The sample that :meth:`to_table` wrote (a ``pyarrow.Table`` or DataFrame of its
        rows; other columns, such as the report's ``cluster``, are ignored), with its
        :meth:`header`: ``samples.parquet`` keeps the header in its metadata, so the table is
        the mergeable sample too.

        Each sample's rows at the first layer give its occurrences (the columns named in the
        state, :meth:`state_dict`), each layer's rows their vectors: every layer must hold the
        same occurrences in the same order. The type-uniform sample's type keys are not in the
        table; they are the function :func:`type_keys` of the seed and the token id. The result
        equals the sample written (``to_bytes`` identical): the vectors are stored as float32
        and the ids and keys as int64, both exactly.
        """
        import pyarrow as pa
        import pyarrow.compute as pc

        cls.check_header(header)
        if not isinstance(table, pa.Table):
            table = pa.Table.from_pandas(table, preserve_index=False)
        layers, dim = [int(x) for x in header["layers"]], int(header["dim"])
        arrays: dict[str, np.ndarray] = {}
        for prefix, name, names in (("u", "uniform", _U_COLS), ("t", "type_uniform", _T_COLS)):
            cols = [_ARRAY_NAMES[k] for k in names if _ARRAY_NAMES[k] in table.column_names]
            vectors, first = [], None
            for layer in layers:
                rows = table.filter(
                    pc.and_(pc.equal(table["layer"], layer), pc.equal(table["sample"], name))
                )
                ids = {c: rows[c].to_numpy().astype(np.int64, copy=False) for c in cols}
                if first is None:
                    first = ids
                elif any(not np.array_equal(ids[c], first[c]) for c in cols):
                    raise StatisticsMismatchError(
                        f"samples table: layer {layer} holds other {name} occurrences than "
                        f"layer {layers[0]}"
                    )
                flat = np.zeros(0, np.float32)  # no rows: the column may not even be a list
                if rows.num_rows:
                    flat = rows["vector"].combine_chunks().flatten().to_numpy(zero_copy_only=False)
                if flat.size != rows.num_rows * dim:
                    raise StatisticsMismatchError(
                        f"samples table: layer {layer}'s {name} vectors are not of dim {dim}"
                    )
                vectors.append(np.asarray(flat, dtype=np.float32).reshape(rows.num_rows, dim))
            for c, values in (first or {}).items():
                arrays[f"{prefix}_{c}"] = values
            arrays[f"{prefix}_vectors"] = np.stack(vectors)
        if "t_type_key" not in arrays and "t_token_id" in arrays:
            tokens = torch.from_numpy(np.array(arrays["t_token_id"], dtype=np.int64))
            arrays["t_type_key"] = type_keys(int(header["seed"]), tokens).numpy()
        return cls.from_state(header, arrays, device=device)
