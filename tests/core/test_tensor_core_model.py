"""The H100 tensor-core model (bench/tensor_core_model.py) and why the bounded product does not
use bf16 with float32 accumulation: on the model, the chunked bf16 split errs beyond 1e-6 where
the int8 product stays within its bound, on the same rows."""

from __future__ import annotations

import numpy as np
import torch

from bench.tensor_core_model import h100_matmul, split_chunked_gram, truncate_to_float32
from embgeom_ray.core.integer_gram import IntegerGram, bound, residues_eager


def _bf16(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).to(torch.bfloat16)


def test_the_block_aligns_to_its_largest_term_and_truncates():
    """One block of 16: 1 + 15 · 2^-30 loses the small products (aligned to the largest with
    2 extra bits: grain 2^-25); 1 + 2^-24 is kept in the block but truncated to float32;
    1 + 2^-23 (one float32 ulp) survives."""
    ones = [1.0] + [2.0**-15] * 15
    assert h100_matmul(_bf16([ones]), _bf16([ones]).t()).item() == 1.0
    a, b = _bf16([[1.0, 2.0**-12] + [0.0] * 14]), _bf16([[1.0, 2.0**-12] + [0.0] * 14])
    assert h100_matmul(a, b.t()).item() == 1.0  # 1 + 2^-24 truncated to float32
    a, b = _bf16([[1.0, 2.0**-11] + [0.0] * 14]), _bf16([[1.0, 2.0**-12] + [0.0] * 14])
    assert h100_matmul(a, b.t()).item() == 1.0 + 2.0**-23  # a float32 ulp is kept
    # negative sums truncate toward zero too
    assert (
        truncate_to_float32(torch.tensor([-(1.0 + 2.0**-30)], dtype=torch.float64)).item() == -1.0
    )


def test_small_integers_are_exact_and_other_products_err_one_way():
    """Integer products far below 2^24 are exact; sums of positive products come out low
    (truncation), by at most K/16 float32 ulps of the sum."""
    rng = np.random.default_rng(1)
    a = torch.as_tensor(rng.integers(-20, 20, size=(8, 64)), dtype=torch.bfloat16)
    b = torch.as_tensor(rng.integers(-20, 20, size=(64, 8)), dtype=torch.bfloat16)
    assert torch.equal(h100_matmul(a, b), (a.double() @ b.double()))
    x = torch.as_tensor(rng.uniform(0.5, 2.0, size=(4, 4096))).to(torch.bfloat16)
    got, want = h100_matmul(x, x.t()), x.double() @ x.double().t()
    assert (got <= want).all()
    assert ((want - got) / want).max() < 4096 / 16 * 2.0**-23


def test_bf16_split_with_float32_sums_breaks_the_bound_where_int8_keeps_it():
    """The rows of a batch with massive activations (one dimension offset by 3000, another
    with a spike every 128 rows), shifted by their mean: the bf16 hi + lo split with every
    product exact, accumulated 256 rows at a time in the H100's float32 and the chunks added
    in float64, errs by more than 1e-6 of √(G_aa G_bb) (on the diagonal, always low); the int8
    product errs by less than its bound ε_n."""
    rng = np.random.default_rng(2)
    x = torch.as_tensor(rng.normal(size=(4096, 16)))
    x[:, 0] += 3000.0
    x[::128, 1] += 2000.0
    x = x.to(torch.bfloat16).double()
    xs = x - x.mean(0)
    ref = xs.T @ xs
    scale = torch.sqrt(torch.outer(ref.diagonal(), ref.diagonal()))
    split = split_chunked_gram(xs, chunk=256)
    assert ((split - ref).abs() / scale).max() > 1e-6
    assert (split.diagonal() <= ref.diagonal()).all()
    gram = IntegerGram(x, x.mean(0))
    ((g, s, e),) = gram.pieces(0, 4096)
    gram.put(g, s, e, residues_eager(x, gram.shift, g.scale, g.moduli, *gram.padding(g, s, e)))
    upper = torch.zeros(16, 16, dtype=torch.float64)
    gram.add_upper(upper)
    upper = torch.triu(upper)
    integer = upper + torch.triu(upper, 1).T
    assert ((integer - ref).abs() / scale).max() < bound(4096)
