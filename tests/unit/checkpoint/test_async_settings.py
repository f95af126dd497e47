"""VitScaleStrategy(async_save=...) is checked when the strategy is made, like every other option."""

from __future__ import annotations

import pytest

from lightning_vitscale import VitScaleStrategy


def test_async_save_with_the_full_format_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="state_dict_type='sharded'.*async_save=False"):
        VitScaleStrategy(async_save=True, state_dict_type="full")
    strategy = VitScaleStrategy(async_save=True)
    with pytest.raises(ValueError, match="cannot be staged per rank"):
        strategy.state_dict_type = "full"  # the setter keeps async_save, so it is checked again


def test_async_save_must_be_a_bool():
    with pytest.raises(TypeError, match="`async_save` must be True or False"):
        VitScaleStrategy(async_save="yes")  # type: ignore[arg-type]
    assert VitScaleStrategy(async_save=True).checkpoint_settings.async_save is True
