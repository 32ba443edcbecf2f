"""The one counts type: adding up, the JSON of checkpoints and manifests, old key names."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from embgeom_ray.counts import Counts, skipped_warning, unk_warning
from embgeom_ray.run_dir import Manifest

#: the ``counts`` of a manifest as the previous version wrote it (its ``run_dir.Counts``)
OLD_MANIFEST_COUNTS = {
    "documents": 3, "windows": 4, "tokens": 50, "padded_tokens": 66, "positions": 60,
    "special_tokens": 10, "unk_tokens": 2, "batches": 2, "oom_batch_splits": 1,
    "padding_ratio": 1.1, "unk_share": 0.038462, "nonfinite_tokens_per_layer": {"0": 0, "2": 1},
}  # fmt: skip
#: a checkpoint group's ``counts`` as the previous version wrote it (its ``ShardCounts``)
OLD_GROUP_COUNTS = {
    "documents": 3, "windows": 4, "tokens": 50, "padded_tokens": 66, "positions": 60,
    "special_tokens": 10, "unk_tokens": 2, "batches": 2, "oom_splits": 1, "duplicates": 5,
    "skipped": {"empty": 2}, "forward_seconds": 0.5, "fold_seconds": 0.25, "seconds": 1.0,
}  # fmt: skip


def test_add_sums_every_field_and_the_ratios_follow():
    a = Counts(tokens=10, padded_tokens=14, positions=13, special_tokens=3, unk_tokens=1,
               oom_batch_splits=1, skipped={"empty": 1}, forward_seconds=0.5)  # fmt: skip
    b = Counts(tokens=5, padded_tokens=8, positions=7, special_tokens=2, unk_tokens=0,
               oom_batch_splits=2, skipped={"empty": 2, "binary": 1}, forward_seconds=0.25)  # fmt: skip
    a.add(b)
    names = ("tokens", "padded_tokens", "positions", "special_tokens", "unk_tokens")
    assert [getattr(a, n) for n in names] == [15, 22, 20, 5, 1]
    assert a.oom_batch_splits == 3 and a.forward_seconds == 0.75
    assert a.skipped == {"empty": 3, "binary": 1} and b.skipped == {"empty": 2, "binary": 1}
    assert a.padding_ratio == 22 / 20
    assert a.text_tokens == 20 - 5 + 1
    assert a.unk_share == 1 / 16
    assert Counts.total([a, b, Counts()]).tokens == 20
    assert Counts.from_json(a.to_json()) == a


def test_counts_of_nothing_have_no_ratios():
    old = Counts.from_json({"tokens": 5, "padded_tokens": 9, "windows": 1})
    assert old.padding_ratio is None and old.unk_share is None and unk_warning(old) is None


def test_skipped_items_that_may_hold_text_are_warned_about_blank_ones_are_not():
    assert skipped_warning(Counts(documents=3)) is None
    assert skipped_warning(Counts(documents=3, skipped={"empty": 7})) is None
    counts = Counts(
        documents=1_200,
        skipped={"non-text value": 2, "empty": 5, "invalid UTF-8": 1, "invalid JSON": 1_000},
    )
    assert skipped_warning(counts) == (
        "warning: 1,003 item(s) of the corpus could not be read as documents and were left out "
        "(1,000 invalid JSON, 1 invalid UTF-8, 2 non-text value; 1,200 documents read); "
        "manifest.json's skipped counts them"
    )


def test_a_checkpoint_group_of_the_previous_version_loads_every_field():
    c = Counts.from_json(OLD_GROUP_COUNTS)
    assert c.oom_batch_splits == 1 and "oom_splits" not in c.to_json()
    assert (c.duplicates, c.skipped, c.seconds) == (5, {"empty": 2}, 1.0)
    expected = {k: v for k, v in OLD_GROUP_COUNTS.items() if k != "oom_splits"}
    new = {"oom_batch_splits": 1, "nonfinite_tokens_per_layer": {}, "documents_without_tokens": 0}
    assert c.to_json() == expected | new  # a counter it did not have: 0


def test_a_manifest_of_the_previous_version_reads_and_writes_the_same_counts():
    manifest = Manifest.model_validate({"status": "complete", "counts": OLD_MANIFEST_COUNTS})
    c = manifest.counts
    assert c is not None and c.oom_batch_splits == 1 and c.tokens == 50
    assert c.padding_ratio == 66 / 60 and c.unk_share == pytest.approx(2 / 52)
    written = manifest.to_json()["counts"]
    assert written == OLD_MANIFEST_COUNTS
    assert list(written) == list(OLD_MANIFEST_COUNTS)  # same keys, same order


def test_the_manifest_holds_the_counters_not_the_shards_timings():
    c = Counts.from_json(OLD_GROUP_COUNTS | {"nonfinite_tokens_per_layer": {"0": 0}})
    written = Manifest(counts=c).to_json()["counts"]
    assert set(written) == set(OLD_MANIFEST_COUNTS)
    assert written["padding_ratio"] == round(66 / 60, 6) and written["unk_share"] == round(2 / 52, 6)
    assert json.loads(json.dumps(written)) == written


def test_unknown_keys_of_a_newer_writer_are_kept():
    c = Counts.from_json({"tokens": 3, "newer_counter": 7})
    assert c.to_json()["newer_counter"] == 7
    assert Manifest(counts=c).to_json()["counts"]["newer_counter"] == 7


def test_the_finishing_steps_and_checkpoints_do_not_import_the_extractor():
    """Nor the report: the job's own process imports matplotlib and the figure modules only to
    draw one (~0.3-0.5 s of its start before the plan, where a run with --no-report never
    needs them)."""
    code = (
        "import sys; import embgeom_ray.counts; assert 'torch' not in sys.modules; "
        "import embgeom_ray.runs.finish, embgeom_ray.runs.merge, embgeom_ray.runs.checkpoints; "
        "assert 'embgeom_ray.inputs.extractor' not in sys.modules, 'extractor imported'; "
        "import embgeom_ray.runs.pipeline; "
        "drawing = sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib' "
        "or m.startswith(('embgeom_ray.report.plots', 'embgeom_ray.report.html'))); "
        "assert not drawing, drawing[:5]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
