"""ReportCallback: after ``trainer.test``, ``predictions.csv`` and ``report/`` in the run directory.

Rank 0 writes the files; the figures also go to wandb and TensorBoard when those loggers are on.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from PIL import Image

from vitpipe.report.multilabel import write_multilabel_report
from vitpipe.report.predictions import PREDICTIONS_FILE, TestPredictions
from vitpipe.report.report import REPORT_DIR, write_report
from vitpipe.report.samples import sample_image


class ReportCallback(TestPredictions):
    """Collect the test predictions (``test/ece`` logged) and write the run's report.

    Args:
        dirpath: the run directory; None = ``trainer.default_root_dir``.
        split: the name of the evaluated split, shown in report.md (eval with ``split=val``).
        title: an extra line for report.md and the calibration figure (e.g. the temperature).
    """

    def __init__(self, dirpath: str | None = None, split: str = "test", title: str = "") -> None:
        super().__init__()
        self.dirpath, self.split, self.title = dirpath, split, title
        self.figures: dict[str, Path] = {}
        # multi-label: (C,) per-class thresholds to report at (thresholds.json) and where they came from
        self.thresholds, self.threshold_source = None, None

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.result is None or not trainer.is_global_zero:
            return
        run_dir = Path(self.dirpath or trainer.default_root_dir)
        dm = trainer.datamodule
        names = getattr(dm, "class_names", None)
        ds = getattr(dm, "data_test", None)
        # keyed by the split evaluated (eval's split=val runs the test loop on the validation set)
        metrics = {f"{self.split}/{k.removeprefix('test/')}": float(v) for k, v in trainer.callback_metrics.items()
                   if k.startswith("test/") and v.numel() == 1}
        image = (lambda i: sample_image(ds, i)) if ds is not None else None
        # the task kind that collected the rows picks the report (one per classifier kind)
        self.figures = REPORTS[pl_module.kind.name](self, pl_module, run_dir, names, metrics, image)
        log_figures(trainer, self.figures)

    def _multiclass_report(self, pl_module, run_dir: Path, names, metrics: dict, image) -> dict[str, Path]:
        self.result.write(run_dir / PREDICTIONS_FILE, list(names) if names else None)
        return write_report(run_dir, list(names) if names else None,
                            num_classes=getattr(pl_module.net, "num_classes", None),
                            image=image, metrics=metrics, split=self.split, title=self.title)

    def _multilabel_report(self, pl_module, run_dir: Path, names, metrics: dict, image) -> dict[str, Path]:
        """Scores per class: the per-class AP report."""
        c = self.result.scores.shape[1]
        if self.thresholds is not None:  # the "predicted" column and the report at the tuned thresholds
            self.result.threshold = self.thresholds
        self.result.write(run_dir / PREDICTIONS_FILE, list(names) if names else [str(i) for i in range(c)])
        return write_multilabel_report(
            run_dir, threshold=np.asarray(self.result.threshold, dtype=np.float64), split=self.split,
            threshold_source=self.threshold_source, metrics={k: v for k, v in metrics.items() if "/ap/" not in k},
            image=image)


REPORTS = {"multiclass": ReportCallback._multiclass_report, "multilabel": ReportCallback._multilabel_report}


def log_figures(trainer: L.Trainer, figures: dict[str, Path]) -> None:
    """The PNGs as images under ``report/<name>`` in wandb / TensorBoard, when those loggers are on."""
    step = trainer.global_step
    for logger in trainer.loggers:
        if not isinstance(logger, (WandbLogger, TensorBoardLogger)):
            continue
        for name, path in figures.items():
            pixels = np.asarray(Image.open(path).convert("RGB"))  # (H, W, 3) uint8
            if isinstance(logger, WandbLogger):
                logger.log_image(key=f"{REPORT_DIR}/{name}", images=[pixels], step=step)
            else:
                logger.experiment.add_image(f"{REPORT_DIR}/{name}", pixels, global_step=step, dataformats="HWC")
