"""The run lock's conditional requests (embgeom_ray/runs/object_lock.py: ``PutObject`` and
``DeleteObject`` with ``IfMatch``) need a botocore that knows the parameter: an older one
refuses it before sending (``ParamValidationError: Unknown parameter in input: "IfMatch"``).
Tried on each release: ``IfMatch`` is in DeleteObject's model from botocore 1.35.68, in
PutObject's from 1.35.69; pyproject.toml's floor must be at least that."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[2]
#: the first botocore whose S3 model has IfMatch on both PutObject and DeleteObject
IF_MATCH_BOTOCORE = Version("1.35.69")


def _botocore_floor(requirements: list[str]) -> Version | None:
    for line in requirements:
        req = Requirement(line)
        if req.name == "botocore":
            return min((Version(s.version) for s in req.specifier if s.operator == ">="),
                       default=None)  # fmt: skip
    return None


@pytest.mark.parametrize("extra", ["s3", "test"])
def test_the_s3_extras_declare_a_botocore_that_knows_if_match(extra) -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(Requirement(r).name == "s3fs" for r in extras[extra])
    floor = _botocore_floor(extras[extra])
    assert floor is not None and floor >= IF_MATCH_BOTOCORE, (extra, floor)


def test_the_installed_botocore_validates_the_locks_requests() -> None:
    """What the lock sends passes botocore's validation (the installed one, within the floor)."""
    import botocore
    import botocore.session
    from botocore.validate import ParamValidator

    assert Version(botocore.__version__) >= IF_MATCH_BOTOCORE
    model = botocore.session.get_session().get_service_model("s3")
    validator = ParamValidator()
    for operation, params in (("DeleteObject", {"Bucket": "b", "Key": "k", "IfMatch": '"e"'}),
                              ("PutObject", {"Bucket": "b", "Key": "k", "Body": b"", "IfMatch": '"e"'})):  # fmt: skip
        report = validator.validate(params, model.operation_model(operation).input_shape)
        assert not report.has_errors(), report.generate_report()
