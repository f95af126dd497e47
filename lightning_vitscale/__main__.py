"""``python -m lightning_vitscale``: see :mod:`lightning_vitscale.cli`."""

import sys

from lightning_vitscale.cli import main

if __name__ == "__main__":
    sys.exit(main())
