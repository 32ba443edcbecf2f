"""The hub token goes where it is needed and is written nowhere.

- :func:`use_hub_credentials` sets a token the node lacks, and never replaces the node's own;
  the driver's runtime environment (which Ray shows in its dashboard and writes to its logs)
  carries the other ``HF_*`` variables but not the token; an extractor actor's body sets the
  token it is given before it loads the model.
- A whole job with ``HF_TOKEN`` set, run as users run it, writes the token nowhere: not in
  the run's files, its output or Ray's files (tests/project/test_wheel.py, whose job is one).
"""

from __future__ import annotations

import os

from embgeom_ray.inputs.hub_credentials import hub_credentials, use_hub_credentials


def test_credentials_fill_in_and_never_replace(monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_driver")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    assert hub_credentials() == {"HF_TOKEN": "hf_driver"}
    monkeypatch.delenv("HF_TOKEN")
    use_hub_credentials({"HF_TOKEN": "hf_driver", "PATH": "/nowhere"})
    assert os.environ["HF_TOKEN"] == "hf_driver" and os.environ["PATH"] != "/nowhere"
    monkeypatch.setenv("HF_TOKEN", "hf_node")
    use_hub_credentials({"HF_TOKEN": "hf_driver"})
    assert os.environ["HF_TOKEN"] == "hf_node"


def test_the_token_is_not_in_the_runtime_env(monkeypatch) -> None:
    from embgeom_ray.distributed.cluster import _driver_runtime_env

    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", "hf_secret")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env_vars = (_driver_runtime_env() or {}).get("env_vars", {})
    assert env_vars.get("HF_HUB_OFFLINE") == "1"
    assert "hf_secret" not in repr(env_vars)


def test_an_extractor_sets_the_token_it_is_given(monkeypatch, minilm_dir) -> None:
    from embgeom_ray.distributed.actor_pool import ShardExtract
    from embgeom_ray.inputs.options import ExtractionOptions

    monkeypatch.delenv("HF_TOKEN", raising=False)
    seen = {}

    def loading(*args, **kwargs):
        seen["token"] = os.environ.get("HF_TOKEN")
        raise RuntimeError("stop here")

    monkeypatch.setattr("embgeom_ray.distributed.actor_pool.ShardProcessor", loading)
    options = ExtractionOptions(model=minilm_dir, corpus="c.jsonl")
    actor = ShardExtract(options.model_dump(), [0], {}, 1, None, {"HF_TOKEN": "hf_given"})
    assert seen["token"] == "hf_given"  # set before the model is loaded
    assert isinstance(actor.error, RuntimeError)
