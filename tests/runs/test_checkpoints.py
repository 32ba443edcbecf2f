"""Checkpoint groups on disk, without Ray or a model: layout, resume, exactly-once coverage."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from embgeom_ray.core.statistics import EmbeddingStatistics
from embgeom_ray.counts import Counts
from embgeom_ray.errors import OutputError
from embgeom_ray.inputs.corpus import Shard, ShardPlan
from embgeom_ray.runs.checkpoints import CheckpointStore, group_id_for
from embgeom_ray.runs.pipeline import reduce_groups

LAYERS, DIM = [0, 1], 4


def plan(n: int) -> ShardPlan:
    shards = [Shard(f"f0-b{i:04d}", "c.txt", "text", i, i + 1, 0) for i in range(n)]
    return ShardPlan(shards, "fp", n, ["c.txt"])


def shard_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One shard's hidden states (L, B, T, d) and token ids, different for every shard."""
    rng = np.random.default_rng(i)
    h = torch.tensor(rng.normal(3.0, 1.0, (len(LAYERS), 2, 5, DIM)))
    ids = torch.tensor(rng.integers(0, 7, (2, 5)))
    return h, ids


def fold(shards: list[int]) -> EmbeddingStatistics:
    stats = EmbeddingStatistics(LAYERS, DIM)
    for i in shards:
        stats.update(*shard_batch(i))
    return stats


def counts(tokens: int) -> Counts:
    return Counts(documents=1, tokens=tokens)


def started(tmp_path: Path, n: int = 5) -> CheckpointStore:
    store = CheckpointStore(str(tmp_path / "out"))
    store.start("fp", {}, plan(n), overwrite=False)
    return store


def ids(*idx: int) -> list[str]:
    return [f"f0-b{i:04d}" for i in idx]


def test_a_group_marks_its_shards_done_with_its_json(tmp_path):
    store = started(tmp_path)
    group = store.save_group(ids(3, 1), fold([1, 3]).to_bytes(), None, counts(20))
    assert group.group_id == group_id_for(ids(1, 3)) == "f0-b0001-n2"
    files = sorted(p.name for p in (tmp_path / "out" / "groups").iterdir())
    assert files == ["f0-b0001-n2.json", "f0-b0001-n2.safetensors"]
    saved = json.loads((tmp_path / "out" / "groups" / "f0-b0001-n2.json").read_text())
    assert saved["shards"] == ids(1, 3) and saved["counts"]["tokens"] == 20
    assert store.done_shards() == set(ids(1, 3))


def test_half_written_group_is_ignored_then_cleaned_on_resume(tmp_path):
    store = started(tmp_path)
    store.save_group(ids(0), fold([0]).to_bytes(), b"sample", counts(10))
    store.save_group(ids(1, 2), fold([1, 2]).to_bytes(), b"sample", counts(20))
    groups = tmp_path / "out" / "groups"
    (groups / "f0-b0001-n2.json").unlink()  # the driver died before the JSON
    (groups / ".tmp-abc").write_bytes(b"partial")  # and in the middle of a write
    assert store.done_shards() == set(ids(0))
    _, resumed = CheckpointStore(str(tmp_path / "out")).start("fp", {}, plan(5), False)
    assert resumed
    assert sorted(p.name for p in groups.iterdir()) == [
        "f0-b0000-n1.json",
        "f0-b0000-n1.safetensors",
        "f0-b0000-n1.sample.safetensors",
    ]


def test_a_group_the_previous_version_wrote_resumes_with_its_counts(tmp_path):
    """A checkpoint group written before the counts type was shared (its counts named
    ``oom_splits``) is read back with every counter, and the reduce adds it up."""
    store = started(tmp_path, 2)
    store.save_group(ids(0), fold([0]).to_bytes(), None, counts(10))
    store.save_group(ids(1), fold([1]).to_bytes(), None, Counts(documents=2, tokens=7, oom_batch_splits=1))
    path = tmp_path / "out" / "groups" / "f0-b0000-n1.json"
    saved = json.loads(path.read_text())
    saved["counts"] = {
        "documents": 1, "windows": 2, "tokens": 10, "padded_tokens": 14, "positions": 12,
        "special_tokens": 2, "unk_tokens": 0, "batches": 1, "oom_splits": 3, "duplicates": 1,
        "skipped": {"empty": 1}, "forward_seconds": 0.5, "fold_seconds": 0.25, "seconds": 1.0,
    }  # fmt: skip
    del saved["digest"]  # nor did that version record one
    path.write_text(json.dumps(saved))
    groups = CheckpointStore(str(tmp_path / "out")).groups_covering(ids(0, 1))
    assert groups[0].counts.oom_batch_splits == 3 and groups[0].counts.skipped == {"empty": 1}
    _, _, totals = reduce_groups(store, groups, EmbeddingStatistics(LAYERS, DIM), False)
    assert (totals.documents, totals.tokens, totals.oom_batch_splits) == (3, 17, 4)
    assert (totals.windows, totals.duplicates, totals.forward_seconds) == (2, 1, 0.5)


def test_groups_cover_the_plan_exactly_once(tmp_path):
    store = started(tmp_path, 3)
    store.save_group(ids(0, 1), fold([0, 1]).to_bytes(), None, counts(1))
    with pytest.raises(OutputError, match="no checkpoint"):
        store.groups_covering(ids(0, 1, 2))
    store.save_group(ids(2), fold([2]).to_bytes(), None, counts(1))
    assert [g.group_id for g in store.groups_covering(ids(0, 1, 2))] == [
        "f0-b0000-n2",
        "f0-b0002-n1",
    ]
    with pytest.raises(OutputError, match="not planned"):
        store.groups_covering(ids(0, 1))
    store.save_group(ids(1), fold([1]).to_bytes(), None, counts(1))  # never happens: a bug
    with pytest.raises(OutputError, match="in groups f0-b0000-n2 and f0-b0001-n1"):
        store.groups_covering(ids(0, 1, 2))


def test_reduce_of_groups_equals_one_pass(tmp_path):
    """Groups of several shards reduce to the statistics of one pass over every shard; counts
    add up exactly. Once the run is complete its groups can be removed."""
    store = started(tmp_path, 5)
    store.save_group(ids(0, 3), fold([3, 0]).to_bytes(), None, counts(10))
    store.save_group(ids(4), fold([4]).to_bytes(), None, counts(5))
    for i in (1, 2):
        store.save_group(ids(i), fold([i]).to_bytes(), None, counts(i))
    assert store.done_shards() == set(ids(0, 1, 2, 3, 4))
    groups = store.groups_covering(ids(0, 1, 2, 3, 4))
    assert [g.shard_ids[0] for g in groups] == ids(0, 1, 2, 4)
    merged, sample, totals = reduce_groups(store, groups, EmbeddingStatistics(LAYERS, DIM), False)
    assert sample is None and totals.tokens == 18 and totals.documents == 4
    ref = fold([0, 1, 2, 3, 4])
    for layer in LAYERS:
        a, b = merged.layer(layer), ref.layer(layer)
        np.testing.assert_array_equal(a.type_ids, b.type_ids)
        np.testing.assert_array_equal(a.counts, b.counts)
        np.testing.assert_allclose(a.means, b.means, rtol=1e-12)
        np.testing.assert_allclose(a.m2, b.m2, rtol=1e-10)
        np.testing.assert_allclose(a.comoment, b.comoment, rtol=1e-10)
    store.remove_groups()
    assert not (tmp_path / "out" / "groups").exists() and store.done_shards() == set()


def test_checkpoints_without_run_json_are_refused(tmp_path):
    store = started(tmp_path)
    store.save_group(ids(0), fold([0]).to_bytes(), None, counts(1))
    (tmp_path / "out" / "run.json").unlink()
    with pytest.raises(OutputError, match=r"no run\.json"):
        CheckpointStore(str(tmp_path / "out")).start("fp", {}, plan(5), overwrite=False)
    CheckpointStore(str(tmp_path / "out")).start("fp", {}, plan(5), overwrite=True)
    assert not (tmp_path / "out" / "groups").exists()


def test_overwrite_removes_what_a_run_wrote_and_nothing_of_the_users(tmp_path):
    """``--overwrite`` over a directory holding a run and the user's own files (a corpus,
    notes, a page and a table of another tool's): the run's entries go, the user's stay."""
    from embgeom_ray.run_dir import RUN_ENTRIES

    store = started(tmp_path)
    store.save_group(ids(0), fold([0]).to_bytes(), None, counts(1))
    out = tmp_path / "out"
    for name in ("manifest.json", "layers.parquet", "statistics.safetensors", "report.html",
                 "doc_hashes.npy", ".tmp-abc123", ".out-check-0123abcd"):  # fmt: skip
        (out / name).write_bytes(b"of the run")
    for folder in ("plots", "statistics", "reducers"):
        (out / folder).mkdir()
        (out / folder / "x").write_bytes(b"of the run")
    users = {"corpus.parquet": b"PAR1", "notes.txt": b"mine", "index.html": b"<p>",
             "embeddings.npy": b"np", "model.safetensors": b"w", "data": None}  # fmt: skip
    for name, data in users.items():
        if data is None:
            (out / name).mkdir()
            (out / name / "a.jsonl").write_text("{}\n")
        else:
            (out / name).write_bytes(data)
    CheckpointStore(str(out)).start("other", {}, plan(5), overwrite=True)
    left = {p.name for p in out.iterdir()}
    assert left == set(users) | {"run.json"}  # the new run's
    assert all((out / n).read_bytes() == d for n, d in users.items() if d is not None)
    assert (out / "data" / "a.jsonl").exists()
    assert {"groups", "run.json", "manifest.json", "plots"} <= RUN_ENTRIES


def test_a_directory_holding_another_run_is_refused_without_overwrite(tmp_path):
    """A manifest without this run's ``run.json`` (a merge's, or a run whose ``run.json`` is
    gone) is another run: refused, not written over."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text('{"kind": "merge", "status": "complete"}')
    (out / "layers.parquet").write_bytes(b"the merge's")
    with pytest.raises(OutputError, match=r"already holds a run \(manifest\.json\)"):
        CheckpointStore(str(out)).start("fp", {}, plan(5), overwrite=False)
    assert not (out / "run.json").exists() and (out / "layers.parquet").read_bytes() == b"the merge's"
    CheckpointStore(str(out)).start("fp", {}, plan(5), overwrite=True)
    assert {p.name for p in out.iterdir()} == {"run.json"}


def test_a_group_of_spilled_pieces_reduces_like_one(tmp_path):
    """An extractor under --worker-memory flushes its spilled pieces and its last statistics
    as one group of several files: written in order, listed in the JSON, merged in order;
    a half-written group's pieces are removed on resume."""
    from embgeom_ray.core.spilling import SpillingStatistics

    spilling = SpillingStatistics(EmbeddingStatistics(LAYERS, DIM, initial_types=1), 1)
    for i in (0, 1, 2):
        spilling.update(*shard_batch(i))
    pieces = spilling.take()
    assert len(pieces) == 4 and spilling.spills == 3  # every batch spilled, then an empty last
    store = started(tmp_path, 5)
    group = store.save_group(ids(0, 1, 2), iter(pieces), None, counts(30))
    assert group.parts == 4
    names = sorted(p.name for p in (tmp_path / "out" / "groups").iterdir())
    assert names == [
        "f0-b0000-n3.json", "f0-b0000-n3.part-1.safetensors", "f0-b0000-n3.part-2.safetensors",
        "f0-b0000-n3.part-3.safetensors", "f0-b0000-n3.safetensors",
    ]  # fmt: skip
    (loaded,) = store.groups_covering(ids(0, 1, 2))
    assert loaded.parts == 4 and len(store.group_urls(loaded)) == 4
    merged, _, _ = reduce_groups(store, [loaded], EmbeddingStatistics(LAYERS, DIM), False)
    ref = fold([0, 1, 2])
    for layer in LAYERS:
        a, b = merged.layer(layer), ref.layer(layer)
        np.testing.assert_array_equal(a.counts, b.counts)
        np.testing.assert_allclose(a.means, b.means, rtol=1e-12)
        np.testing.assert_allclose(a.m2, b.m2, rtol=1e-10)
        np.testing.assert_allclose(a.comoment, b.comoment, rtol=1e-10)
    # a group whose JSON was never written: every piece of it goes on resume
    (tmp_path / "out" / "groups" / "f0-b0000-n3.json").unlink()
    removed = store.discard_incomplete()
    assert len(removed) == 4 and not list((tmp_path / "out" / "groups").iterdir())


def test_a_piece_made_a_block_at_a_time_is_written_as_the_same_file(tmp_path):
    """A host tier's statistics are written a block at a time (StreamedStatistics, or their
    blocks in Ray's object store): the group's file and its digest are those of the same
    statistics given as bytes, and it reads back verified; blocks that come short of the
    piece's size leave no file."""
    from embgeom_ray.core.statistics_io import StreamedStatistics

    stats = fold([0, 1])
    whole, streamed = started(tmp_path / "a", 5), started(tmp_path / "b", 5)
    g_whole = whole.save_group(ids(0, 1), [bytes(stats.to_bytes())], None, counts(20))
    g_streamed = streamed.save_group(ids(0, 1), [StreamedStatistics(stats, 100)], None, counts(20))
    assert g_streamed.digests == g_whole.digests
    name = g_whole.file_names()[0]
    a = (tmp_path / "a" / "out" / "groups" / name).read_bytes()
    assert (tmp_path / "b" / "out" / "groups" / name).read_bytes() == a
    (loaded,) = streamed.groups_covering(ids(0, 1))
    merged, _, _ = reduce_groups(streamed, [loaded], EmbeddingStatistics(LAYERS, DIM), False)
    assert merged.token_count() == stats.token_count()

    class Short:  # a piece whose blocks come short of its size
        size = len(a)

        def __iter__(self):
            yield a[:100]

    with pytest.raises(ValueError, match="a stream of 2,784 bytes gave 100"):
        streamed.save_group(ids(2), [Short()], None, counts(10))
    left = sorted(p.name for p in (tmp_path / "b" / "out" / "groups").iterdir())
    assert left == sorted([name, g_whole.group_id + ".json"])  # nothing of the short piece


def test_a_corrupt_group_is_found_and_discarded_with_the_reducer_checkpoints_that_read_it(tmp_path):
    """Each group's JSON records its files' digests; a group with one flipped byte fails the
    reduce (nothing of it merged) and is discarded: its shards are no longer done, and the
    reducer checkpoints that read it go with it, the others stay. A group a previous version
    wrote (no digests) still reads."""
    from embgeom_ray.errors import IntegrityError
    from embgeom_ray.runs.checkpoints import REDUCERS

    store = started(tmp_path)
    good = store.save_group(ids(0, 1), fold([0, 1]).to_bytes(), None, counts(20))
    bad = store.save_group(ids(2), fold([2]).to_bytes(), None, counts(10))
    groups = tmp_path / "out" / "groups"
    assert set(json.loads((groups / f"{bad.group_id}.json").read_text())["digests"]) == {
        f"{bad.group_id}.safetensors"
    }
    piece = groups / f"{bad.group_id}.safetensors"
    data = bytearray(piece.read_bytes())
    data[-5] ^= 1
    piece.write_bytes(bytes(data))
    reducers = tmp_path / "out" / REDUCERS
    reducers.mkdir()
    (ref,) = store.group_urls(bad)
    for r, applied in ((0, [store.group_urls(good)[0].url, ref.url]), (1, [store.group_urls(good)[0].url])):
        (reducers / f"reducer-{r:04d}.json").write_text(json.dumps({"applied": applied}))

    with pytest.raises(IntegrityError, match=rf"{bad.group_id}\.safetensors is corrupt") as info:
        reduce_groups(store, store.completed_groups(), EmbeddingStatistics(LAYERS, DIM), False)
    assert store.group_of(info.value.url) == bad and store.group_of(str(tmp_path / "x")) is None
    store.discard_group(bad)
    assert store.done_shards() == set(ids(0, 1))
    assert sorted(p.name for p in groups.iterdir()) == sorted(
        p.name for p in groups.iterdir() if p.name.startswith(good.group_id)
    )
    assert [p.name for p in reducers.iterdir()] == ["reducer-0001.json"]

    # the redone shard's group, and the old group without digests, reduce to the one pass
    store.save_group(ids(2), fold([2]).to_bytes(), None, counts(10))
    done = groups / f"{good.group_id}.json"
    record = json.loads(done.read_text())
    del record["digests"], record["digest"]
    done.write_text(json.dumps(record))
    merged, _, _ = reduce_groups(
        store, store.groups_covering(ids(0, 1, 2)), EmbeddingStatistics(LAYERS, DIM), False
    )
    np.testing.assert_allclose(merged.layer(0).comoment, fold([0, 1, 2]).layer(0).comoment, rtol=1e-10)


def test_a_refusal_names_each_option_that_differs_once():
    """The result options are compared by name, inside the identity's ``options`` too;
    ``layers`` stands in both and is named once."""
    from embgeom_ray.runs.checkpoints import _describe_differences

    old = {"corpus": "a", "layers": [0, 6], "options": {"layers": [0, 6], "max_length": 16}}
    new = {"corpus": "a", "layers": [6], "options": {"layers": [6], "max_length": 32}}
    assert _describe_differences(old, new) == "differs in: layers, max_length"
    assert _describe_differences(old, old) == ""
