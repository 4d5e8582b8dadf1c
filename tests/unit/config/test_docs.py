"""Every config field is described, and docs/configuration.md is the schema as the code has it."""

from cluster.config.docs import DOC, render, undescribed


def test_every_config_field_has_a_description():
    assert undescribed() == []


def test_the_configuration_page_is_generated_from_the_schema():
    assert DOC.read_text() == render(), "docs/configuration.md is out of date: run `python -m cluster.config.docs`"
