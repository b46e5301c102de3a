"""The variant tables: what a name means (a ViT's dimensions, an MAE's decoder, the timm weights that fit),
as plain data, and the values a name builds with (``variant_kwargs``), read without importing torch.

It is its own module, below every builder, because three readers need it: the registry, which builds a
variant by name (``create_model``, ``create_mae``); ``mae.load_official``, which gives a
facebookresearch/mae checkpoint the heads of the variant of its width and depth; and the configs'
``${variant:<name>,<key>}`` resolver, which Hydra calls while it composes a command line (``model=``,
``debug=fast``, the experiments), before the command decides whether to load torch at all
(``vitpipe.tasks.cli``). So the builders' defaults are read from their source (``builder_defaults``), not
from the imported classes; a test holds them equal to ``inspect.signature``. What a name means is decided
here and only here; ``vitpipe.models.registry`` explains how the configs read it.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

VARIANTS: dict[str, dict] = {
    # CPU-sized: the embedded default (8x8 digits, 2-px patches) and the tests.
    # nano: fixed positions, 1.4k 8x8 digits are too few to learn a table
    "vit_nano": dict(dim=64, depth=4, num_heads=4, patch_size=2, img_size=8, pos_embed="sincos2d"),
    "vit_micro": dict(dim=64, depth=4, num_heads=4, patch_size=4, img_size=32),
    # small images (28-32 px), trained from scratch with stochastic depth 0.1 (DeiT)
    "vit_ti4": dict(dim=192, depth=12, num_heads=3, patch_size=4, img_size=32, drop_path_rate=0.1),
    "vit_s4": dict(dim=384, depth=12, num_heads=6, patch_size=4, img_size=32, drop_path_rate=0.1),
    # ImageNet sizes (timm's vit_{tiny,small,base,large}_patch16_224, vit_huge_patch14_224); B, L, H with stochastic depth
    "vit_ti16": dict(dim=192, depth=12, num_heads=3, patch_size=16, img_size=224),
    "vit_s16": dict(dim=384, depth=12, num_heads=6, patch_size=16, img_size=224),
    "vit_b16": dict(dim=768, depth=12, num_heads=12, patch_size=16, img_size=224, drop_path_rate=0.1),
    "vit_l16": dict(dim=1024, depth=24, num_heads=16, patch_size=16, img_size=224, drop_path_rate=0.1),
    "vit_h14": dict(dim=1280, depth=32, num_heads=16, patch_size=14, img_size=224, drop_path_rate=0.1),
}

# the timm model whose pretrained weights fit each variant (``pretrained=True``)
TIMM_NAMES = {
    "vit_ti16": "vit_tiny_patch16_224.augreg_in21k_ft_in1k",
    "vit_s16": "vit_small_patch16_224.augreg_in21k_ft_in1k",
    "vit_b16": "vit_base_patch16_224.augreg2_in21k_ft_in1k",
    "vit_l16": "vit_large_patch16_224.augreg_in21k_ft_in1k",
    "vit_h14": "vit_huge_patch14_224.orig_in21k",
}

# the decoder of every released MAE model (the paper's default: 512 wide, 8 deep, 16 heads)
DEFAULT_DECODER = dict(decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16)

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

# the builders whose keyword defaults a name's values start from: class -> its module's file, beside this one
_BUILDERS = {"ViT": "vit.py", "MaskedAutoencoderViT": "mae.py"}


@functools.cache
def builder_defaults(builder: str) -> dict:
    """The keyword defaults of ``builder``'s constructor (``ViT`` or ``MaskedAutoencoderViT``), read from its
    module's source with ``ast``: every default there is a literal, and importing the class would import torch."""
    tree = ast.parse((Path(__file__).with_name(_BUILDERS[builder])).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == builder)
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = init.args
    positional = args.args[len(args.args) - len(args.defaults):]
    pairs = [*zip(positional, args.defaults), *((a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d)]
    return {a.arg: ast.literal_eval(d) for a, d in pairs}


def mae_kwargs(name: str) -> dict:
    """``MaskedAutoencoderViT`` kwargs of MAE variant ``name``: its encoder row of VARIANTS plus its decoder."""
    if name not in MAE_VARIANTS:
        raise ValueError(f"unknown MAE model name={name!r}; valid choices: {', '.join(MAE_VARIANTS)}")
    row = dict(MAE_VARIANTS[name])
    enc = VARIANTS[row.pop("encoder")]
    return dict(img_size=enc["img_size"], patch_size=enc["patch_size"], embed_dim=enc["dim"], depth=enc["depth"],
                num_heads=enc["num_heads"], **row)


def list_mae_models() -> list[str]:
    return list(MAE_VARIANTS)


def list_models() -> list[str]:
    return list(VARIANTS)


def variant_kwargs(name: str) -> dict:
    """Every constructor argument variant ``name`` builds with: ``ViT``'s defaults and the row of VARIANTS
    over them (for an MAE variant, ``MaskedAutoencoderViT``'s defaults and ``mae_kwargs(name)``)."""
    if name in VARIANTS:
        return {**builder_defaults("ViT"), **VARIANTS[name]}
    if name in MAE_VARIANTS:
        return {**builder_defaults("MaskedAutoencoderViT"), **mae_kwargs(name)}
    raise ValueError(f"unknown model.name={name!r}; valid choices: {', '.join([*VARIANTS, *MAE_VARIANTS])}")


def variant_value(name: str, key: str):
    """``variant_kwargs(name)[key]``: the ``${variant:<name>,<key>}`` resolver of conf/model/vit.yaml and
    conf/model/mae.yaml, so a config's value is the one ``create_model(name)`` / ``create_mae(name)`` uses."""
    table = variant_kwargs(name)
    if key not in table:
        raise ValueError(f"variant {name} has no {key!r}; its builder takes {', '.join(table)}")
    return table[key]
