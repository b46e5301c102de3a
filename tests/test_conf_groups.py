"""How the config groups compose: the ViT variants read the one table, a recipe names itself in the
run's config and replaces (not merges) the optimizer it switches, make_shards composes without a model."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from vitpipe.models.registry import VARIANTS

CONF = Path(__file__).resolve().parents[1] / "conf"


def test_a_variant_added_to_the_table_is_a_model_option_with_one_two_line_file(cfg_factory, monkeypatch, tmp_path):
    """conf/model/vit.yaml reads every dimension from VARIANTS: a new row plus `defaults: [vit]` and its name."""
    monkeypatch.setitem(VARIANTS, "vit_test", dict(dim=48, depth=3, num_heads=3, patch_size=2, img_size=12))
    cfg = cfg_factory("model=vit", "model.name=vit_test")  # the base file, named on the command line
    model = OmegaConf.to_container(cfg.model, resolve=True)
    assert {k: model[k] for k in VARIANTS["vit_test"]} == VARIANTS["vit_test"]
    assert cfg.data.img_size == 12  # the data resizes to the variant's size
    from hydra.utils import instantiate

    net = instantiate(cfg.model)
    assert len(net.blocks) == 3 and net.dim == 48 and net.grid_size == (6, 6)


def test_an_unknown_variant_name_is_refused_naming_the_valid_ones(cfg_factory):
    from omegaconf.errors import InterpolationResolutionError

    cfg = cfg_factory("model.name=vit_b61")
    with pytest.raises(InterpolationResolutionError, match=r"unknown model.name='vit_b61'; valid choices: vit_nano"):
        OmegaConf.to_container(cfg.model, resolve=True)


def test_the_run_config_records_which_recipe_applied(cfg_factory):
    assert cfg_factory().recipe == "vit_nano_digits"  # the default run's recipe
    assert cfg_factory("model=vit_b16", "data=cifar10", sub="b16").recipe == "vit_b16_cifar10"
    assert cfg_factory("model=vit_s16", "data=cifar10", sub="none").recipe is None  # no file for the pair
    for f in (CONF / "recipe").glob("*.yaml"):  # each recipe's `recipe:` is its own name
        assert OmegaConf.load(f).recipe == f.stem, f


def test_a_recipe_switching_optimizer_class_must_clear_the_default_node_first(tmp_path):
    """Why conf/recipe/parts/clear_optimizer.yaml exists: Hydra merges a recipe's module.optimizer into
    the default one key by key, even with another _target_ and every key SGD needs, so AdamW's betas
    would stay (and SGD refuse them). A recipe cannot `override /module` instead: Hydra forbids
    overrides in a group chosen by interpolation (`optional recipe: ${model}_${data}`)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException

    (tmp_path / "m").mkdir()
    (tmp_path / "r").mkdir()
    (tmp_path / "top.yaml").write_text("defaults:\n  - _self_\n  - m: a\n  - optional r: ${m}\n")
    header = "# @package _global_\n"
    (tmp_path / "m" / "a.yaml").write_text(header + "opt: {_target_: torch.optim.AdamW, lr: 1.0e-3, betas: [0.9, 0.999]}\n")
    (tmp_path / "m" / "b.yaml").write_text(header + "opt: {_target_: torch.optim.SGD, lr: 0.03}\n")
    sgd = "opt: {_target_: torch.optim.SGD, lr: 0.03, momentum: 0.9}\n"

    def opt(recipe: str):
        (tmp_path / "r" / "a.yaml").write_text(header + recipe)
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
            return OmegaConf.to_container(compose("top").opt)

    assert opt(sgd)["betas"] == [0.9, 0.999]  # merged: AdamW's key survives the switch
    clear = tmp_path / "r" / "clear.yaml"
    clear.write_text(header + "opt: null\n")
    assert opt("defaults:\n  - clear\n  - _self_\n" + sgd) == {"_target_": "torch.optim.SGD", "lr": 0.03,
                                                               "momentum": 0.9}  # fmt: skip
    with pytest.raises(ConfigCompositionException, match="interpolated config group"):
        opt("defaults:\n  - override /m: b\n  - _self_\n")
    GlobalHydra.instance().clear()


@pytest.mark.parametrize("data", ["digits", "cifar10", "fashion_mnist", "synthetic", "imagefolder"])
def test_make_shards_composes_without_a_model(cfg_factory, data):
    """make_shards stores images as they are: no model group, and every classification data config
    resolves (its ${model.*} interpolations are replaced in make_shards.yaml)."""
    cfg = cfg_factory(f"data={data}", "out=/tmp/shards", config_name="make_shards")
    assert "model" not in cfg and "model" not in cfg.hydra.runtime.choices
    resolved = OmegaConf.to_container(cfg.data, resolve=True)
    assert resolved["in_chans"] == resolved["channels"]
