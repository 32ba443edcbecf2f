"""Memory per process against the vocabulary and the number of reducers (issue 17's bench).

A random-weight model of Llama architecture with a WordLevel tokenizer of V entries built here
(``<unk> <s> </s> <pad>`` then ``w4 … w{V-1}``), shrunk to ``--dim`` and ``--blocks`` so it runs
on a laptop with Llama 3's proportions otherwise (MLP 3.5 d, heads of 128 dimensions, one
key/value head per 4: ``--ffn-mult``, ``--kv-group``), and a generated corpus of ``--tokens`` words: half drawn uniformly over the
vocabulary (so most types are seen: 1 − e^(−tokens/2V) of them), half Zipf-distributed (the
frequent types of real text). For every V in ``--vocab`` and R in ``--reducers`` the whole job
(:func:`~embgeom_ray.runs.pipeline.analyze`) runs in a fresh process with a private local Ray
and one extractor; the manifest's ``memory`` gives the peak resident memory of the driver, the
extractor and each reducer, printed against the per-type state of the formula
8 · L · V_seen · (2d + 2) bytes (:func:`~embgeom_ray.core.statistics.state_bytes`). With
``--reducer-memory B`` the job chooses the number of reducers (at least R) and each reducer's
peak must stay within B.

What to look for: with R = 1 the driver holds the merged statistics (and a group while
merging), so its peak grows with V · d; with R > 1 it must not, and each reducer holds about
its 1/R share plus its part of one checkpoint group being read. With ``--worker-memory`` the
extractor's private memory stays near its budget. Two numbers per process: the peak private
(anonymous) memory, the process's own heap, which the formulas predict; and the peak resident
set, which also counts the pages of Ray's shared object store the process wrote or read (spilled
pieces, flushed groups).

Before the jobs, for every V, the fold's cost against the forward's is measured in this process
over the same batches (``--fold-tokens``; median of 3, fresh statistics each time): the fold
per token must not grow with V.

On a GPU (``--device cuda --dtype bfloat16 --no-jobs``: the fold measurement needs no Ray),
the clocks are read after the device has finished, the statistics' peak device memory is
printed against the formula, and ``--profile`` lists the kernels of one steady fold.

    python -m bench.vocabulary [--vocab 32000,128256] [--reducers 1,4] [--dim 128]
        [--blocks 4] [--ffn-mult 3.5] [--kv-group 4] [--reducer-memory 1GiB] [--tokens 300000] [--worker-memory 256MiB] [--fold-tokens 100000]
        [--fold-budget 256MiB] [--device cuda] [--dtype bfloat16]
        [--comoment-precision float64] [--batch-tokens 8192] [--profile]
        [--no-jobs]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd

from bench.common import save, work_dir
from embgeom_ray.core.statistics import state_bytes

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
MIB = 2**20


#: Llama 3's proportions (8B: d = 4096, MLP 14,336 = 3.5 d, 32 heads of 128 dimensions, 8 of
#: them for keys and values): the shrunk bench model keeps them by default
FFN_MULT, HEAD_DIM, KV_GROUP = 3.5, 128, 4


#: ``--comoment-precision`` also takes these: the bounded product with some of this checkout's
#: switches set (module of ``embgeom_ray.core``, switch, value), wherever the fold runs: on int8
#: units by the Triton kernel (``core/integer_syrk.py``), or the default product with the fold's
#: pass 1 in Triton (``core/segment_sums.py``)
VARIANTS: dict[str, tuple[tuple[str, str, bool], ...]] = {
    "bounded-int8-triton": (
        ("statistics", "INTEGER_PRODUCT", True), ("integer_gram", "TRITON_SYRK", True),
    ),
    "bounded-triton-sums": (("segment_sums", "TRITON_SUMS", True),),
}  # fmt: skip


@contextlib.contextmanager
def switches(precision: str) -> Iterator[None]:
    """The switches of ``precision`` where it is one of :data:`VARIANTS`; as before afterwards."""
    import importlib

    changes = [
        (importlib.import_module(f"embgeom_ray.core.{module}"), name, value)
        for module, name, value in VARIANTS.get(precision, ())
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in changes]
    for module, name, value in changes:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def parse_bytes(text: str) -> int:
    """A size such as ``256MiB`` in bytes (pydantic's ByteSize, as the job's options)."""
    from pydantic import ByteSize, TypeAdapter

    return int(TypeAdapter(ByteSize).validate_python(text))


def wordlevel_tokenizer(vocab: int):
    """A fast tokenizer of ``vocab`` entries mapping the words ``w{i}`` to id i (i ≥ 4), after
    ``<unk> <s> </s> <pad>``; it adds ``<s>`` before a text, as Llama's does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = {tok: i for i, tok in enumerate(SPECIALS)} | {f"w{i}": i for i in range(4, vocab)}
    backend = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>",
    )  # fmt: skip


def wordlevel_llama_dir(
    path: Path,
    vocab: int,
    dim: int,
    blocks: int,
    *,
    ffn_mult: float = FFN_MULT,
    head_dim: int = HEAD_DIM,
    kv_group: int = KV_GROUP,
) -> str:
    """A random LlamaModel whose tokenizer maps the words ``w{i}`` to id i (i ≥ 4).

    Shaped as Llama 3 shrunk to width ``dim``: an MLP of ``ffn_mult`` · dim, heads of
    ``head_dim`` dimensions (at least 2 heads), one key/value head per ``kv_group`` query heads
    (grouped-query attention; at least one). The forward's cost per token and block is then
    ~(2 + 2/kv_group + 3 · ffn_mult) · d² multiply-adds plus attention, as in the real models.
    """
    import torch
    from transformers import LlamaConfig, LlamaModel

    tokenizer = wordlevel_tokenizer(vocab)
    torch.manual_seed(0)
    heads = max(2, dim // head_dim)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=dim, num_hidden_layers=blocks, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // kv_group), intermediate_size=round(ffn_mult * dim),
        max_position_embeddings=256,
        pad_token_id=3, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    LlamaModel(config).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


def generated_corpus(path: Path, vocab: int, tokens: int, seed: int = 0) -> str:
    """Documents of 100 words: half uniform over the vocabulary, half Zipf (a = 1.2)."""
    rng = np.random.default_rng(seed)
    half = tokens // 2
    ids = np.concatenate([
        rng.integers(4, vocab, size=half),
        4 + np.minimum(rng.zipf(1.2, size=tokens - half) - 1, vocab - 5),
    ])  # fmt: skip
    rng.shuffle(ids)
    with path.open("w") as f:
        for a in range(0, len(ids), 100):
            f.write(json.dumps({"text": " ".join(f"w{i}" for i in ids[a : a + 100])}) + "\n")
    return str(path)


def fold_and_forward(
    model: str,
    corpus: str,
    tokens: int,
    repeats: int = 3,
    budget: int | None = None,
    options: dict | None = None,
    profile: bool = False,
) -> dict:
    """In this process, over the same batches of the first ``tokens`` words: the forward's
    and the fold's seconds (median of ``repeats``, each fold into fresh statistics, as an
    extractor's first interval), their ratio, and the fold's again into the same statistics
    (every type seen: the steady state of a long run). With ``budget`` (bytes), also the fold
    as an extractor under ``--worker-memory`` does it (:class:`SpillingStatistics`, each
    spill copied as ``ray.put`` copies it), into one accumulator cleared by each spill: the
    steady run's statistics, cleared, as an extractor's accumulator is after its first
    flush (its arrays already allocated and written).

    ``options`` are more of the job's options (``device``, ``dtype``, ``batch_tokens``,
    ``comoment_precision``). On a GPU every clock is read after the device has finished
    (``torch.cuda.synchronize``), the statistics' peak device memory is reported, and with
    ``profile`` the kernels of one steady fold are listed by device time."""
    import torch

    from bench.common import median
    from embgeom_ray.config import build_config
    from embgeom_ray.core.spilling import SpillingStatistics
    from embgeom_ray.counts import Counts
    from embgeom_ray.inputs.corpus import CorpusSpec, ReadReport, plan_shards, read_shard
    from embgeom_ray.inputs.extractor import ShardProcessor
    from embgeom_ray.inputs.model_loading import resolve_identity, resolve_layers

    identity, _ = resolve_identity(model, None, False)
    layers = resolve_layers(None, identity.num_layers)
    cfg = build_config(
        None,
        {
            "model": model, "corpus": corpus, "out": "unused", "max_length": 128,
            "sample_size": 0, **(options or {}),
        },
    )  # fmt: skip
    proc = ShardProcessor(cfg.extraction, layers, {"model_fingerprint": "bench"})
    cuda = proc.device == "cuda"

    def clock() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    shard = plan_shards(CorpusSpec(corpus), 1 << 40).shards[0]
    with torch.inference_mode():
        batches, n = [], 0
        for batch in proc.batches(read_shard(shard, proc.corpus, ReadReport()), Counts()):
            batches.append(batch)
            n += batch.num_tokens
            if n >= tokens:
                break
        forward, fold, seen, spilling, spills = [], [], [], [], 0
        state_peak = 0
        for _ in range(repeats):
            t0 = clock()
            hidden = [proc.forward(b) for b in batches]
            forward.append(clock() - t0)
            stats = proc.new_statistics()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = clock()
            for b, h in zip(batches, hidden, strict=True):
                stats.update(h, b.input_ids, b.keep)
            fold.append(clock() - t0)
            t0 = clock()  # again into the same statistics: no type is new
            for b, h in zip(batches, hidden, strict=True):
                stats.update(h, b.input_ids, b.keep)
            seen.append(clock() - t0)
            if cuda:
                state_peak = torch.cuda.max_memory_allocated() - base
            types = stats.num_types
            if budget is not None:
                stats.clear()  # the accumulator an extractor keeps, as a spill leaves it
                under = SpillingStatistics(
                    stats, budget, lambda data: len(np.array(data, copy=True)), spill_copies=True
                )
                t0 = clock()
                for b, h in zip(batches, hidden, strict=True):
                    under.update(h, b.input_ids, b.keep)
                spilling.append(clock() - t0)
                spills = under.spills
            if profile:
                profile, table = False, profile_fold(stats, batches, hidden, cuda)
                print(table, flush=True)
            del hidden, stats
    blocks = identity.num_layers
    return {
        "tokens": n,
        "types": types,
        "layers": len(layers),
        "blocks": blocks,
        "dim": proc.dim,
        "device": proc.device,
        "dtype": cfg.extraction.dtype,
        "comoment_precision": cfg.extraction.comoment_precision,
        "batch_tokens": proc.batch_tokens,
        # per token: the forward's per block, the fold's per layer (a model of B blocks folding
        # all B + 1 layers then has fold/forward = (B + 1) · fold_layer / (B · forward_block))
        "forward_us_per_token_block": 1e6 * median(forward) / n / blocks,
        "fold_seen_us_per_token_layer": 1e6 * median(seen) / n / len(layers),
        "state_peak_device_bytes": state_peak if cuda else None,
        "state_bytes_formula": state_bytes(len(layers), proc.dim, types, 128),
        "forward_s": median(forward),
        "fold_s": median(fold),
        "fold_over_forward": median(fold) / median(forward),
        "fold_us_per_token": 1e6 * median(fold) / n,
        # the steady state of a long run: every type already seen
        "fold_seen_over_forward": median(seen) / median(forward),
        "fold_seen_us_per_token": 1e6 * median(seen) / n,
        **(
            {}
            if budget is None
            else {
                "budget_bytes": budget,
                "spills": spills,
                "fold_budget_over_forward": median(spilling) / median(forward),
                "fold_budget_us_per_token": 1e6 * median(spilling) / n,
            }
        ),
    }


def profile_fold(stats, batches, hidden, cuda: bool, rows: int = 18) -> str:
    """The kernels (operators on a CPU) of one more steady fold, by their own device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for b, h in zip(batches, hidden, strict=True):
            stats.update(h, b.input_ids, b.keep)
        if cuda:
            import torch

            torch.cuda.synchronize()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


CHILD = """
import json, sys
from embgeom_ray.config import build_config
from embgeom_ray.runs.pipeline import analyze
m = analyze(build_config(None, json.loads(sys.argv[1])), echo=lambda *_: None)
keys = ("memory", "counts", "timings_s", "reducers", "shards", "workers")
print("MANIFEST " + json.dumps({k: m.get(k) for k in keys}))
"""


def run_job(model: str, corpus: str, out: Path, reducers: int, args) -> dict:
    options = {
        "model": model, "corpus": corpus, "out": str(out), "address": "local",
        "reducers": reducers, "num_workers": 1, "max_length": 128, "layers": None,
        "sample_size": args.sample_size, "kmeans_k_max": 4, "comoment_precision": "float32",
        "worker_memory": args.worker_memory, "shard_bytes": args.shard_bytes,
        "reducer_memory": args.reducer_memory,
    }  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(options)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"the job failed (R={reducers}):\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("MANIFEST "))
    return json.loads(line[len("MANIFEST ") :])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", default="32000,128256", help="vocabulary sizes V")
    p.add_argument("--reducers", default="1,4", help="reducer counts R")
    p.add_argument("--dim", type=int, default=128, help="hidden size d")
    p.add_argument("--blocks", type=int, default=4, help="transformer blocks (L = blocks + 1)")
    p.add_argument(
        "--ffn-mult", type=float, default=FFN_MULT, help="MLP width / d (Llama 3: 3.5)"
    )
    p.add_argument(
        "--kv-group", type=int, default=KV_GROUP, help="query heads per key/value head (Llama 3: 4)"
    )
    p.add_argument("--tokens", type=int, default=300_000, help="corpus words")
    p.add_argument("--sample-size", type=int, default=256, help="the job's sample")
    p.add_argument(
        "--worker-memory", default=None, help="the job's --worker-memory (e.g. 256MiB)"
    )
    p.add_argument("--shard-bytes", type=int, default=None, help="the job's --shard-bytes")
    p.add_argument(
        "--reducer-memory",
        default=None,
        help="the job's --reducer-memory (e.g. 1GiB): the reducers' count then follows from it",
    )
    p.add_argument(
        "--fold-tokens",
        type=int,
        default=100_000,
        help="tokens of the in-process fold/forward measurement (0: skip it)",
    )
    p.add_argument(
        "--fold-budget",
        default=None,
        help="also fold under this --worker-memory (e.g. 256MiB): spills cleared in place",
    )
    p.add_argument("--device", default="auto", help="the fold measurement's --device")
    p.add_argument("--dtype", default="float32", help="the fold measurement's model --dtype")
    p.add_argument(
        "--comoment-precision",
        default="float32",
        help="the fold measurement's co-moment precisions (comma-separated: each is measured; "
        f"{', '.join(VARIANTS)}: bounded, with its Triton kernels)",
    )
    p.add_argument(
        "--batch-tokens",
        default="8192",
        help="the fold measurement's --batch-tokens (comma-separated: each is measured; "
        "auto: the size the job picks for the model on the device)",
    )
    p.add_argument(
        "--profile", action="store_true", help="list the kernels of one steady fold per V"
    )
    p.add_argument(
        "--jobs", action=argparse.BooleanOptionalAction, default=True, help="run the jobs"
    )
    p.add_argument("--name", default="vocabulary")
    args = p.parse_args(argv)
    fold_budget = None if args.fold_budget is None else parse_bytes(args.fold_budget)
    with work_dir("vocabulary") as work:
        layers = args.blocks + 1
        rows, folds = [], []
        for vocab in (int(v) for v in args.vocab.split(",")):
            model = wordlevel_llama_dir(
                work / f"model-{vocab}", vocab, args.dim, args.blocks, ffn_mult=args.ffn_mult,
                kv_group=args.kv_group,
            )  # fmt: skip
            corpus = generated_corpus(work / f"corpus-{vocab}.jsonl", vocab, args.tokens)
            for batch_tokens, precision in itertools.product(
                [None if b == "auto" else int(b) for b in args.batch_tokens.split(",")]
                if args.fold_tokens
                else [],
                args.comoment_precision.split(","),
            ):
                variant = precision in VARIANTS
                options = {
                    "device": args.device, "dtype": args.dtype,
                    "comoment_precision": "bounded" if variant else precision,
                    "batch_tokens": batch_tokens,
                }  # fmt: skip
                with switches(precision):
                    f = fold_and_forward(
                        model, corpus, args.fold_tokens, budget=fold_budget, options=options,
                        profile=args.profile,
                    )  # fmt: skip
                if variant:
                    f["comoment_precision"] = precision
                folds.append({"vocab": vocab, **f})
                peak = f["state_peak_device_bytes"]
                print(
                    f"V={vocab:7,d} d={f['dim']} {f['device']} {f['dtype']} co-moment "
                    f"{f['comoment_precision']} batch {f['batch_tokens']:,} tokens: forward "
                    f"{f['forward_us_per_token_block']:.3f} µs/token/block, steady fold "
                    f"{f['fold_seen_us_per_token_layer']:.3f} µs/token/layer"
                    + (
                        ""
                        if peak is None
                        else f"; statistics' peak device memory {peak / MIB:,.0f} MiB "
                        f"(formula {f['state_bytes_formula'] / MIB:,.0f} MiB)"
                    ),
                    flush=True,
                )
                print(
                    f"V={vocab:7,d} in-process over {f['tokens']:,} tokens ({f['types']:,} "
                    f"types): forward {f['forward_s']:.2f}s fold {f['fold_s']:.2f}s "
                    f"({f['fold_us_per_token']:.1f} µs/token) fold/forward "
                    f"{f['fold_over_forward']:.3f}; types already seen: "
                    f"{f['fold_seen_us_per_token']:.1f} µs/token, fold/forward "
                    f"{f['fold_seen_over_forward']:.3f}"
                    + (
                        ""
                        if fold_budget is None
                        else f"; under --worker-memory {args.fold_budget} ({f['spills']} "
                        f"spills): {f['fold_budget_us_per_token']:.1f} µs/token, fold/forward "
                        f"{f['fold_budget_over_forward']:.3f}"
                    ),
                    flush=True,
                )
            for reducers in (int(r) for r in args.reducers.split(",")) if args.jobs else ():
                out = work / f"run-{vocab}-{reducers}"
                m = run_job(model, corpus, out, reducers, args)
                seen = int(pd.read_parquet(out / "layers.parquet")["n_types"].max())
                shutil.rmtree(out, ignore_errors=True)
                mem = m["memory"]
                per_type = state_bytes(layers, args.dim, seen, 0) - state_bytes(
                    layers, args.dim, 0, 0
                )
                row = {
                    "vocab": vocab,
                    "reducers": reducers,
                    "tokens": m["counts"]["tokens"],
                    "per_type_state_seen_mib": per_type / MIB,
                    "driver_peak_mib": mem["driver_peak_rss_bytes"] / MIB,
                    "extractor_peak_mib": mem.get("extractor_peak_rss_bytes", 0) / MIB,
                    "reducer_peak_mib": [x / MIB for x in mem.get("reducer_peak_rss_bytes", [])],
                    "driver_private_mib": (mem.get("driver_peak_private_bytes") or 0) / MIB,
                    "extractor_private_mib": (mem.get("extractor_peak_private_bytes") or 0) / MIB,
                    "reducer_private_mib": [
                        (x or 0) / MIB for x in mem.get("reducer_peak_private_bytes", [])
                    ],
                    "spills": (m.get("workers") or {}).get("spills"),
                    "reducer_count": (m.get("reducers") or {}).get("count", 1),
                    "reducer_budget_mib": (
                        None
                        if (m.get("reducers") or {}).get("memory_budget_bytes") is None
                        else m["reducers"]["memory_budget_bytes"] / MIB
                    ),
                    "timings_s": m["timings_s"],
                    "shards": m["shards"],
                    "workers": m["workers"],
                    "types_seen": seen,
                    # the fold's cost per token against the forward's, summed over the shards
                    "fold_over_forward": m["timings_s"]["extract_fold_sum"]
                    / max(m["timings_s"]["extract_forward_sum"], 1e-9),
                }
                rows.append(row)
                reducer = max(row["reducer_peak_mib"], default=0.0)
                reducer_private = max(row["reducer_private_mib"], default=0.0)
                print(
                    f"V={vocab:7,d} R={row['reducer_count']} (budget {row['reducer_budget_mib']} MiB) tokens={row['tokens']:,} seen={seen:,} | per-type state "
                    f"{row['per_type_state_seen_mib']:7.1f} MiB | peak private (resident) MiB: "
                    f"driver {row['driver_private_mib']:7.1f} ({row['driver_peak_mib']:7.1f}) "
                    f"extractor {row['extractor_private_mib']:7.1f} ({row['extractor_peak_mib']:7.1f}) "
                    f"largest reducer {reducer_private:7.1f} ({reducer:7.1f}) | spills {row['spills']} | "
                    f"reduce {m['timings_s'].get('reduce', 0):.1f}s metrics "
                    f"{m['timings_s'].get('metrics', 0):.1f}s write {m['timings_s'].get('write', 0):.1f}s"
                    f" | shards {m['shards']['total']} groups {m['shards']['checkpoint_groups']}"
                    f" | fold/forward {row['fold_over_forward']:.3f}"
                )
    save(
        args.name,
        {"command": "python -m bench.vocabulary", "args": vars(args), "folds": folds, "runs": rows},
    )


if __name__ == "__main__":
    main()
