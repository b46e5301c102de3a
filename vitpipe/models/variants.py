"""The ViT variant table: a name's dimensions, as plain data.

It is its own module, below every builder, because two modules read it: the registry, which builds a
variant by name (``create_model``, the MAE variants, the config resolver), and ``mae.load_official``,
which gives a facebookresearch/mae checkpoint the heads of the variant of its width and depth. With
the table inside the registry, mae and the registry imported each other. What a name means is
still decided here and only here; ``vitpipe.models.registry`` explains how the configs read it.
"""

from __future__ import annotations

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
