"""The one file format and contract shared by the job's sketches.

:class:`~embgeom_ray.core.statistics.EmbeddingStatistics` (moments) and
:class:`~embgeom_ray.core.samples.ActivationSample` (bounded samples) are sketches in the Apache
DataSketches sense: ``update`` (fold a batch), ``merge`` (combine two sketches of disjoint
inputs), ``save``/``load`` and read-only views. This module holds what they share:

the file
    a safetensors file (named little-endian arrays; no pickle, nothing executed on load) whose
    metadata holds one entry, ``"embgeom_ray"``: a JSON *header* ::

        {"format": NAME, "version": V, "layers": [...], "dim": d, <the class's own fields>,
         "metadata": {"model_fingerprint": ..., ...}}

    ``format`` names the sketch class, ``version`` the layout of its arrays; a reader accepts
    the versions it lists in :attr:`Sketch.READS` (older layouts keep loading) and refuses the
    rest with a one-line :class:`~embgeom_ray.errors.StatisticsMismatchError`;
identity
    ``layers`` and ``dim`` plus the class's :attr:`Sketch.MERGE_FIELDS` must be equal for two
    sketches to merge, and so must the :data:`IDENTITY_KEYS` of their ``metadata`` where both
    have them; :meth:`Sketch.check_compatible` names everything that differs;
update validation
    :meth:`Sketch._batch` checks one batch's shapes (hidden states per layer, token ids, keep
    mask, positions) and says which one is wrong.

Writes are atomic (:func:`embgeom_ray.io_utils.atomic_write_bytes`): a reader sees the old file
or the whole new one.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch
from safetensors.numpy import load as st_load_bytes
from safetensors.numpy import save as st_save_bytes

from ..errors import StatisticsMismatchError
from ..integrity import Digest, FileRef, VerifiedFile, read_verified

#: the safetensors metadata entry that holds the JSON header.
HEADER_KEY = "embgeom_ray"
#: metadata keys that must agree (where both sketches have them) for two sketches to merge.
IDENTITY_KEYS = ("model_fingerprint", "tokenizer_fingerprint", "keep_special")

_S = TypeVar("_S", bound="Sketch")


def read_header(data: bytes, kind: str) -> dict[str, Any]:
    """The JSON header stored in the metadata of the safetensors bytes ``data``.

    A safetensors file starts with an 8-byte little-endian length N and N bytes of JSON whose
    ``__metadata__`` maps strings to strings; ours holds the header under :data:`HEADER_KEY`.
    """
    if len(data) < 8:
        raise StatisticsMismatchError(f"{kind} artefact is empty or truncated")
    size = int.from_bytes(data[:8], "little")
    try:
        raw = json.loads(data[8 : 8 + size].decode("utf-8"))
        header = json.loads(raw["__metadata__"][HEADER_KEY])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise StatisticsMismatchError(f"not an embgeom_ray {kind} artefact ({exc})") from None
    if not isinstance(header, dict):
        raise StatisticsMismatchError(f"not an embgeom_ray {kind} artefact: header {header!r:.80}")
    return header


#: safetensors' names of the torch dtypes our sketches store
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def safetensors_layout(
    specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], metadata: Mapping[str, str]
) -> tuple[list[str], dict[str, Any], bytes, int]:
    """The safetensors file of arrays of ``specs`` (name → dtype, shape) and ``metadata``:
    (the arrays in file order, the header, the file's first bytes: the 8-byte little-endian
    header length and the JSON header padded with spaces to 8 bytes, the file's size). The
    arrays come back to back after those bytes, the widest dtypes first (every array
    aligned), each at its header's ``data_offsets``."""
    order = sorted(specs, key=lambda n: -torch.empty((), dtype=specs[n][0]).element_size())
    header: dict[str, Any] = {}
    offset = 0
    for name in order:
        dtype, shape = specs[name]
        size = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": [int(x) for x in shape],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header["__metadata__"] = dict(metadata)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    prefix = len(text).to_bytes(8, "little") + text
    return order, header, prefix, len(prefix) + offset


def safetensors_into(
    specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    fill: Callable[[str, torch.Tensor], None],
    metadata: Mapping[str, str],
    into: np.ndarray | None = None,
) -> bytearray | np.ndarray:
    """A safetensors file built in one buffer: ``specs`` names each array's dtype and shape,
    and ``fill(name, out)`` writes the array into ``out``, a CPU tensor that is its slice of
    the buffer. Nothing else is allocated, so serialising costs one copy of the arrays, not
    the two of building them and then the file (:func:`safetensors.numpy.save`).

    ``into``: a uint8 array to build the file in, reused across calls (its first bytes are
    returned, as a uint8 array, when it is large enough; else a new bytearray): a caller
    that serialises again and again (an extractor spilling) writes into memory already paged
    in instead of faulting in a fresh buffer each time.

    The layout is the safetensors format (:func:`safetensors_layout`).
    """
    order, header, prefix, size = safetensors_layout(specs, metadata)
    buf: bytearray | np.ndarray = (
        into[:size] if into is not None and into.nbytes >= size else bytearray(size)
    )
    view = memoryview(buf).cast("B")
    view[: len(prefix)] = prefix
    base = len(prefix)
    for name in order:
        dtype, shape = specs[name]
        a, b = header[name]["data_offsets"]
        if b > a:
            count = (b - a) // torch.empty((), dtype=dtype).element_size()
            out = torch.frombuffer(buf, dtype=dtype, count=count, offset=base + a)
            fill(name, out.view(shape))
    return buf


#: ``fill_rows(name, lead, lo, hi, out)``: write rows ``lo:hi`` of the named array (``lead``
#: None), or of its sub-array ``[lead]`` (an int), into ``out``
FillRows = Callable[[str, "int | None", int, int, torch.Tensor], None]


def safetensors_blocks(
    specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    fill_rows: FillRows,
    metadata: Mapping[str, str],
    block_bytes: int,
) -> Iterator[np.ndarray]:
    """The safetensors file of :func:`safetensors_into`, byte for byte, as consecutive blocks
    of at most ``block_bytes`` (more only where one row of an array's last dimensions is
    larger): its first bytes, then each array in rows of its first axis, or of its second
    within one index of the first where one row of the first is larger than a block. Each
    block is a uint8 view of one buffer, reused: valid until the next block is asked for, so
    serialising holds one block beside the arrays, not a copy of them."""
    order, _, prefix, _ = safetensors_layout(specs, metadata)
    yield np.frombuffer(prefix, dtype=np.uint8)
    plans: list[tuple[str, torch.dtype, list[tuple[int | None, int, int, tuple[int, ...]]]]] = []
    largest = 0
    for name in order:
        dtype, shape = specs[name]
        size = torch.empty((), dtype=dtype).element_size()
        if int(np.prod(shape, dtype=np.int64)) == 0:
            continue
        if not shape:
            plans.append((name, dtype, [(None, 0, 1, ())]))
            largest = max(largest, size)
            continue
        row = int(np.prod(shape[1:], dtype=np.int64)) * size
        blocks: list[tuple[int | None, int, int, tuple[int, ...]]] = []
        if row <= block_bytes or len(shape) == 1:
            step = max(1, block_bytes // max(row, 1))
            for lo in range(0, shape[0], step):
                hi = min(shape[0], lo + step)
                blocks.append((None, lo, hi, (hi - lo, *shape[1:])))
            largest = max(largest, min(step, shape[0]) * row)
        else:
            sub = int(np.prod(shape[2:], dtype=np.int64)) * size
            step = max(1, block_bytes // max(sub, 1))
            for lead in range(shape[0]):
                for lo in range(0, shape[1], step):
                    hi = min(shape[1], lo + step)
                    blocks.append((lead, lo, hi, (hi - lo, *shape[2:])))
            largest = max(largest, min(step, shape[1]) * sub)
        plans.append((name, dtype, blocks))
    if not plans:
        return
    buf = np.empty(largest, dtype=np.uint8)
    for name, dtype, blocks in plans:
        for lead, lo, hi, shape in blocks:
            count = int(np.prod(shape, dtype=np.int64))
            out = torch.frombuffer(buf, dtype=dtype, count=count).view(shape)
            fill_rows(name, lead, lo, hi, out)
            yield buf[: count * out.element_size()]


def check_array(
    arrays: Mapping[str, np.ndarray], name: str, shape: tuple[int, ...], dtype: Any, kind: str
) -> np.ndarray:
    """``arrays[name]``, after checking that it exists with this shape and dtype."""
    if name not in arrays:
        raise StatisticsMismatchError(f"{kind} artefact lacks array {name!r}")
    a = arrays[name]
    if tuple(a.shape) != tuple(shape) or a.dtype != np.dtype(dtype):
        raise StatisticsMismatchError(
            f"{kind} array {name!r} is {tuple(a.shape)} {a.dtype}, expected "
            f"{tuple(shape)} {np.dtype(dtype)}"
        )
    return a


#: numpy's dtypes of safetensors' names (those our sketches store; no bfloat16 in numpy)
NUMPY_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}  # fmt: skip


class SafetensorsFile:
    """A safetensors file read a range at a time through ``f`` (a
    :class:`~embgeom_ray.integrity.VerifiedFile`: every block read is checked against the
    file's digest, where it has one): its header, whole arrays, and the slices a part of
    a sketch needs (one layer of an array, a run of rows of one layer), each one read of
    its bytes. Works alike on local files and object stores (ranged reads)."""

    def __init__(self, f: VerifiedFile, kind: str) -> None:
        self.f, self.kind = f, kind
        head = f.read_range(0, 8) if f.size() >= 8 else b""
        if len(head) < 8:
            raise StatisticsMismatchError(f"{f.url}: {kind} artefact is empty or truncated")
        size = int.from_bytes(head, "little")
        if 8 + size > f.size():
            raise StatisticsMismatchError(f"{f.url}: {kind} artefact is truncated")
        try:
            raw = json.loads(bytes(f.read_range(8, 8 + size)).decode("utf-8"))
            self.metadata = dict(raw.pop("__metadata__", None) or {})
            self.specs = {
                name: (NUMPY_DTYPES[spec["dtype"]], tuple(int(x) for x in spec["shape"]),
                       tuple(int(x) for x in spec["data_offsets"]))
                for name, spec in raw.items()
            }  # fmt: skip
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise StatisticsMismatchError(f"{f.url}: not an embgeom_ray {kind} artefact ({exc})") from None
        self.base = 8 + size

    def header(self) -> dict[str, Any]:
        """The JSON header under :data:`HEADER_KEY`."""
        try:
            header = json.loads(self.metadata[HEADER_KEY])
        except (KeyError, ValueError, TypeError) as exc:
            raise StatisticsMismatchError(
                f"{self.f.url}: not an embgeom_ray {self.kind} artefact ({exc})"
            ) from None
        if not isinstance(header, dict):
            raise StatisticsMismatchError(f"{self.f.url}: not an embgeom_ray {self.kind} artefact")
        return header

    def keys(self) -> list[str]:
        return list(self.specs)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.specs[name][1]

    def _read(self, name: str, offset: int, shape: Sequence[int]) -> np.ndarray:
        """The ``shape`` elements of array ``name`` from element ``offset`` on."""
        dtype, _, (start, end) = self.specs[name]
        count = int(np.prod(shape, dtype=np.int64))
        lo = self.base + start + offset * dtype.itemsize
        hi = lo + count * dtype.itemsize
        if hi > self.base + end:
            raise StatisticsMismatchError(f"{self.f.url}: {self.kind} array {name!r} is truncated")
        return np.frombuffer(self.f.read_range(lo, hi), dtype=dtype).reshape(tuple(shape))

    def array(self, name: str) -> np.ndarray:
        """The whole array ``name``."""
        return self._read(name, 0, self.shape(name))

    def layer(self, name: str, index: int) -> np.ndarray:
        """``array[index : index + 1]`` of an array of layers first, ``(L, *tail)``."""
        shape = self.shape(name)
        tail = int(np.prod(shape[1:], dtype=np.int64))
        return self._read(name, index * tail, (1, *shape[1:]))

    def rows(self, name: str, index: int, a: int, b: int) -> np.ndarray:
        """``array[index : index + 1, a:b]`` of an ``(L, T, *tail)`` array."""
        shape = self.shape(name)
        row = int(np.prod(shape[2:], dtype=np.int64))
        return self._read(name, (index * shape[1] + a) * row, (1, b - a, *shape[2:]))


def finite_layers(hidden: Sequence[torch.Tensor]) -> list[bool]:
    """Whether each layer's hidden states are all finite: one float32 sum per layer (a finite
    sum has finite terms; a sum that overflows float32 only sends its layer down the exact
    row-by-row check) and one host synchronisation for all layers together, not one per layer
    (on a GPU every synchronisation stalls the kernels the host could queue meanwhile)."""
    if not hidden:
        return []
    dev = hidden[0].device
    sums = torch.stack([h.sum(dtype=torch.float32).to(dev) for h in hidden])
    return torch.isfinite(sums).tolist()


class Sketch(ABC):
    """Base of the job's sketches: header, serialisation, identity check, batch validation.

    A subclass sets :attr:`FORMAT`, :attr:`FORMAT_VERSION`, :attr:`READS`, :attr:`KIND`,
    :attr:`HEADER_FIELDS` and :attr:`MERGE_FIELDS`, calls :meth:`_init_sketch` in its
    constructor and implements :meth:`state_dict` (writing), :meth:`_empty` and
    :meth:`_set_state` (reading).
    """

    #: the ``format`` written in the header.
    FORMAT: ClassVar[str]
    #: the layout version written.
    FORMAT_VERSION: ClassVar[int]
    #: format names this class reads (former names included) and, for each, the versions.
    READS: ClassVar[Mapping[str, frozenset[int]]]
    #: what the sketch is called in messages ("statistics", "samples").
    KIND: ClassVar[str]
    #: the class's own attributes written in the header (besides ``layers``, ``dim``, ``metadata``).
    HEADER_FIELDS: ClassVar[tuple[str, ...]] = ()
    #: attributes besides ``layers`` and ``dim`` that must be equal to merge.
    MERGE_FIELDS: ClassVar[tuple[str, ...]] = ()
    IDENTITY_KEYS: ClassVar[tuple[str, ...]] = IDENTITY_KEYS

    layers: list[int]
    dim: int
    device: torch.device
    metadata: dict[str, str]

    def _init_sketch(
        self,
        layers: Sequence[int],
        dim: int,
        device: str | torch.device,
        metadata: Mapping[str, str] | None,
    ) -> None:
        """Check and set the fields every sketch has."""
        if not layers:
            raise ValueError("at least one layer is required")
        if len(set(layers)) != len(layers):
            raise ValueError(f"layers must be distinct, got {list(layers)}")
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        self.layers = [int(x) for x in layers]
        self.dim = int(dim)
        self.device = torch.device(device)
        self.metadata = {str(k): str(v) for k, v in (metadata or {}).items()}

    # ------------------------------------------------------------ header
    def _header_fields(self) -> dict[str, Any]:
        """The class's own header fields (between ``dim`` and ``metadata``): its
        :attr:`HEADER_FIELDS`, as JSON values."""
        return {name: getattr(self, name) for name in self.HEADER_FIELDS}

    def header(self) -> dict[str, Any]:
        """The JSON header written with the arrays (see the module docstring)."""
        return {
            "format": self.FORMAT,
            "version": self.FORMAT_VERSION,
            "layers": self.layers,
            "dim": self.dim,
            **self._header_fields(),
            "metadata": self.metadata,
        }

    @classmethod
    def check_header(cls, header: Mapping[str, Any]) -> int:
        """The header's layout version, after checking that this class reads it."""
        versions = cls.READS.get(header.get("format"))  # type: ignore[arg-type]
        if versions is None:
            raise StatisticsMismatchError(
                f"not an embgeom_ray {cls.KIND} artefact: {dict(header)!r:.200}"
            )
        try:
            version = int(header.get("version", -1))
        except (TypeError, ValueError):
            version = -1
        if version not in versions:
            raise StatisticsMismatchError(
                f"{cls.KIND} format version {header.get('version')} is not supported "
                f"(this embgeom_ray reads versions {sorted(versions)})"
            )
        missing = [k for k in ("layers", "dim") if k not in header]
        if missing:
            raise StatisticsMismatchError(f"{cls.KIND} header lacks {', '.join(missing)}")
        return version

    # ------------------------------------------------------ persistence
    @abstractmethod
    def state_dict(self) -> dict[str, np.ndarray]:
        """The sketch's arrays, in a canonical order, on the CPU."""

    @classmethod
    @abstractmethod
    def _empty(cls: type[_S], header: Mapping[str, Any], version: int, device: Any) -> _S:
        """An empty sketch with the fields of ``header`` (of layout ``version``)."""

    @classmethod
    def empty(cls: type[_S], header: Mapping[str, Any], device: Any = "cpu") -> _S:
        """An empty sketch with the fields of ``header`` (after checking that this class reads
        it): what merges with the sketch of that header (:meth:`check_compatible`)."""
        return cls._empty(header, cls.check_header(header), device)

    @abstractmethod
    def _set_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Fill this new, empty sketch with :meth:`state_dict`'s arrays, checking each."""

    @classmethod
    def from_state(
        cls: type[_S],
        header: Mapping[str, Any],
        arrays: Mapping[str, np.ndarray],
        *,
        device: str | torch.device = "cpu",
    ) -> _S:
        """Rebuild from :meth:`header` and :meth:`state_dict` (of any version in READS)."""
        version = cls.check_header(header)
        try:
            sketch = cls._empty(header, version, device)
        except (KeyError, TypeError, ValueError) as exc:
            raise StatisticsMismatchError(f"{cls.KIND} header is not valid ({exc})") from None
        sketch._set_state(arrays)
        return sketch

    def to_bytes(self) -> bytes:
        """Serialize to safetensors bytes (the header JSON in the safetensors metadata)."""
        return st_save_bytes(self.state_dict(), metadata={HEADER_KEY: json.dumps(self.header())})

    def save(self, path: str | os.PathLike[str]) -> Digest:
        """Write atomically to a local path or fsspec URL (temporary name, then rename); the
        digest of the bytes written (:mod:`embgeom_ray.integrity`), for the record that names
        the file."""
        from ..io_utils import atomic_write_bytes

        data = self.to_bytes()
        atomic_write_bytes(str(path), data)
        return Digest.of(data)

    @classmethod
    def from_bytes(
        cls: type[_S], data: bytes | bytearray | memoryview | np.ndarray, *, device: str | torch.device = "cpu"
    ) -> _S:
        """Read :meth:`to_bytes`'s file from any bytes-like object (bytes, a bytearray, a
        uint8 array from Ray's object store)."""
        if not isinstance(data, bytes):
            data = memoryview(data).cast("B").tobytes()  # safetensors reads bytes only
        return cls.from_state(read_header(data, cls.KIND), st_load_bytes(data), device=device)

    @classmethod
    def load(
        cls: type[_S], path: str | os.PathLike[str] | FileRef, *, device: str | torch.device = "cpu"
    ) -> _S:
        """Read a sketch written by :meth:`save` (or by an earlier layout this class reads);
        a :class:`~embgeom_ray.integrity.FileRef` with a digest is checked against it
        (:class:`~embgeom_ray.errors.IntegrityError`)."""
        ref = path if isinstance(path, FileRef) else FileRef(str(path))
        data = read_verified(ref)
        try:
            return cls.from_bytes(data, device=device)
        except StatisticsMismatchError as exc:
            raise StatisticsMismatchError(f"{ref.url}: {exc}") from None

    # ---------------------------------------------------------- identity
    def mismatches(self, other: Sketch, names: Sequence[str] | None = None) -> list[str]:
        """What differs between ``self`` and ``other`` that forbids merging them, one phrase
        each (``"name <other's> != <self's>"``); empty when they measure the same thing.

        ``names``: the attributes compared (default ``layers``, ``dim`` and
        :attr:`MERGE_FIELDS`); the metadata's :attr:`IDENTITY_KEYS` are always compared.
        """
        problems = []
        for name in ("layers", "dim", *self.MERGE_FIELDS) if names is None else names:
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                problems.append(f"{name} {b!r} != {a!r}")
        for key in self.IDENTITY_KEYS:
            a, b = self.metadata.get(key), other.metadata.get(key)
            if a is not None and b is not None and a != b:
                problems.append(f"{key} {b!r} != {a!r}")
        return problems

    def check_compatible(self, other: Sketch) -> None:
        """Raise :class:`StatisticsMismatchError` unless ``other`` measures the same thing."""
        if type(other) is not type(self):
            raise StatisticsMismatchError(
                f"cannot merge {type(other).__name__} into {type(self).__name__}"
            )
        problems = self.mismatches(other)
        if problems:
            raise StatisticsMismatchError(
                f"cannot merge {self.KIND} of different measurements: " + "; ".join(problems)
            )

    def _adopt_metadata(self, other: Sketch) -> None:
        """Keep ``self``'s metadata; add the keys only ``other`` has."""
        for key, value in other.metadata.items():
            self.metadata.setdefault(key, value)

    # ------------------------------------------------------------ update
    def _batch(
        self,
        hidden: Sequence[torch.Tensor] | torch.Tensor,
        token_ids: torch.Tensor,
        keep: torch.Tensor | None,
        positions: torch.Tensor | None,
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One batch's hidden states as a list (one (B, T, d) tensor per layer, in
        ``self.layers`` order) and its keep mask (all True when None), after checking shapes:
        ``hidden`` a list or an (L, B, T, d) tensor; ``token_ids``, ``keep`` and ``positions``
        (B, T)."""
        if isinstance(hidden, torch.Tensor) and hidden.dim() == 4:
            hidden = list(hidden.unbind(0))
        hidden = list(hidden)
        if len(hidden) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} hidden-state tensors, got {len(hidden)}")
        if token_ids.dim() != 2:
            raise ValueError(f"token_ids must be (B, T), got shape {tuple(token_ids.shape)}")
        shape = tuple(token_ids.shape)
        if keep is None:
            keep = torch.ones(shape, dtype=torch.bool, device=token_ids.device)
        if tuple(keep.shape) != shape:
            raise ValueError(f"keep mask shape {tuple(keep.shape)} != token_ids shape {shape}")
        if positions is not None and tuple(positions.shape) != shape:
            raise ValueError(f"positions shape {tuple(positions.shape)} != {shape}")
        for li, h in enumerate(hidden):
            if tuple(h.shape) != (*shape, self.dim):
                raise ValueError(
                    f"hidden state {li} has shape {tuple(h.shape)}, expected {(*shape, self.dim)}"
                )
        return hidden, keep

    @staticmethod
    def _finite_flags(hidden: Sequence[torch.Tensor], finite: Sequence[bool] | None) -> list[bool]:
        """Per layer, whether its hidden states are all finite: ``finite`` when the caller has
        them (the extractor computes :func:`finite_layers` once for the statistics and the
        sample of a batch), else :func:`finite_layers`."""
        if finite is None:
            return finite_layers(hidden)
        if len(finite) != len(hidden):
            raise ValueError(f"{len(finite)} finite flags for {len(hidden)} hidden states")
        return [bool(f) for f in finite]
