"""An API call when the caller has initialised Ray (``ray.init()`` before it): the job runs on
that Ray, and an ``address`` naming another Ray is refused, not ignored
(``embgeom_ray.distributed.cluster``)."""

from __future__ import annotations

import pytest

from embgeom_ray.distributed import cluster


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("10.0.0.5:6379", "10.0.0.5:6379", True),
        ("10.0.0.5:6379", "10.0.0.5:6380", False),  # another port: another Ray
        ("10.0.0.5:6379", "10.0.0.6:6379", False),
        ("127.0.0.1:6379", "10.0.0.5:6379", True),  # loopback: given the benefit of the doubt
        ("localhost:41000", "127.0.0.1:41000", True),
        ("127.0.0.1:1", "192.0.2.2:38829", False),
    ],
)
def test_same_gcs(a: str, b: str, same: bool) -> None:
    assert cluster.same_gcs(a, b) is same


def test_an_address_naming_another_ray_than_the_callers_is_refused(monkeypatch) -> None:
    """Ray initialised by the caller (``ray.init()`` before the call): the job runs there, so
    an explicit ``address`` naming another Ray is refused (it was ignored: the job ran on the
    caller's Ray); the same one, or none, is taken."""
    from embgeom_ray.errors import ConfigError

    monkeypatch.setattr(cluster, "_gcs_address", lambda: "192.0.2.2:38829")
    with pytest.raises(ConfigError) as err:
        cluster._check_initialised_ray(cluster.ClusterChoice("127.0.0.1:1", "--address"))
    assert str(err.value) == (
        "Ray is already initialised in this process (its GCS at 192.0.2.2:38829) and --address "
        "127.0.0.1:1 names another Ray: leave the address out to run on the initialised one, "
        "or call ray.shutdown() first"
    )
    for same in (cluster.ClusterChoice("192.0.2.2:38829", "--address"),
                 cluster.ClusterChoice(None, "default")):  # fmt: skip
        assert cluster._check_initialised_ray(same) is None
