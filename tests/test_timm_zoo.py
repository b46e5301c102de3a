"""The timm zoo converts: one entry point per feature, shrunk (tiny width, depth 2, small images) so the
default suite runs it; the full scan (``python -m vitpipe.models.timm_zoo``) is marked slow."""

import pytest
import timm
import torch

from vitpipe.errors import ConfigError
from vitpipe.models.timm_compat import from_timm, to_timm
from vitpipe.models.timm_zoo import (
    TOLERANCE,
    check,
    entry_points,
    format_table,
    main,
    random_timm,
    sample_input,
    scan,
    summary,
)

TINY = dict(embed_dim=32, depth=2, num_heads=2, num_classes=5)
STD = 0.3  # perturbation of every weight: large enough that a dropped or misplaced one moves the logits

# feature -> (entry point, extra timm kwargs): each must convert with parity
PARITY = {
    "plain": ("vit_tiny_patch16_224", dict(img_size=32)),
    "registers + layer scale (DINOv2)": ("vit_small_patch14_reg4_dinov2", dict(img_size=28)),
    "qk_norm": ("vit_tiny_patch16_224", dict(img_size=32, qk_norm=True)),
    "pre_norm + eps 1e-5 (CLIP)": ("vit_base_patch16_clip_224", dict(img_size=32)),
    "quick_gelu (OpenAI CLIP)": ("vit_base_patch16_clip_quickgelu_224", dict(img_size=32)),
    "map pooling + gelu_tanh (SigLIP)": ("vit_base_patch16_siglip_224", dict(img_size=32)),
    "avg pooling, norm before pooling": ("vit_base_patch16_siglip_gap_224", dict(img_size=32)),
    "avg pooling with fc_norm + registers": ("vit_medium_patch16_reg4_gap_256", dict(img_size=32)),
    "fc_norm with token pooling": ("vit_tiny_patch16_224", dict(img_size=32, fc_norm=True)),
    "no final norm": ("vit_tiny_patch16_224", dict(img_size=32, final_norm=False)),
    "pool_include_prefix": ("vit_tiny_patch16_224", dict(img_size=32, global_pool="avg", pool_include_prefix=True)),
    "norms inside attention and MLP (BEiT-3)": ("beit3_base_patch16_224", dict(img_size=32)),
    "distilled DeiT": ("deit_tiny_distilled_patch16_224", dict(img_size=32)),
    "no_embed_class (DeiT-III)": ("deit3_small_patch16_224", dict(img_size=32)),
    "residual post-norm": ("vit_base_patch16_rpn_224", dict(img_size=32)),
    "relative positions": ("vit_relpos_small_patch16_224", dict(img_size=32)),
    "BEiT": ("beit_base_patch16_224", dict(img_size=32)),
    "EVA-02: rope + learned, fused SwiGLU, rope ref grid": ("eva02_tiny_patch14_224", dict(img_size=56)),
    "EVA-02: SwiGLU with sub-LN": ("eva02_base_patch14_224", dict(img_size=56)),
    "EVA-02 CLIP: a norm inside attention": ("eva02_base_patch16_clip_224", dict(img_size=32)),
    "RoPE-ViT: xy rope, no table, non-square": ("vit_small_patch16_rope_224", dict(img_size=(48, 32))),
    "rope + registers, avg pooling": ("vit_medium_patch16_rope_reg1_gap_256", dict(img_size=32)),
    "DINOv3: centered rope, rotate_half, registers": ("vit_small_patch16_dinov3", dict(img_size=(32, 48))),
    "DINOv3 ViT-S+: SwiGLU": ("vit_small_plus_patch16_dinov3", dict(img_size=32)),
    "Perception Encoder: map over every token, rope offset": ("vit_pe_core_tiny_patch16_384", dict(img_size=32)),
    "NaFlexVit parfac (tensor and patch dict)": ("naflexvit_base_patch16_parfac_gap",
                                                 dict(patch_size=4, pos_embed_grid_size=(4, 4))),
    "NaFlexVit map": ("naflexvit_base_patch16_map", dict(patch_size=4, pos_embed_grid_size=(4, 4))),
}

# entry point -> a word the one-line refusal must name
REFUSED = {
    "vit_small_r26_s32_224": "HybridEmbed",
    "vit_small_patch16_18x2_224": "ParallelThingsBlock",
    "vit_base_patch16_xp_224": "ParallelScalingBlock",
    "vit_dwee_patch16_reg1_gap_256": "DiffAttention",
    "vit_small_patch16_rope_mixed_224": "RoPE-Mixed",
    "vit_base_patch16_sapiens2": "RmsNorm",
    "samvit_base_patch16": "SAM",
    "naflexvit_base_patch16_siglip": "pos_embed_interp_mode='bilinear'",
}


@pytest.mark.parametrize("feature", PARITY)
def test_entry_point_converts_with_parity(feature):
    name, kw = PARITY[feature]
    result = check(name, std=STD, **TINY, **kw)
    assert result.status == "parity", f"{feature}: {result.status}: {result.detail}"


@pytest.mark.parametrize("name", REFUSED)
def test_unsupported_entry_point_is_refused_in_one_line(name):
    with torch.device("meta"):  # the refusal reads the structure only: no weights needed
        tm = timm.create_model(name, pretrained=False)
    with pytest.raises(ValueError) as err:
        from_timm(tm)
    assert "\n" not in str(err.value) and REFUSED[name] in str(err.value), str(err.value)


@pytest.mark.parametrize("name, kw", [("vit_small_patch16_dinov3", dict(img_size=(32, 48))),
                                      ("eva02_tiny_patch14_224", dict(img_size=56))])
def test_rotary_parity_is_not_vacuous(name, kw):
    """The rotary positions move the logits far more than the parity tolerance: a wrong frequency, axis
    order or channel pairing could not pass."""
    tm = random_timm(name, std=STD, **TINY, **kw)
    model, x = from_timm(tm).eval(), sample_input(tm)
    with torch.no_grad():
        ours = model(x)
        model.rope_embed.base *= 1.5
        moved = (model(x) - ours).abs().max() / ours.abs().max()
    assert moved > 10 * TOLERANCE


def test_new_features_go_back_to_timm_or_are_refused_in_one_line():
    for name, kw in [("vit_base_patch16_siglip_224", {}),  # map + gelu_tanh
                     ("vit_tiny_patch16_224", dict(scale_attn_norm=True, scale_mlp_norm=True, pre_norm=True))]:
        tm = random_timm(name, std=STD, **TINY, img_size=32, **kw)
        back, x = to_timm(from_timm(tm)).eval(), sample_input(tm)
        with torch.no_grad():
            assert (back(x) - tm(x)).abs().max() <= 1e-5 * tm(x).abs().max(), name
    for name, kw, what in [("vit_base_patch16_clip_224", dict(img_size=32), r"LayerNorm eps 1e-05"),
                           ("eva02_tiny_patch14_224", dict(img_size=56), r"mlp='swiglu'"),
                           ("vit_medium_patch16_rope_reg1_gap_256", dict(img_size=32), r"rope2d")]:
        model = from_timm(random_timm(name, **TINY, **kw))
        with pytest.raises(ConfigError, match=what) as err:
            to_timm(model)  # timm's kwargs (recorded as JSON) cannot name these
        assert "\n" not in str(err.value)


def test_zoo_command_prints_a_table(capsys):
    rc = main(["--filter", "vit_tiny_patch16_224", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "| `vit_tiny_patch16_224` |" in out and "parity 1, refused 0, mismatch 0, exception 0" in out


@pytest.mark.slow
def test_full_zoo_scan():
    """Every entry point under 120M parameters (about 5 minutes on 2 CPU cores): no exception, no mismatch,
    at least 80% with parity."""
    results = scan(entry_points(), progress=False)
    counts = summary(results)
    bad = [f"{r.name}: {r.status}: {r.detail}" for r in results if r.status in ("exception", "mismatch")]
    assert not bad, bad
    assert counts["parity"] >= 0.8 * len(results), format_table(results)
