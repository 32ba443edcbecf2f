"""The extractor without Ray: windows, batching, out-of-memory retries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embgeom_ray.config import build_config
from embgeom_ray.inputs.corpus import CorpusSpec, plan_shards
from embgeom_ray.inputs.extractor import ShardProcessor
from embgeom_ray.inputs.model_loading import resolve_identity
from embgeom_ray.inputs.windows import make_batches, tokenize_windows
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
    proc = ShardProcessor(cfg, [0, 2], {"model_fingerprint": identity.model_fingerprint})
    shard = plan_shards(CorpusSpec(corpus)).shards[0]
    clean, clean_sample, clean_counts = proc.process(shard)

    real_forward = proc.forward

    def forward_with_small_memory(batch):
        if batch.input_ids.shape[0] > 8:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_forward(batch)

    monkeypatch.setattr(proc, "forward", forward_with_small_memory)
    stats, sample, counts = proc.process(shard)
    assert counts.oom_splits >= 2
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
