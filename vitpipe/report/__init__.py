"""A run's evaluation report: per-epoch history, test predictions, per-class metrics, figures, calibration.

Files in the run directory: history.csv (every epoch), predictions.csv (after test) and report/
(per_class.csv, confusion_matrix.csv/.png, calibration.png, curves.png, errors.png, report.md),
every figure recomputable from the CSVs beside it.
"""

from vitpipe.report.calibration import expected_calibration_error, fit_temperature, reliability_bins
from vitpipe.report.callback import ReportCallback
from vitpipe.report.history import HistoryCallback, read_history
from vitpipe.report.predictions import Predictions, TestPredictions, read_predictions
from vitpipe.report.report import write_report

__all__ = [
    "HistoryCallback",
    "Predictions",
    "ReportCallback",
    "TestPredictions",
    "expected_calibration_error",
    "fit_temperature",
    "read_history",
    "read_predictions",
    "reliability_bins",
    "write_report",
]
