"""Inference on a stored run: the library under predict, serve, demo, visualize and export (timm's
``inference.py`` is a thin CLI over library calls; so is ``vitpipe.tasks.predict``).

* ``load``: a checkpoint -> ``Predictor`` (network in eval mode, eval transform, temperature, thresholds);
* ``images``: the image files ``images=`` names -> batches on a device;
* ``probs``: class probabilities (logits -> TTA -> temperature -> softmax, or a sigmoid per class);
* ``tta``: the TTA and temperature composition eval shares;
* ``labels``: class names, top-k, multi-label label sets and their thresholds;
* ``explain``: ``explain(net, x, method)``, the one dispatch of the attention-map methods (their one list,
  ``METHODS`` with the ``gradient_rollout`` alias, lives with the command options: ``vitpipe.config.options``).

Nothing is imported here: ``vitpipe.report`` imports ``tta`` while ``load`` imports the report's file
readers, and an eager package would make that a cycle at import time.
"""
