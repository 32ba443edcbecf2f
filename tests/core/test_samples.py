"""ActivationSample: exact, order-free mergeability, boundedness and lossless persistence."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import embgeom_ray.core.samples as samples_mod
from embgeom_ray.core.samples import (
    SAMPLE_COLUMNS,
    ActivationSample,
    occurrence_keys,
    splitmix64,
    type_keys,
)
from embgeom_ray.errors import StatisticsMismatchError

U64 = 1 << 64
MASK63 = (1 << 63) - 1


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny tensors: intra-op threads only contend on a shared CI box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def ref_splitmix(x: int) -> int:
    """SplitMix64 on Python ints (the uint64 reference)."""
    z = (x + 0x9E3779B97F4A7C15) % U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % U64
    return z ^ (z >> 31)


def ref_occurrence_key(seed: int, doc: int, win: int, pos: int) -> int:
    h = ref_splitmix((seed % U64) ^ (samples_mod._DOMAIN_OCCURRENCE % U64))
    for v in (doc, win, pos):
        h = ref_splitmix(h ^ v)
    return h & MASK63


def ref_type_key(seed: int, tok: int) -> int:
    h = ref_splitmix((seed % U64) ^ (samples_mod._DOMAIN_TYPE % U64))
    return ref_splitmix(h ^ tok) & MASK63


def ref_content_key(ids, p: int, rule: str = "window") -> int:
    """The content key of position p of a window of token ids, on Python ints."""
    d = ref_splitmix(samples_mod._DOMAIN_CONTENT % U64)
    mix = [ref_splitmix(ref_splitmix(d ^ i) ^ int(t)) for i, t in enumerate(ids)]
    acc = sum(mix[: p + 1] if rule == "prefix" else mix) % U64
    return ref_splitmix(ref_splitmix(acc) ^ p) & MASK63


def test_splitmix64_and_keys_equal_the_uint64_reference():
    rng = np.random.default_rng(0)
    vals = [0, 1, 2**63 - 1, -1, -(2**63), 2**62, *rng.integers(-(2**63), 2**63 - 1, 50).tolist()]
    out = splitmix64(torch.tensor(vals, dtype=torch.int64)).tolist()
    assert [o % U64 for o in out] == [ref_splitmix(v % U64) for v in vals]
    docs = rng.integers(0, 2**40, 30)
    wins = rng.integers(0, 1000, 30)
    pos = rng.integers(0, 512, 30)
    for seed in (0, 7, 2**70 + 3, -5):
        keys = occurrence_keys(seed, *(torch.from_numpy(a) for a in (docs, wins, pos))).tolist()
        expected = [
            ref_occurrence_key(seed, int(d), int(w), int(p))
            for d, w, p in zip(docs, wins, pos, strict=True)
        ]
        assert keys == expected
        assert all(0 <= k <= MASK63 for k in keys)
        tk = type_keys(seed, torch.from_numpy(pos)).tolist()
        assert tk == [ref_type_key(seed, int(p)) for p in pos]


# ------------------------------------------------------------ a toy corpus
D = 3
LAYERS = [0, 2, 5]


def make_windows(rng: np.random.Generator, n_windows: int, vocab: int, nan_rate: float = 0.0):
    """Windows: (doc, window index, ids, keep, vectors (L, len, d)); vectors fixed per occurrence."""
    wins = []
    doc, k = 0, 0
    for _ in range(n_windows):
        if rng.random() < 0.5:
            doc, k = doc + 1 + int(rng.integers(0, 3)), 0
        else:
            k += 1
        n = int(rng.integers(1, 7))
        ids = rng.integers(0, vocab, n)
        keep = rng.random(n) > 0.2
        vec = rng.normal(size=(len(LAYERS), n, D))
        if nan_rate:
            bad = rng.random(n) < nan_rate
            vec[rng.integers(0, len(LAYERS)), bad, rng.integers(0, D)] = np.nan
        wins.append((doc, k, ids, keep, vec))
    return wins


def make_batch(wins, extra_pad: int = 0):
    """Right-padded batch of ``wins``; padding holds NaN vectors, id 999, keep=False and
    attention mask 0."""
    width = max(len(w[2]) for w in wins) + extra_pad
    b = len(wins)
    ids = torch.full((b, width), 999, dtype=torch.long)
    keep = torch.zeros(b, width, dtype=torch.bool)
    mask = torch.zeros(b, width, dtype=torch.long)
    hidden = torch.full((len(LAYERS), b, width, D), float("nan"), dtype=torch.float64)
    for r, (_, _, wid, wkeep, vec) in enumerate(wins):
        n = len(wid)
        ids[r, :n] = torch.from_numpy(wid)
        keep[r, :n] = torch.from_numpy(wkeep)
        mask[r, :n] = 1
        hidden[:, r, :n] = torch.from_numpy(vec)
    docs = torch.tensor([w[0] for w in wins], dtype=torch.int64)
    widx = torch.tensor([w[1] for w in wins], dtype=torch.int64)
    return hidden, ids, keep, docs, widx, mask


def fold(sample: ActivationSample, wins, extra_pad: int = 0) -> ActivationSample:
    if wins:
        hidden, ids, keep, docs, widx, mask = make_batch(wins, extra_pad)
        sample.update(list(hidden), ids, keep, docs, widx, attention_mask=mask)
    return sample


def new_sample(size=6, type_size=4, seed=3, **kw) -> ActivationSample:
    return ActivationSample(LAYERS, D, size, seed, type_size=type_size, **kw)


def brute_force(wins, size: int, type_size: int, seed: int):
    """Reference selection: sorted tuples of the uniform and type-uniform samples."""
    occ = []
    for doc, k, ids, keep, vec in wins:
        for p in range(len(ids)):
            if keep[p] and np.isfinite(vec[:, p]).all():
                key = ref_occurrence_key(seed, doc, k, p)
                occ.append((key, doc, k, p, int(ids[p]), ref_content_key(ids, p)))
    occ = sorted(set(occ))
    uniform = occ[:size]
    best: dict[int, tuple] = {}
    for o in occ:
        best.setdefault(o[4], o)  # occ is sorted: the first is the smallest
    types = sorted(best, key=lambda t: (ref_type_key(seed, t), t))[:type_size]
    return uniform, sorted(best[t] for t in types)


def as_tuples(points) -> list[tuple]:
    return sorted(
        zip(
            points.keys.tolist(),
            points.doc_ids.tolist(),
            points.window_index.tolist(),
            points.positions.tolist(),
            points.token_ids.tolist(),
            points.content_keys.tolist(),
            strict=True,
        )
    )


@settings(max_examples=30, deadline=None)
@given(
    data_seed=st.integers(0, 2**32 - 1),
    n_windows=st.integers(1, 14),
    size=st.integers(1, 9),
    type_size=st.integers(1, 6),
    vocab=st.integers(1, 12),
    seed=st.integers(0, 2**64 - 1),
)
def test_sample_is_independent_of_batching_sharding_and_merge_order(
    data_seed, n_windows, size, type_size, vocab, seed
):
    rng = np.random.default_rng(data_seed)
    wins = make_windows(rng, n_windows, vocab, nan_rate=0.1)

    def fresh():
        return new_sample(size, type_size, seed)

    one = fold(fresh(), wins)
    ref_u, ref_t = brute_force(wins, size, type_size, seed)

    # random batching (shuffled, random batch sizes and padding), random shards, merge trees
    order = rng.permutation(len(wins))
    n_shards = int(rng.integers(1, 5))
    shard_of = rng.integers(0, n_shards, len(wins))
    shards = []
    for s in range(n_shards):
        sample = fresh()
        mine = [wins[i] for i in order if shard_of[i] == s]
        start = 0
        while start < len(mine):
            stop = start + int(rng.integers(1, 4))
            fold(sample, mine[start:stop], extra_pad=int(rng.integers(0, 3)))
            start = stop
        shards.append(sample)
    while len(shards) > 1:
        i, j = rng.choice(len(shards), 2, replace=False)
        shards[i].merge(shards[j])
        shards.pop(j)
    merged = shards[0]

    assert merged.to_bytes() == one.to_bytes()
    assert as_tuples(one.points(LAYERS[0])) == ref_u
    assert as_tuples(one.type_points(LAYERS[0])) == ref_t
    assert one.num_uniform <= size and one.num_types <= type_size
    # merging a sample into itself (an occurrence seen twice) changes nothing
    again = ActivationSample.from_bytes(one.to_bytes())
    assert again.merge(one).to_bytes() == one.to_bytes()


def test_same_occurrences_and_their_vectors_in_every_layer():
    rng = np.random.default_rng(1)
    wins = make_windows(rng, 20, vocab=8, nan_rate=0.15)
    sample = fold(new_sample(size=12, type_size=5), wins)
    where = {(w[0], w[1], p): w[4][:, p] for w in wins for p in range(len(w[2]))}
    for getter in (sample.points, sample.type_points):
        first = getter(LAYERS[0])
        assert len(first.keys) > 0
        for li, layer in enumerate(LAYERS):
            pts = getter(layer)
            for name in ("keys", "token_ids", "doc_ids", "window_index", "positions"):
                np.testing.assert_array_equal(getattr(pts, name), getattr(first, name))
            assert pts.vectors.dtype == np.float64
            for r in range(len(pts.keys)):
                vec = where[(pts.doc_ids[r], pts.window_index[r], pts.positions[r])]
                assert np.isfinite(vec).all()  # non-finite occurrences are never sampled
                np.testing.assert_array_equal(pts.vectors[r], vec[li].astype(np.float32))
    # uniform rows are in key order; type rows in token order, one per type
    assert np.all(np.diff(sample.points(0).keys) >= 0)
    tp = sample.type_points(0)
    assert np.all(np.diff(tp.token_ids) > 0)


def test_size_is_bounded_whatever_the_corpus_size():
    rng = np.random.default_rng(2)
    sample = new_sample(size=50, type_size=20)
    for _ in range(60):
        fold(sample, make_windows(rng, 8, vocab=500))
        assert sample.num_uniform <= 50 and sample.num_types <= 20
        assert sample._u.vec.shape[1] <= 50 and sample._t.vec.shape[1] <= 20
    assert sample.num_uniform == 50 and sample.num_types == 20
    assert len(sample.to_bytes()) < 50_000


def test_uniform_sample_is_roughly_uniform_over_occurrences():
    # every (doc, position) equally likely: the mean sampled position over 40 seeds ~ (T-1)/2
    t = 16
    wins = [
        (d, 0, np.arange(t), np.ones(t, bool), np.zeros((len(LAYERS), t, D))) for d in range(200)
    ]
    positions = []
    for seed in range(40):
        positions.append(fold(new_sample(size=32, seed=seed), wins).points(0).positions)
    pos = np.concatenate(positions)
    assert abs(pos.mean() - (t - 1) / 2) < 0.5
    assert len(np.unique(pos)) == t


def test_bf16_vectors_are_stored_exactly_and_keep_is_not_modified():
    rng = np.random.default_rng(3)
    hidden = torch.from_numpy(rng.normal(size=(len(LAYERS), 2, 5, D))).to(torch.bfloat16)
    ids = torch.from_numpy(rng.integers(0, 4, (2, 5)))
    keep = torch.ones(2, 5, dtype=torch.bool)
    hidden[1, 0, 2, 1] = float("inf")
    before = keep.clone()
    sample = ActivationSample(LAYERS, D, 100, 0, type_size=100)
    sample.update(hidden, ids, keep, torch.tensor([4, 9]), torch.tensor([0, 2]))
    assert torch.equal(keep, before)
    pts = sample.points(LAYERS[1])
    assert len(pts.keys) == 9  # the occurrence with inf in layer 2 is skipped in all layers
    for r in range(len(pts.keys)):
        row = 0 if pts.doc_ids[r] == 4 else 1
        expect = hidden[1, row, pts.positions[r]].float().numpy()
        np.testing.assert_array_equal(pts.vectors[r], expect)


def test_round_trip_is_exact_and_table_has_contract_columns(tmp_path):
    rng = np.random.default_rng(4)
    wins = make_windows(rng, 15, vocab=7, nan_rate=0.05)
    meta = {"model_fingerprint": "m1", "tokenizer_fingerprint": "t1"}
    sample = fold(new_sample(size=10, type_size=4, metadata=meta), wins)
    data = sample.to_bytes()
    back = ActivationSample.from_bytes(data)
    assert back.to_bytes() == data
    assert back.header() == sample.header()
    for layer in LAYERS:
        for a, b in zip(back.points(layer), sample.points(layer), strict=True):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(back.type_points(layer), sample.type_points(layer), strict=True):
            np.testing.assert_array_equal(a, b)
    path = tmp_path / "samples.safetensors"
    sample.save(path)
    assert ActivationSample.load(path).to_bytes() == data
    # keeps folding after a reload exactly as the original would
    more = make_windows(np.random.default_rng(5), 6, vocab=7)
    assert fold(back, more).to_bytes() == fold(sample, more).to_bytes()

    table = sample.to_table(lambda ids: [f"tok{i}" for i in ids])
    assert list(table.columns) == SAMPLE_COLUMNS
    n_u, n_t = sample.num_uniform, sample.num_types
    assert len(table) == len(LAYERS) * (n_u + n_t)
    assert set(table["sample"]) == {"uniform", "type_uniform"}
    assert (table["token"] == "tok" + table["token_id"].astype(str)).all()
    table.to_parquet(tmp_path / "samples.parquet")
    read = pd.read_parquet(tmp_path / "samples.parquet")
    got = read[(read["layer"] == 2) & (read["sample"] == "uniform")]
    vec = np.stack(got["vector"].to_numpy())
    assert vec.dtype == np.float32
    np.testing.assert_array_equal(vec, sample.points(2).vectors.astype(np.float32))
    np.testing.assert_array_equal(got["key"].to_numpy(), sample.points(2).keys)


def test_merge_and_load_reject_different_measurements():
    base = new_sample(metadata={"model_fingerprint": "a"})
    for other in (
        new_sample(seed=4, metadata={"model_fingerprint": "a"}),
        new_sample(size=7, metadata={"model_fingerprint": "a"}),
        new_sample(type_size=5, metadata={"model_fingerprint": "a"}),
        new_sample(metadata={"model_fingerprint": "b"}),
        ActivationSample([0, 2], D, 6, 3, type_size=4),
        ActivationSample(LAYERS, D, 6, 3, type_uniform=False, type_size=4),
    ):
        with pytest.raises(StatisticsMismatchError):
            base.merge(other)
    with pytest.raises(StatisticsMismatchError):
        ActivationSample.from_bytes(b"garbage")
    name = samples_mod.FORMAT.encode()
    stats_like = base.to_bytes().replace(name, name[:-1] + b"z")
    with pytest.raises(StatisticsMismatchError):
        ActivationSample.from_bytes(stats_like)


def test_update_validates_shapes():
    sample = new_sample()
    hidden, ids, keep, docs, widx, _ = make_batch(make_windows(np.random.default_rng(6), 3, 5))
    with pytest.raises(ValueError, match="hidden-state"):
        sample.update(list(hidden)[:2], ids, keep, docs, widx)
    with pytest.raises(ValueError, match="doc_ids"):
        sample.update(list(hidden), ids, keep, docs[:1], widx)
    with pytest.raises(ValueError, match="keep"):
        sample.update(list(hidden), ids, keep[:, :1], docs, widx)


def test_finite_vectors_whose_sum_overflows_are_sampled():
    hidden = torch.ones(len(LAYERS), 1, 4, D, dtype=torch.float32)
    hidden[0, 0, 1, :2] = 3e38  # finite, but the row sum overflows float32
    hidden[2, 0, 2, 0] = float("nan")
    hidden[1, 0, 3, 1] = -float("inf")
    sample = ActivationSample(LAYERS, D, 10, 0)
    ids = torch.tensor([[5, 6, 7, 8]])
    sample.update(hidden, ids, None, torch.tensor([0]), torch.tensor([0]))
    assert sorted(sample.points(0).positions.tolist()) == [0, 1]
    assert sorted(sample.type_points(0).token_ids.tolist()) == [5, 6]
    np.testing.assert_array_equal(
        sample.points(0).vectors[sample.points(0).positions == 1][0, :2], np.float32(3e38)
    )


@pytest.mark.parametrize("name", ["samples.safetensors"])
def test_files_written_by_earlier_versions_load(name, tmp_path):
    """Samples written by commit 82b3bd9 (format "embgeom_ray.samples") load, equal today's sample of the same batches entry for
    entry, and are written back under today's name."""
    from pathlib import Path

    from tests import sketch_fixtures

    old = ActivationSample.load(Path(__file__).parents[1] / "data" / "sketch_v1" / name)
    now = sketch_fixtures.fold_sample(ActivationSample)
    assert old.num_uniform == sketch_fixtures.SAMPLE_SIZE
    assert old.num_types == sketch_fixtures.SAMPLE_TYPE_SIZE
    # version 1 had no content keys: they come from the vectors (rule "vectors")
    assert old.header() == now.header() | {"content_rule": "vectors"}
    assert old.header()["format"] == "embgeom_ray.samples"
    for layer in sketch_fixtures.LAYERS:
        a, b = old.points(layer), now.points(layer)
        for field in a._fields:
            if field != "content_keys":
                np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
        vectors = np.stack([old.points(li).vectors for li in sketch_fixtures.LAYERS])
        np.testing.assert_array_equal(a.content_keys, samples_mod.vector_content_keys(vectors))
    # merging samples of different rules falls back to the vectors' keys on both sides
    assert now.merge(old).to_bytes() == old.to_bytes()
    old.save(tmp_path / "again.safetensors")
    assert ActivationSample.load(tmp_path / "again.safetensors").to_bytes() == old.to_bytes()


@pytest.mark.parametrize("type_uniform", [True, False])
def test_the_table_with_its_header_is_the_sample(tmp_path, type_uniform):
    """``samples.parquet`` (the table and the header in its metadata) reads back as the very
    sample written, so a run keeps its sample once; merging from tables is merging samples."""
    from embgeom_ray.core.sketch import HEADER_KEY as SKETCH_HEADER_KEY
    from embgeom_ray.run_dir import HEADER_KEY, RunDir

    rng = np.random.default_rng(7)
    meta = {"model_fingerprint": "m1", "tokenizer_fingerprint": "t1"}
    a = fold(new_sample(size=10, type_size=4, metadata=meta, type_uniform=type_uniform),
             make_windows(rng, 15, vocab=9, nan_rate=0.05))  # fmt: skip
    b = fold(new_sample(size=10, type_size=4, metadata=meta, type_uniform=type_uniform),
             make_windows(rng, 12, vocab=9))  # fmt: skip
    table = a.to_table(lambda ids: [f"tok{i}" for i in ids])
    table["cluster"] = pd.array(rng.integers(0, 3, len(table)), dtype="Int64")  # ignored
    back = ActivationSample.from_table(table, a.header())
    assert back.to_bytes() == a.to_bytes() and back.header() == a.header()
    run = RunDir(str(tmp_path))
    run.write_table("samples", table, a.header())
    assert HEADER_KEY.decode() == SKETCH_HEADER_KEY  # one name for the header, file or table
    assert run.has_sample()
    assert run.load_sample().to_bytes() == a.to_bytes()
    merged = run.load_sample().merge(ActivationSample.from_table(b.to_table(), b.header()))
    assert merged.to_bytes() == ActivationSample.from_bytes(a.to_bytes()).merge(b).to_bytes()
    empty = new_sample(size=10, type_size=4, type_uniform=type_uniform)
    assert ActivationSample.from_table(empty.to_table(), empty.header()).to_bytes() == empty.to_bytes()


def test_a_table_whose_layers_disagree_is_refused():
    sample = fold(new_sample(size=10, type_size=4), make_windows(np.random.default_rng(8), 10, vocab=9))
    table = sample.to_table()
    last = table.index[(table["layer"] == LAYERS[-1]) & (table["sample"] == "uniform")]
    table.loc[last, "key"] = table.loc[last, "key"].to_numpy()[::-1]
    with pytest.raises(StatisticsMismatchError, match="other uniform occurrences"):
        ActivationSample.from_table(table, sample.header())
    with pytest.raises(StatisticsMismatchError, match="not an embgeom_ray samples"):
        ActivationSample.from_table(sample.to_table(), {"format": "something else"})


def test_runs_whose_documents_share_ids_merge_into_the_sample_of_their_union():
    """Two runs over other corpora whose files have the same name relative to their roots
    (``day1/part.jsonl``, ``day2/part.jsonl``) give their documents the same ids: the same
    (doc, window, position) is another input in each, with another content key. The merge
    keeps both (it dropped one of each such pair), as the brute-force sample of the union of
    the two occurrence sets does; a sample merged with itself still keeps each once."""
    rng = np.random.default_rng(11)
    day1 = make_windows(rng, 6, vocab=20)
    # the same doc ids, windows and lengths, other token ids: another corpus, same file names
    day2 = [(doc, k, (ids + 1) % 20, keep, -vec) for doc, k, ids, keep, vec in day1]
    size, type_size, seed = 64, 3, 5  # room for every kept occurrence of both
    a = fold(new_sample(size, type_size, seed), day1)
    b = fold(new_sample(size, type_size, seed), day2)
    kept = sum(int(keep.sum()) for _, _, _, keep, _ in day1)
    assert a.num_uniform == b.num_uniform == kept
    merged = ActivationSample.from_bytes(a.to_bytes()).merge(b)
    assert merged.num_uniform == 2 * kept
    occ = []
    for wins in (day1, day2):
        for doc, k, ids, keep, _ in wins:
            for p in np.flatnonzero(keep):
                key = ref_occurrence_key(seed, doc, k, int(p))
                occ.append((key, doc, k, int(p), int(ids[p]), ref_content_key(ids, int(p))))
    assert as_tuples(merged.points(LAYERS[0])) == sorted(occ)
    # the day-2 vectors are there too (the negated ones), not only day 1's at the shared ids
    got = merged.points(LAYERS[1]).vectors
    want = [w[4][1, p] for w in (*day1, *day2) for p in range(len(w[2])) if w[3][p]]
    np.testing.assert_array_equal(np.sort(got, axis=0), np.sort(np.array(want, np.float32), axis=0))
    # order-free and idempotent still
    assert ActivationSample.from_bytes(b.to_bytes()).merge(a).to_bytes() == merged.to_bytes()
    assert ActivationSample.from_bytes(merged.to_bytes()).merge(b).to_bytes() == merged.to_bytes()
