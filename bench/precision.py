"""Every table of the bounded path against the float64 path's, on the same hidden states.

Synthetic hidden states in the model dtype (``--dtype``, bf16 by default), as bench.fold makes
them (standard normal rows, token ids half uniform over ``--vocab`` and half Zipf), with planted
massive activations: ``--massive`` dimensions offset by ``--offset`` (μ²/V ~ offset²/ulp² in
bf16), and the first position of every window ``--spike`` higher in one more dimension (the
first token's massive activation in LLMs). ``--batches`` batches of ``--batch-tokens`` tokens,
``--layers`` hidden states each (every layer its own values). The same batches are folded into
statistics with ``comoment_precision="bounded"`` (on int8 matrix units unless
``--no-integer``: on a CPU they are forced, as the tests force them; on CUDA the products by
the Triton kernel of ``core/integer_syrk.py`` unless ``--int-mm``) and ``"float64"``, both
runs' tables are built (``core/tables.build_tables``), and per table and column the largest
relative difference |a − b| / |b| over rows with b ≠ 0 is reported (the contract: 1e-6), with
each fold's seconds per token and layer.

    python -m bench.precision [--device cuda] [--dims 2048,4096] [--batch-tokens 65536]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from bench.common import save
from bench.fold import token_ids

#: the tables compared (``positions`` holds per-position means: float64 in both paths)
TABLES = ("type_stats", "layers", "dims", "positions")


class _Tokenizer:
    @staticmethod
    def convert_ids_to_tokens(ids: list[int]) -> list[str]:
        return [f"w{i}" for i in ids]


def planted_batches(args, d: int, dev: torch.device) -> list[tuple[list[torch.Tensor], Any]]:
    """(hidden states per layer, ids, keep) of ``--batches`` batches with the planted massive
    activations (module docstring)."""
    rng = np.random.default_rng(0)
    gen = torch.Generator(device=dev).manual_seed(0)
    t = args.max_length
    b = max(1, args.batch_tokens // t)
    dtype = getattr(torch, args.dtype)
    out = []
    for _ in range(args.batches):
        hidden = []
        for _ in range(args.layers):
            h = torch.randn(b, t, d, generator=gen, device=dev, dtype=torch.float32)
            h[..., : args.massive] += args.offset
            h[:, 0, args.massive] += args.spike
            hidden.append(h.to(dtype))
        ids = torch.as_tensor(token_ids(b * t, args.vocab, rng).reshape(b, t), device=dev)
        keep = torch.ones(b, t, dtype=torch.bool, device=dev)
        out.append((hidden, ids, keep))
    return out


def table_differences(ours: dict, ref: dict) -> dict[str, dict[str, Any]]:
    """Per table: for each float column the largest |a − b| / |b| over rows with b ≠ 0 (a:
    ours, b: the float64 path's), and the other columns (keys, counts, flags) that differ."""
    out: dict[str, dict[str, Any]] = {}
    for name in TABLES:
        a, b = ours[name], ref[name]
        row: dict[str, Any] = {"rows": len(b), "unequal_columns": []}
        for col in b.columns:
            if b[col].dtype.kind == "f":
                x, y = a[col].to_numpy(float), b[col].to_numpy(float)
                nonzero = np.isfinite(y) & (y != 0)
                rel = np.abs(x[nonzero] - y[nonzero]) / np.abs(y[nonzero])
                row[col] = float(rel.max()) if rel.size else 0.0
            elif not a[col].equals(b[col]):
                row["unequal_columns"].append(col)
        out[name] = row
    return out


def compare(args, d: int, dev: torch.device) -> dict:
    import embgeom_ray.core.statistics as statistics
    from embgeom_ray.config import JobConfig
    from embgeom_ray.core.tables import build_tables

    if args.integer:
        from embgeom_ray.core import integer_gram

        statistics.INTEGER_PRODUCT = True
        # on CUDA the products of the Triton kernel (core/integer_syrk.py) unless --int-mm
        integer_gram.TRITON_SYRK = False if args.int_mm else None
    data = planted_batches(args, d, dev)
    layers = list(range(args.layers))
    options = JobConfig(model="m", corpus="c", out="o").tables
    cuda = dev.type == "cuda"
    result: dict[str, Any] = {"dim": d, "device": str(dev), "dtype": args.dtype}
    tables = {}
    for precision in ("bounded", "float64"):
        stats = statistics.EmbeddingStatistics(
            layers, d, max_positions=args.max_length, device=dev, comoment_precision=precision
        )
        seconds = 0.0
        for hidden, ids, keep in data:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            stats.update(hidden, ids, keep)
            if cuda:
                torch.cuda.synchronize()
            seconds += time.perf_counter() - t0
        n = stats.token_count()
        result[f"{precision}_fold_us_per_token_layer"] = 1e6 * seconds / n / len(layers)
        tables[precision] = build_tables(stats.to("cpu"), _Tokenizer, options)
        if precision == "bounded":
            result["integer_product"] = statistics.integer_product(dev, d)
            m = stats.layer(0)
            var = np.diag(m.comoment) / m.n
            result["mu2_over_var_max"] = float((m.mean**2 / np.maximum(var, 1e-300)).max())
            result["tokens"] = n
    result["relative_differences"] = table_differences(tables["bounded"], tables["float64"])
    worst = max(
        v for t in result["relative_differences"].values() for k, v in t.items()
        if k not in ("rows", "unequal_columns")
    )  # fmt: skip
    result["max_relative_difference"] = worst
    print(
        f"d={d} {n} tokens x {len(layers)} layers, mu^2/V up to {result['mu2_over_var_max']:.2e}:"
        f" largest relative difference of any table value {worst:.2e}; fold "
        f"{result['bounded_fold_us_per_token_layer']:.3f} (bounded, int8: "
        f"{result['integer_product']}) vs {result['float64_fold_us_per_token_layer']:.3f} "
        "(float64) us/token/layer",
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--dims", default="2048", help="hidden sizes d")
    p.add_argument("--dtype", default="bfloat16", help="the hidden states' dtype")
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--batch-tokens", type=int, default=16_384)
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--layers", type=int, default=2, help="hidden states folded per batch")
    p.add_argument("--massive", type=int, default=2, help="dimensions with a massive offset")
    p.add_argument("--offset", type=float, default=3000.0, help="their offset")
    p.add_argument("--spike", type=float, default=2000.0, help="each window's first position")
    p.add_argument(
        "--no-integer", dest="integer", action="store_false",
        help="leave the bounded product to the device (float64 on a CPU)",
    )  # fmt: skip
    p.add_argument(
        "--int-mm", action="store_true",
        help="the int8 products by torch._int_mm, not the Triton kernel (CUDA)",
    )  # fmt: skip
    p.add_argument("--name", default="precision")
    args = p.parse_args(argv)
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(auto if args.device == "auto" else args.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # as the extractor sets it
    rows = [compare(args, int(d), dev) for d in args.dims.split(",")]
    save(args.name, {"command": "python -m bench.precision", "args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
