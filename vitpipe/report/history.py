"""HistoryCallback: ``history.csv`` in the run directory, one row per training epoch.

Written from ``trainer.callback_metrics`` whatever the loggers are (none, wandb only, ...), so the
run's curves can always be redrawn from the run directory. The rows travel inside checkpoints
(callback state): a resumed run, even in a new run directory, writes the whole history, and rows of
epochs at or after the resumed one are replaced rather than duplicated.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_only

from vitpipe.run.csvfiles import dict_csv_text, read_csv_dicts
from vitpipe.run.files import atomic_write_text

HISTORY_FILE = "history.csv"
FIRST = ["epoch", "step", "lr"]


class HistoryCallback(L.Callback):
    """Append the epoch's train/* and val/* metrics (and the first param group's lr) at each
    training epoch end and rewrite ``<dirpath>/history.csv`` atomically, on rank 0.

    Args:
        dirpath: the run directory; None = ``trainer.default_root_dir``.

    Columns: epoch, step, lr, then every scalar ``train/*`` and ``val/*`` metric (epoch values:
    ``train/loss_epoch`` is written as ``train/loss``; per-step values are left out). Validation
    columns stay empty in epochs without validation (``check_val_every_n_epoch > 1``).
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath
        self.rows: list[dict[str, float]] = []
        self._val_epoch: int | None = None  # the epoch whose validation the current val/* values are

    def path(self, trainer: L.Trainer) -> Path:
        return Path(self.dirpath or trainer.default_root_dir) / HISTORY_FILE

    def state_dict(self) -> dict:
        return {"rows": [dict(r) for r in self.rows]}

    def load_state_dict(self, state: dict) -> None:
        self.rows = [dict(r) for r in state.get("rows", [])]

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # after a resume the loop restarts at this epoch: older rows stay, this one and later go
        self.rows = [r for r in self.rows if r["epoch"] < trainer.current_epoch]

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._val_epoch = trainer.current_epoch

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # runs before ModelCheckpoint's own on_train_epoch_end (Lightning runs checkpoint callbacks
        # last), so the checkpoint of this epoch already holds this row
        epoch = trainer.current_epoch
        row: dict[str, float] = {"epoch": epoch, "step": trainer.global_step}
        if trainer.optimizers:
            row["lr"] = float(trainer.optimizers[0].param_groups[0]["lr"])
        for key, value in trainer.callback_metrics.items():
            if key.endswith("_step") or value.numel() != 1:
                continue
            name = key.removesuffix("_epoch")
            if name.startswith("train/") or (name.startswith("val/") and self._val_epoch == epoch):
                row[name] = float(value)
        self.rows = [r for r in self.rows if r["epoch"] != epoch] + [row]
        self._write(trainer)

    @rank_zero_only
    def _write(self, trainer: L.Trainer) -> None:
        atomic_write_text(self.path(trainer), history_csv(self.rows))


def history_csv(rows: list[dict[str, float]]) -> str:
    """The rows as CSV text: epoch, step, lr first, then the metric columns sorted."""
    keys = {k for r in rows for k in r}
    columns = [k for k in FIRST if k in keys] + sorted(keys - set(FIRST))
    return dict_csv_text(({k: (int(v) if k in ("epoch", "step") else f"{v:.6g}") for k, v in r.items()}
                          for r in sorted(rows, key=lambda r: r["epoch"])), columns)


def read_history(path: Path) -> list[dict[str, float]]:
    """history.csv -> rows of floats (empty cells left out); [] when there is no file."""
    path = Path(path)
    if not path.is_file():
        return []
    return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in read_csv_dicts(path)]
