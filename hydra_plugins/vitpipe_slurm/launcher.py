"""See the package docstring."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from hydra.core.utils import JobReturn, JobStatus

try:  # the `sweeps` extra; without it Hydra's plugin scan must not warn on every command
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher
except ImportError:
    SubmititSlurmLauncher = None


class JobLost(RuntimeError):
    """A SLURM job that ended without a result."""


if SubmititSlurmLauncher is not None:
    class SlurmLauncher(SubmititSlurmLauncher):
        def launch(self, job_overrides, initial_job_idx: int):
            with _settled_results():
                returns = super().launch(job_overrides, initial_job_idx)
            lost = [r for r in returns if r.status == JobStatus.FAILED and isinstance(r._return_value, JobLost)]
            if lost:
                from vitpipe.sweep.summary import write_summary

                sweep_dir = Path(str(self.config.hydra.sweep.dir))
                write_summary(sweep_dir, self.config.get("optimized_metric"))
                for r in lost:
                    print(f"vitpipe: error: {r._return_value}", file=sys.stderr)
                print(f"vitpipe: {len(returns) - len(lost)} of {len(returns)} job(s) finished; sweep summary in "
                      f"{sweep_dir / 'summary.md'}", file=sys.stderr)
                sys.exit(1)
            return returns


class _Settled:
    """A submitit job whose ``results()`` does not raise when SLURM ended it without a result: its
    state goes to ``<job dir>/.slurm_state`` and the result is a FAILED JobReturn holding ``JobLost``."""

    def __init__(self, job, overrides, sweep_key: str, idx: int, config_dir: str) -> None:
        self.job, self.overrides, self.idx, self.job_dir = job, list(overrides), idx, Path(config_dir) / str(idx)

    def results(self):
        import submitit

        try:
            return self.job.results()
        except submitit.core.utils.UncompletedJobError:
            state = (str(self.job.state).split() or ["UNKNOWN"])[0]  # "CANCELLED by 0" -> CANCELLED
            from vitpipe.run.files import atomic_write_text
            from vitpipe.sweep.summary import SLURM_STATE

            self.job_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.job_dir / SLURM_STATE, state + "\n")
            lost = JobLost(f"job #{self.idx} ({' '.join(self.overrides)}): SLURM job {self.job.job_id} "
                           f"ended {state} without a result; its run directory is {self.job_dir}")
            return [JobReturn(overrides=self.overrides, status=JobStatus.FAILED, _return_value=lost)]


@contextlib.contextmanager
def _settled_results():
    """Upstream waits with ``[j.results()[0] for j in jobs]`` and so stops at the first lost job;
    hand it jobs whose results() settle instead."""
    import submitit

    original = submitit.AutoExecutor.map_array

    def map_array(executor, fn, overrides, sweep_keys, idxs, *rest):
        jobs = original(executor, fn, overrides, sweep_keys, idxs, *rest)
        sweep_dir = str(fn.config.hydra.sweep.dir)
        return [_Settled(j, o, k, i, sweep_dir) for j, o, k, i in zip(jobs, overrides, sweep_keys, idxs)]

    submitit.AutoExecutor.map_array = map_array
    try:
        yield
    finally:
        submitit.AutoExecutor.map_array = original
