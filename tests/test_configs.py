"""Every shipped recipe composes with every device overlay and passes validation."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError

from portatrain.errors import ConfigError
from portatrain.validate import validate
from tests.conftest import ROOT, compose_config

RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
DEVICES = sorted(p.stem for p in (ROOT / "conf" / "device").glob("*.yaml"))
VENDOR_WORDS = ("cuda", "tpu", "neuron", "xla", "inductor", "nccl")


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("device", DEVICES)
def test_every_recipe_composes_on_every_device(recipe: str, device: str) -> None:
    cfg = compose_config([f"recipe={recipe}", f"device={device}"])
    validate(cfg)
    assert cfg.recipe == recipe and cfg.device.type == device


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipes_are_backend_neutral(recipe: str) -> None:
    text = (ROOT / "recipes" / f"{recipe}.yaml").read_text().lower()
    assert not [w for w in VENDOR_WORDS if w in text]


def test_recipe_overrides_the_model_group() -> None:
    assert compose_config(["recipe=llama8b"]).model.flavor == "8b"
    assert compose_config(["recipe=llama8b", "model=llama3_1b"]).model.flavor == "1b"


def test_misspelled_key_is_rejected() -> None:
    with pytest.raises(ConfigCompositionException) as err:
        compose_config(["optim.lrr=1"])
    assert isinstance(err.value.__cause__, ConfigKeyError) or "lrr" in str(err.value)


def test_wrong_type_is_rejected() -> None:
    with pytest.raises(ConfigCompositionException, match="steps"):
        compose_config(["trainer.steps=many"])


def test_validate_lists_every_problem() -> None:
    cfg = compose_config(["data.buckets=[128,64]", "model.flavor=9b", "optim.betas=[0.9]", "device.type=gpu"])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    message = str(err.value)
    for expected in ("device.type='gpu'", "model.flavor='9b'", "data.buckets=[128, 64]", "optim.betas=[0.9]"):
        assert expected in message


def test_sequence_longer_than_rope_table() -> None:
    with pytest.raises(ConfigError, match=r"set model.max_seq_len>=1024"):
        validate(compose_config(["data.seq_len=1024"]))


def test_recipes_dir_is_the_recipe_group() -> None:
    assert (ROOT / "conf" / "recipe").resolve() == (ROOT / "recipes").resolve()
    assert Path(ROOT / "conf" / "recipe" / "debug.yaml").is_file()


def test_unknown_kernel_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"unknown kernel 'flash_attn'"):
        validate(compose_config(["kernels.enabled=[flash_attn]"]))
