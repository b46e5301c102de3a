"""What a classifier attends to: the one list of attention-map methods and ``explain(net, x, method)``,
the one dispatch visualize, serve and demo draw their maps through (the maps themselves are
``vitpipe.viz.rollout``'s).

Canonical names, ``METHODS``: ``rollout`` (attention rollout, Abnar & Zuidema 2020) and ``gradient``
(gradient-weighted rollout for one class, Chefer et al. 2021). ``gradient_rollout``, the spelling serve's
``?explain=`` used, is accepted wherever a method is typed and read as ``gradient`` (``ALIASES``);
``gradient`` is canonical because visualize's files (``gradient_grid.png``), the demo's switch and the
faithfulness table already carried it. The names live with the command options
(``vitpipe.config.options``), where the one config check reads them before anything loads; this module
is the one place they are dispatched.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vitpipe.config.options import ALIASES, METHODS, check_method, method_name
from vitpipe.errors import ConfigError
from vitpipe.viz.rollout import gradient_rollout, naflex_rollout_for_model, rollout_for_model

__all__ = ["ALIASES", "METHODS", "check_method", "explain", "method_name", "methods_for"]


def methods_for(net: nn.Module, *, naflex: bool = False) -> tuple[str, ...]:
    """The methods ``explain`` can draw for ``net``: both for a vitpipe ViT on fixed-size images, attention
    rollout only for NaFlex patch dicts (each image on its own grid), none for a network without the ViT's
    attention (``model=timm``, e.g. a CNN)."""
    from vitpipe.models.vit import ViT

    if not isinstance(net, ViT):
        return ()
    return ("rollout",) if naflex else METHODS


def explain(net: nn.Module, x, method: str, *, target=None, head_fusion: str = "mean",
            discard_ratio: float = 0.0) -> Tensor | list[Tensor]:
    """Maps of ``method`` (any spelling ``method_name`` reads) on the patch grid, detached.

    x: images (B, C, H, W) -> (B, h, w); a NaFlex patch dict -> a list of (h_i, w_i) maps, each image
    on its own grid (attention rollout only). ``target``: the class gradient rollout explains (None: each
    image's predicted class; one class for all, or one per image); ``head_fusion`` applies to attention
    rollout (gradient rollout fuses heads by the gradient). Eval mode; works inside ``torch.inference_mode``
    (gradient rollout leaves it for its own backward pass).
    """
    method = check_method(method)
    if isinstance(x, dict):
        if method != "rollout":
            raise ConfigError(f"method={method}: a NaFlex checkpoint's images have one grid each; their attention "
                              "maps are attention rollout: choose rollout")
        return naflex_rollout_for_model(net, x, head_fusion=head_fusion, discard_ratio=discard_ratio)
    if method == "rollout":
        return rollout_for_model(net, x, head_fusion=head_fusion, discard_ratio=discard_ratio)
    with torch.inference_mode(False), torch.enable_grad():
        x = x.clone() if x.is_inference() else x  # an inference tensor cannot enter autograd
        return gradient_rollout(net, x, target, discard_ratio=discard_ratio).detach()
