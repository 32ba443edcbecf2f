"""What a write to object storage holds beside its data (io_utils.upload_buffer_bytes), and the
memory formulas of the processes that write to a run in a bucket counting it."""

from __future__ import annotations

import pytest

from embgeom_ray.io_utils import (
    S3_MAX_PARTS,
    S3_PART_BYTES,
    S3_PARTS_AT_ONCE,
    S3_PARTS_AT_ONCE_MAX,
    s3_part_bytes,
    s3_parts_at_once,
    upload_buffer_bytes,
)
from embgeom_ray.sizing.formulas import (
    Shape,
    driver_bytes,
    extractor_bytes,
    reducer_budget,
    reducer_bytes,
    reducers_for,
    shape_reducer_budget,
)

MiB, GiB = 2**20, 2**30


def test_an_upload_sends_more_parts_at_once_as_the_object_grows():
    """Four parts in flight up to 39 parts (the 1.18 GB reducer partition of docs/sizing.md: 23),
    one more for every 8 parts past that, sixteen from 128 parts (6.25 GiB) on: an 8B model's
    flush piece of 172 GiB, and a 70B model's of 747 GiB in its 77 MiB parts."""
    assert s3_parts_at_once(1) == s3_parts_at_once(int(1.18e9)) == S3_PARTS_AT_ONCE == 4
    assert s3_parts_at_once(39 * S3_PART_BYTES) == 4
    assert s3_parts_at_once(40 * S3_PART_BYTES) == 5
    assert s3_parts_at_once(127 * S3_PART_BYTES) == 15
    assert s3_parts_at_once(128 * S3_PART_BYTES) == S3_PARTS_AT_ONCE_MAX == 16
    assert s3_parts_at_once(172 * GiB) == s3_parts_at_once(int(747.2 * GiB)) == 16
    sizes = [2**k for k in range(20, 43)] + [S3_MAX_PARTS * S3_PART_BYTES + 1]
    at_once = [s3_parts_at_once(size) for size in sorted(sizes)]
    assert at_once == sorted(at_once)  # never fewer for a larger object


@pytest.mark.parametrize("url", ["s3://bucket/run", "s3a://bucket/run"])
def test_what_an_s3_upload_holds_beside_the_data(url):
    """Two copies of each part in flight (the part's bytes and the request's body; 0.44 GB
    measured beside a 1.18 GB object, docs/sizing.md), or two copies of an object small
    enough for one request; at most a quarter of a large object; never less for a larger one."""
    assert upload_buffer_bytes(url, 10 * MiB) == 20 * MiB  # one request: gathered, its body
    assert upload_buffer_bytes(url, 2 * S3_PART_BYTES - 1) == 4 * S3_PART_BYTES - 2
    assert upload_buffer_bytes(url, 2 * S3_PART_BYTES) == 4 * S3_PART_BYTES  # 2 parts
    assert upload_buffer_bytes(url, int(1.18e9)) == 8 * S3_PART_BYTES == 400 * MiB
    assert upload_buffer_bytes(url, 172 * GiB) == 32 * S3_PART_BYTES == 1600 * MiB
    part = s3_part_bytes(int(747.2 * GiB))
    assert part == 77 * MiB and upload_buffer_bytes(url, int(747.2 * GiB)) == 32 * part
    sizes = sorted([2**k + j for k in range(10, 43) for j in (-1, 0, 1)])
    held = [upload_buffer_bytes(url, size) for size in sizes]
    assert held == sorted(held)
    for size, u in zip(sizes, held, strict=True):
        assert u <= max(8 * S3_PART_BYTES, size // 4) or size < 2 * S3_PART_BYTES


def test_a_disk_holds_nothing_beside_and_other_stores_a_block():
    for url in ("/tmp/run", "file:///tmp/run", "run", ""):
        assert upload_buffer_bytes(url, 100 * GiB) == 0
    assert upload_buffer_bytes("gs://bucket/run", 10 * MiB) == 20 * MiB
    assert upload_buffer_bytes("gs://bucket/run", 100 * GiB) == 100 * MiB  # its block, twice


def test_a_run_in_a_bucket_counts_its_uploads_in_every_writers_memory():
    """The extractor, the reducers and the job's own process each count u of their largest
    object where the run is in S3, and nothing where it is on a disk: the 8B model's shape
    (docs/sizing.md), whose flush pieces go up sixteen parts at a time."""
    disk = Shape(layers=33, dim=4096, positions=512, vocab=128_256, sample_entries=8192,
                 weight_bytes=16 * GiB, dtype_bytes=2)  # fmt: skip
    bucket = Shape(**{**disk.__dict__, "store": "s3://bucket/run"})
    types, batch = 128_256, 1024
    assert disk.upload_bytes(GiB) == 0 and bucket.upload_bytes(GiB) == 8 * S3_PART_BYTES
    whole = bucket.statistics_bytes(bucket.vocab)
    assert whole > 128 * S3_PART_BYTES  # past 16 parts in flight
    for sigma in (None, 40 * GiB):
        for gpus in (0, 1):
            got = extractor_bytes(bucket, types, batch, sigma, gpus)
            assert got - extractor_bytes(disk, types, batch, sigma, gpus) == 1600 * MiB
    for count in (1, 4, 32):
        budget = reducer_budget(count, 33, 4096, types, 512)
        assert shape_reducer_budget(disk, count, types) == budget
        part = reducer_bytes(count, 33, 4096, types, 512)  # what it writes, at most
        u = shape_reducer_budget(bucket, count, types) - budget
        assert u == upload_buffer_bytes("s3://b/r", part) == 1600 * MiB
    # the fewest reducers within a cap counts u too: 8 of them fit it on a disk, not in S3
    cap = reducer_budget(8, 33, 4096, types, 512)
    assert reducers_for(cap, 33, 4096, types, 512) == 8
    assert reducers_for(cap, 33, 4096, types, 512, store="s3://b/r") > 8
    for in_process in (True, False):
        extra = driver_bytes(bucket, types, in_process) - driver_bytes(disk, types, in_process)
        assert extra > 0 and extra == bucket.upload_bytes(
            max(33 * types * 80, bucket.sample_bytes,
                bucket.statistics_bytes(types) if in_process else 0)
        )  # fmt: skip
