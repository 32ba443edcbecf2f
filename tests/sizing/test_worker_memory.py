"""An extractor's memory bounds (``--worker-memory``, ``--statistics-memory``) and the
statistics' size formula."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
import torch

from embgeom_ray.config import build_config
from embgeom_ray.core.statistics import EmbeddingStatistics, state_bytes
from embgeom_ray.errors import ConfigError


@pytest.mark.parametrize("clip", [None, [1, 3]])
def test_state_bytes_is_the_arrays_and_nbytes_what_is_allocated(clip):
    rng = np.random.default_rng(0)
    stats = EmbeddingStatistics([0, 2, 3], 5, max_positions=8, clip_dims=clip, initial_types=4)
    sizes = []
    for vocab in (6, 40, 200):
        h = rng.normal(size=(3, 6, 8, 5))
        ids = rng.integers(0, vocab, size=(6, 8))
        stats.update(
            torch.as_tensor(h), torch.as_tensor(ids), torch.as_tensor(np.ones((6, 8), bool))
        )
        arrays = sum(a.nbytes for a in stats.state_dict().values())
        formula = state_bytes(3, 5, stats.num_types, 8, clip=len(clip or []))
        assert arrays == formula
        # allocated: at least the arrays, at most twice the per-type rows (doubling) + scratch
        assert formula <= stats.nbytes()
        sizes.append(stats.nbytes())
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0]  # grows with the types seen


def test_a_budget_below_the_fixed_state_is_refused():
    """``--statistics-memory`` must exceed the fixed per-layer state; ``--worker-memory`` must
    hold an extractor whose statistics hold that much (the fixed state, once more serialised,
    beside the process's own share): both refused before any work, with what it takes."""
    from embgeom_ray.sizing import (
        Cluster,
        Node,
        Shape,
        cpu_batch_tokens,
        extractor_bytes,
        size_extractors,
    )

    shape = Shape(layers=7, dim=384, positions=128, vocab=30_522, weight_bytes=90 * 2**20)
    cluster = Cluster((Node("n", 64 * 2**30, cpus=4, head=True),))
    opts = {"model": "m", "corpus": "c", "out": "o", "max_length": 128, "device": "cpu"}

    def size(**extra):
        return size_extractors(shape, 30_522, cluster, build_config(None, opts | extra).scheduling,
                               num_shards=4, driver=0)  # fmt: skip

    fixed = state_bytes(7, 384, 0, 128)
    with pytest.raises(ConfigError, match=f"{fixed:,} bytes"):
        size(statistics_memory="1KiB")
    assert size(statistics_memory=fixed + 1).statistics == fixed + 1
    batch = cpu_batch_tokens(shape)  # MiniLM's shape: 5,120 tokens a CPU batch
    assert batch == 5120
    # the node's 4 CPUs make one extractor of 4 lanes, each holding a batch
    least = extractor_bytes(dataclasses.replace(shape, lanes=4), 30_522, batch, fixed + 1)
    with pytest.raises(ConfigError, match=f"--worker-memory {least - 1:,} bytes cannot hold"):
        size(worker_memory=least - 1)
    pool = size(worker_memory=least)
    assert pool.memory == least and pool.statistics is not None and pool.statistics > fixed
    with pytest.raises(ConfigError):
        build_config(None, {"model": "m", "corpus": "c", "out": "o", "worker_memory": "lots"})


@pytest.mark.slow
def test_a_worker_at_its_budget_spills_and_flushes_and_the_tables_hold(
    tmp_path, ray_local, capsys
):
    from tests.runs.test_job_end_to_end import english_documents, run_job
    from tests.tiny_models import make_tiny_bert

    model_dir = make_tiny_bert(str(tmp_path / "model"))
    docs = english_documents(16, 500)
    opts = {"max_length": 32, "shard_bytes": 1024, "comoment_precision": "float64",
            "sample_size": 64, "num_workers": 1, "checkpoint_interval": 3600}  # fmt: skip
    free, t_free = run_job(tmp_path, model_dir, docs, "free", "c.jsonl", **opts)
    # the fixed state of 3 layers of d = 32 with 32 positions, plus a few types' worth
    budget = state_bytes(3, 32, 8, 32)
    bound, t_bound = run_job(tmp_path, model_dir, docs, "bound", "c.jsonl",
                             statistics_memory=budget, **opts)  # fmt: skip
    shards = bound["shards"]["computed"]
    assert shards > 2
    assert free["shards"]["checkpoint_groups"] == 1  # one flush when the queue drained
    assert bound["shards"]["checkpoint_groups"] == shards  # every shard passes the budget
    assert bound["workers"]["budget_flushes"] == shards
    assert free["workers"]["budget_flushes"] == 0 and free["workers"]["spills"] == 0
    # within each shard the statistics were spilled at every batch past the budget
    assert bound["workers"]["spills"] >= shards
    # the budget, not the hour's interval, set the flushes: measured (the last flush, when the
    # queue drained, stated apart) and said
    paced = bound["sizing"]["checkpoints"]
    assert paced["budget_flushes"] == shards - 1 and paced["last_flushes"] == 1
    assert 0 < paced["budget_fill_s"] < 3600 and paced["budget_write_share"] > 0
    assert free["sizing"]["checkpoints"]["budget_flushes"] == 0
    # every shard timed; the work held unflushed at most: a shard under the budget (a flush
    # after each), every shard in the free run (one flush, at the drain)
    free_paced = free["sizing"]["checkpoints"]
    assert paced["shards_timed"] == shards == free_paced["shards_timed"]
    assert 0 < paced["shard_s_mean"] <= paced["shard_s_max"]
    assert paced["shard_s_max"] <= paced["unflushed_s_max"] < paced["shard_s_max"] + 5.0
    # (the manifest's seconds are rounded to the millisecond)
    assert free_paced["unflushed_s_max"] >= shards * (free_paced["shard_s_mean"] - 5e-4)
    err = capsys.readouterr().err
    assert "checkpoints: the extractors' statistics budget (--statistics-memory) filled in " in err
    assert "before the 3,600 s interval: each extractor flushes whenever it fills" in err
    for name in ("type_stats", "layers", "dims", "positions"):
        pd.testing.assert_frame_equal(t_free[name], t_bound[name], check_exact=False, rtol=1e-9)
    # a host tier: the same spills merged on the host (--host-statistics-memory), so the
    # flushes come when the tier fills, not at every shard, and write each type once a flush
    host = state_bytes(3, 32, 4 * free["sizing"]["reduce"]["types"], 32)  # never fills
    tier, t_tier = run_job(tmp_path, model_dir, docs, "tier", "c.jsonl", statistics_memory=budget,
                           host_statistics_memory=host, **opts)  # fmt: skip
    assert tier["workers"]["host_merges"] >= bound["workers"]["spills"]
    assert tier["workers"]["spills"] == 0  # nothing went to the object store
    assert tier["shards"]["checkpoint_groups"] == 1  # one flush, when the queue drained
    written = {m: m_["sizing"]["checkpoints"]["bytes_written"] for m, m_ in
               (("bound", bound), ("tier", tier), ("free", free))}  # fmt: skip
    assert written["tier"] < written["bound"] / 2, written
    assert written["tier"] == pytest.approx(written["free"], rel=0.05), written  # one group
    for name in ("type_stats", "layers", "dims", "positions"):
        pd.testing.assert_frame_equal(t_free[name], t_tier[name], check_exact=False, rtol=1e-9)
