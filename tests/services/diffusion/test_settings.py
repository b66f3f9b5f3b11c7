"""Diffusion settings as they arrive from a config file or from the environment."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.diffusion.settings import DiffusionSettings


def test_models_may_come_as_a_list_or_as_comma_separated_text():
    assert DiffusionSettings(models=["digits"]).models == ["digits"]
    assert DiffusionSettings.model_validate({"models": "digits, terrain"}).models == [
        "digits",
        "terrain",
    ]
    with pytest.raises(ValidationError):
        DiffusionSettings.model_validate({"models": "digits,sdxl"})
