"""Named variants: a table of dimensions (big_vision ``decode_variant``, timm's registry).

``create_model("vit_b16", num_classes=10, pos_embed="sincos2d")`` builds a ViT-B/16 with those
overrides. Dimensions follow timm/the ViT paper; the ``*4`` variants use 4-px patches for
28-32 px images (CIFAR, Fashion-MNIST), where 16-px patches would leave a 2x2 grid.

The table (``VARIANTS``, kept as plain data in variants.py so that mae.py and the configs' resolver read it
without importing the builders or torch) is the one owner of what a name means. A row holds every constructor value in which the
variant departs from ``ViT``'s defaults (its dimensions, and e.g. vit_nano's fixed positions or the
big variants' stochastic depth), and ``variant_kwargs(name)`` is the whole set. The Hydra model
configs read it: conf/model/vit.yaml takes every ViT argument through ``${variant:${.name},<key>}``
(``vitpipe.config.resolvers``), so ``model=vit_nano`` builds what ``create_model("vit_nano")`` builds, and
a new variant is one line in variants.py plus a two-line conf/model/<name>.yaml (``defaults: [vit]``,
``name: <name>``).

MAE variants (``create_mae``) name their encoder's row of VARIANTS and add only the decoder and loss, so
``mae_vit_b16``'s encoder is ``vit_b16``'s dimensions and loads into a ``vit_b16`` classifier.
"""

from __future__ import annotations

from vitpipe.models.mae import MaskedAutoencoderViT
from vitpipe.models.variants import (  # the table and what a name means: plain data, no torch (variants.py)
    MAE_VARIANTS,
    TIMM_NAMES,
    VARIANTS,
    list_mae_models,
    list_models,
    mae_kwargs,
    variant_kwargs,
    variant_value,
)
from vitpipe.models.vit import ViT

__all__ = ["MAE_VARIANTS", "TIMM_NAMES", "VARIANTS", "create_mae", "create_model", "list_mae_models", "list_models",
           "mae_kwargs", "variant_kwargs", "variant_value"]


def create_mae(name: str, *, dim: int | None = None, **overrides) -> MaskedAutoencoderViT:
    """Build MAE variant ``name`` with keyword overrides (any ``MaskedAutoencoderViT`` argument).

    ``dim`` is the ViT configs' name for the encoder width: when given it is the ``embed_dim``, so a
    config that shrinks every ViT (``debug=fast`` sets ``model.dim``) shrinks an MAE's encoder too.
    """
    if dim is not None:
        overrides["embed_dim"] = dim
    return MaskedAutoencoderViT(**{**mae_kwargs(name), **overrides})


def create_model(name: str, *, pretrained: bool | str | None = None, pretrained_head: bool = True,
                 **overrides) -> ViT:
    """Build variant ``name`` with keyword overrides (any ``ViT`` argument).

    pretrained: ``True`` loads the variant's timm weights; a string is a timm model name or a path
    to a ``.safetensors``/``.pth`` file (or a vitpipe Lightning checkpoint). Heads whose class
    count differs are re-initialised; positional tables are resampled to the new grid.
    pretrained_head: False re-initialises the head even when the class count agrees (a source
    task with other classes).
    """
    if name not in VARIANTS:
        raise ValueError(f"unknown model name={name!r}; valid choices: {', '.join(VARIANTS)}")
    model = ViT(**{**VARIANTS[name], **overrides})
    if pretrained:
        from vitpipe.models.weights import load_pretrained

        source = TIMM_NAMES.get(name) if pretrained is True else pretrained
        if source is None:
            raise ValueError(f"no timm weights are known for {name!r}; pass pretrained=<timm name or file path>")
        load_pretrained(model, source, head=pretrained_head)
    return model
