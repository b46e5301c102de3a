"""Patch-dict (NaFlex) input to the ViT: parity with timm's NaFlexVit, padding invariance, the dict path
equal to the tensor path at the built grid, and one-line errors for malformed dicts."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.data.naflex_dataset import NaFlexCollator
from timm.data.naflex_transforms import (
    Patchify,
    ResizeToSequence,
    get_image_size_for_seq,
)

from vitpipe.models.timm_compat import from_timm
from vitpipe.models.vit import ViT
from vitpipe.nn.naflex import pad_batch, patchify_image, seq_grid
from vitpipe.nn.pos_embed import POS_EMBED_KINDS

PATCH = 4
# (H, W, max_seq_len): wide, tall, square at the built 4x4 grid, square upsampled to 5x5
IMAGES = [(20, 36, 20), (40, 16, 12), (16, 16, 16), (30, 30, 30)]


def tiny_timm(name: str, **kw) -> torch.nn.Module:
    tm = timm.create_model(name, pretrained=False, embed_dim=32, depth=2, num_heads=2, num_classes=5,
                           patch_size=PATCH, pos_embed_grid_size=(4, 4), **kw).eval()
    torch.manual_seed(0)
    for p in tm.parameters():  # timm's LayerScale 1e-5 would make every block an identity: no parity test
        torch.nn.init.normal_(p, std=0.3)
    return tm


def timm_batch(seq_len: int = 36) -> dict:
    """A patch dict built by timm's own transforms and collator: mixed aspect ratios, padded."""
    g = torch.Generator().manual_seed(1)
    items = [(Patchify(PATCH)(ResizeToSequence(PATCH, n)(torch.rand(3, h, w, generator=g))), 0) for h, w, n in IMAGES]
    return NaFlexCollator(max_seq_len=seq_len)(items)[0]


def tiny_vit(pos_embed: str, class_token: bool, img_size=(16, 16), reg_tokens: int = 1) -> ViT:
    torch.manual_seed(0)
    m = ViT(img_size=img_size, patch_size=PATCH, num_classes=5, dim=32, depth=2, num_heads=2, pos_embed=pos_embed,
            class_token=class_token, pool="cls" if class_token else "mean", reg_tokens=reg_tokens).eval()
    with torch.no_grad():  # prefix tokens start at ~1e-6: make them matter
        for t in (m.cls_token, m.reg_token):
            if t is not None:
                t.normal_()
    return m


@pytest.mark.parametrize("name, pos_embed", [
    ("naflexvit_base_patch16_par_gap", "learned"), ("naflexvit_base_patch16_parfac_gap", "factorized"),
    ("naflexvit_base_patch16_gap", "learned"), ("naflexvit_base_patch16_gap", "factorized"),  # not aspect-preserving
])
@pytest.mark.parametrize("pool", ["avg", "token"])
def test_logits_match_timm_naflexvit(name, pos_embed, pool):
    tm = tiny_timm(name, pos_embed=pos_embed, class_token=pool == "token", global_pool=pool, fc_norm=pool == "avg")
    model = from_timm(tm)
    batch = timm_batch()
    valid = batch["patch_valid"]
    grids = (batch["patch_coord"] * valid[..., None]).amax(1) + 1
    assert (~valid).any(dim=1).all(), "every image is padded"
    assert len({h / w for h, w in grids.tolist()}) >= 3 and {(4, 4), (5, 5)} < set(map(tuple, grids.tolist()))
    with torch.no_grad():
        ours, theirs = model(batch), tm(batch)
        tm.embeds.pos_embed_ar_preserving ^= True  # the batch is one where the resampling rule shows
        other_rule = tm(batch)
    assert (ours - theirs).abs().max() <= 1e-5
    assert (other_rule - theirs).abs().max() > 1e-3
    assert (theirs[1:] - theirs[:1]).abs().max() > 1e-2  # the images' logits differ: the model sees them


def test_from_timm_names_an_unsupported_naflex_setting():
    tm = tiny_timm("naflexvit_base_patch16_par_gap", pos_embed_use_grid_sample=True, pool_include_prefix=True)
    with pytest.raises(ValueError, match=r"pool_include_prefix=True, .*pos_embed_use_grid_sample=True; "
                                         r".*naflexvit_base_patch16_gap"):
        from_timm(tm)


@pytest.mark.parametrize("pos_embed", POS_EMBED_KINDS)
@pytest.mark.parametrize("class_token", [True, False])
def test_logits_do_not_depend_on_padding_or_batch_mates(pos_embed, class_token):
    model = tiny_vit(pos_embed, class_token)
    g = torch.Generator().manual_seed(2)
    small = patchify_image(torch.rand(3, 12, 20, generator=g), PATCH, 15)  # 3x5 grid
    big = patchify_image(torch.rand(3, 40, 28, generator=g), PATCH, 40)  # a longer, taller image
    with torch.no_grad():
        alone = model(pad_batch([small]))[0]
        padded = model(pad_batch([small], seq_len=31))[0]
        joined = model(pad_batch([small, big]))[0]
    assert len(big["patches"]) > len(small["patches"])
    assert (padded - alone).abs().max() <= 1e-5
    assert (joined - alone).abs().max() <= 1e-5


@pytest.mark.parametrize("pos_embed", POS_EMBED_KINDS)
@pytest.mark.parametrize("class_token", [True, False])
@pytest.mark.parametrize("img_size", [(16, 16), (16, 24)], ids=["square", "wide"])
def test_dict_path_equals_tensor_path_at_the_built_grid(pos_embed, class_token, img_size):
    model = tiny_vit(pos_embed, class_token, img_size=img_size)
    images = torch.rand(3, 3, *img_size, generator=torch.Generator().manual_seed(3))
    n = (img_size[0] // PATCH) * (img_size[1] // PATCH)
    batch = pad_batch([patchify_image(im, PATCH, n) for im in images])
    assert batch["patches"].shape[1] == n and batch["patch_valid"].all()  # the image's own full grid
    with torch.no_grad():
        assert (model(batch) - model(images)).abs().max() <= 1e-5


def test_padding_gets_no_attention():
    model = tiny_vit("rope2d", class_token=True)
    batch = pad_batch([patchify_image(torch.rand(3, 8, 8), PATCH, 4)], seq_len=9)  # 4 patches, 5 padding
    _, attentions = model.forward_features(batch, return_attn=True)
    P = model.num_prefix_tokens
    assert len(attentions) == 2
    for w in attentions:  # (B, heads, P + 9, P + 9)
        assert w[..., P + 4 :].abs().max() == 0
        assert torch.allclose(w.sum(-1), torch.ones(()))


def test_patchify_image_follows_timm_naflex_transforms():
    for h, w, n in [*IMAGES, (17, 50, 24), (100, 9, 7), (8, 8, 1)]:
        assert seq_grid((h, w), (PATCH, PATCH), n) == tuple(
            s // PATCH for s in get_image_size_for_seq((h, w), PATCH, n)[1]), (h, w, n)
    img = torch.rand(3, 20, 36, generator=torch.Generator().manual_seed(4))
    ours = patchify_image(img, PATCH, 20)
    theirs = Patchify(PATCH)(ResizeToSequence(PATCH, 20)(img))
    assert ours["patch_coord"].tolist() == theirs["patch_coord"].tolist()
    assert (ours["patches"] - theirs["patches"]).abs().max() <= 1e-5
    # no resize (a 2x1 grid), 2 channels, pixel (c, y, x) = 32 c + 4 y + x: patch 1 starts at pixel (4, 0),
    # its flat order is (y, x, c) with the channel fastest
    exact = patchify_image(torch.arange(2 * 8 * 4.0).reshape(2, 8, 4), PATCH, 2)
    assert exact["patches"][1, :4].tolist() == [16.0, 48.0, 17.0, 49.0]


def _batch():
    return pad_batch([patchify_image(torch.rand(3, 16, 16), PATCH, 16)], seq_len=18)


@pytest.mark.parametrize("change, message", [
    (lambda b: b.pop("patch_coord"), r"missing 'patch_coord'; it needs 'patches', 'patch_coord', 'patch_valid'"),
    (lambda b: b.update(patches=b["patches"][..., :-3]), r"'patches' must be a tensor \(B, N, 48\).*\(1, 18, 45\)"),
    (lambda b: b.update(patch_coord=b["patch_coord"][:, :5]), r"'patch_coord' must be .*\(1, 18, 2\).*\(1, 5, 2\)"),
    (lambda b: b.update(patch_coord=b["patch_coord"].float()), r"'patch_coord' must be an integer.*float32"),
    (lambda b: b.update(patch_valid=b["patch_valid"].long()), r"'patch_valid' must be a bool.*int64"),
    (lambda b: b.update(patch_valid=torch.zeros(1, 18, dtype=torch.bool)), r"image\(s\) \[0\] have no valid patch"),
])
def test_malformed_dict_is_a_one_line_value_error(change, message):
    model, batch = tiny_vit("learned", True), _batch()
    change(batch)
    with pytest.raises(ValueError, match=message) as err:
        model(batch)
    assert "\n" not in str(err.value)


def test_conv_stem_refuses_a_patch_dict():
    model = ViT(img_size=16, patch_size=PATCH, num_classes=5, dim=32, depth=1, num_heads=2, stem="conv")
    with pytest.raises(ValueError, match=r"stem='conv' .* use stem='patch'"):
        model(_batch())


@pytest.mark.parametrize("pos_embed", POS_EMBED_KINDS)
def test_positions_come_from_the_coordinates_not_the_token_order(pos_embed):
    model = tiny_vit(pos_embed, class_token=False)
    with torch.no_grad():  # at the 0.02 init rotary phases barely move the logits: make them matter
        for p in model.parameters():
            p.normal_(std=0.3)
    g = torch.Generator().manual_seed(5)
    batch = pad_batch([patchify_image(torch.rand(3, 12, 20, generator=g), PATCH, 15),
                       patchify_image(torch.rand(3, 20, 8, generator=g), PATCH, 10)], seq_len=17)
    order = torch.randperm(17, generator=g)  # padding moves into the middle too
    shuffled = {k: v[:, order] for k, v in batch.items()}
    with torch.no_grad():
        assert (model(shuffled) - model(batch)).abs().max() <= 1e-5
        swapped = dict(batch, patch_coord=batch["patch_coord"].flip(-1))  # (row, col) read as (col, row)
        assert pos_embed == "none" or (model(swapped) - model(batch)).abs().max() > 1e-4


def test_gradient_checkpointing_on_a_patch_dict_changes_nothing():
    model = tiny_vit("learned2d", class_token=True).train()
    batch = pad_batch([patchify_image(torch.rand(3, 12, 20), PATCH, 15), patchify_image(torch.rand(3, 8, 8), PATCH, 4)])
    grads = []
    for enable in (False, True):
        model.zero_grad()
        model.set_grad_checkpointing(enable)
        model(batch).square().sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert grads[0].abs().max() > 0 and (grads[1] - grads[0]).abs().max() <= 1e-6
    assert model.pos_embed.row.grad[:3].abs().min() > 0  # rows 0-2 are used by the 3x5 image
