"""Task kinds (vitpipe.kinds): the registry is the one list, and a kind is chosen the same way from a
config as from the config a checkpoint stores."""

import pytest
import torch
from omegaconf import OmegaConf

from vitpipe.errors import ConfigError
from vitpipe.kinds import KINDS, kind_named, kind_of, kind_of_checkpoint
from vitpipe.kinds.registry import TASKS, classifier_kind

ROOT_CONF = __import__("pathlib").Path(__file__).resolve().parents[1] / "conf" / "module"


@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_round_trips_config_kind_stored_config_kind(name):
    kind = kind_named(name)
    assert kind.name == name
    cfg = OmegaConf.create({"module": {**kind.module_config(), "lr": 1e-3}})  # a composed config
    assert kind_of(cfg) is kind
    stored = {"module": OmegaConf.to_container(cfg.module)}  # what train stores in a checkpoint
    assert kind_of_checkpoint({"vitpipe_config": stored, "state_dict": {}}) is kind
    assert kind_of_checkpoint(stored) is kind


@pytest.mark.parametrize("group,expected", [("classifier", "multiclass"), ("captioner", "captioning"), ("mae", "mae")])
def test_the_shipped_module_groups_choose_their_kind(group, expected):
    loaded = OmegaConf.load(ROOT_CONF / f"{group}.yaml")
    cfg = loaded if "module" in loaded else OmegaConf.create({"module": loaded})  # mae.yaml is @package _global_
    assert kind_of(cfg).name == expected
    cfg.module.task = "multilabel"  # what a user types: module.task=multilabel
    if group == "classifier":
        assert kind_of(cfg).name == "multilabel"


def test_the_module_class_chooses_not_its_import_path():
    # older runs store the classifier under its module path; the same class, the same kind
    assert kind_of({"module": {"_target_": "vitpipe.lit.classifier.ImageClassifier"}}).name == "multiclass"


def test_unknown_kinds_are_one_line_errors_or_none():
    with pytest.raises(ConfigError, match="module.task='bogus'; valid choices: multiclass, multilabel"):
        classifier_kind("bogus")
    with pytest.raises(ConfigError, match="trains no known task"):
        kind_of({"module": {"_target_": "vitpipe.lit.ImageClassifier", "task": "bogus"}})
    with pytest.raises(ConfigError, match="no task kind 'bogus'"):
        kind_named("bogus")
    assert kind_of_checkpoint({"state_dict": {}}) is None
    assert kind_of_checkpoint({"vitpipe_config": {"module": {"_target_": "os.system"}}}) is None


def test_classifier_kinds_differ_in_probabilities_and_losses():
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    assert TASKS == ("multiclass", "multilabel")
    assert torch.allclose(KINDS["multiclass"].probabilities(logits).sum(-1), torch.ones(1))
    assert torch.allclose(KINDS["multilabel"].probabilities(logits), logits.sigmoid())
    assert KINDS["multiclass"].eval_loss(logits, torch.tensor([0])) < KINDS["multiclass"].eval_loss(logits, torch.tensor([1]))
    multilabel = KINDS["multilabel"]
    assert multilabel.eval_loss(logits, torch.tensor([[1, 0, 1]])) < multilabel.eval_loss(logits, torch.tensor([[0, 1, 0]]))
    for name in ("captioning", "mae"):
        assert not KINDS[name].classifies
        with pytest.raises(TypeError, match="no class probabilities"):
            KINDS[name].probabilities(logits)
    assert KINDS["captioning"].generates and not KINDS["multiclass"].generates
