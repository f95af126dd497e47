"""The strategy stays glue: each hook calls one concern (issue 32), so the file stays short and imports only the
concern subpackages or their sub-rooms' faces (plus ``options``, which writes its docstring, and ``_compat``)."""

import ast
from pathlib import Path

import lightning_vitscale

PACKAGE = Path(lightning_vitscale.__file__).parent
STRATEGY = PACKAGE / "strategy.py"


def test_strategy_is_at_most_300_lines() -> None:
    lines = STRATEGY.read_text().count("\n")
    assert lines <= 300, f"strategy.py has {lines} lines: move the new logic into the concern it belongs to"


def test_every_module_is_at_most_300_lines() -> None:
    """One job per file, ~300 lines at most (the style guide); ``_compat.py`` is the one home of every private torch
    and Lightning name and version gate, and grows with them by design."""
    long = {str(path.relative_to(PACKAGE)): path.read_text().count("\n") for path in PACKAGE.rglob("*.py")}
    over = {name: lines for name, lines in long.items() if lines > 300 and name != "_compat.py"}
    assert not over, f"modules over 300 lines: {over}: split each by the jobs it does"


def test_strategy_imports_only_concern_subpackages() -> None:
    imported = set()
    for node in ast.walk(ast.parse(STRATEGY.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_vitscale"):
            parts = node.module.split(".")
            imported.update([parts[1]] if len(parts) > 1 else [alias.name for alias in node.names])
    subpackages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    not_concerns = imported - subpackages - {"options", "_compat"}
    assert not not_concerns, f"strategy.py imports {sorted(not_concerns)}: import the concern's subpackage instead"
    tree = ast.parse(STRATEGY.read_text())
    modules = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    rooms = PACKAGE.glob("*/*/__init__.py")  # a concern's sub-rooms, each with its own face
    faces = {".".join(("lightning_vitscale", *path.parent.relative_to(PACKAGE).parts)) for path in rooms}
    deep = [name for name in modules if name.startswith("lightning_vitscale.") and name.count(".") > 1
            and name not in faces]
    assert not deep, f"strategy.py reaches inside a concern: {deep}"
