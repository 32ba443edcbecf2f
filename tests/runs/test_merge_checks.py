"""What ``jobs.merge`` refuses from the runs' manifests alone, before it reads any statistics
(no Ray, no model: the whole merges are tests/runs/test_merge_runs.py)."""

from __future__ import annotations

import pytest

from embgeom_ray.errors import StatisticsMismatchError
from embgeom_ray.run_dir import CorpusInfo, Manifest, ModelInfo, TokenizerInfo
from embgeom_ray.runs.merge import check_mergeable

MINILM = "sha256:aef05c737ff768b8b807069b0161153f145a0ef23a0d974587a47062b3d295f3"
TINY = "sha256:8945eb753ad374440d251ad819470aac634f982c5bdaae68e7f121ae8ffb90c9"
TOK = "sha256:1fed7034e54ab0218c95d3c04f226d8afc8c46a5256f287832d49e6af1cdc661"
TOK2 = "sha256:b63dc8a8a770b7a291f283b79d613145ce45403c41c39352a2e17cf04c8cea1d"


def _manifest(
    model: str, fingerprint: str, layers: list[int], tokenizer: str = TOK, corpus: str = "c1",
    transformers: str = "5.24.0",
) -> Manifest:  # fmt: skip
    return Manifest(
        status="complete",
        config={"max_length": 64, "sample_size": 256},
        model=ModelInfo(id=model, revision=fingerprint, model_fingerprint=fingerprint),
        tokenizer=TokenizerInfo(fingerprint=tokenizer),
        corpus=CorpusInfo(source=f"{corpus}.jsonl", fingerprint=corpus),
        layers=layers,
        versions={"transformers": transformers},
    )


def test_runs_of_other_models_are_refused_as_such_before_their_layers() -> None:
    """A 2-block model beside a 6-block one: named as another model (the runs' ids and
    fingerprints), not as runs of different layers, which only follows from it."""
    a = _manifest("models/minilm", MINILM, list(range(7)))
    b = _manifest("models/tiny", TINY, [0, 1, 2], tokenizer=TOK2, corpus="c2")
    with pytest.raises(StatisticsMismatchError) as err:
        check_mergeable(["runs/a", "runs/b"], [a, b])
    assert str(err.value) == (
        "cannot merge runs/b into runs/a: runs of different models: runs/b measured "
        "models/tiny (sha256:8945eb753ad3…), runs/a measured models/minilm "
        "(sha256:aef05c737ff7…) (their tokenizers differ too)"
    )


def test_the_same_model_with_another_tokenizer_is_refused_as_such() -> None:
    """The same weights, another tokenizer (another transformers on another cluster): named
    as the tokenizer, with the transformers versions that differ; the same model under another
    path merges."""
    a = _manifest("/cluster1/minilm", MINILM, list(range(7)))
    b = _manifest("/cluster2/minilm", MINILM, list(range(7)), tokenizer=TOK2, corpus="c2",
                  transformers="4.57.1")  # fmt: skip
    with pytest.raises(StatisticsMismatchError) as err:
        check_mergeable(["runs/a", "runs/b"], [a, b])
    assert str(err.value) == (
        "cannot merge runs/b into runs/a: runs with different tokenizers of the same model: "
        "runs/b's is sha256:b63dc8a8a770…, runs/a's sha256:1fed7034e54a… (a token id would "
        "name other tokens); they ran transformers 4.57.1 and 5.24.0"
    )
    same = _manifest("/cluster2/minilm", MINILM, list(range(7)), corpus="c2")
    check_mergeable(["runs/a", "runs/b"], [a, same])


def test_runs_over_copies_of_the_same_files_are_warned_of(tmp_path) -> None:
    """A run over a copy of run a's file (same name, new modification time: another corpus
    fingerprint) shares run a's sampled occurrences, to the key and content key: warned of
    with how many; a run over other text under the same file name (the same document ids,
    other tokens) shares none."""
    import numpy as np

    from embgeom_ray.core.sample_layers import InMemorySample
    from embgeom_ray.run_dir import RunDir
    from embgeom_ray.runs.merge import overlap_warnings
    from tests.core.test_samples import fold, make_windows, new_sample

    wins = make_windows(np.random.default_rng(3), 8, vocab=20)
    other = [(doc, k, (ids + 1) % 20, keep, -vec) for doc, k, ids, keep, vec in wins]
    kept = sum(int(keep.sum()) for _, _, _, keep, _ in wins)
    runs = {}
    for name, windows in (("a", wins), ("other", other), ("copy", wins)):
        runs[name] = str(tmp_path / name)
        sample = fold(new_sample(size=64, type_size=3, seed=5), windows)
        RunDir(runs[name]).write_samples(InMemorySample(sample), None, {})
    assert overlap_warnings([runs["a"], runs["other"]]) == []
    assert overlap_warnings([runs["a"], runs["other"], runs["copy"]]) == [
        f"{runs['copy']} and {runs['a']} share {kept} of their sampled occurrences (the same "
        "tokens at the same place of files of the same name): their corpora hold the same "
        "documents (copies of the same files, with other modification times?), which the merge "
        "counts twice; merge runs over disjoint corpora, or run --dedup over the union"
    ]


def test_the_merged_runs_are_recorded_where_they_are(tmp_path, monkeypatch) -> None:
    """``merged_runs[].path``: a local run given relative to the working directory is
    recorded absolute (a merge written to a bucket is read from anywhere); a URL as given."""
    from embgeom_ray.config import JobConfig
    from embgeom_ray.runs.merge import merged_manifest

    monkeypatch.chdir(tmp_path)
    a = _manifest("models/minilm", MINILM, list(range(7)))
    b = _manifest("models/minilm", MINILM, list(range(7)), corpus="c2")
    config = JobConfig(model="models/minilm", corpus="c1.jsonl", out="s3://bucket/merged")
    manifest = merged_manifest(["runs/a", "s3://bucket/runs/b"], [a, b], config, "now")
    assert [r["path"] for r in manifest.merged_runs] == [
        str(tmp_path / "runs" / "a"),
        "s3://bucket/runs/b",
    ]


def test_a_model_directory_not_found_here_asks_for_the_tokenizer(tmp_path, monkeypatch) -> None:
    """The runs' model was a local directory given relative to where they ran (``--model
    model_tok``): merged from elsewhere, the merge says so and asks for ``--tokenizer``; it
    tried the hub for an id 'model_tok' at the directory's content hash."""
    from embgeom_ray.errors import ModelError
    from embgeom_ray.runs.merge import load_run_tokenizer

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError) as err:
        load_run_tokenizer(_manifest("model_tok", TINY, [0, 1, 2]), None)
    assert str(err.value) == (
        "the runs' model is the local directory 'model_tok', relative to where that run "
        "started, not found here (the merge needs its tokenizer to name the token ids); give "
        "the tokenizer's directory with --tokenizer (its fingerprint is checked against the "
        "runs')"
    )


def test_options_are_compared_by_what_they_measure() -> None:
    """An option left at its default and the same value given (``--sample-type-size`` =
    ``--sample-size``), or the same dimensions clipped by ``--clip-dims`` in another order
    and by ``--clip-dims-from`` (the manifest's resolved ``clip_dims``): the same statistics
    and sample, merged; refused, each by the value it had, where they differ."""
    a = _manifest("models/minilm", MINILM, list(range(7)))
    b = _manifest("models/minilm", MINILM, list(range(7)), corpus="c2")
    a.config |= {"sample_type_size": None, "clip_dims": [300, 12]}
    a.clip_dims = [12, 300]
    b.config |= {"sample_type_size": 256, "clip_dims": None, "clip_dims_from": "runs/earlier"}
    b.clip_dims = [12, 300]
    check_mergeable(["runs/a", "runs/b"], [a, b])
    b.config["sample_type_size"], b.clip_dims = 300, [12]
    with pytest.raises(StatisticsMismatchError) as err:
        check_mergeable(["runs/a", "runs/b"], [a, b])
    assert str(err.value) == (
        "cannot merge runs/b into runs/a: runs with different options: sample_type_size 300 "
        "!= 256; clip_dims [12] != [12, 300]"
    )
