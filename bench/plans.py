"""``--plan`` of MiniLM and of 8B- and 70B-shaped Llama models on a simulated GPU cluster.

What docs/sizing.md shows: the job's decisions, every process's memory as number and formula,
for three models, with nothing run. The two Llama models are their configs alone (Llama 3's
published shapes, written here: no weights, no hub) with a WordLevel tokenizer of Llama 3's
128,256 entries; ``--plan`` builds the model on accelerate's empty weights to count them. The
cluster is ``ray.cluster_utils.Cluster`` on this machine with Ray's resources as given: a head
of ``--head-memory`` and ``--nodes`` GPU nodes of ``--gpus`` fake GPUs of Ray's accelerator
type ``--gpu-type`` (whose memory the sizing looks up), ``--cpus`` CPUs and ``--node-memory``
each. The corpus is a JSON Lines file of ``--corpus-gib`` GiB, sparse (its first line is a
document, the rest never read: ``--plan`` reads a corpus's listing and first lines only).

    python -m bench.plans [--nodes 4] [--gpus 8] [--gpu-type H100] [--cpus 96]
        [--node-memory 2TiB] [--head-memory 64GiB] [--corpus-gib 40] [--models minilm,8b,70b]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from bench.common import minilm_dir, work_dir
from bench.vocabulary import parse_bytes, wordlevel_tokenizer

#: Llama 3's published shapes (config.json of Meta-Llama-3-8B and -70B)
LLAMA_SHAPES = {
    "8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14_336},
    "70b": {"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
            "num_key_value_heads": 8, "intermediate_size": 28_672},
}  # fmt: skip
LLAMA_VOCAB = 128_256


def llama_config_dir(path: Path, size: str) -> str:
    """A model directory holding only the config of Llama 3 ``size`` and a 128,256-entry
    tokenizer (no weights)."""
    from transformers import LlamaConfig

    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=LLAMA_VOCAB, max_position_embeddings=8192, rope_theta=500_000.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, **LLAMA_SHAPES[size],
    )  # fmt: skip
    config.save_pretrained(str(path))
    wordlevel_tokenizer(LLAMA_VOCAB).save_pretrained(str(path))
    return str(path)


def sparse_corpus(path: Path, size: int) -> str:
    """A JSON Lines file of ``size`` bytes whose first line is a document; the rest is a hole
    (no disk), never read by ``--plan``."""
    with path.open("wb") as f:
        f.write((json.dumps({"text": "w4 w5 w6"}) + "\n").encode())
        f.truncate(size)
    return str(path)


def start_cluster(
    nodes: int, gpus: int, gpu_type: str, cpus: int, node_memory: int, head_memory: int
):
    """A simulated cluster on this machine (free ports; no dashboard), joined by this process."""
    import ray
    from ray.cluster_utils import Cluster

    from tests.ray_processes import free_ports

    (port,) = free_ports(1)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 8, "memory": head_memory, "gcs_server_port": port,
                        "include_dashboard": False},
    )  # fmt: skip
    for _ in range(nodes):
        cluster.add_node(num_cpus=cpus, num_gpus=gpus, memory=node_memory,
                         resources={f"accelerator_type:{gpu_type}": gpus})  # fmt: skip
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    return cluster


def plan(model: str, corpus: str, dtype: str, echo=print) -> dict:
    """``python -m jobs.analyze --plan`` of ``model`` over ``corpus`` on the joined cluster."""
    from embgeom_ray.config import build_config
    from embgeom_ray.runs.pipeline import analyze

    config = build_config(None, {"model": model, "corpus": corpus, "out": "unused",
                                 "dtype": dtype, "plan": True})  # fmt: skip
    return analyze(config, echo=echo)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--gpu-type", default="H100")
    p.add_argument("--cpus", type=int, default=96)
    p.add_argument("--node-memory", default="2TiB")
    p.add_argument("--head-memory", default="64GiB")
    p.add_argument("--corpus-gib", type=float, default=40)
    p.add_argument("--models", default="minilm,8b,70b")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray

    with work_dir("plans") as work:
        corpus = sparse_corpus(work / "corpus.jsonl", int(args.corpus_gib * 2**30))
        cluster = start_cluster(
            args.nodes, args.gpus, args.gpu_type, args.cpus, parse_bytes(args.node_memory),
            parse_bytes(args.head_memory),
        )  # fmt: skip
        try:
            for name in args.models.split(","):
                if name == "minilm":
                    model, dtype = minilm_dir(), "float32"
                else:
                    model, dtype = llama_config_dir(work / name, name), "bfloat16"
                print(f"\n$ python -m jobs.analyze --plan --model <{name}> --dtype {dtype} "
                      f"--corpus <{args.corpus_gib:g} GiB of JSON Lines> --out OUT")  # fmt: skip
                try:
                    plan(model, corpus, dtype)
                except Exception as exc:  # a refusal is the plan's answer too
                    print(f"error: {exc}")
        finally:
            ray.shutdown()
            cluster.shutdown()


if __name__ == "__main__":
    main()
