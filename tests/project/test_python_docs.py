"""docs/python.md's examples, run as a reader would run them: every ```python block in order,
in one namespace, in a fresh directory holding ``texts_a.jsonl`` and ``texts_b.jsonl`` (two
disjoint sets of documents of the demo corpus: real English), with a real S3 API on loopback
(moto's server mode) holding the bucket the document names. The document says its run was
copied to the bucket; the copy is made here, after the block that writes the run.

Then what the blocks computed is checked against independent readings of the files: the
tables against pyarrow's, the remote run against the local one, the merge against the two
runs' counts. The session's local Ray (``ray_local``) is the one the job joins.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.conftest import write_jsonl
from tests.object_store import S3, moto_server, s3_env
from tests.outputs_doc import assert_documented_outputs, documented_manifest_keys

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "python.md"
BUCKET = "my-bucket"


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a Markdown document, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def demo_documents(n: int, max_chars: int = 1500) -> list[str]:
    """The demo corpus's first ``n`` documents, each cut to ``max_chars`` characters."""
    from embgeom_ray.inputs.demo_corpus import python_docs_documents

    return [doc[:max_chars] for doc in python_docs_documents()[:n]]


def test_the_document_has_the_examples_it_promises() -> None:
    blocks = python_blocks(DOC.read_text())
    assert len(blocks) >= 6
    text = "\n".join(blocks)
    for call in ("eg.analyze(", "eg.open_run(", "s3://", ".figures(", "eg.merge(", "eg.compare(",
                 "eg.plan(", ".sample(", ".statistics()"):  # fmt: skip
        assert call in text, call


@pytest.mark.timeout(600)
def test_python_docs_examples_run(ray_local, minilm_dir, tmp_path, monkeypatch, capsys) -> None:
    import pyarrow.parquet as pq
    from matplotlib.figure import Figure

    docs = demo_documents(8)
    write_jsonl(tmp_path / "texts_a.jsonl", docs[:4])
    write_jsonl(tmp_path / "texts_b.jsonl", docs[4:])
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks(DOC.read_text())
    namespace: dict[str, object] = {}
    with moto_server(tmp_path / "moto.log") as endpoint:
        for name, value in s3_env(endpoint).items():
            monkeypatch.setenv(name, value)
        store = S3(endpoint, s3_env(endpoint))
        store.fs().mkdir(BUCKET)
        for i, block in enumerate(blocks):
            exec(compile(block, f"{DOC.name}, block {i + 1}", "exec"), namespace)
            if i == 0:  # "Here runs/a was copied to s3://my-bucket/runs/a"
                store.fs().put(str(tmp_path / "runs" / "a"), f"{BUCKET}/runs/", recursive=True)
        remote = namespace["remote"]
        remote_type_stats = remote.type_stats
    printed = capsys.readouterr().out

    run = namespace["run"]
    assert Path(namespace["model"]) == Path(minilm_dir)
    # the run holds what docs/outputs.md lists, and its manifest only keys documented there
    manifest = json.loads((tmp_path / "runs" / "a" / "manifest.json").read_text())
    assert_documented_outputs(tmp_path / "runs" / "a", manifest)
    assert set(manifest) - documented_manifest_keys() == set()
    # the tables are the files' own
    for name in ("layers", "type_stats", "dims", "positions", "kmeans"):
        expected = pq.read_table(tmp_path / "runs" / "a" / f"{name}.parquet").to_pandas()
        pd.testing.assert_frame_equal(getattr(run, name), expected)
    assert run.layers["layer"].tolist() == list(range(7))
    assert "anisotropy" in printed and "tokens;" in printed
    # the sample of layer 6: as many vectors as the sample's uniform rows, d = 384, float64
    layer = namespace["layer"]
    assert layer.vectors.shape == (256, 384) and layer.vectors.dtype == np.float64
    stored = pq.read_table(tmp_path / "runs" / "a" / "samples.parquet",
                           filters=[("layer", "=", 6), ("sample", "=", "uniform")])  # fmt: skip
    np.testing.assert_array_equal(layer.vectors, np.stack(stored.column("vector").to_numpy(False)))
    assert namespace["types"].rows["sample"].eq("type_uniform").all()
    assert namespace["stats"].layers == run.manifest.layers
    # figures: matplotlib figures, drawn without writing; the report written by report()
    figures = namespace["figures"]
    assert "cosine_isotropy" in figures and all(isinstance(f, Figure) for f in figures.values())
    assert list(namespace["only"]) == ["norm_variance", "kmeans_curve"]
    assert (tmp_path / "cosine_isotropy.png").stat().st_size > 10_000
    assert tmp_path / namespace["path"] == tmp_path / "runs" / "a" / "report.html"
    # the remote run is the local one
    assert remote.url == f"s3://{BUCKET}/runs/a"
    pd.testing.assert_frame_equal(remote_type_stats, run.type_stats)
    # the merge counts both corpora; the comparison wrote its tables and report
    ab, b = namespace["ab"], namespace["b"]
    assert ab.manifest.counts.tokens == run.manifest.counts.tokens + b.manifest.counts.tokens
    assert not (tmp_path / "runs" / "ab" / "report.html").exists()  # no_report=True
    assert set(ab.type_stats["token_id"]) == set(run.type_stats["token_id"]) | set(
        b.type_stats["token_id"]
    )
    comparison = namespace["comparison"]
    assert [r["label"] for r in comparison.summary["runs"]] == ["a", "b"]
    assert not comparison.changes.empty and Path(comparison.report_path).is_file()
    # the plan wrote nothing; the error is the one-line user error
    assert namespace["decisions"]["extractors"]["num_workers"] >= 1
    assert not (tmp_path / "runs" / "planned").exists()
    # the merge's plan: the types both runs saw, merged nowhere
    merge_plan = namespace["merge_plan"]
    assert merge_plan["types_seen"] == ab.type_stats["token_id"].nunique()
    assert merge_plan["object_store"]["peak_bytes"] > 0
    assert not (tmp_path / "runs" / "ab_planned").exists()
    assert "missing.jsonl" in printed and "Traceback" not in printed
