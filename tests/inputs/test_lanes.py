"""Forward lanes: batches run at once, folded in their order; the same statistics as one lane."""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import numpy as np
import pytest
import torch

from embgeom_ray.config import build_config
from embgeom_ray.inputs.corpus import CorpusSpec, plan_shards
from embgeom_ray.inputs.extractor import ShardProcessor
from embgeom_ray.inputs.lanes import in_lanes, intra_op_threads
from embgeom_ray.inputs.model_loading import resolve_identity
from embgeom_ray.sizing import lanes_for
from embgeom_ray.sizing.formulas import Shape, batch_bytes_per_token, shape_batch_bytes_per_token
from tests.conftest import write_jsonl


def test_items_are_finished_in_order_with_at_most_lanes_in_flight():
    rng = random.Random(0)
    delays = [rng.uniform(0, 0.004) for _ in range(60)]
    finished: list[tuple[int, int]] = []
    in_flight, most = [0], [0]
    lock = threading.Lock()
    threads = torch.get_num_threads()

    def work(i: int) -> int:
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        time.sleep(delays[i])  # later items often done first
        assert torch.is_inference_mode_enabled()
        assert torch.get_num_threads() == max(1, threads // 3)  # the threads shared out
        return i * i

    def finish(i: int, square: int) -> None:
        with lock:
            in_flight[0] -= 1
        finished.append((i, square))

    in_lanes(range(60), work, finish, lanes=3)
    assert finished == [(i, i * i) for i in range(60)]
    assert torch.get_num_threads() == threads  # and given back
    assert 2 <= most[0] <= 3


@pytest.mark.parametrize("where", ["work", "finish", "items"])
def test_the_first_error_stops_every_lane_and_is_raised(where):
    finished: list[int] = []

    def items():
        for i in range(40):
            if where == "items" and i == 7:
                raise ValueError("bad item 7")
            yield i

    def work(i: int) -> int:
        if where == "work" and i == 7:
            raise ValueError("bad item 7")
        time.sleep(0.001)
        return i

    def finish(i: int, _: int) -> None:
        if where == "finish" and i == 7:
            raise ValueError("bad item 7")
        finished.append(i)

    before = threading.active_count()
    with pytest.raises(ValueError, match="bad item 7"):
        in_lanes(items(), work, finish, lanes=4)
    # in order, and nothing from the failed item on (earlier ones still in a lane stop too)
    assert finished == list(range(len(finished))) and len(finished) <= 7
    if where == "finish":
        assert finished == list(range(7))
    assert threading.active_count() == before


def test_lanes_and_threads_options():
    assert lanes_for(None, 4) == 4
    assert lanes_for(2, 4) == 2
    assert lanes_for(8, 2) == 2  # a lane is one thread at least
    assert lanes_for(None, 1) == lanes_for(3, 1) == 1
    before = torch.get_num_threads()
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_each_lane_holds_its_own_batch_in_the_memory_formula():
    shape = Shape(layers=7, dim=384, positions=128, vocab=30_522, hidden_states=7,
                  intermediate=1_536, dtype_bytes=4)  # fmt: skip
    one = shape_batch_bytes_per_token(shape)
    assert one == batch_bytes_per_token(7, 384, 1_536, 4) == (7 * 384 + 3 * 1_536) * 4 + 64 * 384
    two = shape_batch_bytes_per_token(dataclasses.replace(shape, lanes=2))
    assert two - one == (7 * 384 + 3 * 1_536) * 4  # the fold's scratch once


def test_two_lanes_give_one_lanes_statistics_sample_and_counts_on_minilm(tmp_path, minilm_dir):
    """MiniLM over real English prose: the statistics, sample and counts of two lanes of one
    thread are one single-threaded lane's to the bit (the same forwards, folded in batch
    order). One thread in both: a forward on two may round otherwise on some CPUs."""
    from embgeom_ray.inputs.demo_corpus import python_docs_documents

    corpus = write_jsonl(tmp_path / "c.jsonl", [d[:1500] for d in python_docs_documents()[:24]])
    shard = plan_shards(CorpusSpec(corpus)).shards[0]
    identity, _ = resolve_identity(minilm_dir, None, False)
    results = {}
    for lanes in (1, 2):
        cfg = build_config(
            None,
            {"model": minilm_dir, "corpus": corpus, "out": str(tmp_path / "o"), "cpu_lanes": lanes,
             "batch_tokens": 1024, "max_length": 128, "sample_size": 512},
        )  # fmt: skip
        proc = ShardProcessor(cfg.extraction, [0, 3, 6], {"model_fingerprint": "lanes"})
        with intra_op_threads(lanes):  # one thread a lane
            assert proc.lanes() == lanes
            results[lanes] = proc.process(shard)
    (s1, q1, c1), (s2, q2, c2) = results[1], results[2]
    assert c1.batches > 4  # several batches in flight at once
    for name in ("documents", "windows", "batches", "tokens", "positions", "padded_tokens"):
        assert getattr(c1, name) == getattr(c2, name), name
    a, b = s1.state_dict(), s2.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    for layer in (0, 3, 6):
        p1, p2 = q1.points(layer), q2.points(layer)
        np.testing.assert_array_equal(p1.keys, p2.keys)
        np.testing.assert_array_equal(p1.vectors, p2.vectors)
    assert identity.hidden_size == 384 and s1.layer(6).counts.sum() == c1.tokens
