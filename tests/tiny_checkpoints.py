"""Tiny checkpoints for the predict/export tests, made once per test session and shared by both files.

``trained_run`` is a real ``train()`` run (debug=fast: a run dir with metrics.json and
.hydra/overrides.yaml). ``checkpoint(kind)`` builds model + data module + LightningModule through
``vitpipe.run.build.build_from_config`` exactly as training does, gives every weight a random value (std 0.2 around 0,
around 1 for norm scales: each weight moves the logits, and labels differ between images) and saves
what a trained run saves: state_dict, the resolved config, class names.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from conftest import make_cfg
from omegaconf import OmegaConf
from PIL import Image

# kind -> config overrides (debug=fast: 1-block, 32-wide; vit_nano on 8x8 digits unless said)
KINDS = {
    "learned": ["model.pos_embed=learned"],
    "learned_nocls": ["model.pos_embed=learned", "model.class_token=false", "model.pool=mean"],
    "sincos2d": ["model.pos_embed=sincos2d"],
    "sincos2d_nocls": ["model.pos_embed=sincos2d", "model.class_token=false", "model.pool=mean"],
    "sincos2d_rgb": ["model.pos_embed=sincos2d", "model.in_chans=3"],
    "rope2d": ["model.pos_embed=rope2d"],
    "learned2d": ["model.pos_embed=learned2d"],
    "conv": ["model.pos_embed=sincos2d", "model.stem=conv"],
    "hybrid": ["model.pos_embed=sincos2d", "model.stem=conv", "model.stem_depth=2"],  # fmnist_vit's hybrid stem
    "captioner": ["experiment=caption_shapes", "data.num_train=16", "data.num_val=4", "data.num_test=4",
                  "module.beam_size=2"],
    "folder": ["data=imagefolder", "data.num_classes=3", "model.img_size=16", "model.patch_size=4",
               "model.pos_embed=learned"],
}
_made: dict[str, Path] = {}


def write_image_folder(root: Path) -> Path:
    """root/train/<cat|dog|fish>/ with two small RGB images each (an imagefolder data set)."""
    rng = np.random.default_rng(0)
    for c in ("cat", "dog", "fish"):
        (root / "train" / c).mkdir(parents=True, exist_ok=True)
        for i in range(2):
            Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(root / "train" / c / f"{i}.png")
    return root


def checkpoint(kind: str, base: Path) -> Path:
    """``base/<kind>/checkpoints/epoch_000.ckpt`` with random weights (made once per session)."""
    if kind in _made:
        return _made[kind]
    from vitpipe.run.build import build_from_config

    root = base / kind
    extra = [f"data.root={write_image_folder(root / 'images')}"] if kind == "folder" else []
    cfg = make_cfg(root, ["debug=fast", "logger=none", *KINDS[kind], *extra])
    dm, net, module = build_from_config(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.normal_(mean=1.0 if "norm" in name and name.endswith("weight") else 0.0, std=0.2)
    if kind == "folder":
        dm.check()
    stored = OmegaConf.to_container(cfg, resolve=True)
    stored.pop("hydra", None)  # as ConfigInCheckpoint stores it (scripts/train.py's cfg has no hydra node)
    path = root / "run" / "checkpoints" / "epoch_000.ckpt"
    path.parent.mkdir(parents=True)
    saved = {"state_dict": module.state_dict(), "vitpipe_config": stored, "class_names": getattr(dm, "class_names", None)}
    if kind == "captioner":
        saved["tokenizer"] = module.tokenizer.state_dict()  # as CaptionModule.on_save_checkpoint does
    torch.save(saved, path)
    _made[kind] = path
    return path


def trained_run(base: Path) -> Path:
    """A real (2-step) training run of the default vit_nano on digits; returns its run dir."""
    if "trained" in _made:
        return _made["trained"]
    from vitpipe.tasks.train import train

    cfg = make_cfg(base / "trained", ["debug=fast", "logger=none"])
    train(cfg)
    run = Path(cfg.paths.output_dir)
    (run / ".hydra").mkdir(exist_ok=True)  # what @hydra.main records; make_cfg does not write it
    (run / ".hydra" / "overrides.yaml").write_text("- debug=fast\n- logger=none\n")
    _made["trained"] = run
    return run


def hostile(base: Path, marker: Path) -> Path:
    """A checkpoint whose stored model config would open (create) ``marker`` if instantiated."""
    src = torch.load(checkpoint("sincos2d", base), map_location="cpu", weights_only=True)
    src["vitpipe_config"]["model"] = {"_target_": "builtins.open", "file": str(marker), "mode": "w"}
    path = base / "hostile" / "evil.ckpt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(src, path)
    return path


def timm_checkpoint(base: Path, name: str = "resnet10t") -> Path:
    """``base/timm/run/checkpoints/epoch_000.ckpt``: a timm network (``model=timm``, a CNN: no attention)
    on the digits with random weights, stored as a training run stores it (made once per session)."""
    key = f"timm:{name}"
    if key in _made:
        return _made[key]
    from vitpipe.run.build import build_from_config

    root = base / "timm"
    cfg = make_cfg(root, ["model=timm", f"model.name={name}", "model.img_size=8", "logger=none", "trainer=cpu"])
    dm, net, module = build_from_config(cfg)  # not debug=fast: it sets ViT widths
    stored = OmegaConf.to_container(cfg, resolve=True)
    stored.pop("hydra", None)
    path = root / "run" / "checkpoints" / "epoch_000.ckpt"
    path.parent.mkdir(parents=True)
    torch.save({"state_dict": module.state_dict(), "vitpipe_config": stored,
                "class_names": getattr(dm, "class_names", None)}, path)
    _made[key] = path
    return path
