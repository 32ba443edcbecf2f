"""The checkpoint interval sized to the state and the storage (embgeom_ray/sizing/checkpoints.py):
writing checkpoints takes at most its share of the extraction, from measured bytes and
bandwidth, within the floor and the ceiling."""

from __future__ import annotations

import pytest

from embgeom_ray.sizing.checkpoints import (
    CEILING_S,
    EXTRACTORS,
    FLOOR_S,
    IO_SHARE,
    Pacer,
    describe_plan,
    flush_due,
    interval_for,
    write_share,
)

GiB = 2**30


def test_the_interval_keeps_writing_within_its_share():
    # 32 extractors flushing 61 GiB each to storage that takes 10 GiB/s: 195 s a round of
    # writes; 5% of the extraction is 3,904 s: above the ceiling, which wins
    assert interval_for(61 * GiB, 32, 10 * GiB) == CEILING_S
    assert write_share(61 * GiB, 32, 10 * GiB, CEILING_S) == pytest.approx(0.0542, abs=1e-4)
    # 4 extractors of 2 GiB at 1 GiB/s: 8 s of writes a round, every 160 s
    t = interval_for(2 * GiB, 4, GiB)
    assert t == pytest.approx(160.0) and write_share(2 * GiB, 4, GiB, t) == pytest.approx(IO_SHARE)
    assert interval_for(1 << 20, 1, GiB) == FLOOR_S  # small flushes: the floor
    assert interval_for(GiB, 1, 0.0) == CEILING_S  # no bandwidth: the fewest checkpoints


def extraction_writing(shard_s: float, write_s: float, interval: float, shards: int = 400) -> float:
    """An extractor's shards of ``shard_s`` seconds each, flushed by :func:`flush_due` under
    the sized interval's ceiling, each flush ``write_s`` seconds of writing: the seconds it
    wrote over the seconds it folded, its last flush (the queue drained) left out."""
    age, wrote = 0.0, 0.0
    for _ in range(1, shards):
        age += shard_s
        if flush_due(age, interval, ceiling=CEILING_S, shard_mean=shard_s):
            wrote, age = wrote + write_s, 0.0
    return wrote / ((shards - 1) * shard_s)


def test_shards_of_the_model_let_the_interval_set_the_flushes():
    """docs/sizing.md's plans at 1 GiB/s a writer, each extractor writing its own flush of B
    (a full tier and the sample): the 70B's flushes take 767 s and the rule's interval is the
    1 h ceiling (21%); on shards of 16 MiB (≈ 2,000 s of its extractor) one more shard always
    passes the ceiling, so every shard ends in a flush and writing takes ≈ 38% of the
    extraction; on its default shards of 1.6 MiB (≈ 200 s) the flushes come within a shard of
    the interval. The 8B (176 s a flush, T = 3,525 s) on its 16 MiB shards (≈ 200 s) keeps
    to 5%."""
    b70, b8 = 767.4 * GiB, 176.2 * GiB
    t70, t8 = interval_for(b70, 8, GiB, writers=EXTRACTORS), interval_for(b8, 32, GiB, writers=EXTRACTORS)
    assert t70 == CEILING_S and t8 == pytest.approx(3_525, abs=2)
    stated70 = write_share(b70, 8, GiB, t70, writers=EXTRACTORS)
    assert stated70 == pytest.approx(0.213, abs=1e-3)
    assert extraction_writing(2_000, b70 / GiB, t70) == pytest.approx(0.384, abs=1e-3)
    assert extraction_writing(200, b70 / GiB, t70) == pytest.approx(stated70, rel=0.01)
    assert extraction_writing(200, b8 / GiB, t8) <= 0.05 + 1e-9
    # a shard under half the ceiling and the interval: the interval alone sets the flushes
    assert not flush_due(3_000, 3_600, ceiling=CEILING_S, shard_mean=500)
    assert flush_due(3_000, 3_600, ceiling=CEILING_S, shard_mean=700)
    assert not flush_due(3_000, 3_600, shard_mean=700)  # a given interval: no ceiling rule
    assert flush_due(10, 3_600, drained=True) and flush_due(10, 3_600, over_budget=True)


def test_the_pacer_measures_before_it_decides():
    pacer = Pacer()
    assert pacer.interval(4) == FLOOR_S and "until a flush has measured" in pacer.reason()
    pacer.wrote(2 * GiB, 1.5)
    pacer.wrote(2 * GiB, 2.5)  # 4 GiB in 4 s: 1 GiB/s, 2 GiB a flush
    assert pacer.bandwidth == pytest.approx(GiB) and pacer.flush_bytes == pytest.approx(2 * GiB)
    assert pacer.interval(4) == pytest.approx(160.0)
    assert pacer.interval(8) == pytest.approx(320.0)  # the pool grew: twice the writes
    assert pacer.reason().startswith("320 s: 8 extractor(s) × 2.0 GiB a flush at 1.0 GiB/s")
    record = pacer.to_json(extract_s=400.0)
    assert record["interval_s"] == pytest.approx(320.0) and record["flushes"] == 2
    assert record["write_share"] == pytest.approx(4.0 / 400.0)
    # an interval given is kept as it is
    given = Pacer(300.0)
    given.wrote(100 * GiB, 1.0)
    assert given.interval(32) == 300.0 and given.reason() == "300 s (--checkpoint-interval)"


def test_the_plan_says_the_rule_and_what_one_node_loses():
    lines = describe_plan(int(65.2 * GiB), 32, 8, None)
    assert lines[0].startswith("checkpoints: every T = N · B / (5% · W) s within [60 s, 3600 s]")
    assert "T = 3,600 s at 1 GiB/s" in lines[0]
    # the last flush of each extractor, whatever T: 65.2 GiB at 1 GiB/s
    assert lines[1].startswith("  and each extractor's last flush, when the queue drains")
    assert lines[1].endswith("B / W = 65 s at 1 GiB/s, once a run")
    assert lines[2].startswith("  a node lost loses at most its 8 extractor(s)' last 3,600 s of "
                               "shards, or one shard each, where a shard takes longer")
    assert lines[2].endswith(": 8.00 extractor-hours redone")
    given = describe_plan(GiB, 2, 1, 300.0)
    assert given[0].startswith("checkpoints: every 300 s (--checkpoint-interval): writing them takes")
    # a given interval is not shortened for the shards: the oldest may age to T and a shard
    assert "last 300 s of shards, and the shard each was folding past it" in given[2]


def test_where_each_extractor_writes_its_own_flushes_the_share_is_its_own():
    """In object storage each extractor writes its own flushes (N writers at once), so the
    interval is B / (share · W) whatever N: the 8B model's 65.2 GiB flushes at 1 GiB/s a
    writer every 1,304 s keep writing at 5% of each extractor's time, where one writer for
    all 32 would need 11.6 GiB/s for that at the ceiling."""
    from embgeom_ray.sizing.checkpoints import EXTRACTORS, writers_for

    assert writers_for("s3://bucket/run") == EXTRACTORS and writers_for("gs://b/r") == EXTRACTORS
    b = 65.2 * GiB
    t = interval_for(b, 32, GiB, writers=EXTRACTORS)
    assert t == pytest.approx(b / (IO_SHARE * GiB)) == pytest.approx(1304.0)
    assert write_share(b, 32, GiB, t, EXTRACTORS) == pytest.approx(IO_SHARE)
    assert interval_for(b, 32, GiB) == CEILING_S  # one writer for all: the ceiling binds
    assert write_share(b, 32, GiB, CEILING_S) == pytest.approx(0.58, abs=0.01)
    # the pacer: each writer's own seconds; the pool's size does not change the interval
    pacer = Pacer(writers=EXTRACTORS)
    pacer.wrote(2 * GiB, 3.0)  # two extractors, 2 GiB each in 3 s and 5 s: 0.5 GiB/s a writer
    pacer.wrote(2 * GiB, 5.0)
    assert pacer.interval(2) == pytest.approx(80.0) == pacer.interval(8)
    assert "a writer (8 extractor(s) writing their own)" in pacer.reason()
    record = pacer.to_json(extract_s=400.0)
    # 8 s of writes spread over the 8 writers there were at most, of 400 s
    assert record["writers"] == EXTRACTORS and record["write_share"] == pytest.approx(8 / 400 / 8)
    lines = describe_plan(int(b), 32, 8, None, EXTRACTORS)
    assert lines[0].startswith("checkpoints: every T = B / (5% · W) s (W: one writer's) within")
    assert "T = 1,304 s at 1 GiB/s a writer (5%)" in lines[0]
    assert lines[-1].startswith("  written by each extractor (32 writers at once")


def test_on_a_local_path_the_extractors_write_where_every_node_sees_it(tmp_path):
    """A local ``--out``: each extractor reads back the marker the driver wrote
    (embgeom_ray/shared_out.py). Every extractor sees it (a shared filesystem, or one node):
    each writes its own flushes; one does not: the driver writes them, one line saying which
    node and why, and the interval is the driver's rule."""
    from embgeom_ray.shared_out import MARKER_PREFIX, remove_marker, unseen, write_marker
    from embgeom_ray.sizing.checkpoints import DRIVER, EXTRACTORS, decide_writers, needs_check

    assert needs_check("/data/runs/x") and needs_check("file:///data/x")
    assert not needs_check("s3://bucket/run")
    assert decide_writers("s3://bucket/run") == (EXTRACTORS, "object storage")
    marker = write_marker(str(tmp_path / "run" / "groups"))
    path = tmp_path / "run" / "groups" / (MARKER_PREFIX + marker["nonce"])
    assert marker["path"] == str(path) and path.read_text() == marker["nonce"]
    assert unseen(marker) is None  # this process, the driver's node
    # another disk at the same path: the file is not there, or holds another nonce
    missing = unseen(marker | {"path": str(tmp_path / "elsewhere" / path.name)})
    assert missing == f"no {path.name} in {tmp_path / 'elsewhere'}"
    assert "differs from the job's" in unseen(marker | {"nonce": "0" * 32})
    who, why = decide_writers("/shared/run")
    assert who == EXTRACTORS and why.startswith("every extractor's node sees /shared/run")
    who, why = decide_writers("/shared/run", [("0123456789abcdef", missing)])
    assert who == DRIVER
    assert why == f"the extractor on node 01234567 does not see /shared/run ({missing}): not a filesystem its nodes share"
    remove_marker(marker)
    assert not path.exists() and unseen(marker).startswith("no ")
    remove_marker(marker)  # gone already: nothing to do

    pacer = Pacer(writers=EXTRACTORS)
    pacer.wrote(2 * GiB, 4.0)
    assert pacer.interval(4) == pytest.approx(80.0)  # B / (5% · W): 2 GiB at 0.5 GiB/s
    pacer.fall_back(why)
    assert pacer.interval(4) == pytest.approx(320.0)  # N · B / (5% · W): the driver alone
    assert pacer.writers_line() == f"written by this process ({why})"
    assert pacer.to_json()["writers"] == DRIVER and pacer.to_json()["writers_reason"] == why
    lines = describe_plan(int(65.2 * GiB), 32, 8, None, EXTRACTORS, checked=True)
    assert lines[-1].startswith("  written by each extractor (32 writers at once) where every")
    assert lines[-1].endswith("else by the job's own process alone: T = N · B / (5% · W) = 3,600 s at 1 GiB/s (58%)")


def test_the_last_flushes_are_stated_apart_from_the_share_the_interval_holds():
    """Each extractor's last flush, when the queue drains, is the reduce's input: written
    whatever T is. The manifest states the share of the flushes before it (the one T holds to
    5%) apart from the share of all: for one extractor whose two flushes took 3 s each over an
    extraction of 100 s, 3% before the drain and 6% in all."""
    pacer = Pacer(writers="extractors")
    pacer.interval(1)
    pacer.wrote(GiB, 3.0)
    pacer.wrote(GiB, 3.0, last=True)
    record = pacer.to_json(extract_s=100.0)
    assert (record["flushes"], record["last_flushes"], record["last_write_s"]) == (2, 1, 3.0)
    assert record["write_share"] == pytest.approx(0.06)
    assert record["write_share_before_drain"] == pytest.approx(0.03)


def test_flushes_the_statistics_budget_forces_are_measured_and_said():
    """Where an extractor's statistics budget fills before the interval, the budget sets the
    flushes: each extractor writing its own 2 GiB flush at 1 GiB/s (2 s) every 20 s spends
    10% of its time writing, whatever T says. The pacer measures t_σ on the flushes the
    budget forced (not the last ones), says so once, again only when the share doubles or
    halves, and never where the budget fills after the interval."""
    from embgeom_ray.sizing.checkpoints import EXTRACTORS

    pacer = Pacer(writers=EXTRACTORS)
    assert pacer.budget_news() is None and pacer.budget_fill is None
    pacer.interval(4)  # the floor, 60 s, until a flush measures the storage
    pacer.wrote(2 * GiB, 2.0, budget_fill_s=18.0)
    pacer.wrote(2 * GiB, 2.0, budget_fill_s=22.0)
    pacer.wrote(2 * GiB, 2.0, last=True, budget_fill_s=5.0)  # the last flush: not counted
    assert pacer.budget_fill == pytest.approx(20.0) and pacer.budget_flushes == 2
    assert pacer.budget_share() == pytest.approx(2.0 / 20.0)
    line = pacer.budget_news()
    assert line.startswith("checkpoints: the extractors' statistics budget (--statistics-memory) "
                           "filled in 20 s on average over 2 flush(es), before the 60 s interval")
    assert "2.0 GiB a flush, so writing takes ~10% of each extractor's time" in line
    assert "above the 5% the interval aims at" in line
    assert pacer.budget_news() is None  # said once
    pacer.wrote(2 * GiB, 2.0, budget_fill_s=20.0)
    assert pacer.budget_news() is None  # the same pace
    for _ in range(6):  # the budget now fills in 2 s: the share more than doubles
        pacer.wrote(2 * GiB, 2.0, budget_fill_s=2.0)
    assert pacer.budget_fill == pytest.approx(72.0 / 9)
    assert "~25% of each extractor's time" in pacer.budget_news()
    record = pacer.to_json(extract_s=100.0)
    assert record["budget_flushes"] == 9 and record["budget_fill_s"] == pytest.approx(8.0)
    assert record["budget_write_share"] == pytest.approx(0.25)
    # the driver writing every flush: N · B_σ / (W · t_σ)
    driver = Pacer()
    driver.interval(4)
    driver.wrote(GiB, 1.0, budget_fill_s=40.0)
    assert driver.budget_share() == pytest.approx(4 * 1.0 / 40.0)
    assert "10% of the extraction's time" in driver.budget_news()
    # a budget that fills after the interval: the interval sets the flushes, nothing said
    slow = Pacer(30.0)
    slow.interval(1)
    slow.wrote(GiB, 1.0, budget_fill_s=45.0)
    assert slow.budget_news() is None and slow.to_json()["budget_flushes"] == 1
    assert Pacer().to_json()["budget_fill_s"] is None


def test_the_plan_says_when_the_statistics_budget_may_set_the_flushes():
    """The 8B model of docs/sizing.md: σ = 44.6 GiB beside F = 4.3 GiB holds ~20,000 types'
    rows of 8·33·(2·4,096 + 2) + 8 bytes, of the 128,256 the run may see; the plan says the
    budget may then set the flushes. Where σ holds every type, nothing is said."""
    from embgeom_ray.sizing.checkpoints import EXTRACTORS, BudgetShape

    row = 8 * 33 * (2 * 4096 + 2) + 8
    budget = BudgetShape(int(44.6 * GiB), row, int(4.3 * GiB), 128_256)
    assert budget.types_held == (int(44.6 * GiB) - int(4.3 * GiB)) // row == 20_003
    lines = describe_plan(int(65.2 * GiB), 32, 8, None, EXTRACTORS, budget=budget)
    said = [line for line in lines if "statistics budget" in line]
    assert len(said) == 1
    assert said[0].startswith("  the statistics budget σ = 44.6 GiB holds the rows of ~20,003 "
                              "types (2 MiB a type, beside F) of the ≤ 128,256 the run may see")
    assert "B / (W · t_σ) of its time, over 5% wherever it fills in less than T (1,304 s at " \
           "1 GiB/s a writer)" in said[0]
    roomy = BudgetShape(int(44.6 * GiB), row, int(4.3 * GiB), 20_000)
    assert not any("statistics budget" in line
                   for line in describe_plan(int(65.2 * GiB), 32, 8, None, budget=roomy))


def test_shards_longer_than_the_interval_are_measured_and_said():
    """An extractor decides to flush only between shards. Where a shard takes at least the
    interval, it flushes after every shard and a failure loses up to a shard, however short
    the interval: the pacer measures the shards, says so once the interval is measured (not
    against the floor that comes before), names a --shard-bytes that would fit, says it again
    only when the shards' mean doubles or halves, and records the longest unflushed work."""
    from embgeom_ray.sizing.checkpoints import EXTRACTORS

    pacer = Pacer(writers=EXTRACTORS)
    pacer.shard_bytes = 256 * 2**20
    pacer.interval(8)  # the floor, before any flush
    pacer.folded(90.0)
    assert pacer.shard_news() is None  # the floor is not yet the interval
    pacer.wrote(GiB, 1.0, age_s=91.0)  # 1 GiB at 1 GiB/s a writer: T = 20 s → the floor
    assert pacer.interval(8) == FLOOR_S
    pacer.folded(110.0)
    line = pacer.shard_news()
    assert line.startswith("checkpoints: a shard takes 100 s on average (the longest 110 s), at "
                           "least the 60 s interval: an extractor flushes only between shards, "
                           "so each flushes after every shard")
    # shards of half the interval: 256 MiB × 60 s / (2 × 100 s)
    assert f"--shard-bytes {int(256 * 2**20 * 0.3)} (77 MiB, shards of ~half the interval)" in line
    assert pacer.shard_news() is None  # said once
    pacer.folded(300.0)  # the mean, 166.7 s, not yet twice 100 s
    assert pacer.shard_news() is None
    for _ in range(3):
        pacer.folded(400.0)
    assert "a shard takes 283 s on average (the longest 400 s)" in pacer.shard_news()
    pacer.wrote(GiB, 1.0, age_s=400.5)
    record = pacer.to_json()
    assert (record["shards_timed"], record["shard_s_max"]) == (6, 400.0)
    assert record["shard_s_mean"] == pytest.approx(1700.0 / 6, abs=1e-3)
    assert record["unflushed_s_max"] == 400.5
    # shards shorter than the interval: nothing said
    short = Pacer(300.0)
    short.folded(120.0)
    assert short.shard_news() is None and short.to_json()["shard_s_mean"] == 120.0
    # a given interval is compared at once, and without the plan's shard size no hint
    given = Pacer(30.0)
    given.folded(45.0)
    assert given.shard_news().endswith("loses up to a shard of each of its extractors' work")
    assert Pacer().to_json()["shard_s_mean"] is None
    # --checkpoint-interval 0 asks for a flush after every shard: nothing to say of it
    every = Pacer(0.0)
    every.shard_bytes = 2**20
    every.folded(0.2)
    assert every.shard_news() is None
