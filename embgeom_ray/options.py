"""What an option group is: a frozen pydantic model, its fields the options, their roles marked.

Each part of the job declares the options it uses, with their defaults, bounds and help, as an
:class:`OptionGroup` beside its code: the exact tables' and the sampled metrics' and the
sample's in :mod:`embgeom_ray.core.options`, an extractor's in :mod:`embgeom_ray.inputs.options`,
the actor pool's in :mod:`embgeom_ray.distributed.options`, the run's own in
:mod:`embgeom_ray.config` (beside the assembly: the driver's package sits above it).
:class:`embgeom_ray.config.JobConfig` is assembled from them by inheritance, so a field keeps
its name as flag (``--max-length``) and YAML key (``max_length``), and the command line is
generated from the groups' fields. A part takes its group
(:meth:`OptionGroup.of` the job's configuration), never the whole configuration.

An option's role is metadata on its field (``json_schema_extra``): :data:`RESULT`,
:data:`SCHEDULING`, :data:`AGREE`, :data:`MERGE`; :func:`options_marked` lists the fields that
carry one. Engine-free: pydantic only, so every layer (the core included) may import it.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

#: marks a field as a result option: its value changes the statistics, so it enters the run
#: fingerprint and the run key of scheduled re-analyses
RESULT = {"result": True}
#: marks a field as a scheduling option: it decides how a run is scheduled (where, how many
#: processes, how much memory), never what its statistics or tables hold
SCHEDULING = {"scheduling": True}
#: marks a field that runs must agree on to be merged (``jobs.merge`` refuses runs that differ)
AGREE = {"agree": True}
#: marks a field as an option of ``jobs.merge`` too (its command line is generated from these)
MERGE = {"merge": True}


class OptionGroup(BaseModel):
    """Options of one part of the job: validated, immutable, no unknown keys.

    A group's ``title`` (its ``model_config``) heads its section of ``--help``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def of(cls: type[_G], options: BaseModel) -> _G:
        """This group's options taken from ``options`` (the job's configuration, or any model
        that holds these fields): a model of this group's fields only."""
        return cls(**{name: getattr(options, name) for name in cls.model_fields})


_G = TypeVar("_G", bound=OptionGroup)


def own_fields(group: type[BaseModel]) -> tuple[str, ...]:
    """The fields ``group`` declares itself (those of its base groups left out), in order."""
    inherited = {name for base in group.__bases__ for name in getattr(base, "model_fields", {})}
    return tuple(name for name in group.model_fields if name not in inherited)


def options_marked(model: type[BaseModel], marker: dict[str, Any]) -> tuple[str, ...]:
    """The fields of ``model`` (in order) whose ``json_schema_extra`` holds ``marker``."""
    (key,) = marker
    return tuple(
        name
        for name, field in model.model_fields.items()
        if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get(key)
    )
