"""Small statistics and sample files written by earlier versions of embgeom_ray.

``tests/data/sketch_v1/`` holds what :func:`write_fixtures` wrote when run against two earlier
checkout, so that the tests can check that files saved by that version still load:
``statistics.safetensors`` and ``samples.safetensors`` come from commit 82b3bd9 (format names
``embgeom_ray.statistics`` / ``embgeom_ray.samples``, version 1, flat package layout).

Made with, for the commit C (and an empty suffix S) (outside the checkout, so that the old package is
the one imported)::

    git archive C embgeom_ray | tar -x -C /tmp/old
    cd /tmp && PYTHONPATH=/tmp/old:$REPO python -m tests.sketch_fixtures $REPO/tests/data/sketch_v1 S
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

LAYERS = [0, 2]
DIM = 4
MAX_POSITIONS = 6
CLIP_DIMS = [1]
METADATA = {
    "model_fingerprint": "fixture-model",
    "tokenizer_fingerprint": "fixture-tokenizer",
    "keep_special": "False",
}
SAMPLE_SIZE, SAMPLE_SEED, SAMPLE_TYPE_SIZE = 5, 3, 4


def batches() -> list[dict[str, torch.Tensor]]:
    """Three batches of 3 windows × 6 tokens: float32 hidden states (L, B, T, d) with a NaN
    (one non-finite token in layer 2), token ids 0..9, keep masks, doc ids, window indices."""
    rng = np.random.default_rng(2026)
    out = []
    for i in range(3):
        hidden = rng.normal(2.0, 1.0, (len(LAYERS), 3, 6, DIM)).astype(np.float32)
        if i == 1:
            hidden[1, 0, 2, 3] = np.nan
        out.append(
            {
                "hidden": torch.from_numpy(hidden),
                "token_ids": torch.from_numpy(rng.integers(0, 10, (3, 6))),
                "keep": torch.from_numpy(rng.random((3, 6)) > 0.2),
                "doc_ids": torch.arange(3 * i, 3 * i + 3),
                "window_index": torch.zeros(3, dtype=torch.int64),
            }
        )
    return out


def fold_statistics(cls: type) -> object:
    """The fixture's statistics, folded by the ``EmbeddingStatistics`` class ``cls``."""
    stats = cls(
        LAYERS,
        DIM,
        max_positions=MAX_POSITIONS,
        metadata=METADATA,
        clip_dims=CLIP_DIMS,
        comoment_precision="float32",
    )
    for b in batches():
        stats.update(b["hidden"], b["token_ids"], b["keep"])
    return stats


def fold_sample(cls: type) -> object:
    """The fixture's sample, folded by the ``ActivationSample`` class ``cls``."""
    sample = cls(
        LAYERS, DIM, SAMPLE_SIZE, SAMPLE_SEED, metadata=METADATA, type_size=SAMPLE_TYPE_SIZE
    )
    for b in batches():
        sample.update(b["hidden"], b["token_ids"], b["keep"], b["doc_ids"], b["window_index"])
    return sample


def write_fixtures(out: Path, suffix: str = "") -> None:
    """Write the fixtures with whichever embgeom_ray is imported (flat or core layout)."""
    try:
        from embgeom_ray.core.samples import ActivationSample
        from embgeom_ray.core.statistics import EmbeddingStatistics
    except ImportError:
        from embgeom_ray.samples import ActivationSample  # type: ignore[no-redef]
        from embgeom_ray.statistics import EmbeddingStatistics  # type: ignore[no-redef]
    out.mkdir(parents=True, exist_ok=True)
    fold_statistics(EmbeddingStatistics).save(out / f"statistics{suffix}.safetensors")
    fold_sample(ActivationSample).save(out / f"samples{suffix}.safetensors")


if __name__ == "__main__":
    write_fixtures(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "")
