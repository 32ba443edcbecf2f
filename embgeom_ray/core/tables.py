"""Every exact table of the output contract, from the corpus statistics alone (no Ray)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from ..config import JobConfig
from . import metrics
from .rogue import (
    OutlierRules,
    clipping_row,
    exact_clipped_cosines,
    flagged_dims,
    positions_table,
    rogue_dims_table,
)
from .statistics import EmbeddingStatistics


def build_tables(
    merged: EmbeddingStatistics, tokenizer: Any, config: JobConfig
) -> dict[str, pd.DataFrame]:
    """Every table of the output contract, from the corpus statistics alone."""
    rules = OutlierRules(
        config.outlier_mean_z, config.outlier_variance_ratio, config.outlier_tail_share
    )
    dims = rogue_dims_table(merged, rules)
    flagged = flagged_dims(dims)
    layers = metrics.layers_table(merged, config.min_count)
    extra = [
        {"layer": layer}
        | clipping_row(merged.layer(layer), flagged.get(layer, []))
        | exact_clipped_cosines(merged.layer(layer))
        for layer in merged.layers
    ]
    layers = layers.merge(pd.DataFrame(extra), on="layer", how="left")
    return {
        "type_stats": metrics.type_stats_table(merged, tokenizer.convert_ids_to_tokens),
        "layers": layers,
        "dims": dims,
        "positions": positions_table(merged, flagged),
    }
