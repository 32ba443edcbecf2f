"""``report.html``: one self-contained, offline-readable page per run (or per comparison).

:func:`write_report` draws the run's figures (:mod:`embgeom_ray.report.plots`) and writes
``OUT/report.html``: run metadata, the per-layer table, the figures with captions grouped by
section, each section with a short "how to read this" naming its paper, and links to the
Parquet tables. :func:`write_comparison_report` does the same for several runs, layer by layer.

The page is ONE file: images are embedded as base64 ``data:`` URIs, CSS is inline, and there
is no script, web font or any other external resource, so it can be mailed or opened from a
laptop with no network. The only links are relative hrefs to the run's own files and
in-page anchors. It is written atomically (temporary file + :func:`os.replace`).
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from ..core import metric_registry as registry
from ..core.kmeans_selection import ROBUST_SUPPORT
from ..io_utils import atomic_write_bytes, exists, is_local, join, local_path, read_bytes
from ..run_dir import Manifest, ModelInfo, RunDir, TokenizerInfo, now
from ..run_view import RunView, by_depth, corpus_label, model_name, short_name
from ..sizing.peaks import describe_peaks
from ..storage import check_input
from ..version import __version__
from .figures.clipping import ClipPair, clipping_pairs
from .figures.compare import COMPARE_METRICS, plot_comparison
from .plots import SECTIONS, Elsewhere, Figure, make_all_plots

REPORT = "report.html"

#: Files of a run directory that the report links to, with a description.
RUN_FILES: list[tuple[str, str]] = [
    ("layers.parquet", "one row per layer: the table above, full precision"),
    (
        "type_stats.parquet",
        "one row per (layer, token type): count, ‖μ_t‖, Q_t, V_t, self-similarity",
    ),
    ("dims.parquet", "one row per (layer, dimension): mean, std, rogue-dimension scores and flags"),
    ("positions.parquet", "per (layer, position): count, mean norm, flagged dimensions' means"),
    (
        "samples.parquet",
        "the bounded random token sample (vectors, K-means clusters) behind the sampled metrics;"
        " also the mergeable sample (merges with later runs)",
    ),
    ("kmeans.parquet", "per (layer, k): the silhouette and inertia of every K-means fit"),
    ("manifest.json", "configuration, model and corpus identity, counts, timings, versions"),
    (
        "statistics.safetensors",
        "the mergeable sufficient statistics (reload or merge with later runs)",
    ),
    ("sample.safetensors", "the sample as an earlier version wrote it beside samples.parquet"),
    ("report.html", "this report"),
    ("run.json", "the run's fingerprint and shard plan (for resuming)"),
]
#: folders of a run directory, described in the report's file list
RUN_FOLDERS: dict[str, str] = {
    "plots": "the report's figures as PNG",
    "groups": "checkpoint groups (kept with --keep-checkpoints, else removed when complete)",
}

#: layers.parquet columns the report shows: (header, tooltip, format kind), standard errors
#: last, declared in :mod:`~embgeom_ray.core.metric_registry`. Kinds: int, sci (4
#: significant), unit (3 decimals, values in [−1, 1] or [0, 1]), corr (signed, 2 decimals), text.
COLUMNS: dict[str, tuple[str, str, str]] = registry.report_columns()
#: the standard errors' table: the ``<metric>_se`` column of each metric that has one
SE_COLUMNS = list(registry.SE_COLUMNS)
#: the exact table: the registry's exact section of ``layers.parquet``
EXACT_COLUMNS = registry.columns(registry.LAYERS, registry.EXACT_SECTION)
#: the sampled table: the registry's sampled section, the columns with a header (the sampled
#: clipped cosines are its clipping section's, in the clipping table: :func:`clipping_table_html`)
SAMPLED_COLUMNS = [c for c in registry.columns(registry.LAYERS, registry.SAMPLED_SECTION)
                   if c in COLUMNS]  # fmt: skip

#: the mark of a best k at the cap of the grown K-means search (no interior optimum)
AT_CAP = "▲ at cap"

#: "How to read this" per report section.
HOW_TO_READ: dict[str, str] = {
    "norms": (
        "<b>Yamagiwa et al. 2024</b>, <i>Norm of Mean Contextualized Embeddings Determines their "
        "Variance</i>. Each token type t has a mean vector μ_t over its occurrences and a "
        "variance V_t around it; the mean squared norm Q_t = ‖μ_t‖² + V_t exactly, and "
        "LayerNorm keeps Q_t nearly constant within a layer, so types with a longer mean vary "
        "less: expect a strongly negative r in the middle layers. The layer's variance splits "
        "exactly into a within-type part V_W (what context adds) and a between-type part V_B "
        "(what token identity explains); deeper layers usually move variance from V_B to V_W."
    ),
    "isotropy": (
        "<b>Ethayarajh 2019</b>, <i>How Contextual are Contextualized Word Representations?</i>; "
        "<b>Cai et al. 2021</b>, <i>Isotropy in the Contextual Embedding Space: Clusters and "
        "Manifolds</i>; <b>Rudman et al. 2022</b>, <i>IsoScore</i>. Anisotropy is the mean "
        "cosine between random tokens: 0 for directions spread evenly, near 1 when all vectors "
        "point one way. S_intra (self-similarity) high and S_inter low means occurrences of a "
        "type stay together while types are distinguishable; read S_intra relative to S_inter, "
        "since anisotropy inflates both. IsoScore (0…1) says how evenly the variance uses all "
        "dimensions. Cai et al. show much of the anisotropy comes from a few clusters: "
        "cluster-adjusted values (when present) subtract each cluster's mean first."
    ),
    "clusters": (
        "<b>Cai et al. 2021</b> find that contextual embeddings form a few clusters (often split "
        "by token frequency) and low-dimensional manifolds inside them. <b>Clusters.</b> K-means "
        "fits the same k on every run, k = 2…15 and a 10% grid up to --kmeans-k-max, and keeps "
        "the k of the best silhouette; the curve of every k is drawn below. "
        f"<b>{AT_CAP}</b> marks a best k at the end of the scan: the silhouette was still rising, "
        "there is no interior optimum, and k (with every cluster-adjusted column) reports the "
        "range scanned rather than structure. <b>k = 1</b> means no clustering was preferred (best "
        "silhouette below --kmeans-min-silhouette); the silhouette then shown is that of the "
        "rejected best k &gt; 1, written in parentheses. <b>Stability</b> (0…1) is the adjusted "
        "Rand index between the clustering and refits from other seedings: near 1 the clusters "
        "are reproducible, low values mean the partition is one of many of similar quality. "
        "<b>Support</b> (0…1) says how sure the k decision is: the share of bootstrap resamples "
        "of the sample that take the same k (“k support”) and the same k = 1 vs k ≥ 2 decision; "
        f"below {ROBUST_SUPPORT:g} the sample does not settle it. Each k's partition is the "
        "lowest inertia of "
        "k-means++ seedings, warm starts from the previous k (--kmeans-n-init of each: 3 "
        "when the scan goes past 15, else 10) and a start from the next k's partition. "
        "<b>Cluster-adjusted metrics</b> subtract each cluster's mean first. Cai's columns "
        "(no “(w)”) average clusters without weights, so a tiny cluster of m types, whose "
        "centred mean cosine is near −1/(m − 1), can dominate them; “(w)” columns weight "
        "clusters by size over clusters of at least --cluster-min-size points (those left out "
        "are counted). “S_inter adj. (draws)” is the exact mean of Cai's one-occurrence-per-type "
        "draw, with the spread of a single draw beside it. <b>LID</b> is Levina &amp; Bickel's "
        "estimator on true distances: the mean over points has a long right tail, the median "
        "is robust; Cai's released code uses squared distances divided by k, so “LID (Cai)” is "
        "their exact convention (doubling theirs is only approximately ours). "
        "<b>Standard errors</b> (<code>_se</code>, under the sampled table) come from random "
        "half-samples: differences smaller than about twice them are sampling noise. "
        "<b>Mickus et al. 2024</b>, <i>Isotropy, Clusters, and Classifiers</i>, show that "
        "isotropy and cluster structure conflict: a layer cannot be both isotropic (high "
        "IsoScore) and well clustered (high silhouette). The PCA views show the sample on its "
        "main directions; they need the run's token sample."
    ),
    "rogue": (
        "<b>Luo 2020</b>, <i>Catch the “Tails” of BERT</i>: a few dimensions are the largest or "
        "smallest coordinate of most tokens in most layers (their argmax/argmin share is far "
        "above 1/d) and dominate cosine similarity. <b>Luo, Kulmizev &amp; Mao 2021</b>, "
        "<i>Positional Artefacts Propagate Through Masked Language Model Embeddings</i>: such "
        "outlier dimensions persist across layers and encode token position; zeroing them "
        "makes the space less anisotropic. Dark vertical stripes in the heat map are rogue "
        "dimensions; the positional profile shows whether they follow position. The clipping "
        "figure and table compare like with like: sampled clipped cosines with the same sample "
        "unclipped, exact (--clip-dims) with exact, never a sampled value with an exact one."
    ),
}

_CSS = """
:root { --fg:#1d2228; --muted:#5b6672; --line:#dfe3e8; --bg:#ffffff; --panel:#f6f8fa;
        --accent:#1f4e99; --ok:#1a7f37; --warn:#9a6700; --bad:#cf222e; }
* { box-sizing: border-box; }
html { font-size: 15px; }
body { margin: 0; color: var(--fg); background: var(--bg);
       font-family: system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial,
                    "Noto Sans", "Liberation Sans", sans-serif; line-height: 1.5; }
main { max-width: 1320px; margin: 0 auto; padding: 24px 32px 64px; }
header.top { padding-bottom: 4px; margin-bottom: 8px; }
h1 { font-size: 1.7rem; margin: 0 0 4px; }
h1 .sub { font-weight: 400; color: var(--muted); font-size: 1.05rem; display: block; }
h2 { font-size: 1.3rem; margin: 36px 0 8px; padding-top: 8px; border-top: 1px solid var(--line); }
h3 { font-size: 1.05rem; margin: 20px 0 6px; }
a { color: var(--accent); }
code, .mono { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, "DejaVu Sans Mono",
              monospace; font-size: 0.86em; }
.badge { display: inline-block; padding: 1px 10px; border-radius: 12px; font-size: 0.85rem;
         font-weight: 600; color: #fff; vertical-align: middle; }
.badge.complete { background: var(--ok); } .badge.other { background: var(--warn); }
.muted { color: var(--muted); }
.banner { border: 1px solid #d4a72c; background: #fff8c5; padding: 10px 14px; border-radius: 6px;
          margin: 12px 0; }
nav.toc { margin: 10px 0 0; font-size: 0.92rem; color: var(--muted); }
nav.toc a { margin-right: 14px; text-decoration: none; }
.meta { display: grid; grid-template-columns: repeat(auto-fit, minmax(300px, 1fr));
        gap: 12px 20px; }
.card { background: var(--panel); border: 1px solid var(--line); border-radius: 8px;
        padding: 10px 14px; }
.card h3 { margin: 0 0 6px; font-size: 0.95rem; color: var(--muted); text-transform: uppercase;
           letter-spacing: 0.04em; }
dl.kv { display: grid; grid-template-columns: max-content 1fr; gap: 2px 14px; margin: 0; }
dl.kv dt { color: var(--muted); }
dl.kv dd { margin: 0; overflow-wrap: anywhere; }
.scroll { overflow-x: auto; }
table.data { border-collapse: collapse; font-size: 0.86rem; font-variant-numeric: tabular-nums;
             margin: 6px 0 4px; }
table.data th, table.data td { padding: 4px 9px; border-bottom: 1px solid var(--line);
                               text-align: right; white-space: nowrap; }
table.data th { background: var(--panel); position: sticky; top: 0; font-weight: 600;
                border-bottom: 2px solid #c9d1d9; cursor: help; }
table.data td.txt, table.data th.txt { text-align: left; }
table.data tbody tr:hover td { background-color: #eef3fb; }
.note { color: var(--muted); font-size: 0.88rem; margin: 4px 0 0; }
.howto { background: #f3f7fd; border-left: 4px solid var(--accent); padding: 8px 14px;
         margin: 8px 0 14px; font-size: 0.93rem; border-radius: 0 6px 6px 0; }
.howto .label { font-weight: 700; color: var(--accent); margin-right: 6px; }
figure { margin: 14px 0 26px; padding: 12px; border: 1px solid var(--line); border-radius: 8px;
         background: #fff; }
figure img { display: block; max-width: 100%; height: auto; margin: 0 auto; }
figcaption { font-size: 0.9rem; color: #333d47; margin-top: 8px; max-width: 1100px; }
figcaption b { color: var(--fg); }
ul.absent { color: var(--muted); font-size: 0.88rem; margin: 4px 0; }
ul.files { padding-left: 18px; } ul.files li { margin: 2px 0; }
details { margin: 8px 0; } summary { cursor: pointer; color: var(--accent); }
pre { background: var(--panel); border: 1px solid var(--line); border-radius: 6px; padding: 10px;
      overflow-x: auto; font-size: 0.8rem; }
footer { margin-top: 40px; color: var(--muted); font-size: 0.82rem;
         border-top: 1px solid var(--line);
         padding-top: 8px; }
"""


# --------------------------------------------------------------------------------------------
# formatting


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _finite(v: Any) -> bool:
    try:
        return v is not None and math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


#: significant digits of every metric in the report's tables
SIG_DIGITS = 4
#: a column of kind "sci" is written in scientific notation, every cell of it, when any of its
#: non-zero values has |x| below SCI_BELOW or at least SCI_FROM
SCI_BELOW, SCI_FROM = 1e-3, 1e6


def _fixed(v: float, digits: int = SIG_DIGITS) -> str:
    """``v`` with ``digits`` significant digits in fixed notation, thousands separated."""
    if v == 0:
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(v))))
    s = f"{v:,.{decimals}f}"
    if decimals and abs(float(s.replace(",", ""))) >= 10 ** (digits - decimals):
        s = f"{v:,.{decimals - 1}f}"  # rounding carried into a new digit (9.9996 -> 10.000)
    return s


def _scientific(v: float, digits: int = SIG_DIGITS) -> str:
    """``v`` as ``5.570e−4``: ``digits`` significant digits, the exponent without padding."""
    mant, exp = f"{v:.{digits - 1}e}".split("e")
    return f"{mant}e{int(exp)}"


def column_notation(values: Sequence[Any]) -> str:
    """``"sci"`` or ``"fixed"``: the one notation of a metric column (see :func:`format_column`)."""
    v = np.array([float(x) for x in values if _finite(x)], dtype=np.float64)
    v = np.abs(v[v != 0])
    if len(v) and (v.min() < SCI_BELOW or v.max() >= SCI_FROM):
        return "sci"
    return "fixed"


def format_column(values: Sequence[Any], kind: str = "sci") -> list[str]:
    """The cells of one table column, formatted alike; the report's only number formatter.

    Kinds (:data:`COLUMNS`): ``int`` counts with thousands separators; ``text`` as is (cut at
    48 characters); ``corr`` a signed correlation, 2 decimals; ``unit`` a value in [−1, 1]
    (cosines, IsoScore, silhouettes), 3 decimals, so a column's cells share their absolute
    precision; ``sci`` any other metric, :data:`SIG_DIGITS` significant digits, and in ONE
    notation per column: scientific (``5.570e−4``) for every cell when any non-zero value
    has |x| < :data:`SCI_BELOW` or ≥ :data:`SCI_FROM`, else fixed (``0.1176``, ``12.35``,
    ``1,235``). Missing or non-finite values are ``—``; minus signs are U+2212.
    """
    if kind == "text":
        out = []
        for v in values:
            text = "" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)
            text = text.replace(",", ", ")
            out.append(_e(text if len(text) <= 48 else text[:47] + "…") or "—")
        return out
    notation = column_notation(values) if kind == "sci" else ""
    out = []
    for v in values:
        if not _finite(v):
            out.append("—")
            continue
        v = float(v)
        if kind == "int":
            s = f"{round(v):,}"
        elif kind == "unit":
            s = f"{v:.3f}"
        elif kind == "corr":
            s = f"{v:+.2f}"
        elif notation == "sci":
            s = _scientific(v)
        else:
            s = _fixed(v)
        out.append(s.replace("-", "−"))
    return out


def fmt_value(v: Any, kind: str = "sci") -> str:
    """One cell: :func:`format_column` of a column holding only ``v``."""
    return format_column([v], kind)[0]


def _bytes(n: float) -> str:
    """``n`` bytes in binary units (KiB = 1024 B, …), as the job's own sizing lines write them."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _seconds(s: Any) -> str:
    if not _finite(s):
        return "—"
    s = float(s)
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(s, 60)
    if m < 60:
        return f"{int(m)} min {sec:.0f} s"
    h, m = divmod(m, 60)
    return f"{int(h)} h {int(m)} min"


def _bar_style(v: float, lo: float, hi: float, kind: str) -> str:
    """A faint in-cell bar so a column's shape across layers reads at a glance."""
    if not _finite(v):
        return ""
    if kind == "corr":
        w = min(abs(v), 1.0) * 100
        col = "rgba(31,119,180,0.22)" if v < 0 else "rgba(214,39,40,0.22)"
    else:
        span = hi - lo
        base = min(lo, 0.0) if lo >= 0 or hi <= 0 else lo
        span = hi - base
        if not (_finite(span) and span > 0):
            return ""
        w = (v - base) / span * 100
        col = "rgba(31,78,153,0.15)"
    w = max(0.0, min(100.0, w))
    return f' style="background:linear-gradient(90deg,{col} {w:.1f}%,transparent {w:.1f}%)"'


def _truthy(v: Any) -> bool:
    """A boolean cell of layers.parquet (missing, NaN and None are False)."""
    if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA:
        return False
    return bool(v)


def _int_or_none(v: Any) -> int | None:
    return round(float(v)) if _finite(v) else None


def kmeans_cells(row: pd.Series) -> dict[str, str]:
    """The K-means cells of one layer, as text: ``kmeans_k``, ``kmeans_best_k``, ``kmeans_silhouette``.

    A best k at the cap of the grown search (``kmeans_k_at_cap``) carries :data:`AT_CAP`: the
    silhouette was still highest at the largest k allowed, so there is no interior optimum and
    k is the range searched. With k = 1 (no clustering preferred: the best silhouette over
    k ≥ 2 fell below ``--kmeans-min-silhouette``) the silhouette is that of the rejected best
    k > 1 and is written as such, never as a result of the chosen clustering.
    """
    k, best = _int_or_none(row.get("kmeans_k")), _int_or_none(row.get("kmeans_best_k"))
    sil = row.get("kmeans_silhouette")
    at_cap = _truthy(row.get("kmeans_k_at_cap"))
    mark = f" {AT_CAP}" if at_cap else ""
    out = {
        "kmeans_k": fmt_value(k, "int") + (mark if k is not None and k > 1 else ""),
        "kmeans_best_k": fmt_value(best, "int") + mark,
        "kmeans_silhouette": fmt_value(sil, "unit"),
    }
    if k == 1:
        parts = [f"best k&gt;1: {best}{mark}"] if best is not None and best > 1 else []
        if _finite(sil):
            parts.append(f"silhouette {fmt_value(sil, 'unit')}")
        out["kmeans_k"] = f"1 ({', '.join([*parts, 'rejected'])})"
        out["kmeans_silhouette"] = f"({fmt_value(sil, 'unit')}, rejected)" if _finite(sil) else "—"
    return out


#: tooltips of the K-means cells whose meaning differs from the column's header
_KMEANS_TIPS = {
    "rejected": "k = 1: no clustering preferred; the silhouette is that of the best k > 1, "
    "below --kmeans-min-silhouette, and was rejected",
    "cap": "the best k is the largest k fitted (--kmeans-k-max): the silhouette was still "
    "rising there, so there is no interior optimum",
}


def layers_table_html(
    layers: pd.DataFrame,
    columns: Sequence[str],
    *,
    bars: bool = True,
    headers: dict[str, str] | None = None,
) -> str:
    """An HTML table of ``layers`` restricted to ``columns`` (those present), nicely formatted.

    Every column is formatted at once by :func:`format_column` (one notation per column); the
    K-means cells by :func:`kmeans_cells` (the at-cap mark, the k = 1 wording). ``headers``
    replaces the headers of some columns.
    """
    cols = [c for c in columns if c in layers.columns]
    headers = headers or {}
    head = "".join(
        f'<th title="{_e(COLUMNS.get(c, (c, c, ""))[1])}">'
        f"{_e(headers.get(c, COLUMNS.get(c, (c,))[0]))}</th>"
        for c in cols
    )
    stats: dict[str, tuple[float, float]] = {}
    text: dict[str, list[str]] = {}
    for c in cols:
        kind = COLUMNS.get(c, ("", "", "sci"))[2]
        text[c] = format_column(list(layers[c]), kind)
        if kind == "text":
            continue
        v = pd.to_numeric(layers[c], errors="coerce").to_numpy(dtype=np.float64)
        v = v[np.isfinite(v)]
        stats[c] = (float(v.min()), float(v.max())) if len(v) else (math.nan, math.nan)
    no_bar = ("layer", "n_tokens", "n_types", "kmeans_k", "kmeans_best_k", "n_outlier_dims")
    rows = []
    for i, (_, r) in enumerate(layers.iterrows()):
        km = kmeans_cells(r) if {"kmeans_k", "kmeans_best_k"} & set(cols) else {}
        rejected = _int_or_none(r.get("kmeans_k")) == 1
        cells = []
        for c in cols:
            kind = COLUMNS.get(c, ("", "", "sci"))[2]
            style = ""
            if bars and kind != "text" and c not in no_bar and _finite(r[c]):
                if not (c == "kmeans_silhouette" and rejected):
                    style = _bar_style(float(r[c]), *stats[c], kind)
            cls = ' class="txt"' if kind == "text" else ""
            cell = km.get(c, text[c][i])
            tip = ""
            if c in km and rejected and c in ("kmeans_k", "kmeans_silhouette"):
                tip = _KMEANS_TIPS["rejected"]
            elif c in km and AT_CAP in cell:
                tip = _KMEANS_TIPS["cap"]
            if tip:
                cls = ' class="txt"' if c == "kmeans_k" and rejected else cls
                cell = f'<span title="{_e(tip)}">{cell}</span>'
            cells.append(f"<td{cls}{style}>{cell}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return (
        '<div class="scroll"><table class="data"><thead><tr>'
        + head
        + "</tr></thead><tbody>"
        + "".join(rows)
        + "</tbody></table></div>"
    )


def kmeans_notes(layers: pd.DataFrame, config: dict[str, Any]) -> str:
    """Footnotes of the K-means cells: what :data:`AT_CAP` and a k = 1 row mean, when present."""
    notes = []
    if "kmeans_k_at_cap" in layers.columns and any(map(_truthy, layers["kmeans_k_at_cap"])):
        flags = zip(layers["layer"], layers["kmeans_k_at_cap"], strict=True)
        at = [int(x) for x, c in flags if _truthy(c)]
        # runs of earlier versions grew their search up to --kmeans-k-cap
        option = "kmeans_k_cap" if "kmeans_k_cap" in config else "kmeans_k_max"
        flag = "--" + option.replace("_", "-")
        cap = config.get(option)
        notes.append(
            f"<b>{AT_CAP}</b> (layers {', '.join(map(str, at))}): the best k is the largest k "
            "fitted"
            + (f" ({flag} {_e(cap)})" if cap is not None else f" ({flag})")
            + ". The silhouette was still highest at the edge, so there is no interior "
            "optimum: k reports the range searched, not the number of clusters, and every "
            "cluster-adjusted column inherits it."
        )
    if "kmeans_k" in layers.columns:
        ks = zip(layers["layer"], layers["kmeans_k"], strict=True)
        ones = [int(x) for x, k in ks if _int_or_none(k) == 1]
        if ones:
            thr = config.get("kmeans_min_silhouette", 0.1)
            notes.append(
                f"<b>k = 1</b> (layers {', '.join(map(str, ones))}): no clustering preferred, "
                f"the best silhouette over k ≥ 2 was below --kmeans-min-silhouette ({_e(thr)}). "
                "Its k and silhouette are shown in parentheses and marked <i>rejected</i>; the "
                "cluster-adjusted columns of these layers subtract the layer mean only."
            )
    return "".join(f'<p class="note">{n}</p>' for n in notes)


def _img_tag(path: str, alt: str) -> str:
    data = base64.b64encode(read_bytes(path)).decode("ascii")
    return f'<img alt="{_e(alt)}" src="data:image/png;base64,{data}">'


def _figure_html(fig: Figure) -> str:
    return (
        f'<figure id="fig-{_e(fig.name)}">{_img_tag(fig.path, fig.name)}'
        f"<figcaption>{_e(fig.caption)}</figcaption></figure>"
    )


def _kv(items: Sequence[tuple[str, Any]]) -> str:
    body = "".join(f"<dt>{_e(k)}</dt><dd>{v}</dd>" for k, v in items if v not in (None, ""))
    return f'<dl class="kv">{body}</dl>'


def _page(title: str, body: str) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head>"
        f"<body><main>{body}</main></body></html>\n"
    )


def _write(out_dir: str, text: str) -> str:
    path = join(out_dir, REPORT)
    atomic_write_bytes(path, text.encode("utf-8"))
    return local_path(path) if is_local(path) else path


def _rel(target: str, start: str) -> str:
    """A relative href from directory ``start`` to ``target`` (URL-quoted)."""
    from urllib.parse import quote

    if not (is_local(target) and is_local(start)):
        return target
    try:
        rel = os.path.relpath(
            os.path.abspath(local_path(target)), os.path.abspath(local_path(start))
        )
    except ValueError:  # different drives
        rel = target
    return quote(rel.replace(os.sep, "/"))


# --------------------------------------------------------------------------------------------
# one run


def _metadata_html(run: RunView) -> str:
    m = run.manifest
    model = m.model or ModelInfo(id=run.model)
    corpus, counts, timings = m.corpus, m.counts, m.timings_s
    tok = m.tokenizer or TokenizerInfo()
    cfg = run.config
    model_items = [
        ("name", f'<span title="{_e(model.id)}">{_e(model_name(model.id))}</span>'),
        ("id", f'<span class="mono">{_e(model.id)}</span>'),
        ("revision", f'<span class="mono">{_e(model.revision)}</span>'),
        ("type", _e(model.model_type)),
        ("blocks / hidden size", _e(f"{model.num_layers or '?'} / {model.hidden_size or '?'}")),
        ("tokenizer", _e(tok.class_)),
        ("special tokens", "counted" if tok.special_tokens_counted else "excluded"),
        ("dtype / max length", _e(f"{cfg.get('dtype', '?')} / {cfg.get('max_length', '?')}")),
        ("clip dims", _e(", ".join(map(str, m.clip_dims))) if m.clip_dims else None),
        ("layers", _e(", ".join(map(str, m.layers)))),
    ]
    corpus_items = [
        ("source", f'<span class="mono">{_e(run.corpus)}</span>'),
        ("fingerprint", f'<span class="mono">{_e(str(corpus.fingerprint or "")[:16])}</span>'),
        ("files / shards", _e(f"{corpus.files} / {corpus.shards}")),
        ("size", _bytes(corpus.bytes) if corpus.bytes else None),
        ("documents", fmt_value(counts.documents, "int") if counts else None),
        ("windows", fmt_value(counts.windows, "int") if counts else None),
        ("tokens counted", fmt_value(counts.tokens, "int") if counts else None),
        ("padded tokens", fmt_value(counts.padded_tokens, "int") if counts else None),
        (
            "padded / real positions",
            f"{counts.padding_ratio:.3f}" if counts and counts.padding_ratio else None,
        ),
        ("[UNK] share", f"{counts.unk_share:.2%}" if counts and counts.unk_share else None),
    ]
    if m.dedup:  # --dedup: left out before the documents above were read
        corpus_items.append(("duplicates dropped", _e(m.dedup.describe())))
    if m.skipped:
        corpus_items.append(("skipped", _e(", ".join(f"{v} {k}" for k, v in m.skipped.items()))))
    bad = {k: v for k, v in (counts.nonfinite_tokens_per_layer if counts else {}).items() if v}
    if bad:
        corpus_items.append(
            ("non-finite vectors", _e(", ".join(f"layer {k}: {v}" for k, v in bad.items())))
        )
    thr = m.throughput.get("tokens_per_s_extract_wall")
    merged = m.kind == "merge"
    stages = ("load", "merge", "write") if merged else ("plan", "reduce", "write")
    run_items = [
        ("status", _status_badge(run.status)),
        ("kind", f"merge of {len(m.merged_runs or [])} runs (below)" if merged else None),
        ("started", _e(_when(m.started_at))),
        ("finished", _e(_when(m.finished_at))),
        ("total time", _seconds(timings.get("total"))),
        ("Ray start", _seconds(timings.get("ray_start")) if "ray_start" in timings else None),
        ("extract (wall)", None if merged else _seconds(timings.get("extract_wall"))),
        (
            "forward / fold (sum)",
            None
            if merged
            else f"{_seconds(timings.get('extract_forward_sum'))} / "
            f"{_seconds(timings.get('extract_fold_sum'))}",
        ),
        (
            " / ".join(stages),
            " / ".join(_seconds(timings.get(stage)) for stage in stages),
        ),
        ("throughput", f"{fmt_value(thr, 'int')} tokens/s" if _finite(thr) else None),
        ("workers", _e(_workers(m.workers))),
        ("reducers", _e(_reducers(m.reducers))),
        ("peak memory", _e(_peak_memory(m.memory, m.to_json()))),
        ("fingerprint", f'<span class="mono">{_e(str(m.fingerprint or "")[:16])}</span>'),
    ]
    cards = (
        f'<div class="card"><h3>Model</h3>{_kv(model_items)}</div>'
        f'<div class="card"><h3>Corpus</h3>{_kv(corpus_items)}</div>'
        f'<div class="card"><h3>Run</h3>{_kv(run_items)}</div>'
    )
    cards += merged_runs_html(m.merged_runs)
    ver = ", ".join(f"{k} {v}" for k, v in m.versions.items())
    details = (
        f"<details><summary>Configuration and versions</summary>"
        f'<p class="note">{_e(ver)}</p>'
        f"<pre>{_e(json.dumps(cfg, indent=2, default=str))}</pre></details>"
    )
    return f'<div class="meta">{cards}</div>{details}'


def merged_runs_html(merged_runs: list[dict[str, Any]] | None) -> str:
    """A merge's input runs (the manifest's ``merged_runs``): each run's directory, corpus
    (a merged run's corpora joined), tokens counted and when it finished; empty for an
    analysis."""
    if not merged_runs:
        return ""
    rows = "".join(
        f'<tr><td class="txt mono">{_e(r.get("path"))}</td>'
        f'<td class="txt mono">{_e(corpus_label(r.get("corpus")))}</td>'
        f"<td>{fmt_value(r.get('tokens'), 'int')}</td>"
        f'<td class="txt">{_e(_when(r.get("finished_at")))}</td></tr>'
        for r in merged_runs
    )
    return (
        '<div class="card" style="grid-column: 1 / -1"><h3>Merged runs</h3>'
        '<div class="scroll"><table class="data"><thead><tr><th class="txt">run</th>'
        '<th class="txt">corpus</th><th>tokens counted</th><th class="txt">finished</th>'
        f"</tr></thead><tbody>{rows}</tbody></table></div></div>"
    )


def _when(iso: Any) -> str:
    """``2026-11-22T02:37:16+00:00`` -> ``2026-11-22 02:37:16 UTC``."""
    if not iso:
        return ""
    s = str(iso).replace("T", " ", 1)
    return s[:-6] + " UTC" if s.endswith("+00:00") else s


def _workers(w: Any) -> str:
    if not isinstance(w, dict):
        return ""
    parts = [f"{w.get('num_workers', '?')} actor(s)"]
    if (w.get("largest_workers") or 0) > (w.get("num_workers") or 0):
        parts.append(f"up to {w['largest_workers']} as nodes joined")
    if w.get("num_gpus"):
        parts.append(f"{w['num_gpus']} GPU each")
    if w.get("num_cpus"):
        parts.append(f"{w['num_cpus']} CPU each")
    if w.get("batch_tokens"):
        parts.append(f"batches of {w['batch_tokens']:,} tokens")
    return ", ".join(parts)


def _reducers(r: Any) -> str | None:
    """``--reducers``: how many, and how often one was restored."""
    if not isinstance(r, dict) or not r.get("count"):
        return None
    restarts = sum(r.get("restarts") or [])
    return f"{r['count']} (statistics by token-id range and layer)" + (
        f", {restarts} restored after a loss" if restarts else ""
    )


def _peak_memory(mem: Any, manifest: dict[str, Any] | None = None) -> str | None:
    """The manifest's ``memory``: peak private memory (the process's own heap; resident
    memory, which also counts the object store's shared pages, where that is all there is) of
    the job, the largest extractor and the largest reducer; where the run recorded what each
    was sized for, against that (:func:`~embgeom_ray.sizing.peaks.describe_peaks`)."""
    if not isinstance(mem, dict) or not mem:
        return None
    against = describe_peaks(manifest) if manifest else None
    if against and "driver_start_private_bytes" in mem:
        return against.removeprefix("memory, peak private: ")

    def peak(who: str) -> str | None:
        for kind, label in (("private", " private"), ("rss", " resident")):
            value = mem.get(f"{who}_peak_{kind}_bytes")
            values = [v for v in (value if isinstance(value, list) else [value]) if v]
            if values:
                return _bytes(max(values)) + label
        return None

    parts = [
        f"{name} {value}"
        for name, value in (
            ("job", peak("driver")),
            ("extractor", peak("extractor")),
            ("reducer (largest)", peak("reducer")),
        )
        if value
    ]
    return ", ".join(parts) or None


def _status_badge(status: str) -> str:
    cls = "complete" if status == "complete" else "other"
    return f'<span class="badge {cls}">{_e(status)}</span>'


def _files_html(out_dir: str, base_href: str = "") -> str:
    """Every file of the run with its size: known files described, folders summed."""
    described = dict(RUN_FILES)
    order = {name: i for i, (name, _) in enumerate(RUN_FILES)}
    top: list[tuple[str, int]] = []
    folders: dict[str, list[int]] = {}
    for rel, size in RunDir(out_dir).files():
        if "/" in rel:
            folders.setdefault(rel.split("/", 1)[0], []).append(size)
        else:
            top.append((rel, size))
    items = []
    for name, size in sorted(top, key=lambda f: (order.get(f[0], len(order)), f[0])):
        desc = described.get(name, "")
        items.append(
            f'<li><a href="{_e(base_href + name)}"><code>{_e(name)}</code></a> '
            f"({_bytes(size)}){': ' + _e(desc) if desc else ''}</li>"
        )
    for folder, sizes in sorted(folders.items()):
        desc = RUN_FOLDERS.get(folder, "")
        items.append(
            f"<li><code>{_e(folder)}/</code> ({len(sizes)} files, {_bytes(sum(sizes))})"
            f"{': ' + _e(desc) if desc else ''}</li>"
        )
    return f'<ul class="files">{"".join(items)}</ul>'


def _sections_html(figures: Sequence[Figure]) -> tuple[str, list[tuple[str, str]]]:
    parts, toc = [], []
    for key, heading in SECTIONS:
        figs = [f for f in figures if f.section == key]
        drawn = [f for f in figs if f.path]
        absent = [f for f in figs if not f.path]
        if not figs:
            continue
        toc.append((f"sec-{key}", heading))
        parts.append(f'<section id="sec-{key}"><h2>{_e(heading)}</h2>')
        if key in HOW_TO_READ:
            parts.append(
                '<div class="howto"><span class="label">How to read this.</span>'
                f"{HOW_TO_READ[key]}</div>"
            )
        parts.extend(_figure_html(f) for f in drawn)
        if absent:
            li = "".join(
                f"<li><b>{_e(f.name)}</b>: {_e(f.caption.removeprefix('Not drawn: '))}</li>"
                for f in absent
            )
            parts.append(f'<p class="note">Not in this run:</p><ul class="absent">{li}</ul>')
        parts.append("</section>")
    return "".join(parts), toc


def clipping_table_html(
    layers: pd.DataFrame, pairs: Sequence[ClipPair], rule: str | None = None
) -> str:
    """The clipping table: each clipped column beside its unclipped counterpart of the same
    estimator (:func:`~embgeom_ray.report.figures.clipping.clipping_pairs`), headers naming the estimator,
    and a caption saying which pairs it holds. A sampled clipped value is never put beside an
    exact unclipped one.
    """
    cols = ["layer", "n_outlier_dims", "outlier_dims"]
    headers: dict[str, str] = {}
    done: set[str] = set()
    for p in pairs:
        if p.zeroed == "--clip-dims" and "clip_dims_exact" in layers.columns:
            cols.append("clip_dims_exact")
        if p.base and p.base not in done:
            cols.append(p.base)
            done.add(p.base)
            headers[p.base] = f"{p.label} ({p.estimator})"
        cols.append(p.clipped)
        headers[p.clipped] = f"{p.label} clipped ({p.estimator})"
    cols = list(dict.fromkeys(cols))
    estimators = sorted({p.estimator for p in pairs if p.base})
    lone = [p.clipped for p in pairs if not p.base]
    caption = (
        "Like with like: each clipped column follows its unclipped counterpart from the same "
        "estimator. "
        + (
            "<b>Sampled</b>: the cosines on the uniform token sample, unclipped "
            "(<code>*_sampled</code>) and with the layer's flagged dims zeroed "
            "(<code>*_clipped</code>); compare these with each other, not with the exact "
            "columns above (sampled S_intra covers only types with ≥ 2 sampled occurrences). "
            if "sampled" in estimators
            else ""
        )
        + (
            "<b>Exact</b>: over every counted token; IsoScore with the flagged dims zeroed"
            + (
                ", and the exact cosines with the --clip-dims dims zeroed beside the exact "
                "unclipped ones"
                if any(p.zeroed == "--clip-dims" and p.base for p in pairs)
                else ""
            )
            + ". "
            if "exact" in estimators
            else ""
        )
        + (
            f"{', '.join(f'<code>{_e(c)}</code>' for c in lone)}: this run has no unclipped "
            "counterpart of the same estimator, so these stand alone (do not compare them with "
            "the exact table). "
            if lone
            else ""
        )
        + "Flagged dims: see dims.parquet (<code>outlier</code>, <code>outlier_rule</code>)"
        + (f"; a dim is flagged when {_e(rule)}" if rule else "")
        + ". “Clipped” metrics set those dimensions to zero (Luo 2020)."
    )
    return layers_table_html(layers, cols, headers=headers) + f'<p class="note">{caption}</p>'


def sample_note(run: RunView) -> str:
    """What the sampled metrics were computed on: the manifest's ``sample`` point counts beside
    the tokens counted (the table note said only "the bounded random sample")."""
    note = run.manifest.sample or {}
    uniform, types = note.get("uniform_points"), note.get("type_uniform_points")
    if not isinstance(uniform, int) or uniform <= 0:
        return "From the bounded random sample of tokens (see samples.parquet)."
    tokens = run.tokens
    text = (
        f"From a uniform random sample of {uniform:,} token occurrences per layer (the same "
        "occurrences in every layer"
        + (f", of the {tokens:,} counted" if tokens else "")
        + ")"
    )
    if isinstance(types, int) and types > 0:
        text += f" and, for “S_inter (Cai)”, {types:,} token types with one random occurrence each"
    return text + "; see samples.parquet."


def render_report(run: RunView, figures: Sequence[Figure]) -> str:
    """The HTML text of a run's report (see :func:`write_report`)."""
    layers = run.layers
    model_short, corpus_short = model_name(run.model), short_name(run.corpus)
    banner = ""
    if run.status != "complete":
        banner = (
            f'<div class="banner"><b>This run is not complete</b> (manifest status: '
            f"{_e(run.status)}). Its tables may be partial or from an earlier run.</div>"
        )
    sampled = [c for c in SAMPLED_COLUMNS if c in layers.columns]
    se = [c for c in SE_COLUMNS if c in layers.columns]
    n_tokens = layers["n_tokens"].max() if "n_tokens" in layers.columns else None
    table = layers_table_html(layers, EXACT_COLUMNS)
    table_note = (
        '<p class="note">Exact over every counted token (no sampling). Variances are population '
        "variances (1/n). r(‖μ_t‖,V_t) is over types seen at least "
        f"{run.min_count} times. Hover a header for its definition; bars show each column's "
        "shape across layers (blue: negative, red: positive correlation). Numbers have "
        f"{SIG_DIGITS} significant digits, in one notation per column (scientific for the whole "
        f"column when a value is below {SCI_BELOW:g}); cosines, IsoScores and silhouettes 3 "
        "decimals.</p>"
    )
    sampled_html = ""
    if sampled:
        sampled_html = (
            "<h3>Sampled metrics</h3>"
            + layers_table_html(layers, ["layer", *sampled])
            + kmeans_notes(layers, run.config)
            + f'<p class="note">{_e(sample_note(run))} '
            "“(w)”: size-weighted over clusters of at least --cluster-min-size points; without "
            "it, Cai et al.'s unweighted mean over every cluster. LID means and medians use "
            "true (not squared) distances; “LID (Cai)” is Cai et al.'s convention.</p>"
        )
    if se:
        sampled_html += (
            "<details><summary>Standard errors of the sampled metrics</summary>"
            + layers_table_html(layers, ["layer", *se], bars=False)
            + '<p class="note">Each <code>&lt;metric&gt;_se</code> is the standard error of the '
            "metric from random half-samples of the layer's sample (K-means clusters held "
            "fixed): differences between layers or runs smaller than about twice it are "
            "sampling noise.</p></details>"
        )
    pairs = clipping_pairs(layers.columns)
    if pairs or "n_outlier_dims" in layers.columns:
        sampled_html += "<h3>Outlier dimensions and clipping</h3>" + clipping_table_html(
            layers, pairs, run.manifest.outlier_rules
        )
    sections, toc = _sections_html(figures)
    toc = [("sec-run", "Run"), ("sec-layers", "Per-layer summary"), *toc, ("sec-files", "Files")]
    nav = "".join(f'<a href="#{a}">{_e(t)}</a>' for a, t in toc)
    body = (
        f'<header class="top"><h1>Embedding geometry report {_status_badge(run.status)}'
        f'<span class="sub"><span title="{_e(run.model)}">{_e(model_short)}</span> · '
        f'<span title="{_e(run.corpus)}">{_e(corpus_short)}</span> · '
        f"{len(layers)} layers · {fmt_value(n_tokens, 'int')} tokens</span>"
        f'</h1><nav class="toc">{nav}</nav></header>{banner}'
        f'<section id="sec-run"><h2>Run</h2>{_metadata_html(run)}</section>'
        f'<section id="sec-layers"><h2>Per-layer summary</h2>{table}{table_note}'
        f"{sampled_html}</section>"
        f"{sections}"
        f'<section id="sec-files"><h2>Files</h2><p class="note">Relative links to this run\'s '
        f"tables (open them with pandas, pyarrow or DuckDB).</p>{_files_html(run.out)}</section>"
        f"<footer>Generated {_e(_when(now()))} by embgeom_ray {__version__} "
        f"(<code>python -m jobs.report {_e(run.out)}</code> rebuilds it). Self-contained: no "
        f"network access needed.</footer>"
    )
    return _page(f"Embedding geometry: {model_short} · {corpus_short}", body)


def write_report(
    out_dir: str,
    *,
    figures: Sequence[Figure] | None = None,
    elsewhere: Elsewhere | None = None,
    draw_here: bool = True,
) -> str:
    """Draw the run's figures and write ``out_dir/report.html``; returns its path.

    ``figures`` (from :func:`embgeom_ray.report.plots.make_all_plots` with ``include_absent=True``)
    skips re-drawing; ``elsewhere`` draws some of them in other processes, or all of them
    with ``draw_here=False`` (``make_all_plots``). Raises :class:`~embgeom_ray.run_dir.RunDirError` when ``out_dir`` is not a run
    directory (no manifest.json or layers.parquet), and a
    :class:`~embgeom_ray.errors.StorageError` at once when its object store does not answer.
    """
    check_input(out_dir, "run")
    run = RunView(out_dir)
    if figures is None:
        figures = make_all_plots(run, include_absent=True, elsewhere=elsewhere, draw_here=draw_here)
    return _write(run.out, render_report(run, figures))


# --------------------------------------------------------------------------------------------
# comparison of runs

def _run_labels(runs: Sequence[RunView], labels: Sequence[str] | None) -> list[str]:
    if labels is not None:
        if len(labels) != len(runs):
            raise ValueError(f"{len(labels)} labels for {len(runs)} runs")
        return list(labels)
    base = [model_name(r.model, 32) for r in runs]
    if len(set(base)) < len(runs):
        base = [f"{model_name(r.model, 28)} · {short_name(r.corpus, 24)}" for r in runs]
    if len(set(base)) < len(runs):
        base = [short_name(r.out, 40) for r in runs]
    if len(set(base)) < len(runs):
        base = [f"{i + 1}: {b}" for i, b in enumerate(base)]
    return base


def _evidence_cell(r: pd.Series) -> str:
    """How a change stands against its sampling noise (compare's ``kind`` / ``z``), or why it
    compares different clusterings (``not_comparable``)."""
    why = r.get("not_comparable")
    if r.get("evidence") == "clipping changed":
        return (
            f'<span class="muted" title="computed with other dimensions zeroed in the two runs '
            f'({_e(why)}: only in the baseline -> only in the run): not comparable, not ranked">'
            "clipping changed</span>"
        )
    if isinstance(why, str) and "not robust" in why:
        return (
            f'<span class="muted" title="the K-means k decision is not robust ({_e(why)}): '
            f'not comparable, not a change">k not robust</span>'
        )
    if isinstance(why, str) and why:
        return (
            f'<span class="muted" title="computed inside K-means clusters that differ between '
            f'the runs ({_e(why)}): not comparable, not ranked by z">clustering changed</span>'
        )
    kind = r.get("kind")
    if kind is None or (isinstance(kind, float) and not _finite(kind)):
        return "—"
    if kind == "exact":
        return '<span title="computed over every token: no sampling error">exact</span>'
    z = r.get("z")
    if not _finite(z):
        return '<span title="sampled; this run has no standard error for it">no s.e.</span>'
    text = f"z {z:+.1f}".replace("-", "−")
    if bool(r.get("within_noise")):
        why = _e("|z| < 2: within the runs' sampling noise")
        return f'<span class="muted" title="{why}">{text}, noise</span>'
    q = r.get("q")
    if _finite(q):
        text += f" · q {q:.2g}".replace("e-0", "e−").replace("-", "−")
    return f'<b title="|z| ≥ 2: beyond the sampling noise; q: its false discovery rate">{text}</b>'


#: the report's lists of changes: (title, the evidence groups it holds, what it says first).
#: The report sits below ``runs.compare`` and cannot import its names: the groups are
#: ``EXACT_LIST``, ``SAMPLED_LIST`` and ``APART_LIST`` there, the numbers its ``EXACT_BOUND``,
#: ``SAMPLED_BOUND`` and ``NOISE_Z`` (tests/runs/test_compare.py holds them equal)
CHANGE_LISTS = (
    ("Exact metrics", ("exact",),
     "Computed over every counted token: no sampling error, so any difference beyond 1e-6 "
     "relative is a change. Ranked by |Δ| over the metric's range across all runs and layers."),
    ("Sampled metrics", ("beyond noise", "no standard error", "within noise"),
     "Estimated on each run's sample, with a half-sample standard error: ranked by "
     "z = Δ / √(se_baseline² + se_run²), those with |z| ≥ 2 first, then those without a "
     "standard error by |Δ| over the range, then those within noise (|z| < 2). Many metrics "
     "are tested at once, so some reach |z| ≥ 2 by chance: q is the Benjamini–Hochberg "
     "adjusted p-value over the run's tested changes (q ≤ 0.05: kept at a 5% false discovery "
     "rate)."),
    ("Not comparable", ("clustering changed", "clipping changed"),
     "Computed inside K-means clusters that differ between the runs (another k: not one "
     "quantity measured twice, and not ranked by z), or with other dimensions zeroed (another "
     "set of flagged outlier dimensions, or of --clip-dims): the hover text says which. Ranked "
     "by |Δ| over the range."),
)  # fmt: skip
#: the evidence of the rows of ``changes.parquet`` that are not changes (``runs.compare``'s
#: ``NOT_A_CHANGE``): a k decision that is not robust, a difference within the bounds
NOT_A_CHANGE = ("k not robust", "agree")


def _changes_table_html(df: pd.DataFrame, baseline: str) -> str:
    """One list of changes as an HTML table: values, Δ, Δ / |baseline|, |Δ| / range, evidence."""
    rows = []
    # one notation for the baseline and run columns together, one for Δ (format_column)
    values = format_column([*df["baseline"], *df["value"]], "sci")
    base_txt, value_txt = values[: len(df)], values[len(df) :]
    change_txt = format_column(list(df["change"]), "sci")
    for i, (_, r) in enumerate(df.iterrows()):
        rel = "—" if not _finite(r["relative"]) else f"{r['relative']:+.1%}".replace("-", "−")
        small = " ⚠" if bool(r.get("small_run", False) or r.get("samples_differ", False)) else ""
        rows.append(
            f'<tr><td class="txt">{_e(r["run"])}{small}</td>'
            f'<td class="txt" title="{_e(COLUMNS.get(r["metric"], ("", r["metric"]))[1])}">'
            f"{_e(r['metric'])}</td>"
            f"<td>{_layer_pair(r)}</td><td>{base_txt[i]}</td>"
            f"<td>{value_txt[i]}</td><td>{change_txt[i]}</td>"
            f"<td>{rel}</td><td>{r['score']:.2f}</td><td>{_evidence_cell(r)}</td></tr>"
        )
    head = (
        '<tr><th class="txt">run</th><th class="txt">metric</th><th>layer</th>'
        f'<th title="{_e(baseline)}">baseline</th><th>run</th><th>Δ</th><th>Δ / |baseline|</th>'
        '<th title="|Δ| over the metric\'s range across all runs and layers">|Δ| / range</th>'
        '<th title="exact, or z = Δ / √(se_baseline² + se_run²) of a sampled metric">'
        "evidence</th></tr>"
    )
    return (
        f'<div class="scroll"><table class="data"><thead>{head}</thead><tbody>'
        f'{"".join(rows)}</tbody></table></div>'
    )


def _changes_html(
    df: pd.DataFrame,
    baseline: str,
    matching_note: str,
    warning: str | None = None,
    unchanged: str = "",
    sampled_tests: Sequence[str] = (),
) -> str:
    """The changes of :func:`embgeom_ray.runs.compare.changes_table` as HTML, in three lists
    (:data:`CHANGE_LISTS`: exact, sampled, not comparable), each in the table's order, with
    the comparison's size warning above them and ``sampled_tests`` (one line per run: how many
    sampled changes were tested, how many chance alone would put beyond noise) above the
    sampled list; differences within the bounds of the same result are not listed, like the
    rows of layers whose k decision is not robust. With no change listed, ``unchanged``: the
    line compare prints then (:func:`embgeom_ray.runs.compare.unchanged_line`)."""
    banner = (
        f'<div class="banner"><b>Runs of very different sizes.</b> {_e(warning)}</div>'
        if warning
        else ""
    )
    if "evidence" in df.columns:
        df = df.loc[(df["change"] != 0) & ~df["evidence"].isin(NOT_A_CHANGE)]
    if not len(df):
        return banner + f'<p class="note">{_e(unchanged[:1].upper() + unchanged[1:])}.</p>'
    parts = [banner]
    for title, groups, about in CHANGE_LISTS:
        rows = df.loc[df["evidence"].isin(groups)] if "evidence" in df.columns else df
        if not len(rows) and title == "Not comparable":
            continue
        parts.append(f"<h3>{_e(title)}</h3><p class=\"note\">{_e(about)}</p>")
        if title == "Sampled metrics" and sampled_tests:
            parts.append(
                '<p class="note">' + "<br>".join(_e(line) for line in sampled_tests) + "</p>"
            )
        parts.append(
            _changes_table_html(rows, baseline)
            if len(rows)
            else f'<p class="note">{_e(f"No {title.lower()} changed.")}</p>'
        )
    note = (
        f"Baseline: {baseline} (the first run); each list shows its largest changes (compare's "
        "--top). Differences within the bounds of the same result (exact metrics 1e-6, sampled "
        "1e-4 relative) and those of layers whose k decision is not robust in a run are not "
        "changes and are not listed. ⚠ marks a run too small for its sampled metrics to be "
        "compared (see the warning); z does not capture the effect of a smaller sample on "
        f"K-means, silhouettes or LID. {matching_note}."
    )
    parts.append(f'<p class="note">{_e(note)}</p>')
    return "".join(parts)


def _layer_pair(r: pd.Series) -> str:
    """``layer`` of the baseline, with the run's matched layer when it differs."""
    base, other = int(r["layer"]), int(r.get("run_layer", r["layer"]))
    return str(base) if base == other else f"{base} / {other}"


def _runs_table_html(runs: Sequence[RunView], labels: Sequence[str], out_dir: str) -> str:
    """The comparison's table of runs: model, revision, corpus, layers, tokens, status, and a
    link to each run's own report."""
    rows = []
    for run, label in zip(runs, labels, strict=True):
        m = run.manifest
        rev = str((m.model.revision if m.model else None) or "")
        report = join(run.out, REPORT)
        link = _rel(run.out, out_dir) + "/"
        name = f'<a href="{_e(link + REPORT)}">{_e(label)}</a>' if exists(report) else _e(label)
        rows.append(
            f'<tr><td class="txt">{name}</td>'
            f'<td class="txt mono" title="{_e(run.model)}">{_e(model_name(run.model, 60))}</td>'
            f'<td class="txt mono" title="{_e(rev)}">{_e(rev[:19])}</td>'
            f'<td class="txt mono">{_e(short_name(run.corpus, 60))}</td>'
            f"<td>{len(run.layers)}</td>"
            f"<td>{fmt_value(m.counts.tokens if m.counts else None, 'int')}</td>"
            f"<td>{_status_badge(run.status)}</td></tr>"
        )
    return (
        '<div class="scroll"><table class="data"><thead><tr><th class="txt">run</th>'
        '<th class="txt">model</th><th class="txt">revision</th><th class="txt">corpus</th>'
        "<th>layers</th><th>tokens</th><th>status</th></tr></thead><tbody>"
        + "".join(rows)
        + "</tbody></table></div>"
    )


def _comparison_caption(runs: Sequence[RunView]) -> str:
    return (
        "One panel per metric of layers.parquet, one line per run (colours as in the legend). "
        + (
            "The runs' models have different numbers of blocks, so x is the relative depth "
            "layer / blocks, by which their layers are matched. "
            if by_depth(runs)
            else ""
        )
        + "Panels of metrics estimated on the runs' samples say “sampled” in their title (the "
        "others are exact over every token); the band around a run's sampled line is ± 2 of its "
        "half-sample standard errors, where it has them (about a 95% interval of that run's "
        "estimate; compare's z weighs both runs' errors). Definitions are in the per-layer tables' headers and in each run's "
        "report."
    )


def write_comparison_report(
    run_dirs: Sequence[str | RunView],
    out_dir: str,
    *,
    changes: pd.DataFrame,
    matching_note: str,
    labels: Sequence[str] | None = None,
    warning: str | None = None,
    unchanged: str = "no metric changed",
    sampled_tests: Sequence[str] = (),
) -> str:
    """Write ``out_dir/report.html`` comparing runs layer by layer; returns its path.

    The first run is the baseline; ``run_dirs`` are run directories or their views (the
    views :func:`embgeom_ray.runs.compare.compare_runs` read, not read again). The page holds
    a table of the runs (model, revision, corpus, tokens, status, link to each run's own
    report), overlaid per-layer lines of every metric in :data:`COMPARE_METRICS` present in any
    run (x = layer index, or relative depth layer / blocks when the runs' models have different
    numbers of blocks: :func:`~embgeom_ray.run_view.by_depth`), the largest ``changes`` — the table
    :func:`embgeom_ray.runs.compare.changes_table` computed, layers matched as
    ``matching_note`` says, in three lists: exact, sampled (under ``sampled_tests``, one line
    per run on how its sampled changes stand against chance) and not comparable; differences
    within the bounds of the same result are not among them, and with no change listed the
    page says ``unchanged`` (:func:`embgeom_ray.runs.compare.unchanged_line`) — and each
    run's headline table. Raises :class:`~embgeom_ray.run_dir.RunDirError` for a
    directory that is not a run, ``ValueError`` for fewer than two runs.
    """
    if len(run_dirs) < 2:
        raise ValueError(f"a comparison needs at least two runs, got {len(run_dirs)}")
    runs = [d if isinstance(d, RunView) else RunView(d) for d in run_dirs]
    labels = _run_labels(runs, labels)
    metrics = [m for m in COMPARE_METRICS if any(r.layer_col(m) is not None for r in runs)]
    out_dir = str(out_dir).rstrip("/") or "/"
    headers = {name: spec[0] for name, spec in COLUMNS.items()}
    fig = Figure(
        "compare_metrics",
        plot_comparison(runs, labels, out_dir, metrics, headers),
        _comparison_caption(runs),
        "compare",
    )
    runs_table = _runs_table_html(runs, labels, out_dir)
    per_run = "".join(
        f"<h3>{_e(label)}</h3>"
        + layers_table_html(run.layers, EXACT_COLUMNS)
        + f'<p class="note">Files: {_files_inline(run.out, out_dir)}</p>'
        for run, label in zip(runs, labels, strict=True)
    )
    incomplete = [lab for r, lab in zip(runs, labels, strict=True) if r.status != "complete"]
    banner = (
        f'<div class="banner"><b>Not complete:</b> {_e(", ".join(incomplete))}; their tables may '
        "be partial.</div>"
        if incomplete
        else ""
    )
    nav = "".join(
        f'<a href="#{a}">{t}</a>'
        for a, t in (
            ("sec-runs", "Runs"),
            ("sec-metrics", "Metrics by layer"),
            ("sec-changes", "Largest changes"),
            ("sec-tables", "Per-run tables"),
        )
    )
    body = (
        f'<header class="top"><h1>Embedding geometry: comparison of {len(runs)} runs'
        f'<span class="sub">{_e(" vs ".join(labels))}</span></h1><nav class="toc">{nav}</nav>'
        f"</header>{banner}"
        f'<section id="sec-runs"><h2>Runs</h2>{runs_table}</section>'
        f'<section id="sec-metrics"><h2>Metrics by layer</h2><div class="howto"><span '
        f'class="label">How to read this.</span>Each metric is defined as in the single-run '
        f"reports: variance split and norm–variance correlation after <b>Yamagiwa et al. 2024</b>, "
        f"cosines after <b>Ethayarajh 2019</b> and <b>Cai et al. 2021</b>, IsoScore after "
        f"<b>Rudman et al. 2022</b>, silhouettes after <b>Mickus et al. 2024</b>. Lines that "
        f"coincide mean the runs agree; exact metrics of the same model on two corpora differ "
        f"only through the text.</div>{_figure_html(fig)}</section>"
        f'<section id="sec-changes"><h2>Largest changes</h2>'
        f"{_changes_html(changes, labels[0], matching_note, warning, unchanged, sampled_tests)}"
        "</section>"
        f'<section id="sec-tables"><h2>Per-run tables</h2>{per_run}</section>'
        f"<footer>Generated {_e(_when(now()))} by embgeom_ray {__version__}. Self-contained: no network "
        f"access needed.</footer>"
    )
    return _write(out_dir, _page(f"Embedding geometry: {' vs '.join(labels)}", body))


def _files_inline(run_out: str, out_dir: str) -> str:
    base = _rel(run_out, out_dir) + "/"
    links = [
        f'<a href="{_e(base + name)}"><code>{_e(name)}</code></a>'
        for name, _ in RUN_FILES
        if name.endswith(".parquet") and exists(join(run_out, name))
    ]
    return ", ".join(links)


def write_run_report(
    run: RunDir,
    manifest: Manifest,
    echo: Callable[[str], None] = print,
    elsewhere: Elsewhere | None = None,
    draw_here: bool = True,
) -> None:
    """Plots and ``report.html`` for a finished run; recorded in (and rewrites) the manifest.

    The measurement is already complete and saved: a failure here is reported, not raised.
    ``elsewhere`` draws some figures in other processes, all with ``draw_here=False``
    (:func:`write_report`).
    """
    import time

    t0 = time.perf_counter()
    try:
        path = write_report(run.url, elsewhere=elsewhere, draw_here=draw_here)
    except Exception as exc:  # plotting must never lose a finished run
        manifest.set(report_error=f"{type(exc).__name__}: {exc}")
        echo(f"warning: the report could not be written ({manifest.report_error})")
    else:
        if manifest.outputs is not None:
            manifest.outputs.report = REPORT
            manifest.set(outputs=manifest.outputs)
        echo(f"report: {path}")
    manifest.set(timings_s=manifest.timings_s | {"report": round(time.perf_counter() - t0, 3)})
    run.write_manifest(manifest)


__all__ = [
    "REPORT",
    "render_report",
    "write_comparison_report",
    "write_report",
]
