"""MAE (vitpipe.models.mae): masking, loss, patch order, the official checkpoint format, transfer to a ViT."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from vitpipe.benchmark.reference_mae import ReferenceMAE
from vitpipe.errors import ConfigError
from vitpipe.models import (
    MAE_VARIANTS,
    VARIANTS,
    MaskedAutoencoderViT,
    ViT,
    create_mae,
    load_official,
)
from vitpipe.models.registry import mae_kwargs, variant_value
from vitpipe.models.weights import load_pretrained
from vitpipe.nn.pos_embed import POS_EMBED_KINDS

TINY = dict(img_size=8, patch_size=2, in_chans=3, embed_dim=32, depth=2, num_heads=2,
            decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2)


def tiny(**kw) -> MaskedAutoencoderViT:
    torch.manual_seed(0)
    if kw.get("class_token") is False:
        kw.setdefault("pool", "mean")
    return MaskedAutoencoderViT(**{**TINY, **kw}).eval()


def unshuffle(latent, ids_restore, P):
    """Patch tokens of an encoder output back in patch order (mask_ratio=0 keeps all of them)."""
    return latent[:, P:].gather(1, ids_restore[..., None].expand(-1, -1, latent.shape[-1]))


@pytest.mark.parametrize("class_token", [True, False])
@pytest.mark.parametrize("kind", POS_EMBED_KINDS)
def test_encoder_runs_on_the_kept_tokens_only(kind, class_token):
    m = tiny(pos_embed=kind, class_token=class_token, reg_tokens=1)
    P, L = m.num_prefix_tokens, 16
    seen = []
    for blk in m.blocks:
        blk.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[1]))
    for ratio in (0.75, 0.7, 0.0):  # 0.7: int(4.8) = 4 kept, not round()
        keep = int(L * (1 - ratio))
        seen.clear()
        latent, mask, ids_restore = m.forward_encoder(torch.randn(2, 3, 8, 8), ratio)
        assert seen == [P + keep] * len(m.blocks)  # every block, not just the output
        assert latent.shape == (2, P + keep, 32)
        assert mask.sum(1).tolist() == [L - keep] * 2 and ids_restore.shape == (2, L)


def test_mask_is_the_argsort_of_the_noise():
    m, x = tiny(), torch.randn(3, 3, 8, 8)
    noise = torch.rand(3, 16)
    loss1, pred1, mask1 = m(x, 0.75, noise)
    loss2, pred2, mask2 = m(x, 0.75, noise.clone())
    assert torch.equal(mask1, mask2) and torch.equal(pred1, pred2) and loss1 == loss2
    kept = noise.argsort(1)[:, :4]  # the 4 smallest noise values are kept
    assert mask1.gather(1, kept).sum() == 0 and mask1.sum() == 3 * 12
    assert not torch.equal(m(x, 0.75, torch.rand(3, 16))[2], mask1)
    torch.manual_seed(1)
    a = m(x)[2]
    assert not torch.equal(a, m(x)[2])  # noise=None draws fresh noise
    with pytest.raises(ValueError, match=r"noise has shape \(3, 15\)"):
        m(x, 0.75, torch.rand(3, 15))
    with pytest.raises(ValueError, match="mask_ratio=1.0"):
        m(x, 1.0)


@pytest.mark.parametrize("kind", [k for k in POS_EMBED_KINDS if k != "none"])
def test_each_kept_token_keeps_its_own_position(kind):
    """The same kept set in another order gives the same token outputs: positions (and rotary phases)
    travel with their patches, not with their place in the shortened sequence."""
    m, x = tiny(pos_embed=kind), torch.randn(2, 3, 8, 8)
    noise = torch.rand(2, 16)
    kept = noise.argsort(1)[:, :4]
    flipped = noise.clone()
    flipped.scatter_(1, kept, noise.gather(1, kept.flip(1)))  # same 4 kept, in reverse order
    a, mask_a, _ = m.forward_encoder(x, 0.75, noise)
    b, mask_b, _ = m.forward_encoder(x, 0.75, flipped)
    assert torch.equal(mask_a, mask_b)
    torch.testing.assert_close(b[:, 1:], a[:, 1:].flip(1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b[:, 0], a[:, 0], atol=1e-5, rtol=1e-5)
    # and the positions matter: another kept set, the same pixels moved there, gives other outputs
    assert not torch.allclose(m.forward_encoder(x, 0.0, noise)[0][:, 1:5], a[:, 1:], atol=1e-3)


def test_loss_is_on_the_masked_patches_only():
    m, x = tiny(), torch.randn(1, 3, 8, 8)
    noise = torch.rand(1, 16)
    loss, pred, mask = m(x, 0.75, noise)
    vis, hid = int(mask[0].argmin()), int(mask[0].argmax())  # a visible and a masked patch index

    def bumped(patch):
        y = x.clone()
        i, j = divmod(patch, 4)
        y[..., 2 * i:2 * i + 2, 2 * j:2 * j + 2] += 1.0
        return y

    # the loss reads targets of masked patches only
    assert m.forward_loss(bumped(vis), pred, mask) == m.forward_loss(x, pred, mask)
    assert m.forward_loss(bumped(hid), pred, mask) != m.forward_loss(x, pred, mask)
    # the encoder never sees a masked patch: its pixels change the target, not the prediction
    loss_h, pred_h, _ = m(bumped(hid), 0.75, noise)
    assert torch.equal(pred_h, pred) and loss_h != loss
    assert not torch.allclose(m(bumped(vis), 0.75, noise)[1], pred)


@pytest.mark.parametrize("img_size,patch_size", [(8, 2), ((6, 12), (2, 3))])
def test_patchify_order_and_roundtrip(img_size, patch_size):
    m = tiny(img_size=img_size, patch_size=patch_size, pos_embed="learned")
    (H, W), (p, q) = m.img_size, m.patch_size
    x = torch.randn(2, 3, H, W)
    patches = m.patchify(x)
    h, w = H // p, W // q
    assert patches.shape == (2, h * w, p * q * 3)
    i, j = h - 1, 1  # patch (i, j) is row-major index i*w + j, its pixels (row, col, channel) flattened
    torch.testing.assert_close(patches[1, i * w + j], x[1, :, i * p:(i + 1) * p, j * q:(j + 1) * q].permute(1, 2, 0).flatten())
    assert torch.equal(m.unpatchify(patches), x)
    _, pred, mask = m(x)
    assert pred.shape == patches.shape and mask.shape == (2, h * w)


def test_norm_pix_loss_is_per_patch_normalised_mse():
    m, x = tiny(norm_pix_loss=True), torch.rand(2, 3, 8, 8)
    loss, pred, mask = m(x, 0.5, torch.rand(2, 16))
    total, count = 0.0, 0
    for b in range(2):
        for patch in range(16):
            i, j = divmod(patch, 4)
            t = x[b, :, 2 * i:2 * i + 2, 2 * j:2 * j + 2].permute(1, 2, 0).flatten()
            t = (t - t.mean()) / torch.sqrt(t.var(unbiased=True) + 1e-6)
            if mask[b, patch]:
                total, count = total + ((pred[b, patch] - t) ** 2).mean(), count + 1
    torch.testing.assert_close(loss, total / count)
    m.norm_pix_loss = False
    assert not torch.allclose(m.forward_loss(x, pred, mask), loss)


# ---- the facebookresearch/mae format: the MAE paper's reference forward (models_mae.py on timm's Block),
# the one copy the benchmark's MAE comparison times too
def reference() -> ReferenceMAE:
    """A small reference MAE (2 heads of 64 as the paper's sizes: embed_dim // 64) with random weights
    everywhere (norms around 1), so every tensor of a checkpoint saved from it matters."""
    ref = ReferenceMAE(img_size=8, patch_size=2, in_chans=3, embed_dim=128, depth=2, num_heads=128 // 64,
                       decoder_embed_dim=64, decoder_depth=2, decoder_num_heads=16)
    torch.manual_seed(3)
    with torch.no_grad():
        for name, t in ref.state_dict().items():
            t.copy_(torch.randn_like(t) * 0.1 + (1.0 if name.endswith("norm.weight") or "norm1.w" in name
                                                  or "norm2.w" in name else 0.0))
    return ref


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    """(reference module, full .pth, encoder-only .pth), saved as facebookresearch/mae does: {"model": sd}."""
    d = tmp_path_factory.mktemp("official")
    ref = reference().eval()
    torch.save({"model": ref.state_dict()}, d / "mae_pretrain_vit_tiny_full.pth")
    enc = {k: v for k, v in ref.state_dict().items() if not k.startswith(("decoder_", "mask_token"))}
    torch.save({"model": enc}, d / "mae_pretrain_vit_tiny.pth")
    return ref, d / "mae_pretrain_vit_tiny_full.pth", d / "mae_pretrain_vit_tiny.pth"


@pytest.mark.parametrize("norm_pix", [True, False])
def test_official_full_checkpoint_matches_the_reference(official, norm_pix):
    ref, full, _ = official
    m = load_official(full, norm_pix_loss=norm_pix).eval()
    assert (m.embed_dim, len(m.blocks), m.blocks[0].attn.num_heads, m.patch_size, m.img_size) == (128, 2, 2, (2, 2), (8, 8))
    assert len(m.decoder_blocks) == 2 and m.decoder_pred.out_features == 12 and not m.pos_embed.weight.requires_grad
    x, noise = torch.randn(2, 3, 8, 8), torch.rand(2, 16)
    ref.norm_pix_loss = norm_pix
    with torch.no_grad():
        want = (*ref(x, 0.75, noise), ref.forward_encoder(x, 0.75, noise)[0])  # loss, pred, mask, latent
        got = m(x, 0.75, noise)
        latent = m.forward_encoder(x, 0.75, noise)[0]
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[2], want[2])
    torch.testing.assert_close(latent, want[3], atol=1e-5, rtol=1e-5)


def test_official_encoder_only_checkpoint_gets_a_fresh_decoder(official, caplog):
    ref, _, enc = official
    with caplog.at_level(logging.INFO, logger="vitpipe.models.mae"):
        m = load_official(enc, decoder_embed_dim=16, decoder_depth=1).eval()
    assert "holds the encoder only; the decoder (16 wide, 1 deep, 16 heads) is freshly initialised" in caplog.text
    x, noise = torch.randn(2, 3, 8, 8), torch.rand(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(m.forward_encoder(x, 0.5, noise)[0], ref.forward_encoder(x, 0.5, noise)[0],
                                   atol=1e-5, rtol=1e-5)
        assert torch.isfinite(m(x)[0])


def test_official_checkpoint_that_does_not_fit_is_one_line(official, tmp_path):
    ref, _, _ = official
    sd = dict(ref.state_dict())
    sd.pop("blocks.1.norm1.weight")
    sd["decoder_extra"] = torch.zeros(1)
    torch.save({"model": sd}, tmp_path / "bad.pth")
    with pytest.raises(ConfigError) as e:
        load_official(tmp_path / "bad.pth")
    msg = str(e.value)
    assert "\n" not in msg and "1 missing key: blocks.1.norm1.weight" in msg and "1 unexpected key: decoder_extra" in msg
    with pytest.raises(ConfigError, match=r"decoder_embed_dim=32\): \d+ shape mismatches \(file vs model\): "
                                          r"mask_token \(1,1,64\) vs \(1,1,32\)"):
        load_official(official[1], decoder_embed_dim=32)


@pytest.mark.parametrize("which", [1, 2])  # the full file, the encoder-only file
def test_official_encoder_loads_into_a_vit_classifier(official, which, caplog):
    path = official[which]
    mae = load_official(path, **({} if which == 1 else dict(decoder_embed_dim=16, decoder_depth=1))).eval()
    vit = ViT(**mae.encoder_kwargs(), num_classes=5).eval()
    with caplog.at_level(logging.INFO, logger="vitpipe.models.weights"):
        load_pretrained(vit, path)
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pretrained: ")][-1]
    assert line.endswith("new: head.weight, head.bias")
    n_dec = sum(k.startswith(("decoder_", "mask_token")) for k in official[0].state_dict())
    assert (f"(an MAE: its decoder's {n_dec} tensors dropped)" in line) == (which == 1)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        latent, _, ids_restore = mae.forward_encoder(x, 0.0)
        feats = vit.forward_features(x)
    torch.testing.assert_close(feats[:, 0], latent[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(feats[:, 1:], unshuffle(latent, ids_restore, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["learned", "sincos2d", "learned2d", "rope2d"])
@pytest.mark.parametrize("form", ["ckpt", "bare"])
def test_vitpipe_mae_checkpoint_loads_into_a_vit_classifier(kind, form, tmp_path, caplog):
    mae = tiny(pos_embed=kind, reg_tokens=1)
    sd = mae.state_dict()
    path = tmp_path / ("mae.ckpt" if form == "ckpt" else "mae.pth")
    # a LightningModule's checkpoint names the network's tensors net.*
    torch.save({"state_dict": {f"net.{k}": v for k, v in sd.items()}} if form == "ckpt" else sd, path)
    vit = ViT(**mae.encoder_kwargs(), num_classes=3).eval()
    with caplog.at_level(logging.INFO, logger="vitpipe.models.weights"):
        load_pretrained(vit, path)
    n_dec = sum(k.startswith(("decoder_", "mask_token")) for k in sd)
    assert f"{len(sd) - n_dec} tensors loaded from {path.name} (an MAE: its decoder's {n_dec} tensors dropped); " \
           "new: head.weight, head.bias" in caplog.text
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        latent, _, ids_restore = mae.forward_encoder(x, 0.0)
        feats = vit.forward_features(x)
    torch.testing.assert_close(feats[:, :2], latent[:, :2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(feats[:, 2:], unshuffle(latent, ids_restore, 2), atol=1e-5, rtol=1e-5)


def test_mae_into_a_classifier_of_another_shape_names_the_fix(tmp_path):
    torch.save(tiny(pos_embed="sincos2d").state_dict(), tmp_path / "mae.pth")
    vit = ViT(**{**tiny().encoder_kwargs(), "pos_embed": "learned"}, num_classes=3)
    with pytest.raises(ConfigError, match=r"1 missing key: pos_embed.weight; build the classifier from the MAE's encoder"):
        load_pretrained(vit, tmp_path / "mae.pth")


def test_registry_mae_variants_read_the_vit_table():
    for name, row in MAE_VARIANTS.items():
        enc = VARIANTS[row["encoder"]]
        kw = mae_kwargs(name)
        assert (kw["embed_dim"], kw["depth"], kw["num_heads"], kw["patch_size"], kw["img_size"]) == \
               (enc["dim"], enc["depth"], enc["num_heads"], enc["patch_size"], enc["img_size"])
        assert variant_value(name, "decoder_embed_dim") == kw["decoder_embed_dim"]
    for name in ("mae_vit_b16", "mae_vit_l16", "mae_vit_h14"):  # the paper's decoder and targets
        assert {k: mae_kwargs(name)[k] for k in ("decoder_embed_dim", "decoder_depth", "decoder_num_heads",
                                                 "norm_pix_loss")} == dict(decoder_embed_dim=512, decoder_depth=8,
                                                                           decoder_num_heads=16, norm_pix_loss=True)
    m = create_mae("mae_vit_nano", in_chans=1)
    assert m.encoder_kwargs() == dict(img_size=(8, 8), patch_size=(2, 2), in_chans=1, dim=64, depth=4, num_heads=4,
                                      mlp_ratio=4.0, pos_embed="sincos2d", class_token=True, reg_tokens=0, pool="cls")
    assert m.no_weight_decay() == {"cls_token", "mask_token"}
    assert set(tiny(pos_embed="learned").no_weight_decay()) == {"cls_token", "mask_token", "pos_embed.weight"}
    names = set(m.state_dict())
    assert {"cls_token", "mask_token", "decoder_pos_embed", "patch_embed.proj.weight", "norm.weight",
            "decoder_embed.weight", "decoder_norm.weight", "decoder_pred.weight", "blocks.3.attn.qkv.weight",
            "decoder_blocks.1.mlp.fc2.weight"} <= names
    with pytest.raises(ValueError, match="unknown MAE model name='mae_vit_x'; valid choices: mae_vit_nano"):
        create_mae("mae_vit_x")


def test_official_sizes_come_from_the_shapes():
    """ViT-H/14's 16 heads of 80 are not 1280 // 64: heads come from the variant of that width and depth."""
    def shapes(D, depth, p, n, Dd=512, ddepth=8):
        sd = {"patch_embed.proj.weight": (D, 3, p, p), "cls_token": (1, 1, D), "pos_embed": (1, 1 + n, D),
              "decoder_embed.weight": (Dd, D)}
        sd.update({f"blocks.{i}.mlp.fc1.weight": (4 * D, D) for i in range(depth)})
        sd.update({f"decoder_blocks.{i}.mlp.fc1.weight": (4 * Dd, Dd) for i in range(ddepth)})
        return {k: torch.empty(s, device="meta") for k, s in sd.items()}

    from vitpipe.models.mae import official_kwargs

    for (D, depth, p, heads) in [(768, 12, 16, 12), (1024, 24, 16, 16), (1280, 32, 14, 16), (256, 3, 8, 4)]:
        kw = official_kwargs(shapes(D, depth, p, 14 * 14 if p == 16 else 16 * 16 if p == 14 else 4 * 4))
        assert (kw["embed_dim"], kw["depth"], kw["num_heads"], kw["patch_size"]) == (D, depth, heads, (p, p))
        assert kw["img_size"] == ((224, 224) if p in (14, 16) else (32, 32)) and kw["mlp_ratio"] == 4.0
        assert (kw["decoder_embed_dim"], kw["decoder_depth"], kw["decoder_num_heads"]) == (512, 8, 16)
    with pytest.raises(ConfigError, match="holds 12 patch rows, not a square grid; pass img_size"):
        official_kwargs(shapes(256, 3, 8, 12))
    assert official_kwargs(shapes(256, 3, 8, 12), img_size=(24, 32))["img_size"] == (24, 32)


def test_mean_pool_mae_loads_into_its_mean_pool_classifier(tmp_path, caplog):
    """The MAE's token norm is dropped and fc_norm starts fresh (the paper's global-pool fine-tuning)."""
    mae = tiny(class_token=False, pos_embed="rope2d")
    torch.save(mae.state_dict(), tmp_path / "mae.pth")
    vit = ViT(**mae.encoder_kwargs(), num_classes=3).eval()
    assert mae.encoder_kwargs()["pool"] == "mean" and isinstance(vit.norm, nn.Identity)
    with caplog.at_level(logging.INFO, logger="vitpipe.models.weights"):
        load_pretrained(vit, tmp_path / "mae.pth")
    assert "new: fc_norm.weight, fc_norm.bias, head.weight, head.bias" in caplog.text
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        latent, _, ids_restore = mae.forward_encoder(x, 0.0)
        torch.testing.assert_close(mae.norm(vit.forward_features(x)), unshuffle(latent, ids_restore, 0),
                                   atol=1e-5, rtol=1e-5)
