"""What a run counted: one type for a shard, a checkpoint group, a run's manifest and a merge.

:class:`Counts` is what an extractor adds up while it reads a shard
(:mod:`embgeom_ray.inputs.extractor`), what a checkpoint group stores beside its statistics
(:mod:`embgeom_ray.runs.checkpoints`), what the driver sums over the groups, and, as
``manifest.json``'s ``counts``, what a run reports and what a merge of runs adds up
(:mod:`embgeom_ray.runs.merge`). The same fields serve all of them; the JSON of a checkpoint
group or an actor's reply (:meth:`Counts.to_json`) holds every field, the manifest's
``counts`` only the counters (the fields marked ``exclude`` are held elsewhere in the manifest:
``skipped``, ``dedup``, ``timings_s``) and the two ratios derived from them.

Torch-free: the job's driver, the merge and the checkpoints import it without the model stack.
"""

from __future__ import annotations

from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_serializer, model_validator

#: :func:`unk_warning` speaks up when more than this share of the text's tokens is [UNK].
UNK_WARN_SHARE = 0.01
#: the ratios derived from the counters: written in the manifest, never read back
DERIVED = ("padding_ratio", "unk_share")


class Counts(BaseModel):
    """Counters of documents, windows and positions; added up over shards, groups and runs.

    Positions, per batch that ran (``B × T`` for ``B`` windows, the longest ``T`` tokens):

    * ``padded_tokens``: all positions the model ran, ``Σ B × T`` (padding included);
    * ``positions``: the real ones, ``Σ`` window lengths (special tokens included);
    * ``tokens``: the counted ones (not special, unless ``--keep-special``);
    * ``special_tokens``: real positions holding a special token id ([CLS], [SEP], [UNK], …),
      whether or not ``--keep-special`` counts them, so ``positions = tokens + special_tokens``
      without it and ``positions = tokens`` with it;
    * ``unk_tokens``: real positions holding the tokenizer's unknown token ([UNK], <unk>),
      a subset of ``special_tokens``.

    Every field but ``nonfinite_tokens_per_layer`` (set once, from the run's statistics) is a
    sum: :meth:`add` adds every field, so a new counter is one line here. Counts saved before
    ``positions`` existed load with 0 there; :attr:`padding_ratio` and :attr:`unk_share` are
    then ``None``. ``oom_batch_splits`` reads the name checkpoint groups wrote before this type
    was shared (``oom_splits``); keys this version does not know are kept as they are.
    """

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    documents: int = 0
    windows: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    positions: int = 0
    special_tokens: int = 0
    unk_tokens: int = 0
    batches: int = 0
    #: documents read that gave the model no token to count, so no window: their text
    #: tokenizes to nothing (only characters the tokenizer drops, such as U+200B for BERT's
    #: WordPiece) or, without ``--keep-special``, to special tokens alone (a line of emoji:
    #: [UNK]s); in ``documents``, in no other counter
    documents_without_tokens: int = 0
    #: batches split in two after the device ran out of memory
    oom_batch_splits: int = Field(
        0, validation_alias=AliasChoices("oom_batch_splits", "oom_splits")
    )
    #: documents left out as duplicates of an earlier one (``--dedup``; not in ``documents``;
    #: the manifest's ``dedup`` says it for the run)
    duplicates: int = Field(0, exclude=True)
    #: items skipped, by reason (the manifest's top-level ``skipped``)
    skipped: dict[str, int] = Field(default_factory=dict, exclude=True)
    #: seconds the model's forward passes, the folds and the whole shard took, summed over the
    #: extractors and their CPU lanes (the manifest's ``timings_s.extract_forward_sum`` /
    #: ``extract_fold_sum``; lanes run their forwards at once)
    forward_seconds: float = Field(0.0, exclude=True)
    fold_seconds: float = Field(0.0, exclude=True)
    seconds: float = Field(0.0, exclude=True)
    #: tokens whose hidden state was not finite, by layer (a run's, from its statistics)
    nonfinite_tokens_per_layer: dict[str, int] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _drop_derived(cls, data: Any) -> Any:
        """The ratios a manifest holds are recomputed from the counters, not read back."""
        if isinstance(data, dict) and any(k in data for k in DERIVED):
            return {k: v for k, v in data.items() if k not in DERIVED}
        return data

    @model_serializer(mode="wrap")
    def _with_derived(self, handler: Any) -> dict[str, Any]:
        """The manifest's form: the counters, then the derived ratios (6 decimals)."""
        out = handler(self)
        tail = {k: out.pop(k) for k in ("nonfinite_tokens_per_layer",) if k in out}
        for name in DERIVED:
            value = getattr(self, name)
            out[name] = None if value is None else round(value, 6)
        return out | tail

    # ------------------------------------------------------------------ adding up
    def add(self, other: Counts) -> None:
        """Add ``other``'s every field to this one's (dicts key by key)."""
        for name in type(self).model_fields:
            mine, theirs = getattr(self, name), getattr(other, name)
            if isinstance(mine, dict):
                for key, value in theirs.items():
                    mine[key] = mine.get(key, 0) + value
            else:
                setattr(self, name, mine + theirs)

    @classmethod
    def total(cls, parts: Any) -> Counts:
        """The sum of ``parts`` (an iterable of :class:`Counts`)."""
        out = cls()
        for part in parts:
            out.add(part)
        return out

    # ------------------------------------------------------------------ derived
    @property
    def padding_ratio(self) -> float | None:
        """Positions the model ran per real position: ``padded_tokens / positions`` (≥ 1).

        Without ``--keep-special`` this is ``padded_tokens / (tokens + special_tokens)``.
        ``None`` before any batch ran.
        """
        return self.padded_tokens / self.positions if self.positions else None

    @property
    def text_tokens(self) -> int:
        """Positions that stand for text: non-special ones plus [UNK] (which replaces text)."""
        return self.positions - self.special_tokens + self.unk_tokens

    @property
    def unk_share(self) -> float | None:
        """Share of the text's tokens that are the unknown token: ``unk_tokens / text_tokens``."""
        return self.unk_tokens / self.text_tokens if self.text_tokens > 0 else None

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        """Every field (the ``exclude`` ones too): a checkpoint group's or an actor's counts."""
        return {k: dict(v) if isinstance(v, dict) else v for k, v in self}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Counts:
        """Read :meth:`to_json`'s dict, or a manifest's ``counts``, of any version."""
        return cls.model_validate(data)


def unk_warning(
    counts: Counts, unk_token: str | None = "[UNK]", threshold: float = UNK_WARN_SHARE
) -> str | None:
    """A one-line warning when the unknown token's share of the text exceeds ``threshold``.

    A high share means the tokenizer does not cover the corpus (another script or language,
    binary or mangled text, or a tokenizer that is not the model's): every such token is the
    same id with one embedding, and without ``--keep-special`` it is not counted at all.
    Returns ``None`` when the share is within the threshold or unknown.
    """
    share = counts.unk_share
    if share is None or share <= threshold:
        return None
    name = unk_token or "unknown"
    return (
        f"warning: {share:.1%} of the corpus's text tokens are the tokenizer's {name} token "
        f"({counts.unk_tokens:,} of {counts.text_tokens:,}): the tokenizer does not cover "
        f"this text (another script or language, mangled text, or a tokenizer that is not the "
        f"model's); {name} tokens are special and are not counted unless --keep-special"
    )


#: skipped items that are not text a user would miss: blank lines and empty or whitespace-only
#: texts hold no token, so :func:`skipped_warning` keeps quiet about them
QUIET_SKIPS = ("empty",)


def skipped_warning(counts: Counts) -> str | None:
    """A one-line warning when items of the corpus that may hold text were skipped.

    The reasons (:class:`~embgeom_ray.inputs.corpus.ReadReport`: ``invalid UTF-8``, ``invalid
    JSON``, ``not a JSON object``, ``missing column``, ``non-text value``) mean lines or rows
    the job could not read as documents: a file in another encoding, JSON that is not one
    object per line, a text column that holds other values. They are counted in the manifest's
    ``skipped``; this says so at the end of the run. ``None`` when only empty items (blank
    lines, empty texts: :data:`QUIET_SKIPS`) or none were skipped.
    """
    loud = {k: v for k, v in sorted(counts.skipped.items()) if k not in QUIET_SKIPS and v}
    if not loud:
        return None
    total = sum(loud.values())
    why = ", ".join(f"{v:,} {k}" for k, v in loud.items())
    return (
        f"warning: {total:,} item(s) of the corpus could not be read as documents and were left "
        f"out ({why}; {counts.documents:,} documents read); manifest.json's skipped counts them"
    )
