"""Bytes in binary units, as the plan, the refusals and the peaks lines write them.

A leaf of :mod:`embgeom_ray.sizing`: the formulas (:mod:`.formulas`) and the sampled stage's
tasks (:mod:`.sampled_tasks`, which the formulas' :class:`~.formulas.Shape` holds) both
format their numbers with :func:`gib`, and neither may import the other for it."""

from __future__ import annotations

KiB, MiB, GiB = 2**10, 2**20, 2**30


def gib(n: float | None) -> str:
    """``n`` bytes in GiB (MiB below 1 GiB), for messages and the plan."""
    if n is None:
        return "unbounded"
    if abs(n) < KiB:
        return f"{n:,.0f} B"
    if abs(n) < MiB:
        return f"{n / KiB:,.0f} KiB"
    if abs(n) < GiB:
        return f"{n / MiB:,.0f} MiB"
    return f"{n / GiB:,.1f} GiB"
