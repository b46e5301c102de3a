"""``predict(cfg) -> output file``: the body of ``scripts/predict.py``: image files -> labels or captions.

checkpoint -> network + the run's eval transform (``vitpipe.data.preprocess``) -> batches of files ->

* classifiers: one row per image, ``path,label,prob,top2_label,top2_prob,...`` up to ``topk``
  (class names stored in the checkpoint); probabilities as eval computes them
  (``vitpipe.report.tta``): ``tta=hflip`` averages the softmax of the image and its mirror, then the
  temperature of a ``calibration.json`` beside the checkpoint divides the log of that, when it was
  fitted on this very checkpoint with this ``tta`` (else one line says why it is not applied);
* multi-label classifiers (``module.task=multilabel``): ``path,labels,probs,top1_label,top1_prob,...``:
  ``labels`` every class whose sigmoid score is >= its threshold (``a;b``, most probable first),
  ``probs`` their scores; thresholds: ``threshold=`` for all classes, else a thresholds.json beside the
  checkpoint tuned on it (``scripts/eval.py split=val tune_thresholds=true``), else the run's
  ``module.threshold``; no tta, no calibration (a softmax temperature);
* captioners: ``path,caption`` (the decoding settings the run validated with).

CSV, or JSON (a list of the same rows) when ``out`` ends in ``.json``, written through a temporary
file and a rename (CSV cells a spreadsheet would run as formulas, a class named ``=...``, get a leading
quote: ``vitpipe.run.csvfiles``); ``out`` is checked (name, folder, permission) before the checkpoint or any image
is read, so a bad path never costs the predictions. A file that does not decode is named on stderr
and skipped; the count is printed at the end.
"""

from __future__ import annotations

import glob
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from vitpipe.data.images import is_image_file, open_image
from vitpipe.data.preprocess import Preprocess, hflip_patches, naflex_settings
from vitpipe.errors import ConfigError
from vitpipe.report.tta import TTAS, tta_logits
from vitpipe.run.csvfiles import dict_csv_text
from vitpipe.run.files import atomic_write_text
from vitpipe.run.outputs import Input, check_not_input, checkpoint_inputs, named_checkpoint_inputs, prepare_output

OUT_SUFFIXES = (".csv", ".json")


# --------------------------------------------------------------------------- inputs


def find_images(spec: str) -> tuple[list[Path], int]:
    """The files ``images=`` names: a folder (its image files, recursively), one file, or a glob pattern.

    Returns (files sorted by path, how many files in the folder/glob were passed over as not images
    by their extension). A file named on its own is always tried.
    """
    spec = str(spec)
    path = Path(spec)
    if path.is_file():
        return [path], 0
    if path.is_dir():
        candidates = [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    elif glob.has_magic(spec):
        candidates = [Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file()]
    else:
        raise ConfigError(f"images={spec}: no such file or folder; pass a folder, an image file or a glob like 'dir/*.jpg'")
    files = sorted(p for p in candidates if is_image_file(p))  # the image folders' rule (vitpipe.data.images)
    if not files:
        raise ConfigError(f"images={spec} holds no image files (of {len(candidates)} file(s)); "
                          "pass a folder, an image file or a glob of images")
    return files, len(candidates) - len(files)


class ImageFiles(Dataset):
    """``(index, tensor (C, H, W) or None, why it failed or None)`` per file: a bad file never raises."""

    def __init__(self, files: list[Path], preprocess: Preprocess) -> None:
        self.files, self.preprocess = files, preprocess

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        try:
            return i, self.preprocess(open_image(self.files[i], self.preprocess.spec.mode)), None
        except Exception as err:  # PIL raises many types for broken files
            return i, None, (str(err).splitlines() or [type(err).__name__])[0]


class Collate:
    """Good items stacked with ``stack`` (``torch.stack`` for images, ``pad_batch`` for NaFlex patch dicts);
    bad ones listed. A class, not a closure, so DataLoader workers can pickle it."""

    def __init__(self, stack=torch.stack) -> None:
        self.stack = stack

    def __call__(self, items):
        ok = [(i, x) for i, x, _ in items if x is not None]
        bad = [(i, why) for i, x, why in items if x is None]
        x = self.stack([x for _, x in ok]) if ok else None  # (B, C, H, W) or a padded patch dict
        return [i for i, _ in ok], x, bad



def to_device(x, device):
    """A tensor or a patch dict of tensors on ``device``."""
    return {k: v.to(device) for k, v in x.items()} if isinstance(x, dict) else x.to(device)


def batch_len(x) -> int:
    return len(x["patches"]) if isinstance(x, dict) else x.shape[0]


# --------------------------------------------------------------------------- the model side


def class_probs(net, x: Tensor, *, tta: str = "none", temperature: float | None = None,
                multilabel: bool = False) -> Tensor:
    """Softmax probabilities (B, classes) of a classifier: logits -> TTA -> temperature (Guo et al. 2017)
    -> softmax, eval's composition (``vitpipe.report.tta.tta_logits``). ``x``: images (B, C, H, W) or a
    NaFlex patch dict (mirrored per image on its own grid for ``tta=hflip``). ``multilabel``: the sigmoid
    of each logit instead (no TTA, no temperature: ``load_predictor`` refuses them for such checkpoints)."""
    logits = net(x)
    if not (isinstance(logits, Tensor) and logits.ndim == 2 and logits.shape[0] == batch_len(x)):
        what = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise ConfigError(f"predict: {type(net).__name__} returns {what}, not logits (B, classes); "
                          "predict handles classifiers and captioners")
    if multilabel:
        return logits.float().sigmoid()
    flipped = (lambda: net(hflip_patches(x, net.patch_size))) if isinstance(x, dict) else (lambda: net(x.flip(-1)))
    return tta_logits(logits, flipped, tta=tta, temperature=temperature).float().softmax(dim=-1)


def class_rows(paths: list[str], probs: Tensor, names: list[str], topk: int) -> list[dict]:
    """``path,label,prob,top2_label,top2_prob,...`` rows from probabilities (B, classes)."""
    values, idx = probs.topk(min(topk, probs.shape[1]), dim=1)  # (B, k) each
    rows = []
    for path, v, i in zip(paths, values.tolist(), idx.tolist()):
        row = {"path": path}
        for rank, (p, c) in enumerate(zip(v, i), start=1):
            key = "" if rank == 1 else f"top{rank}_"
            row[f"{key}label"], row[f"{key}prob"] = names[c], p
        rows.append(row)
    return rows


def label_sets(scores: Tensor, names: list[str], thresholds: Tensor, topk: int) -> list[dict]:
    """Multi-label answers per row of sigmoid scores (B, classes): ``labels`` every class whose score is
    >= its threshold (``thresholds`` (classes,)), most probable first, ``probs`` their scores, ``topk``
    ``{"labels", "probs"}`` of the k highest scores whatever the thresholds. Predict's rows and serve's bodies."""
    above = scores.double() >= thresholds.double()  # (B, classes)
    out = []
    for row, keep, top in zip(scores.tolist(), above.tolist(), top_labels(scores, names, topk)):
        chosen = sorted((c for c, k in enumerate(keep) if k), key=lambda c: -row[c])
        out.append({"labels": [names[c] for c in chosen], "probs": [row[c] for c in chosen], "topk": top})
    return out


def label_set_rows(paths: list[str], scores: Tensor, names: list[str], thresholds: Tensor, topk: int) -> list[dict]:
    """``path,labels,probs,top1_label,top1_prob,...`` rows (labels and probs are lists: ``a;b`` in a CSV)."""
    rows = []
    for path, answer in zip(paths, label_sets(scores, names, thresholds, topk)):
        row = {"path": path, "labels": answer["labels"], "probs": answer["probs"]}
        for rank, (n, p) in enumerate(zip(answer["topk"]["labels"], answer["topk"]["probs"]), start=1):
            row[f"top{rank}_label"], row[f"top{rank}_prob"] = n, p
        rows.append(row)
    return rows


def label_set_columns(topk: int, num_classes: int) -> list[str]:
    return ["path", "labels", "probs"] + [f"top{r}_{k}" for r in range(1, min(topk, num_classes) + 1)
                                          for k in ("label", "prob")]


def columns(topk: int, num_classes: int) -> list[str]:
    cols = ["path", "label", "prob"]
    for rank in range(2, min(topk, num_classes) + 1):
        cols += [f"top{rank}_label", f"top{rank}_prob"]
    return cols


def label_names(class_names, num_classes: int) -> list[str]:
    """The checkpoint's class names, or the indices as strings (with a one-line note) when it has none."""
    if class_names and len(class_names) == num_classes:
        return [str(n) for n in class_names]
    why = "stores no class names" if not class_names else f"stores {len(class_names)} class names for {num_classes} classes"
    print(f"vitpipe: note: the checkpoint {why}; labels are class indices", file=sys.stderr)
    return [str(i) for i in range(num_classes)]


# --------------------------------------------------------------------------- the loaded checkpoint


@dataclass
class Predictor:
    """A checkpoint ready to predict, as ``predict`` (and ``scripts/serve.py``) use it: the network on its
    device in eval mode, the checkpoint's eval transform, and the calibration temperature for ``tta``."""

    path: Path  # the checkpoint file ckpt_path resolved to
    checkpoint: dict  # as load_checkpoint read it (weights only)
    built: Any  # vitpipe.run.checkpoint.Rebuilt
    net: torch.nn.Module
    captioner: bool
    preprocess: Preprocess  # PIL image -> (C, H, W) tensor, or a NaFlex patch dict
    tta: str
    temperature: float | None  # of a calibration.json fitted on this checkpoint with this tta, else None
    multilabel: bool = False  # a sigmoid per class (module.task=multilabel): label sets at ``thresholds``
    thresholds: Tensor | None = None  # (classes,) for a multi-label checkpoint


def load_predictor(ckpt_path, *, paths=None, task_name: str = "predict", device="cpu", tta: str = "none",
                   threshold: float | None = None) -> Predictor:
    """Resolve ``ckpt_path`` (file | run dir | last), read it safely, rebuild the network and its eval
    transform (the NaFlex rule for NaFlex checkpoints) and find the calibration temperature: everything
    ``predict`` does before the first image. ConfigError (one line) for a checkpoint or ``tta`` it cannot use.

    Multi-label checkpoints: ``thresholds`` per class are ``threshold`` when given, else those of a
    thresholds.json beside the checkpoint fitted on it (``scripts/eval.py split=val tune_thresholds=true``),
    else the run's ``module.threshold``; tta and calibration.json do not apply (tta refused)."""
    from vitpipe.report.evaluation import unseen_flip_warning
    from vitpipe.report.multilabel import is_multilabel
    from vitpipe.run.checkpoint import load_checkpoint, rebuild
    from vitpipe.run.paths import needs_kinds, resolve_ckpt_path

    if tta not in TTAS:
        raise ConfigError(f"tta={tta!r}; valid choices: {', '.join(TTAS)}")
    path = resolve_ckpt_path(ckpt_path, log_dir=paths.log_dir if paths is not None else None, which="best",
                             usable=needs_kinds("classifier", "captioner", command=task_name))  # last: not an MAE run
    checkpoint = load_checkpoint(path)
    multilabel = is_multilabel(checkpoint.get("vitpipe_config"))
    if multilabel and tta != "none":
        raise ConfigError(f"tta={tta} averages softmax probabilities; this checkpoint is multi-label "
                          "(module.task=multilabel): use tta=none")
    if threshold is not None and not multilabel:
        raise ConfigError(f"threshold={threshold} applies to multi-label checkpoints; this one is single-label: drop it")
    built = rebuild(checkpoint, path, paths=paths, task_name=task_name)
    net = built.net.to(device).eval()
    captioner = hasattr(net, "generate")
    if not captioner and not getattr(net, "num_classes", None):  # e.g. MAE pre-training: no classes to answer
        raise ConfigError(f"{path} holds a {type(net).__name__}, not a classifier or a captioner; {task_name} "
                          "answers those: fine-tune it into a classifier first (model.pretrained=<its run>, docs/mae.md)")
    if captioner and tta != "none":
        raise ConfigError(f"tta={tta} applies to classifiers; this checkpoint is a captioner: drop tta")
    warning = unseen_flip_warning(checkpoint.get("vitpipe_config"), tta)
    if warning:  # the same averaging as eval's tta=hflip, the same loss on a network that never saw a flip
        print(f"vitpipe: warning: {warning}", file=sys.stderr, flush=True)
    naflex = naflex_settings(checkpoint.get("vitpipe_config"))
    if naflex is not None and captioner:
        raise ConfigError("data.naflex is set on a captioner checkpoint; NaFlex prediction supports classifiers")
    preprocess = Preprocess(built.datamodule, net.encoder if captioner else net, naflex=naflex)
    temperature = None if captioner or multilabel else calibration_temperature(path, checkpoint, tta=tta)
    thresholds = class_thresholds(path, checkpoint, built, threshold) if multilabel else None
    return Predictor(path=path, checkpoint=checkpoint, built=built, net=net, captioner=captioner,
                     preprocess=preprocess, tta=tta, temperature=temperature, multilabel=multilabel,
                     thresholds=thresholds)


def class_thresholds(path: Path, checkpoint: dict, built, threshold: float | None) -> Tensor:
    """(classes,) thresholds of a multi-label checkpoint: ``threshold`` for all, else its thresholds.json
    (fitted on this checkpoint), else ``module.threshold``; one line on stderr says which file was used or passed over."""
    from vitpipe.report.multilabel import find_thresholds

    c = int(built.net.num_classes)
    if threshold is not None:
        return torch.full((c,), float(threshold), dtype=torch.float64)
    tuned, line = find_thresholds(path, checkpoint, label_names(built.class_names, c))
    if line:
        print(f"vitpipe: note: {line}", file=sys.stderr, flush=True)
    if tuned is not None:
        return tuned
    return torch.full((c,), float(built.module.hparams.get("threshold", 0.5)), dtype=torch.float64)


def captions(loaded: Predictor, x) -> list[str]:
    """A captioner's captions of a batch ``x`` (on its device), with the decoding settings the run validated with."""
    hp = loaded.built.module.hparams
    ids = loaded.net.generate(x, max_len=hp.max_gen_len, beam_size=hp.beam_size, length_penalty=hp.length_penalty)
    return loaded.built.module.tokenizer.batch_decode(ids)


def top_labels(probs: Tensor, names: list[str], topk: int) -> list[dict]:
    """``{"labels": [...], "probs": [...]}`` per row of probabilities (B, classes), most probable first:
    the ranking ``class_rows`` writes."""
    values, idx = probs.topk(min(topk, probs.shape[1]), dim=1)  # (B, k) each
    return [{"labels": [names[c] for c in i], "probs": v} for v, i in zip(values.tolist(), idx.tolist())]


# --------------------------------------------------------------------------- files beside a checkpoint


def calibration_temperature(ckpt_path: Path, checkpoint: dict, *, tta: str = "none") -> float | None:
    """The temperature of a ``calibration.json`` (beside the checkpoint, or in its run directory) fitted
    on this checkpoint with this ``tta``; else None, with one line on stderr when a file was passed over."""
    from vitpipe.report.calibration import find_temperature

    temperature, line = find_temperature(ckpt_path, checkpoint, tta=tta)
    if temperature is None and line:
        print(f"vitpipe: note: {line}", file=sys.stderr, flush=True)
    return temperature


# --------------------------------------------------------------------------- writing


def check_out(spec) -> Path:
    """The file ``out=`` names, after checking that it can be written: a .csv or .json name, not a
    folder, under folders that are folders (or can be made) in which this process may create files.
    ConfigError (one line naming ``out=`` and why) otherwise; nothing is created."""
    out = Path(str(spec))
    fix = "pass out=<a writable folder>/<name>.csv or .json"
    if out.suffix.lower() not in OUT_SUFFIXES:
        raise ConfigError(f"out={spec}: the file name must end in .csv or .json")
    if out.is_dir():
        raise ConfigError(f"out={spec} is a folder; {fix}")
    folder = out.parent
    while not folder.exists() and folder != folder.parent:  # the nearest folder that exists: the file goes under it
        folder = folder.parent
    if not folder.is_dir():
        raise ConfigError(f"out={spec}: {folder} is a file, not a folder; {fix}")
    try:  # the real test of permission (root ignores mode bits, read-only mounts refuse root too)
        tempfile.TemporaryFile(dir=folder).close()  # O_TMPFILE where it exists: never visible in the folder
    except OSError as e:
        raise ConfigError(f"out={spec}: cannot create files in {folder} ({e.strerror or e}); {fix}") from None
    return out


def cell(v) -> str:
    """A CSV cell: floats as %.6g, lists (a label set, its probabilities) joined by ``;``."""
    if isinstance(v, list):
        return ";".join(cell(x) for x in v)
    return f"{v:.6g}" if isinstance(v, float) else v


def write_rows(rows: list[dict], cols: list[str], out: Path) -> Path:
    """CSV (floats as %.6g) or JSON by the suffix of ``out``, through a temporary file and a rename."""
    if out.suffix.lower() == ".json":
        atomic_write_text(out, json.dumps(rows, indent=1) + "\n")
        return out
    # class names and paths as cells a spreadsheet shows, never evaluates (vitpipe.run.csvfiles)
    atomic_write_text(out, dict_csv_text(({k: cell(v) for k, v in row.items()} for row in rows), cols))
    return out


# --------------------------------------------------------------------------- the command


def check_options(cfg: DictConfig) -> None:
    """Everything checkable before the checkpoint is read."""
    for key, minimum in (("topk", 1), ("batch_size", 1), ("num_workers", 0)):
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ConfigError(f"{key}={v!r}: expected an int >= {minimum}")
    if cfg.tta not in TTAS:
        raise ConfigError(f"tta={cfg.tta!r}; valid choices: {', '.join(TTAS)}")
    check_threshold(cfg.get("threshold"))
    check_out(cfg.out)


def check_threshold(t) -> None:
    """``threshold=`` of predict and serve: null or a probability in [0, 1] (ConfigError otherwise)."""
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0):
        raise ConfigError(f"threshold={t!r}: null (tuned thresholds.json, else the run's module.threshold) "
                          "or a probability in [0, 1]")


def predict(cfg: DictConfig) -> Path:
    """Predict every image ``cfg.images`` names with checkpoint ``cfg.ckpt_path``; returns the file written."""
    from vitpipe.config.build import resolve_device

    check_options(cfg)
    device = resolve_device(cfg.device)
    files, not_images = find_images(cfg.images)
    # out= never replaces what it reads: the checkpoint, a file of its run, an image (vitpipe.run.outputs)
    images = [Input(f, f"an image images={cfg.images} reads") for f in files] if Path(str(cfg.out)).exists() else []
    prepare_output(cfg.out, [*named_checkpoint_inputs(cfg.ckpt_path), *images], key="out", folder=False)
    loaded = load_predictor(cfg.ckpt_path, paths=cfg.paths, task_name=cfg.task_name, device=device, tta=cfg.tta,
                            threshold=cfg.get("threshold"))
    check_not_input(cfg.out, checkpoint_inputs(loaded.path, cfg.ckpt_path), key="out", folder=False)  # ckpt_path=last
    built, net, captioner, preprocess, temperature = (loaded.built, loaded.net, loaded.captioner, loaded.preprocess,
                                                      loaded.temperature)
    loader = DataLoader(ImageFiles(files, preprocess), batch_size=cfg.batch_size, num_workers=cfg.num_workers,
                        collate_fn=Collate(preprocess.collate))

    rows, bad, names = [], 0, None
    if captioner:
        cols = ["path", "caption"]
    with torch.inference_mode():
        for indices, x, failed in tqdm(loader, desc="predict", unit="batch", file=sys.stderr):
            for i, why in failed:
                tqdm.write(f"vitpipe: skipped {files[i]}: {why}", file=sys.stderr)
            bad += len(failed)
            if x is None:
                continue
            x, paths = to_device(x, device), [str(files[i]) for i in indices]
            if captioner:
                rows += [{"path": p, "caption": c} for p, c in zip(paths, captions(loaded, x))]
            else:
                probs = class_probs(net, x, tta=cfg.tta, temperature=temperature, multilabel=loaded.multilabel)
                if names is None:  # the class count as the network reports it
                    names = label_names(built.class_names, probs.shape[1])
                    cols = (label_set_columns if loaded.multilabel else columns)(cfg.topk, len(names))
                if loaded.multilabel:
                    rows += label_set_rows(paths, probs.cpu(), names, loaded.thresholds, cfg.topk)
                else:
                    rows += class_rows(paths, probs.cpu(), names, cfg.topk)
    if not rows:
        raise ConfigError(f"images={cfg.images}: none of the {len(files)} file(s) could be read as an image")
    out = write_rows(rows, cols, check_out(cfg.out))  # checked again: the run took a while
    notes = [f"{bad} unreadable file(s) skipped"] if bad else []
    notes += [f"{not_images} non-image file(s) ignored"] if not_images else []
    notes += [f"temperature {temperature:g} from calibration.json, fitted on this checkpoint with tta={cfg.tta}"] \
        if temperature else []
    print(f"vitpipe predict: {len(rows)} image(s) -> {out}" + (f" ({'; '.join(notes)})" if notes else ""))
    return out
