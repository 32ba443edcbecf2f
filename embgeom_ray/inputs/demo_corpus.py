"""The ``make demo`` corpus: the prose of the Python Language Reference, from CPython itself.

Why this corpus:

* It ships with CPython on every operating system (``pydoc_data.topics``, the text behind
  ``help("while")``), so the demo needs no download, no network and no data licence check.
* It is real English prose written by people (the Language Reference's topics, about 465 KB),
  not generated or templated text, so token statistics look like those of natural text.
* Its topics vary in length: one document per topic gives documents far longer than 128
  tokens, which exercises the splitting of long documents into windows.

Each topic is turned into prose: split into blocks on blank lines; titles and their underlines,
markup-only lines (tables, rules), code examples, grammar productions and interactive sessions
are dropped; list markers and inline markup (``*emphasis*``, ``**strong**``) are removed;
wrapped lines are joined; blocks with fewer than :data:`MIN_WORDS` words are dropped. A topic's
paragraphs are joined with a space. The output is deterministic for a given Python version.

Usage: ``python -m embgeom_ray.inputs.demo_corpus OUT.jsonl`` writes one JSON object per line,
``{"text": ..., "topic": ...}``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

#: Paragraphs with fewer words than this are dropped (headings, labels, stray fragments).
MIN_WORDS = 8

_MARKUP_ONLY = re.compile(r"^[\s*=\-+|~^#_`.:'\"]*$")
_TABLE_LINE = re.compile(r"^\s*(\+[-=+]+\+?|\|.*\||={3,}(\s+={3,})*)\s*$")
_BULLET = re.compile(r"^(\s*)(?:[*\-•]|\d+\.|\(\d+\)|[a-z]\.)\s+")
_STRONG_EMPH = re.compile(r"(?<![\w*\"'])\*{1,2}(\w[^*\n]*?)\*{1,2}(?![\w*])")
_SENTENCE_END = re.compile(r"[.!?:][\"')\]]*$")
_WORD = re.compile(r"^[(\"'“‘]*[A-Za-z][A-Za-z'’-]*[.,;:!?)\"'”’]*$")
_CODE_HINTS = (">>>", "::=", "...:", "$ ", "#!")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _is_code(lines: list[str]) -> bool:
    """Whether a block looks like code, grammar, a table or an interactive session."""
    for line in lines:
        stripped = line.strip()
        if stripped.startswith(_CODE_HINTS) or "::=" in stripped:
            return True
        if _TABLE_LINE.match(line):
            return True
    # Code keeps its own indentation structure: a deeper line after a line ending in ":".
    for a, b in itertools.pairwise(lines):
        if a.rstrip().endswith(":") and _indent(b) > _indent(a) and not _BULLET.match(a):
            return True
    return False


def _prose(lines: list[str]) -> str | None:
    """The block as one line of prose, or None if it is not prose."""
    lines = [ln for ln in lines if not _MARKUP_ONLY.match(ln)]
    if not lines or _is_code(lines):
        return None
    # A definition-list term ("  **PEP 3129** - Class Decorators" over an indented body):
    # keep the body only.
    if len(lines) > 1 and _indent(lines[1]) > _indent(lines[0]) and not _BULLET.match(lines[0]):
        lines = lines[1:]
    first = _BULLET.sub(r"\1", lines[0], count=1)
    text = " ".join(ln.strip() for ln in [first, *lines[1:]])
    text = _STRONG_EMPH.sub(r"\1", text)
    text = re.sub(r"\s+", " ", text).strip()
    words = text.split()
    if len(words) < MIN_WORDS or not _SENTENCE_END.search(text):
        return None
    # Mostly words: identifiers, operators and literals are welcome inside prose, not instead.
    if sum(1 for w in words if _WORD.match(w)) < 0.6 * len(words):
        return None
    return text


def _blocks(topic_text: str) -> list[list[str]]:
    """Blank-line separated blocks, with titles (a line over an underline) removed."""
    lines = topic_text.splitlines()
    keep: list[str] = []
    for i, line in enumerate(lines):
        next_line = lines[i + 1] if i + 1 < len(lines) else ""
        is_title = (
            bool(line.strip())
            and bool(next_line.strip())
            and bool(re.fullmatch(r"\s*([*=\-~^])\1{2,}\s*", next_line))
        )
        keep.append("" if is_title else line)
    blocks: list[list[str]] = []
    current: list[str] = []
    for line in keep:
        if line.strip():
            current.append(line.rstrip())
        elif current:
            blocks.append(current)
            current = []
    if current:
        blocks.append(current)
    return blocks


def topic_paragraphs(topic_text: str) -> list[str]:
    """The prose paragraphs of one ``pydoc_data`` topic, in order."""
    return [p for p in (_prose(b) for b in _blocks(topic_text)) if p is not None]


def python_docs_topics() -> list[tuple[str, str]]:
    """``(topic, document)`` pairs, sorted by topic; topics without prose are left out."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        paragraphs = topic_paragraphs(topics[name])
        if paragraphs:
            out.append((name, " ".join(paragraphs)))
    return out


def python_docs_documents() -> list[str]:
    """One document per Language Reference topic: its prose paragraphs joined by a space."""
    return [text for _, text in python_docs_topics()]


def write_jsonl(path: str | os.PathLike[str]) -> tuple[int, int]:
    """Write the corpus to ``path`` atomically; return (documents, words)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    docs = python_docs_topics()
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")  # same folder: atomic rename
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            for topic, text in docs:
                f.write(json.dumps({"text": text, "topic": topic}, ensure_ascii=False) + "\n")
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(docs), sum(len(text.split()) for _, text in docs)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m embgeom_ray.inputs.demo_corpus OUT.jsonl``: write the demo corpus, print a summary."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print("usage: python -m embgeom_ray.inputs.demo_corpus OUT.jsonl", file=sys.stderr)
        return 0 if args[:1] in (["-h"], ["--help"]) else 2
    documents, words = write_jsonl(args[0])
    print(f"{args[0]}: {documents} documents, {words} words")
    return 0


if __name__ == "__main__":
    sys.exit(main())
