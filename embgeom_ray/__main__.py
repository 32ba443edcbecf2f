"""``python -m embgeom_ray COMMAND [options]``: the ``embgeom`` command (:mod:`embgeom_ray.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
