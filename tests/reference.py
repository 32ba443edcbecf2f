"""Independent, slow, float64 reference for the job's exact metrics (the output contract of docs/design.md).

Everything here is done the obvious way so that it can check a fast implementation:

* windows: each document is tokenized once without special tokens, cut into consecutive
  chunks of ``max_length - (number of special tokens added to one sequence)`` content tokens,
  and each chunk is wrapped with the tokenizer's own special tokens (``[CLS] … [SEP]`` for
  BERT, ``<s> …`` for Llama, nothing for GPT-2, ``<s> … </s>`` for RoBERTa);
* the model (float32, eval, no grad) runs on each window alone: batch of one, no padding;
* activations are converted to float64 numpy and every statistic is computed two-pass
  (means first, then mean squared deviations); cosine metrics are computed by brute force from
  the full matrix of pairwise cosines, never from sums of unit vectors.

Nothing in this module imports ``embgeom_ray``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

__all__ = [
    "DIMS_COLUMNS",
    "LAYERS_COLUMNS",
    "TYPE_STATS_COLUMNS",
    "LayerActivations",
    "Window",
    "brute_force_cosines",
    "layer_tables",
    "load_model_and_tokenizer",
    "make_windows",
    "participation_ratio",
    "reference_activations",
    "reference_tables",
    "special_wrapping",
]

TYPE_STATS_COLUMNS = [
    "layer",
    "token_id",
    "token",
    "count",
    "mean_norm",
    "sq_norm_mean",
    "variance",
    "self_similarity",
]
LAYERS_COLUMNS = [
    "layer",
    "n_tokens",
    "n_types",
    "mean_norm",
    "total_variance",
    "within_variance",
    "between_variance",
    "within_ratio",
    "norm_variance_corr",
    "isoscore",
    "anisotropy",
    "s_inter",
    "s_intra",
    "participation_ratio",
]
DIMS_COLUMNS = ["layer", "dim", "mean", "std"]

_PROBES = ("hello world", "The cat sat on the mat.", "a", "Numbers 1234 and symbols: x+y=z")


@dataclass(frozen=True)
class Window:
    """One model input: ``input_ids`` (special tokens included) cut from document ``document``.

    ``index`` is the window's rank within its document (0 for the first window).
    """

    document: int
    index: int
    input_ids: list[int]


@dataclass(frozen=True)
class LayerActivations:
    """The counted token occurrences of one layer, in corpus order.

    Attributes:
        points: ``(n, d)`` float64 hidden states.
        token_ids: ``(n,)`` int64 token ids.
        positions: ``(n,)`` int64 position in the window; 0 is the window's first token,
            the special token included (so the first content token of a BERT window is 1).
        documents: ``(n,)`` int64 index of the document in the input list.
        windows: ``(n,)`` int64 global index of the window (order of ``make_windows``).
    """

    points: np.ndarray
    token_ids: np.ndarray
    positions: np.ndarray
    documents: np.ndarray
    windows: np.ndarray


def _ids(encoding) -> list[int]:
    ids = encoding["input_ids"]
    return [int(i) for i in ids]


def special_wrapping(tokenizer) -> tuple[list[int], list[int]]:
    """Return ``(prefix, suffix)``: the special token ids the tokenizer adds to one sequence.

    transformers 5 tokenizers no longer have ``build_inputs_with_special_tokens``, so this is
    derived by probing: for a few texts, ``tokenizer(text)`` must equal
    ``prefix + tokenizer(text, add_special_tokens=False) + suffix`` with the same prefix and
    suffix every time (raises ``ValueError`` otherwise).
    """
    found: tuple[list[int], list[int]] | None = None
    for text in _PROBES:
        with_sp = _ids(tokenizer(text, add_special_tokens=True))
        without = _ids(tokenizer(text, add_special_tokens=False))
        if not without:
            continue
        candidates = [
            (with_sp[:i], with_sp[i + len(without) :])
            for i in range(len(with_sp) - len(without) + 1)
            if with_sp[i : i + len(without)] == without
        ]
        if not candidates:
            raise ValueError(
                f"tokenizer(text) does not contain the content ids of {text!r}: "
                f"{with_sp} vs {without}"
            )
        # The shortest prefix wins; the specials never contain content tokens in practice.
        candidate = candidates[0]
        if found is None:
            found = candidate
        elif found != candidate:
            raise ValueError(f"inconsistent special-token wrapping: {found} vs {candidate}")
    if found is None:
        raise ValueError("could not probe the tokenizer's special tokens")
    n_special = getattr(tokenizer, "num_special_tokens_to_add", None)
    if callable(n_special) and n_special(pair=False) != len(found[0]) + len(found[1]):
        raise ValueError(
            f"probed wrapping {found} disagrees with num_special_tokens_to_add="
            f"{n_special(pair=False)}"
        )
    return found


def make_windows(tokenizer, documents: Sequence[str], max_length: int) -> list[Window]:
    """Cut documents into consecutive windows of at most ``max_length`` tokens.

    Each document is tokenized once with ``add_special_tokens=False``; its content ids are split
    into chunks of ``max_length - len(prefix) - len(suffix)`` and each chunk is wrapped as
    ``prefix + chunk + suffix`` (see ``special_wrapping``). Empty or whitespace-only
    documents, and documents without tokens, give no windows.
    """
    prefix, suffix = special_wrapping(tokenizer)
    content = max_length - len(prefix) - len(suffix)
    if content < 1:
        raise ValueError(
            f"max_length={max_length} leaves no room for content next to "
            f"{len(prefix) + len(suffix)} special tokens"
        )
    windows: list[Window] = []
    for doc_index, doc in enumerate(documents):
        if not isinstance(doc, str):
            raise TypeError(f"document {doc_index} is {type(doc).__name__}, not str")
        if not doc.strip():
            continue
        ids = _ids(tokenizer(doc, add_special_tokens=False, verbose=False))
        for rank, start in enumerate(range(0, len(ids), content)):
            chunk = ids[start : start + content]
            windows.append(Window(doc_index, rank, prefix + chunk + suffix))
    return windows


def load_model_and_tokenizer(model_dir: str | os.PathLike[str]):
    """Load ``AutoModel`` (float32, eval) and ``AutoTokenizer`` from a local directory."""
    from transformers import AutoModel, AutoTokenizer

    from embgeom_ray.inputs.model_loading import dtype_argument  # the keyword, by version

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModel.from_pretrained(str(model_dir), **dtype_argument(torch.float32))
    model.eval()
    return model, tokenizer


def reference_activations(
    model_dir: str | os.PathLike[str],
    documents: Sequence[str],
    max_length: int,
    layers: Sequence[int] | None = None,
    keep_special: bool = False,
) -> dict[int, LayerActivations]:
    """Float64 hidden states of every counted token, per layer.

    Layer ``l`` is ``hidden_states[l]`` (0 = embeddings). Each window (``make_windows``) runs
    alone (batch of one, no padding, all-ones attention mask). Tokens whose id is in
    ``tokenizer.all_special_ids`` are dropped unless ``keep_special``. ``layers=None`` means
    all ``L + 1`` layers.
    """
    model, tokenizer = load_model_and_tokenizer(model_dir)
    n_layers = int(model.config.num_hidden_layers) + 1
    wanted = list(range(n_layers)) if layers is None else [int(layer) for layer in layers]
    for layer in wanted:
        if not 0 <= layer < n_layers:
            raise ValueError(f"layer {layer} out of range [0, {n_layers})")
    special = np.asarray(sorted(set(tokenizer.all_special_ids)), dtype=np.int64)
    hidden_size = int(model.config.hidden_size)

    chunks: dict[int, list[np.ndarray]] = {layer: [] for layer in wanted}
    ids_parts: list[np.ndarray] = []
    pos_parts: list[np.ndarray] = []
    doc_parts: list[np.ndarray] = []
    win_parts: list[np.ndarray] = []
    for w_index, window in enumerate(make_windows(tokenizer, documents, max_length)):
        ids = np.asarray(window.input_ids, dtype=np.int64)
        keep = np.ones(len(ids), dtype=bool) if keep_special else ~np.isin(ids, special)
        input_ids = torch.tensor([window.input_ids], dtype=torch.long)
        with torch.no_grad():
            out = model(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                output_hidden_states=True,
            )
        hidden_states = out.hidden_states
        if len(hidden_states) != n_layers:
            raise RuntimeError(f"model returned {len(hidden_states)} hidden states")
        for layer in wanted:
            h = hidden_states[layer][0].to(torch.float64).numpy()
            chunks[layer].append(h[keep])
        ids_parts.append(ids[keep])
        pos_parts.append(np.arange(len(ids), dtype=np.int64)[keep])
        doc_parts.append(np.full(int(keep.sum()), window.document, dtype=np.int64))
        win_parts.append(np.full(int(keep.sum()), w_index, dtype=np.int64))

    def cat(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    token_ids, positions = cat(ids_parts), cat(pos_parts)
    docs, wins = cat(doc_parts), cat(win_parts)
    result: dict[int, LayerActivations] = {}
    for layer in wanted:
        points = (
            np.concatenate(chunks[layer])
            if chunks[layer]
            else np.zeros((0, hidden_size), dtype=np.float64)
        )
        result[layer] = LayerActivations(points, token_ids, positions, docs, wins)
    return result


def brute_force_cosines(
    points: np.ndarray, token_ids: np.ndarray, block: int = 1024
) -> tuple[dict[int, float], float, float, float]:
    """Cosine metrics from the explicit pairwise cosine matrix, summed block by block.

    Returns ``(self_similarity, anisotropy, s_inter, s_intra)``:

    * ``self_similarity[t]`` = mean of cos(x_i, x_j) over ordered pairs i != j of type t
      (NaN when n_t < 2);
    * ``anisotropy`` = mean over all ordered pairs i != j (NaN when N < 2);
    * ``s_inter`` = mean over ordered pairs of different types (NaN with one type);
    * ``s_intra`` = unweighted mean of ``self_similarity`` over types with n_t >= 2.
    """
    x = np.asarray(points, dtype=np.float64)
    ids = np.asarray(token_ids, dtype=np.int64)
    n = x.shape[0]
    types, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    same_sum = np.zeros(len(types), dtype=np.float64)
    offdiag_sum = 0.0
    diff_sum = 0.0
    for i0 in range(0, n, block):
        i1 = min(n, i0 + block)
        cos = unit[i0:i1] @ unit.T
        rows = np.arange(i1 - i0)
        cos[rows, i0 + rows] = 0.0  # drop the pairs (i, i)
        same = inverse[i0:i1, None] == inverse[None, :]
        offdiag_sum += float(cos.sum())
        diff_sum += float(cos[~same].sum())
        np.add.at(same_sum, inverse[i0:i1], np.where(same, cos, 0.0).sum(axis=1))
    pairs = counts.astype(np.float64) * (counts - 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        self_sim = np.where(counts >= 2, same_sum / pairs, np.nan)
    anisotropy = offdiag_sum / (n * (n - 1)) if n >= 2 else math.nan
    n_diff = float(n) * n - float(np.sum(counts.astype(np.float64) ** 2))
    s_inter = diff_sum / n_diff if n_diff > 0 else math.nan
    multi = counts >= 2
    s_intra = float(np.mean(self_sim[multi])) if multi.any() else math.nan
    by_type = {int(t): float(s) for t, s in zip(types, self_sim, strict=True)}
    return by_type, float(anisotropy), float(s_inter), s_intra


def _isoscore(points: np.ndarray) -> float:
    from IsoScore import IsoScore

    if points.shape[0] < 2:
        return math.nan
    return float(IsoScore.IsoScore(np.ascontiguousarray(points, dtype=np.float64)))


def participation_ratio(points: np.ndarray) -> float:
    """(Σλ)² / Σλ² of the eigenvalues λ of the points' two-pass float64 covariance (NaN for
    fewer than 2 points or a zero covariance)."""
    x = np.asarray(points, dtype=np.float64)
    if x.shape[0] < 2:
        return math.nan
    centred = x - x.mean(axis=0)
    lam = np.linalg.eigvalsh(centred.T @ centred / x.shape[0])
    sq = float(np.sum(lam**2))
    return float(np.sum(lam)) ** 2 / sq if sq > 0 else math.nan


def layer_tables(
    layer: int,
    points: np.ndarray,
    token_ids: np.ndarray,
    tokens: dict[int, str],
    *,
    min_count: int = 5,
) -> tuple[pd.DataFrame, dict[str, float], pd.DataFrame]:
    """Type rows, the layer row and dim rows of one layer (two-pass float64 formulas).

    ``tokens`` maps token id to its string (``convert_ids_to_tokens``).
    """
    x = np.asarray(points, dtype=np.float64)
    ids = np.asarray(token_ids, dtype=np.int64)
    n_total, dim = x.shape
    types, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    order = np.argsort(inverse, kind="stable")
    groups = np.split(x[order], np.cumsum(counts)[:-1]) if n_total else []

    mu = x.mean(axis=0) if n_total else np.full(dim, np.nan)
    type_means = np.zeros((len(types), dim), dtype=np.float64)
    variances = np.zeros(len(types), dtype=np.float64)
    sq_norm_means = np.zeros(len(types), dtype=np.float64)
    for k, g in enumerate(groups):
        m = g.mean(axis=0)
        type_means[k] = m
        sq_norm_means[k] = np.mean(np.sum(g * g, axis=1))
        variances[k] = np.mean(np.sum((g - m) ** 2, axis=1))
    mean_norms = np.linalg.norm(type_means, axis=1)

    self_sim, anisotropy, s_inter, s_intra = brute_force_cosines(x, ids)
    type_rows = pd.DataFrame(
        {
            "layer": np.full(len(types), layer, dtype=np.int64),
            "token_id": types.astype(np.int64),
            "token": [tokens[int(t)] for t in types],
            "count": counts.astype(np.int64),
            "mean_norm": mean_norms,
            "sq_norm_mean": sq_norm_means,
            "variance": variances,
            "self_similarity": [self_sim[int(t)] for t in types],
        },
        columns=TYPE_STATS_COLUMNS,
    )

    if n_total:
        weights = counts / n_total
        total_variance = float(np.mean(np.sum((x - mu) ** 2, axis=1)))
        within = float(np.sum(weights * variances))
        between = float(np.sum(weights * np.sum((type_means - mu) ** 2, axis=1)))
        within_ratio = within / total_variance if total_variance > 0 else math.nan
    else:
        total_variance = within = between = within_ratio = math.nan
    frequent = counts >= min_count
    if frequent.sum() >= 3:  # docs/outputs.md: NaN when fewer than 3 types qualify
        with np.errstate(invalid="ignore", divide="ignore"):
            corr = float(np.corrcoef(mean_norms[frequent], variances[frequent])[0, 1])
    else:
        corr = math.nan
    layer_row = {
        "layer": layer,
        "n_tokens": int(n_total),
        "n_types": len(types),
        "mean_norm": float(np.linalg.norm(mu)),
        "total_variance": total_variance,
        "within_variance": within,
        "between_variance": between,
        "within_ratio": within_ratio,
        "norm_variance_corr": corr,
        "isoscore": _isoscore(x),
        "anisotropy": anisotropy,
        "s_inter": s_inter,
        "s_intra": s_intra,
        "participation_ratio": participation_ratio(x),
    }
    dims = pd.DataFrame(
        {
            "layer": np.full(dim, layer, dtype=np.int64),
            "dim": np.arange(dim, dtype=np.int64),
            "mean": mu,
            "std": x.std(axis=0) if n_total else np.full(dim, np.nan),
        },
        columns=DIMS_COLUMNS,
    )
    return type_rows, layer_row, dims


def reference_tables(
    model_dir: str | os.PathLike[str],
    documents: Sequence[str],
    *,
    max_length: int,
    layers: Sequence[int] | None = None,
    keep_special: bool = False,
    min_count: int = 5,
) -> dict[str, pd.DataFrame]:
    """The job's exact tables, computed slowly: ``{"type_stats", "layers", "dims"}``.

    Columns are exactly those of docs/design.md's output contract (see ``TYPE_STATS_COLUMNS``,
    ``LAYERS_COLUMNS``, ``DIMS_COLUMNS``); rows are sorted by (layer, token_id), layer, and
    (layer, dim). ``token`` is ``tokenizer.convert_ids_to_tokens(token_id)``.
    """
    from transformers import AutoTokenizer

    acts = reference_activations(model_dir, documents, max_length, layers, keep_special)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    all_ids = sorted({int(t) for a in acts.values() for t in np.unique(a.token_ids)})
    tokens = dict(zip(all_ids, tokenizer.convert_ids_to_tokens(all_ids), strict=True))
    type_parts: list[pd.DataFrame] = []
    layer_rows: list[dict[str, float]] = []
    dim_parts: list[pd.DataFrame] = []
    for layer in sorted(acts):
        a = acts[layer]
        t_rows, l_row, d_rows = layer_tables(
            layer, a.points, a.token_ids, tokens, min_count=min_count
        )
        type_parts.append(t_rows)
        layer_rows.append(l_row)
        dim_parts.append(d_rows)
    type_stats = (
        pd.concat(type_parts, ignore_index=True)
        if type_parts
        else pd.DataFrame(columns=TYPE_STATS_COLUMNS)
    )
    layers_df = pd.DataFrame(layer_rows, columns=LAYERS_COLUMNS)
    dims = (
        pd.concat(dim_parts, ignore_index=True) if dim_parts else pd.DataFrame(columns=DIMS_COLUMNS)
    )
    type_stats = type_stats.sort_values(["layer", "token_id"], ignore_index=True)
    layers_df = layers_df.sort_values("layer", ignore_index=True)
    dims = dims.sort_values(["layer", "dim"], ignore_index=True)
    return {"type_stats": type_stats, "layers": layers_df, "dims": dims}
