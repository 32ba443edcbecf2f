"""Models larger than one GPU (``--gpus-per-worker``), as far as it can be checked on a CPU:
statistics folded per device and combined, the balanced device map, the actors' requests.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embgeom_ray.config import build_config
from embgeom_ray.core.sketch import finite_layers
from embgeom_ray.core.split_statistics import SplitStatistics
from embgeom_ray.core.statistics import EmbeddingStatistics
from embgeom_ray.errors import ConfigError
from embgeom_ray.inputs.extractor import gpu_device_map
from embgeom_ray.inputs.model_loading import balanced_device_map
from tests.core.test_statistics import assert_same_state
from tests.tiny_models import make_tiny_llama

LAYERS = [0, 3, 6, 7]


@pytest.mark.parametrize(
    ("groups", "offset", "clip"),
    [([[0, 3], [6, 7]], 0.0, None), ([[0], [3, 6], [7]], 1e4, [2]), (None, 0.0, [1])],
)
def test_split_statistics_equal_a_one_device_fold(groups, offset, clip):
    """Layers folded in separate parts (as on the GPUs of a device map), combined at a
    flush: the same header and arrays as one object folding every layer, exactly. The split
    gets the batch's finite flags, as from the extractor; each part must take its own layers'
    (a NaN in layer 6 of one batch is left out there only)."""
    rng = np.random.default_rng(3)
    options = {"max_positions": 9, "metadata": {"model_fingerprint": "m"}, "clip_dims": clip,
               "comoment_precision": "float64"}  # fmt: skip
    split = SplitStatistics(LAYERS, 6, groups=groups, **options)
    one = EmbeddingStatistics(LAYERS, 6, **options)
    for batch in range(3):
        h = torch.as_tensor(rng.normal(size=(len(LAYERS), 4, 9, 6)) + offset)
        ids = torch.as_tensor(rng.integers(0, 30, size=(4, 9)))
        keep = torch.as_tensor(rng.random((4, 9)) > 0.2)
        keep[1, 2] = True
        if batch == 1:
            h[2, 1, 2, 0] = float("nan")
        split.update(list(h), ids, keep, finite=finite_layers(list(h)))
        one.update(h, ids, keep)
    assert one.layer(6).nonfinite == 1 and one.layer(7).nonfinite == 0
    assert len(split.parts) == (1 if groups is None else len(groups))  # CPU: one device
    assert split.nbytes() >= sum(a.nbytes for a in one.state_dict().values())
    back = EmbeddingStatistics.from_bytes(split.to_bytes())
    assert back.partition is None
    assert back.header() == one.header()
    assert_same_state(back, one)
    assert set(split.devices) == set(LAYERS)


def test_split_statistics_refuse_groups_that_miss_a_layer():
    with pytest.raises(ValueError, match="do not cover"):
        SplitStatistics(LAYERS, 6, groups=[[0, 3], [6]])


def test_balanced_device_map_splits_the_blocks_between_gpus(tmp_path):
    """accelerate's map of an empty-weight copy: no GPU needed to compute it."""
    model = make_tiny_llama(str(tmp_path / "llama"), num_layers=4, hidden=64, intermediate=128)
    plenty = {0: 2**30, 1: 2**30}
    device_map = balanced_device_map(model, None, "float32", False, plenty)
    assert set(device_map.values()) == {0, 1}
    blocks = {int(k.split(".")[1]): v for k, v in device_map.items() if k.startswith("layers.")}
    if blocks:  # per-block entries: contiguous, the first blocks on GPU 0
        order = [blocks[i] for i in sorted(blocks)]
        assert order == sorted(order) and order[0] == 0 and order[-1] == 1
    assert device_map.get("embed_tokens", 0) == 0
    with pytest.raises(ConfigError, match="does not fit 2 GPU"):
        balanced_device_map(model, None, "float32", False, {0: 4096, 1: 4096})


def test_a_worker_without_the_gpus_it_asks_for_says_so(tmp_path):
    cfg = build_config(None, {"model": "m", "corpus": "c", "out": "o", "gpus_per_worker": 2})
    with pytest.raises(ConfigError, match="needs 2 GPUs in each extractor, but this one sees 0"):
        gpu_device_map(cfg.extraction, "cpu")
    assert (
        gpu_device_map(
            build_config(None, {"model": "m", "corpus": "c", "out": "o"}).extraction, "cpu"
        )
        is None
    )


@pytest.mark.own_ray_cluster
def test_actors_ask_for_gpus_per_worker_on_one_node(tmp_path):
    """A simulated cluster with fake GPUs: a node of 4 and a node of 2."""
    import ray
    from ray.cluster_utils import Cluster

    from embgeom_ray.distributed.actor_pool import plan_pool

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    cluster.add_node(num_cpus=1, num_gpus=4)
    cluster.add_node(num_cpus=1, num_gpus=2)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        opts = {"model": "m", "corpus": "x", "out": str(tmp_path)}

        def plan(**extra):
            return plan_pool(build_config(None, opts | extra).scheduling, 10)

        assert (plan().num_workers, plan().num_gpus) == (6, 1.0)
        two = plan(gpus_per_worker=2)
        assert (two.num_workers, two.num_gpus) == (3, 2.0)  # 2 on the node of 4, 1 on the other
        four = plan(gpus_per_worker=4)
        assert (four.num_workers, four.num_gpus) == (1, 4.0)
        assert plan(gpus_per_worker=3).num_workers == 1
        with pytest.raises(ConfigError, match="largest node"):
            plan(gpus_per_worker=8)
        with pytest.raises(ConfigError, match="needs GPUs"):
            plan(gpus_per_worker=2, device="cpu")
    finally:
        ray.shutdown()
        cluster.shutdown()
