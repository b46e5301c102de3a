"""``export(cfg) -> written path``: the body of ``scripts/export.py``.

    format=timm  out=DIR         config.json + model.safetensors (timm's hub layout) + README.md model card
    format=onnx  out=model.onnx  one self-contained file, dynamic batch

Both are written beside ``out`` first and checked there against the checkpoint's network (timm: logits
within 1e-5, loaded back through ``timm.create_model("local-dir:DIR")``; ONNX: within 1e-4 in
onnxruntime), then renamed to ``out``: a failed check or a kill leaves an earlier export intact. A
non-empty ``out`` folder is refused unless ``overwrite=true`` (an ONNX file is always replaced). ``out`` is
checked before the checkpoint is read (``vitpipe.run.outputs``): it may not be, contain or lie inside the
run it exports (an ONNX file may not replace one of its files), and it must be writable.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from vitpipe.config.options import FORMATS
from vitpipe.config.preflight import preflight
from vitpipe.data.preprocess import Preprocess, naflex_settings
from vitpipe.errors import ConfigError
from vitpipe.export.hub import push_folder
from vitpipe.export.model_card import model_card
from vitpipe.export.onnx_format import export_onnx
from vitpipe.export.staging import check_out_folder
from vitpipe.export.timm_format import save_timm, timm_arch
from vitpipe.inference.probs import calibration_temperature
from vitpipe.kinds import TaskKind
from vitpipe.run.outputs import check_not_input, check_writable, checkpoint_inputs
from vitpipe.run.paths import run_dir_of
from vitpipe.run.stored import config_of

__all__ = ["FORMATS", "export", "multilabel_thresholds", "onnx_metadata", "output_path"]


def output_path(cfg: DictConfig) -> Path | None:
    """``out`` checked against the disk (None: not given): writable, and for format=timm an empty folder
    unless ``overwrite``. Its name against the format is preflight's (``vitpipe.config.options``)."""
    if cfg.get("out") in (None, ""):
        return None
    out = Path(str(cfg.out))
    check_writable(out, key="out", folder=cfg.format == "timm")  # a read-only folder, a file in the way, a full disk
    if cfg.format == "timm":
        check_out_folder(out, overwrite=cfg.get("overwrite", False))  # before the checkpoint is read
    return out


def export(cfg: DictConfig) -> Path:
    from vitpipe.run.checkpoint import rebuild
    from vitpipe.run.paths import needs_kinds, resolve_ckpt_path
    from vitpipe.run.stored import load_checkpoint

    preflight(cfg, "export")  # every option, before the disk or the checkpoint is read
    out = output_path(cfg)
    path = resolve_ckpt_path(cfg.ckpt_path, log_dir=cfg.paths.log_dir, which="best",
                             usable=needs_kinds("classifier", command="export"))  # last: the newest classifier run
    inputs = checkpoint_inputs(path, cfg.ckpt_path)
    if out is not None:  # overwrite=true would swap the run's own folder out: refused before it is read
        check_not_input(out, inputs, key="out", folder=cfg.format == "timm")
    checkpoint = load_checkpoint(path)
    built = rebuild(checkpoint, path, paths=cfg.paths, task_name=cfg.task_name)
    net = built.net.cpu().eval()
    kind = built.module.kind  # the task kind the LightningModule chose once (vitpipe.kinds)
    if kind.generates:
        raise ConfigError(f"format={cfg.format} exports classifiers; {path} is a captioner "
                          "(use scripts/predict.py for its captions)")
    spec = Preprocess(built.datamodule, net, naflex=naflex_settings(config_of(checkpoint))).spec
    if out is None:  # e.g. <run output dir>/vit_nano_digits(.onnx)
        data = str(built.cfg.data.get("_target_", "")).rsplit(".", 1)[-1] if built.cfg.get("data") else ""
        stem = "_".join(filter(None, [str(built.cfg.model.get("name", "vit")), data.removesuffix("DataModule").lower()]))
        out = Path(cfg.paths.output_dir) / (stem + (".onnx" if cfg.format == "onnx" else ""))
        check_not_input(out, inputs, key="out", folder=cfg.format == "timm")

    thresholds = multilabel_thresholds(path, checkpoint, built, kind)
    if cfg.format == "onnx":
        diff = export_onnx(net, spec, out, kind=kind, metadata=onnx_metadata(thresholds, built.class_names),
                           class_names=built.class_names)  # the file names its classes, input and preprocessing
        print(f"vitpipe export: {out} ({out.stat().st_size / 1e6:.2f} MB; onnxruntime logits within {diff:.2g} "
              "of PyTorch's)")
        return out

    from vitpipe.lit.finetune import fold_probe_bn

    net = fold_probe_bn(net)  # module.probe_bn: its eval-mode BN absorbed into the head (timm has no place for it)
    timm_arch(net, spec)  # a part timm cannot express: one line, before anything is written
    class_names = built.class_names if built.class_names and len(built.class_names) == net.num_classes else None
    temperature = None if thresholds else calibration_temperature(path, checkpoint, tta="none")  # the card: plain logits
    card = model_card(name=out.name, net=net, arch=timm_arch(net, spec), spec=spec, train_config=config_of(checkpoint),
                      class_names=class_names, run_dir=run_dir_of(path), temperature=temperature, thresholds=thresholds)
    diff = save_timm(net, spec, out, class_names=class_names, readme=card, overwrite=cfg.get("overwrite", False),
                     thresholds=thresholds)
    print(f"vitpipe export: timm model in {out} (config.json, model.safetensors, README.md; "
          f"timm's logits within {diff:.2g} of the checkpoint's)")
    if cfg.get("push_to_hub"):
        url = push_folder(out, cfg.push_to_hub, private=bool(cfg.get("private", False)))
        print(f"vitpipe export: uploaded to {url}")
    return out


def multilabel_thresholds(path: Path, checkpoint: dict, built, kind: TaskKind) -> list[float] | None:
    """A multi-label checkpoint's per-class thresholds as predict applies them (thresholds.json fitted on it,
    else ``module.threshold``); None for a single-label one."""
    from vitpipe.inference.labels import class_thresholds

    if kind.name != "multilabel":
        return None
    return class_thresholds(path, checkpoint, built, None).tolist()


def onnx_metadata(thresholds: list[float] | None, class_names) -> dict[str, str] | None:
    """A multi-label ONNX file's ``metadata_props``: its outputs are logits to pass through a sigmoid, the
    per-class thresholds and class names as JSON lists; None for a single-label one."""
    if thresholds is None:
        return None
    import json

    meta = {"multi_label": "true", "outputs": "logits; sigmoid per class, a class predicted at sigmoid >= its threshold",
            "thresholds": json.dumps(thresholds)}
    if class_names:
        meta["label_names"] = json.dumps([str(n) for n in class_names])
    return meta
