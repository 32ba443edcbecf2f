"""A run's peaks against what it was sized for (embgeom_ray/sizing/peaks.py): the line printed
when a run ends and the report's "peak memory" row, from the manifest alone."""

from __future__ import annotations

from embgeom_ray.config import build_config
from embgeom_ray.sizing import Cluster, Node, Shape, size_reduce
from embgeom_ray.sizing.peaks import describe_peaks, peaks

MiB, GiB = 2**20, 2**30


def manifest(extractor: int, reducers: list[int]) -> dict:
    """What the llama128k run of the trial recorded (V = 128,256, d = 256, L = 5; 45,759
    types seen), with the peaks given."""
    return {
        "memory": {"driver_start_private_bytes": 231_116_800,
                   "driver_peak_private_bytes": 518_012_928,
                   "extractor_peak_private_bytes": extractor,
                   "reducer_peak_private_bytes": reducers},
        "workers": {"memory_bytes": 6_461_959_328},
        "sizing": {"driver_bytes": 603_602_944,
                   "reduce": {"count": 1, "memory": 3_372_288_488, "driver": 570_000_000}},
    }  # fmt: skip


def test_each_peak_against_its_budget():
    """The job's own process above its start against its figure for the reduce it did (not the
    plan's, at the bound), the extractor against what it asked Ray for, the largest reducer
    against its budget for the types seen; over a budget, the option to turn."""
    m = manifest(2_479_087_616, [2_136_924_160])
    found = {p.process: p for p in peaks(m)}
    assert found["job's own process"].peak == 518_012_928 - 231_116_800
    assert found["job's own process"].budget == 570_000_000  # sizing.reduce.driver
    assert round(found["extractor"].share, 3) == round(2_479_087_616 / 6_461_959_328, 3) == 0.384
    assert describe_peaks(m) == (
        "memory, peak private: job's own process 274 MiB of 544 MiB above its start (50%); "
        "extractor 2.3 GiB of 6.0 GiB asked of Ray (38%); reducer (largest) 2.0 GiB of 3.1 GiB "
        "asked of Ray (63%)"
    )
    over = describe_peaks(manifest(7 * GiB, [1 * GiB, 4 * GiB]))
    assert "extractor 7.0 GiB of 6.0 GiB asked of Ray (116%; over its budget: give more --worker-memory)" in over
    assert "reducer (largest) 4.0 GiB of 3.1 GiB asked of Ray (127%; over its budget: give more --reducer-memory)" in over
    assert describe_peaks({"memory": {}}) is None


def test_the_reduce_records_the_drivers_figure_for_the_types_it_reduces():
    """size_reduce records the job's own process's figure for the types seen: in the process,
    512 MiB + 3 · (S(V) + F) + V rows of 160 B + the sample; on reducers, the dims rows in place
    of the statistics."""
    opts = build_config(None, {"model": "m", "corpus": "c", "out": "o"}).scheduling
    shape = Shape(layers=7, dim=384, positions=128, vocab=30_522, sample_entries=0)
    cluster = Cluster((Node("h", 16 * GiB, cpus=2, head=True),))
    state = 8 * (7 * 2839 * (2 * 384 + 2) + 2839) + 8 * 7 * (384**2 + 3 * 384 + 128 * 385 + 2)
    small = size_reduce(shape, 2839, cluster, opts)
    assert not small.partitioned and small.driver == 512 * MiB + 3 * state + 2839 * 160
    large = size_reduce(shape, 30_522, cluster, opts)
    assert large.partitioned and large.driver == 512 * MiB + 7 * 384 * 160 + 30_522 * 160


def test_the_reports_peak_memory_row_sets_the_peaks_against_the_budgets():
    """The report's "peak memory" says what the run's last line says; a manifest without the
    driver's start (an older run) keeps the peaks alone."""
    from embgeom_ray.report.html import _peak_memory

    m = manifest(2_479_087_616, [2_136_924_160])
    assert _peak_memory(m["memory"], m) == describe_peaks(m).removeprefix("memory, peak private: ")
    del m["memory"]["driver_start_private_bytes"]
    assert _peak_memory(m["memory"], m).startswith("job 494.0 MiB private, extractor 2.3 GiB private")
