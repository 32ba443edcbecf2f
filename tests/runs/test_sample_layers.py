"""The sample a layer at a time (embgeom_ray.core.sample_layers, embgeom_ray.runs.run_samples): the same sample, tables and
sampled-stage inputs as the whole sample in memory, and a driver that holds one layer of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from embgeom_ray.core.options import SampledOptions
from embgeom_ray.core.sample_layers import (
    FileSample,
    InMemorySample,
    MergedSamples,
    merged_layers,
    sample_layers,
)
from embgeom_ray.core.samples import ActivationSample, type_keys
from embgeom_ray.core.tables import plan_sampled_metrics, sampled_layer
from embgeom_ray.errors import StatisticsMismatchError
from embgeom_ray.run_dir import HEADER_KEY, ROW_GROUP_KEYS, RunDir, write_table
from embgeom_ray.runs.run_samples import RunSamples, run_samples

REPO = Path(__file__).resolve().parents[2]
LAYERS = [0, 2, 5]
D = 8


def fake_sample(n: int, seed: int, *, layers=LAYERS, dim=D, rule="window", size=None,
                vocab=50_000, metadata=None) -> ActivationSample:  # fmt: skip
    """A sample of ``n`` random occurrences (uniform and type-uniform) built from its arrays:
    random keys, ids and float32 vectors (the selection of a real fold, without the fold)."""
    rng = np.random.default_rng(seed)
    size = size or n
    empty = ActivationSample(layers, dim, size, 7, type_size=size, content_rule=rule,
                             metadata=metadata)  # fmt: skip

    def occurrences(m: int, tokens: np.ndarray) -> dict[str, np.ndarray]:
        return {
            "key": rng.integers(0, 2**62, m), "doc_id": rng.integers(0, 10**6, m),
            "window": rng.integers(0, 50, m), "position": rng.integers(0, 512, m),
            "token_id": tokens, "content_key": rng.integers(0, 2**62, m),
        }  # fmt: skip

    arrays = {}
    for prefix, tokens in (
        ("u", rng.integers(0, vocab, n)),
        ("t", rng.choice(vocab, size=n, replace=False)),
    ):
        for k, v in occurrences(n, tokens).items():
            arrays[f"{prefix}_{k}"] = np.asarray(v, dtype=np.int64)
        arrays[f"{prefix}_vectors"] = rng.normal(size=(len(layers), n, dim)).astype(np.float32)
    arrays["t_type_key"] = type_keys(7, torch.from_numpy(arrays["t_token_id"])).numpy()
    # the type-uniform sample keeps the size types of least type key: cut to them
    keep = np.argsort(arrays["t_type_key"], kind="stable")[:size]
    for name in [k for k in arrays if k.startswith("t_")]:
        a = arrays[name]
        arrays[name] = a[:, keep] if a.ndim == 3 else a[keep]
    return ActivationSample.from_state(empty.header(), arrays)


def tokens(ids):
    return [f"tok{i}" for i in ids]


def _save_parts(tmp_path, parts):
    urls = []
    for i, part in enumerate(parts):
        url = str(tmp_path / f"g{i}.sample.safetensors")
        part.save(url)
        urls.append(url)
    return urls


def test_one_layer_read_from_the_file_is_the_layer_of_the_whole():
    """load_layer reads only the layer's byte range and equals layer_sample of the whole
    sample, to the byte; the layer's points are those of the whole sample."""
    whole = fake_sample(300, 1)
    for layer in LAYERS:
        one = whole.layer_sample(layer)
        assert one.layers == [layer] and one.header() == whole.header() | {"layers": [layer]}
        for get in (one.points, one.type_points):
            a, b = get(layer), (whole.points if get == one.points else whole.type_points)(layer)
            for field in a._fields:
                np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


def test_layerwise_merge_of_group_files_equals_the_whole_merge(tmp_path):
    """Three group samples merged a layer at a time from their files: each layer's merge is
    byte-identical to the layer of the whole merge (the old path), whatever the overlap."""
    parts = [fake_sample(200, s, size=256) for s in (1, 2, 3)]
    parts.append(ActivationSample.from_bytes(parts[0].to_bytes()))  # a repeated group
    urls = _save_parts(tmp_path, parts)
    whole = ActivationSample.load(urls[0])
    for url in urls[1:]:
        whole.merge(ActivationSample.load(url))
    layered = sample_layers(urls)
    assert isinstance(layered, MergedSamples) and layered.layers == LAYERS
    for layer in LAYERS:
        assert ActivationSample.load_layer(urls[1], layer).to_bytes() == parts[1].layer_sample(layer).to_bytes()
        assert layered.layer(layer).to_bytes() == whole.layer_sample(layer).to_bytes()
    assert isinstance(sample_layers(urls[:1]), FileSample)
    assert sample_layers([]) is None


def test_samples_of_other_rules_merge_whole_and_mismatches_are_refused_first(tmp_path):
    """Different content rules (a merge falls back to keys from every layer's vectors) and the
    "vectors" rule merge whole, as before; samples that cannot merge are refused before any
    layer is read, naming the part."""
    a, b = fake_sample(100, 1, rule="window"), fake_sample(100, 2, rule="prefix")
    urls = _save_parts(tmp_path, [a, b])
    layered = sample_layers(urls)
    assert isinstance(layered, InMemorySample)
    whole = ActivationSample.load(urls[0]).merge(ActivationSample.load(urls[1]))
    assert layered.sample.to_bytes() == whole.to_bytes()
    with pytest.raises(StatisticsMismatchError, match="'vectors' content rule"):
        ActivationSample.load_layer(_vectors_file(tmp_path), 0)
    (tmp_path / "bad").mkdir()
    bad = _save_parts(tmp_path / "bad", [a, fake_sample(100, 3, layers=[0, 2])])
    with pytest.raises(StatisticsMismatchError, match=r"cannot merge the sample of .*g1"):
        sample_layers(bad)


def _vectors_file(tmp_path) -> str:
    s = fake_sample(50, 4, rule="vectors")
    url = str(tmp_path / "v.safetensors")
    s.save(url)
    return url


@pytest.mark.parametrize("skipped", [False, True])
def test_samples_parquet_written_a_layer_at_a_time_equals_the_whole_table(tmp_path, skipped):
    """write_samples (a layer at a time, from the group files) writes the rows, columns,
    clusters, row groups and header that the whole table wrote (write_table of to_table with
    the clusters), and the file reads back as the whole merged sample."""
    parts = [fake_sample(150, s, size=200) for s in (5, 6)]
    urls = _save_parts(tmp_path, parts)
    whole = ActivationSample.load(urls[0]).merge(ActivationSample.load(urls[1]))
    rng = np.random.default_rng(0)
    clusters = {} if skipped else {la: rng.integers(0, 5, whole.num_uniform) for la in LAYERS}
    # the table as the whole-sample path built it
    old = whole.to_table(tokens)
    old["cluster"] = pd.array([None] * len(old), dtype="Int64")
    for layer, labels in clusters.items():
        old.loc[(old["layer"] == layer) & (old["sample"] == "uniform"), "cluster"] = labels
    (tmp_path / "old").mkdir()
    write_table(str(tmp_path / "old"), "samples", old, whole.header())
    new = RunDir(str(tmp_path / "new"))
    assert new.write_samples(sample_layers(urls), tokens, clusters) == "samples.parquet"
    a = pq.read_table(tmp_path / "old" / "samples.parquet")
    b = pq.read_table(tmp_path / "new" / "samples.parquet")
    assert a.equals(b) and a.schema.metadata == b.schema.metadata
    assert json.loads(b.schema.metadata[HEADER_KEY]) == whole.header()
    meta = pq.ParquetFile(tmp_path / "new" / "samples.parquet").metadata
    assert meta.num_row_groups == len(LAYERS) * 2 == len(ROW_GROUP_KEYS["samples"]) * len(LAYERS)
    assert new.load_sample().to_bytes() == whole.to_bytes()
    # the run's samples.parquet, a layer at a time, is the sample too
    again = run_samples(new)
    assert isinstance(again, RunSamples)
    for layer in LAYERS:
        assert again.layer(layer).to_bytes() == whole.layer_sample(layer).to_bytes()
    merged = merged_layers([again, InMemorySample(whole)], ["run", "memory"])
    assert merged.layer(LAYERS[1]).to_bytes() == whole.layer_sample(LAYERS[1]).to_bytes()


def test_the_sampled_stage_gets_the_same_inputs_a_layer_at_a_time(tmp_path):
    """sampled_layer of each one-layer sample equals plan_sampled_metrics' inputs of the whole
    sample (vectors, ids, type vectors, content keys: bitwise), so every K-means and metrics
    task runs on the very arrays it ran on before."""

    class Tok:
        convert_ids_to_tokens = staticmethod(tokens)

    urls = _save_parts(tmp_path, [fake_sample(120, s) for s in (8, 9)])
    whole = ActivationSample.load(urls[0]).merge(ActivationSample.load(urls[1]))
    dims = pd.DataFrame({"layer": [], "dim": [], "flagged": []})
    plan = plan_sampled_metrics(whole, dims, Tok, SampledOptions())
    layered = sample_layers(urls)
    for layer in LAYERS:
        got, want = sampled_layer(layered.layer(layer), layer, []), plan.layers[layer]
        for field in ("vectors", "token_ids", "type_vectors", "content_keys"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
            assert getattr(got, field).dtype == getattr(want, field).dtype


PEAK_SCRIPT = r"""
import json, sys
import fsspec, numpy as np, pandas as pd, pyarrow, pyarrow.compute, pyarrow.parquet
from embgeom_ray.core.samples import ActivationSample
from embgeom_ray.core.tables import sampled_layer
from embgeom_ray.run_dir import RunDir
from embgeom_ray.core.sample_layers import sample_layers

def peak():  # VmHWM: this process's peak resident set (ru_maxrss survives exec)
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

urls, out, mode = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
start = peak()
tokens = lambda ids: [f"tok{i}" for i in ids]
if mode == "layers":
    layered = sample_layers(urls)
    for layer in layered.layers:
        inputs = sampled_layer(layered.layer(layer), layer, [])
        del inputs
    RunDir(out).write_samples(layered, tokens, {})
else:  # the whole sample, as the driver held it before
    whole = ActivationSample.load(urls[0])
    for url in urls[1:]:
        whole.merge(ActivationSample.load(url))
    print(json.dumps({"peak": peak() - start}))
    sys.exit(0)
print(json.dumps({"peak": peak() - start}))
"""


@pytest.mark.slow
def test_the_drivers_peak_holds_one_layer_of_the_sample(tmp_path):
    """The finishing steps a layer at a time (merge from the group files, the sampled stage's
    inputs, samples.parquet) in a fresh process, for two hidden sizes at L = 40: the peak
    resident memory above the start grows with the one-layer sample Q_l = 4·s·d + 48·s as the
    formula says (sizing.formulas.driver_sample_bytes, whatever L; a third of Q here), above
    a fixed part under 128 MiB (libraries loaded on first use, allocator arenas: within
    DRIVER_RUN_BYTES); merely
    merging the whole sample from the same files, as the driver did before, costs more than Q."""
    from embgeom_ray.sizing.formulas import DRIVER_SAMPLE_LAYERS, driver_sample_bytes

    layers, n = list(range(40)), 1024  # s = 2n entries
    env = os.environ | {"PYTHONPATH": str(REPO)}

    def files(dim: int) -> list[str]:
        (tmp_path / str(dim)).mkdir()
        parts = [fake_sample(n, s, layers=layers, dim=dim, size=n) for s in (11, 12)]
        return _save_parts(tmp_path / str(dim), parts)

    def run(urls: list[str], mode: str) -> int:
        res = subprocess.run(
            [sys.executable, "-c", PEAK_SCRIPT, json.dumps(urls), str(tmp_path / mode), mode],
            capture_output=True, text=True, env=env, check=True, timeout=600,
        )  # fmt: skip
        return int(json.loads(res.stdout.strip().splitlines()[-1])["peak"])

    small, large = files(256), files(1024)
    q_small, q_large = (4 * 2 * n * d + 48 * 2 * n for d in (256, 1024))
    peak_small, peak_large = run(small, "layers"), run(large, "layers")
    bound = driver_sample_bytes(len(layers), 2 * n, 1024)
    assert peak_large - peak_small <= DRIVER_SAMPLE_LAYERS * (q_large - q_small), (peak_small, peak_large)
    assert peak_large <= 128 * 2**20 + bound, (peak_large, bound)  # the fixed part: < 128 MiB
    assert bound < len(layers) * q_large / 3
    assert run(large, "whole") > len(layers) * q_large


def test_the_plans_driver_figure_holds_no_layer_of_the_sample_nor_of_the_state():
    """size_job's driver figure (what --plan prints and the manifest records) for 8B- and
    70B-shaped models at the default sample, written out here: 512 MiB + the dims rows
    L·d × 160 B (each layer analysed by its reducer) + V rows of 160 B + the sample on Ray
    tasks, 4 pieces of 8 MiB + the labels 8·L·s; within 1 GiB, where one layer's sample
    (10 · Q_l) and one layer's state were held before (1.9 and 3.5 GiB)."""
    from embgeom_ray.config import build_config
    from embgeom_ray.sizing import Cluster, CorpusShape, Node, Shape, size_job
    from embgeom_ray.sizing.formulas import gib as gib_text
    from embgeom_ray.sizing.plan import describe_plan

    gib, mib = 2**30, 2**20
    opts = build_config(None, {"model": "m", "corpus": "c", "out": "o", "device": "cpu"}).scheduling
    cluster = Cluster((Node("h", 64 * gib, cpus=4, head=True), Node("w", 4096 * gib, cpus=64)))
    corpus = CorpusShape("c", 1, 10**12, 1000)
    s, p, v = 8192, 128, 128_256
    for layers, d in ((33, 4096), (66, 4096), (81, 8192)):
        shape = Shape(layers=layers, dim=d, positions=p, vocab=v, hidden_states=layers,
                      intermediate=4 * d, heads=32, weight_bytes=16 * 10**9, dtype_bytes=2,
                      sample_entries=s)  # fmt: skip
        sizing = size_job(shape, corpus, cluster, opts)
        assert sizing.reduce.partitioned
        want = 512 * mib + layers * d * 160 + v * 160 + 4 * 8 * mib + 8 * layers * s
        assert sizing.driver == want < gib
        assert "the sample on Ray tasks" in sizing.driver_formula
        assert "the dims rows L·d × 160 B" in sizing.driver_formula
        assert not any("warning" in line for line in sizing.lines())
        # --plan names the sample's tasks and what each holds at its peak, 10 · Q_l
        printed = "\n".join(describe_plan(sizing, corpus, checkpoint_interval=600,
                                           total_layers=layers))  # fmt: skip
        q = 4 * s * d + 48 * s
        assert "sample tasks: one Ray task a layer" in printed
        assert f"each ≈ 10 · Q_l = {gib_text(10 * q)} at its peak" in printed


def test_type_stats_written_a_layer_at_a_time_equal_the_whole_table(tmp_path):
    """build_tables with a type_rows sink hands over each layer's type_stats rows in turn and
    keeps none: written through RunDir.table_writer they make the very table that the whole
    build wrote (rows, order, dtypes, token names), the other tables unchanged; a partition of
    the statistics (build_tables of token ranges) streams the same rows."""
    from embgeom_ray.config import build_config
    from embgeom_ray.core.statistics import EmbeddingStatistics
    from embgeom_ray.core.tables import build_tables

    class Tok:
        convert_ids_to_tokens = staticmethod(tokens)

    rng = np.random.default_rng(3)
    stats = EmbeddingStatistics(LAYERS, D, max_positions=6)
    h = torch.from_numpy(rng.normal(size=(len(LAYERS), 4, 6, D)))
    ids = torch.from_numpy(rng.integers(0, 40, (4, 6)))
    stats.update(list(h), ids, torch.ones(4, 6, dtype=torch.bool))
    options = build_config(None, {"model": "m", "corpus": "c", "out": "o"}).tables
    whole = build_tables(stats, Tok, options)
    halves = [stats.select(LAYERS, (0, 20)), stats.select(LAYERS, (20, None), layer_state=False)]
    for parts in (stats, halves):
        run = RunDir(str(tmp_path / f"run{len(parts) if isinstance(parts, list) else 1}"))
        got: list[int] = []
        with run.table_writer("type_stats") as write:

            def sink(df: pd.DataFrame, got: list[int] = got, write=write) -> None:
                got.append(len(df))
                write(df)

            streamed = build_tables(parts, Tok, options, sink)
        per_layer = [int((whole["type_stats"].layer == la).sum()) for la in LAYERS]
        assert "type_stats" not in streamed and got == per_layer
        for name in ("layers", "dims", "positions"):
            pd.testing.assert_frame_equal(streamed[name], whole[name])
        pd.testing.assert_frame_equal(run.read_table("type_stats"), whole["type_stats"])


def test_the_sample_drawn_sizes_its_tasks_not_the_options(tmp_path):
    """A sample drawn smaller than its sizes (a small corpus: 150 occurrences and types a
    part, of --sample-size and --sample-type-size 1,000): each reader says its entries as
    drawn from the arrays' shapes (a file's header, a run's row count), no layer read, and
    the sample's tasks ask Ray for 10 · Q_l of those; they asked for the sizes' 2,000
    entries, and a refusal counted those too. The plan's check keeps the sizes (the most
    the sample can be), and each line says which s it is."""
    from types import SimpleNamespace

    from embgeom_ray.distributed import sample_tasks
    from embgeom_ray.errors import ConfigError

    urls = _save_parts(tmp_path, [fake_sample(150, s, size=1000) for s in (5, 6)])
    assert [FileSample(u).drawn for u in urls] == [300, 300]
    merged = sample_layers(urls)
    assert isinstance(merged, MergedSamples) and merged.drawn == 600  # of 2,000
    whole = ActivationSample.load(urls[0]).merge(ActivationSample.load(urls[1]))
    assert whole.num_uniform == 300 and InMemorySample(whole).drawn == 300 + whole.num_types
    run = RunDir(str(tmp_path / "run"))
    run.write_samples(InMemorySample(whole), tokens, {})
    assert run_samples(run).drawn == 300 + whole.num_types
    # parts whose entries together exceed the sizes: at most the sizes (400 of 2 · 200)
    capped = sample_layers(_save_parts(tmp_path / "c", [fake_sample(150, s, size=200) for s in (5, 6)]))  # fmt: skip
    assert capped.drawn == 400
    assert sample_tasks.sample_size(merged) == (600, True)
    assert sample_tasks.task_bytes(merged) == 10 * (4 * D + 48) * 600
    unsaid = SimpleNamespace(header=merged.header)  # a sample that does not say: its sizes
    assert sample_tasks.sample_size(unsaid) == (2000, False)
    nodes = [{"NodeID": "w", "Alive": True, "Resources": {"CPU": 1.0, "memory": 1000}}]
    with pytest.raises(ConfigError, match=r"\(10 · Q_l, Q_l = 4·s·d \+ 48·s; s = 600 entries "
                       r"a layer: the sample drawn\), more than the 1,000 B"):  # fmt: skip
        sample_tasks.check_fits(merged, nodes, None, can_start=())
    with pytest.raises(ConfigError, match=r"s = 2,000 entries a layer: --sample-size \+ "
                       r"--sample-type-size, the most the sample can hold\)"):  # fmt: skip
        sample_tasks.check_fits(unsaid, nodes, None, can_start=())


def test_the_tasks_reading_a_large_sample_are_placed_once(tmp_path, monkeypatch, capsys):
    """The tasks that read a large sample (the sampled stage's inputs, then the rows of
    samples.parquet) were placed twice in finish_run (sample_tasks.placement, in each), so
    each of its warnings was printed twice; now once, the same options handed to both."""
    from embgeom_ray import progress
    from embgeom_ray.config import JobConfig
    from embgeom_ray.distributed import cluster, sample_tasks
    from embgeom_ray.run_dir import Manifest
    from embgeom_ray.runs import finish
    from embgeom_ray.runs.finish import StatisticsHere
    from embgeom_ray.sizing import formulas
    from tests.runs.test_checkpoints import fold
    from tests.runs.test_storage_faults import Tokens

    monkeypatch.setattr(formulas, "SAMPLE_ON_WORKERS_BYTES", 0)  # the sample is "large"
    monkeypatch.setattr(cluster, "connect", lambda address=None: None)
    where, got = {"memory": 123}, {}

    def placement(sample):
        progress.notice("warning: placed")
        return where

    def stage(tables, sample, options, address=None, where=None):
        got["stage"] = where
        return {"skipped": "a test"}, {}

    def pieces(sample, id_to_token, clusters, address=None, ahead=2, where=None):
        got["pieces"] = where  # None: the driver writes the rows itself

    monkeypatch.setattr(sample_tasks, "placement", placement)
    monkeypatch.setattr(sample_tasks, "table_pieces_on_ray", pieces)
    monkeypatch.setattr(finish, "add_sampled_metrics", stage)
    out = str(tmp_path / "run")
    config = JobConfig(model="m", corpus="c.txt", out=out, no_report=True, sample_size=20)
    run = RunDir(out)
    finish.finish_run(run, Manifest(status="running"), StatisticsHere(fold([0, 1])),
                      fake_sample(20, 1), Tokens, config, t_start=0, echo=lambda *_: None)  # fmt: skip
    assert got == {"stage": where, "pieces": where}
    assert capsys.readouterr().err.count("warning: placed") == 1
    assert RunDir(out).manifest().status == "complete"
