"""The extractor without Ray: windows, batching, out-of-memory retries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embgeom_ray import sizing
from embgeom_ray.config import build_config
from embgeom_ray.counts import unk_warning
from embgeom_ray.inputs import extractor
from embgeom_ray.inputs.corpus import CorpusSpec, plan_shards
from embgeom_ray.inputs.extractor import ShardProcessor
from embgeom_ray.inputs.lanes import intra_op_threads
from embgeom_ray.inputs.model_loading import resolve_identity
from embgeom_ray.inputs.windows import (
    MAX_PADDING,
    MIN_BATCH_POSITIONS,
    make_batches,
    tokenize_windows,
)
from tests.conftest import write_jsonl
from tests.tiny_models import make_tiny_bert


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> str:
    return make_tiny_bert(str(tmp_path_factory.mktemp("bert")))


def test_windows_partition_content_tokens(tiny_bert):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_bert)
    texts = ["word " * 50, "short text", "another " * 13]
    windows = tokenize_windows(tok, [7, 8, 9], texts, max_length=10)
    for doc, text in zip([7, 8, 9], texts, strict=True):
        mine = [w for w in windows if w.doc_id == doc]
        assert [w.index for w in mine] == list(range(len(mine)))
        content = [i for w in mine for i in w.input_ids[1:-1]]
        assert content == tok(text, add_special_tokens=False)["input_ids"]
        assert all(
            w.input_ids[0] == tok.cls_token_id and w.input_ids[-1] == tok.sep_token_id for w in mine
        )
        assert all(len(w.input_ids) <= 10 for w in mine)
    batches = list(
        make_batches(
            windows, batch_tokens=40, pad_id=0, special_ids=tok.all_special_ids, keep_special=False
        )
    )
    assert all(b.input_ids.numel() <= 40 or b.input_ids.shape[0] == 1 for b in batches)
    assert sum(b.num_tokens for b in batches) == sum(len(w.input_ids) - 2 for w in windows)


def test_out_of_memory_splits_the_batch_and_counts_every_token_once(
    tmp_path, tiny_bert, monkeypatch
):
    corpus = write_jsonl(
        tmp_path / "c.jsonl", [f"sentence number {i} about cats and dogs" for i in range(40)]
    )
    cfg = build_config(
        None,
        {
            "model": tiny_bert,
            "corpus": corpus,
            "out": str(tmp_path / "o"),
            "max_length": 16,
            "batch_tokens": 4096,
        },
    )
    identity, _ = resolve_identity(tiny_bert, None, False)
    proc = ShardProcessor(cfg.extraction, [0, 2], {"model_fingerprint": identity.model_fingerprint})
    shard = plan_shards(CorpusSpec(corpus)).shards[0]
    clean, clean_sample, clean_counts = proc.process(shard)

    real_forward = proc.forward

    def forward_with_small_memory(batch):
        if batch.input_ids.shape[0] > 8:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_forward(batch)

    monkeypatch.setattr(proc, "forward", forward_with_small_memory)
    stats, sample, counts = proc.process(shard)
    assert counts.oom_batch_splits >= 2
    assert counts.tokens == clean_counts.tokens
    for layer in (0, 2):
        a, b = clean.layer(layer), stats.layer(layer)
        np.testing.assert_array_equal(a.counts, b.counts)
        np.testing.assert_allclose(a.means, b.means, rtol=1e-5, atol=1e-6)
    # the sample depends only on which occurrences were seen, not on how batches were cut
    for layer in (0, 2):
        pa, pb = clean_sample.points(layer), sample.points(layer)
        np.testing.assert_array_equal(pa.keys, pb.keys)
        np.testing.assert_allclose(pa.vectors, pb.vectors, rtol=1e-5, atol=1e-6)

    def always_oom(batch):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(proc, "forward", always_oom)
    with pytest.raises(torch.OutOfMemoryError, match="lower --max-length"):
        proc.process(shard)


def processor(tiny_bert: str, corpus: str, out, **options) -> ShardProcessor:
    cfg = build_config(None, {"model": tiny_bert, "corpus": corpus, "out": str(out), **options})
    identity, _ = resolve_identity(tiny_bert, None, False)
    return ShardProcessor(cfg.extraction, [0, 2], {"model_fingerprint": identity.model_fingerprint})


@pytest.mark.parametrize("wide_tokens", [4096, None])
def test_batching_changes_neither_counts_nor_statistics_nor_sample(
    tmp_path, tiny_bert, monkeypatch, wide_tokens
):
    """Wide pooled batches with a padding budget (4,096 tokens, or the CPU default) against
    small unpooled exact-length ones."""
    rng = np.random.default_rng(0)
    words = ["cat", "dog", "sat", "mat", "the", "a", "on", "ran", "blue", "sky", "tree", "sun"]
    texts = [" ".join(rng.choice(words, size=int(rng.integers(1, 40)))) for _ in range(120)]
    corpus = write_jsonl(tmp_path / "c.jsonl", texts)
    shard = plan_shards(CorpusSpec(corpus)).shards[0]
    wide = processor(tiny_bert, corpus, tmp_path / "a", max_length=24, batch_tokens=wide_tokens)
    assert wide.batch_tokens == (wide_tokens or 8192)  # a tiny model: the CPU cap
    stats_a, sample_a, counts_a = wide.process(shard)

    monkeypatch.setattr(extractor, "POOL_BATCHES", 1)
    monkeypatch.setattr(extractor, "MAX_PADDING", 0.0)
    monkeypatch.setattr(extractor, "MIN_BATCH_POSITIONS", 0)
    narrow = processor(
        tiny_bert, corpus, tmp_path / "b", max_length=24, batch_tokens=64, docs_per_chunk=7
    )
    stats_b, sample_b, counts_b = narrow.process(shard)

    assert counts_b.batches > 3 * counts_a.batches  # really another batching
    assert counts_b.padded_tokens == counts_b.positions  # exact-length batches: no padding
    # a pool this small (2.6k tokens) also merges batches under MIN_BATCH_POSITIONS positions,
    # each for fewer than MIN_BATCH_POSITIONS padded ones, at most one per window length
    bound = MAX_PADDING * counts_a.positions + MIN_BATCH_POSITIONS * 24
    assert counts_a.positions <= counts_a.padded_tokens <= counts_a.positions + bound
    for name in ("documents", "windows", "tokens", "positions", "special_tokens", "unk_tokens"):
        assert getattr(counts_a, name) == getattr(counts_b, name), name
    assert counts_a.positions == counts_a.tokens + counts_a.special_tokens
    for layer in (0, 2):
        a, b = stats_a.layer(layer), stats_b.layer(layer)
        np.testing.assert_array_equal(a.type_ids, b.type_ids)
        np.testing.assert_array_equal(a.counts, b.counts)
        for name in ("means", "m2", "position_means"):
            np.testing.assert_allclose(getattr(a, name), getattr(b, name), rtol=1e-4, atol=1e-5)
        pa, pb = sample_a.points(layer), sample_b.points(layer)
        np.testing.assert_array_equal(pa.keys, pb.keys)
        np.testing.assert_array_equal(pa.token_ids, pb.token_ids)
        np.testing.assert_allclose(pa.vectors, pb.vectors, rtol=1e-4, atol=1e-5)


def test_unknown_tokens_are_counted(tmp_path, tiny_bert):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_bert)
    texts = [
        "a parrot 🦜 and a snowman ⛄ walk into a bar 🍺",
        "plain words only here",
        "🦜🦜 both birds, 𓀀 a hieroglyph",
        "nothing unknown",
    ]
    corpus = write_jsonl(tmp_path / "c.jsonl", texts)
    shard = plan_shards(CorpusSpec(corpus)).shards[0]
    proc = processor(tiny_bert, corpus, tmp_path / "o", max_length=64)
    stats, _, counts = proc.process(shard)
    # the per-type arrays never get more slots than the tokenizer has tokens
    assert stats.type_moments.max_types == len(tok) and stats._capacity() <= len(tok)
    ids = [tok(t)["input_ids"] for t in texts]  # the tokenizer alone; every text fits one window
    unk = sum(x.count(tok.unk_token_id) for x in ids)
    assert unk >= 4
    assert counts.unk_tokens == unk
    assert counts.positions == sum(len(x) for x in ids)
    assert counts.special_tokens == 2 * len(texts) + unk  # [CLS], [SEP] and every [UNK]
    assert counts.tokens == counts.positions - counts.special_tokens
    assert counts.unk_share == pytest.approx(unk / (counts.tokens + unk))
    assert counts.padding_ratio == counts.padded_tokens / counts.positions
    message = unk_warning(counts)
    assert message is not None
    assert f"{counts.unk_share:.1%}" in message and "[UNK]" in message
    assert unk_warning(counts, threshold=0.5) is None


@pytest.mark.parametrize("keep_special", [False, True])
def test_documents_without_tokens_count_no_window(tmp_path, tiny_bert, keep_special):
    """A document whose text the tokenizer drops (U+200B, U+FEFF) has no window, and one of
    [UNK]s alone none that runs without --keep-special: ``windows`` counts the windows that
    ran, ``documents_without_tokens`` the documents that gave none (it was 1 window each)."""
    texts = ["the cat sat on the mat", "\u200b\ufeff", "🦜🦜", "a dog ran"]
    corpus = write_jsonl(tmp_path / "c.jsonl", texts)
    shard = plan_shards(CorpusSpec(corpus)).shards[0]
    proc = processor(tiny_bert, corpus, tmp_path / "o", max_length=64, keep_special=keep_special)
    _, _, counts = proc.process(shard)
    ran = 3 if keep_special else 2  # [CLS] [UNK] [UNK] [SEP] holds counted tokens only if kept
    assert counts.documents == 4
    assert (counts.windows, counts.documents_without_tokens) == (ran, 4 - ran)
    # [CLS] the cat sat on the mat [SEP], [CLS] a dog ran [SEP] (+ [CLS] [UNK] [SEP])
    assert counts.positions == {False: 8 + 5, True: 8 + 3 + 5}[keep_special]


def test_batch_tokens_default_to_what_the_allocator_reuses_on_cpus_and_fits_on_a_gpu(
    tmp_path, tiny_bert, monkeypatch
):
    """Without --batch-tokens: on a CPU as many as keep one layer's largest tensor,
    max(ffn, d)·b bytes a token, within glibc's 32 MiB mmap threshold, 1,024..8,192 in steps
    of 1,024; on a GPU as many as 8 GiB (or half the free memory) hold at
    ((L + 1)·d + 3·ffn + heads·T)·b + 64·d bytes a token, 8,192..65,536 in steps of 1,024
    (the per-batch launch cost of the GPU fold is amortised over more tokens)."""
    import json
    from pathlib import Path

    corpus = write_jsonl(tmp_path / "c.jsonl", ["the cat sat"])
    proc = processor(tiny_bert, corpus, tmp_path / "o")
    cfg = json.loads((Path(tiny_bert) / "config.json").read_text())
    d, ffn, blocks = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    assert max(ffn, d) * 4 * 8192 < 32 << 20  # a tiny model: the most a CPU batch gets
    assert proc.batch_tokens == 8192
    assert processor(tiny_bert, corpus, tmp_path / "o", batch_tokens=640).batch_tokens == 640
    # the same rule as the job's sizing, from this model's shape: with a threshold of 3,000
    # tokens of float32 d_ff, 2,048 tokens in float32 and 5,120 in bfloat16 (6,000 tokens)
    monkeypatch.setattr(sizing.formulas, "MMAP_THRESHOLD_MAX", 3000 * max(ffn, d) * 4)
    assert processor(tiny_bert, corpus, tmp_path / "o").batch_tokens == 2048
    assert processor(tiny_bert, corpus, tmp_path / "o", dtype="bfloat16").batch_tokens == 5120
    with intra_op_threads(2):  # the same in two lanes
        assert processor(tiny_bert, corpus, tmp_path / "o", cpu_lanes=2).batch_tokens == 2048
    monkeypatch.undo()
    scores = cfg["num_attention_heads"] * proc.options.max_length  # one layer's, a token
    per_token = ((blocks + 1) * d + 3 * ffn + scores) * 4 + 64 * d  # float32 weights
    assert sizing.batch_bytes_per_token(blocks + 1, d, ffn, 4, scores) == per_token
    text_config = proc.model.config.get_text_config()
    proc.device = "cuda"  # as on a GPU: the free memory decides
    state = sizing.Shape(
        layers=2, dim=d, positions=proc.options.max_length, vocab=len(proc.tokenizer),
        sample_entries=2 * proc.options.sample_size,
    ).statistics_bytes(len(proc.tokenizer))  # fmt: skip
    for free, want in (
        (80 << 30, 65_536),  # 8 GiB hold more than the cap
        (2 * 20 * 1024 * per_token + 2 * per_token - 2, 20 * 1024),  # half the free memory,
        (4 << 20, 8192),  # never fewer than 8,192 on a GPU           # in steps of 1,024
    ):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda free=free: (free, 80 << 30))
        tokens, budget = proc._budgets(text_config)
        assert tokens == want
        # the statistics get 0.8 of what the batch leaves, unless the whole vocabulary fits
        left = int(0.8 * max(0, free - want * per_token))
        assert budget == (None if left >= state else left)
    # the 8 GiB bound, at the size of an 8B Llama in bf16 (33 hidden states, d = 4,096)
    llama = sizing.batch_bytes_per_token(33, 4096, 14_336, 2, 32 * 128)
    assert llama == 33 * 4096 * 2 + 64 * 4096 + 3 * 14_336 * 2 + 32 * 128 * 2
    assert sizing.default_batch_tokens(llama, 80 << 30) == 13_312
    assert sizing.default_batch_tokens(llama, 80 << 30) == (8 << 30) // llama // 1024 * 1024
    assert sizing.default_batch_tokens(llama, None) == 8192


@pytest.mark.parametrize(
    ("device", "budget", "slots"),
    [("cuda", None, "vocabulary"), ("cuda", 1 << 30, None), ("cpu", None, None)],
)
def test_a_gpu_holding_every_type_allocates_their_slots_at_once(
    tmp_path, tiny_bert, monkeypatch, device, budget, slots
):
    """Where the sizing found room on the GPU for the statistics of every type (no budget),
    the per-type arrays get all the tokenizer's slots at once: no doubling, whose last step
    holds a field's old and new arrays together. Under a budget the budget's slots are given
    by fit_budget instead, and on a CPU (pages touched only when a slot is assigned) the
    arrays start small; the doubling stops at the tokenizer's size everywhere."""
    from transformers import AutoTokenizer

    corpus = write_jsonl(tmp_path / "c.jsonl", ["a few words"])
    proc = processor(tiny_bert, corpus, tmp_path / "o")
    made = {}
    monkeypatch.setattr(extractor, "EmbeddingStatistics", lambda *a, **kw: made.update(kw))
    proc.device, proc.statistics_budget = device, budget
    proc.new_statistics()
    vocabulary = len(AutoTokenizer.from_pretrained(tiny_bert))
    assert made["max_types"] == vocabulary
    assert made.get("initial_types") == (vocabulary if slots else None)


def test_a_host_tier_is_kept_only_above_the_statistics_budget(tmp_path, tiny_bert, caplog):
    """The host tier (--host-statistics-memory) sets what the statistics may hold before a
    flush where it exceeds the statistics budget; without a budget nothing spills, and a
    budget the extractor decides above it (a GPU holding more than its type says) leaves it
    out, with a warning, instead of failing the run."""
    corpus = write_jsonl(tmp_path / "c.jsonl", ["the cat sat"])
    tier = processor(tiny_bert, corpus, tmp_path / "o", statistics_memory="4MiB",
                     host_statistics_memory="64MiB")  # fmt: skip
    assert (tier.host_budget, tier.flush_budget) == (64 << 20, 64 << 20)
    plain = processor(tiny_bert, corpus, tmp_path / "o", statistics_memory="4MiB")
    assert (plain.host_budget, plain.flush_budget) == (None, 4 << 20)
    unbounded = processor(tiny_bert, corpus, tmp_path / "o", host_statistics_memory="64MiB")
    assert (unbounded.host_budget, unbounded.flush_budget) == (None, None)
    outgrown = processor(tiny_bert, corpus, tmp_path / "o", statistics_memory="4MiB",
                         host_statistics_memory="2MiB")  # fmt: skip
    assert (outgrown.host_budget, outgrown.flush_budget) == (None, 4 << 20)
    assert "no host tier" in caplog.text
