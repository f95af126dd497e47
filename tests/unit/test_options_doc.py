"""Each VitScaleStrategy option is documented once (its settings field's ``metadata["doc"]``): the signature, the
docstring and README's options table must agree with those texts.

Mutations seen failing: a new keyword in ``__init__`` without an ``Option``; an ``Args:`` entry written by hand in
the class docstring; one word of README's table edited by hand; a default changed in the signature only; docs/
sharding.md's "The default, `None`," of ``prefetch`` changed to `1`; an error message restating an option's text by
hand (``blocks_per_unit``'s once contradicted its field); docs/init.md's link to README's table removed."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from lightning_vitscale import VitScaleStrategy, options
from lightning_vitscale.options import OPTIONS, README, _show, args_section, options_table, with_options_table
from lightning_vitscale.sharding.settings import ShardingPolicy

REGENERATE = f"edit the settings field's metadata doc, then regenerate README's table: {options.REGENERATE}"


def _parameters() -> dict[str, inspect.Parameter]:
    params = dict(inspect.signature(VitScaleStrategy.__init__).parameters)
    params.pop("self")
    return params


def test_every_parameter_has_one_documented_option_and_the_same_default():
    params = _parameters()
    names = [option.name for option in OPTIONS]
    assert names == list(params), (
        f"VitScaleStrategy.__init__ takes {list(params)}, lightning_vitscale/options.py documents {names}:"
        " add (or remove) the Option and its settings field's metadata doc, in signature order."
    )
    for option in OPTIONS:
        assert params[option.name].default == option.default, (
            f"`{option.name}` defaults to {params[option.name].default!r} in the signature but {option.default!r}"
            f" in {option.where}."
        )


def test_every_option_text_lives_in_its_settings_field():
    for option in OPTIONS:
        assert dataclasses.is_dataclass(option.settings), option.where
        assert option.doc.strip() and option.doc == option.doc.strip(), f"{option.where} has no metadata doc"


def test_docstring_args_are_generated_from_the_settings():
    doc = VitScaleStrategy.__doc__ or ""
    assert args_section() in doc, "VitScaleStrategy.__doc__ lacks the generated Args (options.document)"
    assert doc.count("Args:") == 1, "an Args section written by hand in strategy.py: the text lives in the settings"
    for option in OPTIONS:
        assert f"\n    {option.name}: " in doc, option.name


def test_readme_options_table_is_the_rendered_one():
    readme = README.read_text()
    assert options_table() in readme, f"README.md's options table differs from the settings' texts: {REGENERATE}"
    assert with_options_table(readme) == readme, REGENERATE


DOCS = README.parent / "docs"
# How docs/ states an option's default: `name=V` (default), `VitScaleStrategy(name=X)`** (default `V`), `name`
# (default `V`...), "The default, `name=V`", `name=V`, the default; "The default, `V`," in a paragraph about `name=`.
_STATED = [
    re.compile(r"`(?P<name>\w+)=(?P<value>[^`]+)`,? \(?(?:the )?default\b"),
    re.compile(r"`(?:VitScaleStrategy\()?(?P<name>\w+)(?:=[^`]*)?`\**,? \(default `(?P<value>[^`]+)`"),
    re.compile(r"[Tt]he default, `(?P<name>\w+)=(?P<value>[^`]+)`"),
]
_UNNAMED = re.compile(r"[Tt]he default, `(?P<value>[^`=]+)`,")
_TABLE_HEAD = re.compile(r"^\| `(?P<name>\w+)=` \|", re.M)
_TABLE_DEFAULT = re.compile(r"^\| `(?P<value>[^`]+)` \(default\) \|", re.M)


def stated_defaults(text: str) -> list[tuple[str, str]]:
    """Every (option, value) a Markdown text states as the option's default."""
    names = {option.name for option in OPTIONS}
    found = []
    for paragraph in re.split(r"\n\s*\n", text):
        found += [(m["name"], m["value"]) for p in _STATED for m in p.finditer(paragraph) if m["name"] in names]
        named = [m[1] for m in re.finditer(r"`(\w+)=", paragraph) if m[1] in names]
        found += [(named[0], m["value"]) for m in _UNNAMED.finditer(paragraph) if named]
        head = _TABLE_HEAD.search(paragraph)  # tables of other things' choices (export formats) have no `name=`
        found += [(head["name"], m["value"]) for m in _TABLE_DEFAULT.finditer(paragraph) if head]
    return found


def test_docs_state_each_options_default_as_the_settings_do():
    defaults = {option.name: _show(option.default) for option in OPTIONS}
    stated = {page.name: stated_defaults(page.read_text()) for page in sorted(DOCS.glob("*.md"))}
    wrong = [(page, name, value) for page, pairs in stated.items() for name, value in pairs
             if defaults[name] != value]
    assert not wrong, (
        f"docs/ states defaults the settings do not have (page, option, stated): {wrong}; the settings say"
        f" {defaults}. Correct the page, or drop the statement and link README's options table."
    )
    covered = {name for pairs in stated.values() for name, _ in pairs}
    assert {"prefetch", "blocks_per_unit", "accumulation", "auto_resume", "init", "kernels", "sharding"} <= covered


def test_docs_pages_naming_an_option_link_the_options_table():
    names = {option.name for option in OPTIONS}
    unlinked = [page.name for page in sorted(DOCS.glob("*.md"))
                if names & set(re.findall(r"`(\w+)=", page.read_text()))
                and "../README.md#options" not in page.read_text()]
    assert not unlinked, f"docs/ pages naming strategy options without linking README's options table: {unlinked}"


def test_a_changed_default_in_the_docs_is_caught():
    text = (DOCS / "sharding.md").read_text()
    assert ("prefetch", "None") in stated_defaults(text)
    assert ("prefetch", "1") in stated_defaults(text.replace("The default, `None`,", "The default, `1`,"))


@pytest.mark.parametrize(("name", "value"), [("blocks_per_unit", 0), ("prefetch", -1), ("accumulation", "x"),
                                             ("offload", "x")])
def test_an_invalid_value_is_refused_with_the_options_own_text(name, value):
    doc = next(option.doc for option in OPTIONS if option.name == name)
    with pytest.raises(ValueError) as error:
        ShardingPolicy(**{name: value})
    assert str(error.value).endswith(f"`{name}`: {doc}")
