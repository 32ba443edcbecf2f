"""An activation sample, one layer at a time: what the job's own process holds of it.

The merged sample of a run is (size + type_size) occurrences × L layers × d float32: Q =
4 · L · s · d + 48 · s bytes (gigabytes for an 8B model at the default 4096 + 4096). Its
*selection* (which occurrences: keys, ids, positions) does not depend on the vectors, and is
the same in every layer (:mod:`embgeom_ray.core.samples`); so the one-layer sample of layer l
of the merge of some samples is the merge of their one-layer samples of l, bit for bit. A
:class:`SampleLayers` gives one-layer samples one at a time, so that the driver holds one
layer of the merge and one layer of a part (Q/L each), never the whole sample; from a one-layer
sample of :data:`~embgeom_ray.sizing.formulas.SAMPLE_ON_WORKERS_BYTES`
(:func:`~embgeom_ray.sizing.formulas.on_workers`),
Ray tasks take the :class:`SampleLayers` and read their layer themselves
(:mod:`embgeom_ray.distributed.sample_tasks`), and the driver holds none of it:

- :class:`FileSample`: a sample file (a checkpoint group's), read only in the layer's byte
  range (:meth:`ActivationSample.load_layer <embgeom_ray.core.samples.ActivationSample.load_layer>`);
- :class:`~embgeom_ray.runs.run_samples.RunSamples`: a finished run's ``samples.parquet``,
  each layer's row groups read alone (beside the run directory it reads, above this core);
- :class:`InMemorySample`: a sample whole in memory, sliced;
- :class:`MergedSamples`: the merge of several of these, redone per layer in their order.

One exception keeps the whole merge: samples of the ``"vectors"`` content rule (format
version 1, whose keys hash every layer's vectors) or of different rules (their merge falls
back to that rule) merge whole (:func:`merged_layers`), as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ..errors import StatisticsMismatchError
from ..integrity import FileRef, as_ref, open_verified
from .options import header_entries
from .samples import ActivationSample
from .sketch import SafetensorsFile


class SampleLayers(Protocol):
    """A sample given one layer at a time (the module docstring)."""

    layers: list[int]
    #: the sample's header (every layer): its content rule, sizes, seed, metadata
    header: dict[str, Any]
    #: the entries (uniform and type-uniform) each layer holds at most, as drawn (None: not
    #: known without reading a layer; :func:`drawn_entries`)
    drawn: int | None

    def layer(self, layer: int) -> ActivationSample:
        """The one-layer sample of ``layer`` (its header that of the whole sample but the
        ``layers``)."""


def _rule(header: dict[str, Any]) -> str:
    """The content rule of a sample of ``header`` (version 1: ``"vectors"``)."""
    version = ActivationSample.check_header(header)
    return str(header.get("content_rule", "vectors" if version < 2 else ""))


class InMemorySample:
    """A whole :class:`ActivationSample` as a :class:`SampleLayers`."""

    def __init__(self, sample: ActivationSample) -> None:
        self.sample = sample
        self.layers = list(sample.layers)
        self.header = sample.header()
        self.drawn: int | None = sample.num_uniform + sample.num_types

    def layer(self, layer: int) -> ActivationSample:
        return self.sample.layer_sample(layer)

    def whole(self) -> ActivationSample:
        return self.sample


class FileSample:
    """The sample :meth:`~embgeom_ray.core.sketch.Sketch.save` wrote at ``url`` (with the
    digest recorded when it was written, which every read is checked against); only its
    header is read here."""

    def __init__(self, url: str | FileRef) -> None:
        self.ref = as_ref(url)
        self.url = self.ref.url
        with open_verified(self.ref) as f:
            st = SafetensorsFile(f, ActivationSample.KIND)
            self.header = st.header()
            # the (L, n, d) vectors of either sample: n entries of each, as drawn
            shapes = [st.shape(f"{p}_vectors") for p in "ut" if f"{p}_vectors" in st.keys()]
        self.layers = [int(x) for x in self.header["layers"]]
        self.drawn: int | None = sum(int(s[1]) for s in shapes) if shapes else None

    def layer(self, layer: int) -> ActivationSample:
        return ActivationSample.load_layer(self.ref, layer)

    def whole(self) -> ActivationSample:
        return ActivationSample.load(self.ref)


class MergedSamples:
    """The merge of ``parts`` (in that order), a layer at a time: each part's one-layer
    sample of the layer merged (each read once per layer: its columns, O(s), and one layer's
    vectors)."""

    def __init__(self, parts: Sequence[SampleLayers]) -> None:
        self.parts = list(parts)
        self.layers = list(self.parts[0].layers)
        self.header = self.parts[0].header
        drawn = [drawn_entries(part) for part in self.parts]
        # the parts' entries together, at most what the sample's sizes hold (the uniform
        # parts are disjoint, so that part is exact; a type drawn in two parts counts twice)
        self.drawn: int | None = (None if None in drawn
                                  else min(sum(drawn), sum(header_entries(self.header))))  # type: ignore[arg-type]  # fmt: skip

    def layer(self, layer: int) -> ActivationSample:
        merged = self.parts[0].layer(layer)
        for part in self.parts[1:]:
            merged.merge(part.layer(layer))
        return merged


def merged_layers(parts: Sequence[Any], names: Sequence[str] | None = None) -> SampleLayers | None:
    """``parts`` (:class:`FileSample`, :class:`~embgeom_ray.runs.run_samples.RunSamples`,
    :class:`InMemorySample`: each a :class:`SampleLayers` with a ``whole()``) merged in order:
    a layer at a time (:class:`MergedSamples`), or whole when a layer-wise merge would differ
    from the whole one (the module docstring). Parts that cannot merge (other layers, sizes,
    seed, model) are refused here, before any layer is read, naming the part (``names``,
    default its index). None without parts."""
    if not parts:
        return None
    names = list(names) if names is not None else [str(i) for i in range(len(parts))]
    check = ActivationSample.empty(parts[0].header)
    for part, name in zip(parts[1:], names[1:], strict=True):
        try:
            check.check_compatible(ActivationSample.empty(part.header))
        except StatisticsMismatchError as exc:
            raise StatisticsMismatchError(f"cannot merge the sample of {name}: {exc}") from None
    rules = {_rule(part.header) for part in parts}
    if len(rules) == 1 and "vectors" not in rules:
        return parts[0] if len(parts) == 1 else MergedSamples(parts)
    merged = parts[0].whole()
    for part in parts[1:]:
        merged.merge(part.whole())
    return InMemorySample(merged)


def sample_layers(urls: Sequence[str | FileRef]) -> SampleLayers | None:
    """The sample files at ``urls`` (checkpoint groups', with their digests) merged in order
    a layer at a time (:func:`merged_layers`); None without any."""
    return merged_layers([FileSample(url) for url in urls], [str(url) for url in urls])


def drawn_entries(sample: Any) -> int | None:
    """The entries (uniform + type-uniform) each layer of ``sample`` holds at most, as it was
    drawn: fewer than its sizes (:func:`~embgeom_ray.core.options.header_entries`) where the corpus had fewer
    occurrences or types (a small corpus, ``--sample-type-size`` beyond the types seen).
    From the arrays' shapes (a sample file's header, a run's row count), no layer read; None
    where ``sample`` does not say (then its sizes are the most it can be)."""
    drawn = getattr(sample, "drawn", None)
    return None if drawn is None else int(drawn)


def as_layers(sample: ActivationSample | SampleLayers | None) -> SampleLayers | None:
    """``sample`` as a :class:`SampleLayers` (a whole sample wrapped)."""
    return InMemorySample(sample) if isinstance(sample, ActivationSample) else sample
