"""The sample's per-layer work on Ray tasks (embgeom_ray.distributed.sample_tasks): the same
sampled-stage results and the same samples.parquet as the driver computes itself, the driver
holding no layer of the sample."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from embgeom_ray.core.options import SampledOptions
from embgeom_ray.core.sample_layers import InMemorySample, sample_layers
from embgeom_ray.core.samples import ActivationSample
from embgeom_ray.distributed import sample_tasks
from embgeom_ray.distributed.sampled_stage import add_sampled_metrics
from embgeom_ray.run_dir import HEADER_KEY, RunDir
from embgeom_ray.sizing import formulas
from embgeom_ray.sizing.formulas import on_workers
from tests.runs.test_sample_layers import LAYERS, D, _save_parts, fake_sample, tokens

pytestmark = pytest.mark.slow


def _tables() -> dict[str, pd.DataFrame]:
    dims = pd.DataFrame({"layer": [0, 0, 2], "dim": [1, 3, 4], "outlier": [True, False, True]})
    return {"dims": dims, "layers": pd.DataFrame({"layer": LAYERS, "isoscore": [0.1, 0.3, 0.2]})}


def test_tasks_give_the_drivers_results_and_table(tmp_path, ray_local, monkeypatch):
    """A sample merged from two group files, once in the driver and once on Ray tasks
    (SAMPLE_ON_WORKERS_BYTES lowered to 0; pieces of 40 rows): the same note, K-means labels,
    sampled columns and kmeans table, bit for bit; samples.parquet holds the same rows,
    schema and header (as does a sample held in memory), its row groups each within one
    (layer, sample)."""
    urls = _save_parts(tmp_path, [fake_sample(150, s, size=200) for s in (5, 6)])
    options = SampledOptions(kmeans_k_max=6, kmeans_stability_seeds=0, sampled_se_replicates=0)
    layered = sample_layers(urls)
    assert not on_workers(layered)
    here = _tables()
    note_here, clusters_here = add_sampled_metrics(here, layered, options)
    RunDir(str(tmp_path / "here")).write_samples(layered, tokens, clusters_here)

    monkeypatch.setattr(formulas, "SAMPLE_ON_WORKERS_BYTES", 0)
    monkeypatch.setattr(sample_tasks, "SAMPLE_PIECE_BYTES", 40 * (4 * D + 96))
    assert on_workers(layered)
    there = _tables()
    # placed once by the caller (finish_run), as the rows' tasks after: not placed again
    where = sample_tasks.placement(layered)
    placed = sample_tasks.placement
    monkeypatch.setattr(sample_tasks, "placement", lambda sample: pytest.fail("placed again"))
    note_there, clusters_there = add_sampled_metrics(there, layered, options, where=where)
    monkeypatch.setattr(sample_tasks, "placement", placed)
    assert json.dumps(note_there) == json.dumps(note_here)
    assert clusters_there.keys() == clusters_here.keys() == set(LAYERS)
    for layer in LAYERS:
        np.testing.assert_array_equal(clusters_there[layer], clusters_here[layer])
    for name in ("layers", "kmeans"):
        pd.testing.assert_frame_equal(there[name], here[name], check_exact=True)

    whole = ActivationSample.load(urls[0]).merge(ActivationSample.load(urls[1]))
    # local files are read on this node; a sample in the object store anywhere
    assert "scheduling_strategy" in sample_tasks.placement(layered)
    assert sample_tasks.placement(InMemorySample(whole)) == {"memory": 10 * (4 * D + 48) * 400}
    want = pq.read_table(tmp_path / "here" / "samples.parquet")
    for name, source in (("tasks", layered), ("memory", InMemorySample(whole))):
        pieces = sample_tasks.table_pieces_on_ray(source, tokens, clusters_there)
        RunDir(str(tmp_path / name)).write_samples(source, tokens, clusters_there, pieces)
        path = tmp_path / name / "samples.parquet"
        got = pq.read_table(path)
        assert got.equals(want) and got.schema.metadata == want.schema.metadata
        assert json.loads(got.schema.metadata[HEADER_KEY]) == whole.header()
        groups = pq.ParquetFile(path)
        # 200 uniform and 200 type-uniform rows a layer, in pieces of 40 rows
        assert groups.metadata.num_row_groups == len(LAYERS) * 10
        for i in range(groups.metadata.num_row_groups):
            rows = groups.read_row_group(i, columns=["layer", "sample"]).to_pandas()
            assert len(rows) == 40 and len(rows.drop_duplicates()) == 1
        assert RunDir(str(tmp_path / name)).load_sample().to_bytes() == whole.to_bytes()


#: the measured steps of :func:`test_the_driver_holds_pieces_not_a_layer`, in a fresh process
#: joined to the tests' Ray: a worker process that has run other tests keeps their heap (its
#: holes and arenas), which the growth measured here must not depend on
PIECES_SCRIPT = r"""
import json, sys
import numpy as np, ray
from embgeom_ray.core.sample_layers import sample_layers
from embgeom_ray.distributed import sample_tasks
from embgeom_ray.distributed.process_memory import anon_bytes, sampler
from embgeom_ray.run_dir import RunDir
from tests.runs.test_sample_layers import tokens

address, url, out, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ray.init(address=address, log_to_driver=False)
layered = sample_layers([url])
labels = {layer: np.arange(n) % 7 for layer in layered.layers}
# once first: what the first write loads and keeps (Parquet's writer, zstd, the allocator's
# arenas; ~60 MiB, within DRIVER_RUN_BYTES) is not the sample's
warm = sample_tasks.table_pieces_on_ray(layered, tokens, labels)
RunDir(out + "/warm").write_samples(layered, tokens, labels, warm)
peak = sampler()
base = anon_bytes()
peak.peak = base
source = ray.put(layered)
points = []
for layer in layered.layers:
    refs = sample_tasks.submit_inputs(source, layer, [])
    points.append(ray.get(refs[0])["uniform_points"])
    ray.wait(refs, num_returns=len(refs))
    del refs
pieces = sample_tasks.table_pieces_on_ray(layered, tokens, labels)
RunDir(out + "/run").write_samples(layered, tokens, labels, pieces)
print(json.dumps({"grew": peak.peak_bytes() - base, "points": points}))
"""


def test_the_driver_holds_pieces_not_a_layer(tmp_path, ray_local):
    """A sample of L = 2 layers of 8,192 entries at d = 2,048 (Q_l = 64 MiB, on Ray tasks by
    the default rule): the sampled stage's inputs made by tasks and samples.parquet written
    from their pieces raise the driver's private memory (RssAnon) by no more than the
    formula's share (4 pieces of 8 MiB and the labels), less than half of one layer, where
    the driver itself would hold 10 · Q_l. The driver is a fresh process joined to the tests'
    Ray (:data:`PIECES_SCRIPT`)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from embgeom_ray.sizing.formulas import driver_sample_bytes, sample_layer_bytes

    n, d, layers = 4096, 2048, [0, 1]
    url = _save_parts(tmp_path, [fake_sample(n, 3, layers=layers, dim=d, size=n)])[0]
    assert on_workers(sample_layers([url]))
    repo = Path(__file__).resolve().parents[2]
    address = ray_local.get_runtime_context().gcs_address
    done = subprocess.run(
        [sys.executable, "-c", PIECES_SCRIPT, address, url, str(tmp_path), str(n)],
        capture_output=True, text=True, timeout=600, cwd=repo,
        env=os.environ | {"PYTHONPATH": str(repo)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["points"] == [n] * len(layers)
    grew, q_l = result["grew"], sample_layer_bytes(2 * n, d)
    assert grew <= driver_sample_bytes(len(layers), 2 * n, d) < q_l / 2, (grew, q_l)
    got = pq.read_table(tmp_path / "run" / "samples.parquet", columns=["layer", "cluster"])
    assert got.num_rows == 2 * n * len(layers)
    assert got.column("cluster").null_count == n * len(layers)
