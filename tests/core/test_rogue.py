"""Rogue dimensions, positional artefacts and clipping, on models with planted dimensions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from embgeom_ray.config import build_config
from embgeom_ray.runs.pipeline import analyze
from tests.conftest import start_local_ray, write_jsonl
from tests.reference import _isoscore, brute_force_cosines, reference_activations
from tests.runs.test_job_end_to_end import english_documents
from tests.tiny_models import make_tiny_bert, plant_outlier_dimension, plant_positional_dimension

pytestmark = pytest.mark.slow

OUTLIER, POSITIONAL = 5, 17


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> str:
    path = make_tiny_bert(str(tmp_path_factory.mktemp("planted")), max_position=64)
    plant_outlier_dimension(path, OUTLIER, 8.0)
    plant_positional_dimension(path, POSITIONAL, 0.01)
    return path


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return english_documents(20, 700)


def run(tmp_path, model: str, docs: list[str], name: str, **opts) -> dict[str, pd.DataFrame]:
    corpus = write_jsonl(tmp_path / f"{name}.jsonl", docs)
    out = tmp_path / name
    cfg = build_config(
        None,
        {
            "model": model,
            "corpus": corpus,
            "out": str(out),
            "max_length": 48,
            "sample_size": 512,
            "kmeans_k_max": 6,
            "no_report": True,
            **opts,
        },
    )
    analyze(cfg, echo=lambda *_: None)
    return {t: pd.read_parquet(out / f"{t}.parquet") for t in ("layers", "dims", "positions")}


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory, _ray_session, planted, docs) -> tuple[Path, dict]:
    """The run of the planted model with the default options (its directory and tables),
    made once: checked by one test, and the run another takes its clip dims from."""
    import ray

    if not ray.is_initialized():
        start_local_ray()  # left running for the session's other tests (conftest)
    root = tmp_path_factory.mktemp("rogue")
    return root / "planted", run(root, planted, docs, "planted")


def test_planted_dimensions_are_found_exactly(planted_run):
    _, tables = planted_run
    dims = tables["dims"]
    for layer, group in dims.groupby("layer"):
        flagged = set(group.loc[group["outlier"], "dim"])
        assert OUTLIER in flagged, layer
        row = group.set_index("dim").loc[OUTLIER]
        assert row["argmax_share"] > 0.9 and "tail_share" in row["outlier_rule"]
    # layer 0 (embeddings): exactly the two planted dimensions
    l0 = dims[dims.layer == 0].set_index("dim")
    assert set(l0.index[l0["outlier"]]) == {OUTLIER, POSITIONAL}
    # the positional dimension is the one most correlated with position, strongly
    corr = l0["position_corr"].abs()
    assert corr.idxmax() == POSITIONAL and corr[POSITIONAL] > 0.85
    assert corr.drop([POSITIONAL]).max() < 0.6
    # positions.parquet profiles the flagged dims; the planted one rises with position
    pos = tables["positions"]
    prof = pos[pos.layer == 0].sort_values("position")
    assert np.corrcoef(prof["position"], prof[f"dim_{POSITIONAL}"])[0, 1] > 0.9
    assert prof["count"].sum() == tables["layers"].set_index("layer").loc[0, "n_tokens"]
    # the outlier dimension drives anisotropy: clipping it lowers cosine structure via IsoScore
    layers = tables["layers"].set_index("layer")
    assert (layers["isoscore_clipped"] > layers["isoscore"]).all()


def test_position_correlation_equals_token_level_pearson(planted_run, planted, docs):
    """On every layer of the planted model's run (a run of its own over layers 0 and 2 was one
    job more for the same numbers: a layer's statistics do not depend on the others)."""
    _, tables = planted_run
    dims = tables["dims"]
    layers = sorted(int(layer) for layer in dims["layer"].unique())
    assert len(layers) >= 3
    acts = reference_activations(planted, docs, 48, layers)
    for layer in layers:
        a = acts[layer]
        ref = [np.corrcoef(a.positions, a.points[:, d])[0, 1] for d in range(a.points.shape[1])]
        ours = dims[dims.layer == layer].sort_values("dim")["position_corr"].to_numpy()
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)


def test_exact_clipping_equals_float64_on_clipped_activations(
    tmp_path, ray_local, planted, docs, planted_run
):
    first_out, first = planted_run
    flagged = sorted(set(first["dims"].loc[first["dims"]["outlier"], "dim"]))
    clipped = run(tmp_path, planted, docs, "clipped", clip_dims_from=str(first_out))
    layers = clipped["layers"].set_index("layer")
    assert (layers["clip_dims_exact"] == ",".join(map(str, flagged))).all()
    acts = reference_activations(planted, docs, 48)
    for layer, a in acts.items():
        x = a.points.copy()
        x[:, flagged] = 0.0
        _, aniso, s_inter, s_intra = brute_force_cosines(x, a.token_ids)
        row = layers.loc[layer]
        assert row["anisotropy_clipped_exact"] == pytest.approx(aniso, abs=1e-6)
        assert row["s_inter_clipped_exact"] == pytest.approx(s_inter, abs=1e-6)
        assert row["s_intra_clipped_exact"] == pytest.approx(s_intra, abs=1e-6)
        assert row["isoscore_clipped_exact"] == pytest.approx(_isoscore(x), rel=1e-5, abs=1e-7)
        # and clipping the outlier removes most anisotropy, as Luo and Luo et al. found
        assert row["anisotropy_clipped_exact"] < 0.5 * row["anisotropy"]
