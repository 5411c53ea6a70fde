"""docs/configuration.md's configuration reference is generated from the config dataclasses and must stay current."""

import dataclasses

from megarl.config import Config
from megarl.config.reference import END, REFERENCE_PAGE, START, reference, updated_page


def test_docs_config_reference_is_current():
    text = REFERENCE_PAGE.read_text()
    assert START in text and END in text
    assert updated_page(text) == text, "run `python -m megarl.config.reference --update`"


def test_reference_lists_every_field_with_its_docstring():
    ref = reference()
    for section in dataclasses.fields(Config):
        assert f"#### `{section.name}`" in ref
    assert "`actor.optimizer.lr`" in ref and "Peak learning rate." in ref
    assert "| `model.hf_path` | str | **required** |" in ref
