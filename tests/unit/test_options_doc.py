"""Each VitScaleStrategy option is documented once (its settings field's ``metadata["doc"]``): the signature, the
docstring and README's options table must agree with those texts.

Mutations seen failing: a new keyword in ``__init__`` without an ``Option``; an ``Args:`` entry written by hand in
the class docstring; one word of README's table edited by hand; a default changed in the signature only."""

from __future__ import annotations

import dataclasses
import inspect

from lightning_vitscale import VitScaleStrategy, options
from lightning_vitscale.options import OPTIONS, README, args_section, options_table, with_options_table

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
