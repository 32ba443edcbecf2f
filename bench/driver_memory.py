"""The job's own process at 8B and 70B shapes: what its finishing steps add to its private memory.

Two parts, each in this process with a private local Ray of 2 CPUs, each measured as the peak
of the anonymous resident memory (``RssAnon``, sampled every 20 ms) above a start taken after
the same step ran once on something smaller (so that libraries loaded on first use, which
``DRIVER_RUN_BYTES`` holds, are not counted):

- **the sample**: two checkpoint groups' samples of ``--size`` uniform and as many
  type-uniform entries, ``--layers`` layers of d = ``--dims`` (random vectors), merged a
  layer at a time by Ray tasks (:mod:`embgeom_ray.distributed.sample_tasks`): every layer's
  sampled-stage inputs made and ``samples.parquet`` written from the tasks' pieces. Compare
  10 · Q_l, Q_l = 4·s·d + 48·s, which the driver held when it did this itself;
- **the layer states**: statistics of 4 layers of d = ``--state-dim`` on 2 reducer actors;
  the exact tables built with each layer analysed by its owner (now), and with each layer's
  state fetched into this process (before). Compare 8 · d² a layer.

    python -m bench.driver_memory [--dims 4096,8192] [--size 4096] [--layers 2] [--state-dim 2048]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

MIB = 2**20


def _tokens(ids):
    return [f"tok{i}" for i in ids]


def _sample_steps(urls: list[str], out: str) -> None:
    """What the driver does with a large sample: each layer's inputs by a task, then
    samples.parquet from the tasks' pieces."""
    import ray

    from embgeom_ray.core.sample_layers import sample_layers
    from embgeom_ray.distributed import sample_tasks
    from embgeom_ray.run_dir import RunDir
    from embgeom_ray.sizing.formulas import on_workers

    layered = sample_layers(urls)
    assert on_workers(layered)
    source, n = ray.put(layered), 0
    for layer in layered.layers:
        refs = sample_tasks.submit_inputs(source, layer, [])
        n = ray.get(refs[0])["uniform_points"]
        ray.wait(refs, num_returns=len(refs))
        del refs
    labels = {layer: np.arange(n) % 7 for layer in layered.layers}
    pieces = sample_tasks.table_pieces_on_ray(layered, _tokens, labels)
    RunDir(out).write_samples(layered, _tokens, labels, pieces)


def _growth(step) -> int:
    """Peak private bytes above the start while ``step()`` runs."""
    from embgeom_ray.distributed.process_memory import anon_bytes, sampler

    peak = sampler()
    base = anon_bytes()
    peak.peak = base
    step()
    return peak.peak_bytes() - base


def sample_part(dims: list[int], size: int, layers: int, tmp: Path) -> list[dict]:
    from tests.runs.test_sample_layers import fake_sample

    rows = []
    for i, d in enumerate([dims[0], *dims]):  # the first once more: the warm-up
        here = tmp / f"s{i}"
        here.mkdir()
        urls = []
        for g, seed in enumerate((11, 12)):
            url = str(here / f"g{g}.sample.safetensors")
            fake_sample(size, seed, layers=list(range(layers)), dim=d, size=size).save(url)
            urls.append(url)
        grew = _growth(lambda urls=urls, here=here: _sample_steps(urls, str(here / "run")))
        if i:
            q_l = 4 * 2 * size * d + 48 * 2 * size
            rows.append({"d": d, "Q_l MiB": q_l / MIB, "10·Q_l MiB": 10 * q_l / MIB,
                         "driver above start MiB": grew / MIB})  # fmt: skip
    return rows


def state_part(d: int, tmp: Path) -> dict:
    import torch

    from embgeom_ray.config import build_config
    from embgeom_ray.core.statistics import EmbeddingStatistics
    from embgeom_ray.core.tables import build_tables_from
    from embgeom_ray.distributed.reducers import PartitionedStatistics, PartitionPlan

    layers, rng, urls = list(range(4)), np.random.default_rng(0), []
    for g in range(2):
        stats = EmbeddingStatistics(layers, d, max_positions=128, metadata={"model_fingerprint": "m"})
        h = torch.from_numpy(rng.normal(size=(len(layers), 4, 64, d)))
        stats.update(list(h), torch.from_numpy(rng.integers(0, 500, (4, 64))), torch.ones(4, 64, dtype=torch.bool))
        urls.append(str(tmp / f"g{g}.safetensors"))
        stats.save(urls[-1])

    class Tok:
        convert_ids_to_tokens = staticmethod(_tokens)

    opts = build_config(None, {"model": "m", "corpus": "c", "out": "o"}).tables
    parts = PartitionedStatistics(PartitionPlan.of(2, 1000, layers), urls)
    try:
        def owners() -> None:
            parts.tables(Tok, opts, lambda df: None)

        def here() -> None:
            build_tables_from(parts.layer_states(), lambda la, m: parts.summaries(la, m, opts.min_count),
                              Tok, opts, lambda df: None)  # fmt: skip

        owners(), here()  # warm-up
        return {"d": d, "8·d² MiB": 8 * d * d / MIB, "analysed by owners MiB": _growth(owners) / MIB,
                "states fetched here MiB": _growth(here) / MIB}  # fmt: skip
    finally:
        parts.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="4096,8192")
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--state-dim", type=int, default=2048)
    args = ap.parse_args()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        for row in sample_part([int(x) for x in args.dims.split(",")], args.size, args.layers, Path(tmp)):
            print("sample:", {k: round(v, 1) for k, v in row.items()})
        print("states:", {k: round(v, 1) for k, v in state_part(args.state_dim, Path(tmp)).items()})


if __name__ == "__main__":
    main()
