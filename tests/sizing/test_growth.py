"""The extractor pool's growth as a function of the cluster (embgeom_ray/sizing/growth.py):
how many extractors the nodes hold, how many to start, what to ask an autoscaler for. The
expected numbers are worked out by hand here from the nodes' resources."""

from __future__ import annotations

import pytest

from embgeom_ray.sizing import (
    Cluster,
    Extractor,
    Node,
    autoscaler_request,
    extractors_held,
    extractors_to_add,
    pool_target,
)

GiB = 2**30

#: cluster.yaml's shape: a CPU head that takes no actor, and GPU workers of 8 CPUs and 1 GPU
HEAD = Node("head", 24 * GiB, cpus=0, head=True)


def gpu_node(name: str, gpus: int = 1, memory: int = 24 * GiB) -> Node:
    return Node(name, memory, cpus=8 * gpus, gpus=gpus, gpu_type="A10G")


def test_nodes_hold_by_their_scarcest_resource():
    one_gpu = Extractor(cpus=1, gpus=1, memory=5 * GiB)
    cluster = Cluster((HEAD, gpu_node("a"), gpu_node("b", gpus=4), gpu_node("c", 4, 12 * GiB)))
    # head: no GPU; a: 1 GPU; b: 4 GPUs, 24 GiB // 5 GiB = 4; c: 4 GPUs but 12 // 5 = 2
    assert extractors_held(cluster, one_gpu) == {"head": 0, "a": 1, "b": 4, "c": 2}
    # two GPUs each: b holds 2, c 2 by GPUs and 2 by memory, a none
    two_gpus = Extractor(cpus=1, gpus=2, memory=5 * GiB)
    assert extractors_held(cluster, two_gpus) == {"head": 0, "a": 0, "b": 2, "c": 2}
    # CPU extractors of 4 CPUs asking no memory: the CPUs alone (8, 32 and 32 CPUs)
    cpu = Extractor(cpus=4)
    assert extractors_held(cluster, cpu) == {"head": 0, "a": 2, "b": 8, "c": 8}


def test_the_head_keeps_the_jobs_own_share():
    head = Node("head", 10 * GiB, cpus=8, head=True)
    worker = Node("w", 10 * GiB, cpus=8)
    each = Extractor(cpus=1, memory=2 * GiB)
    # 10 GiB hold 5; the head less 3 GiB for the job's own process: 7 GiB hold 3
    assert extractors_held(Cluster((head, worker)), each, head_reserve=3 * GiB) == {
        "head": 3,
        "w": 5,
    }
    # a reserve beyond the head's memory leaves it none, never a negative count
    assert extractors_held(Cluster((head,)), each, head_reserve=20 * GiB) == {"head": 0}


def test_the_target_is_the_shards_waiting_within_num_workers():
    # 3 running (one of them starting), 10 shards queued: the starting one takes one of them
    assert pool_target(running=3, starting=1, queued=10, num_workers=None) == 3 + 9
    assert pool_target(running=3, starting=1, queued=10, num_workers=8) == 8
    # the queue drained: the pool it has is enough (never less than it has, without a ceiling)
    assert pool_target(running=3, starting=0, queued=0, num_workers=None) == 3
    # more starting than shards waiting: nothing more
    assert pool_target(running=3, starting=3, queued=2, num_workers=None) == 3


@pytest.mark.parametrize(
    ("held", "running", "starting", "queued", "num_workers", "add"),
    [
        (1, 0, 0, 100, None, 1),  # the start on one GPU node: one extractor
        (8, 1, 0, 100, None, 7),  # seven GPU nodes joined: one extractor on each
        (8, 1, 0, 100, 4, 3),  # --num-workers 4: three more, not seven
        (8, 4, 0, 100, 4, 0),  # at --num-workers: none
        (8, 1, 0, 3, None, 3),  # three shards waiting: three more, not seven
        (8, 2, 2, 3, None, 1),  # two still starting take two of the three shards
        (8, 1, 0, 0, None, 0),  # nothing waits: none
        (2, 4, 0, 100, None, 0),  # nodes left (4 running, room for 2): none, none removed
        (0, 0, 0, 5, None, 1),  # no node holds one (GPU workers at 0): one waits for a node
        (0, 0, 0, 5, 8, 1),  # … with --num-workers too
        (0, 0, 0, 0, None, 0),  # and none when no shard waits
    ],
)
def test_extractors_to_add(held, running, starting, queued, num_workers, add):
    assert extractors_to_add(
        held, running=running, starting=starting, queued=queued, num_workers=num_workers
    ) == add


def test_without_an_autoscaler_to_ask_a_known_pool_waits_for_nodes_as_demand():
    """Where the autoscaler's request failed (a Ray Client connection), ``--num-workers 8``
    with one GPU node up starts all 8: the 7 no node holds wait, their resources the demand
    that brings nodes. Without a ceiling, only what the nodes hold (and one)."""
    counts = {"running": 0, "starting": 0, "queued": 100}
    assert extractors_to_add(1, **counts, num_workers=8, demand=True) == 8
    assert extractors_to_add(1, **counts, num_workers=8) == 1
    assert extractors_to_add(1, **counts, num_workers=None, demand=True) == 1
    assert extractors_to_add(0, **counts, num_workers=None, demand=True) == 1


def test_the_pool_grows_as_gpu_nodes_join():
    """cluster.yaml's autoscaling: GPU workers from 0 to 8, one extractor per GPU node."""
    each = Extractor(cpus=1, gpus=1, memory=4 * GiB)
    nodes, running, shards = [HEAD], 0, 1000
    sizes = []
    for joined in range(9):
        if joined:
            nodes.append(gpu_node(f"g{joined}"))
        held = sum(extractors_held(Cluster(tuple(nodes)), each).values())
        running += extractors_to_add(held, running=running, starting=0, queued=shards,
                                     num_workers=None)  # fmt: skip
        sizes.append(running)
    assert sizes == [1, 1, 2, 3, 4, 5, 6, 7, 8]  # the first waits for the first node


def test_the_autoscaler_is_asked_for_the_target_once_the_nodes_do_not_hold_it():
    each = Extractor(cpus=1, gpus=1, memory=4 * GiB)
    bundle = {"CPU": 1.0, "GPU": 1.0, "memory": float(4 * GiB)}
    # the nodes hold the target: nothing asked
    assert autoscaler_request(each, target=2, held=2, asked=None) is None
    # they do not: the whole pool's room (the request is a size, not an addition)
    assert autoscaler_request(each, target=8, held=1, asked=None) == [bundle] * 8
    # asked already, unchanged: nothing new; the target shrinking: asked again, smaller
    assert autoscaler_request(each, target=8, held=8, asked=8) is None
    assert autoscaler_request(each, target=3, held=8, asked=8) == [bundle] * 3
    # a CPU extractor that asks for no memory: CPUs alone
    assert Extractor(cpus=4).bundle() == {"CPU": 4.0}


def test_the_sizing_keeps_extractors_that_wait_for_nodes():
    """``--device cuda`` on cluster.yaml's cluster before any GPU worker is up: one extractor
    (or ``--num-workers`` of them) waiting for nodes, each asking for what its statistics
    need; with some GPU nodes up, the memory fitted to those and the rest kept, not refused."""
    from embgeom_ray.config import build_config
    from embgeom_ray.sizing import Shape, size_extractors

    shape = Shape(layers=3, dim=128, positions=128, vocab=30_522, hidden_states=3,
                  intermediate=512, heads=2, weight_bytes=90 * 2**20, sample_entries=512)  # fmt: skip

    def pool(cluster: Cluster, **extra):
        options = build_config(None, {"model": "m", "corpus": "c", "out": "o", "device": "cuda",
                                      **extra}).scheduling  # fmt: skip
        return size_extractors(shape, 30_522, cluster, options, 1000, driver=2 * GiB)

    bare = Cluster((HEAD,))
    alone = pool(bare)
    assert (alone.num_workers, alone.num_gpus) == (1, 1)
    assert "no node holds an extractor yet" in alone.reason
    eight = pool(bare, num_workers=8)
    assert eight.num_workers == 8 and eight.memory == alone.memory
    assert "all 8 wait for nodes to join" in eight.reason
    some = pool(Cluster((HEAD, gpu_node("a"), gpu_node("b"))), num_workers=8)
    assert some.num_workers == 8 and "the nodes hold 2 of the 8 extractors now" in some.reason
    assert some.head_reserve == 2 * GiB  # what the growth leaves of the head's memory


def test_what_the_autoscalers_node_groups_hold():
    """cluster.yaml's node groups as an autoscaler that reports them shows them to Ray."""
    from embgeom_ray.sizing import NodeGroup, extractors_possible, pool_ceiling

    head = NodeGroup("head.cpu", cpus=0, memory=32 * GiB, max_count=1)
    gpus = NodeGroup("worker.gpu", cpus=8, gpus=1, memory=24 * GiB, max_count=8)
    one_gpu = Extractor(cpus=1, gpus=1, memory=4 * GiB)
    assert extractors_possible([head, gpus], one_gpu) == 8
    # four-GPU nodes, two extractors of two GPUs on each, at most 3 nodes; memory not stated
    quads = NodeGroup("worker.4gpu", cpus=32, gpus=4, max_count=3)
    assert extractors_possible([head, gpus, quads], Extractor(cpus=1, gpus=2)) == 6
    # CPU extractors of 4 CPUs: 2 on each GPU node, none on the head
    assert extractors_possible([head, gpus], Extractor(cpus=4)) == 16
    # nothing tells: no group, a group without a limit, no group that holds one
    assert extractors_possible([], one_gpu) is None
    assert extractors_possible([head, NodeGroup("w", cpus=8, gpus=1, max_count=None)], one_gpu) is None
    assert extractors_possible([head], one_gpu) is None
    # the ceiling: --num-workers, within what the groups hold
    assert pool_ceiling(None, None) is None
    assert pool_ceiling(None, 8) == 8
    assert pool_ceiling(4, 8) == 4 and pool_ceiling(16, 8) == 8 and pool_ceiling(4, None) == 4


def test_a_small_corpus_on_gpus_not_yet_up_is_sized_with_its_whole_statistics():
    """``--device cuda`` before any GPU node is up, over a corpus of a few types: the whole
    statistics S(V) + F are less than their per-layer floor plus a batch's growth, and that
    whole is then the least an extractor needs (it was refused as needing more memory than
    'the nodes hold', with 0 extractors)."""
    from embgeom_ray.config import build_config
    from embgeom_ray.sizing import Shape, size_extractors

    shape = Shape(layers=7, dim=384, positions=512, vocab=30_522, hidden_states=7,
                  intermediate=1536, heads=12, weight_bytes=90 * 2**20, sample_entries=4096)  # fmt: skip
    options = build_config(None, {"model": "m", "corpus": "c", "out": "o", "device": "cuda"}).scheduling
    pool = size_extractors(shape, 12, Cluster((HEAD,)), options, 1, driver=2 * GiB)
    assert (pool.num_workers, pool.num_gpus) == (1, 1)
    assert "no node holds an extractor yet" in pool.reason


def test_cuda_on_a_machine_without_gpus_is_refused_only_on_the_private_ray():
    """No GPU ever comes to the job's private local Ray: ``--device cuda`` there is one line;
    on a cluster the pool waits for GPU nodes to join; with a GPU, nothing to refuse."""
    from embgeom_ray.errors import ConfigError
    from embgeom_ray.sizing import check_device

    here = Cluster((Node("head", 8 * GiB, cpus=2, head=True),))
    with pytest.raises(ConfigError, match=r"--device cuda needs a GPU.*private local Ray of 2 CPUs"):
        check_device("cuda", here, private_local=True)
    check_device("cuda", here, private_local=False)
    check_device("auto", here, private_local=True)
    check_device("cuda", Cluster((HEAD, gpu_node("a"))), private_local=True)
