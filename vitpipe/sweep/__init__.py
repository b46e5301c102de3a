"""Sweeps: the summary of a multirun (summary.csv/md, a figure) and the Optuna search's helpers."""
