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


def test_a_section_made_by_a_factory_shows_the_factorys_values():
    """critic.optimizer and train_rm's training.optimizer are made with lr 1e-5, not OptimizerConfig's 1e-6: the
    reference shows what a recipe that leaves them out gets."""
    from megarl.config import build_config

    ref = reference()
    assert build_config({"model": {"hf_path": "m"}, "data": {"train_path": "x"}}).critic.optimizer.lr == 1e-5
    assert "| `critic.optimizer.lr` | float | `1e-05` |" in ref
    assert "| `training.optimizer.lr` | float | `1e-05` |" in ref
    assert "| `actor.optimizer.lr` | float | `1e-06` |" in ref
