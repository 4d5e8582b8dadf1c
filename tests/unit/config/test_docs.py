"""Every config field is described, and docs/configuration.md is the schema as the code has it."""

from cluster.config.docs import DOC, render, undescribed


def test_every_config_field_has_a_description():
    assert undescribed() == []


def test_the_configuration_page_is_generated_from_the_schema():
    assert DOC.read_text() == render(), "docs/configuration.md is out of date: run `python -m cluster.config.docs`"


def test_the_fixed_bounds_named_on_the_page_are_the_code_s():
    """A bound that is a number is named in docs/configuration.md, with its value."""
    import importlib

    from cluster.config.docs import FIXED_BOUNDS

    for name, value, _ in FIXED_BOUNDS:
        module, constant = name.rsplit(".", 1)
        assert getattr(importlib.import_module(module), constant) == value, name
