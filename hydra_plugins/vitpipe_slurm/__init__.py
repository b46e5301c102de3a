"""vitpipe's SLURM launcher (``hydra/launcher=slurm``): hydra-submitit-launcher's, waiting for every
job of the sweep even when one does not finish.

The upstream launcher collects results in job order and raises at the first job that produced
none (``scancel``, a time limit after the last requeue, a node failure): the multirun then ends
with submitit's traceback while later jobs may still be running, and the summary calls the lost
job "incomplete". Here each job is waited for; one that did not finish gets its SLURM state
(``CANCELLED``, ``TIMEOUT``, ``FAILED``, ...) written to ``<job dir>/.slurm_state`` (the sweep
summary's status column shows it), one line names it, and once all jobs are accounted for the
summary is written and the command exits with status 1.

Hydra finds launchers only in the ``hydra_plugins`` namespace, hence this package.
"""
