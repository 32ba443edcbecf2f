"""What the job's own process hands its extractors so that they write their own checkpoint
groups to object storage (embgeom_ray/storage.py: ``storage_access``, ``use_storage_access``):
the object stores' variables and fsspec's configuration, set only where the extractor's
process has none of its own."""

from __future__ import annotations

import os

import fsspec.config

from embgeom_ray.storage import storage_access, use_storage_access


def test_the_drivers_access_reaches_an_extractor_without_its_own(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "driver-key")
    monkeypatch.setenv("FSSPEC_S3_ANON", "false")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # not the store's: never handed over
    monkeypatch.setitem(fsspec.config.conf, "s3", {"config_kwargs": {"read_timeout": 0.5}})
    access = storage_access()
    assert access["env"]["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9000"
    assert access["env"]["FSSPEC_S3_ANON"] == "false" and "HF_HUB_OFFLINE" not in access["env"]
    assert access["fsspec"]["s3"] == {"config_kwargs": {"read_timeout": 0.5}}
    # an extractor's process: its own key and fsspec settings win, the rest come from the driver
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "node-key")
    monkeypatch.setattr(fsspec.config, "conf", {"s3": {"anon": True}})
    use_storage_access(access)
    assert os.environ["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9000"
    assert os.environ["AWS_ACCESS_KEY_ID"] == "node-key"
    assert fsspec.config.conf["s3"] == {"anon": True}
    use_storage_access({})  # nothing to hand over: nothing changes
    assert os.environ["AWS_ACCESS_KEY_ID"] == "node-key"
