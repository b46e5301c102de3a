"""``predict(cfg) -> output file``: the body of ``scripts/predict.py``: image files -> labels or captions.

checkpoint -> network + the run's eval transform (``vitpipe.data.preprocess``) -> batches of files ->

* classifiers: one row per image, ``path,label,prob,top2_label,top2_prob,...`` up to ``topk``
  (class names stored in the checkpoint); probabilities as eval computes them
  (``vitpipe.inference.probs``): ``tta=hflip`` averages the softmax of the image and its mirror, then the
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

This module is the command only (options -> ``vitpipe.inference`` calls -> rows written); loading a run,
probabilities, TTA, temperature, label sets and top-k are the inference library's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch import Tensor
from torch.utils.data import DataLoader
from tqdm import tqdm

from vitpipe.config.options import check_out
from vitpipe.config.preflight import preflight
from vitpipe.errors import ConfigError
from vitpipe.inference.images import Collate, ImageFiles, find_images, to_device
from vitpipe.inference.labels import label_names, label_sets, top_labels
from vitpipe.inference.load import captions, load_predictor
from vitpipe.inference.probs import class_probs
from vitpipe.run.csvfiles import dict_csv_text
from vitpipe.run.files import atomic_write_text
from vitpipe.run.outputs import Input, check_not_input, checkpoint_inputs, named_checkpoint_inputs, prepare_output

# --------------------------------------------------------------------------- rows


def class_rows(paths: list[str], probs: Tensor, names: list[str], topk: int) -> list[dict]:
    """``path,label,prob,top2_label,top2_prob,...`` rows from probabilities (B, classes): ``top_labels``' ranking."""
    rows = []
    for path, top in zip(paths, top_labels(probs, names, topk)):
        row = {"path": path}
        for rank, (n, p) in enumerate(zip(top["labels"], top["probs"]), start=1):
            key = "" if rank == 1 else f"top{rank}_"
            row[f"{key}label"], row[f"{key}prob"] = n, p
        rows.append(row)
    return rows


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


# per classifier kind (``kind.name``): its columns, and its rows from (paths, probabilities, names, the
# Predictor, topk): the top-k ranking, or the label set at the Predictor's thresholds
ROWS = {
    "multiclass": (columns, lambda paths, probs, names, loaded, topk: class_rows(paths, probs, names, topk)),
    "multilabel": (label_set_columns, lambda paths, probs, names, loaded, topk:
                   label_set_rows(paths, probs, names, loaded.thresholds, topk)),
}


# --------------------------------------------------------------------------- writing


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


def predict(cfg: DictConfig) -> Path:
    """Predict every image ``cfg.images`` names with checkpoint ``cfg.ckpt_path``; returns the file written."""
    from vitpipe.config.build import resolve_device

    preflight(cfg, "predict")  # every option, before the checkpoint or an image is read
    device = resolve_device(cfg.device)
    files, not_images = find_images(cfg.images)
    # out= never replaces what it reads: the checkpoint, a file of its run, an image (vitpipe.run.outputs)
    images = [Input(f, f"an image images={cfg.images} reads") for f in files] if Path(str(cfg.out)).exists() else []
    prepare_output(cfg.out, [*named_checkpoint_inputs(cfg.ckpt_path), *images], key="out", folder=False)
    loaded = load_predictor(cfg.ckpt_path, paths=cfg.paths, task_name=cfg.task_name, device=device, tta=cfg.tta,
                            threshold=cfg.get("threshold"), tome_r=cfg.get("model_tome_r"))
    check_not_input(cfg.out, checkpoint_inputs(loaded.path, cfg.ckpt_path), key="out", folder=False)  # ckpt_path=last
    built, net, kind, preprocess, temperature = (loaded.built, loaded.net, loaded.kind, loaded.preprocess,
                                                 loaded.temperature)
    loader = DataLoader(ImageFiles(files, preprocess), batch_size=cfg.batch_size, num_workers=cfg.num_workers,
                        collate_fn=Collate(preprocess.collate))

    rows, bad, names = [], 0, None
    if kind.generates:
        cols = ["path", "caption"]
    with torch.inference_mode():
        for indices, x, failed in tqdm(loader, desc="predict", unit="batch", file=sys.stderr):
            for i, why in failed:
                tqdm.write(f"vitpipe: skipped {files[i]}: {why}", file=sys.stderr)
            bad += len(failed)
            if x is None:
                continue
            x, paths = to_device(x, device), [str(files[i]) for i in indices]
            if kind.generates:
                rows += [{"path": p, "caption": c} for p, c in zip(paths, captions(loaded, x))]
            else:
                probs = class_probs(net, x, kind=kind, tta=cfg.tta, temperature=temperature)
                kind_columns, kind_rows = ROWS[kind.name]
                if names is None:  # the class count as the network reports it
                    names = label_names(built.class_names, probs.shape[1])
                    cols = kind_columns(cfg.topk, len(names))
                rows += kind_rows(paths, probs.cpu(), names, loaded, cfg.topk)
    if not rows:
        raise ConfigError(f"images={cfg.images}: none of the {len(files)} file(s) could be read as an image")
    out = write_rows(rows, cols, check_out(cfg.out))  # checked again: the run took a while
    notes = [f"{bad} unreadable file(s) skipped"] if bad else []
    notes += [f"{not_images} non-image file(s) ignored"] if not_images else []
    notes += [f"temperature {temperature:g} from calibration.json, fitted on this checkpoint with tta={cfg.tta}"] \
        if temperature else []
    print(f"vitpipe predict: {len(rows)} image(s) -> {out}" + (f" ({'; '.join(notes)})" if notes else ""))
    return out
