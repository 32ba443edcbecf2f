"""A finished run's sample a layer at a time: ``samples.parquet``, each layer's row groups read
alone (a :class:`~embgeom_ray.core.sample_layers.SampleLayers` over the run directory)."""

from __future__ import annotations

from typing import Any

from ..core.sample_layers import InMemorySample
from ..core.samples import ActivationSample
from ..errors import StatisticsMismatchError
from ..run_dir import RunDir


class RunSamples:
    """The sample of a finished run's ``samples.parquet``, a layer at a time: that layer's
    row groups (:data:`~embgeom_ray.run_dir.ROW_GROUP_KEYS`) read alone
    (:meth:`ActivationSample.from_table <embgeom_ray.core.samples.ActivationSample.from_table>`
    of them)."""

    def __init__(self, run: RunDir, header: dict[str, Any]) -> None:
        self.run, self.header = run, header
        self.layers = [int(x) for x in header["layers"]]
        #: each layer's rows (its uniform and type-uniform entries, as drawn)
        self.drawn: int | None = run.table_rows("samples") // max(len(self.layers), 1)

    def layer(self, layer: int) -> ActivationSample:
        rows = self.run.read_arrow("samples", filters=[("layer", "=", int(layer))])
        try:
            return ActivationSample.from_table(rows, self.header | {"layers": [int(layer)]})
        except StatisticsMismatchError as exc:
            raise StatisticsMismatchError(f"{self.run.path('samples')}: {exc}") from None

    def whole(self) -> ActivationSample:
        return self.run.load_sample()


def run_samples(run: RunDir) -> RunSamples | InMemorySample | None:
    """A finished run's sample a layer at a time (:class:`RunSamples`), or whole for a run
    of an earlier version that keeps it as ``sample.safetensors``; None without one."""
    header = run.table_header("samples")
    if header is not None:
        return RunSamples(run, header)
    sample = run.load_sample()
    return None if sample is None else InMemorySample(sample)
