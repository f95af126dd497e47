"""Generated example data written once to a cache folder, so it is then read like a user's files.

Shared by the detection (COCO folder of PNGs) and video (mp4 class folders) defaults: where the cache lives, a
folder name that changes with the generation parameters, and an atomic write that concurrent ranks or nodes
sharing the cache can race on safely.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lightning-vitscale/examples`` (``~/.cache/...`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lightning-vitscale" / "examples"


def cache_root(cache_dir: str | None, name: str, params: dict[str, Any]) -> Path:
    """``cache_dir/<name>-<hash>``: the hash changes whenever a generation parameter does (no stale data)."""
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
    return (Path(cache_dir) if cache_dir else default_cache_dir()) / f"{name}-{digest}"


def write_once(root: Path, writer: Any) -> None:
    """Run ``writer(tmp_dir)`` and move the result to ``root`` atomically; skip if ``root`` exists.

    Ranks or nodes sharing the cache may race: each writes its own temporary folder, the first rename
    wins and the others discard theirs, so a reader never sees a half-written folder.
    """
    if root.exists():
        return
    tmp = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    writer(tmp)
    try:
        tmp.rename(root)
    except OSError:  # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)


class WrittenOnce:
    """Mixin for a file-reading LightningDataModule whose default data is generated: ``_write(tmp)`` writes it.

    ``prepare_data`` (Lightning runs it on one rank per node, before the others read) writes the folder if it
    is missing; ``setup`` does the same first, for callers that skip ``prepare_data``, then reads as usual.
    """

    root: Path

    def _write(self, tmp: Path) -> None:
        raise NotImplementedError

    def prepare_data(self) -> None:
        write_once(self.root, self._write)

    def setup(self, stage: str | None = None) -> None:
        write_once(self.root, self._write)
        super().setup(stage)  # type: ignore[misc]
