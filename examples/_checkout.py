"""Lets ``python examples/<task>.py`` import the ``examples`` package from a source checkout.

Python puts only the script's own folder on ``sys.path``; the scripts, and the ``class_path`` entries of their
configs, name classes as ``examples.models...``, so the checkout root must be importable as well. The scripts
import this module only when run as a file; ``python -m examples.<task>`` and the tests need nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(1, _ROOT)  # after the script's folder, before site-packages
