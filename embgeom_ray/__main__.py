"""``python -m embgeom_ray COMMAND [options]``: the ``embgeom`` command (:mod:`embgeom_ray.cli`)."""

from .cli import exit_process, main

if __name__ == "__main__":
    exit_process(main())
