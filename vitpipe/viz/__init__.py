"""Attention visualisation: rollout, gradient rollout, raw and cross-attention maps, overlays."""

from vitpipe.run.checkpoint import load_from_checkpoint  # the notebooks' one-liner
from vitpipe.viz.callback import RolloutCallback
from vitpipe.viz.overlay import overlay, overlay_grid, save_figure, save_overlay, unnormalize
from vitpipe.viz.rollout import (
    attention_maps,
    attention_rollout,
    cross_attention_maps,
    gradient_rollout,
    naflex_rollout,
    naflex_rollout_for_model,
    rollout_for_model,
)

__all__ = [
    "RolloutCallback",
    "attention_maps",
    "attention_rollout",
    "cross_attention_maps",
    "gradient_rollout",
    "load_from_checkpoint",
    "naflex_rollout",
    "naflex_rollout_for_model",
    "overlay",
    "overlay_grid",
    "rollout_for_model",
    "save_figure",
    "save_overlay",
    "unnormalize",
]
