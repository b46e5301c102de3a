"""Named variants: a table of dimensions (big_vision ``decode_variant``, timm's registry).

``create_model("vit_b16", num_classes=10, pos_embed="sincos2d")`` builds a ViT-B/16 with those
overrides. Dimensions follow timm/the ViT paper; the ``*4`` variants use 4-px patches for
28-32 px images (CIFAR, Fashion-MNIST), where 16-px patches would leave a 2x2 grid.

The table (``VARIANTS``, kept as plain data in variants.py so that mae.py can read it without importing
the builders) is the one owner of what a name means. A row holds every constructor value in which the
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

import inspect

from vitpipe.models.mae import DEFAULT_DECODER, MaskedAutoencoderViT
from vitpipe.models.variants import VARIANTS
from vitpipe.models.vit import ViT

# the timm model whose pretrained weights fit each variant (``pretrained=True``)
TIMM_NAMES = {
    "vit_ti16": "vit_tiny_patch16_224.augreg_in21k_ft_in1k",
    "vit_s16": "vit_small_patch16_224.augreg_in21k_ft_in1k",
    "vit_b16": "vit_base_patch16_224.augreg2_in21k_ft_in1k",
    "vit_l16": "vit_large_patch16_224.augreg_in21k_ft_in1k",
    "vit_h14": "vit_huge_patch14_224.orig_in21k",
}


# MAE pre-training: the encoder is a VARIANTS row; the paper's decoder (512 wide, 8 deep, 16 heads) and
# norm_pix_loss (its best targets) for the ImageNet sizes; narrower, shallower decoders for small images.
# nano's 2x2 one-channel patches are too small to normalise (4 pixels; blank patches), so raw pixels there.
MAE_VARIANTS: dict[str, dict] = {
    "mae_vit_nano": dict(encoder="vit_nano", decoder_embed_dim=32, decoder_depth=2, decoder_num_heads=4,
                         norm_pix_loss=False),
    "mae_vit_ti4": dict(encoder="vit_ti4", decoder_embed_dim=128, decoder_depth=4, decoder_num_heads=4,
                        norm_pix_loss=True),
    "mae_vit_s4": dict(encoder="vit_s4", decoder_embed_dim=256, decoder_depth=4, decoder_num_heads=8,
                       norm_pix_loss=True),
    "mae_vit_b16": dict(encoder="vit_b16", **DEFAULT_DECODER, norm_pix_loss=True),
    "mae_vit_l16": dict(encoder="vit_l16", **DEFAULT_DECODER, norm_pix_loss=True),
    "mae_vit_h14": dict(encoder="vit_h14", **DEFAULT_DECODER, norm_pix_loss=True),
}


def mae_kwargs(name: str) -> dict:
    """``MaskedAutoencoderViT`` kwargs of MAE variant ``name``: its encoder row of VARIANTS plus its decoder."""
    if name not in MAE_VARIANTS:
        raise ValueError(f"unknown MAE model name={name!r}; valid choices: {', '.join(MAE_VARIANTS)}")
    row = dict(MAE_VARIANTS[name])
    enc = VARIANTS[row.pop("encoder")]
    return dict(img_size=enc["img_size"], patch_size=enc["patch_size"], embed_dim=enc["dim"], depth=enc["depth"],
                num_heads=enc["num_heads"], **row)


def create_mae(name: str, *, dim: int | None = None, **overrides) -> MaskedAutoencoderViT:
    """Build MAE variant ``name`` with keyword overrides (any ``MaskedAutoencoderViT`` argument).

    ``dim`` is the ViT configs' name for the encoder width: when given it is the ``embed_dim``, so a
    config that shrinks every ViT (``debug=fast`` sets ``model.dim``) shrinks an MAE's encoder too.
    """
    if dim is not None:
        overrides["embed_dim"] = dim
    return MaskedAutoencoderViT(**{**mae_kwargs(name), **overrides})


def list_mae_models() -> list[str]:
    return list(MAE_VARIANTS)


def list_models() -> list[str]:
    return list(VARIANTS)


def _defaults(builder) -> dict:
    return {n: p.default for n, p in inspect.signature(builder).parameters.items() if p.default is not p.empty}


def variant_kwargs(name: str) -> dict:
    """Every constructor argument variant ``name`` builds with: ``ViT``'s defaults and the row of VARIANTS
    over them (for an MAE variant, ``MaskedAutoencoderViT``'s defaults and ``mae_kwargs(name)``)."""
    if name in VARIANTS:
        return {**_defaults(ViT), **VARIANTS[name]}
    if name in MAE_VARIANTS:
        return {**_defaults(MaskedAutoencoderViT), **mae_kwargs(name)}
    raise ValueError(f"unknown model.name={name!r}; valid choices: {', '.join([*VARIANTS, *MAE_VARIANTS])}")


def variant_value(name: str, key: str):
    """``variant_kwargs(name)[key]``: the ``${variant:<name>,<key>}`` resolver of conf/model/vit.yaml and
    conf/model/mae.yaml, so a config's value is the one ``create_model(name)`` / ``create_mae(name)`` uses."""
    table = variant_kwargs(name)
    if key not in table:
        raise ValueError(f"variant {name} has no {key!r}; its builder takes {', '.join(table)}")
    return table[key]


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
