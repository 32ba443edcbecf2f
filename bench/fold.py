"""The fold alone: this checkout's ``EmbeddingStatistics.update`` against an earlier revision's,
alternately in one process, on one device.

Batches of synthetic hidden states, as an extractor folds them: ``--batch-tokens`` tokens a
batch as windows of ``--max-length``, the model dtype ``--dtype`` (bf16 by default: standard
normal values, one dimension offset by 100, a rogue dimension), token ids half uniform over
``--vocab`` and half Zipf-distributed (a = 1.2, as ``bench.vocabulary``'s corpus), positions
counted (``max_positions = --max-length``, as the job does), ``--layers`` hidden states a
batch (one tensor passed for every layer: the fold's cost does not depend on the values).
Both accumulators first fold the ``--warmup`` batches, so that every type of the timed batch
is already seen (the steady state of a long run); then each folds the timed batch
``--repeats`` times, alternately, the device synchronised before each clock read. Printed per
width and co-moment precision: the fold's µs per token and layer, baseline and current, their
ratio, and whether the two accumulators hold the same state afterwards (counts and tails
exactly, moments to 1e-12 relative: an optimisation must not change what is computed). On
CUDA also how many times one update makes the host wait for the device (``host_syncs``:
``torch.cuda.set_sync_debug_mode`` warnings; each stalls the kernels the host could queue).

``--comoment-precision`` lists the co-moment precisions to time, each as ``CURRENT:BASELINE``
where the two differ (the baseline may predate a precision: ``bounded:float32`` times this
checkout's default against the default before it, 2026-11-27); a plain ``P`` is ``P:P``.
``--integer-product`` runs this checkout's bounded product on int8 units on any device
(``statistics.INTEGER_PRODUCT``; by default on CUDA only).

``--products int8-triton,int8-int-mm`` also folds with this checkout's bounded product on int8
units (``statistics.INTEGER_PRODUCT``), its products in one Triton kernel
(``integer_gram.TRITON_SYRK``, ``core/integer_syrk.py``) or by ``torch._int_mm``, alternated
with the others; printed against this checkout's default fold (on Hopper its float64 product).
``--products triton-sums`` folds with this checkout's pass 1 in Triton (the tails, per-type,
unit-vector and per-position sums read once from the model's rows: ``core/segment_sums.py``,
``segment_sums.TRITON_SUMS``) and its per-type merge in one Triton kernel, the default product; on a CPU (no Triton there, or its
interpreter) that entry folds as the default does.

Beside each of this checkout's folds, its co-moment product alone is timed on the same
batch, alternated with the folds: the kept rows shifted by their mean, multiplied as that fold
multiplies them (``gram.add_gram`` in float64, or float32 for ``float32``; for the bounded
product on int8 units, its residues, products and reconstruction, as ``bench.comoment``'s
``int8_upper`` and ``int8_triton``). Printed as ``product_us_per_token_layer`` and
``fold_to_product``, the fold's time over its product's: issue 53's first target (≤ 1.2),
measured side by side in one process.

``--gram-blocks K`` runs this checkout's co-moment product in K column blocks on a GPU
(``gram.GPU_GRAM_BLOCKS``, 8 by default), the baseline's as it is.

``--scatter`` also times the per-type sums of one batch's float64 rows, sorted by type, three
ways: ``index_add_`` (what the fold does on CPUs), ``torch.segment_reduce`` and a CSR matrix
product (the GPU fold's); and of the same rows in ``--dtype`` without a float64 copy: one
float32 ``index_add_`` or CSR product (one piece, no bound) and the float32 error-free split
(``group_sums.split_sums``, within 2^-36 of each column's largest value; its levels for the
batch's largest type), each with its error against the float64 sums of those rows.
``--scatter-only`` times only these. ``--profile`` lists the operators (kernels on a GPU) of
one more steady fold of this checkout (and of each ``--products`` entry), by their own time.
``--split-sums`` also folds with this checkout's per-type and per-position sums in float32 by
the split (``statistics.SPLIT_SUMS``), alternated with the others, and prints its time against
this checkout's default fold.

    python -m bench.fold [--device cuda] [--dims 2048,4096] [--batch-tokens 65536]
        [--baseline 7975c32 | --baseline path/to/embgeom_ray]
        [--comoment-precision bounded:float32,bounded:float64,float64] [--integer-product]
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from bench.common import baseline_module, median, save, work_dir
from embgeom_ray.core.group_sums import GroupMatrix, split_levels, split_sums
from embgeom_ray.core.statistics import EmbeddingStatistics

#: the last revision before the GPU fold's argmax tails and reused float64 copy
BASELINE = "7975c32"
#: ``--products``: the settings of this checkout's fold for each extra entry
PRODUCTS: dict[str, dict[str, bool]] = {
    "int8-triton": {"INTEGER_PRODUCT": True, "TRITON_SYRK": True},
    "int8-int-mm": {"INTEGER_PRODUCT": True, "TRITON_SYRK": False},
    "triton-sums": {"TRITON_SUMS": True},
}


def product_settings(name: str) -> None:
    """Set this checkout's product switches for the entry ``name`` (defaults for the others)."""
    from embgeom_ray.core import integer_gram, segment_sums, statistics

    wanted = PRODUCTS.get(name, {})
    statistics.INTEGER_PRODUCT = wanted.get("INTEGER_PRODUCT", DEFAULT_PRODUCT["INTEGER_PRODUCT"])
    integer_gram.TRITON_SYRK = wanted.get("TRITON_SYRK", DEFAULT_PRODUCT["TRITON_SYRK"])
    segment_sums.TRITON_SUMS = wanted.get("TRITON_SUMS", DEFAULT_PRODUCT["TRITON_SUMS"])


#: the switches as the command line leaves them (``--integer-product``), set by main
DEFAULT_PRODUCT: dict[str, bool | None] = {
    "INTEGER_PRODUCT": None, "TRITON_SYRK": None, "TRITON_SUMS": False,
}  # fmt: skip


def token_ids(n: int, vocab: int, rng: np.random.Generator) -> np.ndarray:
    """n ids: half uniform over 4..vocab − 1, half Zipf (a = 1.2) from id 4 (ids 0–3 special)."""
    half = n // 2
    uniform = rng.integers(4, vocab, size=half)
    zipf = 4 + np.minimum(rng.zipf(1.2, size=n - half) - 1, vocab - 5)
    ids = np.concatenate([uniform, zipf])
    rng.shuffle(ids)
    return ids


def batches(args, d: int, dev: torch.device, dtype: torch.dtype) -> list[tuple[Any, ...]]:
    """``--warmup`` + 1 batches (hidden, ids, keep, positions); the last is the timed one."""
    rng = np.random.default_rng(0)
    gen = torch.Generator(device=dev).manual_seed(0)
    t = args.max_length
    b = max(1, args.batch_tokens // t)
    out = []
    for _ in range(args.warmup + 1):
        h = torch.randn(b, t, d, generator=gen, device=dev, dtype=torch.float32)
        h[..., 1] += 100.0  # a rogue dimension
        ids = torch.as_tensor(token_ids(b * t, args.vocab, rng).reshape(b, t), device=dev)
        keep = torch.ones(b, t, dtype=torch.bool, device=dev)
        keep[:, 0] = False  # a special token at the start of each window
        pos = torch.arange(t, device=dev).expand(b, t)
        out.append((h.to(dtype), ids, keep, pos))
    # the warm-up batches hold every type of the timed one (the steady state)
    out[0][1].view(-1)[: b * t] = out[-1][1].view(-1)
    return out


def same_state(a: EmbeddingStatistics, b: Any) -> dict[str, Any]:
    """Exact equality of counts and tails, largest relative difference of the float arrays."""
    sa, sb = a.state_dict(), b.state_dict()
    worst, unequal = 0.0, []
    for name in sorted(sa.keys() & sb.keys()):
        x, y = np.asarray(sa[name]), np.asarray(sb[name])
        if x.shape != y.shape:
            unequal.append(name)
        elif x.dtype.kind in "iub":
            if not np.array_equal(x, y):
                unequal.append(name)
        else:
            scale = max(float(np.abs(y).max(initial=0.0)), 1e-300)
            worst = max(worst, float(np.abs(x - y).max(initial=0.0)) / scale)
    return {"exact_fields_unequal": unequal, "max_rel_diff": worst, "same": not unequal}


def host_syncs(fn: Callable[[], None]) -> int:
    """How many synchronising CUDA calls ``fn`` makes (the sync debug mode's warnings)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def product_alone(batch: tuple[Any, ...], d: int, precision: str) -> Callable[[], None]:
    """This checkout's co-moment product alone (module docstring), for its fold of ``batch``
    at ``precision`` under the product switches set now (:func:`product_settings`): a
    function that multiplies once."""
    from embgeom_ray.core import gram, integer_gram, statistics

    h, _, keep, _ = batch
    rows = h.reshape(-1, d)[keep.reshape(-1)]
    c = rows.to(torch.float64).mean(dim=0)
    if precision == "bounded" and statistics.integer_product(rows.device, d):
        from bench.comoment import _int8_upper

        xs, triton = rows.to(torch.float64) - c, bool(integer_gram.TRITON_SYRK)
        return lambda: _int8_upper(xs, triton=triton)  # type: ignore[return-value]
    dtype = torch.float32 if precision == "float32" else torch.float64
    xs = rows.to(dtype) - c.to(dtype)
    upper = torch.zeros(d, d, dtype=torch.float64, device=rows.device)

    def multiply() -> None:
        upper.zero_()
        gram.add_gram(upper, xs)

    return multiply


def time_folds(args, d: int, precision: str, dev: torch.device, modules: dict) -> dict:
    """``precision``: ``CURRENT[:BASELINE]`` (module docstring)."""
    current, _, base = precision.partition(":")
    precisions = {name: (base or current) if name == "baseline" else current for name in modules}
    dtype = getattr(torch, args.dtype)
    data = batches(args, d, dev, dtype)
    layers = list(range(args.layers))
    cuda = dev.type == "cuda"

    def clock() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def update(name: str, s: Any, batch: tuple[Any, ...]) -> None:
        if "split" in modules:  # one module, the split on for its own entry only
            modules["split"].SPLIT_SUMS = True if name == "split" else None
        if PRODUCTS.keys() & modules.keys():  # likewise the product of --products' entries
            product_settings(name)
        h, ids, keep, pos = batch
        s.update([h] * len(layers), ids, keep, pos)

    stats = {}
    for name, module in modules.items():
        s = module.EmbeddingStatistics(
            layers, d, max_positions=args.max_length, device=dev,
            comoment_precision=precisions[name],
        )  # fmt: skip
        for batch in data[:-1]:
            update(name, s, batch)
        stats[name] = s
    h, ids, keep, pos = data[-1]
    n = int(keep.sum())
    # this checkout's own folds (not the baseline's, nor the split sums': the same product)
    products = {}
    for name in ("current", *(PRODUCTS.keys() & stats.keys())):
        if name in stats:
            product_settings(name)
            products[name] = product_alone(data[-1], d, current)
    product_settings("current")
    secs: dict[str, list[float]] = {name: [] for name in modules}
    product_secs: dict[str, list[float]] = {name: [] for name in products}
    with torch.inference_mode():
        for name, multiply in products.items():  # built (and compiled) before the clock
            product_settings(name)
            multiply()
        for _ in range(args.repeats):
            for name, s in stats.items():
                t0 = clock()
                update(name, s, data[-1])
                secs[name].append(clock() - t0)
                if name in products:
                    product_settings(name)
                    t0 = clock()
                    products[name]()
                    product_secs[name].append(clock() - t0)
        syncs = {
            name: host_syncs(lambda name=name, s=s: update(name, s, data[-1]))
            for name, s in stats.items()
            if cuda
        }
    if "split" in modules:
        modules["split"].SPLIT_SUMS = None
    per = {name: median(v) / (n * len(layers)) * 1e6 for name, v in secs.items()}
    product = {name: median(v) / n * 1e6 for name, v in product_secs.items()}
    row = {
        "dim": d, "comoment_precision": current, "baseline_precision": precisions.get("baseline"),
        "tokens": n, "us_per_token_layer": per, "product_us_per_token_layer": product,
        "fold_to_product": {name: per[name] / product[name] for name in product},
    }  # fmt: skip
    if syncs:
        row["host_syncs"] = syncs
    if "baseline" in stats:
        row["ratio"] = per["current"] / per["baseline"]
        row["state"] = same_state(stats["current"], stats["baseline"])
    if "split" in stats:
        row["split_ratio"] = per["split"] / per["current"]
        row["split_state"] = same_state(stats["split"], stats["current"])
    for name in PRODUCTS.keys() & stats.keys():
        row[f"{name}_ratio"] = per[name] / per["current"]
        row[f"{name}_state"] = same_state(stats[name], stats["current"])
    if args.profile:  # after the comparisons: the profiled fold is one more batch
        for name in ("current", *sorted(PRODUCTS.keys() & stats.keys())):  # each fold's kernels
            product_settings(name)
            print(f"--- {name}, d = {d}")
            print(profile_update(stats[name], (h, ids, keep, pos), len(layers), cuda))
    if PRODUCTS.keys() & modules.keys():
        product_settings("current")
    return row


def profile_update(stats: Any, batch: tuple[Any, ...], layers: int, cuda: bool) -> str:
    """The operators (kernels on a GPU) of one more fold of ``batch``, by their own time."""
    from torch.profiler import ProfilerActivity, profile

    h, ids, keep, pos = batch
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.inference_mode(), profile(activities=activities) as prof:
        stats.update([h] * layers, ids, keep, pos)
        if cuda:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=50)


def time_scatter(args, d: int, dev: torch.device) -> dict:
    """Per-type sums of n rows sorted by type, the ways of the module docstring, alternated."""
    rng = np.random.default_rng(1)
    n = args.batch_tokens
    ids = torch.as_tensor(np.sort(token_ids(n, args.vocab, rng)), device=dev)
    slots, inv, counts = torch.unique_consecutive(ids, return_inverse=True, return_counts=True)
    u = slots.numel()
    x = torch.randn(n, d, dtype=torch.float64, device=dev)
    x[:, 0] += 100.0  # an offset dimension, as the fold's batches
    low = x.to(getattr(torch, args.dtype))  # the model's rows
    x = low.to(torch.float64)
    x32 = low.to(torch.float32)
    by_type = GroupMatrix.of_sorted(counts, n)  # the fold's own sparse sums
    n_max = int(counts.max())
    ways = {
        "index_add": lambda: torch.zeros(u, d, dtype=torch.float64, device=dev).index_add_(
            0, inv, x
        ),
        "segment_reduce": lambda: torch.segment_reduce(x, "sum", lengths=counts),
        "csr_matmul": lambda: by_type.sums(x),
        "f64_copy_csr": lambda: by_type.sums(low.to(torch.float64)),
        "f32_index_add": lambda: torch.zeros(u, d, device=dev).index_add_(0, inv, x32),
        "f32_csr": lambda: by_type.sums(x32),
        "split_f32": lambda: split_sums(low, inv, u, n_max),
    }
    ref = ways["index_add"]()
    out: dict[str, Any] = {
        "dim": d, "rows": n, "types": u, "largest_type": n_max, "levels": split_levels(n_max)
    }  # fmt: skip
    runs: dict[str, list[float]] = {}
    for name, fn in ways.items():
        try:
            err = float((fn().to(torch.float64) - ref).abs().max() / ref.abs().max())
            out[name] = {"max_rel_err": err}
            runs[name] = []
        except (RuntimeError, NotImplementedError) as e:  # a way this device lacks
            out[name] = {"error": str(e).splitlines()[0]}
    for _ in range(args.repeats):  # the ways alternated: the machine's load shared alike
        for name, ts in runs.items():
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            ways[name]()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
    for name, ts in runs.items():
        out[name]["ms"] = median(ts) * 1e3
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--dims", default="2048", help="hidden sizes d")
    p.add_argument("--dtype", default="bfloat16", help="the hidden states' dtype")
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--batch-tokens", type=int, default=65_536)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--layers", type=int, default=4, help="hidden states folded per batch")
    p.add_argument("--warmup", type=int, default=2, help="batches folded before the timed one")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--comoment-precision", default="bounded:float32,float64",
        help="CURRENT[:BASELINE] precisions, comma-separated",
    )  # fmt: skip
    p.add_argument(
        "--integer-product", action="store_true",
        help="this checkout's bounded product on int8 units on any device",
    )  # fmt: skip
    p.add_argument("--baseline", default=BASELINE, help="git revision, package path, or none")
    p.add_argument("--scatter", action="store_true", help="also time the per-type sums")
    p.add_argument("--scatter-only", action="store_true", help="time only the per-type sums")
    p.add_argument("--profile", action="store_true", help="list the ops of one more fold")
    p.add_argument(
        "--split-sums", action="store_true",
        help="also fold with the float32 split sums (statistics.SPLIT_SUMS)",
    )  # fmt: skip
    p.add_argument(
        "--gram-blocks", type=int, default=None,
        help="this checkout's co-moment column blocks on a GPU (gram.GPU_GRAM_BLOCKS)",
    )  # fmt: skip
    p.add_argument(
        "--products", default="",
        help=f"also fold with these settings, comma-separated: {', '.join(PRODUCTS)}",
    )  # fmt: skip
    p.add_argument("--name", default="fold")
    args = p.parse_args(argv)
    products = [x for x in args.products.split(",") if x]
    if set(products) - PRODUCTS.keys():
        p.error(f"unknown --products {sorted(set(products) - PRODUCTS.keys())}")
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(auto if args.device == "auto" else args.device)
    import embgeom_ray.core.gram as gram
    import embgeom_ray.core.statistics as current

    if args.gram_blocks is not None:
        gram.GPU_GRAM_BLOCKS = args.gram_blocks
    if args.integer_product:
        current.INTEGER_PRODUCT = True
    DEFAULT_PRODUCT["INTEGER_PRODUCT"] = current.INTEGER_PRODUCT

    with work_dir("fold") as work:
        modules = {"current": current}
        if args.baseline.lower() != "none":
            modules = {"baseline": baseline_module(args.baseline, work, "core.statistics")}
            modules["current"] = current
        if args.split_sums:
            modules["split"] = current
        for name in products:
            modules[name] = current
        rows, scatter = [], []
        for d in (int(x) for x in args.dims.split(",")):
            for precision in [] if args.scatter_only else args.comoment_precision.split(","):
                row = time_folds(args, d, precision, dev, modules)
                rows.append(row)
                print(row, flush=True)
            if args.scatter or args.scatter_only:
                scatter.append(time_scatter(args, d, dev))
                print(scatter[-1], flush=True)
    save(
        args.name,
        {
            "command": "python -m bench.fold",
            "args": vars(args),
            "device": str(dev),
            "folds": rows,
            "scatter": scatter,
        },
    )


if __name__ == "__main__":
    main()
