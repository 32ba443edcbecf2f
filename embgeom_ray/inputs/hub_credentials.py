"""Hugging Face hub credentials: handed from the job's own process to its extractors, never
recorded.

A gated or private hub model is read with a token (``HF_TOKEN``; ``HUGGING_FACE_HUB_TOKEN``
of older huggingface_hub releases). Where the job's process has one and the extractors' nodes
may not, the driver passes :func:`hub_credentials` to each extractor actor as an argument, and
the actor sets them in its own process (:func:`use_hub_credentials`) before it loads the
model. They do not travel in Ray's runtime environment, which Ray shows in its dashboard and
writes to its logs (``runtime_env_agent.log``); and no option, manifest key, table or message of
the job holds them. ``docs/operations.md`` ("Gated and private models") compares the ways to
give the token.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

#: the environment variables that hold a hub token
TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def hub_credentials() -> dict[str, str]:
    """This process's hub token variables that are set (name -> value)."""
    return {name: os.environ[name] for name in TOKEN_VARIABLES if os.environ.get(name)}


def use_hub_credentials(credentials: Mapping[str, str]) -> None:
    """Set ``credentials`` (:func:`hub_credentials` of the driver) in this process, where it
    has none of its own: a token set on the node wins."""
    for name, value in credentials.items():
        if name in TOKEN_VARIABLES and not os.environ.get(name):
            os.environ[name] = value
