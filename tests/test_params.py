"""Typed parameters: every setting says what it means, and the key lists the code checks follow the flags."""

from __future__ import annotations

from dataclasses import fields, make_dataclass

import pytest

from eagle3lib import params, runs
from eagle3lib.generation import online
from eagle3lib.params import DataSection, ParamsError, TrainSection, keys_with, load_params, setting
from eagle3lib.training import train, trainer


def leaf_fields(section: type = params.Params, prefix: str = ""):
    for f in fields(section):
        if params._is_section(f):
            yield from leaf_fields(f.default_factory, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


def test_every_setting_says_what_it_means():
    undocumented = [key for key, f in leaf_fields() if not f.metadata.get("doc")]
    assert not undocumented, f"settings without a doc: {undocumented}"


def test_the_role_lists_are_derived_from_the_flags():
    """A new train setting flagged free on resume and deciding the stand-in joins exactly those lists."""
    fake = ("fake_setting", int, setting(0, "a setting made up for this test", resume_free=True,
                                         decides_stand_in=True, at_least=3))
    extended = make_dataclass("ExtendedTrain", [fake], bases=(TrainSection,))
    assert keys_with(extended, "resume_free") == (*params.RESUME_FREE, "fake_setting")
    assert keys_with(extended, "decides_stand_in") == (*params.STAND_IN_TRAIN_KEYS, "fake_setting")
    assert "fake_setting" not in keys_with(extended, "decides_text")
    # what the code imports is that derivation, not a list of its own
    assert params.RESUME_FREE == keys_with(TrainSection, "resume_free")
    assert params.ONLINE_TEXT_KEYS == keys_with(DataSection, "decides_text")
    assert params.STAND_IN_DATA_KEYS == keys_with(DataSection, "decides_stand_in")
    assert params.STAND_IN_TRAIN_KEYS == keys_with(TrainSection, "decides_stand_in")
    assert trainer.RESUME_FREE is params.RESUME_FREE and online.ONLINE_TEXT_KEYS is params.ONLINE_TEXT_KEYS


def test_a_flagged_minimum_is_checked_by_its_step(monkeypatch):
    fake = ("fake_setting", int, setting(5, "a setting made up for this test", at_least=3))
    extended = make_dataclass("ExtendedTrain", [fake], bases=(TrainSection,))
    monkeypatch.setattr(params.Params.__dataclass_fields__["train"], "default_factory", extended)
    assert params.minimums("train")["fake_setting"] == 3
    settings = {**load_params()["train"], "fake_setting": 2}
    with pytest.raises(ValueError, match="train.fake_setting must be an integer >= 3, got 2"):
        train.check_settings(settings)


def test_value_checks_come_from_the_flags():
    assert params.VALUE_CHECKS == {"run.name": params.check_run_name}
    with pytest.raises(ParamsError, match="a run name is one folder name"):
        load_params(None, ["run.name=a/b"])


def test_each_step_names_a_notebook():
    assert [path.stem for path in runs.notebook_paths()] == list(runs.STEPS)


def test_a_template_switch_mapping_takes_the_recipes_own_keys(tmp_path):
    """data.chat_template_kwargs holds the template's switches, whatever they are called: a recipe sets them,
    overrides add to them; a section's mapping (train.scratch) still refuses a key it does not have."""
    recipe = tmp_path / "thinking.yaml"
    recipe.write_text("data:\n  chat_template_kwargs: {enable_thinking: true}\n")
    assert load_params(recipe)["data"]["chat_template_kwargs"] == {"enable_thinking": True}
    both = load_params(recipe, ["data.chat_template_kwargs.thinking=false"])
    assert both["data"]["chat_template_kwargs"] == {"enable_thinking": True, "thinking": False}
    assert params.FREE_MAPPINGS == ("data.chat_template_kwargs",)
    with pytest.raises(ParamsError, match="'data.chat_template_kwargs' expects dict"):
        load_params(None, ["data.chat_template_kwargs=true"])
    with pytest.raises(ParamsError, match="unknown key 'train.scratch.heads'"):
        load_params(None, ["train.scratch.heads=3"])
