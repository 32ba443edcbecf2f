"""An S3 endpoint that refuses, stalls or drops the connection mid-upload, during a flush (a
checkpoint group written) and during the final write (the artefact and tables), with a real
S3 API (moto's server mode) behind a TCP proxy on loopback that fails on demand
(:class:`tests.object_store.FaultyProxy`).

- A short outage is survived: the store's own retries (botocore's, inside s3fs's) carry the
  write through, and what was written reads back checked against its digest.
- An outage that outlasts the retries stops the run with one line naming the run and the
  endpoint and saying that rerunning resumes (:func:`embgeom_ray.storage.resumable`, a
  :class:`~embgeom_ray.errors.StorageError`: exit status 2); the group being written is not
  done, the groups before it are kept, and writing again once the store answers counts
  every shard once.
- The same for each file of the final write (a table staged and uploaded, a table in one
  PUT, the manifest marked complete): the manifest is not ``complete`` until every file is
  written, and writing again gives the run's tables.
- The whole job, stalled mid-run, then rerun: it resumes, and its tables equal the
  reference.

The retries here are fsspec's configuration of s3fs made short (a read timeout of 0.5 s, two
attempts a request), as a user would set it (``FSSPEC_S3``); the job's defaults are in
:data:`embgeom_ray.io_utils.STORE_DEFAULTS`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import numpy as np
import pandas as pd
import pytest

from embgeom_ray.errors import StorageError
from embgeom_ray.run_dir import Manifest, RunDir
from embgeom_ray.runs.checkpoints import CheckpointStore
from embgeom_ray.storage import resumable
from tests.object_store import FaultyProxy, moto_server, s3_env
from tests.runs.test_checkpoints import counts, fold, ids, plan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BUCKET = "faults"
#: botocore's timeouts and attempts made short, as ``FSSPEC_S3`` would (the job's own
#: defaults are minutes: embgeom_ray.io_utils.STORE_DEFAULTS)
SHORT = {"config_kwargs": {"connect_timeout": 1, "read_timeout": 0.5,
                           "retries": {"mode": "standard", "total_max_attempts": 2}}}  # fmt: skip


@pytest.fixture(scope="module")
def proxy(tmp_path_factory) -> Iterator[FaultyProxy]:
    """moto behind the failing proxy, the environment pointing boto at the proxy."""
    import fsspec.config
    import s3fs

    with moto_server(tmp_path_factory.mktemp("moto") / "moto.log") as endpoint:
        proxy = FaultyProxy(endpoint)
        with pytest.MonkeyPatch.context() as mp:
            for key, value in s3_env(proxy.endpoint).items():
                mp.setenv(key, value)
            mp.setitem(fsspec.config.conf, "s3", json.loads(json.dumps(SHORT)))
            s3fs.S3FileSystem.clear_instance_cache()
            s3fs.S3FileSystem().mkdir(BUCKET)
            try:
                yield proxy
            finally:
                proxy.heal()
                s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def store(proxy, request) -> CheckpointStore:
    name = request.node.name.replace("[", "-").replace("]", "")
    store = CheckpointStore(f"s3://{BUCKET}/{name}")
    store.start("fp", {}, plan(4), overwrite=False)
    return store


def save(store: CheckpointStore, *shards: int):
    return store.save_group(ids(*shards), fold(list(shards)).to_bytes(), None, counts(10))


def finalise(out: str):
    stats = fold([0, 1, 2, 3])
    tables = {"layers": pd.DataFrame({"layer": [0, 1], "anisotropy": [0.1, 0.2]})}
    return RunDir(out).finalise(Manifest(status="running"), tables, stats, None), stats


#: the faults, and what a write during each is: the request that fails is the next one
FAULTS = {"refuse": {"mode": "refuse"}, "stall": {"mode": "stall"},
          "cut mid-upload": {"mode": "cut"}}  # fmt: skip


@pytest.mark.parametrize("fault", FAULTS)
def test_a_short_outage_is_retried_through(proxy, store, fault):
    """The fault lasts one request (a refusal: one connection reset): the flush and the final write go
    through on the store's retries, and read back checked against their digests."""
    proxy.fault(**FAULTS[fault], at=rb"PUT /faults/", requests=1)
    group = save(store, 0, 1)
    assert proxy.faults >= 1
    stats, _ = store.load_group(store.groups_covering(ids(0, 1))[0], with_sample=False)
    assert stats.to_bytes() == fold([0, 1]).to_bytes()
    proxy.heal()
    proxy.faults = 0
    proxy.fault(**FAULTS[fault], at=rb"PUT /faults/[^ ]*/statistics", requests=1)
    manifest, stats = finalise(store.out)
    assert proxy.faults >= 1 and manifest.complete and group.group_id
    assert RunDir(store.out).load_statistics().to_bytes() == stats.to_bytes()
    proxy.heal()


@pytest.mark.parametrize("fault", FAULTS)
def test_a_store_that_stays_down_stops_the_run_resumably(proxy, store, fault, monkeypatch):
    """The fault outlasts the retries: one line naming the run, the endpoint and what to do
    (a StorageError: exit status 2); the group being written is not done, the one before is
    kept, and once the store answers the writes complete with every shard counted once. The
    same for the final write: the run is not marked complete until it is written whole."""
    import s3fs

    # s3fs's own loop once (botocore's two attempts a request stay): a stall outlasted its five
    # tries in ~7 s a write, here twice (18.5 s of make test)
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    save(store, 0, 1)
    proxy.fault(**FAULTS[fault], at=rb"PUT /faults/")  # the next group's first file
    t0 = time.monotonic()
    with pytest.raises(StorageError) as info, resumable(store.out):
        save(store, 2, 3)
    line = str(info.value)
    assert "\n" not in line and store.out in line and proxy.endpoint in line, line
    assert "rerun the same command to resume" in line, line
    assert time.monotonic() - t0 < 60
    proxy.heal()
    assert store.done_shards() == set(ids(0, 1))  # the group whose JSON was never written
    store.discard_incomplete()  # what a rerun does first
    save(store, 2, 3)
    assert len(store.groups_covering(ids(0, 1, 2, 3))) == 2

    proxy.fault(**FAULTS[fault], at=rb"PUT /faults/[^ ]*/statistics")
    with pytest.raises(StorageError, match="rerun the same command"), resumable(store.out):
        finalise(store.out)
    proxy.heal()
    assert not RunDir(store.out).has_manifest() or not RunDir(store.out).manifest().complete
    manifest, stats = finalise(store.out)
    assert manifest.complete
    assert RunDir(store.out).load_statistics().to_bytes() == stats.to_bytes()


class Tokens:
    """A tokenizer's one method the tables use: token id -> name."""

    @staticmethod
    def convert_ids_to_tokens(ids):
        return [f"t{int(i)}" for i in ids]


#: the final write's files that the store fails on (the statistics artefact: above), as the
#: proxy sees their uploads: ``type_stats`` staged in a file and uploaded, ``layers`` written
#: in one PUT, and the manifest marked complete (the ``running`` one is written before)
FINAL_WRITES = {"type_stats.parquet": rb"PUT /faults/[^ ]*/type_stats\.parquet",
                "layers.parquet": rb"PUT /faults/[^ ]*/layers\.parquet",
                "complete manifest": rb"PUT /faults/[^ ]*/manifest\.json"}  # fmt: skip


@pytest.mark.parametrize("target", FINAL_WRITES)
@pytest.mark.parametrize("fault", FAULTS)
def test_a_store_down_during_the_final_write_leaves_the_run_unfinished(proxy, fault, target, monkeypatch):
    """The job's final write (:func:`~embgeom_ray.runs.finish.finish_run`: the tables, the
    artefact and the manifest) with the store failing for good on one of its files, past
    the retries: one line naming the run, the endpoint and what to do (a StorageError, exit
    status 2); the manifest is not ``complete``. Written again once the store answers (what
    the rerun does, its checkpoint groups kept), the run is complete and its tables, read
    back checked against their digests, are the tables of its statistics."""
    import s3fs

    from embgeom_ray.config import JobConfig
    from embgeom_ray.core.tables import build_tables
    from embgeom_ray.runs.finish import StatisticsHere, finish_run

    # s3fs's own loop once, in this process (the final write; the extractor's process keeps
    # s3fs's five tries: a class attribute no configuration reaches)
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    out = f"s3://{BUCKET}/final-{fault.replace(' ', '-')}-{target.split('.')[0].replace(' ', '-')}"
    config = JobConfig(model="m", corpus="c.txt", out=out, no_report=True, sample_size=0)
    stats = fold([0, 1, 2, 3])

    def final_write(fails: bool) -> Manifest:
        run = RunDir(out)
        manifest = Manifest(status="running")
        run.write_manifest(manifest)  # as the job does before it reduces
        if fails:
            proxy.fault(**FAULTS[fault], at=FINAL_WRITES[target])
        return finish_run(run, manifest, StatisticsHere(stats), None, Tokens, config, t_start=0, echo=print)

    with pytest.raises(StorageError) as info, resumable(out):
        final_write(fails=True)
    proxy.heal()
    line = str(info.value)
    assert "\n" not in line and out in line and proxy.endpoint in line, line
    assert "rerun the same command to resume" in line, line
    assert RunDir(out).manifest().status == "running"
    assert final_write(fails=False).complete
    run = RunDir(out)
    assert run.manifest().complete
    assert sorted(run.manifest().outputs.digests) == [
        "dims.parquet", "layers.parquet", "positions.parquet", "statistics.safetensors",
        "type_stats.parquet",
    ]  # fmt: skip
    expected = build_tables(stats, Tokens, config.tables)
    for name in ("type_stats", "layers", "dims", "positions"):
        pd.testing.assert_frame_equal(run.read_table(name), expected[name], check_dtype=False)
    assert run.load_statistics().to_bytes() == stats.to_bytes()


def test_a_job_stalled_mid_run_resumes_and_equals_the_reference(
    proxy, ray_local, tmp_path, capsys, monkeypatch
):
    """The whole job (its writes through the proxy: a local corpus, the checkpoint groups
    written by the extractor, committed and reduced in this process): the store stalls after
    its second checkpoint group, the job stops in one line, exit status 2; rerun once the store answers, it resumes with both groups kept
    (one shard left to extract), and this time the store refuses during the final write (a
    table): one line again, exit status 2, the manifest ``running``. The third run extracts
    nothing (every group kept), writes the run, and its tables equal the reference."""
    import s3fs

    from jobs.analyze import main
    from tests.conftest import write_jsonl
    from tests.reference import reference_tables
    from tests.runs.test_job_end_to_end import assert_tables_close, english_documents
    from tests.tiny_models import make_tiny_bert

    # s3fs's own loop once, in this process (the final write; the extractor's process keeps
    # s3fs's five tries: a class attribute no configuration reaches)
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    model = make_tiny_bert(str(tmp_path / "model"))
    docs = [d.encode("ascii", "ignore").decode() for d in english_documents(6, 900)]
    docs = [d for d in docs if d.strip()]
    corpus = write_jsonl(tmp_path / "c.jsonl", docs)
    out = f"s3://{BUCKET}/job"
    argv = ["--model", model, "--corpus", corpus, "--out", out, "--max-length", "32",
            "--shard-bytes", "2048", "--checkpoint-interval", "0", "--sample-size", "0",
            "--no-report", "--reducers", "1", "--num-workers", "1"]  # fmt: skip
    seen = len(proxy.seen)
    # the store stalls from the third group's first file on: two groups are complete
    proxy.fault("stall", at=rb"PUT /faults/job/groups/[^ ]*-n1\.safetensors", skip=2)
    capsys.readouterr()
    assert main(argv) == 2
    said = capsys.readouterr()
    # in object storage the extractor writes its own groups: the stall met it, not this process
    assert "written by each extractor (object storage)" in said.out, said.out
    err = [line for line in said.err.splitlines() if line.startswith("error")]
    assert len(err) == 1 and out in err[0] and "rerun the same command" in err[0], err
    proxy.heal()
    groups = [r for r in proxy.seen[seen:] if r.endswith(b".json") and b"/groups/" in r]
    assert groups, proxy.seen[seen:]
    proxy.fault("refuse", at=rb"PUT /faults/job/layers\.parquet")
    assert main(argv) == 2
    said = capsys.readouterr()
    assert "resuming" in said.out and "2 of 3 shards already done" in said.out, said.out
    err = [line for line in said.err.splitlines() if line.startswith("error")]
    assert len(err) == 1 and out in err[0] and "rerun the same command" in err[0], err
    proxy.heal()
    fs = __import__("s3fs").S3FileSystem()
    assert json.loads(fs.cat(f"{BUCKET}/job/manifest.json"))["status"] == "running"
    assert main(argv) == 0, capsys.readouterr().err[-3000:]
    said = capsys.readouterr()
    assert "3 of 3 shards already done" in said.out, said.out
    manifest = json.loads(fs.cat(f"{BUCKET}/job/manifest.json"))
    shards = manifest["shards"]
    assert (shards["reused_from_checkpoints"], shards["computed"], shards["total"]) == (3, 0, 3)
    assert manifest["sizing"]["reduce"]["count"] == 0  # --reducers 1: reduced in this process
    tables = {}
    for name in ("type_stats", "layers", "dims", "positions"):
        with fs.open(f"{BUCKET}/job/{name}.parquet", "rb") as f:
            tables[name] = pd.read_parquet(f)
    ref = reference_tables(model, docs, max_length=32)
    assert_tables_close(tables, ref, rtol=1e-5, cos_atol=1e-6)
    assert np.isfinite(tables["layers"]["anisotropy"]).all()


def test_an_object_of_more_than_s3s_parts_takes_larger_parts():
    """S3 refuses a part numbered past 10,000: at 50 MiB a part, an object past 488 GiB (a 70B
    model's host tier of 747 GiB, a flush's piece) would fail 10,000 parts into its upload."""
    from embgeom_ray.io_utils import S3_MAX_PARTS, S3_PART_BYTES, s3_part_bytes

    GiB, MiB = 2**30, 2**20
    assert s3_part_bytes(13 * MiB) == s3_part_bytes(172 * GiB) == S3_PART_BYTES == 50 * MiB
    assert s3_part_bytes(S3_MAX_PARTS * S3_PART_BYTES) == S3_PART_BYTES
    assert s3_part_bytes(S3_MAX_PARTS * S3_PART_BYTES + 1) == 51 * MiB
    for size in (489 * GiB, int(747.2 * GiB), 5 * 2**40):  # S3's largest object: 5 TiB
        part = s3_part_bytes(size)
        assert part % MiB == 0 and -(-size // part) <= S3_MAX_PARTS < -(-size // (part - MiB))
    assert s3_part_bytes(int(747.2 * GiB)) == 77 * MiB


def test_a_large_object_goes_up_in_parts_and_a_failed_part_leaves_nothing(proxy, monkeypatch):
    """Past two parts an S3 object is uploaded in parts a few at a time (io_utils.S3_PART_BYTES;
    here parts of 5 MiB, S3's least): it reads back whole, from bytes, from a uint8 array (Ray's)
    or given a block at a time (io_utils.atomic_write_blocks); a part
    the store refuses past the retries stops the write with the run's one line, and the upload
    is aborted, so no object stands under the name."""
    import fsspec.config
    import numpy as np
    import s3fs

    from embgeom_ray import io_utils

    monkeypatch.setattr(io_utils, "S3_PART_BYTES", 5 << 20)
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    # nothing stalls here: the module's read timeout of 0.5 s (for its stall tests) can run out
    # while moto, under load, assembles an upload's parts, and the retried completion then
    # finds the upload completed ("the specified upload does not exist")
    monkeypatch.setitem(fsspec.config.conf, "s3", SHORT | {"config_kwargs": {
        **SHORT["config_kwargs"], "read_timeout": 30}})  # fmt: skip
    s3fs.S3FileSystem.clear_instance_cache()
    data = np.random.default_rng(13).integers(0, 256, (12 << 20) + 123, dtype=np.uint8)
    fs = s3fs.S3FileSystem()

    def parts_of(name: str, body, whole: np.ndarray) -> int:
        """``body`` written to the bucket as ``name`` (bytes, an array, or a list of blocks):
        it reads back as ``whole``; the parts its upload sent."""
        seen = len(proxy.seen)
        url = f"s3://{BUCKET}/parts/{name}.bin"
        if isinstance(body, list):
            io_utils.atomic_write_blocks(url, iter(body), whole.nbytes)
        else:
            io_utils.atomic_write_bytes(url, body)
        assert fs.cat(f"{BUCKET}/parts/{name}.bin") == whole.tobytes()
        return sum(b"partNumber=" in r and r.startswith(b"PUT") for r in proxy.seen[seen:])

    # from bytes, from a uint8 array (Ray's), and given a block at a time (a host tier's
    # statistics: blocks of 3 MiB, cut into parts as they come): two whole parts and the rest
    blocks = [data[i : i + (3 << 20)] for i in range(0, len(data), 3 << 20)]
    for name, body in (("array", data), ("bytes", data.tobytes()), ("blocks", blocks)):
        assert parts_of(name, body, data) == 3
    # S3 takes at most 10,000 parts an upload (moto too): a larger object takes larger parts,
    # here under a limit of 3 (16 MiB in 3 parts of 6 MiB, whole MiB each, not 4 of 5 MiB)
    monkeypatch.setattr(io_utils, "S3_MAX_PARTS", 3)
    more = np.random.default_rng(14).integers(0, 256, (16 << 20) + 123, dtype=np.uint8)
    assert parts_of("few-bytes", more, more) == 3
    assert parts_of("few-blocks", [more[: 9 << 20], more[9 << 20 :]], more) == 3
    monkeypatch.setattr(io_utils, "S3_MAX_PARTS", 10_000)
    proxy.fault("refuse", at=rb"PUT /faults/parts/refused\.bin\?partNumber=2")
    with pytest.raises(StorageError) as info, resumable(f"s3://{BUCKET}/parts"):
        io_utils.atomic_write_bytes(f"s3://{BUCKET}/parts/refused.bin", data)
    proxy.heal()
    assert "\n" not in str(info.value) and proxy.endpoint in str(info.value)
    fs.invalidate_cache()
    assert not fs.exists(f"{BUCKET}/parts/refused.bin")
    proxy.fault("refuse", at=rb"PUT /faults/parts/refused-blocks\.bin\?partNumber=2")
    with pytest.raises(StorageError), resumable(f"s3://{BUCKET}/parts"):
        io_utils.atomic_write_blocks(f"s3://{BUCKET}/parts/refused-blocks.bin", iter(blocks),
                                     data.nbytes)  # fmt: skip
    proxy.heal()
    fs.invalidate_cache()
    assert not fs.exists(f"{BUCKET}/parts/refused-blocks.bin")


def test_a_larger_object_has_more_parts_in_flight_and_no_more(proxy, monkeypatch):
    """The parts an upload has in flight at once, counted at s3fs's requests: as many as
    io_utils.s3_parts_at_once gives for the object's size, in each of the three ways the job
    uploads (bytes, blocks streamed, a staged file: RunDir's tables), and never more. Here
    an object of 7 parts of 5 MiB (S3's least): with one connection for every part, 7 at
    once; with the job's one for every 8 parts, the least, 4 (4 to 16)."""
    import numpy as np
    import s3fs

    from embgeom_ray import io_utils
    from embgeom_ray.run_dir import _staged

    monkeypatch.setattr(io_utils, "S3_PART_BYTES", 5 << 20)
    monkeypatch.setitem(fsspec_conf(), "s3", SHORT | {"config_kwargs": {
        **SHORT["config_kwargs"], "read_timeout": 30}})  # fmt: skip
    s3fs.S3FileSystem.clear_instance_cache()
    flight = {"now": 0, "most": 0}
    call = s3fs.S3FileSystem._call_s3

    async def counted(self, method, *args, **kwargs):
        if method != "upload_part":
            return await call(self, method, *args, **kwargs)
        flight["now"] += 1
        flight["most"] = max(flight["most"], flight["now"])
        try:
            return await call(self, method, *args, **kwargs)
        finally:
            flight["now"] -= 1

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counted)
    fs = s3fs.S3FileSystem()
    size = (30 << 20) + 7
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    for per, want in ((1, 7), (io_utils.S3_PARTS_PER_CONNECTION, 4)):
        monkeypatch.setattr(io_utils, "S3_PARTS_PER_CONNECTION", per)
        assert io_utils.s3_parts_at_once(size) == want
        for how in ("bytes", "blocks", "staged"):
            flight["most"] = 0
            url = f"s3://{BUCKET}/flight/{how}-{per}.bin"
            if how == "bytes":
                io_utils.atomic_write_bytes(url, data)
            elif how == "blocks":
                blocks = (data[i : i + (2 << 20)] for i in range(0, size, 2 << 20))
                io_utils.atomic_write_blocks(url, blocks, size)
            else:
                with _staged(url) as path:
                    data.tofile(path)
            assert flight["most"] == want, how
            assert fs.cat(url[len("s3://") :]) == data.tobytes()


def fsspec_conf() -> dict:
    import fsspec.config

    return fsspec.config.conf
