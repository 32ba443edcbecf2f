"""The engine-free table builder (core/tables.py) against float64 computations on the raw points."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from embgeom_ray.config import JobConfig
from embgeom_ray.core import metric_registry as registry
from embgeom_ray.core import metrics, partials, rogue
from embgeom_ray.core.kmeans_selection import select_k
from embgeom_ray.core.sampled_metrics import SAMPLED_LAYER_COLUMNS, sampled_metrics_of_points
from embgeom_ray.core.statistics import EmbeddingStatistics
from embgeom_ray.core.tables import (
    LID_CONVENTION,
    MIN_SAMPLE_POINTS,
    build_tables,
    finish_sampled_metrics,
    plan_sampled_metrics,
    sampled_row,
)
from tests import reference as ref
from tests.core.test_sampled_metrics import clustered_sample

LAYERS = [0, 3, 4]
D, B, T = 8, 12, 10
ROGUE = 5  # planted: +8 in every vector of layer 3, so the argmax of all its vectors
POSITIONAL = 2  # planted: grows with the position in layers 0 and 4
CLIP = [ROGUE]


class Tokenizer:
    @staticmethod
    def convert_ids_to_tokens(ids: list[int]) -> list[str]:
        return [f"tok{i}" for i in ids]


def config(**overrides) -> JobConfig:
    return JobConfig(model="m", corpus="c", out="o", min_count=2, **overrides)


@pytest.fixture(scope="module")
def folded() -> tuple[EmbeddingStatistics, dict[int, np.ndarray], np.ndarray, np.ndarray]:
    """Statistics of random points with planted dimensions, and the points themselves."""
    rng = np.random.default_rng(21)
    h = rng.normal(size=(len(LAYERS), B, T, D))
    h[1, ..., ROGUE] += 8.0
    h[[0, 2], :, :, POSITIONAL] += np.arange(T) * 0.7
    ids = rng.integers(0, 9, size=(B, T))
    keep = rng.random((B, T)) > 0.2
    stats = EmbeddingStatistics(LAYERS, D, max_positions=T, clip_dims=CLIP)
    stats.update(torch.as_tensor(h), torch.as_tensor(ids), torch.as_tensor(keep))
    points = {layer: h[li][keep] for li, layer in enumerate(LAYERS)}
    positions = np.broadcast_to(np.arange(T), (B, T))[keep]
    return stats, points, ids[keep], positions


@pytest.fixture(scope="module")
def tables(folded) -> dict[str, pd.DataFrame]:
    return build_tables(folded[0], Tokenizer, config().tables)


def test_each_layer_view_is_taken_once(folded, monkeypatch):
    stats = folded[0]
    taken: list[int] = []
    view = EmbeddingStatistics.layer

    def counting(self: EmbeddingStatistics, layer: int):
        taken.append(layer)
        return view(self, layer)

    monkeypatch.setattr(EmbeddingStatistics, "layer", counting)
    build_tables(stats, Tokenizer, config().tables)
    assert taken == LAYERS


def test_type_stats_and_layers_equal_two_pass_float64(folded, tables):
    _, points, ids, _ = folded
    tokens = {int(t): f"tok{t}" for t in np.unique(ids)}
    for layer in LAYERS:
        types, row, dims = ref.layer_tables(layer, points[layer], ids, tokens, min_count=2)
        ours = tables["type_stats"][tables["type_stats"].layer == layer].reset_index(drop=True)
        assert ours.token.tolist() == types.token.tolist()
        pd.testing.assert_frame_equal(
            ours.drop(columns="token"), types.drop(columns="token"), rtol=1e-10, atol=1e-12
        )
        got = tables["layers"].set_index("layer").loc[layer]
        for column, value in row.items():
            if column != "layer":
                np.testing.assert_allclose(got[column], value, rtol=1e-7, err_msg=column)
        ours_dims = tables["dims"][tables["dims"].layer == layer].reset_index(drop=True)
        pd.testing.assert_frame_equal(ours_dims[metrics.DIM_COLUMNS], dims, rtol=1e-10)


def test_participation_ratio_counts_the_directions_of_the_variance():
    """PR = (Σλ)²/Σλ²: k for variance spread equally over k directions, 1 for one direction,
    whatever the offset of the points; equal to the eigenvalues' ratio of the two-pass float64
    covariance (tests/reference.py) for any spectrum."""
    rng = np.random.default_rng(5)
    basis = np.linalg.qr(rng.normal(size=(D, D)))[0]
    for k in (1, 3, D):
        spectrum = np.zeros(D)
        spectrum[:k] = 2.5
        cov = basis @ np.diag(spectrum) @ basis.T
        assert metrics.participation_ratio(cov) == pytest.approx(k, rel=1e-12)
        assert metrics.participation_ratio(1e6 * cov) == pytest.approx(k, rel=1e-12)
    assert np.isnan(metrics.participation_ratio(np.zeros((D, D))))
    for offset in (0.0, 1e4):
        x = rng.normal(size=(400, D)) * rng.uniform(0.1, 3.0, size=D) + offset
        stats = EmbeddingStatistics([0], D)
        ids = torch.as_tensor(rng.integers(0, 9, size=(1, 400)))
        stats.update(torch.as_tensor(x)[None, None], ids)
        row = metrics.layer_row(stats.layer(0))
        np.testing.assert_allclose(row["participation_ratio"], ref.participation_ratio(x), rtol=1e-9)
        assert 1.0 < row["participation_ratio"] < D


def test_dims_flags_and_position_correlation(folded, tables):
    _, points, _, positions = folded
    dims = tables["dims"]
    assert list(dims.columns) == rogue.DIMS_COLUMNS
    for layer in LAYERS:
        x, d = points[layer], dims[dims.layer == layer]
        var = x.var(axis=0)
        np.testing.assert_allclose(d.variance_ratio, var / var.mean(), rtol=1e-10)
        mu = x.mean(axis=0)
        np.testing.assert_allclose(d.mean_zscore, (mu - mu.mean()) / mu.std(), rtol=1e-8)
        share = np.bincount(x.argmax(axis=1), minlength=D) / len(x)
        np.testing.assert_allclose(d.argmax_share, share, rtol=1e-12)
        share = np.bincount(x.argmin(axis=1), minlength=D) / len(x)
        np.testing.assert_allclose(d.argmin_share, share, rtol=1e-12)
        r = [np.corrcoef(positions, x[:, j])[0, 1] for j in range(D)]
        np.testing.assert_allclose(d.position_corr, r, rtol=1e-8, atol=1e-12)
    flagged = rogue.flagged_dims(dims)
    assert ROGUE in flagged[3] and ROGUE not in flagged[0] + flagged[4]
    rule = dims[(dims.layer == 3) & (dims.dim == ROGUE)].outlier_rule.item()
    assert "tail_share" in rule.split(",")
    assert all(d.outlier == bool(d.outlier_rule) for d in dims.itertuples())


def test_clipping_columns_equal_float64_on_clipped_points(folded, tables):
    _, points, ids, _ = folded
    flagged = rogue.flagged_dims(tables["dims"])
    layers = tables["layers"].set_index("layer")
    for layer in LAYERS:
        got = layers.loc[layer]
        assert got.n_outlier_dims == len(flagged[layer])
        assert got.outlier_dims == ",".join(map(str, flagged[layer]))
        x = points[layer].copy()
        x[:, flagged[layer]] = 0.0
        np.testing.assert_allclose(got.isoscore_clipped, ref._isoscore(x), rtol=1e-5)
        x = points[layer].copy()
        x[:, CLIP] = 0.0
        _, aniso, s_inter, s_intra = ref.brute_force_cosines(x, ids)
        assert got.clip_dims_exact == ",".join(map(str, CLIP))
        np.testing.assert_allclose(got.anisotropy_clipped_exact, aniso, rtol=1e-9)
        np.testing.assert_allclose(got.s_inter_clipped_exact, s_inter, rtol=1e-9)
        np.testing.assert_allclose(got.s_intra_clipped_exact, s_intra, rtol=1e-9)
        np.testing.assert_allclose(got.isoscore_clipped_exact, ref._isoscore(x), rtol=1e-5)


def test_positions_table(folded, tables):
    _, points, _, positions = folded
    pos = tables["positions"]
    union = sorted({d for ds in rogue.flagged_dims(tables["dims"]).values() for d in ds})
    assert list(pos.columns) == ["layer", "position", "count", "mean_norm"] + [
        f"dim_{d}" for d in union
    ]
    for layer in LAYERS:
        rows = pos[pos.layer == layer]
        assert rows.position.tolist() == sorted(set(positions.tolist()))
        for row in rows.itertuples():
            x = points[layer][positions == row.position]
            assert row.count == len(x)
            np.testing.assert_allclose(row.mean_norm, np.linalg.norm(x.mean(0)), rtol=1e-12)
            for d in union:
                np.testing.assert_allclose(getattr(row, f"dim_{d}"), x[:, d].mean(), rtol=1e-12)


def test_one_table_conveniences_build_the_same_tables(folded, tables):
    stats = folded[0]
    names = Tokenizer.convert_ids_to_tokens
    pd.testing.assert_frame_equal(metrics.type_stats_table(stats, names), tables["type_stats"])
    exact = tables["layers"][metrics.LAYER_COLUMNS]
    pd.testing.assert_frame_equal(metrics.layers_table(stats, min_count=2), exact)
    pd.testing.assert_frame_equal(
        metrics.dims_table(stats), tables["dims"][metrics.DIM_COLUMNS], check_exact=True
    )
    pd.testing.assert_frame_equal(
        rogue.rogue_dims_table(stats, rogue.OutlierRules()), tables["dims"]
    )


def test_mean_cosine_from_unit_sum_equals_brute_force():
    rng = np.random.default_rng(4)
    u = rng.normal(size=(9, 5)) + 1.0
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    cos = u @ u.T
    brute = (cos.sum() - np.trace(cos)) / (9 * 8)
    s = u.sum(axis=0)
    np.testing.assert_allclose(partials.mean_cosine_from_unit_sum(s @ s, 9), brute, rtol=1e-12)


# ---------------------------------------------------------------- the sampled stage's parts


def run_locally(tables: dict[str, pd.DataFrame], sample, cfg: JobConfig) -> dict:
    """The sampled stage in this process: the plan, select_k and sampled_row per layer."""
    plan = plan_sampled_metrics(sample, tables["dims"], Tokenizer, cfg.sampled)
    kmeans = {
        layer: select_k(x.vectors, groups=x.content_keys, **plan.kmeans_options)
        for layer, x in plan.layers.items()
    }
    rows = {
        layer: sampled_row(
            x.vectors,
            x.token_ids,
            x.type_vectors,
            kmeans[layer],
            x.clip_dims,
            groups=x.content_keys,
            **plan.row_options,
        )
        for layer, x in plan.layers.items()
    }
    note = finish_sampled_metrics(tables, plan, rows, kmeans)
    return {"plan": plan, "kmeans": kmeans, "rows": rows, "note": note}


def test_sampled_stage_parts(tables):
    tables = dict(tables)
    exact_layers = tables["layers"]
    sample = clustered_sample(layers=LAYERS, d=D)
    cfg = config(lid_k=10, kmeans_k_max=5)
    out = run_locally(tables, sample, cfg)
    plan, kmeans, n = out["plan"], out["kmeans"], sample.num_uniform
    assert not plan.skipped and list(plan.layers) == LAYERS
    assert plan.kmeans_options["k_max"] == 5
    assert plan.row_options == {
        "lid_k": 10,
        "silhouette_max_points": 4096,
        "seed": 0,
        "cluster_min_size": 20,
        "s_inter_draws": 20,
        "se_replicates": 10,
    }
    assert plan.kmeans_options["n_init"] is None and plan.kmeans_options["stability_seeds"] == 2
    flagged = rogue.flagged_dims(tables["dims"])
    layers = tables["layers"].set_index("layer")
    for layer, x in plan.layers.items():
        pts = sample.points(layer)
        np.testing.assert_array_equal(x.vectors, pts.vectors)
        np.testing.assert_array_equal(x.type_vectors, sample.type_points(layer).vectors)
        assert x.clip_dims == flagged[layer]
        np.testing.assert_array_equal(x.content_keys, pts.content_keys)
        expected = sampled_metrics_of_points(
            pts.vectors, pts.token_ids, x.type_vectors, kmeans[layer], lid_k=10,
            groups=pts.content_keys,
        )  # fmt: skip
        for column in SAMPLED_LAYER_COLUMNS:
            np.testing.assert_array_equal(layers.loc[layer, column], expected[column])
        clipped = pts.vectors.copy()
        clipped[:, flagged[layer]] = 0.0
        _, aniso, s_inter, s_intra = ref.brute_force_cosines(clipped, pts.token_ids)
        np.testing.assert_allclose(layers.loc[layer, "anisotropy_clipped"], aniso, rtol=1e-9)
        np.testing.assert_allclose(layers.loc[layer, "s_inter_clipped"], s_inter, rtol=1e-9)
        np.testing.assert_allclose(layers.loc[layer, "s_intra_clipped"], s_intra, rtol=1e-9)
        samples = tables["samples"][tables["samples"].layer == layer]
        uniform = samples[samples["sample"] == "uniform"]
        np.testing.assert_array_equal(uniform.cluster.to_numpy(int), kmeans[layer].labels)
        assert samples[samples["sample"] == "type_uniform"].cluster.isna().all()
        curve = tables["kmeans"][tables["kmeans"].layer == layer]
        km = kmeans[layer]
        assert curve["k"].tolist() == sorted(km.silhouettes) == [2, 3, 4, 5]
        np.testing.assert_array_equal(curve["silhouette"], [km.silhouettes[k] for k in curve["k"]])
        np.testing.assert_array_equal(curve["inertia"], [km.inertias[k] for k in curve["k"]])
        assert curve.loc[curve["best"], "k"].tolist() == [km.best_k]
        assert curve.loc[curve["chosen"], "k"].tolist() == ([km.k] if km.k > 1 else [])
    pd.testing.assert_frame_equal(tables["layers"][exact_layers.columns], exact_layers)
    # every column of every table is declared in the registry, in its order, and every
    # declared column is there (positions: a dim_<d> per dimension flagged in any layer)
    assert list(tables["layers"].columns) == registry.layer_columns()
    for name in (registry.TYPE_STATS, registry.DIMS, registry.KMEANS):
        assert list(tables[name].columns) == registry.columns(name), name
    flagged = sorted({d for ds in rogue.flagged_dims(tables["dims"]).values() for d in ds})
    expand = {"dim_<d>": [f"dim_{d}" for d in flagged]}
    assert flagged and list(tables["positions"].columns) == [
        c for col in registry.columns(registry.POSITIONS) for c in expand.get(col, [col])
    ]
    iso, sil = layers["isoscore"].to_numpy(), layers["kmeans_silhouette"].to_numpy()
    assert out["note"] == {
        "uniform_points": n,
        "type_uniform_points": sample.num_types,
        "isoscore_silhouette_corr": pytest.approx(np.corrcoef(iso, sil)[0, 1], rel=1e-12),
        "lid_convention": LID_CONVENTION,
    }


def test_too_small_a_sample_is_skipped(tables):
    tables = dict(tables)
    exact_layers = tables["layers"]
    sample = clustered_sample(layers=LAYERS, d=D, n_docs=1, t=3)
    assert sample.num_uniform < MIN_SAMPLE_POINTS
    out = run_locally(tables, sample, config())
    assert out["plan"].skipped and out["rows"] == {}
    assert out["note"] == {
        "uniform_points": sample.num_uniform,
        "type_uniform_points": sample.num_types,
        "skipped": f"sample of {sample.num_uniform} points < 32: no sampled metrics",
    }
    assert tables["layers"] is exact_layers
    assert len(tables["samples"]) == len(LAYERS) * (sample.num_uniform + sample.num_types)
    assert tables["samples"].cluster.isna().all()
