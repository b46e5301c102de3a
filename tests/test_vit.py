"""The ViT: variants, equivariance, errors, checkpointing switches, input sizes."""

import pytest
import torch

from vitpipe import create_model, list_models
from vitpipe.models import VARIANTS
from vitpipe.models.registry import TIMM_NAMES, variant_kwargs
from vitpipe.nn.pos_embed import POS_EMBED_KINDS


def _shuffle_patches(x, p, perm):
    """Permute the p x p patches of images x (B, C, H, W) by perm (over row-major patch indices)."""
    B, C, H, W = x.shape
    t = x.unfold(2, p, p).unfold(3, p, p)  # (B, C, h, w, p, p)
    h, w = t.shape[2:4]
    t = t.reshape(B, C, h * w, p, p)[:, :, perm].reshape(B, C, h, w, p, p)
    return t.permute(0, 1, 2, 4, 3, 5).reshape(B, C, H, W)


@pytest.mark.parametrize("pos_embed", POS_EMBED_KINDS)
def test_permutation_equivariance_only_without_positions(pos_embed):
    torch.manual_seed(0)
    m = create_model("vit_micro", img_size=16, pos_embed=pos_embed, num_classes=3, depth=2).eval()
    if pos_embed in ("learned", "learned2d"):  # give the tables something to say
        for p in m.pos_embed.parameters():
            torch.nn.init.normal_(p, std=1.0)
    x = torch.randn(2, 3, 16, 16)
    perm = torch.randperm(16)
    out = m.forward_features(x)[:, 1:]
    out_perm = m.forward_features(_shuffle_patches(x, 4, perm))[:, 1:]
    diff = (out[:, perm] - out_perm).abs().max().item()
    if pos_embed == "none":
        assert diff < 1e-5
    else:
        assert diff > 1e-3


@pytest.mark.parametrize("name", list_models())
def test_every_variant_builds_and_gives_finite_logits(name):
    torch.manual_seed(0)
    size = 2 * VARIANTS[name]["patch_size"]  # a 2x2 grid keeps the big ones fast
    m = create_model(name, num_classes=7, img_size=size).eval()
    with torch.no_grad():
        y = m(torch.randn(2, 3, size, size))
    assert y.shape == (2, 7) and torch.isfinite(y).all()
    assert m.grid_size == (2, 2)


# each variant with a timm counterpart, and how it is built there: the ImageNet rows are the models whose
# weights pretrained=True loads; the *4 rows are timm's tiny/small at 4-px patches on 32-px images
TIMM_TWINS = {**{n: (t, {}) for n, t in TIMM_NAMES.items()},
              "vit_ti4": ("vit_tiny_patch16_224", dict(patch_size=4, img_size=32)),
              "vit_s4": ("vit_small_patch16_224", dict(patch_size=4, img_size=32))}


def _timm_row(tm) -> dict:
    """What a VARIANTS row says, read from a built timm VisionTransformer."""
    block = tm.blocks[0]
    return dict(dim=tm.embed_dim, depth=len(tm.blocks), num_heads=block.attn.num_heads,
                patch_size=tuple(tm.patch_embed.patch_size), img_size=tuple(tm.patch_embed.img_size),
                mlp_ratio=block.mlp.fc1.out_features / tm.embed_dim, qkv_bias=block.attn.qkv.bias is not None,
                qk_norm=not isinstance(block.attn.q_norm, torch.nn.Identity), class_token=tm.cls_token is not None,
                reg_tokens=tm.num_reg_tokens, pool={"token": "cls", "avg": "mean"}.get(tm.global_pool, tm.global_pool),
                init_values=None if isinstance(block.ls1, torch.nn.Identity) else float(block.ls1.gamma[0]))


@pytest.mark.parametrize("name", sorted(TIMM_TWINS))
def test_variant_dimensions_match_timm(name):
    """The variant table against timm's own model definitions (built on the meta device: ViT-H/14's 632M
    parameters take no memory), not against numbers typed into a test."""
    import timm

    twin, overrides = TIMM_TWINS[name]
    with torch.device("meta"):
        tm = timm.create_model(twin, pretrained=False, **overrides)
    ours = variant_kwargs(name)
    pair = lambda v: tuple(v) if isinstance(v, (tuple, list)) else (v, v)  # noqa: E731
    ours = {**ours, "patch_size": pair(ours["patch_size"]), "img_size": pair(ours["img_size"])}
    theirs = _timm_row(tm)
    assert {k: ours[k] for k in theirs} == theirs
    if name in ("vit_ti16", "vit_s16", "vit_ti4", "vit_s4"):  # small enough to build for real: the same parameters
        built = create_model(name, num_classes=tm.num_classes)
        assert sum(p.numel() for p in built.parameters()) == sum(p.numel() for p in tm.parameters())


@pytest.mark.parametrize("builder", ["ViT", "MaskedAutoencoderViT"])
def test_the_builders_defaults_read_from_source_are_their_signatures(builder):
    """The configs' ${variant:...} resolver reads the constructors' defaults from source, without torch
    (vitpipe.models.variants.builder_defaults): they are what the imported class takes, value and type."""
    import inspect

    import vitpipe.models
    from vitpipe.models.variants import builder_defaults

    cls = getattr(vitpipe.models, builder)
    signature = {n: p.default for n, p in inspect.signature(cls).parameters.items() if p.default is not p.empty}
    read = builder_defaults(builder)
    assert read == signature and [type(v) for v in read.values()] == [type(v) for v in signature.values()]


def test_non_square_images_and_other_sizes_at_eval():
    torch.manual_seed(0)
    m = create_model("vit_micro", img_size=(16, 24), num_classes=4).eval()
    assert m.grid_size == (4, 6)
    tokens, attn = m.forward_features(torch.randn(1, 3, 16, 24), return_attn=True)
    assert tokens.shape == (1, 1 + 24, 64) and attn[0].shape == (1, 4, 25, 25)
    assert m(torch.randn(1, 3, 32, 32)).shape == (1, 4)  # a 224 -> 384 style change of grid


def test_return_attn_does_not_change_the_output():
    torch.manual_seed(0)
    m = create_model("vit_micro", num_classes=5).eval()
    x = torch.randn(2, 3, 32, 32)
    fused = m.forward_features(x)
    explicit, attn = m.forward_features(x, return_attn=True)
    assert (fused - explicit).abs().max() < 1e-5 and len(attn) == 4


def test_grad_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    m = create_model("vit_micro", num_classes=5, drop_path_rate=0.0)
    x = torch.randn(2, 3, 32, 32)
    m(x).sum().backward()
    g = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m.set_grad_checkpointing(True)
    m(x).sum().backward()
    for a, p in zip(g, m.parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-6, rtol=1e-5)


def test_no_weight_decay_names_positions_and_prefix_tokens():
    m = create_model("vit_micro", reg_tokens=2)
    assert m.no_weight_decay() == {"pos_embed.weight", "cls_token", "reg_token"}
    names = set(dict(m.named_parameters()))
    assert m.no_weight_decay() <= names


def test_mean_pool_without_class_token():
    m = create_model("vit_micro", class_token=False, pool="mean", num_classes=3)
    assert m.num_prefix_tokens == 0 and m(torch.randn(2, 3, 32, 32)).shape == (2, 3)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(dim=30, num_heads=4), r"dim=30.*num_heads=4"),
        (dict(img_size=30, patch_size=4), r"30x30.*patch size 4x4"),
        (dict(pos_embed="fourier"), r"'fourier'.*none, learned, sincos1d, sincos2d, learned2d, rope2d"),
        (dict(pool="max"), r"'max'.*cls, mean"),
        (dict(stem="resnet"), r"'resnet'.*patch, conv"),
        (dict(stem="conv", img_size=24, patch_size=6), r"power-of-two patch.*6x6"),
        (dict(stem="conv", stem_depth=0), r"stem_depth=0.*int >= 1"),
        (dict(stem="patch", stem_depth=2), r"stem_depth=2.*needs stem='conv'.*got stem='patch'"),
    ],
)
def test_bad_arguments_raise_value_error_naming_value_and_choices(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        create_model("vit_micro", **kwargs)


def test_unknown_variant_lists_choices():
    with pytest.raises(ValueError, match=r"'vit_x99'.*vit_b16"):
        create_model("vit_x99")


def test_input_not_divisible_by_patch_raises_at_forward():
    m = create_model("vit_micro")
    with pytest.raises(ValueError, match="30x32"):
        m(torch.randn(1, 3, 30, 32))


def _token_sensitivity(m, x, pixel):
    """Which patch tokens change when one input pixel (row, col) changes."""
    with torch.no_grad():
        a, _ = m.patch_embed(x)
        x2 = x.clone()
        x2[:, :, pixel[0], pixel[1]] += 1.0
        b, _ = m.patch_embed(x2)
    return ((a - b).abs().amax(dim=(0, 2)) > 1e-6).nonzero().flatten().tolist()


def test_conv_stem_sees_across_patch_borders_patch_stem_does_not():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    kw = dict(img_size=16, patch_size=4, num_classes=3, depth=1)
    patch, conv = create_model("vit_micro", **kw).eval(), create_model("vit_micro", stem="conv", **kw).eval()
    # pixel (3, 3) is the bottom-right corner of patch 0 in a 4x4 grid of 4x4 patches
    assert _token_sensitivity(patch, x, (3, 3)) == [0]
    assert set(_token_sensitivity(conv, x, (3, 3))) == {0, 1, 4, 5}  # overlapping 3x3 receptive fields


@pytest.mark.parametrize("img_size, patch_size", [(28, 4), ((24, 40), 8), (32, 2)])
def test_conv_stem_gives_the_patch_grid_and_trains(img_size, patch_size):
    torch.manual_seed(0)
    m = create_model("vit_micro", stem="conv", img_size=img_size, patch_size=patch_size, in_chans=1,
                     num_classes=3, depth=1, pool="mean", class_token=False)
    H, W = (img_size, img_size) if isinstance(img_size, int) else img_size
    x = torch.randn(4, 1, H, W)
    tokens, grid = m.patch_embed(x)
    assert grid == m.grid_size == (H // patch_size, W // patch_size)
    assert tokens.shape == (4, grid[0] * grid[1], m.dim)
    loss = torch.nn.functional.cross_entropy(m(x), torch.tensor([0, 1, 2, 0]))
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.patch_embed.parameters())


def test_a_deeper_conv_stem_adds_stride_1_convs_per_stage_and_keeps_the_grid():
    """stem_depth=2: each stride-2 stage gains a 3x3 stride-1 conv at its width; grid, tokens and the
    receptive field's growth follow (a pixel reaches more tokens than through the one-conv-per-stage stem)."""
    torch.manual_seed(0)
    kw = dict(img_size=28, patch_size=4, in_chans=1, num_classes=3, depth=1, pool="mean", class_token=False)
    one, two = create_model("vit_micro", stem="conv", **kw), create_model("vit_micro", stem="conv", stem_depth=2, **kw)
    convs = lambda m: [(c.in_channels, c.out_channels, c.stride[0], c.kernel_size[0])  # noqa: E731
                       for c in m.patch_embed.proj if isinstance(c, torch.nn.Conv2d)]
    w = one.dim
    assert convs(one) == [(1, w // 2, 2, 3), (w // 2, w, 2, 3), (w, w, 1, 1)]
    assert convs(two) == [(1, w // 2, 2, 3), (w // 2, w // 2, 1, 3), (w // 2, w, 2, 3), (w, w, 1, 3), (w, w, 1, 1)]
    x = torch.randn(2, 1, 28, 28)
    assert two.patch_embed(x)[1] == one.patch_embed(x)[1] == (7, 7) and two(x).shape == (2, 3)
    one.eval(), two.eval()
    assert len(_token_sensitivity(two, x, (13, 13))) > len(_token_sensitivity(one, x, (13, 13)))
