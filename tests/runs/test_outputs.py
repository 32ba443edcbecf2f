"""Output tables: what a reader of the Parquet files relies on."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from embgeom_ray.run_dir import RunDir, RunDirError, write_table


def sample_rows(rng, layers, sizes: tuple[int, int], dim: int) -> pd.DataFrame:
    """Rows shaped like samples.parquet's: per layer, ``sizes`` uniform and type-uniform rows."""
    frames = [
        pd.DataFrame(
            {
                "layer": np.full(n, layer, dtype=np.int64),
                "sample": [sample] * n,
                "token_id": rng.integers(0, 100, n),
                "vector": list(rng.normal(size=(n, dim)).astype(np.float32)),
            }
        )
        for layer in layers
        for sample, n in zip(("uniform", "type_uniform"), sizes, strict=True)
    ]
    return pd.concat(frames, ignore_index=True)


def test_samples_have_one_row_group_per_layer_and_sample(tmp_path):
    """A reader filtering one layer's sample decodes only that row group; the rows round-trip."""
    df = sample_rows(np.random.default_rng(0), (0, 3, 6), (7, 4), dim=5)
    write_table(str(tmp_path), "samples", df)
    write_table(str(tmp_path), "other", df)
    meta = pq.ParquetFile(tmp_path / "samples.parquet").metadata
    assert meta.num_row_groups == 6
    assert pq.ParquetFile(tmp_path / "other.parquet").metadata.num_row_groups == 1
    seen = []
    for g in range(meta.num_row_groups):
        group = pq.ParquetFile(tmp_path / "samples.parquet").read_row_group(g).to_pandas()
        assert group["layer"].nunique() == 1 and group["sample"].nunique() == 1
        seen.append((int(group["layer"][0]), group["sample"][0], len(group)))
    assert seen == [
        (la, s, n) for la in (0, 3, 6) for s, n in (("uniform", 7), ("type_uniform", 4))
    ]
    back = pd.read_parquet(tmp_path / "samples.parquet")
    pd.testing.assert_frame_equal(back.drop(columns="vector"), df.drop(columns="vector"))
    np.testing.assert_array_equal(np.stack(back["vector"]), np.stack(df["vector"]))
    one = pq.read_table(
        tmp_path / "samples.parquet", filters=[("layer", "=", 3), ("sample", "=", "uniform")]
    ).to_pandas()
    np.testing.assert_array_equal(np.stack(one["vector"]), np.stack(df["vector"][11:18]))
    # an empty table is still a valid file with the columns
    write_table(str(tmp_path), "samples", df.iloc[:0])
    assert pd.read_parquet(tmp_path / "samples.parquet").columns.tolist() == df.columns.tolist()


def test_run_dir_reads_one_layer_of_the_sample(tmp_path):
    """:class:`RunDir` is the reader of a run's tables: schema, filtered rows, one layer's
    sample vectors (float64, exactly the stored float32), the sampled layers."""
    rng = np.random.default_rng(1)
    df = sample_rows(rng, (0, 2), (6, 3), dim=4)
    df["cluster"] = pd.array(rng.integers(0, 3, len(df)), dtype="Int64")
    run = RunDir(str(tmp_path))
    run.write_table("samples", df)
    assert run.columns("samples") == df.columns.tolist() and run.columns("dims") == []
    assert run.sample_layers() == [0, 2]
    rows, vectors = run.sample_vectors(2)
    want = df[(df.layer == 2) & (df["sample"] == "uniform")]
    assert vectors.dtype == np.float64
    np.testing.assert_array_equal(vectors, np.stack(want["vector"]).astype(np.float64))
    assert rows["token_id"].tolist() == want["token_id"].tolist()
    assert rows["cluster"].tolist() == want["cluster"].tolist()
    _, types = run.sample_vectors(0, "type_uniform")
    np.testing.assert_array_equal(types, np.stack(df["vector"][6:9]).astype(np.float64))
    assert run.sample_vectors(5) is None
    some = run.read_table("samples", ["token_id"], filters=[("layer", "=", 0)])
    assert some.columns.tolist() == ["token_id"] and some["token_id"].tolist() == df["token_id"][:9].tolist()
    with pytest.raises(RunDirError, match=r"has no layers\.parquet"):
        run.read_table("layers")
    (tmp_path / "layers.parquet").write_bytes(b"not parquet")
    with pytest.raises(RunDirError, match="cannot be read"):
        run.read_table("layers")


def _sample():
    import torch

    from embgeom_ray.core.samples import ActivationSample

    gen = torch.Generator().manual_seed(0)
    sample = ActivationSample([0, 2], 4, size=5, seed=1, type_size=3)
    hidden = [torch.randn(2, 6, 4, generator=gen) for _ in range(2)]
    ids = torch.randint(0, 9, (2, 6), generator=gen)
    sample.update(hidden, ids, None, torch.tensor([0, 1]), torch.tensor([0, 0]))
    return sample


def test_a_run_keeps_its_sample_once_and_reads_an_earlier_runs_sample(tmp_path):
    """The sample is written once, as samples.parquet with its header; a run directory of an
    earlier version (samples.parquet without the header beside sample.safetensors) reads its
    sample from sample.safetensors, and finalising it again leaves the table alone."""
    from embgeom_ray.core.statistics import EmbeddingStatistics
    from embgeom_ray.run_dir import SAMPLE, Manifest

    sample = _sample()
    table = sample.to_table()
    old = RunDir(str(tmp_path / "old"))
    old.write_table("samples", table)  # as an earlier version wrote it: no header
    sample.save(old.path(SAMPLE))
    assert old.table_header("samples") is None and old.has_sample()
    assert old.load_sample().to_bytes() == sample.to_bytes()
    stats = EmbeddingStatistics([0, 2], 4)
    manifest = old.finalise(Manifest(), {"samples": table}, stats, old.load_sample())
    assert manifest.outputs.artefacts == ["statistics.safetensors"]
    assert manifest.outputs.tables == ["samples.parquet"]
    assert not (tmp_path / "old" / SAMPLE).exists()
    assert old.table_header("samples") == sample.header()
    assert old.load_sample().to_bytes() == sample.to_bytes()
    with pytest.raises(ValueError, match="samples table"):
        old.finalise(Manifest(), {"samples": table.iloc[1:]}, stats, sample)
    none = RunDir(str(tmp_path / "none"))
    none.write_table("layers", pd.DataFrame({"layer": [0]}))
    assert not none.has_sample() and none.load_sample() is None


def test_outputs_carry_their_format_version_and_newer_majors_are_refused(tmp_path):
    """``manifest.json`` and every table record :data:`FORMAT_VERSION`; a reader reads a run
    without one (written before versions were recorded) and a newer minor, and refuses a newer
    major in one line that says to upgrade."""
    import json

    import pyarrow as pa

    from embgeom_ray.run_dir import FORMAT_KEY, FORMAT_VERSION, Manifest

    run = RunDir(str(tmp_path / "run"))
    df = pd.DataFrame({"layer": [0, 1], "anisotropy": [0.1, 0.2]})
    run.write_table("layers", df)
    with run.table_writer("type_stats") as write:
        write(pd.DataFrame({"layer": [0], "token_id": [5]}))
    run.write_manifest(Manifest(status="complete"))
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["format_version"] == FORMAT_VERSION
    for name in ("layers", "type_stats"):
        meta = pq.read_schema(tmp_path / "run" / f"{name}.parquet").metadata
        assert meta[FORMAT_KEY] == FORMAT_VERSION.encode()
    assert run.manifest().format_version == FORMAT_VERSION
    pd.testing.assert_frame_equal(run.read_table("layers"), df)

    major = int(FORMAT_VERSION.split(".")[0])
    for version, readable in ((None, True), (f"{major}.99", True), (f"{major + 1}.0", False)):
        data = {"status": "complete"} | ({"format_version": version} if version else {})
        (tmp_path / "run" / "manifest.json").write_text(json.dumps(data))
        table = pa.Table.from_pandas(df, preserve_index=False)
        meta = {k: v for k, v in table.schema.metadata.items() if k != FORMAT_KEY}
        if version:
            meta[FORMAT_KEY] = version.encode()
        pq.write_table(table.replace_schema_metadata(meta), tmp_path / "run" / "layers.parquet")
        if readable:
            assert run.manifest().format_version == version
            pd.testing.assert_frame_equal(run.read_table("layers"), df)
            continue
        for read in (run.manifest, lambda: run.read_table("layers")):
            with pytest.raises(RunDirError, match=rf"format {major + 1}\.0 by a newer embgeom_ray.*upgrade"):
                read()


def test_every_manifest_key_is_documented():
    """docs/outputs.md's manifest table documents every key the typed manifest has (the keys
    a real run writes are checked in tests/project/test_python_docs.py), and lists no
    output file the code does not know."""
    from embgeom_ray.run_dir import Manifest
    from tests.outputs_doc import documented_files, documented_manifest_keys

    keys = {field.alias or name for name, field in Manifest.model_fields.items()}
    assert keys - documented_manifest_keys() == set()
    assert "sample.safetensors" not in documented_files()  # read from older runs, not written


def test_overwrite_removes_what_the_run_directory_table_lists():
    """``RUN_ENTRIES`` (what ``--overwrite`` removes, and nothing else) is the table of
    docs/outputs.md, plus the sample file older runs wrote."""
    from embgeom_ray.run_dir import RUN_ENTRIES
    from tests.outputs_doc import documented_files

    assert {name.rstrip("/") for name in documented_files()} | {"sample.safetensors"} == RUN_ENTRIES


def test_the_comparison_and_reanalyze_tables_are_documented_column_for_column():
    """docs/outputs.md's column tables of ``changes.parquet``, ``rogue_dims.parquet`` and
    ``runs.parquet`` name the columns the code writes, in order, no more and none fewer (a
    column added to the code, such as ``changes.parquet``'s ``q``, is documented with it)."""
    from embgeom_ray.runs.compare import CHANGE_COLUMNS, ROGUE_COLUMNS
    from embgeom_ray.runs.reanalyze import INDEX_COLUMNS
    from tests.outputs_doc import documented_columns

    assert documented_columns("`changes.parquet`") == (CHANGE_COLUMNS, [])
    assert documented_columns("`rogue_dims.parquet`") == (ROGUE_COLUMNS, [])
    assert documented_columns("`runs.parquet` (`jobs.reanalyze`)") == (list(INDEX_COLUMNS), [])
