"""A trained run's network as a distillation teacher file: weights only, in safetensors (data, no code).

    python scripts/train.py experiment=fmnist_teacher
    python scripts/make_teacher.py logs/fmnist_teacher/runs/<time> assets/teachers/fmnist_resnet10t.safetensors

The run (a run directory: its best checkpoint, or a .ckpt file) must hold a timm model
(``model=timm``); its safetensors metadata records the timm name, the run's ``model.kwargs`` and
``model.img_size``, so ``module.distill.teacher=<file>`` alone uses it (the script prints the line).
After writing, the file is loaded back the way training loads a teacher, from its metadata
(``vitpipe.lit.distill.load_teacher``), and must give the checkpoint's logits.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save

from vitpipe.errors import ConfigError
from vitpipe.export.check import check_logits
from vitpipe.lit.distill import load_teacher
from vitpipe.run.checkpoint import rebuild
from vitpipe.run.files import atomic_write
from vitpipe.run.paths import resolve_ckpt_path
from vitpipe.run.stored import config_of, load_checkpoint


def make_teacher(run: str, out: str) -> Path:
    ckpt = resolve_ckpt_path(run, log_dir="logs", which="best")
    checkpoint = load_checkpoint(ckpt)
    model = config_of(checkpoint)["model"]
    arch = model.get("name")
    if not arch or "timm_model" not in model.get("_target_", ""):  # before building anything
        raise ConfigError(f"{ckpt} holds no timm model (model=timm): a teacher file needs a timm architecture")
    kwargs = dict(model.get("kwargs") or {})
    net = rebuild(checkpoint, ckpt).net.eval()
    out = Path(out)
    data = save({k: v.contiguous() for k, v in net.state_dict().items()},
                metadata={"arch": arch, "kwargs": json.dumps(kwargs), "img_size": json.dumps(list(net.img_size)),
                          "source": str(ckpt)})  # fmt: skip
    atomic_write(out, lambda f: f.write(data))  # a kill mid-write never leaves half a teacher
    teacher = load_teacher(str(out), num_classes=net.num_classes, in_chans=net.in_chans)  # as the metadata says
    x = torch.randn(4, net.in_chans, *net.img_size)
    with torch.no_grad():
        diff = check_logits(teacher.eval()(x), net, x, tolerance=1e-5, differs=f"{out} reloads unlike {ckpt}",
                            measure="max abs logit difference")
    size = out.stat().st_size / 2**20
    print(f"vitpipe: teacher {arch} from {ckpt} -> {out} ({size:.2f} MB; reloaded, logits within {diff:.1g});\n"
          f"  use it: module.distill.teacher={out} (its arch, kwargs and img_size are read from the file)")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a run directory (its best checkpoint) or a .ckpt file")
    parser.add_argument("out", help="the .safetensors file to write")
    args = parser.parse_args(argv)
    try:
        make_teacher(args.run, args.out)
    except ConfigError as err:  # one line, as the other scripts print it
        raise SystemExit(f"vitpipe: error: {err}") from None

