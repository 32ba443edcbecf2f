"""The output directory's tables and manifest (the contract of DESIGN.md).

Tables are Parquet, each written atomically. ``manifest.json`` is written with
``"status": "running"`` when a run starts and rewritten with ``"status": "complete"`` only after
every table and the statistics artefact are in place, so a reader can trust a complete manifest
and must not trust anything else.
"""

from __future__ import annotations

import io
import platform
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from .io_utils import atomic_write_bytes, atomic_write_json, join

MANIFEST = "manifest.json"
STATISTICS = "statistics.safetensors"
SAMPLE = "sample.safetensors"


#: tables written with one Parquet row group per run of equal values of these columns, so a
#: reader filtering on them (``filters=[("layer", "=", 3)]``, as the report's PCA views do)
#: decodes only the matching groups, not every layer's vectors.
ROW_GROUP_KEYS: dict[str, tuple[str, ...]] = {"samples": ("layer", "sample")}


def _runs(df: pd.DataFrame, keys: tuple[str, ...]) -> list[tuple[int, int]]:
    """(start, length) of the runs of consecutive rows with equal values in ``keys``."""
    if not len(df):
        return [(0, 0)]
    change = np.zeros(len(df), dtype=bool)
    change[0] = True
    for key in keys:
        col = df[key].to_numpy()
        change[1:] |= col[1:] != col[:-1]
    starts = np.flatnonzero(change)
    ends = np.append(starts[1:], len(df))
    return [(int(a), int(b - a)) for a, b in zip(starts, ends, strict=True)]


def write_table(out: str, name: str, df: pd.DataFrame) -> str:
    """Write ``df`` as ``OUT/name.parquet`` atomically; returns the file name.

    Tables named in :data:`ROW_GROUP_KEYS` get one row group per run of their keys.
    """
    table = pa.Table.from_pandas(df, preserve_index=False)
    buf = io.BytesIO()
    keys = ROW_GROUP_KEYS.get(name, ())
    if keys and all(k in df.columns for k in keys):
        with pq.ParquetWriter(buf, table.schema, compression="zstd") as writer:
            for start, length in _runs(df, keys):
                writer.write_table(table.slice(start, length))
    else:
        pq.write_table(table, buf, compression="zstd")
    atomic_write_bytes(join(out, f"{name}.parquet"), buf.getvalue())
    return f"{name}.parquet"


def versions() -> dict[str, str]:
    import numpy
    import ray
    import torch
    import transformers

    from . import __version__

    return {
        "embgeom_ray": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ray": ray.__version__,
        "numpy": numpy.__version__,
        "pyarrow": pa.__version__,
    }


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def write_manifest(out: str, manifest: dict[str, Any]) -> None:
    atomic_write_json(join(out, MANIFEST), manifest)


def format_summary(layers: pd.DataFrame) -> str:
    """The per-layer summary printed at the end of a run."""
    cols = [
        c
        for c in ("layer", "n_tokens", "n_types", "mean_norm", "total_variance", "within_ratio",
                  "norm_variance_corr", "isoscore", "anisotropy", "s_inter", "s_intra")
        if c in layers.columns
    ]  # fmt: skip
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.precision", 4):
        return layers[cols].to_string(index=False)
