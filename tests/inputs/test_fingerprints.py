"""The model directory's content hash and its cache (embgeom_ray.inputs.fingerprints)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from embgeom_ray.inputs import fingerprints
from embgeom_ray.inputs.fingerprints import content_fingerprint, directory_fingerprint


def make_model_dir(root: Path) -> Path:
    d = root / "model"
    (d / "sub").mkdir(parents=True)
    (d / "__pycache__").mkdir()
    (d / "config.json").write_bytes(b'{"hidden_size": 8}')
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (d / "sub" / "tokenizer.json").write_bytes(b"{}")
    (d / ".gitattributes").write_bytes(b"ignored")
    (d / "__pycache__" / "x.pyc").write_bytes(b"ignored")
    return d


def by_hand(d: Path) -> str:
    """The definition, written out: sha256 of (relative path, NUL, bytes, NUL) per file in
    sorted order, directories in sorted order, hidden files and __pycache__ left out."""
    h = hashlib.sha256()
    for rel in ("config.json", "model.safetensors", "sub/tokenizer.json"):
        h.update(rel.encode() + b"\0" + (d / rel).read_bytes() + b"\0")
    return "sha256:" + h.hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A private cache, files trusted as soon as they are written (no racy window)."""
    where = tmp_path / "cache"
    monkeypatch.setenv(fingerprints.CACHE_ENV, str(where))
    monkeypatch.setattr(fingerprints, "RACY_SECONDS", 0.0)
    return where


def reads_of(monkeypatch) -> list[str]:
    """The directories whose files :func:`directory_fingerprint` reads from now on."""
    reads: list[str] = []

    def spy(path: str) -> str:
        reads.append(path)
        return content_fingerprint(path)

    monkeypatch.setattr(fingerprints, "content_fingerprint", spy)
    return reads


def test_the_fingerprint_is_the_content_hash(tmp_path, cache):
    d = make_model_dir(tmp_path)
    assert content_fingerprint(str(d)) == by_hand(d)
    assert directory_fingerprint(str(d)) == by_hand(d)  # computed, then cached
    assert directory_fingerprint(str(d)) == by_hand(d)  # from the cache
    (entry,) = (cache / "fingerprints").glob("*.json")
    assert json.loads(entry.read_text())["fingerprint"] == by_hand(d)


def test_an_unchanged_directory_is_not_read_again(tmp_path, cache, monkeypatch):
    d = make_model_dir(tmp_path)
    reads = reads_of(monkeypatch)
    first = directory_fingerprint(str(d))
    assert reads == [str(d)]
    assert directory_fingerprint(str(d)) == first and reads == [str(d)]
    # the same directory through a symbolic link is the same cache entry
    link = tmp_path / "link"
    link.symlink_to(d)
    assert directory_fingerprint(str(link)) == first and reads == [str(d)]


def test_any_change_of_the_files_is_hashed_again(tmp_path, cache, monkeypatch):
    d = make_model_dir(tmp_path)
    weights = d / "model.safetensors"
    before = directory_fingerprint(str(d))
    reads = reads_of(monkeypatch)

    # new bytes of the same size, and the old mtime put back: the ctime still changes
    st = weights.stat()
    time.sleep(0.01)
    weights.write_bytes(bytes(reversed(range(256))) * 64)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size and weights.stat().st_mtime_ns == st.st_mtime_ns
    changed = directory_fingerprint(str(d))
    assert changed == by_hand(d) != before and len(reads) == 1

    # the file replaced by another one (a new inode) with the old content
    new = d / "new.tmp"
    new.write_bytes(bytes(range(256)) * 64)
    os.replace(new, weights)
    assert directory_fingerprint(str(d)) == before == by_hand(d) and len(reads) == 2

    # a file added, then removed
    (d / "sub" / "extra.txt").write_bytes(b"x")
    assert directory_fingerprint(str(d)) == by_hand_with_extra(d) and len(reads) == 3
    (d / "sub" / "extra.txt").unlink()
    assert directory_fingerprint(str(d)) == before and len(reads) == 4


def by_hand_with_extra(d: Path) -> str:
    h = hashlib.sha256()
    for rel in ("config.json", "model.safetensors", "sub/extra.txt", "sub/tokenizer.json"):
        h.update(rel.encode() + b"\0" + (d / rel).read_bytes() + b"\0")
    return "sha256:" + h.hexdigest()


def test_files_changed_just_now_are_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(fingerprints.CACHE_ENV, str(tmp_path / "cache"))
    d = make_model_dir(tmp_path)  # written within RACY_SECONDS
    reads = reads_of(monkeypatch)
    assert directory_fingerprint(str(d)) == directory_fingerprint(str(d)) == by_hand(d)
    assert len(reads) == 2 and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("setting", ["off", "unwritable", "corrupt"])
def test_without_a_usable_cache_the_files_are_hashed(tmp_path, monkeypatch, setting):
    monkeypatch.setattr(fingerprints, "RACY_SECONDS", 0.0)
    d = make_model_dir(tmp_path)
    if setting == "off":
        monkeypatch.setenv(fingerprints.CACHE_ENV, "off")
    elif setting == "unwritable":  # a file where the directory should be
        (tmp_path / "cache").write_text("not a directory")
        monkeypatch.setenv(fingerprints.CACHE_ENV, str(tmp_path / "cache"))
    else:
        monkeypatch.setenv(fingerprints.CACHE_ENV, str(tmp_path / "cache"))
        directory_fingerprint(str(d))
        (entry,) = (tmp_path / "cache" / "fingerprints").glob("*.json")
        entry.write_text('{"stat_key": ')  # cut short
    reads = reads_of(monkeypatch)
    assert directory_fingerprint(str(d)) == by_hand(d)
    assert len(reads) == 1


def test_the_cache_location(tmp_path, monkeypatch):
    monkeypatch.delenv(fingerprints.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert fingerprints.cache_dir() == tmp_path / "xdg" / "embgeom_ray"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/xdg")  # ignored, as the XDG spec says
    assert fingerprints.cache_dir() == Path.home() / ".cache" / "embgeom_ray"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert fingerprints.cache_dir() == Path.home() / ".cache" / "embgeom_ray"
    # no home at all (no HOME, no passwd entry): no cache, rather than a "~" folder in the cwd
    monkeypatch.setattr(fingerprints.os.path, "expanduser", lambda p: p)
    assert fingerprints.cache_dir() is None
    monkeypatch.undo()
    monkeypatch.setenv(fingerprints.CACHE_ENV, str(tmp_path / "mine"))
    assert fingerprints.cache_dir() == tmp_path / "mine"
    for off in ("off", "", "0", "none"):
        monkeypatch.setenv(fingerprints.CACHE_ENV, off)
        assert fingerprints.cache_dir() is None


def test_a_run_of_a_local_model_reuses_the_cached_fingerprint(tmp_path, cache, monkeypatch, minilm_dir):
    """resolve_identity (what every run, resume and re-analysis calls) reads the weights once."""
    import shutil

    from embgeom_ray.inputs.model_loading import resolve_identity

    d = tmp_path / "minilm"
    shutil.copytree(minilm_dir, d)
    reads = reads_of(monkeypatch)
    first, _ = resolve_identity(str(d), None, False)
    again, _ = resolve_identity(str(d), None, False)
    assert reads == [str(d)]
    assert first.model_fingerprint == again.model_fingerprint == content_fingerprint(str(d))
    assert first.revision == first.model_fingerprint
