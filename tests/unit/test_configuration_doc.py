"""docs/configuration.md is generated from the settings and never drifts from them."""

from __future__ import annotations

from cli.configuration_doc import DOC, render
from runtime.settings import ENV_PREFIX, Settings


def test_the_committed_reference_is_what_the_settings_say() -> None:
    assert DOC.read_text(encoding="utf-8") == render()


def test_every_setting_is_documented_with_a_description() -> None:
    text = render()
    for name, field in Settings.model_fields.items():
        assert field.description, f"{name} has no description"
        assert f"`{ENV_PREFIX}{name.upper()}`" in text
