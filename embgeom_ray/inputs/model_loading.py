"""Loading models and tokenizers, resolving what exactly was measured, choosing layers.

The driver loads only the config and the tokenizer (to validate options and name tokens); the
model itself is loaded once per extractor actor (:mod:`embgeom_ray.inputs.extractor`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, ModelError
from .fingerprints import directory_fingerprint

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


@dataclass(frozen=True)
class ModelIdentity:
    """What was measured: the model as given, its resolved revision and content fingerprints."""

    model: str
    revision: str | None  # commit hash for hub models; "sha256:…" content hash for local dirs
    model_fingerprint: str
    tokenizer_fingerprint: str
    num_layers: int  # transformer blocks L; hidden states are 0..L
    hidden_size: int
    model_type: str

    def to_json(self) -> dict[str, Any]:
        return self.__dict__.copy()


def _load_error(kind: str, model: str, exc: Exception) -> ModelError:
    if model.startswith(("/", ".", "~")) and not os.path.exists(os.path.expanduser(model)):
        # a path, not a hub id: the hub's own complaint about the id's form says nothing
        return ModelError(f"cannot load the {kind} of {model!r}: no such directory")
    where = "local directory" if os.path.isdir(model) else "hub id"
    hint = ""
    if not os.path.exists(model) and ("/" in model or model.startswith((".", "~"))):
        hint = f" ({model} is not an existing directory"
        hint += "; offline mode is on)" if os.environ.get("HF_HUB_OFFLINE") == "1" else ")"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ModelError(f"cannot load the {kind} of {where} {model!r}{hint}: {first}")


def load_config(model: str, revision: str | None, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(
            model, revision=revision, trust_remote_code=trust_remote_code
        )
    except Exception as exc:
        raise _load_error("config", model, exc) from None
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def load_tokenizer(model: str, revision: str | None, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(
            model, revision=revision, trust_remote_code=trust_remote_code
        )
    except Exception as exc:
        if os.path.isdir(model) and not _has_tokenizer_files(model):  # transformers 4 raises
            raise _no_tokenizer_files(model, "the tokenizer cannot be loaded") from None
        raise _load_error("tokenizer", model, exc) from None
    if not getattr(tok, "is_fast", False):
        raise ModelError(
            f"the tokenizer of {model!r} is not a fast (Rust) tokenizer; embgeom_ray needs one "
            "to tokenize a corpus at speed"
        )
    return tok


def _no_tokenizer_files(model: str, found: str) -> ModelError:
    return ModelError(
        f"{model!r} has no tokenizer files (tokenizer.json / vocab.txt / vocab.json + "
        f"merges.txt / a sentencepiece *.model): {found}; copy the model's tokenizer files "
        "into it"
    )


#: Files that carry a fast tokenizer's vocabulary (one of them, or a sentencepiece ``*.model``
#: / tiktoken ``*.tiktoken`` file, must be in a local model directory).
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "merges.txt")
#: A tokenizer may have fewer entries than the model's vocabulary by this many ...
VOCAB_SHORTFALL_ENTRIES = 128
#: ... or by this share of the model's vocabulary, whichever is larger (see check_vocabulary).
VOCAB_SHORTFALL_SHARE = 0.10


def _has_tokenizer_files(path: str) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(n in TOKENIZER_FILES or n.endswith((".model", ".tiktoken")) for n in names)


def check_vocabulary(model: str, tokenizer: Any, config: Any) -> None:
    """Refuse a tokenizer that cannot be the model's, before any work starts.

    With ``n = len(tokenizer)`` (base vocabulary plus added tokens), ``base`` the base
    vocabulary alone and ``V`` the config's ``vocab_size`` (rows of the embedding matrix):

    * ``V − n`` may reach ``max(VOCAB_SHORTFALL_ENTRIES, VOCAB_SHORTFALL_SHARE × V)``: a model's
      embedding is often larger than its tokenizer (rows padded to a multiple of 64/128/…,
      reserved ids: T5 32,100 of 32,128, Qwen2 151,646 of 151,936, phi-2 50,295 of 51,200);
      a tokenizer missing more is not the model's. The usual failure: a local directory with
      weights and config but no tokenizer files, where the tokenizer library silently builds a
      tokenizer of its five special tokens, every word becomes [UNK], and the job would end
      blaming the corpus. A local directory without any vocabulary file
      (:data:`TOKENIZER_FILES`, ``*.model``, ``*.tiktoken``) is refused whenever ``n < V``.
    * ``n > V`` is accepted when only added tokens lie past the embedding (``base ≤ V``): some
      checkpoints ship added special tokens the model never embeds; they do not occur in text.
      ``base > V`` is refused: ordinary text would produce ids the embedding does not have.

    Models whose config states no ``vocab_size`` are not checked. Raises :class:`ModelError`.
    """
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab <= 0:
        return
    n = len(tokenizer)
    base = int(getattr(tokenizer, "vocab_size", n) or n)
    local = os.path.isdir(model)
    missing_files = local and not _has_tokenizer_files(model)
    if n < vocab and (
        missing_files or vocab - n > max(VOCAB_SHORTFALL_ENTRIES, VOCAB_SHORTFALL_SHARE * vocab)
    ):
        if missing_files:
            raise _no_tokenizer_files(
                model, f"the tokenizer found has {n:,} entries, the model's vocabulary {vocab:,}"
            )
        raise ModelError(
            f"the tokenizer of {model!r} has {n:,} entries but the model's vocabulary has "
            f"{vocab:,}: the tokenizer files are missing or not this model's"
        )
    if base > vocab:
        raise ModelError(
            f"the tokenizer of {model!r} has {base:,} entries but the model's embedding only "
            f"{vocab:,} rows (ids {vocab:,} and up would fall outside it): the tokenizer files "
            "are not this model's"
        )


def unknown_token_id(tokenizer: Any) -> int | None:
    """The id of the tokenizer's unknown token ([UNK], <unk>), or ``None`` if it has none.

    Byte-level tokenizers (GPT-2, …) name a structural token as ``unk_token``
    (``<|endoftext|>``); when the unknown token's id is also the BOS/EOS/CLS/SEP/PAD/MASK id it
    marks structure, not unknown text, and ``None`` is returned.
    """
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return None
    structural = {
        getattr(tokenizer, f"{name}_token_id", None)
        for name in ("bos", "eos", "cls", "sep", "pad", "mask")
    }
    return None if unk in structural else int(unk)


def load_model(
    model: str,
    revision: str | None,
    dtype: str,
    device: str,
    trust_remote_code: bool,
    device_map: dict[str, int] | None = None,
) -> Any:
    """The model in eval mode on ``device``, or dispatched over GPUs by ``device_map``
    (:func:`balanced_device_map`). transformers' own progress bar of the weights' loading is
    off: in an extractor actor Ray forwards it into the job's bar of shards, on one line."""
    import torch
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        m = AutoModel.from_pretrained(
            model,
            revision=revision,
            trust_remote_code=trust_remote_code,
            **dtype_argument(getattr(torch, _DTYPES[dtype])),
            **({} if device_map is None else {"device_map": device_map}),
        )
    except Exception as exc:
        raise _load_error("weights", model, exc) from None
    return m.eval() if device_map is not None else m.eval().to(device)


def content_rule(config: Any) -> str:
    """What a hidden state depends on, for the sample's content keys
    (:func:`embgeom_ray.core.samples.content_keys`): ``"prefix"`` for a causal model (a
    position attends to the positions up to it only), ``"window"`` otherwise.

    Causal: ``config.is_decoder`` (an encoder run as a decoder), or a ``model_type`` that has a
    causal-LM class in transformers and no masked-LM one (GPT-2, Llama, Mistral, Qwen, Gemma,
    ...; BERT and RoBERTa have both and are bidirectional as ``AutoModel`` loads them). A model
    type transformers knows neither way gets ``"window"``: equal windows then still give equal
    keys, only the repeats of a causal prefix in different windows stay apart.
    """
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(config, "model_type", None)
    causal = bool(getattr(config, "is_decoder", False)) or (
        model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    )
    return "prefix" if causal else "window"


def dtype_argument(dtype: Any) -> dict[str, Any]:
    """The keyword that sets a model's dtype in ``from_pretrained``/``from_config``: ``dtype``
    since transformers 4.56, ``torch_dtype`` before (the range this project declares starts at
    4.45; 4.45 refuses ``dtype``, 5.x warns about ``torch_dtype``)."""
    import transformers
    from packaging.version import Version

    new = Version(transformers.__version__).release >= (4, 56)
    return {"dtype" if new else "torch_dtype": dtype}


def empty_model(model: str, revision: str | None, dtype: str, trust_remote_code: bool) -> Any:
    """The model built from its config with no weights (accelerate's ``init_empty_weights``:
    every parameter on the meta device), in ``dtype``: its structure and sizes, nothing loaded."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModel

    try:
        cfg = AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise _load_error("config", model, exc) from None
    with init_empty_weights():
        return AutoModel.from_config(
            cfg,
            trust_remote_code=trust_remote_code,
            **dtype_argument(getattr(torch, _DTYPES[dtype])),
        )


def weight_bytes(model: str, revision: str | None, dtype: str, trust_remote_code: bool) -> int:
    """Bytes of the model's weights in ``dtype``: read from a local base-model checkpoint's
    safetensors headers where there is one (:func:`checkpoint_weight_bytes`), else counted on
    its empty-weight copy (:func:`empty_model`), whose building imports the model's modeling
    code (~1.8 s of CPU for MiniLM, a driver's only use of it)."""
    if not trust_remote_code and os.path.isdir(model):
        counted = checkpoint_weight_bytes(model, dtype)
        if counted is not None:
            return counted
    empty = empty_model(model, revision, dtype, trust_remote_code)
    return int(sum(p.numel() * p.element_size() for p in empty.parameters()))


#: safetensors' floating dtypes (the weights; integer tensors are buffers such as position ids)
_FLOAT_TENSORS = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


def checkpoint_weight_bytes(model_dir: str, dtype: str) -> int | None:
    """Bytes in ``dtype`` of the floating tensors of a local checkpoint that is the model
    :class:`~transformers.AutoModel` loads: ``config.json``'s ``architectures`` is exactly the
    base class of its ``model_type`` (``BertModel`` for ``bert``), so every floating tensor of
    its safetensors file(s) (``model.safetensors``, or the shards its index names) is a
    parameter of that model, read from their headers alone. None otherwise (a checkpoint of a
    head class such as ``LlamaForCausalLM``, whose head AutoModel leaves out; weights not in
    safetensors, or not readable; a config without one architecture): :func:`weight_bytes`
    then counts the empty-weight copy. Equal to that count for MiniLM and the tests' random
    BERT, GPT-2, Llama and RoBERTa (tests/inputs/test_model_loading.py)."""
    import torch
    from safetensors import SafetensorError, safe_open
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    base = MODEL_MAPPING_NAMES.get(config.get("model_type", ""))
    if not isinstance(base, str) or config.get("architectures") != [base]:
        return None
    index = os.path.join(model_dir, "model.safetensors.index.json")
    itemsize = getattr(torch, _DTYPES[dtype]).itemsize
    numel = 0
    try:
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f).get("weight_map", {}).values()))
        elif os.path.isfile(os.path.join(model_dir, "model.safetensors")):
            files = ["model.safetensors"]
        else:
            return None
        for name in files:
            with safe_open(os.path.join(model_dir, name), framework="pt") as f:
                for key in f.keys():
                    tensor = f.get_slice(key)
                    if tensor.get_dtype() in _FLOAT_TENSORS:
                        numel += math.prod(tensor.get_shape())
    except (OSError, ValueError, AttributeError, SafetensorError):  # unreadable: the
        return None  # extractor's load says so in one line
    return numel * itemsize if files else None


def balanced_device_map(
    model: str,
    revision: str | None,
    dtype: str,
    trust_remote_code: bool,
    max_memory: dict[int, int],
) -> dict[str, int]:
    """Module name → GPU index for the model split over the GPUs of ``max_memory`` (GPU
    index → bytes it may hold), blocks balanced between them (accelerate's
    ``get_balanced_memory`` and ``infer_auto_device_map`` on an empty-weight copy, so
    nothing is loaded; no GPU is needed to compute it). A :class:`ConfigError` when the
    weights do not fit the GPUs, since offloading to the CPU would be orders slower."""
    import torch
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    torch_dtype = getattr(torch, _DTYPES[dtype])
    empty = empty_model(model, revision, dtype, trust_remote_code)
    no_split = list(getattr(empty, "_no_split_modules", None) or [])
    balanced = get_balanced_memory(
        empty, max_memory=max_memory, no_split_module_classes=no_split, dtype=torch_dtype
    )
    device_map = infer_auto_device_map(
        empty, max_memory=balanced, no_split_module_classes=no_split, dtype=torch_dtype
    )
    outside = sorted({str(v) for v in device_map.values() if not isinstance(v, int)})
    if outside:
        total = sum(max_memory.values()) / 2**30
        raise ConfigError(
            f"{model!r} in {dtype} does not fit {len(max_memory)} GPU(s) with {total:.1f} GiB "
            f"between them (parts would go to {', '.join(outside)}); raise --gpus-per-worker "
            "or use a smaller --dtype"
        )
    return {name: int(v) for name, v in device_map.items()}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the fast tokenizer's full JSON definition (vocab, merges, normalizers, …)."""
    backend = tokenizer.backend_tokenizer
    payload = json.dumps(
        {"tokenizer": json.loads(backend.to_str()), "special": sorted(tokenizer.all_special_ids)},
        sort_keys=True,
    )
    return "sha256:" + hashlib.sha256(payload.encode()).hexdigest()


def resolve_identity(
    model: str, revision: str | None, trust_remote_code: bool
) -> tuple[ModelIdentity, Any]:
    """The model's identity and its tokenizer (loaded once here, in the driver).

    Raises :class:`ModelError` when the tokenizer cannot be the model's (:func:`check_vocabulary`).
    """
    cfg = load_config(model, revision, trust_remote_code)
    tok = load_tokenizer(model, revision, trust_remote_code)
    check_vocabulary(model, tok, cfg)
    if os.path.isdir(model):
        resolved = directory_fingerprint(model)
        fingerprint = resolved
    else:
        resolved = getattr(cfg, "_commit_hash", None) or revision
        fingerprint = f"{model}@{resolved}"
    num_layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    if not num_layers or not hidden:
        raise ModelError(
            f"cannot tell the number of layers / hidden size of {model!r} from its config"
        )
    identity = ModelIdentity(
        model=model,
        revision=resolved,
        model_fingerprint=fingerprint,
        tokenizer_fingerprint=tokenizer_fingerprint(tok),
        num_layers=int(num_layers),
        hidden_size=int(hidden),
        model_type=str(getattr(cfg, "model_type", "unknown")),
    )
    return identity, tok


def resolve_layers(requested: list[int] | None, num_layers: int) -> list[int]:
    """HF hidden-state indices 0..L (negative counts from the end); None means all L + 1."""
    top = num_layers
    if requested is None:
        return list(range(top + 1))
    out = []
    for layer in requested:
        idx = layer + top + 1 if layer < 0 else layer
        if not 0 <= idx <= top:
            raise ConfigError(
                f"unknown layer {layer}: the model has {num_layers} blocks, so layers are 0..{top} "
                f"(0 = embedding output; negative numbers count from the end)"
            )
        out.append(idx)
    if len(set(out)) != len(out):
        raise ConfigError(f"layers {requested} name the same layer twice")
    return sorted(out)


def max_window_length(config: Any, tokenizer: Any) -> int | None:
    """The longest window the model accepts, from its position embeddings, if it has a limit."""
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is None:
        return None
    if getattr(config, "model_type", "") in {"roberta", "xlm-roberta", "camembert", "longformer"}:
        limit -= (getattr(config, "pad_token_id", 1) or 1) + 1  # positions start at pad_id + 1
    return int(limit)
