"""The files of :class:`~embgeom_ray.core.statistics.EmbeddingStatistics`: writing, reading,
reading a part, and the versions read.

The functions here take the statistics as :class:`HeldStatistics` (what they read and fill:
the type moments, the per-layer state, the fields held), so this module, below
``core/statistics.py``, never imports it; the class's methods call them.

A statistics file is the sketches' safetensors file (``core/sketch.py``): named little-endian
arrays, no pickle, and a JSON header ::

    {"format": "embgeom_ray.statistics", "version": 2, "layers": [...], "dim": d,
     "max_positions": P, "clip_dims": [...] | null, "comoment_precision": "...",
     "partition": {"of_layers": [...], "token_range": [lo, hi], "layer_state": bool} | null,
     "metadata": {...}}

The arrays are the held :data:`FIELDS <embgeom_ray.core.statistics_fields.FIELDS>` (per-type
ones (L, T, *tail), per-layer ones (L, *tail)) and ``type_ids`` (T,): the types sorted by id,
unused slots dropped, so equal statistics give equal bytes, and a token range is one contiguous
run of rows that :func:`read_part` reads alone. Versions read (:data:`READS`): 1, without the
``partition`` record (a whole), and 2.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from ..errors import StatisticsMismatchError
from .layer_state import LayerState
from .partitions import StatisticsPart, range_text, requested_part
from .sketch import (
    HEADER_KEY,
    SafetensorsFile,
    check_array,
    safetensors_blocks,
    safetensors_into,
    safetensors_layout,
)
from .statistics_fields import FIELDS, STREAM_BLOCK_BYTES, Field
from .type_moments import TypeMoments

#: the ``format`` of the header (this name since the first version; see :data:`READS`).
FORMAT = "embgeom_ray.statistics"
#: version 2 adds the header's ``partition`` record; version 1 files (no record) are wholes.
FORMAT_VERSION = 2
#: format names and versions read.
READS = {FORMAT: frozenset({1, 2})}


class HeldStatistics(Protocol):
    """What the functions below read and fill of statistics
    (:class:`~embgeom_ray.core.statistics.EmbeddingStatistics`)."""

    KIND: ClassVar[str]
    layers: list[int]
    dim: int
    max_positions: int
    device: torch.device
    type_moments: TypeMoments
    layer_state: LayerState | None

    @property
    def num_types(self) -> int: ...

    @property
    def arrays(self) -> dict[str, torch.Tensor]: ...

    @property
    def token_range(self) -> tuple[int, int | None]: ...

    def held_fields(self) -> list[Field]: ...

    def header(self) -> dict[str, Any]: ...


def state_arrays(stats: HeldStatistics) -> dict[str, np.ndarray]:
    """The held fields plus ``type_ids``: types sorted by id, unused slots dropped, all on
    the CPU (:meth:`EmbeddingStatistics.state_dict`)."""
    order = stats.type_moments.order()
    t = stats.num_types
    arrays = stats.arrays
    out = {"type_ids": stats.type_moments.slot_ids[order]}
    for f in stats.held_fields():
        a = arrays[f.name]
        out[f.name] = a[:, :t][:, order] if f.per_type else a
    return {k: np.ascontiguousarray(v.detach().cpu().numpy()) for k, v in out.items()}


def _file_arrays(
    stats: HeldStatistics,
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], dict[str, tuple[torch.Tensor, bool]], torch.Tensor]:
    """What a statistics file holds: each array's (dtype, shape) in the file, its source and
    whether it is per type, and the slots' order (types by id, unused slots dropped)."""
    order = stats.type_moments.order()
    t = stats.num_types
    arrays = stats.arrays
    sources = {"type_ids": (stats.type_moments.slot_ids, False)}
    sources |= {f.name: (arrays[f.name], f.per_type) for f in stats.held_fields()}
    specs = {}
    for name, (a, per_type) in sources.items():
        shape = (t,) if name == "type_ids" else ((a.shape[0], t, *a.shape[2:]) if per_type else tuple(a.shape))  # fmt: skip
        specs[name] = (a.dtype, shape)
    return specs, sources, order


def to_bytes(stats: HeldStatistics, into: np.ndarray | None = None) -> bytearray | np.ndarray:
    """The safetensors file of :func:`state_arrays` and the header, each array gathered
    straight into its place in the file's buffer (:func:`~embgeom_ray.core.sketch.safetensors_into`;
    ``into``: a uint8 array to reuse as that buffer where it is large enough)."""
    specs, sources, order = _file_arrays(stats)
    t = stats.num_types

    def fill(name: str, out: torch.Tensor) -> None:
        a, per_type = sources[name]
        if name == "type_ids":
            out.copy_(a.index_select(0, order))
        elif per_type:
            # a layer at a time: a layer's slots are contiguous, where the first t slots of
            # every layer are not, and index_select would first copy them whole (one field of
            # every layer: half the statistics, beyond the one copy serialising may hold)
            for layer in range(a.shape[0]):
                rows = a[layer, :t]
                if rows.device == out.device:
                    torch.index_select(rows, 0, order, out=out[layer])
                else:  # one layer's rows gathered where they are, then copied over
                    out[layer].copy_(rows.index_select(0, order))
        else:
            out.copy_(a)

    return safetensors_into(specs, fill, {HEADER_KEY: json.dumps(stats.header())}, into)


#: a statistics file given whole; a file made a block at a time (:class:`StreamedStatistics`,
#: or the Ray layer's blocks in the object store) is any other object with its ``size`` that
#: gives its blocks when iterated
BYTES_LIKE = (bytes, bytearray, memoryview, np.ndarray)


class StreamedStatistics:
    """The file of :func:`to_bytes`, byte for byte, made a block at a time as it is read
    (:func:`~embgeom_ray.core.sketch.safetensors_blocks`): iterating yields uint8 arrays of at
    most ``block_bytes`` (one reused buffer: each valid until the next is asked for), so
    writing statistics of H bytes holds H and one block, not H and a serialised copy of H.
    ``size``: the file's bytes. The statistics must not change until the blocks are read; each
    iteration makes the file again."""

    def __init__(self, stats: HeldStatistics, block_bytes: int = STREAM_BLOCK_BYTES) -> None:
        self.stats, self.block_bytes = stats, int(block_bytes)
        specs, _, _ = _file_arrays(stats)
        self.size = safetensors_layout(specs, self._metadata())[3]

    def _metadata(self) -> dict[str, str]:
        return {HEADER_KEY: json.dumps(self.stats.header())}

    def __iter__(self) -> Iterator[np.ndarray]:
        stats = self.stats
        specs, sources, order = _file_arrays(stats)
        t = stats.num_types

        def fill_rows(name: str, lead: int | None, lo: int, hi: int, out: torch.Tensor) -> None:
            a, per_type = sources[name]
            if name == "type_ids":
                out.copy_(a.index_select(0, order[lo:hi]))
            elif per_type and lead is None:  # whole layers: (hi − lo, t, …)
                out.copy_(a[lo:hi, :t].index_select(1, order))
            elif per_type:  # rows lo:hi of one layer's types in id order: (hi − lo, …)
                out.copy_(a[lead].index_select(0, order[lo:hi]))
            elif not specs[name][1]:
                out.copy_(a)
            else:
                out.copy_(a[lo:hi] if lead is None else a[lead, lo:hi])

        yield from safetensors_blocks(specs, fill_rows, self._metadata(), self.block_bytes)


def empty_arguments(header: Mapping[str, Any], version: int) -> dict[str, Any]:
    """The constructor's arguments (but the device) of empty statistics with the header's
    fields (version 1: a whole, no partition)."""
    record = header.get("partition") if version >= 2 else None
    return {
        "layers": [int(x) for x in header["layers"]],
        "dim": int(header["dim"]),
        "max_positions": int(header.get("max_positions", 0)),
        "metadata": header.get("metadata"),
        "initial_types": 1,
        "clip_dims": header.get("clip_dims"),
        "comoment_precision": header.get("comoment_precision", "float64"),
        "partition": None if record is None else StatisticsPart.from_json(record),
    }


def set_state(stats: HeldStatistics, arrays: Mapping[str, np.ndarray]) -> None:
    """Fill the new, empty ``stats`` from :func:`state_arrays`'s arrays, each checked against
    its field."""
    t = int(np.asarray(arrays["type_ids"]).shape[0]) if "type_ids" in arrays else 0
    ids = check_array(arrays, "type_ids", (t,), np.int64, stats.KIND)
    lo, hi = stats.token_range
    if t and ((np.diff(ids) <= 0).any() or ids[0] < lo or (hi is not None and ids[-1] >= hi)):
        raise StatisticsMismatchError(
            f"statistics type_ids are not increasing ids in {range_text((lo, hi))}"
        )
    shape = (len(stats.layers), t, stats.dim, stats.max_positions)
    if t:
        stats.type_moments.slots_for(torch.from_numpy(np.array(ids)).to(stats.device))  # 0..t-1
    # one field at a time, and the per-type rows copied straight from the (read-only)
    # arrays into their slots: a reader holds the arrays read and these statistics, not a
    # third copy of everything
    for f in stats.held_fields():
        a = check_array(arrays, f.name, f.shape(*shape), f.numpy_dtype, stats.KIND)
        if f.per_type:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # a read-only view, copied
                stats.type_moments.arrays[f.name][:, :t] = torch.from_numpy(np.asarray(a)).to(
                    stats.device
                )
        else:
            stats.layer_state.arrays[f.name] = (
                torch.from_numpy(np.array(a)).to(stats.device).contiguous()
            )


def read_part(
    st: SafetensorsFile,
    header: dict[str, Any],
    layers: Sequence[int] | None,
    token_range: tuple[int, int | None],
    layer_state: bool,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The header and arrays of a part of an open safetensors file (version 2 and later), for
    :meth:`~embgeom_ray.core.statistics.EmbeddingStatistics.from_state`: of a whole, or of a
    part that holds what is asked (:func:`~embgeom_ray.core.partitions.requested_part`).

    Files store the types sorted by id, so a token range is one contiguous run of rows: each
    per-type array is read as one ``[layer, a:b]`` range of bytes per layer, and each
    per-layer array only for the kept layers (:class:`~embgeom_ray.core.sketch.SafetensorsFile`).
    What a reducer holds while reading a checkpoint group is then its part, not the group.
    A :class:`~embgeom_ray.integrity.FileRef` with a digest has every block read checked
    against it."""
    record = header.get("partition")
    held = [int(x) for x in header["layers"]]
    kept, part = requested_part(
        held, None if record is None else StatisticsPart.from_json(record), layers, token_range,
        layer_state,
    )  # fmt: skip
    lis = [held.index(x) for x in kept]
    arrays = _read_rows(st, header.get("clip_dims") is not None, lis, token_range, layer_state)
    record = None if part is None else part.to_json()
    return header | {"layers": kept, "partition": record}, arrays


def _read_rows(
    st: SafetensorsFile,
    clip: bool,
    lis: Sequence[int],
    token_range: tuple[int, int | None],
    layer_state: bool,
) -> dict[str, np.ndarray]:
    """The arrays of layer slots ``lis`` and the types in ``token_range`` of a safetensors
    file of statistics (with ``clip_unit_sums`` if ``clip``; the per-layer fields if
    ``layer_state``), each read as ranges of bytes."""
    lo, hi = token_range
    ids = st.array("type_ids")
    a = int(np.searchsorted(ids, lo, "left"))
    b = len(ids) if hi is None else int(np.searchsorted(ids, hi, "left"))
    arrays = {"type_ids": ids[a:b]}
    for field in FIELDS:
        if (field.clip and not clip) or (not field.per_type and not layer_state):
            continue
        if field.name not in st.keys():
            raise StatisticsMismatchError(f"{st.f.url}: {st.kind} artefact lacks array {field.name!r}")
        shape = st.shape(field.name)
        if field.per_type:
            rows = [st.rows(field.name, li, a, b) for li in lis]
            none = (0, b - a, *shape[2:])
        else:
            rows = [st.layer(field.name, li) for li in lis]
            none = (0, *shape[1:])
        arrays[field.name] = (
            np.concatenate(rows) if len(rows) > 1 else rows[0] if rows
            else np.empty(none, field.numpy_dtype)
        )  # fmt: skip
    return arrays
