"""The parts of ``vitpipe.lit.checkpointing.PreemptionCheckpoint``, the callback that stops a run at a
batch boundary with a ``last.ckpt`` and resumes it exactly; each part is one thing a reader can name:

- ``signals.Interrupts``: Ctrl-C relayed as SIGTERM (Lightning's stop at the batch boundary), a second
  Ctrl-C stops at once (``SecondInterrupt``); owns which signal is stopping the run
- ``requeue.DeferredRequeue``: submitit's SLURM requeue handler, held back until the checkpoint is saved
- ``stop``: what the ``SIGTERMException`` that ends the run carries for ``vitpipe.tasks.cli``
- ``rng.RandomStreams``: every rank's random generators saved in each checkpoint and restored on resume
- ``resume``: the resume's message, the clean-up of temporary files killed saves left, and the quieted
  "dataloader is not resumable" warning where vitpipe's data state makes it wrong
"""
