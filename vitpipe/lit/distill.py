"""Knowledge distillation (Hinton et al. 2015) as DeiT trains with it (Touvron et al. 2021).

``module.distill``: ``teacher`` (null: off), ``type`` soft | hard, ``alpha``, ``tau``; for a weights
file ``arch`` (its timm name) and ``kwargs`` (its timm constructor arguments); ``img_size``: the
teacher's input size, when it was trained at another size than the student (null: a vitpipe
checkpoint's own ``model.img_size``, else the student's batch as it is). A safetensors file written
by ``scripts/make_teacher.py`` carries its arch, kwargs and img_size in its metadata: settings left
null are read from there, and a setting that contradicts the file is refused.

    loss = (1 - alpha) * CE(student, labels) + alpha * distill
    soft:  distill = KL(softmax(teacher / tau) || softmax(student / tau)) * tau^2   (mean over images)
    hard:  distill = CE(student, argmax teacher)                                   (DeiT's best, Table 3)

With a distillation token (``model.dist_token=true``) the class head takes the first term and the
distillation head the second. Departure from DeiT's code: the soft term is the KL per image
(``batchmean``); DeiT divides the summed KL by B * C, which shrinks it by the class count.

The teacher runs frozen, in eval mode, under no_grad, on the same (mixed) batch as the student,
resized bilinearly to its input size as the data module resizes (``teacher_input``). It
is loaded when a fit starts (``load_teacher``), kept outside the LightningModule's module tree: it
is in no optimizer, no checkpoint and no DDP wrapper, and eval/predict/export never load it.

``precompute: true`` computes the teacher's logits once, before the first step, for every training image
as it is and mirrored (``teacher_targets``), and each step reads those of the view the student sees
instead of running the teacher (FKD, Shen & Xing 2022, stores a teacher's soft labels the same way):
the same targets at no cost per step. That holds only where a training view is the image or its mirror:
random crops, erasing, RandAugment and mixup are refused (``vitpipe.config.checks.check_precompute``),
and the data must be held in memory (the fast path: digits, Fashion-MNIST, CIFAR). The logits are kept in
``<data.root>/teacher_targets/<key>.safetensors``, the key a SHA-256 of the teacher's weights, the images
and their input transform, so a changed teacher or split is computed afresh, never read from an old file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitpipe.config.checks import TEACHER_WEIGHT_SUFFIXES, check_teacher_file
from vitpipe.errors import ConfigError, to_hw
from vitpipe.models.timm_model import plain_kwargs

TYPES = ("soft", "hard")
CPU_BATCH = 128  # the precompute pass's largest batch on a CPU: its activations stay in cache (teacher_targets)
KEYS = {"teacher", "arch", "kwargs", "img_size", "type", "alpha", "tau", "precompute"}


def check_distill(distill: dict | None) -> dict | None:
    """The validated settings, or None when distillation is off (no teacher)."""
    if not distill or distill.get("teacher") in (None, ""):
        return None
    cfg = {"arch": None, "kwargs": None, "img_size": None, "type": "soft", "alpha": 0.5, "tau": 1.0, "precompute": False,
           **dict(distill)}
    if set(cfg) - KEYS:
        raise ConfigError(f"module.distill has unknown keys {sorted(set(cfg) - KEYS)}; valid: {sorted(KEYS)}")
    if cfg["type"] not in TYPES:
        raise ConfigError(f"module.distill.type={cfg['type']!r}; valid choices: {', '.join(TYPES)}")
    if not 0.0 <= float(cfg["alpha"]) <= 1.0:
        raise ConfigError(f"module.distill.alpha={cfg['alpha']!r}: use a weight in [0, 1] (DeiT: 0.5)")
    if not float(cfg["tau"]) > 0:
        raise ConfigError(f"module.distill.tau={cfg['tau']!r}: use a temperature > 0 (DeiT soft: 1.0)")
    if not isinstance(cfg["precompute"], bool):
        raise ConfigError(f"module.distill.precompute={cfg['precompute']!r}: use true or false")
    size = None if cfg["img_size"] is None else to_hw(cfg["img_size"], "module.distill.img_size")
    return {**cfg, "teacher": str(cfg["teacher"]), "alpha": float(cfg["alpha"]), "tau": float(cfg["tau"]),
            "kwargs": None if cfg["kwargs"] is None else plain_kwargs(cfg["kwargs"], "module.distill.kwargs"),
            "img_size": size}  # kwargs None: a weights file's metadata says them (load_teacher)


def targets_key(teacher: nn.Module, images: Tensor, transform: dict, views: int) -> str:
    """The SHA-256 naming a set of precomputed targets: the teacher's weights and input size, the images
    (uint8), their input transform (``transform``: size, mean, std, ...) and the number of views."""
    h = hashlib.sha256()
    for name, value in teacher.state_dict().items():
        h.update(name.encode())
        h.update(value.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())  # 0-dim buffers too (BN counts)
    h.update(json.dumps({"teacher_size": list(getattr(teacher, "img_size", None) or []), "views": views,
                         "transform": transform, "images": list(images.shape)}, sort_keys=True).encode())
    h.update(images.contiguous().numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def teacher_targets(teacher: nn.Module, images: Tensor, to_input: Callable[[Tensor], Tensor], *, mirror: bool,
                    batch_size: int = 500, device: torch.device | str = "cpu") -> Tensor:
    """The teacher's logits (N, V, C), float32, of ``images`` (uint8 (N, C, h, w)) as they are (view 0) and,
    with ``mirror``, flipped left-right (view 1); ``to_input`` makes a uint8 batch the student's input
    (the data module's evaluation transform), which the teacher sees resized to its own size.

    The pass runs channels-last (oneDNN's convolutions read NHWC without reordering), in batches of
    ``batch_size`` on a GPU and of at most ``CPU_BATCH`` on a CPU, whose activations then stay in cache
    (``python scripts/benchmark.py --only teacher`` times it against contiguous batches of 1,000:
    docs/deit.md). The teacher's weights are contiguous again afterwards, as ``load_teacher`` gives them."""
    from tqdm.auto import tqdm

    if torch.device(device).type == "cpu":
        batch_size = min(batch_size, CPU_BATCH)
    out = []
    teacher.to(memory_format=torch.channels_last)  # 4-D weights only: a ViT's patch projection, a CNN's convs
    try:
        for i in tqdm(range(0, len(images), batch_size), desc="teacher targets", unit="batch", leave=False):
            xb = images[i:i + batch_size].to(device)
            views = (xb, xb.flip(-1)) if mirror else (xb,)
            out.append(torch.stack([teacher(teacher_input(to_input(v), teacher.img_size).contiguous(
                memory_format=torch.channels_last)).float() for v in views], 1).cpu())
    finally:
        teacher.to(memory_format=torch.contiguous_format)
    return torch.cat(out)


def cached_targets(folder: Path | None, key: str, compute: Callable[[], Tensor], shape: tuple[int, ...]) -> Tensor:
    """``compute()``'s targets, read from ``folder/<key>.safetensors`` when a file of that name and
    ``shape`` is there, else computed and written there (a temporary file and a rename)."""
    from safetensors.torch import load_file, save

    from vitpipe.run.files import atomic_write

    path = None if folder is None else Path(folder) / f"{key}.safetensors"
    if path is not None and path.is_file():
        try:
            found = load_file(str(path))["logits"]
        except Exception:  # noqa: BLE001 - unreadable (a disk error, a foreign file): computed afresh below
            found = None
        if found is not None and tuple(found.shape) == shape and found.dtype == torch.float32:
            return found
    logits = compute()
    if path is not None:
        atomic_write(path, lambda f: f.write(save({"logits": logits.contiguous()})))
    return logits


def teacher_input(x: Tensor, size: tuple[int, int] | None) -> Tensor:
    """The student's batch at the teacher's input size: bilinear, no antialias, as the data module's
    resize (resizing the normalised batch equals normalising the resized one: both are linear)."""
    if size is None or tuple(x.shape[-2:]) == tuple(size):
        return x
    return F.interpolate(x, size=tuple(size), mode="bilinear", align_corners=False)


def distill_term(student: Tensor, teacher: Tensor, *, type: str, tau: float = 1.0) -> Tensor:
    """The distillation loss of student logits (B, C) against teacher logits (B, C)."""
    if type == "hard":
        return F.cross_entropy(student, teacher.argmax(dim=1))
    log_p_s = F.log_softmax(student / tau, dim=1)
    log_p_t = F.log_softmax(teacher / tau, dim=1)
    # tau^2 keeps the gradient scale independent of tau (Hinton et al. 2015)
    return F.kl_div(log_p_s, log_p_t, reduction="batchmean", log_target=True) * tau * tau


def combine(base: Tensor, student: Tensor, teacher: Tensor, *, type: str, alpha: float, tau: float) -> Tensor:
    """``(1 - alpha) * base + alpha * distill_term``; alpha 0 is ``base`` exactly."""
    if alpha == 0:
        return base
    return (1 - alpha) * base + alpha * distill_term(student, teacher, type=type, tau=tau)


def file_metadata(path: Path) -> dict:
    """``{arch, kwargs, img_size}`` as far as a safetensors teacher file's metadata holds them
    (``vitpipe.tasks.make_teacher`` writes all three); empty for other files or a file without them."""
    if path.suffix != ".safetensors":
        return {}
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except Exception:  # not a readable safetensors file: the weights loader says so in its own line
        return {}
    found = {}
    for key in ("arch", "kwargs", "img_size"):
        if key not in meta:
            continue
        try:
            found[key] = meta[key] if key == "arch" else json.loads(meta[key])
        except ValueError:
            raise ConfigError(f"module.distill.teacher={path}: its metadata {key}={meta[key]!r} is not JSON; "
                              f"set module.distill.{key} instead") from None
    if "kwargs" in found:
        found["kwargs"] = plain_kwargs(found["kwargs"], f"module.distill.teacher={path}: its metadata kwargs")
    if "img_size" in found:
        found["img_size"] = to_hw(found["img_size"], f"module.distill.teacher={path}: its metadata img_size")
    return found


def _from_file(given, stored, key: str, spec: str):
    """A setting of a weights-file teacher: the config's, else the file's; both and different: refused."""
    if given is None or stored is None:
        return stored if given is None else given
    if given != stored:
        def show(v):  # as the config writes it: lists, not the tuples the checks make
            return list(v) if isinstance(v, tuple) else {k: show(x) for k, x in v.items()} if isinstance(v, dict) else v

        raise ConfigError(f"module.distill.{key}={show(given)} but the teacher file {spec} was written for "
                          f"{key}={show(stored)} (its metadata); leave module.distill.{key} null to use the file's")
    return given


def load_teacher(spec: str, *, num_classes: int, in_chans: int, arch: str | None = None, kwargs: dict | None = None,
                 img_size: int | tuple[int, int] | None = None) -> nn.Module:
    """The teacher named by ``module.distill.teacher``, frozen, in eval mode, on the CPU.

    A vitpipe checkpoint (a ``.ckpt`` file or run directory) is rebuilt through
    ``vitpipe.run.checkpoint`` (its config is data, checked there); a folder holding ``config.json`` is a
    timm export (``format=timm``); a weights file needs ``arch`` (its timm model name); anything
    else must be a timm model name with weights in the HF cache. The teacher must predict the
    data's ``num_classes`` classes. ``teacher.img_size`` is its input size: ``img_size``, else what a
    vitpipe checkpoint was trained at, else None (the student's batch as it is). For a weights file,
    ``arch``, ``kwargs`` and ``img_size`` left None are read from its metadata (``file_metadata``).
    """
    import timm

    path = Path(spec)
    if path.suffix == ".ckpt" or (path.is_dir() and not (path / "config.json").is_file()):
        from vitpipe.run.checkpoint import rebuild
        from vitpipe.run.paths import resolve_ckpt_path
        from vitpipe.run.stored import load_checkpoint

        ckpt = resolve_ckpt_path(spec, which="best")
        teacher = rebuild(load_checkpoint(ckpt), ckpt).net  # EMA weights when the run kept them
    elif path.is_dir():
        teacher = timm.create_model(f"local-dir:{path}", pretrained=True)
    elif path.suffix in TEACHER_WEIGHT_SUFFIXES:
        check_teacher_file(spec)
        meta = file_metadata(path)
        arch = _from_file(arch, meta.get("arch"), "arch", spec)
        kwargs = _from_file(None if kwargs is None else plain_kwargs(kwargs, "module.distill.kwargs"),
                            meta.get("kwargs"), "kwargs", spec)  # fmt: skip
        given = None if img_size is None else to_hw(img_size, "module.distill.img_size")
        img_size = _from_file(given, meta.get("img_size"), "img_size", spec)
        if not arch or not timm.is_model(arch):
            raise ConfigError(f"module.distill.teacher={spec} is a weights file: name its timm model with "
                              f"module.distill.arch (got {arch!r}), e.g. resnet18")
        teacher = timm.create_model(arch, num_classes=num_classes, in_chans=in_chans,
                                    **plain_kwargs(kwargs, "module.distill.kwargs"))  # fmt: skip
        if path.suffix != ".safetensors":  # sizes bounded before timm's torch.load inflates anything
            from vitpipe.run.safeload import check_archive

            check_archive(path, what="module.distill.teacher file")
        try:  # weights_only spelled out: timm defaulted to False up to 1.0.24 (pickled code ran)
            state = timm.models.load_state_dict(str(path), weights_only=True)
        except Exception as err:  # a pickle that needs code to load, or a corrupt file
            raise ConfigError(f"module.distill.teacher={spec} cannot be read as weights: {type(err).__name__}: "
                              f"{str(err).splitlines()[0][:200]}") from None
        try:
            teacher.load_state_dict(state)
        except RuntimeError as err:
            raise ConfigError(f"module.distill.teacher={spec} does not fit {arch} with {num_classes} classes, "
                              f"{in_chans} channel(s) and kwargs {kwargs or {}}: "
                              f"{str(err).splitlines()[1][:200]}") from None
    elif timm.is_model(spec):
        teacher = timm.create_model(spec, pretrained=True)
    else:
        raise ConfigError(f"module.distill.teacher={spec!r} is no checkpoint, run dir, weights file or timm model name")
    classes = getattr(teacher, "num_classes", None)
    if classes != num_classes:
        raise ConfigError(f"module.distill.teacher={spec} predicts {classes} classes, the data has {num_classes}: "
                          "train or fine-tune it on this data first (e.g. model=timm model.name=resnet18)")
    own = getattr(teacher, "img_size", None)  # vitpipe ViTs and model=timm networks keep theirs
    own = to_hw(own, "teacher img_size") if isinstance(own, (int, tuple, list)) else None
    size = own if img_size is None else to_hw(img_size, "module.distill.img_size")
    if own is not None and size != own:
        raise ConfigError(f"module.distill.img_size={list(size)}: the teacher {spec} was trained at {list(own)}; "
                          "leave img_size null for a vitpipe checkpoint")
    teacher.img_size = size
    return teacher.eval().requires_grad_(False).cpu()
