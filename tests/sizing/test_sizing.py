"""The job sizes itself (embgeom_ray/sizing.py): every process's memory and count from the
model's shape, the corpus and the cluster, by the documented policy; explicit options win;
what cannot fit is refused before any work, naming the option that fixes it.

The expected numbers are computed here from the formulas of docs/sizing.md, written out
(8-byte numbers: per-type rows 8·L·V·(2d+2) + 8V, per-layer state 8·L·(d² + 3d + P(d+1) + 2)),
not from the module's own helpers.
"""

from __future__ import annotations

import math

import pytest

from embgeom_ray.config import build_config
from embgeom_ray.errors import ConfigError
from embgeom_ray.sizing import (
    Cluster,
    CorpusShape,
    Node,
    NodeGroup,
    Shape,
    place,
    size_extractors,
    size_job,
    size_reduce,
    size_reducers,
    types_bound,
)

GiB, MiB = 2**30, 2**20
BASE = 512 * MiB  # a reducer's own


def rows(layers: int, d: int, types: int) -> int:
    return 8 * (layers * types * (2 * d + 2) + types)


def layer_state(layers: int, d: int, positions: int) -> int:
    return 8 * layers * (d * d + 3 * d + positions * (d + 1) + 2)


def reducer_need(r: int, layers: int, d: int, types: int, positions: int) -> int:
    held = rows(layers, d, -(-types // r)) + layer_state(-(-layers // r), d, positions)
    return BASE + 3 * held


def options(**extra):
    return build_config(None, {"model": "m", "corpus": "c", "out": "o"} | extra).scheduling


#: an 8B Llama-class model measured in every hidden state: L = 33, d = 4096, P = 128
LLAMA_8B = Shape(
    layers=33, dim=4096, positions=128, vocab=128_256, hidden_states=33, intermediate=14_336,
    heads=32, weight_bytes=16 * 10**9, dtype_bytes=2, sample_entries=512, name="8B",
)  # fmt: skip
V_SEEN = 66_000


def test_the_formulas():
    s = Shape(layers=5, dim=256, positions=128, vocab=128_256, clip=0, sample_entries=8192)
    assert s.type_bytes(1000) == 8 * 5 * 1000 * 514 + 8 * 1000
    assert s.layer_state_bytes() == 8 * 5 * (256**2 + 3 * 256 + 128 * 257 + 2)
    assert s.statistics_bytes(1000) == s.type_bytes(1000) + s.layer_state_bytes()
    assert s.row_bytes == 8 * 5 * 514 + 8
    assert s.sample_bytes == 4 * 5 * 8192 * 256 + 48 * 8192
    clipped = Shape(layers=5, dim=256, positions=128, vocab=10, clip=3)
    assert clipped.type_bytes(1000) == s.type_bytes(1000) + 8 * 5 * 1000 * 256
    # the example: 8B over web text, 8·L·V·(2d+2) ≈ 133 GiB
    assert LLAMA_8B.type_bytes(V_SEEN) / GiB == pytest.approx(133.0, abs=0.05)


def test_cpu_batches_keep_a_layers_largest_tensor_within_32_mib():
    """max(d_ff, d)·b bytes a token, 32 MiB / that rounded down to 1,024s, 1,024..8,192, in
    one lane or several; a CPU pool gets it where --batch-tokens is not given."""
    from embgeom_ray.sizing import cpu_batch_tokens

    minilm = Shape(layers=7, dim=384, positions=128, vocab=30_522, hidden_states=7,
                   intermediate=1536, heads=12, weight_bytes=90 * MiB)  # fmt: skip
    assert cpu_batch_tokens(minilm) == 5120 == (32 * MiB) // (1536 * 4) // 1024 * 1024
    bert_base = Shape(**{**minilm.__dict__, "dim": 768, "intermediate": 3072})
    assert cpu_batch_tokens(bert_base) == 2048  # 2,730
    assert cpu_batch_tokens(Shape(**{**minilm.__dict__, "dtype_bytes": 2})) == 8192  # 10,922
    assert cpu_batch_tokens(LLAMA_8B) == 1024  # 14,336 · 2 bytes a token: 1,170
    wide = Shape(**{**minilm.__dict__, "dim": 16_384, "intermediate": 0})  # 4d: 256 KiB
    assert cpu_batch_tokens(wide) == 1024  # 128, raised to the least
    roomy = Cluster((Node("h", 16 * GiB, cpus=2, head=True),))
    assert cpu_batch_tokens(Shape(**{**minilm.__dict__, "lanes": 2})) == 5120
    pool = size_extractors(minilm, 30_522, roomy, options(device="cpu"), 4, driver=GiB)
    assert pool.batch_tokens == 5120
    assert "6,144 B a token, within glibc's 32 MiB" in pool.batch_reason  # what --plan prints
    given = size_extractors(minilm, 30_522, roomy, options(device="cpu", batch_tokens=640), 4, GiB)
    assert (given.batch_tokens, given.batch_reason) == (640, "--batch-tokens")


def test_the_types_seen_are_bounded_by_the_vocabulary_and_the_plain_text():
    assert types_bound(30_522, None)[0] == 30_522  # compressed or Parquet: the vocabulary
    assert types_bound(30_522, 10**9)[0] == 30_522
    bound, why = types_bound(30_522, 1000)
    assert bound == 1001 and "1,000 bytes" in why  # one type a byte, and a SentencePiece ▁
    assert types_bound(30_522, 1000, special=5)[0] == 1006  # --keep-special: its ids too


def test_small_statistics_are_reduced_in_the_jobs_own_process():
    small = Shape(layers=7, dim=384, positions=128, vocab=30_522)
    cluster = Cluster((Node("h", 16 * GiB, cpus=2, head=True),))
    reduce = size_reducers(small, 300, cluster, options(), driver=0)
    assert not reduce.partitioned and "within its 1.0 GiB" in reduce.reason


def test_reducers_follow_the_policy_on_nodes_of_different_memory():
    """Self-sized: the fewest reducers each needing at most half the largest node's offer,
    that the nodes hold together, at least one on each node that can hold one; placed one at
    a time where most memory is left (a worker before the head at equal room)."""
    nodes = (
        Node("head", 16 * GiB, cpus=8, head=True),
        *(Node(f"big-{i}", 160 * GiB, cpus=32) for i in range(4)),
        Node("small", 32 * GiB, cpus=8),
    )
    cluster = Cluster(nodes)
    reduce = size_reducers(LLAMA_8B, V_SEEN, cluster, options(), driver=4 * GiB)
    cap = 80 * GiB  # half the largest node's 160 GiB
    offers = [12 * GiB, *[160 * GiB] * 4, 32 * GiB]  # the head less the job's own 4 GiB
    r = reduce.count

    def allowed(k: int) -> bool:
        need = reducer_need(k, 33, 4096, V_SEEN, 128)
        return (need <= cap and sum(o // need for o in offers) >= k
                and k >= sum(o >= need for o in offers))  # fmt: skip

    need = reducer_need(r, 33, 4096, V_SEEN, 128)
    assert reduce.memory == need and allowed(r) and not any(allowed(k) for k in range(1, r))
    # 133 GiB of rows three times over in ≤ 80 GiB pieces (each also its layers' state and 0.5 GiB)
    assert r >= math.ceil(3 * rows(33, 4096, V_SEEN) / cap)
    # placed on the big nodes first, one each while their room is equal
    assert sorted(reduce.nodes[:4]) == [f"big-{i}" for i in range(4)]
    for node, offer in zip(nodes, offers, strict=True):
        assert reduce.nodes.count(node.node_id) * need <= offer
    assert "over reducers of ≤ 80.0 GiB" in reduce.reason and "4 × 160.0 GiB" in reduce.reason
    # the types seen at the reduce (fewer than the bound): fewer reducers, each asking less
    later = size_reduce(LLAMA_8B, V_SEEN // 4, cluster, options())
    assert later.count < r and later.memory <= need


def test_placement_spreads_and_refuses_what_does_not_fit():
    cluster = Cluster((Node("h", 10, head=True), Node("a", 10), Node("b", 6)))
    assert place(cluster, [10, 10, 6], 3, 5) == ["a", "h", "b"]
    assert place(cluster, [10, 10, 6], 6, 5, partial=True) == ["a", "h", "b", "a", "h"]
    with pytest.raises(ValueError):
        place(cluster, [10, 10, 6], 6, 5)


def test_explicit_options_win():
    cluster = Cluster((Node("h", 16 * GiB, cpus=4, head=True), Node("w", 256 * GiB, cpus=16)))
    # --reducers 1: the job's own process, however large
    assert not size_reducers(LLAMA_8B, 1000, cluster, options(reducers=1), driver=0).partitioned
    # --reducers R: R reducers, each asking for what its share needs
    r3 = size_reducers(LLAMA_8B, 1000, cluster, options(reducers=3), driver=0)
    assert (r3.count, r3.memory) == (3, reducer_need(3, 33, 4096, 1000, 128))
    # --reducer-memory B: the fewest reducers of B each, at least --reducers
    budget = reducer_need(2, 33, 4096, 1000, 128)
    rb = size_reducers(LLAMA_8B, 1000, cluster, options(reducer_memory=budget), driver=0)
    assert (rb.count, rb.memory) == (2, budget)
    rb5 = size_reducers(LLAMA_8B, 1000, cluster, options(reducer_memory=budget, reducers=5), 0)
    assert rb5.count == 5
    # --worker-memory and --statistics-memory: taken as given
    pool = size_extractors(LLAMA_8B, V_SEEN, cluster, options(device="cpu", worker_memory=100 * GiB,
                                                              statistics_memory=8 * GiB), 8, 0)  # fmt: skip
    assert (pool.memory, pool.statistics) == (100 * GiB, 8 * GiB)
    # --num-workers, --cpus-per-worker
    pool = size_extractors(LLAMA_8B, V_SEEN, cluster, options(device="cpu", num_workers=2,
                                                              cpus_per_worker=3), 8, 0)  # fmt: skip
    assert (pool.num_workers, pool.num_cpus) == (2, 3)


def test_extractors_take_what_their_statistics_need_or_a_share_of_the_node():
    """Each extractor asks for its own share (libraries, weights, a CPU batch, two samples)
    plus twice the whole statistics where the nodes hold that; else the smallest share of a
    node's memory any node hosting extractors gives each of them, the statistics then
    bounded by what is left of it (halved: one serialised copy)."""
    small = Shape(layers=3, dim=128, positions=128, vocab=128_256, hidden_states=3,
                  intermediate=448, heads=2, weight_bytes=70 * MiB, sample_entries=8192)  # fmt: skip
    whole = rows(3, 128, 128_256) + layer_state(3, 128, 128)
    def own(lanes: int) -> int:  # one batch in each of the extractor's lanes, one fold scratch
        per_token = lanes * (3 * 128 + 3 * 448 + 2 * 128) * 4 + 64 * 128
        return 512 * MiB + 70 * MiB + 8192 * per_token + 2 * small.sample_bytes

    roomy = Cluster((Node("h", 16 * GiB, cpus=2, head=True),))
    pool = size_extractors(small, 128_256, roomy, options(device="cpu"), 4, driver=GiB)
    assert (pool.num_workers, pool.num_cpus, pool.memory) == (1, 2, own(2) + 2 * whole)
    assert pool.statistics is None
    assert "(2 lanes)" in pool.formula
    pool = size_extractors(small, 128_256, roomy, options(device="cpu", cpu_lanes=1), 4, GiB)
    assert pool.memory == own(1) + 2 * whole
    # 8 CPUs in 2 extractors of 4 on a node offering 2 GiB: 1 GiB each, the statistics bounded
    tight = Cluster((Node("h", 2 * GiB + GiB, cpus=8, head=True),))
    pool = size_extractors(small, 128_256, tight, options(device="cpu"), 4, driver=GiB)
    assert (pool.num_workers, pool.num_cpus, pool.memory) == (2, 4, GiB)
    growth = 8192 * (8 * 3 * 258 + 8)
    assert pool.statistics == (GiB - own(4)) // 2 - growth
    assert "do not fit" in pool.reason


def test_gpus_per_worker_from_the_weights_and_ray_accelerator_type():
    # a node's share, 80 GiB an extractor, leaves no room for a host tier beside σ's copy
    h100 = Cluster((Node("h", 64 * GiB, cpus=8, head=True),
                    Node("g", 640 * GiB, cpus=64, gpus=8, gpu_type="H100")))  # fmt: skip
    pool = size_extractors(LLAMA_8B, V_SEEN, h100, options(), 64, driver=0)
    assert (pool.num_workers, pool.num_gpus) == (8, 1)  # 16 GB ≤ half of 80 GB
    assert pool.batch_tokens is None  # decided on each GPU
    # the host holds the one serialised copy of what the GPU can hold: 0.8 of what the
    # weights and the least batch (8,192 tokens) leave of 80 GB
    per_token = (33 * 4096 + 3 * 14_336 + 32 * 128) * 2 + 64 * 4096
    on_gpu = int(0.8 * (80 * 10**9 - 16 * 10**9 - 8192 * per_token))
    growth = 8192 * (8 * 33 * (2 * 4096 + 2) + 8)
    own = 512 * MiB + 16 * 10**9 + 2 * LLAMA_8B.sample_bytes
    assert pool.memory == own + on_gpu + growth
    big = Shape(**{**LLAMA_8B.__dict__, "weight_bytes": 141 * 10**9, "dim": 8192, "layers": 81})
    pool = size_extractors(big, V_SEEN, h100, options(), 64, driver=0)
    assert (pool.num_workers, pool.num_gpus) == (2, 4)  # 141 GB ≤ half of 4 × 80 GB
    unknown = Cluster((Node("g", 1024 * GiB, cpus=64, gpus=8, head=True),))
    assert size_extractors(LLAMA_8B, V_SEEN, unknown, options(), 64, driver=0).num_gpus == 1
    assert size_extractors(big, V_SEEN, h100, options(gpus_per_worker=8), 64, 0).num_gpus == 8


def test_what_cannot_fit_is_refused_naming_the_option():
    tiny = Cluster((Node("h", 4 * GiB, cpus=2, head=True), Node("w", 8 * GiB, cpus=2)))
    corpus = CorpusShape("c", 1, 10**12, 1000)
    with pytest.raises(ConfigError, match="--layers"):  # 133 GiB of rows, 8 GiB nodes
        size_job(LLAMA_8B, corpus, tiny, options(device="cpu", worker_memory=2 * GiB))
    with pytest.raises(ConfigError, match=r"--reducer-memory .* more than any node"):
        size_reducers(LLAMA_8B, 10, tiny, options(reducer_memory=64 * GiB), driver=0)
    with pytest.raises(ConfigError, match="--reducers 2: each needs"):
        size_reducers(LLAMA_8B, V_SEEN, tiny, options(reducers=2), driver=0)
    with pytest.raises(ConfigError, match=r"--worker-memory .* cannot hold"):
        size_extractors(LLAMA_8B, V_SEEN, tiny, options(device="cpu", worker_memory="1GiB"), 8, 0)
    with pytest.raises(ConfigError, match="--num-workers"):  # weights alone exceed the share
        size_extractors(LLAMA_8B, V_SEEN, tiny, options(device="cpu"), 8, 0)
    # the sample's work runs on Ray tasks, but the job's own process keeps every layer's
    # K-means labels (8·L·s: 50 MiB here) beside its 512 MiB: more than a 1 GiB head holds
    huge_sample = Shape(**{**LLAMA_8B.__dict__, "sample_entries": 200_000})
    roomy = Cluster((Node("h", 1 * GiB, cpus=0, head=True), Node("w", 8192 * GiB, cpus=16)))
    with pytest.raises(ConfigError, match="--sample-size"):
        size_job(huge_sample, corpus, roomy, options(device="cpu"))


def test_early_reducers_fit_beside_the_extractors():
    """Reducers start with the extractors only as far as both fit the nodes at once."""
    shape = Shape(layers=5, dim=256, positions=128, vocab=128_256, weight_bytes=140 * MiB)
    cluster = Cluster((Node("h", 12 * GiB, cpus=2, head=True),))
    big_corpus = CorpusShape("c", 1, 10 * GiB, 100)
    sizing = size_job(shape, big_corpus, cluster, options(device="cpu", reducers=2))
    pool, reduce = sizing.pool, sizing.reduce
    room = 12 * GiB - 512 * MiB - GiB - pool.memory  # the head less the job's own, the pool
    assert reduce.early == min(2, room // reduce.memory)
    # a small corpus: self-sized reducers start at the reduce
    small_corpus = CorpusShape("c", 1, 10 * MiB, 1)
    assert size_job(shape, small_corpus, cluster, options(device="cpu")).reduce.early == 0


def test_before_the_corpus_is_read_only_what_cannot_fit_whatever_the_types_is_refused():
    """At the bound on the types (before the corpus is read) a request the types seen may fit
    is sized and noted, not refused; at the reduce, with the types seen, it is refused. What
    cannot fit whatever the types (reducers' own 512 MiB each) is refused at once."""
    cluster = Cluster((Node("h", 8 * GiB, cpus=2, head=True),))
    shape = Shape(layers=7, dim=384, positions=128, vocab=30_522)
    budget = reducer_need(2, 7, 384, 2000, 128)  # two of these hold 2,000 types
    opts = options(reducer_memory=budget)
    early = size_reducers(shape, 30_522, cluster, opts, driver=0, final=False)
    assert early.count > 8 and "sized again for the types seen" in early.reason
    assert len(early.nodes) < early.count  # as many placed as fit
    with pytest.raises(ConfigError, match=r"need .* reducers of that"):
        size_reducers(shape, 30_522, cluster, opts, driver=0)  # the types seen: refused
    assert size_reducers(shape, 2000, cluster, opts, driver=0).count == 2
    with pytest.raises(ConfigError, match="--reducers 40: each needs"):
        size_reducers(shape, 30_522, cluster, options(reducers=40), driver=0, final=False)


def test_reducer_options_that_cannot_fit_name_the_counts_and_the_memory_that_do():
    """A refused ``--reducers R`` says which way to go and which counts the nodes hold (it
    said "give more --reducers" to a count that was too many), and a refused
    ``--reducer-memory B`` the least memory whose reducers the nodes hold (it said "give at
    least" the floor of one type and one layer a reducer: 128,256 reducers of 514 MiB)."""
    shape = Shape(layers=5, dim=256, positions=128, vocab=128_256)
    offers = [6 * GiB + 512 * MiB, 32 * GiB]
    cluster = Cluster((Node("h", offers[0], cpus=8, head=True), Node("w", offers[1], cpus=16)))

    def held(r: int) -> int:
        return sum(o // reducer_need(r, 5, 256, 128_256, 128) for o in offers)

    fitting = [r for r in range(2, 200) if held(r) >= r]
    lo, hi = fitting[0], fitting[-1]
    assert (lo, hi) == (2, 61) and fitting == list(range(lo, hi + 1))
    # too many even at the least a reducer needs (514 MiB: 63 + 12 of them): fewer
    with pytest.raises(ConfigError, match=r"give fewer --reducers \(2 to 61 fit the nodes\)"):
        size_reducers(shape, 128_256, cluster, options(reducers=76), driver=0, final=False)
    # too few for the types seen: more
    small = Cluster((Node("h", 4 * GiB, cpus=8, head=True),
                     *(Node(f"w{i}", 4 * GiB, cpus=8) for i in range(3))))  # fmt: skip
    few = [r for r in range(2, 50) if 4 * (4 * GiB // reducer_need(r, 5, 256, 128_256, 128)) >= r]
    end = next(r for r in few if r + 1 not in few)  # every count from 3 to it fits
    assert few[0] == 3 and end == 12  # two of 4.2 GiB fit no node
    with pytest.raises(ConfigError, match=r"give more --reducers \(3 to 12 fit the nodes\)"):
        size_reducers(shape, 128_256, small, options(reducers=2), driver=0)
    # a budget below one layer's state: the least whose reducers the nodes hold
    least = reducer_need(hi, 5, 256, 128_256, 128)
    with pytest.raises(ConfigError, match=rf"give --reducer-memory {least:,} \(638 MiB: 61 reducers"):
        size_reducers(shape, 128_256, cluster, options(reducer_memory="100MiB"), driver=0)
    given = size_reducers(shape, 128_256, cluster, options(reducer_memory=least), driver=0)
    assert (given.count, given.memory) == (61, least)
    with pytest.raises(ConfigError, match=rf"hold fewer; give --reducer-memory {least:,} "):
        size_reducers(shape, 128_256, cluster, options(reducer_memory=least - 1), driver=0)


def test_gpu_extractors_merge_their_spills_on_the_host_where_the_nodes_leave_room():
    """Statistics that spill on the GPUs are merged on the host (``--host-statistics-memory``)
    in what a node's share leaves beside the copy of σ, less one block of the tier's file (it is
    written a block at a time), up to the whole statistics. A share too small for a tier larger than σ
    gets none and asks only for what it needs; an explicit tier is asked for on top, and one
    no larger than σ is refused."""
    from embgeom_ray.core.statistics_io import STREAM_BLOCK_BYTES
    from embgeom_ray.sizing.decisions import host_tier_for
    from embgeom_ray.sizing.formulas import extractor_bytes

    def h100(node_memory: int) -> Cluster:
        return Cluster((Node("h", 64 * GiB, cpus=8, head=True),
                        Node("g", node_memory, cpus=64, gpus=8, gpu_type="H100")))  # fmt: skip

    roomy = size_extractors(LLAMA_8B, V_SEEN, h100(1536 * GiB), options(), 64, driver=0)
    assert roomy.memory == 192 * GiB  # the node's share: an eighth of 1.5 TiB
    sigma = int(0.8 * (80 * 10**9 - 16 * 10**9 - 8192 * ((33 * 4096 + 3 * 14_336 + 32 * 128) * 2
                                                          + 64 * 4096)))  # fmt: skip
    need = extractor_bytes(LLAMA_8B, V_SEEN, 8192, sigma, 1)  # without a tier
    assert roomy.host_statistics == 192 * GiB - need - STREAM_BLOCK_BYTES > 2 * sigma
    assert roomy.host_statistics == host_tier_for(LLAMA_8B, V_SEEN, 8192, 192 * GiB, 1, sigma)
    assert "merged on the host into a tier of" in roomy.reason
    # the whole statistics fit the tier where the node holds them: no more asked
    whole = LLAMA_8B.statistics_bytes(V_SEEN)
    for node in (2048 * GiB, 8192 * GiB):
        huge = size_extractors(LLAMA_8B, V_SEEN, h100(node), options(), 64, driver=0)
        assert huge.host_statistics == whole
        assert huge.memory == need + whole + STREAM_BLOCK_BYTES
    # 1 TiB: an eighth leaves ~52 GiB beside the rest, more than σ: a tier
    one = size_extractors(LLAMA_8B, V_SEEN, h100(1024 * GiB), options(), 64, driver=0)
    assert one.host_statistics == 128 * GiB - need - STREAM_BLOCK_BYTES > sigma
    # 768 GiB: an eighth leaves less than σ beside the rest: no tier, nothing more asked
    tight = size_extractors(LLAMA_8B, V_SEEN, h100(768 * GiB), options(), 64, driver=0)
    assert tight.host_statistics is None and tight.memory == need
    # explicit: asked on top of what the extractor needs, and refused at or below σ
    given = size_extractors(LLAMA_8B, V_SEEN, h100(2048 * GiB),
                            options(host_statistics_memory=60 * GiB, worker_memory=200 * GiB),
                            64, driver=0)  # fmt: skip
    assert given.host_statistics == 60 * GiB and given.memory == 200 * GiB
    with pytest.raises(ConfigError, match=r"--worker-memory .* cannot hold"):
        size_extractors(LLAMA_8B, V_SEEN, h100(2048 * GiB),
                        options(host_statistics_memory=60 * GiB, worker_memory=70 * GiB),
                        64, driver=0)  # fmt: skip
    small = Shape(layers=3, dim=128, positions=128, vocab=128_256, hidden_states=3,
                  intermediate=448, heads=2, weight_bytes=70 * MiB, sample_entries=8192)  # fmt: skip
    tight_cpu = Cluster((Node("h", 3 * GiB, cpus=8, head=True),))
    with pytest.raises(ConfigError, match="does not exceed the extractors' statistics budget"):
        size_extractors(small, 128_256, tight_cpu,
                        options(device="cpu", worker_memory="1280MiB", host_statistics_memory="1MiB"),
                        4, driver=GiB)  # fmt: skip


def test_a_given_host_tier_is_asked_for_where_a_gpu_may_spill_and_dropped_where_nothing_can():
    """``--host-statistics-memory H`` where the plan expects the whole statistics to fit: on a
    GPU, σ is decided on the device once the model is loaded and may fall short, and its
    spills then fill the tier, so H + one block is asked of Ray on top (before, the plan
    printed "+ H" in the formula and asked for none of it: 3.2 GiB with H = 40 GiB); on a CPU,
    whose budget is the one decided here, nothing spills: no tier, nothing asked, and said so."""
    from dataclasses import replace

    from embgeom_ray.core.statistics_io import STREAM_BLOCK_BYTES
    from embgeom_ray.sizing.formulas import extractor_bytes

    small = Shape(layers=5, dim=256, positions=128, vocab=128_256, hidden_states=5,
                  intermediate=896, heads=2, weight_bytes=139 * MiB, sample_entries=8192)  # fmt: skip
    whole = small.statistics_bytes(128_256)
    gpu = Cluster((Node("h", 8 * GiB, cpus=8, head=True),
                   Node("g", 32 * GiB, cpus=16, gpus=2, gpu_type="H100")))  # fmt: skip
    given = size_extractors(small, 128_256, gpu, options(host_statistics_memory="20GiB"), 1,
                            driver=0)  # fmt: skip
    own = 512 * MiB + 139 * MiB + 2 * small.sample_bytes  # no batch on the host of a GPU
    assert given.statistics is None and given.host_statistics == 20 * GiB
    assert given.memory == own + whole + 20 * GiB + STREAM_BLOCK_BYTES
    assert given.memory == extractor_bytes(small, 128_256, 8192, None, 1) + 20 * GiB + STREAM_BLOCK_BYTES
    assert "+ H + 64 MiB" in given.formula
    with pytest.raises(ConfigError, match=r"needs at least .*\+ H 40\.0 GiB.*lower --host-statistics-memory"):
        size_extractors(small, 128_256, gpu, options(host_statistics_memory="40GiB"), 1, driver=0)
    cpu = size_extractors(small, 128_256, gpu, options(device="cpu", host_statistics_memory="4GiB"),
                          1, driver=0)  # fmt: skip
    assert cpu.statistics is None and cpu.host_statistics is None
    lanes = replace(small, lanes=cpu.num_cpus)  # a batch in each of its CPUs' lanes
    assert cpu.memory == extractor_bytes(lanes, 128_256, cpu.batch_tokens, None, 0) < 4 * GiB + whole
    assert "+ H" not in cpu.formula and "--host-statistics-memory 4.0 GiB not used" in cpu.reason


def test_the_drivers_formula_names_the_sample_factor_its_figure_counts():
    """A sample under 16 MiB a layer is held min(10, L) layers at a time: the figure counts
    7 · Q_l for MiniLM's 7 layers, and the printed formula now says 7 (it said 10, so its
    terms summed to 635 MiB against the 606 MiB printed beside them)."""
    minilm = Shape(layers=7, dim=384, positions=128, vocab=30_522, hidden_states=7,
                   intermediate=1536, heads=12, weight_bytes=90 * MiB, sample_entries=8192)  # fmt: skip
    cluster = Cluster((Node("h", 16 * GiB, cpus=2, head=True),))
    sizing = size_job(minilm, CorpusShape("c", 1, 10**6, 1), cluster, options(device="cpu"))
    q_l = 4 * 8192 * 384 + 48 * 8192
    assert sizing.reduce.partitioned  # 3 · (S(V) + F) in the job's process: over 1 GiB
    assert sizing.driver == 512 * MiB + 7 * 384 * 160 + 30_522 * 160 + 7 * q_l + 256 * 8192
    assert round(sizing.driver / MiB) == 606
    assert "the sample a layer at a time 7 · (4·s·d + 48s) + 256 B · s" in sizing.driver_formula


def test_the_plan_says_when_the_shards_bound_the_pool():
    """One extractor a shard at most: a corpus of 1 shard gets 1 extractor on nodes whose CPUs
    hold 6 of 4 CPUs, and the plan now says why (it printed "1 actor(s)" alone); with as many
    shards as the nodes hold extractors, nothing is added."""
    from embgeom_ray.sizing.plan import describe_plan

    minilm = Shape(layers=7, dim=384, positions=128, vocab=30_522, hidden_states=7,
                   intermediate=1536, heads=12, weight_bytes=90 * MiB, sample_entries=8192)  # fmt: skip
    cluster = Cluster((Node("h", 8 * GiB, cpus=8, head=True), Node("w", 32 * GiB, cpus=16)))
    for shards, want in ((1, "extractors: 1 actor(s) (one a shard: the corpus has 1; the nodes' "
                              "CPUs and GPUs hold 6; --shard-bytes cuts more), each 4 CPU(s)"),
                         (18, "extractors: 6 actor(s), each 4 CPU(s)")):  # fmt: skip
        corpus = CorpusShape("c", 1, 10**6, shards)
        sizing = size_job(minilm, corpus, cluster, options(device="cpu"))
        lines = describe_plan(sizing, corpus, checkpoint_interval=None, total_layers=7)
        assert next(x for x in lines if x.startswith("extractors:")).startswith(want)


def test_the_plans_extractor_formula_gives_sigma_and_g_and_sums_to_what_is_asked():
    """The extractor's formula in --plan gives σ and g beside its other terms (it named them
    without a number): own + w + B · b + 2 · Q + 2 · (σ + g) is the memory asked of Ray, to the
    byte, at --worker-memory 3 GiB (σ = 681 MiB, g = 161 MiB) and unbounded (σ = S(V) + F, g = 0)."""
    from embgeom_ray.sizing.formulas import gib as gib_text
    from embgeom_ray.sizing.plan import describe_plan

    llama = Shape(layers=5, dim=256, positions=128, vocab=128_256, hidden_states=5,
                  intermediate=896, heads=2, weight_bytes=139 * MiB, sample_entries=8192)  # fmt: skip
    cluster = Cluster((Node("h", 8 * GiB, cpus=8, head=True), Node("w", 32 * GiB, cpus=16)))
    corpus = CorpusShape("c", 1, 10**6, 1)
    per_token = 4 * (5 * 256 + 3 * 896 + 2 * 128) * 4 + 64 * 256  # 4 lanes of float32, the fold
    own = 512 * MiB + 139 * MiB + 8192 * per_token + 2 * (4 * 5 * 8192 * 256 + 48 * 8192)
    g = 8192 * (8 * 5 * (2 * 256 + 2) + 8)
    bounded = size_job(llama, corpus, cluster, options(device="cpu", worker_memory="3GiB"))
    sigma = bounded.pool.statistics
    assert sigma == (3 * GiB - own) // 2 - g and gib_text(sigma) == "681 MiB"
    assert own + 2 * (sigma + g) in (3 * GiB, 3 * GiB - 1)  # the halving's rounding
    lines = describe_plan(bounded, corpus, checkpoint_interval=None, total_layers=5)
    assert any(x.endswith("2 · (σ + g), with σ = 681 MiB, g = 161 MiB") for x in lines)
    whole = size_job(llama, corpus, cluster, options(device="cpu"))
    assert whole.pool.memory == own + 2 * (rows(5, 256, 128_256) + layer_state(5, 256, 128))
    lines = describe_plan(whole, corpus, checkpoint_interval=None, total_layers=5)
    assert any(x.endswith("2 · (σ + g), with σ = S(V) + F = 2.5 GiB, g = 0") for x in lines)


def test_sample_tasks_ask_ray_for_their_peak_and_one_no_node_holds_is_refused():
    """The sample's per-layer tasks (from Q_l = 4·s·d + 48s of 16 MiB) took ≈ 10 · Q_l each
    but asked Ray for a CPU, not memory: a node ran min(L, its CPUs) at once (five tasks of
    8 GiB on a head of 8 GiB), and the plan only warned. Now each asks Ray for 10 · Q_l (the
    plan's number), so a node runs as many as its memory holds; a task no node it may run on
    holds (the head, for a run on a local path; any node, in object storage) is refused in one
    line, by the plan and again by the stage on the live cluster, naming the sample that fits."""
    from types import SimpleNamespace

    from embgeom_ray.distributed.sample_tasks import check_fits, task_bytes
    from embgeom_ray.sizing.formulas import gib as gib_text
    from embgeom_ray.sizing.plan import describe_plan

    llama = Shape(layers=5, dim=256, positions=128, vocab=128_256, hidden_states=5,
                  intermediate=896, heads=2, weight_bytes=139 * MiB, sample_entries=900_000)  # fmt: skip
    corpus = CorpusShape("c", 1, 10**6, 1)
    each = 10 * (4 * 900_000 * 256 + 48 * 900_000)
    assert gib_text(each) == "9.0 GiB"
    # tasks of 9.0 GiB on a head of 8 GiB (its Ray memory): the local run is refused
    cluster = Cluster((Node("h", 8 * GiB, cpus=8, head=True), Node("w", 32 * GiB, cpus=16)))
    fits = 8 * GiB // (10 * (4 * 256 + 48))  # entries of one 10 · Q_l within the head's 8 GiB
    assert fits == 801_299 and 10 * (4 * fits * 256 + 48 * fits) <= 8 * GiB < each
    line = (
        "the sample's per-layer tasks need ≈ 9.0 GiB each at their peak (10 · Q_l, "
        "Q_l = 4·s·d + 48·s; s = 900,000 entries a layer: --sample-size + --sample-type-size, "
        "the most the sample can hold), more than the 8.0 GiB of Ray memory of the job's own node (the "
        "sample is read from its local files); lower --sample-size and --sample-type-size "
        "(together at most 801,299 entries fit)"
    )
    with pytest.raises(ConfigError) as refused:
        size_job(llama, corpus, cluster, options(device="cpu"))
    assert str(refused.value) == line and refused.value.exit_code == 2
    # in object storage they may run on the worker's 32 GiB: asked of Ray, planned as such
    bucket = Shape(**{**llama.__dict__, "store": "s3://b/run"})
    sizing = size_job(bucket, corpus, cluster, options(device="cpu"))
    lines = describe_plan(sizing, corpus, checkpoint_interval=None, total_layers=5)
    (task_line,) = [x for x in lines if x.startswith("sample tasks:")]
    assert "each ≈ 10 · Q_l = 9.0 GiB at its peak, Q_l = 4·s·d + 48s = 920 MiB (asked of Ray" in task_line
    # the default sample (8,192 entries, Q_l = 8.4 MiB here) stays in the job's own process
    small = Shape(**{**llama.__dict__, "sample_entries": 8192})
    assert size_job(small, corpus, cluster, options(device="cpu")).driver > 0
    # the stage: each task asks Ray for the same number, checked against the live nodes
    sample = SimpleNamespace(header={"dim": 256, "size": 700_000, "type_size": 200_000})
    assert task_bytes(sample) == each
    nodes = [{"NodeID": "h", "Alive": True, "Resources": {"memory": 8 * GiB, "CPU": 8}},
             {"NodeID": "w", "Alive": True, "Resources": {"memory": 32 * GiB, "CPU": 16}},
             {"NodeID": "x", "Alive": False, "Resources": {"memory": 64 * GiB, "CPU": 16}}]  # fmt: skip
    check_fits(sample, nodes, None)  # the worker holds one
    # a head without CPUs runs none in object storage (each task asks for a CPU), whatever
    # its memory: the 64 GiB one does not count, the 8 GiB worker refuses
    headless = [{"NodeID": "h", "Alive": True, "Resources": {"memory": 64 * GiB}},
                {"NodeID": "w", "Alive": True, "Resources": {"memory": 8 * GiB, "CPU": 16}}]  # fmt: skip
    with pytest.raises(ConfigError, match=r"more than the 8\.0 GiB of Ray memory of the largest node with a CPU"):
        check_fits(sample, headless, None, can_start=())
    with pytest.raises(ConfigError, match=r"more than the 8\.0 GiB of Ray memory of the job's own node"):
        check_fits(sample, nodes, "h")
    # one that no node has free now (the job's reducers hold it through the stage) asks for
    # the most one has free, and says so: asked in full, it would wait for the reducers, which
    # wait for it
    from embgeom_ray.distributed.sample_tasks import held_memory

    free = {"h": 1.0 * GiB, "w": 4.0 * GiB}
    assert held_memory(each, free, None) == (4 * GiB, (
        "the sample's per-layer tasks need ≈ 9.0 GiB each at their peak; a node with a CPU has at "
        "most 4.0 GiB of its Ray memory free now (other actors, such as another job's, hold the "
        "rest): they ask Ray for that much, and run fewer at once rather than wait for it"))  # fmt: skip
    assert held_memory(each, {**free, "w": 10.0 * GiB}, None) is None
    asked, line = held_memory(each, {**free, "w": 10.0 * GiB}, "h")
    assert asked == 1 * GiB and "the job's own node has at most 1.0 GiB" in line
    assert held_memory(each, {}, "h") is None  # Ray does not say
    # 10 · Q_l = 32.9 GiB: no live node holds it (the 64 GiB one is gone)
    large = SimpleNamespace(header={"dim": 256, "size": 3_300_000, "type_uniform": False})
    with pytest.raises(ConfigError, match=r"more than the 32\.0 GiB of Ray memory of the largest "
                       r"node with a CPU; lower --sample-size and --sample-type-size \(together at most "
                       r"3,205,199 entries fit\)$"):  # fmt: skip
        check_fits(large, nodes, None)
    check_fits(large, nodes, None, can_start=[64 * GiB])  # the autoscaler may start a node of it
    with pytest.raises(ConfigError, match="own node"):  # not for local files: this node only
        check_fits(large, nodes, "w", can_start=[64 * GiB])


def test_sample_tasks_are_refused_only_where_no_node_can_ever_run_them():
    """Two refusals of the sample tasks' memory check fired where the job would have run:
    a local run's tasks on a head that offers Ray no memory (``ray start --memory 0``, kept
    for the driver) were refused ("more than the 0 B of Ray memory …; together at most 0
    entries fit") though they ran there before they asked Ray for memory, as they run on a
    head with no CPU; and in object storage, on a joined cluster whose autoscaler does not say
    its node types (Ray 2.60's launcher, KubeRay), a small head and no worker yet (they start
    at 0) refused the run before any work. Now the first asks for no memory there, and the
    second waits for a node, said in one line; the private local Ray, and an autoscaler whose
    node types hold none, are still refused."""
    from types import SimpleNamespace

    from embgeom_ray.distributed.sample_tasks import check_fits, note_no_node
    from embgeom_ray.sizing.decisions import sample_task_memory, sample_task_refusal
    from embgeom_ray.sizing.plan import describe_plan

    llama = Shape(layers=5, dim=256, positions=128, vocab=128_256, hidden_states=5,
                  intermediate=896, heads=2, weight_bytes=139 * MiB, sample_entries=900_000,
                  store="")  # fmt: skip
    each = 10 * (4 * 900_000 * 256 + 48 * 900_000)  # 9.0 GiB
    corpus = CorpusShape("c", 1, 10**6, 1)
    kept = Cluster((Node("h", 0, cpus=0, head=True), Node("w", 32 * GiB, cpus=16)))
    sizing = size_job(llama, corpus, kept, options(device="cpu"))
    (task_line,) = [x for x in describe_plan(sizing, corpus, checkpoint_interval=None,
                                             total_layers=5) if x.startswith("sample tasks:")]  # fmt: skip
    assert task_line.endswith("(not asked of Ray: the job's own node, where they read the run's "
                              "local files, offers Ray no memory; --sample-size and "
                              "--sample-type-size bound it)")  # fmt: skip
    assert sample_task_memory(each, True, 0) == {}
    assert sample_task_memory(each, True, 16 * GiB) == sample_task_memory(each, False, 0) == {
        "memory": each}
    sample = SimpleNamespace(header={"dim": 256, "size": 700_000, "type_size": 200_000})
    nodes = [{"NodeID": "h", "Alive": True, "Resources": {"memory": 0}},
             {"NodeID": "w", "Alive": True, "Resources": {"memory": 4 * GiB, "CPU": 16}}]  # fmt: skip
    check_fits(sample, nodes, "h")  # not refused: asks this node for no memory
    # object storage on a small head alone: the autoscaler says nothing (None), may start one
    bucket = Shape(**{**llama.__dict__, "store": "s3://b/run"})
    alone = Cluster((Node("h", 4 * GiB, cpus=0, head=True),))
    assert size_job(bucket, corpus, alone, options(device="cpu", num_workers=2),
                    groups=None).driver > 0  # fmt: skip
    check_fits(sample, nodes, None, can_start=None)
    assert note_no_node(each, [0, 4 * GiB], said=False) == (
        "the sample's per-layer tasks ask Ray for 9.0 GiB each and no node now has that much Ray "
        "memory (the largest 4.0 GiB): they wait for a node the autoscaler starts (on a cluster "
        "without one, for ever: stop the job and lower --sample-size and --sample-type-size)")  # fmt: skip
    assert note_no_node(each, [4 * GiB], said=True).endswith("a node the autoscaler starts")
    assert note_no_node(each, [10 * GiB], said=False) is None
    # where nothing can come (the private local Ray: ()), or what can come holds none: refused
    for groups in ((), (NodeGroup("small", cpus=8, memory=8 * GiB, max_count=4),)):
        # (its head has no CPU: with nothing to come, no node with a CPU offers anything)
        with pytest.raises(ConfigError, match=r"more than the (8\.0 GiB|0 B) of Ray memory of the "
                           r"largest node with a CPU"):
            size_job(bucket, corpus, alone, options(device="cpu", num_workers=2), groups=groups)
    with pytest.raises(ConfigError, match=r"more than the 4\.0 GiB of Ray memory of the largest"):
        check_fits(sample, nodes, None, can_start=())
    # a plan of the same: a head without CPUs and a worker of 8 GiB, nothing more to come
    big_head = Cluster((Node("h", 64 * GiB, cpus=0, head=True), Node("w", 8 * GiB, cpus=16)))
    assert "more than the 8.0 GiB of Ray memory of the largest node with a CPU" in (
        sample_task_refusal(bucket, big_head, ()))


def test_sample_tasks_do_not_wait_for_memory_the_jobs_reducers_hold(monkeypatch, capsys):
    """The reducers lived until the run was written (they are now stopped before the sampled
    stage; another job's actors may still hold a node's memory), and reserved up to all of a
    node's Ray memory (two of half the largest offer each). The
    sample tasks, which run inside ``finish_run``, asked Ray for 10 · Q_l whatever was free:
    where no node had that free they waited for the reducers, which waited for them, and the
    job hung for ever (the stage said they "wait until one of them lets it go"). Now they ask
    for none there (a CPU each, as before they asked for memory) and say so; where a node has
    it free, they ask for it."""
    from types import SimpleNamespace

    import ray

    from embgeom_ray.distributed import cluster as cluster_mod
    from embgeom_ray.distributed import sample_tasks

    sample = SimpleNamespace(url="s3://b/run/samples.parquet",
                             header={"dim": 256, "size": 700_000, "type_size": 200_000})  # fmt: skip
    each = 10 * (4 * 900_000 * 256 + 48 * 900_000)
    nodes = [{"NodeID": "w", "Alive": True, "Resources": {"memory": 32 * GiB, "CPU": 16}}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.setattr(cluster_mod, "started_private_local", lambda: True)
    # two reducers of 16 GiB on the 32 GiB node: nothing free
    monkeypatch.setattr(sample_tasks, "free_memory", lambda: {"w": 0.0})
    assert sample_tasks.placement(sample) == {}
    assert "they ask Ray for that much, and run fewer at once" in capsys.readouterr().err
    # 3 GiB free: they ask for that, so Ray runs one at a time there, not one a CPU
    monkeypatch.setattr(sample_tasks, "free_memory", lambda: {"w": 3.0 * GiB})
    assert sample_tasks.placement(sample) == {"memory": 3 * GiB}
    assert "at most 3.0 GiB of its Ray memory free now" in capsys.readouterr().err
    monkeypatch.setattr(sample_tasks, "free_memory", lambda: {"w": 10.0 * GiB})
    assert sample_tasks.placement(sample) == {"memory": each}
    assert capsys.readouterr().err == ""


def test_a_gpus_larger_batch_takes_its_new_types_from_the_budget_not_the_hosts_memory():
    """The host's memory holds σ + g, g = min(B, V) · r sized at the least GPU batch (8,192
    tokens); an 8B model on an H100 decides 13,312 tokens once loaded, whose new types may add
    5,120 · r = 10.3 GiB more to the serialised copy. The budget now gives that up: the copy
    stays within what the extractor asked Ray for (by the formulas it went 7.2 GiB over: σ of
    41.5 GiB on the device and g of 26.8 GiB, against 44.6 + 16.5 GiB asked).
    A given --batch-tokens was sized as it is: nothing is taken."""
    from embgeom_ray.sizing.formulas import gpu_budgets

    llama = Shape(layers=33, dim=4096, positions=128, vocab=128_256, hidden_states=33,
                  intermediate=14_336, heads=32, weight_bytes=16 * 10**9, dtype_bytes=2,
                  sample_entries=8192)  # fmt: skip
    r = 8 * 33 * (2 * 4096 + 2) + 8
    per_token = (33 * 4096 + 3 * 14_336 + 32 * 128) * 2 + 64 * 4096
    free, host = 64 * 10**9, 47_889_211_392  # the host's σ: 44.6 GiB
    on_gpu = int(0.8 * (free - 13_312 * per_token))
    assert gpu_budgets(llama, free, None, None) == (13_312, on_gpu)  # 41.5 GiB: no host bound
    tokens, budget = gpu_budgets(llama, free, None, host)
    assert tokens == 13_312 and budget == host - (13_312 - 8192) * r < on_gpu
    assert budget + 13_312 * r == host + 8192 * r  # σ + g: what the host was sized for
    assert round((13_312 - 8192) * r / GiB, 1) == 10.3
    assert gpu_budgets(llama, free, 13_312, host) == (13_312, on_gpu)  # --batch-tokens given


def test_num_workers_gets_cpus_with_which_the_nodes_hold_them_all():
    """--num-workers N on CPUs: each extractor gets the most CPUs with which the nodes hold all
    N at once. 24 CPUs on nodes of 8 and 16 gave 2 extractors 12 CPUs (24 / 2), one of which no
    node held (it waited for a node that never joined); now 8 each, one on each node."""
    small = Shape(layers=3, dim=128, positions=128, vocab=128_256, hidden_states=3,
                  intermediate=448, heads=2, weight_bytes=70 * MiB, sample_entries=8192)  # fmt: skip
    two = Cluster((Node("h", 8 * GiB, cpus=8, head=True), Node("w", 32 * GiB, cpus=16)))
    pool = size_extractors(small, 128_256, two, options(device="cpu", num_workers=2), 4, driver=GiB)
    assert (pool.num_workers, pool.num_cpus) == (2, 8)
    assert "wait for nodes" not in pool.reason
    three = size_extractors(small, 128_256, two, options(device="cpu", num_workers=3), 4, GiB)
    assert three.num_cpus == 8  # 1 + 2 of 8 CPUs
    # more extractors than CPUs (nodes yet to join): one CPU each, as before
    many = size_extractors(small, 128_256, two, options(device="cpu", num_workers=40), 40, GiB)
    assert many.num_cpus == 1 and "wait for nodes to join" in many.reason
    # one node: the cluster's CPUs / N
    one = Cluster((Node("h", 64 * GiB, cpus=16, head=True),))
    assert size_extractors(small, 128_256, one, options(device="cpu", num_workers=3), 4, GiB).num_cpus == 5
