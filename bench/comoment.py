"""The fold's one matrix product, (X − c)ᵀ(X − c), in the ways a device can compute it.

For each width d in ``--dims``: ``--rows`` rows of a bf16 "hidden state" (standard normal
rows plus a per-dimension offset, one dimension offset by ``--offset``: a rogue dimension),
shifted by c (their column mean rounded to float32, as the fold shifts them), and the product
computed as

* ``f64_upper`` – float64, upper block triangle (:func:`add_gram_upper`): the fold with
  ``comoment_precision="float64"``;
* ``f32_upper`` – float32 without TF32, upper block triangle: the fold's default;
* ``f32_full`` / ``f64_full`` – one ``xs.T @ xs`` in that dtype;
* ``tf32_full`` – float32 inputs on the matrix units (TF32, 10-bit mantissa);
* ``f32_upper4`` / ``f64_upper4`` – the block triangle in 4 column blocks (the GPU's);
  ``f64_upper6``, ``f64_upper8``, ``f32_upper8`` – in 6 or 8 (fewer multiply-adds: 7/12 and
  9/16 of the full product's, against 5/8; narrower products);
* ``bf16x3_full`` – each float32 row split as hi + lo (two bf16), hiᵀhi + hiᵀlo + loᵀhi with
  float32 accumulation (``torch.mm(..., out_dtype=float32)`` on CUDA; elsewhere emulated by
  float32 products of the bf16 values: the same numbers, for the error only);
* ``bf16_split3`` – each float32 row split exactly as hi + mid + lo (three bf16), the four
  largest of the nine products (hiᵀhi, midᵀmid, hiᵀmid, hiᵀlo and their transposes): a
  candidate for an exact-as-float32 product on the bf16 matrix units;
* ``bf16_split3_k1024`` – ``bf16_split3`` over chunks of 1,024 rows (batched products), the
  chunks' float32 products summed in float64: whether the error comes from the depth of the
  device's float32 accumulation;
* ``bf16_pairs`` – the shift c rounded to bf16, so that x − c (two bf16 numbers) mostly splits
  exactly into hi + lo, and all four bf16 products (three matrix products);
* ``bf16_pairs_k256`` – ``bf16_pairs`` over chunks of 256 rows, the chunks' float32 products
  summed in float64: split-K as the issue proposed. On a CPU the products run on the model of an
  H100's tensor core (``bench/tensor_core_model.py``: blocks of 16, truncation), and only where
  that emulation is cheap (rows · d² ≤ 2^26);
* ``int8_upper`` – the bounded product (``core/integer_gram.py``: 39-bit fixed point, twelve
  int8 products of residues, Garner's reconstruction), the block triangle as the fold takes it
  on this device (``torch._int_mm``); its error is within 2^(2−B) √n of √(G_aa G_bb);
* ``int8_triton`` – the same with every modulus' products of the upper tiles in one Triton
  kernel, remainders in its epilogue (``core/integer_syrk.py``; on a CPU only under Triton's
  interpreter). With it, ``--syrk-alone`` also times the kernel alone on random residues and
  prints its rate in int8 operations a second (the tiles it multiplies), against the card's
  dense int8 peak (H100/H200 SXM: ~1,979 TOPS).

Each is timed (median of ``--repeats`` after a warm-up, the device synchronised) and compared
with the float64 product of the same rows: ‖G − G₆₄‖_F / ‖G₆₄‖_F and the largest relative
error of a diagonal entry. The ratio printed is each variant's time over ``f32_upper``'s.

    python -m bench.comoment [--dims 1024,2048,4096] [--rows 8192] [--device cuda]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from bench.common import median, save
from embgeom_ray.core.gram import add_gram_upper, symmetric_from_upper


def _upper(xs: torch.Tensor, block: int = 96) -> torch.Tensor:
    d = xs.shape[1]
    upper = torch.zeros(d, d, dtype=torch.float64, device=xs.device)
    add_gram_upper(upper, xs, block)
    return symmetric_from_upper(upper)


def _upper_in(blocks: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The block triangle in ``blocks`` column blocks."""

    def product(xs: torch.Tensor) -> torch.Tensor:
        return _upper(xs, -(-xs.shape[1] // blocks))

    return product


_upper4 = _upper_in(4)


def _full(xs: torch.Tensor) -> torch.Tensor:
    return (xs.T @ xs).to(torch.float64)


def _tf32(xs: torch.Tensor) -> torch.Tensor:
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        return (xs.T @ xs).to(torch.float64)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of bf16 matrices with float32 accumulation and output: on CUDA the matrix units
    (``out_dtype``); elsewhere the same numbers by a float32 product of the bf16 values (each
    bf16 × bf16 product is exact in float32), for the error, not the time."""
    if a.device.type == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.to(torch.float32) @ b.to(torch.float32)


def _split(xs: torch.Tensor, pieces: int) -> list[torch.Tensor]:
    """bf16 pieces p_1, p_2, … of the float32 ``xs``: each the bf16 rounding of what the
    previous ones leave (exact float32 differences); three hold all 24 bits of a float32."""
    out, rest = [], xs
    for _ in range(pieces):
        out.append(rest.to(torch.bfloat16))
        rest = rest - out[-1].to(torch.float32)
    return out


def _bf16x3(xs: torch.Tensor) -> torch.Tensor:
    hi, lo = _split(xs, 2)
    g = _mm32(hi.T, hi)
    cross = _mm32(hi.T, lo)
    return (g + cross + cross.T).to(torch.float64)


def _bf16_split3(xs: torch.Tensor) -> torch.Tensor:
    """x = hi + mid + lo exactly (three bf16 of a float32: 8 + 8 + 8 bits), and the products
    down to 2^-16 of the leading one: hiᵀhi + midᵀmid + S + Sᵀ, S = hiᵀmid + hiᵀlo (four bf16
    matrix products; the dropped midᵀlo, loᵀmid, loᵀlo are ≤ 2^-23 of it)."""
    hi, mid, lo = _split(xs, 3)
    cross = _mm32(hi.T, mid) + _mm32(hi.T, lo)
    return (_mm32(hi.T, hi) + _mm32(mid.T, mid) + cross + cross.T).to(torch.float64)


def _bmm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched :func:`_mm32`."""
    if a.device.type == "cuda":
        return torch.bmm(a, b, out_dtype=torch.float32)
    return a.to(torch.float32) @ b.to(torch.float32)


def _bf16_split3_k1024(xs: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """:func:`_bf16_split3` for each chunk of ``chunk`` rows (the rows zero-padded to whole
    chunks), the chunks' float32 products summed in float64."""
    n, d = xs.shape
    pad = -n % chunk
    if pad:
        xs = torch.cat([xs, xs.new_zeros(pad, d)])
    hi, mid, lo = (p.view(-1, chunk, d) for p in _split(xs, 3))
    hit, midt = hi.transpose(1, 2), mid.transpose(1, 2)
    cross = _bmm32(hit, mid) + _bmm32(hit, lo)
    per_chunk = _bmm32(hit, hi) + _bmm32(midt, mid) + cross + cross.transpose(1, 2)
    return per_chunk.to(torch.float64).sum(0)


def _bf16_pairs(xs: torch.Tensor) -> torch.Tensor:
    """x' = hi + lo (two bf16, exact when x' has ≤ 16 significant bits: the difference of two
    bf16 numbers, x − c with c rounded to bf16, close in magnitude); hiᵀhi + loᵀlo + hiᵀlo +
    (hiᵀlo)ᵀ, each bf16 product exact in float32 and accumulated in float32."""
    hi, lo = _split(xs, 2)
    g = _mm32(hi.T, hi) + _mm32(lo.T, lo)
    cross = _mm32(hi.T, lo)
    return (g + cross + cross.T).to(torch.float64)


def _bf16_pairs_k256(xs: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """:func:`_bf16_pairs` per chunk of ``chunk`` rows, the chunks summed in float64; on a CPU
    on the H100 model (:func:`bench.tensor_core_model.split_chunked_gram`)."""
    if xs.device.type != "cuda":
        from bench.tensor_core_model import split_chunked_gram

        if xs.shape[0] * xs.shape[1] ** 2 > 2**26:
            raise NotImplementedError("the tensor-core emulation is too slow at this size")
        return split_chunked_gram(xs, chunk)
    n, d = xs.shape
    pad = -n % chunk
    if pad:
        xs = torch.cat([xs, xs.new_zeros(pad, d)])
    hi, lo = (p.view(-1, chunk, d) for p in _split(xs, 2))
    hit, lot = hi.transpose(1, 2), lo.transpose(1, 2)
    cross = _bmm32(hit, lo)
    per_chunk = _bmm32(hit, hi) + _bmm32(lot, lo) + cross + cross.transpose(1, 2)
    return per_chunk.to(torch.float64).sum(0)


def _int8_upper(xs: torch.Tensor, triton: bool = False) -> torch.Tensor:
    """The bounded product of the (already shifted) rows ``xs`` as the fold computes it:
    residues by the fold's kernel (compiled on CUDA), int8 products of the upper triangle
    (``triton``: every modulus and tile in one Triton kernel, ``core/integer_syrk.py``; else
    ``torch._int_mm`` in the fold's column blocks on this device), Garner's reconstruction."""
    from embgeom_ray.core import integer_gram
    from embgeom_ray.core.gram import integer_blocks
    from embgeom_ray.core.integer_gram import IntegerGram

    saved, integer_gram.TRITON_SYRK = integer_gram.TRITON_SYRK, triton
    try:
        n, d = xs.shape
        zero = torch.zeros(d, dtype=torch.float64, device=xs.device)
        gram = IntegerGram(xs, zero, **integer_blocks(d, xs.device.type == "cuda"))
        for g, s, e in gram.pieces(0, n):
            res = integer_gram.residues(xs[s:e], zero, g.scale, g.moduli, *gram.padding(g, s, e))
            gram.put(g, s, e, res)
        upper = torch.zeros(d, d, dtype=torch.float64, device=xs.device)
        gram.add_upper(upper)
    finally:
        integer_gram.TRITON_SYRK = saved
    return symmetric_from_upper(upper)


def _int8_triton(xs: torch.Tensor) -> torch.Tensor:
    """:func:`_int8_upper` with the Triton kernel's products."""
    return _int8_upper(xs, triton=True)


def syrk_alone(d: int, rows: int, repeats: int, device: str) -> dict:
    """The Triton kernel alone (``integer_syrk.remainders``) on random residues of twelve
    moduli: its time, and its rate in int8 operations per second counting only the tiles it
    multiplies (2 · rows · BM · BN a tile and modulus), against the card's dense int8 peak."""
    from embgeom_ray.core import integer_syrk
    from embgeom_ray.core.integer_gram import MODULI

    cols, align = integer_syrk.alignment()
    d_pad, k = -(-d // cols) * cols, -(-rows // align) * align
    r = torch.randint(-128, 128, (len(MODULI), d_pad, k), dtype=torch.int8, device=device)
    integer_syrk.remainders(r, MODULI)  # the autotuner's runs, on the first call of a width
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        integer_syrk.remainders(r, MODULI)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    config = integer_syrk.best_config() or dict(
        zip(("BM", "BN", "BK"), integer_syrk.INTERPRETER_CONFIG[:3], strict=True)
    )
    bm, bn = config["BM"], config["BN"]
    tiles = sum(1 for i in range(d_pad // bm) for j in range(d_pad // bn) if (j + 1) * bn > i * bm)
    ops = 2.0 * k * bm * bn * tiles * len(MODULI)
    secs = median(times)
    out = {"seconds": secs, "tops": ops / secs / 1e12, "config": config, "rows": k, "d_pad": d_pad}
    print(
        f"d={d:5d} rows={k} the Triton kernel alone {1e3 * secs:8.3f} ms, "
        f"{out['tops']:7.1f} TOPS (int8, tiles multiplied), config {config}",
        flush=True,
    )
    return out


#: name: (dtype of the shifted rows, the product, the shift c rounded to: float32 or bfloat16)
def variants() -> dict[
    str, tuple[torch.dtype, Callable[[torch.Tensor], torch.Tensor], torch.dtype]
]:
    f32, f64, bf16 = torch.float32, torch.float64, torch.bfloat16
    return {
        "f64_upper": (f64, _upper, f32),
        "f32_upper": (f32, _upper, f32),
        "f64_upper4": (f64, _upper4, f32),
        "f32_upper4": (f32, _upper4, f32),
        "f64_upper6": (f64, _upper_in(6), f32),
        "f64_upper8": (f64, _upper_in(8), f32),
        "f32_upper8": (f32, _upper_in(8), f32),
        "f64_full": (f64, _full, f32),
        "f32_full": (f32, _full, f32),
        "tf32_full": (f32, _tf32, f32),
        "bf16x3_full": (f32, _bf16x3, f32),
        "bf16_split3": (f32, _bf16_split3, f32),
        "bf16_split3_k1024": (f32, _bf16_split3_k1024, f32),
        "bf16_pairs": (f32, _bf16_pairs, bf16),
        "bf16_pairs_k256": (f32, _bf16_pairs_k256, bf16),
        "int8_upper": (f64, _int8_upper, f32),
        "int8_triton": (f64, _int8_triton, f32),
    }


def bench_dim(
    d: int, rows: int, offset: float, repeats: int, device: str, names: list[str] | None = None
) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(d)
    x = torch.randn(rows, d, generator=gen) + torch.randn(d, generator=gen)
    x[:, 0] += offset
    x = x.to(torch.bfloat16).to(device)
    mean = x.to(torch.float32).mean(dim=0)
    refs = {}
    for shift in (torch.float32, torch.bfloat16):
        x64 = x.to(torch.float64) - mean.to(shift).to(torch.float64)
        refs[shift] = x64.T @ x64

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    out: dict[str, dict] = {}
    chosen = {n: v for n, v in variants().items() if names is None or n in names}
    for name, (dtype, fn, shift) in chosen.items():
        xs = x.to(dtype) - mean.to(shift).to(dtype)
        ref = refs[shift]
        try:
            g = fn(xs)
        except (RuntimeError, NotImplementedError, TypeError) as e:
            out[name] = {"error": str(e).splitlines()[0][:200]}
            continue
        times = []
        for _ in range(repeats):
            sync()
            t = time.perf_counter()
            fn(xs)
            sync()
            times.append(time.perf_counter() - t)
        err = float(torch.linalg.matrix_norm(g - ref) / torch.linalg.matrix_norm(ref))
        diag = float(((g.diagonal() - ref.diagonal()).abs() / ref.diagonal()).max())
        out[name] = {"seconds": median(times), "rel_frobenius": err, "rel_diag_max": diag}
    base = out.get("f32_upper", {}).get("seconds", float("nan"))
    for name, r in out.items():
        if "seconds" in r:
            r["over_f32_upper"] = r["seconds"] / base
            flops = 2 * rows * d * d
            r["tflops_full_equivalent"] = flops / r["seconds"] / 1e12
            print(
                f"d={d:5d} rows={rows} {name:12s} {1e3 * r['seconds']:8.3f} ms "
                f"({r['over_f32_upper']:5.2f}x f32_upper, {r['tflops_full_equivalent']:6.1f} "
                f"TFLOP/s as a full product) rel. error {r['rel_frobenius']:.1e} "
                f"(diagonal max {r['rel_diag_max']:.1e})",
                flush=True,
            )
        else:
            print(f"d={d:5d} {name:12s} not available: {r['error']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", default="1024,2048,4096")
    p.add_argument("--rows", type=int, default=8192, help="rows of one batch")
    p.add_argument("--offset", type=float, default=100.0, help="one dimension's offset")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--variants", default=None, help="comma-separated names (default: every variant)"
    )
    p.add_argument("--syrk-alone", action="store_true", help="also time the Triton kernel alone")
    p.add_argument("--name", default="comoment")
    args = p.parse_args(argv)
    names = None if args.variants is None else args.variants.split(",")
    if names is not None and set(names) - set(variants()):
        p.error(f"unknown variants {sorted(set(names) - set(variants()))}")
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # as the extractor sets it
    results = {
        d: bench_dim(d, args.rows, args.offset, args.repeats, args.device, names)
        for d in (int(x) for x in args.dims.split(","))
    }
    if args.syrk_alone:
        for d, out in results.items():
            out["syrk_alone"] = syrk_alone(d, args.rows, args.repeats, args.device)
    save(args.name, {"command": "python -m bench.comoment", "args": vars(args), "dims": results})


if __name__ == "__main__":
    main()
