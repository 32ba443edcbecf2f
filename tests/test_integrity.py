"""Digests of what the job writes (``embgeom_ray/integrity.py``): one flipped byte is found by
whole reads and by every partial read that touches it, and by nothing else; files without a
digest (written before digests existed) read as before."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from embgeom_ray.core.samples import ActivationSample
from embgeom_ray.core.statistics import EmbeddingStatistics
from embgeom_ray.errors import IntegrityError
from embgeom_ray.integrity import (
    MIN_BLOCK,
    Digest,
    FileRef,
    VerifiedFile,
    block_size,
    integrity_error,
    seal,
    unseal,
)
from embgeom_ray.run_dir import Manifest, RunDir, load_statistics_part
from embgeom_ray.storage import as_user_error

LAYERS, DIM = [0, 1, 2], 8


def flip(path: Path, offset: int) -> None:
    """Flip the low bit of the byte at ``offset`` of ``path`` (negative: from the end)."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


def statistics(seed: int = 0, types: int = 40) -> EmbeddingStatistics:
    rng = np.random.default_rng(seed)
    stats = EmbeddingStatistics(LAYERS, DIM, max_positions=6)
    for _ in range(3):
        h = torch.tensor(rng.normal(1.0, 2.0, (len(LAYERS), 4, 6, DIM)))
        stats.update(h, torch.tensor(rng.integers(0, types, (4, 6))))
    return stats


def test_block_digests_find_a_flipped_byte_where_it_is_read():
    data = np.random.default_rng(0).integers(0, 256, (2 * MIN_BLOCK + 12_345,), np.uint8).tobytes()
    digest = Digest.of(data)
    assert (digest.size, digest.block, digest.blocks) == (len(data), MIN_BLOCK, 3)
    assert Digest.from_json(json.loads(json.dumps(digest.to_json()))) == digest
    assert Digest.from_json({"algorithm": "crc32c", "size": 1}) is None  # unknown: unchecked
    digest.check(data, "f")
    bad = bytearray(data)
    bad[MIN_BLOCK + 7] ^= 0x10  # in the second block
    with pytest.raises(IntegrityError, match=r"f is corrupt: bytes 4,194,304-8,388,608 \(block 2 of 3\)"):
        digest.check(bad, "f")
    with pytest.raises(IntegrityError, match="it holds 10 bytes"):
        digest.check(data[:10], "f")
    for start, end, found in ((0, 100, False), (MIN_BLOCK - 5, MIN_BLOCK + 1, True),
                              (2 * MIN_BLOCK, len(data), False), (0, len(data), True)):  # fmt: skip
        f = VerifiedFile(io.BytesIO(bytes(bad)), digest, "f")
        if found:
            with pytest.raises(IntegrityError):
                f.read_range(start, end)
        else:
            assert bytes(f.read_range(start, end)) == data[start:end]
        # without a digest, the same bytes come back unchecked
        assert bytes(VerifiedFile(io.BytesIO(bytes(bad)), None, "f").read_range(start, end)) == bad[start:end]
    # blocks grow past 4,096 of them, up to 64 MiB
    assert block_size(100) == MIN_BLOCK and block_size(64 << 30) == 16 << 20
    assert block_size(10 << 40) == 64 << 20


def test_an_error_raised_on_ray_reads_as_itself():
    """A Ray task's error reaches the driver wrapped, with the error as its ``cause``: the
    command line prints the error's own one line, and the pipeline finds the file."""
    error = IntegrityError("s3://b/run/groups/g.safetensors", "bytes 0-9 do not match")

    class Wrapped(Exception):
        cause = error

    assert as_user_error(Wrapped("traceback ...")) is error
    assert integrity_error(Wrapped()) is error and integrity_error(ValueError()) is None


def test_statistics_and_sample_files_are_checked_on_every_read(tmp_path):
    stats = statistics()
    path = tmp_path / "s.safetensors"
    digest = stats.save(path)
    ref = FileRef(str(path), digest)
    ids = EmbeddingStatistics.read_type_ids(ref)
    assert EmbeddingStatistics.load(ref).to_bytes() == stats.to_bytes()
    whole = EmbeddingStatistics.load_part(ref, [1], (0, None))
    assert whole.to_bytes() == stats.select([1], (0, None)).to_bytes()
    # a byte in the last array: the rows of the last type ids of the last layer
    flip(path, -3)
    for read in (lambda r: EmbeddingStatistics.load(r),
                 lambda r: EmbeddingStatistics.load_part(r, [2], (0, None), layer_state=False)):  # fmt: skip
        with pytest.raises(IntegrityError, match=r"s\.safetensors is corrupt"):
            read(ref)
    # the file is one block: every part of it is checked, its header and ids too
    with pytest.raises(IntegrityError):
        EmbeddingStatistics.read_type_ids(ref)
    # the same file without a digest (written before digests) loads, corrupt or not
    assert np.array_equal(EmbeddingStatistics.read_type_ids(str(path)), ids)
    EmbeddingStatistics.load(str(path))

    sample = ActivationSample(LAYERS, DIM, 16, seed=1)
    rng = np.random.default_rng(3)
    h = torch.tensor(rng.normal(size=(len(LAYERS), 2, 5, DIM)), dtype=torch.float32)
    sample.update(
        h, torch.tensor(rng.integers(0, 9, (2, 5))), None, torch.arange(2), torch.zeros(2, dtype=torch.int64)
    )
    spath = tmp_path / "sample.safetensors"
    ref = FileRef(str(spath), sample.save(spath))
    assert ActivationSample.load_layer(ref, 1).to_bytes() == sample.layer_sample(1).to_bytes()
    flip(spath, -1)
    with pytest.raises(IntegrityError, match=r"sample\.safetensors is corrupt"):
        ActivationSample.load_layer(ref, 1)
    ActivationSample.load_layer(str(spath), 1)  # no digest: unchecked


def test_a_partial_read_checks_the_blocks_it_reads_and_no_others(tmp_path):
    """A reducer reads its token range of a group: a flipped byte in another range's rows
    is not its to find (the reducer of that range finds it), and a flip in its own is."""
    from embgeom_ray.core.sketch import SafetensorsFile

    stats = statistics()
    path = tmp_path / "g.safetensors"
    stats.save(path)
    # blocks of 256 bytes, so that the ranges below lie in blocks of their own
    ref = FileRef(str(path), Digest.of(path.read_bytes(), block=256))
    with VerifiedFile(io.BytesIO(path.read_bytes()), None, "g") as f:
        st = SafetensorsFile(f, "statistics")
        dtype, (layers, types, dim), (start, _) = st.specs["means"]
        row = dim * dtype.itemsize
        last_row = st.base + start + ((layers - 1) * types + types - 1) * row  # highest id
    flip(path, last_row + 3)
    ids = EmbeddingStatistics.read_type_ids(ref)
    low = (0, int(ids[types // 2]))
    part = EmbeddingStatistics.load_part(ref, None, low, layer_state=False)  # not touched
    assert part.to_bytes() == stats.select(None, low, layer_state=False).to_bytes()
    with pytest.raises(IntegrityError, match=r"block \d+ of \d+"):
        EmbeddingStatistics.load_part(ref, None, (low[1], None), layer_state=False)


def test_run_files_are_checked_against_the_manifest(tmp_path):
    """A complete run records its tables' and artefacts' digests in ``manifest.json``
    (``outputs.digests``); every read through RunDir (and so ``open_run``) checks them; a
    run without them (an earlier version) reads as before."""
    run = RunDir(str(tmp_path / "run"))
    stats = statistics()
    tables = {"layers": pd.DataFrame({"layer": LAYERS, "anisotropy": [0.1, 0.2, 0.3]})}
    manifest = run.finalise(Manifest(status="running"), tables, stats, None)
    digests = manifest.outputs.digests
    assert sorted(digests) == ["layers.parquet", "statistics.safetensors"]
    assert all(d["algorithm"] == "xxh3_64-blocks" for d in digests.values())
    again = RunDir(run.url)
    pd.testing.assert_frame_equal(again.read_table("layers"), tables["layers"])
    assert again.load_statistics().to_bytes() == stats.to_bytes()
    flip(tmp_path / "run" / "layers.parquet", 40)
    flip(tmp_path / "run" / "statistics.safetensors", -2)
    for read in (lambda r: r.read_table("layers"), lambda r: r.load_statistics(),
                 lambda r: load_statistics_part(r.statistics_ref(), [0], (0, 5))):  # fmt: skip
        with pytest.raises(IntegrityError, match="is corrupt"):
            read(RunDir(run.url))
    from embgeom_ray import open_run

    with pytest.raises(IntegrityError, match=r"layers\.parquet is corrupt"):
        open_run(run.url).table("layers")
    # the manifest of an earlier version records no digests: the files read unchecked
    on_disk = json.loads((tmp_path / "run" / "manifest.json").read_text())
    del on_disk["outputs"]["digests"], on_disk["digest"]
    (tmp_path / "run" / "manifest.json").write_text(json.dumps(on_disk))
    RunDir(run.url).load_statistics()


def flip_digit(path: Path, text: bytes) -> None:
    """Flip the low bit of the first digit at or after the end of ``text`` in ``path``: it
    becomes another digit, and the JSON still parses."""
    data = path.read_bytes()
    at = data.index(text) + len(text) - 1
    while not data[at : at + 1].isdigit():
        at += 1
    flip(path, at)


def test_json_the_job_reads_back_carries_its_own_digest():
    """A JSON document's digest is of its content (keys sorted, no spaces): indentation and
    key order do not matter, a digit does; a document without one reads as it is."""
    doc = {"shards": ["f0-b0001", "f0-b0002"], "counts": {"tokens": 50, "x": 0.1 + 0.2}}
    sealed = seal(doc)
    assert sealed["digest"].startswith("xxh3_64:") and seal(sealed) == sealed
    for text in (json.dumps(sealed), json.dumps(sealed, indent=2, sort_keys=True)):
        assert unseal(json.loads(text), "f.json") == doc
    bad = json.loads(json.dumps(sealed).replace("f0-b0002", "f0-b0003"))
    with pytest.raises(IntegrityError, match=r"f\.json is corrupt: its content does not match"):
        unseal(bad, "f.json")
    assert unseal(doc, "f.json") == doc  # an earlier version's: no digest, read as it is
    assert unseal([1, 2], "f.json") == [1, 2]


def test_a_flipped_digit_in_a_manifest_is_refused_in_one_line(tmp_path, capsys):
    """``manifest.json`` holds its own digest: a digit flipped in it (a count, a digest's
    size) is refused by every reader, ``open_run`` and the commands (exit status 2)."""
    from embgeom_ray import open_run
    from jobs import merge

    run = RunDir(str(tmp_path / "run"))
    manifest = Manifest(status="running", counts={"tokens": 1250})
    run.finalise(manifest, {"layers": pd.DataFrame({"layer": LAYERS})}, statistics(), None)
    assert open_run(run.url).manifest.counts.tokens == 1250
    other = tmp_path / "other"
    __import__("shutil").copytree(tmp_path / "run", other)
    flip_digit(tmp_path / "run" / "manifest.json", b'"tokens": 125')
    with pytest.raises(IntegrityError, match=r"manifest\.json is corrupt"):
        open_run(run.url)
    capsys.readouterr()
    assert merge.main(["--out", str(tmp_path / "m"), str(other), run.url]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run/manifest.json is corrupt" in err[0], err


def test_a_checkpoint_json_with_a_flipped_digit_is_not_trusted(tmp_path):
    """A group's JSON whose shard id reads as another shard (f0-b0001 -> f0-b0000) would count
    a shard twice and leave another out: on resume the group is discarded, in one line, and
    its shards are redone; the other group is kept. A corrupt ``run.json`` (the plan) is
    refused. The reducer checkpoints that read the group go with it."""
    from embgeom_ray.errors import OutputError
    from embgeom_ray.runs.checkpoints import REDUCERS, CheckpointStore
    from tests.runs.test_checkpoints import counts, fold, ids, plan, started

    store = started(tmp_path, 4)
    good = store.save_group(ids(0), fold([0]).to_bytes(), None, counts(10))
    bad = store.save_group(ids(1, 2), fold([1, 2]).to_bytes(), None, counts(20))
    groups = tmp_path / "out" / "groups"
    reducers = tmp_path / "out" / REDUCERS
    reducers.mkdir()
    for r, group in ((0, bad), (1, good)):
        applied = [ref.url for ref in store.group_urls(group)]
        (reducers / f"reducer-{r:04d}.json").write_text(json.dumps({"applied": applied}))
    flip_digit(groups / f"{bad.group_id}.json", b'"f0-b0001')
    again = CheckpointStore(str(tmp_path / "out"))
    _, resumed = again.start("fp", {}, plan(4), overwrite=False)
    assert resumed and again.done_shards() == set(ids(0))
    (line,) = again.corrupt
    assert line.startswith(f"checkpoint group {bad.group_id} is corrupt ({bad.group_id}.json: ")
    assert line.endswith("; its shards are redone")
    assert not any(p.name.startswith(bad.group_id) for p in groups.iterdir())
    assert [p.name for p in reducers.iterdir()] == ["reducer-0001.json"]

    flip_digit(tmp_path / "out" / "run.json", b'"f0-b0003')
    with pytest.raises(OutputError, match=r"run\.json is corrupt: .*pass --overwrite"):
        CheckpointStore(str(tmp_path / "out")).start("fp", {}, plan(4), overwrite=False)


def test_a_comparison_records_its_tables_digests(tmp_path):
    """``comparison.json`` holds its own digest and its tables' digests: the Python API's
    :class:`~embgeom_ray.api.Comparison` checks both."""
    from embgeom_ray.api import Comparison
    from embgeom_ray.runs.compare import compare_runs
    from tests.runs.test_compare import (
        BASE_LAYERS,
        BASE_OUTLIERS,
        OTHER_LAYERS,
        OTHER_OUTLIERS,
        make_run,
    )

    a = make_run(tmp_path / "runs" / "base", BASE_LAYERS, BASE_OUTLIERS)
    b = make_run(tmp_path / "runs" / "new", OTHER_LAYERS, OTHER_OUTLIERS)
    out = tmp_path / "cmp"
    summary = compare_runs([a, b], str(out), echo=lambda s: None)
    assert sorted(summary["digests"]) == sorted(summary["files"][:4])
    expected = Comparison(str(out)).changes
    flip(out / "changes.parquet", 40)
    with pytest.raises(IntegrityError, match=r"changes\.parquet is corrupt"):
        Comparison(str(out)).changes  # noqa: B018
    assert len(expected)
    flip_digit(out / "comparison.json", b'"size_threshold"')
    with pytest.raises(IntegrityError, match=r"comparison\.json is corrupt"):
        Comparison(str(out))


def test_a_reducer_checkpoint_json_with_a_flipped_digit_is_not_used(tmp_path):
    """A reducer's checkpoint JSON holds its own digest: one whose content does not match is
    not used (removed, and why reported), and the reducer reads its sources again, to the
    same partition (the class in this process, as Ray runs it in an actor)."""
    from embgeom_ray.distributed.reducers import PartitionPlan, Reducer

    stats = statistics()
    sources = []
    for i in range(2):
        path = tmp_path / f"g{i}.safetensors"
        sources.append(FileRef(str(path), stats.save(path)))
    plan = PartitionPlan.of(2, 40, LAYERS)
    first = Reducer(0, plan, checkpoint_dir=str(tmp_path / "reducers"))
    first.load(sources)
    name = Path(first.checkpoint())
    assert json.loads(name.read_text())["digest"].startswith("xxh3_64:")
    assert Reducer(0, plan, checkpoint_dir=str(tmp_path / "reducers")).load(sources)["restored"] == 2
    flip_digit(name, b'"ranges"')
    again = Reducer(0, plan, checkpoint_dir=str(tmp_path / "reducers"))
    result = again.load(sources)
    assert (result["restored"], result["read"]) == (0, 2)
    assert "is corrupt: its content does not match" in result["dropped"] and not name.exists()
    assert again.rows.to_bytes() == first.rows.to_bytes()


@pytest.mark.parametrize("size", [0, 5, MIN_BLOCK - 1, MIN_BLOCK, 3 * MIN_BLOCK + 17])
def test_a_digest_taken_as_the_bytes_stream_by_is_the_digest_of_the_whole(size):
    """A file made a block at a time is hashed as it is written (Digest.of_stream): whatever
    the cut of its pieces against the digest's blocks, the same digest as of its bytes whole;
    pieces that do not add up to the size are an error."""
    rng = np.random.default_rng(size)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    for cuts in (rng.integers(1, 3 * MIN_BLOCK, 8), [1] * 3, [MIN_BLOCK], [size + 1]):
        pieces, at = [], 0
        for cut in [*cuts, size]:
            pieces.append(data[at : at + int(cut)])
            at += int(cut)
            if at >= size:
                break
        made: list[Digest] = []
        passed = list(Digest.of_stream(size, pieces, made))
        assert [p.nbytes for p in passed] == [p.nbytes for p in pieces]
        assert made == [Digest.of(data)]
    with pytest.raises(ValueError, match="gave"):
        list(Digest.of_stream(size + 1, [data], []))
