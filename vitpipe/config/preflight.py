"""The one config check: ``preflight(cfg, entry)``, run once by an entry point's task body before anything
is built, loaded or seeded, and the rules that relate one key to another.

A mistake is one ``ConfigError`` line naming the key and the value. In order:

1. a null ``data.num_classes`` is filled in from the data's files where they say it
   (``vitpipe.data.num_classes``: an image folder's class folders, a shard index);
2. every value against what it builds (``vitpipe.config.checks``: the targets' signatures, the optimizer
   and scheduler built on a dummy parameter, a wandb login) and against its key's type and range
   (``vitpipe.config.schema``, OmegaConf structured configs);
3. the rules across keys, here: the data module's arguments that exclude each other, labels the module can
   learn from, NaFlex and multi-label combinations, the model's classes against the data's;
4. for train, what this machine must have (a GPU for ``trainer.accelerator=gpu``).

The commands that read a stored run (predict, visualize, demo, serve, export) check their own options here too
(``vitpipe.config.options``), before the checkpoint, an image or an optional dependency is read.

``check_config`` is 1-3, the part that holds on any machine (a config for GPU nodes may be composed and
checked on a CPU-only login node). ``vitpipe.run.build.build_from_config`` runs it only for a config built
by hand (the benchmark's); train hands it the data module it built after its preflight, so the walk of
``train(cfg)`` enters here once. The facts a data set states about itself (its class count, its channels)
are compared with the config by its data module once it knows them (``vitpipe.data.base``).
"""

from __future__ import annotations

import inspect

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from vitpipe.config.checks import (
    check_arguments,
    check_class_counts,
    check_precompute,
    check_teacher_file,
    check_wandb_login,
    dry_build_optimizer,
    trusted_target,
)
from vitpipe.config.options import check_demo, check_export, check_predict, check_serve, check_visualize
from vitpipe.config.schema import ENTRY_SCHEMAS, check_schema
from vitpipe.errors import ConfigError, check_int, to_hw


def preflight(cfg: DictConfig, entry: str) -> None:
    """Everything about ``cfg`` that can be checked before anything is built, for the script ``entry``
    (``train``, ``eval``, ``predict``, ``visualize``, ``demo``, ``serve``, ``export``, ``doctor``)."""
    if entry not in ENTRIES:
        raise ValueError(f"preflight: unknown entry {entry!r}; known: {', '.join(ENTRIES)}")
    ENTRIES[entry](cfg)


def check_config(cfg: DictConfig) -> None:
    """A training config (train, the benchmark's recipes), on any machine: steps 1-3 of the module's list."""
    from vitpipe.data.num_classes import resolve_num_classes

    resolve_num_classes(cfg.get("data"))
    with _one_line():
        check_schema(cfg, where=ENTRY_SCHEMAS["train"])  # first, as the command line's check runs it: one wording
        check_arguments(cfg)
        dry_build_optimizer(cfg)
        check_wandb_login(cfg)
        check_data_arguments(cfg.get("data"))
    check_labels_used(cfg)
    check_naflex_module(cfg)
    check_multilabel(cfg)
    check_precomputed_targets(cfg)
    try:
        model_n, data_n = cfg.model.get("num_classes"), cfg.data.get("num_classes")
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} must be set on the command line, e.g. {e.full_key}=10") from None
    check_class_counts(model_n, data_n)


def _train(cfg: DictConfig) -> None:
    check_config(cfg)
    check_time_budget(cfg)
    check_lora_base(cfg)
    check_device(cfg)


def check_lora_base(cfg: DictConfig) -> None:
    """``module.finetune=lora`` trains adapters on frozen weights: without ``model.pretrained`` those are
    random, and the run learns next to nothing (the head on random features). Refused rather than warned:
    minutes of training for a config that forgot one key."""
    module = cfg.get("module")
    if not isinstance(module, DictConfig) or module.get("finetune") != "lora":
        return
    if not cfg.model.get("pretrained"):
        raise ConfigError("module.finetune=lora adapts pretrained weights, but model.pretrained is null (the frozen "
                          "weights would be random); set model.pretrained=<a run directory, a weights file or a "
                          "timm name>, or use module.finetune=full")


def check_time_budget(cfg: DictConfig) -> None:
    """``trainer.time_budget`` fits a timm scheduler's progress to the time: a torch scheduler, sized by
    its own step arguments, cannot follow it."""
    if cfg.get("trainer") is None or cfg.trainer.get("time_budget") is None:
        return
    scheduler = cfg.module.get("scheduler") if cfg.get("module") is not None else None
    target = str(scheduler.get("_target_") or "") if scheduler is not None else ""
    if target and not target.startswith("timm.scheduler"):
        raise ConfigError(f"trainer.time_budget={cfg.trainer.time_budget} fits a timm scheduler to the time; "
                          f"module.scheduler._target_={target} is sized by its own arguments (use "
                          "timm.scheduler.CosineLRScheduler or timm.scheduler.PolyLRScheduler, or module.scheduler=null)")


def _eval(cfg: DictConfig) -> None:
    """The eval config's own values (its seed: one line, not numpy's traceback from seed_everything); the
    run it rebuilds is the checkpoint's, checked by the stored-config rule (``vitpipe.run.stored``)."""
    with _one_line():
        check_schema(cfg, where=ENTRY_SCHEMAS["eval"])


def _doctor(cfg: DictConfig) -> None:
    """``scripts/doctor.py``: a run (``ckpt_path``) or a model config (``model=``), exactly one; ``data=`` only
    with ``model=``; ``batch_size``, ``device``, ``seed`` and the model's own ranges."""
    from vitpipe.config.build import resolve_device
    from vitpipe.config.shipped import names

    model, data, ckpt = cfg.get("model"), cfg.get("data"), cfg.get("ckpt_path")
    if ckpt is None and model is None:
        models = [n.split("/", 1)[1] for n in names() if n.startswith("model/")  # the ViT and captioner configs
                  and not n.startswith("model/mae") and n not in ("model/vit", "model/timm")]
        raise ConfigError("doctor needs a model: pass ckpt_path=<a .ckpt file, a run directory or `last`> or "
                          f"model=<one of {', '.join(models)}>")
    if ckpt is not None and model is not None:
        raise ConfigError(f"ckpt_path={ckpt} and model={model.get('name') or model.get('_target_')}: pass one of them "
                          "(ckpt_path checks the run's own model)")
    if ckpt is not None and data is not None:
        raise ConfigError(f"data={str(data.get('_target_', '?')).rsplit('.', 1)[-1]} goes with model= (its channels "
                          "and classes); ckpt_path uses the run's own: drop data")
    size = cfg.get("batch_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ConfigError(f"batch_size={size!r}: expected null (the run's data.batch_size) or an int >= 1")
    resolve_device(str(cfg.device))
    with _one_line():
        check_schema(cfg, where=ENTRY_SCHEMAS["doctor"])


# the commands on a stored run check their own options (vitpipe.config.options); the run they read is the
# checkpoint's, checked by the stored-config rule when it loads (vitpipe.run.stored)
ENTRIES = {"train": _train, "eval": _eval, "predict": check_predict, "visualize": check_visualize,
           "demo": check_demo, "serve": check_serve, "export": check_export, "doctor": _doctor}


class _one_line:
    """OmegaConf's own errors (a value left ``???``, a bad interpolation) as one ConfigError line."""

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if isinstance(e, MissingMandatoryValue):
            raise ConfigError(f"{e.full_key} must be set on the command line, e.g. {e.full_key}=<value>") from None
        if isinstance(e, OmegaConfBaseException):
            msg = str(getattr(e, "msg", e)).splitlines()[0]
            raise ConfigError(f"{e.full_key}: {msg}" if getattr(e, "full_key", None) else msg) from None
        return False


# --------------------------------------------------------------------------- the data module's arguments


def data_arguments(node) -> dict | None:
    """The arguments a ``ClassificationDataModule`` subclass would get from ``node`` (resolved), its
    constructors' defaults filled in for the keys left out; None for any other data module."""
    from vitpipe.data.base import ClassificationDataModule

    target = trusted_target(node) if isinstance(node, DictConfig) else None
    if not (isinstance(target, type) and issubclass(target, ClassificationDataModule)):
        return None
    args = {}
    for cls in reversed(target.__mro__[:target.__mro__.index(ClassificationDataModule) + 1]):
        for p in inspect.signature(cls.__dict__["__init__"]).parameters.values() if "__init__" in cls.__dict__ else ():
            if p.default is not p.empty:
                args[p.name] = p.default
    args.update({k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if not k.startswith("_")})
    return args


def check_data_arguments(node) -> None:
    """The arguments of a classification data module that no annotation or range can refuse alone: the
    choices, and the pairs that exclude each other (a balanced sampler without shuffling, MAE's crop with
    erasing, NaFlex's own batches with an epoch sampler, ...). Nothing read; the data set's own facts
    (its classes, channels, image size) are compared by the data module once built."""
    from vitpipe.data.splits import check_val_split
    from vitpipe.data.transforms import MAE_AUGMENT

    a = data_arguments(node)
    if a is None:
        return
    to_hw(a.get("img_size"), "data.img_size")
    check_int(a.get("in_chans"), "data.in_chans")
    if a.get("num_classes") is not None:  # null: filled in from the files, or the data module says it
        check_int(a["num_classes"], "data.num_classes")
    check_val_split(a.get("val_split"))
    check_int(a.get("crop_padding"), "data.crop_padding", minimum=0)
    sampler, shuffle, repeated_aug = a.get("sampler"), bool(a.get("shuffle")), a.get("repeated_aug")
    augment, auto_augment, random_erasing = a.get("augment"), a.get("auto_augment"), a.get("random_erasing")
    if sampler not in ("default", "balanced"):
        raise ConfigError(f"data.sampler={sampler!r}; valid choices: default, balanced")
    if sampler == "balanced" and not shuffle:
        raise ConfigError("data.sampler=balanced draws a random class-balanced epoch; it cannot honour data.shuffle=false")
    if isinstance(repeated_aug, bool) or not isinstance(repeated_aug, int) or repeated_aug < 1:
        raise ConfigError(f"data.repeated_aug={repeated_aug!r}: use an int >= 1 (copies of each image per epoch; DeiT: 3)")
    if repeated_aug > 1 and sampler == "balanced":
        raise ConfigError(f"data.repeated_aug={repeated_aug} cannot be combined with data.sampler=balanced "
                          "(both choose the epoch's images); use one of them")
    if augment not in (True, False, MAE_AUGMENT):
        raise ConfigError(f"data.augment={augment!r}; valid choices: true, false, mae")
    if isinstance(random_erasing, bool) or not isinstance(random_erasing, (int, float)) or not 0 <= random_erasing <= 1:
        raise ConfigError(f"data.random_erasing={random_erasing!r} is a probability: use a value in [0, 1] (DeiT: 0.25)")
    if augment == MAE_AUGMENT and (random_erasing or auto_augment):
        extra = "data.random_erasing=0" if random_erasing else "data.auto_augment=null"
        raise ConfigError(f"data.augment=mae is RandomResizedCrop + flip alone (MAE pre-training): set {extra}")
    fast_path = bool(a.get("fast_path"))
    if (a.get("classes") is not None or a.get("train_per_class") is not None) and not fast_path:
        raise ConfigError("data.classes / data.train_per_class select from the split tensors: set data.fast_path=true")
    if fast_path and auto_augment:
        raise ConfigError(f"data.auto_augment={auto_augment!r} is per-image PIL augmentation: it needs data.fast_path=false")
    naflex = a.get("naflex")
    if isinstance(naflex, dict) and naflex.get("enabled", False):
        clash = [f"data.{k}={v!r}" for k, v, bad in (
            ("sampler", sampler, sampler != "default"), ("repeated_aug", repeated_aug, repeated_aug != 1),
            ("augment", augment, augment == MAE_AUGMENT), ("random_erasing", random_erasing, bool(random_erasing)),
            ("auto_augment", auto_augment, bool(auto_augment))) if bad]
        if clash:
            raise ConfigError(f"data.naflex.enabled=true plans its own batches and augments by a flip alone: "
                              f"it cannot take {', '.join(clash)}")


# --------------------------------------------------------------------------- rules across groups


def check_labels_used(cfg: DictConfig) -> None:
    """``data.labels=none`` (images without labels: one class) trains only a module that needs no labels
    (module=mae); a classifier on it would fit a constant and report 100% accuracy."""
    data, module = cfg.get("data"), cfg.get("module")
    if not isinstance(data, DictConfig) or data.get("labels") != "none" or not isinstance(module, DictConfig):
        return
    target = str(module.get("_target_", ""))
    if not target.endswith("MAEModule"):
        raise ConfigError(f"data.labels=none reads the images without labels (one class), which module "
                          f"{target.rsplit('.', 1)[-1] or '?'} cannot learn from; pre-train on them with module=mae, "
                          f"or put the images in class folders and use data.labels=folders")


def check_naflex_module(cfg: DictConfig) -> None:
    """``data.naflex.enabled=true`` feeds patch dicts: mixup, a distillation teacher, relative position
    bias and local attention need whole images.
    Refused here, before data loads (the module repeats the check for code that builds it by hand)."""
    data, module = cfg.get("data"), cfg.get("module")
    naflex = data.get("naflex") if isinstance(data, DictConfig) else None
    if not isinstance(naflex, DictConfig) or not naflex.get("enabled") or not isinstance(module, DictConfig):
        return
    model = cfg.get("model")
    rel_pos = model.get("rel_pos", "none") if isinstance(model, DictConfig) else "none"
    if rel_pos not in (None, "none"):
        raise ConfigError(f"data.naflex.enabled=true feeds patch dicts: model.rel_pos={rel_pos} takes image tensors; "
                          "set model.rel_pos=none (absolute or rope2d positions) or data.naflex.enabled=false")
    window = model.get("attn_window") if isinstance(model, DictConfig) else None
    if window is not None:
        raise ConfigError(f"data.naflex.enabled=true feeds patch dicts: model.attn_window={window} takes image tensors; "
                          "set model.attn_window=null (dense attention) or data.naflex.enabled=false")
    distill = module.get("distill")
    for key, on in (("module.mixup", bool(module.get("mixup"))),
                    ("module.distill.teacher", isinstance(distill, DictConfig) and distill.get("teacher") is not None)):
        if on:
            raise ConfigError(f"data.naflex.enabled=true feeds patch dicts: {key} needs whole images; "
                              f"set {key}=null or data.naflex.enabled=false")


def check_precomputed_targets(cfg: DictConfig) -> None:
    """A teacher named as a weights file exists; ``module.distill.precompute=true`` with a teacher: the training
    views must be the images or their mirrors (``vitpipe.config.checks.check_precompute``); before data loads."""
    data, module = cfg.get("data"), cfg.get("module")
    distill = module.get("distill") if isinstance(module, DictConfig) else None
    if isinstance(distill, DictConfig):
        check_teacher_file(distill.get("teacher"))  # a weights file, e.g. a recipe's in a checkout's assets/
    if not isinstance(distill, DictConfig) or distill.get("teacher") is None or not distill.get("precompute"):
        return
    if not isinstance(data, DictConfig) or not data.get("fast_path", False):
        name = str(data.get("_target_", "?") if isinstance(data, DictConfig) else "?").rsplit(".", 1)[-1]
        raise ConfigError(f"module.distill.precompute=true needs a data set held in memory (data.fast_path=true: digits, "
                          f"fashion_mnist, cifar10, cifar100), not {name}; set module.distill.precompute=false")
    check_precompute(data, module.get("mixup"))


def check_multilabel(cfg: DictConfig) -> None:
    """``module.task=multilabel`` trains on label sets, which an image folder with a labels file gives
    (``data.labels=<file>.csv``) and shards written from one (their index says so), and neither with a
    distillation teacher (its softmax targets), the class-balanced sampler (one class per image) nor NaFlex;
    a labels file or multi-label shards need ``module.task=multilabel``."""
    data, module = cfg.get("data"), cfg.get("module")
    if not isinstance(data, DictConfig) or not isinstance(module, DictConfig):
        return
    labels = data.get("labels") if "labels" in data else None
    labels_file = isinstance(labels, str) and labels.lower().endswith(".csv")
    classifier = str(module.get("_target_", "")).endswith("ImageClassifier")
    multilabel = module.get("task", "multiclass") == "multilabel"
    if labels_file and classifier and not multilabel:
        raise ConfigError(f"data.labels={labels} gives each image a set of labels; set module.task=multilabel")
    shards = str(data.get("_target_", "")).endswith("ShardsDataModule")
    label_sets = labels_file or (shards and classifier and _check_shards_task(data, multilabel))
    if not multilabel:
        return
    if not label_sets:
        name = str(data.get("_target_", "?")).rsplit(".", 1)[-1]
        raise ConfigError(f"module.task=multilabel needs label sets: data=imagefolder data.labels=<labels file>.csv "
                          f"(vitpipe/data/multilabel.py); {name} with data.labels={labels} gives one class per image")
    distill, naflex = module.get("distill"), data.get("naflex")
    for key, on in (("module.distill.teacher", isinstance(distill, DictConfig) and distill.get("teacher") is not None),
                    ("data.sampler", data.get("sampler", "default") != "default"),
                    ("data.naflex.enabled", isinstance(naflex, DictConfig) and bool(naflex.get("enabled")))):
        if on:
            default = {"module.distill.teacher": "null", "data.sampler": "default"}.get(key, "false")
            raise ConfigError(f"module.task=multilabel cannot take {key}={OmegaConf.select(cfg, key)} "
                              f"(it needs one class per image); set {key}={default}")


def _check_shards_task(data: DictConfig, multilabel: bool) -> bool:
    """Whether ``data=shards`` holds label sets (its index, one small file), refusing a task that does not
    match them. A root that cannot be read is left to the data module's own error, except under
    ``module.task=multilabel``, where it says what the task needs."""
    from vitpipe.data.shards import _plain, is_multilabel_index, read_index

    need = ("module.task=multilabel needs label sets: data=imagefolder data.labels=<labels file>.csv, or data=shards "
            "written from one by scripts/make_shards.py")
    if OmegaConf.is_missing(data, "root") or data.get("root") is None:
        if multilabel:
            raise ConfigError(f"{need}; set data.root to such shards")
        return False
    root, cache_dir = str(data.root), data.get("cache_dir")
    try:
        index = read_index(root, None if cache_dir is None else str(cache_dir), _plain(data.get("storage_options")))
    except ConfigError as err:
        if multilabel:
            raise ConfigError(f"{need}; {err}") from None
        return False
    found = is_multilabel_index(index)
    if multilabel and not found:
        raise ConfigError(f"{need}; data.root={root} holds single-label shards (one class per image): set "
                          "module.task=multiclass, or write multi-label shards with scripts/make_shards.py "
                          "data=imagefolder data.labels=<labels file>.csv out=DIR")
    if found and not multilabel:
        raise ConfigError(f"data.root={root} holds multi-label shards (a set of labels per image); "
                          "set module.task=multilabel")
    return found


# --------------------------------------------------------------------------- this machine


def check_device(cfg: DictConfig) -> None:
    """A GPU trainer on a machine without one: one line before anything is built (Lightning's own
    message, "No supported gpu backend found!", names neither the setting nor the way out)."""
    accelerator = str((cfg.get("trainer") or {}).get("accelerator", ""))
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(f"trainer.accelerator={accelerator} needs a CUDA GPU and torch sees none here; "
                          f"use trainer=cpu (or trainer=default, which picks the device)")
    model = cfg.get("model")
    if isinstance(model, DictConfig) and model.get("attn_window") is not None and model.get("attn_backend") == "flex":
        from vitpipe.nn.patterns import flex_support

        on_gpu = accelerator in ("gpu", "cuda") or (accelerator in ("auto", "") and torch.cuda.is_available())
        support = flex_support("cuda" if on_gpu else "cpu")
        if not support["backward"]:  # the first training step would stop on it, after the data loaded
            raise ConfigError(f"model.attn_backend=flex cannot train on {'cuda' if on_gpu else 'cpu'} here "
                              f"({support['why']}); use model.attn_backend=auto or sdpa for training")
