"""What the job's own process hands its extractors so that they write their own checkpoint
groups to object storage (embgeom_ray/storage.py: ``storage_access``, ``use_storage_access``):
the object stores' variables and fsspec's configuration, set only where the extractor's
process has none of its own."""

from __future__ import annotations

import os

import fsspec.config

from embgeom_ray import io_utils  # applies the job's defaults on import, as in every process
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


def test_the_drivers_settings_replace_the_job_defaults_an_extractor_applied_first(monkeypatch):
    """An extractor's process that imported io_utils before it took the driver's access has
    the job's defaults (minutes of timeouts and retries) in fsspec's configuration: they are not
    the node's own, so the driver's settings (here a test's short timeouts) replace them; a
    node's own setting, or the defaults changed since, still win."""
    short = {"config_kwargs": {"read_timeout": 0.5, "retries": {"total_max_attempts": 2}}}
    access = {"env": {}, "fsspec": {"s3": short}}
    for own in (None, {"anon": True}):
        monkeypatch.setattr(fsspec.config, "conf", {} if own is None else {"s3": dict(own)})
        monkeypatch.setattr(io_utils, "_FROM_DEFAULTS", {})
        io_utils.apply_store_defaults()
        assert io_utils.store_defaults_only("s3") is (own is None)
        use_storage_access(access)
        if own is None:
            assert fsspec.config.conf["s3"] == short
        else:  # the node's own, with the defaults under it
            assert fsspec.config.conf["s3"]["anon"] is True
            assert fsspec.config.conf["s3"]["config_kwargs"] == io_utils.STORE_DEFAULTS["s3"]["config_kwargs"]
    # the defaults, changed in this process since they were applied, are its own
    monkeypatch.setattr(fsspec.config, "conf", {})
    monkeypatch.setattr(io_utils, "_FROM_DEFAULTS", {})
    io_utils.apply_store_defaults()
    fsspec.config.conf["s3"]["config_kwargs"]["read_timeout"] = 7
    use_storage_access(access)
    assert fsspec.config.conf["s3"]["config_kwargs"]["read_timeout"] == 7
