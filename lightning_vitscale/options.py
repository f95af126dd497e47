"""Every ``VitScaleStrategy`` option, documented once: its text is the ``metadata["doc"]`` of the settings field
that holds it (:data:`OPTIONS`). From those texts come the strategy's docstring Args (at import, so
``help(VitScaleStrategy)`` and IDEs show them) and README's options table (:func:`write_readme`; compared by
``tests/unit/test_options_doc.py``)."""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

from lightning_vitscale._utils import documented
from lightning_vitscale.checkpoint.settings import CheckpointSettings
from lightning_vitscale.init.settings import InitSettings
from lightning_vitscale.sharding.checkpointing_settings import CheckpointingPolicy
from lightning_vitscale.sharding.settings import ParallelConfig, ShardingPolicy


@dataclass(frozen=True)
class ProcessGroupSettings:
    """What ``VitScaleStrategy`` passes on to Lightning's process-group setup unchanged."""

    timeout: timedelta = documented(timedelta(minutes=10), (
        "Bound on every collective, so a rank that dies or hangs cannot leave the others waiting forever; also"
        " how long a rank waits before an ``OutsideStepCallError``/``StateDictGatherError`` where the other ranks"
        " may still come (where they went on to a later batch, wait in a collective of the Trainer's such as"
        " ``ModelCheckpoint``'s, or ended, it learns so within seconds)."
    ))
    process_group_backend: str | None = documented(
        None, "``None`` picks NCCL on CUDA and gloo on CPU; any backend name torch knows otherwise."
    )


class Option(NamedTuple):
    """One ``VitScaleStrategy`` keyword argument and the settings field whose ``metadata["doc"]`` documents it."""

    name: str
    settings: type
    field: str

    @property
    def _field(self) -> dataclasses.Field[Any]:
        for f in dataclasses.fields(self.settings):
            if f.name == self.field:
                return f
        raise LookupError(f"option `{self.name}`: {self.settings.__name__} has no field {self.field!r} (options.py)")

    @property
    def doc(self) -> str:
        return str(self._field.metadata["doc"])

    @property
    def default(self) -> object:
        """The option's default: the field's, unless its metadata names the strategy's own (``"default"``)."""
        f = self._field
        if "default" in f.metadata:
            return f.metadata["default"]
        if f.default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        return f.default

    @property
    def where(self) -> str:
        return f"{self.settings.__name__}.{self.field}"


# In the order of VitScaleStrategy's signature.
OPTIONS: tuple[Option, ...] = (
    Option("blocks", ShardingPolicy, "blocks"),
    Option("priority", ParallelConfig, "priority"),
    Option("activation_checkpointing", CheckpointingPolicy, "blocks"),
    Option("memory_budget", CheckpointingPolicy, "memory_budget"),
    Option("reshard_after_forward", ShardingPolicy, "reshard_after_forward"),
    Option("kernels", ParallelConfig, "kernels"),
    Option("sharding", ShardingPolicy, "layout"),
    Option("tensor_parallel", ShardingPolicy, "tensor_parallel"),
    Option("tensor_plan", ShardingPolicy, "tensor_plan"),
    Option("offload", ShardingPolicy, "offload"),
    Option("accumulation", ShardingPolicy, "accumulation"),
    Option("prefetch", ShardingPolicy, "prefetch"),
    Option("blocks_per_unit", ShardingPolicy, "blocks_per_unit"),
    Option("find_unused_parameters", ShardingPolicy, "find_unused_parameters"),
    Option("timeout", ProcessGroupSettings, "timeout"),
    Option("process_group_backend", ProcessGroupSettings, "process_group_backend"),
    Option("state_dict_type", CheckpointSettings, "state_dict_type"),
    Option("init", InitSettings, "mode"),
    Option("auto_resume", CheckpointSettings, "auto_resume"),
    Option("async_save", CheckpointSettings, "async_save"),
)

README = Path(__file__).resolve().parent.parent / "README.md"
TABLE_BEGIN = "<!-- options table: generated from the settings by lightning_vitscale/options.py (write_readme) -->"
TABLE_END = "<!-- end of options table -->"
_WIDTH = 116


def _show(value: object) -> str:
    if isinstance(value, timedelta):
        return f"timedelta(minutes={value.total_seconds() / 60:g})"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def args_section() -> str:
    """The Google-style ``Args:`` section of the strategy's docstring: one entry per option, with its default."""
    out = ["Args:"]
    for option in OPTIONS:
        text = f"{option.name}: {option.doc} Default: ``{_show(option.default)}``."
        first, *rest = textwrap.wrap(text, _WIDTH, initial_indent="    ", subsequent_indent="    ",
                                     break_long_words=False, break_on_hyphens=False)
        out += [first, *("    " + line for line in rest)]
    return "\n".join(out)


def document(cls: type) -> str:
    """``cls``'s own docstring with :func:`args_section` before its ``Example::``."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    head, sep, tail = doc.partition("Example::")
    return f"{head.rstrip()}\n\n{args_section()}\n\n{sep}{tail}" if sep else f"{doc}\n\n{args_section()}\n"


def options_table() -> str:
    """README's options table (Markdown), between its marker comments."""
    rows = ["| option | default | what it does |", "|---|---|---|"]
    for option in OPTIONS:
        doc = re.sub(r":\w+:`(\w+)`", r"`\1`", option.doc).replace("``", "`").replace("|", "\\|")
        rows.append(f"| `{option.name}` | `{_show(option.default)}` | {doc} |")
    return "\n".join([TABLE_BEGIN, *rows, TABLE_END])


def with_options_table(readme: str) -> str:
    """``readme`` with the text between the markers replaced by :func:`options_table`."""
    pattern = re.compile(re.escape(TABLE_BEGIN) + r".*?" + re.escape(TABLE_END), flags=re.S)
    if not pattern.search(readme):
        raise ValueError(f"README has no options table between {TABLE_BEGIN!r} and {TABLE_END!r}.")
    return pattern.sub(lambda _: options_table(), readme, count=1)


REGENERATE = 'python -c "from lightning_vitscale.options import write_readme; write_readme()"'


def write_readme(path: Path = README) -> None:
    """Rewrite README's options table from the settings' texts (the command :data:`REGENERATE` runs)."""
    path.write_text(with_options_table(path.read_text()))
