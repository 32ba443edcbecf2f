"""Model directories whose tokenizer cannot be the model's: refused before any work."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from embgeom_ray.errors import ModelError
from embgeom_ray.inputs.model_loading import check_vocabulary, resolve_identity, unknown_token_id
from jobs.analyze import main
from tests.conftest import write_jsonl
from tests.tiny_models import make_tiny_bert, make_tiny_gpt2

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
)


def weights_and_config_only(source: str, target: Path) -> str:
    """A copy of a model directory with its config and weights only (weights linked)."""
    target.mkdir()
    shutil.copy(Path(source) / "config.json", target / "config.json")
    os.symlink(Path(source) / "model.safetensors", target / "model.safetensors")
    return str(target)


def test_model_without_tokenizer_files_is_refused(tmp_path, minilm_dir):
    bare = weights_and_config_only(minilm_dir, tmp_path / "bare")
    with pytest.raises(ModelError) as err:
        resolve_identity(bare, None, False)
    message = str(err.value)
    assert "has no tokenizer files" in message and "tokenizer.json" in message
    # transformers 5 builds a tokenizer of the 5 special tokens, transformers 4 raises
    assert ("5 entries" in message and "30,522" in message) or "cannot be loaded" in message


def test_job_on_model_without_tokenizer_exits_2_before_any_work(tmp_path, minilm_dir, capsys):
    bare = weights_and_config_only(minilm_dir, tmp_path / "bare")
    corpus = write_jsonl(tmp_path / "c.jsonl", ["the cat sat on the mat", "a dog barked"])
    out = tmp_path / "out"
    code = main(["--model", bare, "--corpus", corpus, "--out", str(out)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err
    assert "has no tokenizer files" in lines[0] and "bare" in lines[0]
    assert not (out / "manifest.json").exists()


def with_tokenizer_of(model_dir: str, tokenizer_dir: str, target: Path) -> str:
    shutil.copytree(model_dir, target)
    for name in TOKENIZER_FILES:
        (target / name).unlink(missing_ok=True)
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, target / name)
    return str(target)


def test_another_models_tokenizer_is_refused(tmp_path):
    bert = make_tiny_bert(str(tmp_path / "bert"))  # vocabulary 30,522
    gpt2 = make_tiny_gpt2(str(tmp_path / "gpt2"))  # vocabulary 800
    small = with_tokenizer_of(bert, gpt2, tmp_path / "bert-with-gpt2-tokenizer")
    with pytest.raises(ModelError, match=r"800 entries but the model's vocabulary has 30,522"):
        resolve_identity(small, None, False)
    large = with_tokenizer_of(gpt2, bert, tmp_path / "gpt2-with-bert-tokenizer")
    with pytest.raises(ModelError, match=r"30,522 entries but the model's embedding only 800"):
        resolve_identity(large, None, False)


def test_usual_vocabulary_differences_are_accepted(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    bert = make_tiny_bert(str(tmp_path / "bert"))
    tok = AutoTokenizer.from_pretrained(bert)
    config = AutoConfig.from_pretrained(bert)
    assert len(tok) == config.vocab_size == 30522
    check_vocabulary(bert, tok, config)
    # embedding rows padded to a multiple of 128, or reserved ids: up to 10% more than the tokenizer
    for padded in (30592, 33_000):
        config.vocab_size = padded
        check_vocabulary(bert, tok, config)
    config.vocab_size = 34_000  # 3,478 rows (10.2%) without a token: not this tokenizer
    with pytest.raises(ModelError, match="30,522 entries"):
        check_vocabulary(bert, tok, config)
    # added tokens past the embedding (base vocabulary within it)
    config.vocab_size = 30522
    tok.add_special_tokens({"additional_special_tokens": ["<extra_a>", "<extra_b>"]})
    assert len(tok) == 30524
    check_vocabulary(bert, tok, config)
    # a small vocabulary padded to a multiple of 128 (800 -> 896): 96 rows (11%) without a token
    gpt2 = make_tiny_gpt2(str(tmp_path / "gpt2"))
    small_tok, small_config = AutoTokenizer.from_pretrained(gpt2), AutoConfig.from_pretrained(gpt2)
    small_config.vocab_size = 896
    check_vocabulary(gpt2, small_tok, small_config)
    small_config.vocab_size = 1000  # 200 rows (20%): more than padding explains
    with pytest.raises(ModelError, match="800 entries"):
        check_vocabulary(gpt2, small_tok, small_config)
    # a config that states no vocabulary size is not checked
    del config.vocab_size
    check_vocabulary(bert, tok, config)


def test_unknown_token_id(tmp_path, minilm_dir):
    from transformers import AutoTokenizer

    assert unknown_token_id(AutoTokenizer.from_pretrained(minilm_dir)) == 100
    gpt2 = AutoTokenizer.from_pretrained(make_tiny_gpt2(str(tmp_path / "gpt2")))
    assert gpt2.unk_token_id == gpt2.eos_token_id  # "<|endoftext|>": structure, not unknown
    assert unknown_token_id(gpt2) is None


@pytest.mark.parametrize(
    ("version", "keyword"),
    [("4.45.2", "torch_dtype"), ("4.55.4", "torch_dtype"), ("4.56.0", "dtype"), ("5.24.0", "dtype")],
)
def test_the_dtype_keyword_follows_the_transformers_version(monkeypatch, version, keyword):
    """transformers 4.45–4.55 take ``torch_dtype`` (4.45 refuses ``dtype``: every model failed
    to load), 4.56 and later ``dtype`` (5.x warns about ``torch_dtype``)."""
    import torch
    import transformers

    from embgeom_ray.inputs.model_loading import dtype_argument

    monkeypatch.setattr(transformers, "__version__", version)
    assert dtype_argument(torch.bfloat16) == {keyword: torch.bfloat16}


def test_weight_bytes_from_the_checkpoint_equal_the_empty_models(tmp_path, minilm_dir):
    """A base-model checkpoint's weights read from its safetensors headers: the bytes the
    empty-weight copy's parameters count, for MiniLM and random BERT, GPT-2, Llama and RoBERTa
    (GPT-2's and Llama's tied and untied embeddings, BERT's integer position ids left out)."""
    from embgeom_ray.inputs.model_loading import checkpoint_weight_bytes, empty_model
    from tests.tiny_models import make_tiny_llama, make_tiny_roberta

    dirs = [minilm_dir, make_tiny_bert(tmp_path / "bert"), make_tiny_gpt2(tmp_path / "gpt2"),
            make_tiny_llama(tmp_path / "llama"), make_tiny_roberta(tmp_path / "roberta")]  # fmt: skip
    for model in dirs:
        for dtype in ("float32", "bfloat16"):
            empty = empty_model(model, None, dtype, False)
            want = sum(p.numel() * p.element_size() for p in empty.parameters())
            assert checkpoint_weight_bytes(model, dtype) == want, (model, dtype)
    assert checkpoint_weight_bytes(minilm_dir, "float32") == 90_852_864  # 22.7M parameters


def test_weight_bytes_of_a_head_checkpoint_come_from_the_empty_model(tmp_path):
    """A causal LM's checkpoint holds a head AutoModel leaves out: not read from its headers;
    without weights in safetensors, or with a file that is not one, neither."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from embgeom_ray.inputs.model_loading import checkpoint_weight_bytes, weight_bytes

    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         tie_word_embeddings=False)  # fmt: skip
    head = tmp_path / "causal"
    LlamaForCausalLM(config).save_pretrained(head)
    assert checkpoint_weight_bytes(str(head), "float32") is None
    base = sum(p.numel() for n, p in LlamaForCausalLM(config).named_parameters()
               if not n.startswith("lm_head."))  # fmt: skip
    assert weight_bytes(str(head), None, "float32", False) == 4 * base
    torch.save({}, head / "pytorch_model.bin")
    (head / "model.safetensors").unlink()
    (head / "config.json").write_text(
        (head / "config.json").read_text().replace('"LlamaForCausalLM"', '"LlamaModel"')
    )
    assert checkpoint_weight_bytes(str(head), "float32") is None  # no safetensors
    (head / "model.safetensors").write_bytes(b"not a safetensors file")
    assert checkpoint_weight_bytes(str(head), "float32") is None  # the extractor's load says so
