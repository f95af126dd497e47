"""Every private torch/Lightning name the package uses is listed in ``_compat.PRIVATE_NAMES``, exists in the
installed torch/Lightning, and is used nowhere else (mutations tried: a misspelt entry fails the first test with its
name and the versions; a new `torch._x` import in kernels/, or `module._buffers` in init/, fails the third; a
private name added to _compat without an entry fails the second)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import lightning
import pytest
import torch
from packaging.specifiers import SpecifierSet

from lightning_vitscale import _compat

PACKAGE = Path(_compat.__file__).parent
PRIVATE = {name.rsplit(".", 1)[-1] for name in _compat.PRIVATE_NAMES}
# A subclass defines these itself (an override), so they appear where the subclass is.
OVERRIDDEN = {name.rsplit(".", 1)[-1] for name, why in _compat.PRIVATE_NAMES.items() if why.startswith("overridden")}


def _resolve(name: str) -> None:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
            break
        except ImportError:
            continue
    for i, attr in enumerate(parts[cut:], cut):
        if hasattr(owner, attr):
            owner = getattr(owner, attr)
        elif i == len(parts) - 1 and re.search(rf"\.{attr}\b *[:=]|[\"']{attr}[\"']", _source(owner)):
            return  # an instance attribute, set in the code of the class (or function) that owns it
        else:
            raise AttributeError(".".join(parts[: i + 1]))


def _source(owner: object) -> str:
    """The code of a function, or of a class and its bases: where an instance attribute is assigned."""
    if not inspect.isclass(owner):
        return inspect.getsource(owner) if inspect.isfunction(owner) else ""
    return "".join(inspect.getsource(c) for c in owner.__mro__ if c.__module__.startswith(("torch", "lightning")))


@pytest.mark.parametrize("name", sorted(_compat.PRIVATE_NAMES))
def test_each_private_name_exists_in_the_installed_torch_and_lightning(name):
    if name.startswith("timm."):
        pytest.importorskip("timm")
    if name in _compat.PRIVATE_NAMES_TORCH and _compat.TORCH_VERSION not in SpecifierSet(
        _compat.PRIVATE_NAMES_TORCH[name]
    ):
        pytest.skip(f"{name} exists on torch{_compat.PRIVATE_NAMES_TORCH[name]} only")
    try:
        _resolve(name)
    except (ImportError, AttributeError, OSError, TypeError) as error:
        pytest.fail(
            f"{name} ({_compat.PRIVATE_NAMES[name]}) is missing from torch {torch.__version__} / lightning"
            f" {lightning.__version__} ({error!r}): update lightning_vitscale/_compat.py for this version"
        )


def _private_words(path: Path) -> tuple[set[str], set[str]]:
    """Private names ``path`` imports from torch/Lightning (or reads off ``torch``), and every private attribute
    name it reads (``x._name``, ``getattr(x, "_name")``)."""
    imported: set[str] = set()
    other: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("torch", "lightning"):
            imported |= {*node.module.split("."), *(alias.name for alias in node.names)}  # type: ignore[union-attr]
        elif isinstance(node, ast.Import):
            imported |= {p for a in node.names if a.name.startswith(("torch", "lightning")) for p in a.name.split(".")}
        elif isinstance(node, ast.Attribute):
            (imported if isinstance(node.value, ast.Name) and node.value.id == "torch" else other).add(node.attr)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr"):
            other |= {a.value for a in node.args[1:2] if isinstance(a, ast.Constant) and isinstance(a.value, str)}

    def private(words: set[str]) -> set[str]:
        return {w for w in words if w.startswith("_") and not w.startswith("__")}

    return private(imported), private(other)


def test_compat_lists_every_private_name_it_uses_and_no_other():
    used = set().union(*_private_words(PACKAGE / "_compat.py"))
    listed = {part for name in _compat.PRIVATE_NAMES for part in name.split(".")}
    unlisted = sorted(used - listed)
    assert not unlisted, f"private names in _compat.py with no PRIVATE_NAMES entry saying what they are for: {unlisted}"
    everywhere = "".join(path.read_text() for path in PACKAGE.rglob("*.py"))
    stale = sorted(name for name in PRIVATE if not re.search(rf"\b{name}\b", everywhere))
    assert not stale, f"PRIVATE_NAMES entries the package no longer uses: {stale}"


def test_no_module_but_compat_uses_a_private_torch_or_lightning_name():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != PACKAGE / "_compat.py":
            imported, other = _private_words(path)
            if names := imported | (other & (PRIVATE - OVERRIDDEN)):
                found[path.relative_to(PACKAGE).as_posix()] = sorted(names)
    assert not found, f"private torch/Lightning names outside lightning_vitscale/_compat.py (use it): {found}"


def test_fit_impl_takes_ckpt_path():
    """``with_ckpt_path`` rewrites the ``ckpt_path`` that ``Trainer.fit`` hands the launcher; one without it would
    leave ``ckpt_path="last"`` to Lightning's resolution (mutation tried: a ``_fit_impl`` without it patched in)."""
    from lightning.pytorch import Trainer

    parameters = inspect.signature(Trainer._fit_impl).parameters
    assert "ckpt_path" in parameters, (
        f"Trainer._fit_impl of lightning {lightning.__version__} takes no `ckpt_path`: update"
        " lightning_vitscale/_compat.py's with_ckpt_path for this version"
    )


def test_fsdp_param_groups_reads_torch_2_11s_single_group():
    """The GPU image's torch (2.11) holds one optional group (``_fsdp_param_group``), later ones a list (mutation
    tried: the 2.11 branch removed fails the first two asserts with an AttributeError)."""
    from types import SimpleNamespace

    def unit(**state: object) -> SimpleNamespace:
        return SimpleNamespace(_get_fsdp_state=lambda: SimpleNamespace(**state))

    group = object()
    assert _compat.fsdp_param_groups(unit(_fsdp_param_group=group)) == [group]  # type: ignore[arg-type]
    assert _compat.fsdp_param_groups(unit(_fsdp_param_group=None)) == []  # type: ignore[arg-type]
    assert _compat.fsdp_param_groups(unit(_fsdp_param_groups=[group, group])) == [group, group]  # type: ignore[arg-type]


def test_keep_storage_data_records_the_written_files_on_the_returned_metadata():
    """torch 2.11's ``FileSystemWriter.finish`` fills a copy of the metadata, so the object ``dcp.save`` returns
    would list no file (checkpoint/save.py reads it); the wrapper records them on the caller's object (mutation
    tried: the wrapper returning the writer unchanged fails)."""
    from types import SimpleNamespace

    seen = []

    class CopyingWriter:  # torch 2.11's behaviour: the metadata it is given is not the one it writes
        def finish(self, metadata: object, results: object) -> None:
            seen.append((metadata, results))

    metadata = SimpleNamespace(storage_data=None)
    results = [[SimpleNamespace(index="a", storage_data="shard0")], [SimpleNamespace(index="b", storage_data="shard1")]]
    writer = _compat.keep_storage_data(CopyingWriter())
    writer.finish(metadata=metadata, results=results)
    assert metadata.storage_data == {"a": "shard0", "b": "shard1"}
    assert seen == [(metadata, results)]


def test_the_gpu_images_torch_imports_with_a_warning_and_an_older_one_is_refused():
    """The lent GPU machine has torch 2.11 preinstalled and no network (the device tool's README): a gate at the
    tested floor (2.14) made every part of a GPU run fail at import, one session's whole GPU time (mutation tried:
    TORCH_API_MIN = 2.14 fails the first assert)."""
    assert "below 2.14" in _compat.torch_below_floor("2.11.0+cu130")
    assert _compat.torch_below_floor("2.14.1+cu130") is None
    with pytest.raises(ImportError, match=r"needs torch>=2.11; found 2.10.0"):
        _compat.torch_below_floor("2.10.0")
