"""Scaling: workers, corpus size (memory), vocabulary and dimension (artefact), shards (reduce).

Four sections, each selectable with ``--sections`` (default: all four, in one JSON result):

throughput
    The whole job (:func:`embgeom_ray.runs.pipeline.analyze`) on MiniLM over the demo corpus, on a
    simulated multi-node cluster (``ray.cluster_utils.Cluster``: a head with 0 CPUs and two
    nodes of 1 CPU), with 1 and then 2 extractor workers of 1 CPU (1 torch thread) each, the
    corpus cut into ``--shards`` shards, a sample of ``--sample-size`` (512). Tokens/s = the
    manifest's token count / ``timings_s.extract_wall`` (actor start and model load included;
    the metrics after it are not). Printed: the ratio 2 workers / 1 worker (ideal 2.0). On a
    2-core machine the two nodes share the two cores, so 2 workers of 1 thread compete with
    1 worker of 1 thread only for memory bandwidth and caches (and with the driver, which
    checkpoints the shards). ``--address`` runs the section on that Ray cluster instead (this
    process's own where it has joined one already, e.g. the tests' local Ray of 2 CPUs), its
    nodes and CPUs as they are: no simulated cluster started, none shut down.
memory
    Extractor peak memory against corpus size: for each N in ``--copies``, a fresh Python
    process builds a :class:`~embgeom_ray.inputs.extractor.ShardProcessor` and processes the demo
    corpus repeated N times as *one* shard; it reports its peak RSS (``ru_maxrss``) and the RSS
    after loading the model. The peak must not grow with N. The processes run one after the
    other (``--memory-parallel``: concurrently, for quick checks; peaks are per process).
artefact
    Bytes of :meth:`EmbeddingStatistics.to_bytes` against the vocabulary V (types seen) and d:
    synthetic statistics over ``--layers`` layers, max_positions P = 128, folded from random
    activations of exactly V distinct token ids, against the formula
    ``8·(L·(V·(2d + 2) + d² + 3d + P·(d + 1) + 2) + V)`` (per layer and type: count, mean,
    M2, unit-vector sum; per layer: n, mean, co-moment, argmax/argmin counts, positional counts
    and means, non-finite count; type ids), plus the formula's value for full vocabularies.
reduce
    The driver's reduce against the number of shards: ``--reduce-shards`` synthetic shard
    statistics (MiniLM's shape: 7 layers, d = 384, P = 128; each ``--reduce-tokens`` tokens with
    Zipf-distributed ids over a 30,522-type vocabulary) are merged one by one, as
    :func:`~embgeom_ray.runs.pipeline.analyze` does (``from_bytes`` + ``merge``); only those two
    are timed (shards are generated and serialized untimed, one at a time, so memory stays
    bounded). Time for the first k shards, k in ``--reduce-shards``, and per shard.

    python -m bench.scaling [--sections throughput,memory,artefact,reduce] [--shards 8]
        [--copies 1,2,4] [--vocab 1000,10000] [--dims 384,768] [--reduce-shards 4,16,64]
        [--address ADDRESS]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import english_jsonl, median, minilm_dir, save, timed, work_dir
from embgeom_ray.core.statistics import state_bytes

SECTIONS = ("throughput", "memory", "artefact", "reduce")
ROOT = Path(__file__).resolve().parent.parent
MAX_POSITIONS = 128


def base_corpus(work: Path, tokens: int, repeat: int = 1) -> Path:
    """The demo corpus (or its first ~``tokens`` tokens when ``tokens`` > 0), ``repeat`` times."""
    full = Path(english_jsonl(work / "full.jsonl"))
    lines = full.read_text().splitlines(keepends=True)
    if tokens > 0:
        kept, chars = [], 0
        for line in lines:
            kept.append(line)
            chars += len(line)
            if chars > tokens * 5:  # ~5 characters per token in this prose
                break
        lines = kept
    path = work / f"corpus_{tokens}_x{repeat}.jsonl"
    if not path.exists():
        path.write_text("".join(lines) * repeat)
    return path


# ----------------------------------------------------------------------------- throughput
def section_throughput(args, work: Path) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from embgeom_ray.config import build_config
    from embgeom_ray.runs.pipeline import analyze

    corpus = base_corpus(work, args.tokens)
    shard_bytes = max(1024, corpus.stat().st_size // args.shards)
    cluster, joined = None, False
    if args.address:
        print(f"throughput: on the Ray cluster at {args.address}, its nodes as they are")
        if not ray.is_initialized():
            ray.init(address=args.address, log_to_driver=False, logging_level="ERROR")
            joined = True
    else:
        print(
            "throughput: simulated cluster (head 0 CPUs + 2 nodes of 1 CPU); on a 2-core machine "
            "2 workers of 1 thread compete with 1 worker of 1 thread only for memory bandwidth"
        )
        if ray.is_initialized():
            ray.shutdown()
        t0 = time.perf_counter()
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        for _ in range(2):
            cluster.add_node(num_cpus=1)
    runs: dict[int, list[dict]] = {1: [], 2: []}
    try:
        if cluster is not None:
            ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
            cluster.wait_for_nodes()
            print(f"  cluster up in {time.perf_counter() - t0:.1f}s")
        for rep in range(args.repeats):
            for workers in (1, 2) if rep % 2 == 0 else (2, 1):  # alternate which goes first
                cfg = build_config(
                    None,
                    {
                        "model": minilm_dir(),
                        "corpus": str(corpus),
                        "out": str(work / f"run_w{workers}_r{rep}"),
                        "num_workers": workers,
                        "cpus_per_worker": 1,
                        "shard_bytes": shard_bytes,
                        "sample_size": args.sample_size,
                        "kmeans_k_max": args.kmeans_k_max,
                        "no_report": True,  # measured: the extraction (and the job's total)
                    },
                )
                t, manifest = timed(lambda cfg=cfg: analyze(cfg, echo=lambda *_: None))
                tm = manifest["timings_s"]
                tokens = manifest["counts"]["tokens"]
                run = {
                    "workers": workers,
                    "shards": manifest["shards"]["total"],
                    "tokens": tokens,
                    "extract_wall_s": tm["extract_wall"],
                    "extract_busy_s": tm["extract_forward_sum"] + tm["extract_fold_sum"],
                    "job_total_s": tm["total"],
                    "timings_s": tm,
                    "analyze_wall_s": t,
                    "tokens_per_s": tokens / tm["extract_wall"],
                }
                runs[workers].append(run)
                print(
                    f"  workers={workers} shards={run['shards']} tokens={tokens:,} "
                    f"extract {tm['extract_wall']:.2f}s = {run['tokens_per_s']:,.0f} tok/s "
                    f"(forward+fold summed over workers {run['extract_busy_s']:.2f}s; "
                    f"job total {tm['total']:.2f}s)"
                )
    finally:
        if cluster is not None or joined:
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    tps = {w: median([r["tokens_per_s"] for r in rs]) for w, rs in runs.items()}
    ratio = tps[2] / tps[1]
    print(
        f"throughput 1 worker {tps[1]:,.0f} tok/s | 2 workers {tps[2]:,.0f} tok/s | "
        f"ratio 2/1 {ratio:.3f} (ideal 2.0; 2 workers share this machine's {os.cpu_count()} "
        "cores and its memory bandwidth)"
    )
    return {
        "corpus_bytes": corpus.stat().st_size,
        "shard_bytes": shard_bytes,
        "runs": {str(w): rs for w, rs in runs.items()},
        "tokens_per_s": {str(w): v for w, v in tps.items()},
        "ratio_2_to_1": ratio,
        "cluster": args.address or "simulated",
        "note": f"the Ray cluster at {args.address}, its nodes as they are"
        if args.address
        else "2 simulated nodes of 1 CPU on one machine: the workers share its cores and "
        "memory bandwidth",
    }


# --------------------------------------------------------------------------------- memory
def memory_child(corpus: str, threads: int) -> dict:
    """Run in a fresh process: load the extractor, fold the corpus as one shard, report RSS."""
    import resource

    import torch

    from embgeom_ray.config import build_config
    from embgeom_ray.inputs.corpus import CorpusSpec, plan_shards
    from embgeom_ray.inputs.extractor import ShardProcessor
    from embgeom_ray.inputs.model_loading import resolve_identity, resolve_layers

    def peak_mib() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux

    def rss_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    if threads:
        torch.set_num_threads(threads)
    model = minilm_dir()
    identity, _ = resolve_identity(model, None, False)
    layers = resolve_layers(None, identity.num_layers)
    cfg = build_config(None, {"model": model, "corpus": corpus, "out": "unused"})
    proc = ShardProcessor(cfg.extraction, layers, {"model_fingerprint": "bench"})
    loaded = rss_mib()
    shard = plan_shards(CorpusSpec(corpus), 1 << 40).shards[0]
    t, (stats, _sample, counts) = timed(lambda: proc.process(shard))
    return {
        "tokens": counts.tokens,
        "documents": counts.documents,
        "seconds": t,
        "rss_after_load_mib": loaded,
        "peak_rss_mib": peak_mib(),
        "statistics_types": stats.num_types,
        "docs_per_chunk": cfg.docs_per_chunk,
        "batch_tokens": proc.batch_tokens,
        "sample_size": cfg.sample_size,
    }


def section_memory(args, work: Path) -> dict:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    copies = [int(c) for c in args.copies.split(",")]

    def start(n: int) -> tuple[int, Path, subprocess.Popen]:
        corpus = base_corpus(work, args.tokens, n)
        code = (
            "import json; from bench.scaling import memory_child; "
            f"print('RESULT', json.dumps(memory_child({str(corpus)!r}, {args.threads})))"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        return n, corpus, proc

    def finish(n: int, corpus: Path, proc: subprocess.Popen) -> dict:
        stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"memory child for {n} copies failed:\n{stderr[-4000:]}")
        line = next(x for x in stdout.splitlines() if x.startswith("RESULT "))
        return {"copies": n, "corpus_bytes": corpus.stat().st_size} | json.loads(line[7:])

    if args.memory_parallel:  # peak RSS is per process; only the children's seconds suffer
        started = [start(n) for n in copies]
        results = [finish(*s) for s in started]
    else:
        results = [finish(*start(n)) for n in copies]
    for res in results:
        print(
            f"memory: {res['copies']}x corpus ({res['corpus_bytes'] / 1e6:.2f} MB, "
            f"{res['tokens']:,} tokens, one shard) peak RSS {res['peak_rss_mib']:,.0f} MiB "
            f"(after load {res['rss_after_load_mib']:,.0f} MiB) "
            f"ratio to {results[0]['copies']}x {res['peak_rss_mib'] / results[0]['peak_rss_mib']:.3f}"
        )
    growth = results[-1]["peak_rss_mib"] / results[0]["peak_rss_mib"]
    print(
        f"memory: peak RSS at {results[-1]['copies']}x / at {results[0]['copies']}x = "
        f"{growth:.3f} (flat = 1.0)"
    )
    return {"runs": results, "peak_ratio_largest_to_smallest": growth}


# ------------------------------------------------------------------------------- artefact
def artefact_formula(layers: int, vocab: int, dim: int, positions: int = MAX_POSITIONS) -> int:
    """Array bytes of a statistics artefact (float64/int64 everywhere; header not counted)."""
    return state_bytes(layers, dim, vocab, positions)


def synthetic_statistics(
    layers: int,
    dim: int,
    ids: np.ndarray,
    seed: int,
    chunk: int = 2048,
    metadata: dict[str, str] | None = None,
):
    """Statistics folded from random activations of the token ids ``ids`` (one per token)."""
    import torch

    from embgeom_ray.core.statistics import EmbeddingStatistics

    stats = EmbeddingStatistics(
        list(range(layers)), dim, max_positions=MAX_POSITIONS, metadata=metadata
    )
    gen = torch.Generator().manual_seed(seed)
    t = MAX_POSITIONS
    for start in range(0, len(ids), chunk):
        part = torch.from_numpy(np.asarray(ids[start : start + chunk], dtype=np.int64))
        rows = -(-len(part) // t)
        tok = torch.zeros(rows * t, dtype=torch.int64)
        tok[: len(part)] = part
        keep = torch.zeros(rows * t, dtype=torch.bool)
        keep[: len(part)] = True
        hidden = torch.randn(layers, rows, t, dim, generator=gen)
        stats.update(hidden, tok.view(rows, t), keep.view(rows, t))
    return stats


def section_artefact(args, work: Path) -> dict:
    results = []
    L = args.layers
    for dim in [int(d) for d in args.dims.split(",")]:
        for vocab in [int(float(v)) for v in args.vocab.split(",")]:
            ids = np.random.default_rng(0).permutation(vocab)  # each id once: V types
            stats = synthetic_statistics(L, dim, ids, seed=vocab + dim)
            assert stats.num_types == vocab
            t, data = timed(stats.to_bytes)
            formula = artefact_formula(L, vocab, dim)
            res = {
                "layers": L,
                "vocab": vocab,
                "dim": dim,
                "bytes": len(data),
                "formula_bytes": formula,
                "ratio_to_formula": len(data) / formula,
                "to_bytes_s": t,
                "per_type_layer_bytes": 8 * (2 * dim + 2),
            }
            results.append(res)
            print(
                f"artefact: L={L} V={vocab:6,d} d={dim:4d} {len(data) / 2**20:9.2f} MiB | formula "
                f"{formula / 2**20:9.2f} MiB ratio {res['ratio_to_formula']:.5f} | to_bytes {t:.2f}s"
            )
            del stats, data
    extrapolated = {
        "all-MiniLM-L6-v2 (L=7, V=30522, d=384)": artefact_formula(7, 30522, 384),
        "bert-base (L=13, V=30522, d=768)": artefact_formula(13, 30522, 768),
        "a 128k-vocab d=4096 33-layer model": artefact_formula(33, 128_000, 4096),
    }
    for name, b in extrapolated.items():
        print(f"artefact formula, every type seen: {name}: {b / 2**30:,.2f} GiB")
    return {"runs": results, "formula_every_type_seen_bytes": extrapolated}


# --------------------------------------------------------------------------------- reduce
def section_reduce(args, work: Path) -> dict:
    from embgeom_ray.core.statistics import EmbeddingStatistics

    L, dim, vocab = 7, 384, 30522
    rng = np.random.default_rng(0)
    rank_to_id = rng.permutation(vocab)
    p = 1.0 / np.arange(1, vocab + 1)
    p /= p.sum()
    checkpoints = sorted(int(k) for k in args.reduce_shards.split(","))
    metadata = {"model_fingerprint": "bench"}
    merged = EmbeddingStatistics(
        list(range(L)), dim, max_positions=MAX_POSITIONS, metadata=metadata
    )
    warm = synthetic_statistics(L, dim, rank_to_id[:64], seed=10**6, metadata=metadata).to_bytes()
    EmbeddingStatistics(list(range(L)), dim, max_positions=MAX_POSITIONS, metadata=metadata).merge(
        EmbeddingStatistics.from_bytes(warm)
    )  # warm-up, not timed
    reduce_s, gen_s, shard_bytes = 0.0, 0.0, []
    results = []
    for i in range(checkpoints[-1]):
        t0 = time.perf_counter()
        ids = rank_to_id[rng.choice(vocab, size=args.reduce_tokens, p=p)]
        data = synthetic_statistics(L, dim, ids, seed=i, metadata=metadata).to_bytes()
        t1 = time.perf_counter()
        merged.merge(EmbeddingStatistics.from_bytes(data))
        reduce_s += time.perf_counter() - t1
        gen_s += t1 - t0
        shard_bytes.append(len(data))
        del data
        if i + 1 in checkpoints:
            res = {
                "shards": i + 1,
                "reduce_s": reduce_s,
                "reduce_s_per_shard": reduce_s / (i + 1),
                "merged_types": merged.num_types,
                "mean_shard_bytes": float(np.mean(shard_bytes)),
            }
            results.append(res)
            print(
                f"reduce: {i + 1:4d} shards ({res['mean_shard_bytes'] / 2**20:.1f} MiB each, "
                f"{args.reduce_tokens:,} tokens) {reduce_s:7.3f}s = "
                f"{1000 * res['reduce_s_per_shard']:7.1f} ms/shard | merged types "
                f"{merged.num_types:,} | per shard / at {checkpoints[0]} shards "
                f"{res['reduce_s_per_shard'] / results[0]['reduce_s_per_shard']:.3f}"
            )
    return {
        "layers": L,
        "dim": dim,
        "tokens_per_shard": args.reduce_tokens,
        "runs": results,
        "generation_s_untimed": gen_s,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    p.add_argument("--tokens", type=int, default=0, help="base corpus: first ~N tokens (0: all)")
    p.add_argument("--shards", type=int, default=8, help="throughput: shards of the corpus")
    p.add_argument("--repeats", type=int, default=1, help="throughput: runs per worker count")
    p.add_argument("--address", default="", help="throughput: this Ray cluster, not a simulated one")
    p.add_argument("--sample-size", type=int, default=512, help="throughput: job's sample")
    p.add_argument(
        "--kmeans-k-max", type=int, default=15, help="throughput: job's K-means k range 2..K"
    )
    p.add_argument("--copies", default="1,2,4", help="memory: corpus repeated N times")
    p.add_argument("--threads", type=int, default=0, help="memory: torch threads (0: default)")
    p.add_argument(
        "--memory-parallel", action="store_true", help="memory: run the processes concurrently"
    )
    p.add_argument("--layers", type=int, default=7, help="artefact: layers L kept")
    p.add_argument("--vocab", default="1000,10000", help="artefact: types seen V")
    p.add_argument("--dims", default="384,768", help="artefact: hidden sizes d")
    p.add_argument("--reduce-shards", default="4,16,64", help="reduce: shard counts")
    p.add_argument("--reduce-tokens", type=int, default=8192, help="reduce: tokens per shard")
    p.add_argument("--name", default="scaling")
    args = p.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    with work_dir("scaling") as work:
        runners = {
            "throughput": section_throughput,
            "memory": section_memory,
            "artefact": section_artefact,
            "reduce": section_reduce,
        }
        result = {"command": "python -m bench.scaling", "args": vars(args)}
        for name in SECTIONS:
            if name in sections:
                t, result[name] = timed(lambda name=name: runners[name](args, work))
                print(f"[{name}: {t:.1f}s]")
    save(args.name, result)


if __name__ == "__main__":
    main()
