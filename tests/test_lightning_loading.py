"""Lightning's own loading and the variant table.

- ``<Module>.load_from_checkpoint(path)``, the way Lightning documents reloading a module, works on every
  vitpipe module (classifier: plain, EMA, multi-label, distillation; MAE; captioner): the network is rebuilt
  from the stored config through vitpipe's builders (allow-list, ``weights_only=True``), every weight loaded.
  ``vitpipe.load_run(path)`` gives a stored run's module and data module for ``Trainer.test``.
- A variant name means one model: ``create_model(name)`` builds what ``model=<name>`` builds.
"""

from __future__ import annotations

import csv
import functools
import inspect
import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from conftest import make_cfg
from hydra.utils import instantiate
from omegaconf import OmegaConf
from PIL import Image
from tiny_checkpoints import checkpoint, hostile
from user_shell import SHORT_TRAIN, fresh_checkout, run, run_dir_of

import vitpipe
from vitpipe.errors import ConfigError
from vitpipe.lit import CaptionModule, ImageClassifier
from vitpipe.lit.mae import MAEModule
from vitpipe.models import registry
from vitpipe.models.mae import MaskedAutoencoderViT
from vitpipe.models.vit import ViT

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# ---------------------------------------------------------------- one variant table


def _recorded(builder):
    """A stand-in for ``builder`` (ViT or MaskedAutoencoderViT) that records every argument it is called with,
    defaults filled in, and builds nothing (vit_h14 is 632M parameters)."""
    calls = []

    @functools.wraps(builder)  # keeps its signature: the registry reads the defaults from it
    def build(**kwargs):
        bound = inspect.signature(builder).bind(**kwargs)
        bound.apply_defaults()
        calls.append(dict(bound.arguments))
        return torch.nn.Identity()

    return build, calls


VARIANT_NAMES = [*registry.VARIANTS, *registry.MAE_VARIANTS]


@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_a_variant_name_builds_one_model_in_python_and_on_the_command_line(name, cfg_factory, monkeypatch):
    """``create_model(name)`` (``create_mae`` for MAE names) and ``model=<name>`` call the network's constructor
    with the same arguments, every one of them: the values a data set sets (channels, classes) passed alike."""
    mae = name in registry.MAE_VARIANTS
    cls = MaskedAutoencoderViT if mae else ViT
    build, calls = _recorded(cls)
    monkeypatch.setattr(registry, cls.__name__, build)
    cfg = cfg_factory(f"model={name}", *(["module=mae"] if mae else []))
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    instantiate(cfg.model)  # what train builds for model=<name>
    from_data = {"in_chans": model_cfg["in_chans"]} if mae else \
        {"in_chans": model_cfg["in_chans"], "num_classes": model_cfg["num_classes"]}
    (registry.create_mae if mae else registry.create_model)(name, **from_data)  # what Python builds
    command_line, python = calls
    assert python == command_line, {k: (python[k], command_line[k]) for k in python if python[k] != command_line[k]}


@pytest.mark.parametrize("name", ["vit_nano", "vit_micro", "vit_ti4", "mae_vit_nano"])
def test_small_variants_have_the_same_weights_in_python_and_on_the_command_line(name, cfg_factory):
    """The same state-dict keys and shapes (and the same positional encoding) both ways."""
    mae = name in registry.MAE_VARIANTS
    cfg = cfg_factory(f"model={name}", *(["module=mae"] if mae else []))
    cli = instantiate(cfg.model)
    py = registry.create_mae(name, in_chans=cfg.model.in_chans) if mae else \
        vitpipe.create_model(name, in_chans=cfg.model.in_chans, num_classes=cfg.model.num_classes)
    assert {k: v.shape for k, v in py.state_dict().items()} == {k: v.shape for k, v in cli.state_dict().items()}
    assert type(py.pos_embed) is type(cli.pos_embed)


def test_vit_nano_in_python_is_the_sincos2d_model_the_default_run_trains():
    net = vitpipe.create_model("vit_nano", num_classes=10, in_chans=1)
    assert type(net.pos_embed).__name__ == "SinCos2DPosEmbed"
    assert not any(k.startswith("pos_embed") for k in net.state_dict())  # fixed: nothing to learn or load


# ---------------------------------------------------------------- load_from_checkpoint on every module


# kind -> (module class, overrides); debug=fast shrinks each network to one 32-wide block
KINDS = {
    "ema": (ImageClassifier, ["module.ema_decay=0.5"]),
    "distill": (ImageClassifier, ["model.dist_token=true", "module.distill.type=hard"]),  # + teacher below
    "mae": (MAEModule, ["model=mae_vit_nano", "module=mae", "module.mask_ratio=0.5"]),
    "multilabel": (ImageClassifier, ["data=imagefolder", "data.labels=labels.csv", "module.task=multilabel",
                                     "module.threshold=0.3"]),  # + data.root below
}
LABELS = ["img/0.png,cat;dog,train", "img/1.png,dog,train", "img/2.png,owl;cat,train", "img/3.png,owl,val",
          "img/4.png,cat,val", "img/5.png,dog;owl,test"]


def _labelled_folder(root: Path) -> Path:
    """root/img/0..5.png (8 x 8 RGB) and root/labels.csv giving each a set of cat, dog, owl."""
    (root / "img").mkdir(parents=True)
    for i in range(6):
        Image.fromarray(np.full((8, 8, 3), 30 * i, dtype=np.uint8)).save(root / "img" / f"{i}.png")
    (root / "labels.csv").write_text("\n".join(["path,labels,split", *LABELS]) + "\n")
    return root


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """kind -> a checkpoint as a training run stores it (state_dict, resolved config, class names; no
    hyper_parameters key, as in a checkpoint written before load_from_checkpoint worked), random weights."""
    from vitpipe.run.build import build_from_config

    base = tmp_path_factory.mktemp("reload")
    made = {"classifier": checkpoint("sincos2d", base), "captioner": checkpoint("captioner", base)}
    for kind, (_, overrides) in KINDS.items():
        extra = []
        if kind == "distill":
            extra = [f"module.distill.teacher={made['classifier']}"]
        if kind == "multilabel":
            extra = [f"data.root={_labelled_folder(base / 'labelled')}"]
        cfg = make_cfg(base / kind, ["debug=fast", "logger=none", *overrides, *extra])
        dm, net, module = build_from_config(cfg)
        torch.manual_seed(0)
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.normal_(mean=1.0 if "norm" in name and name.endswith("weight") else 0.0, std=0.2)
        saved = OmegaConf.to_container(cfg, resolve=True)
        saved.pop("hydra", None)
        path = base / kind / "run" / "checkpoints" / "epoch_000.ckpt"
        path.parent.mkdir(parents=True)
        torch.save({"state_dict": module.state_dict(), "vitpipe_config": saved,
                    "class_names": getattr(dm, "class_names", None)}, path)
        made[kind] = path
    return made


CLASSES = {"classifier": ImageClassifier, "captioner": CaptionModule, **{k: c for k, (c, _) in KINDS.items()}}


@pytest.mark.parametrize("kind", list(CLASSES))
def test_load_from_checkpoint_rebuilds_every_module_with_every_weight(kind, stored, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # data roots resolve under ./data here, never the checkout's
    path = stored[kind]
    cls = CLASSES[kind]
    module = cls.load_from_checkpoint(path)  # Lightning's documented call, nothing else passed
    assert type(module) is cls and not module.training
    file = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    mine = module.state_dict()
    assert mine.keys() == file.keys()
    assert all(torch.equal(mine[k], v) for k, v in file.items())
    # the same module vitpipe's own rebuild (eval, predict, export) gives: same settings, same outputs
    ref = vitpipe.load_run(path).module
    assert dict(module.hparams) == dict(ref.hparams)
    torch.manual_seed(1)
    if kind == "captioner":
        images = torch.randn(2, 3, 32, 32)
        assert module.caption(images) == ref.caption(images)
        assert module.tokenizer.state_dict() == file_tokenizer(path)
    elif kind == "mae":
        x, noise = torch.randn(2, 1, 8, 8), torch.rand(2, 16)
        assert torch.equal(module(x, noise=noise)[1], ref(x, noise=noise)[1])
        assert module.hparams.mask_ratio == 0.5
    else:
        x = torch.randn(2, 3 if kind == "multilabel" else 1, 8, 8)
        assert torch.equal(module.eval_net(x), ref.eval_net(x))
    if kind == "multilabel":
        assert module.kind.name == "multilabel" and module.hparams.threshold == 0.3
    if kind == "distill":
        assert module.distill["type"] == "hard" and module.teacher is None  # the teacher loads only to fit
        assert hasattr(module.net, "head_dist")
    if kind == "ema":
        assert module.ema is not None and torch.equal(module.eval_net.head.weight, file["ema.module.head.weight"])


def file_tokenizer(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)["tokenizer"]


def test_keyword_arguments_override_the_stored_settings_and_map_location_moves(stored, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    module = ImageClassifier.load_from_checkpoint(stored["classifier"], label_smoothing=0.3, map_location="cpu")
    assert module.hparams.label_smoothing == 0.3 and module.device.type == "cpu"


@pytest.mark.parametrize("call, words", [
    (lambda p: MAEModule.load_from_checkpoint(p), "holds a module of class ImageClassifier, not MAEModule"),
    (lambda p: ImageClassifier.load_from_checkpoint(p, net=torch.nn.Identity()), "net= is built from the checkpoint's"),
    (lambda p: ImageClassifier.load_from_checkpoint(p, weights_only=False), "weights_only=False is refused"),
    (lambda p: ImageClassifier.load_from_checkpoint(p, hparams_file="h.yaml"), "hparams_file='h.yaml' is not read"),
])
def test_what_cannot_be_honoured_is_one_line(call, words, stored, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        call(stored["classifier"])
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_checkpoint_without_a_stored_config_is_one_line(stored, tmp_path):
    """A checkpoint that only Lightning wrote (no vitpipe config: e.g. a module trained by hand) cannot say
    which network it holds: one line saying what to do instead."""
    ckpt = torch.load(stored["classifier"], map_location="cpu", weights_only=True)
    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": ckpt["state_dict"], "hyper_parameters": {"label_smoothing": 0.1}}, path)
    with pytest.raises(ConfigError) as err:
        ImageClassifier.load_from_checkpoint(path)
    message = str(err.value)
    assert message.startswith(f"{path} stores no vitpipe config") and "load_state_dict" in message
    assert "\n" not in message


def test_a_hostile_stored_config_is_refused_before_anything_is_called(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "marker"
    path = hostile(tmp_path / "h", marker)
    with pytest.raises(ConfigError, match=r"refused checkpoint .*model\._target_='builtins.open'"):
        ImageClassifier.load_from_checkpoint(path)
    assert not marker.exists()


# ---------------------------------------------------------------- a real run, as the user types it


def _best_checkpoint(stdout: str) -> Path:
    lines = [ln.split("best checkpoint", 1)[1].strip() for ln in stdout.splitlines()
             if ln.strip().startswith("best checkpoint")]
    assert lines, stdout[-2000:]
    return Path(lines[-1])


@pytest.mark.slow
def test_a_trained_run_reloads_by_lightnings_call_and_tests_to_its_own_accuracy(tmp_path, monkeypatch):
    """``python scripts/train.py`` (short), then in Python: ``ImageClassifier.load_from_checkpoint(<best>)`` gives
    the logits of ``vitpipe.load_run`` and the probabilities the run's test wrote to predictions.csv, and
    ``Trainer.test`` on ``load_run``'s module and data module gives the run's test/acc."""
    work = fresh_checkout(tmp_path / "w")
    r = run(["python", "scripts/train.py", *SHORT_TRAIN], work)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir, best = run_dir_of(r.stdout), _best_checkpoint(r.stdout)
    monkeypatch.chdir(work)

    module = ImageClassifier.load_from_checkpoint(best)
    stored = vitpipe.load_run(run_dir)
    dm = stored.datamodule
    dm.setup("test")
    x, y = next(iter(dm.test_dataloader()))
    if dm.fast_path:  # uint8 batches, resized and normalised after the transfer to the device (as in a test loop)
        x = dm.augment_batch(x, train=False)
    with torch.no_grad():
        logits = module(x)
        assert torch.equal(logits, stored.net(x))
    probs = logits.softmax(-1)
    with open(run_dir / "predictions.csv", newline="") as f:
        rows = list(csv.DictReader(f))[: len(x)]
    assert [int(row["target"]) for row in rows] == y.tolist()
    assert [int(row["pred"]) for row in rows] == probs.argmax(-1).tolist()
    assert [float(row["prob"]) for row in rows] == pytest.approx(probs.max(-1).values.tolist(), abs=2e-6)

    trainer = L.Trainer(accelerator="cpu", limit_test_batches=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    (scores,) = trainer.test(stored.module, datamodule=stored.datamodule, verbose=False)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert scores["test/acc"] == pytest.approx(metrics["test/acc"], abs=1e-6)
    assert scores["test/loss"] == pytest.approx(metrics["test/loss"], abs=1e-5)
