"""Parity with timm's VisionTransformer and pretrained-weight loading."""

import pickle

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

from vitpipe import create_model
from vitpipe.errors import ConfigError
from vitpipe.models.timm_compat import from_timm, vitpipe_to_timm
from vitpipe.models.weights import load_pretrained

CONFIGS = {
    "square_cls": dict(img_size=32, patch_size=4, embed_dim=64, depth=3, num_heads=4, num_classes=10),
    "nonsquare_avg_qknorm_ls": dict(img_size=(24, 40), patch_size=8, embed_dim=48, depth=2, num_heads=3,
                                    num_classes=7, global_pool="avg", class_token=False, qk_norm=True,
                                    init_values=0.1),
    "registers_no_embed_class": dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5,
                                     reg_tokens=2, no_embed_class=True),
}


def _random_timm(kw):
    torch.manual_seed(0)
    tm = VisionTransformer(**kw).eval()
    with torch.no_grad():  # default init leaves biases at 0 and tokens ~0: randomise so every weight matters
        for p in tm.parameters():
            p.normal_(std=0.2)
    return tm


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_equal_timm(name):
    kw = CONFIGS[name]
    tm = _random_timm(kw)
    m = from_timm(tm)
    size = kw["img_size"] if isinstance(kw["img_size"], tuple) else (kw["img_size"],) * 2
    x = torch.randn(4, 3, *size)
    with torch.no_grad():
        diff = (m(x) - tm(x)).abs().max().item()
    print(f"timm parity {name}: max abs diff {diff:.3g}")
    assert diff <= 1e-5


def test_timm_attention_maps_equal_ours():
    tm = _random_timm(CONFIGS["square_cls"])
    m = from_timm(tm)
    x = torch.randn(2, 3, 32, 32)
    _, attn = m.forward_features(x, return_attn=True)
    # timm's own explicit path: recompute block 0's softmax from its qkv
    blk = tm.blocks[0]
    h = tm._pos_embed(tm.patch_embed(x))
    q, k, _ = blk.attn.qkv(blk.norm1(h)).reshape(2, -1, 3, 4, 16).permute(2, 0, 3, 1, 4)
    ref = (q @ k.transpose(-2, -1) * 16**-0.5).softmax(-1)
    assert (attn[0] - ref).abs().max() < 1e-5


def _save_timm_weights(tmp_path, kind):
    tm = _random_timm(dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=10))
    sd = tm.state_dict()
    if kind == "safetensors":
        from safetensors.torch import save_file

        path = tmp_path / "w.safetensors"
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    else:
        path = tmp_path / "w.pth"
        torch.save(sd, path)
    return tm, path


@pytest.mark.parametrize("kind", ["safetensors", "pth"])
def test_pretrained_from_file_same_config_matches_timm(tmp_path, kind):
    tm, path = _save_timm_weights(tmp_path, kind)
    m = create_model("vit_micro", img_size=32, patch_size=8, dim=32, depth=2, num_heads=2, num_classes=10,
                     pretrained=str(path)).eval()
    x = torch.randn(2, 3, 32, 32)
    assert (m(x) - tm(x)).abs().max() < 1e-4


def test_pretrained_to_new_grid_and_class_count(tmp_path):
    tm, path = _save_timm_weights(tmp_path, "safetensors")
    m = create_model("vit_micro", img_size=48, patch_size=8, dim=32, depth=2, num_heads=2, num_classes=3,
                     pretrained=str(path)).eval()
    assert m.pos_embed.weight.shape == (1, 1 + 36, 32)
    torch.testing.assert_close(m.blocks[1].mlp.fc2.weight, tm.blocks[1].mlp.fc2.weight)
    torch.testing.assert_close(m.pos_embed.weight[:, 0], tm.pos_embed[:, 0])  # class-token row kept
    assert m(torch.randn(1, 3, 48, 48)).shape == (1, 3)


def test_exported_state_dict_loads_into_timm():
    tm = _random_timm(CONFIGS["square_cls"])
    m = from_timm(tm)
    tm2 = VisionTransformer(**CONFIGS["square_cls"]).eval()
    tm2.load_state_dict(vitpipe_to_timm(m.state_dict()))
    x = torch.randn(2, 3, 32, 32)
    assert (tm2(x) - tm(x)).abs().max() < 1e-6


class _Evil:
    def __reduce__(self):
        return (print, ("pickled code ran",))


def test_weight_file_never_executes_pickled_code(tmp_path, capsys):
    path = tmp_path / "evil.pth"
    with open(path, "wb") as f:
        pickle.dump({"x": _Evil()}, f)
    with pytest.raises(ConfigError, match="evil.pth"):
        create_model("vit_micro", pretrained=str(path))
    assert "pickled code ran" not in capsys.readouterr().out


def test_missing_file_and_wrong_shape_give_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        create_model("vit_micro", pretrained=str(tmp_path / "nope.safetensors"))
    _, path = _save_timm_weights(tmp_path, "pth")
    with pytest.raises(ConfigError, match="do not fit this model"):
        create_model("vit_micro", pretrained=str(path))  # dim 64 vs 32


def test_timm_name_offline_gives_clear_error(monkeypatch):
    import timm

    def offline(*a, **k):
        raise OSError("no network")

    monkeypatch.setattr(timm, "create_model", offline)
    m = create_model("vit_micro")
    with pytest.raises(ConfigError, match=r"offline.*pretrained=/path/to/model.safetensors"):
        load_pretrained(m, "vit_tiny_patch16_224")
    with pytest.raises(ConfigError, match="neither an existing weights file nor a timm model name"):
        load_pretrained(m, "not_a_model_name")


# qk_norm where its LayerNorm eps shows: the q and k rows of every qkv projection shrunk so that q and k
# vary by ~1e-5 per head, the size of eps itself (eps 1e-5 instead of timm's 1e-6 moves these logits by ~1e-3)
QK_NORM = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=5, qk_norm=True)


def _shrink_qk(model, scale=0.01):
    """Scale the q and k rows of each block's fused qkv (the same layout in timm and vitpipe) by ``scale``."""
    with torch.no_grad():
        for blk in model.blocks:
            dim = blk.attn.qkv.in_features
            blk.attn.qkv.weight[: 2 * dim] *= scale
            blk.attn.qkv.bias[: 2 * dim] *= scale
    return model


def _max_logit_diff(a, b, x):
    with torch.no_grad():
        return (a(x) - b(x)).abs().max().item()


def _with_qk_eps(model, eps):
    """A copy of a vitpipe ViT whose qk LayerNorms use ``eps`` (what a model built with another eps computes)."""
    import copy

    other = copy.deepcopy(model)
    for blk in other.blocks:
        blk.attn.q_norm.eps = blk.attn.k_norm.eps = eps
    return other


def test_qk_norm_from_timm_is_exact_where_eps_matters():
    tm = _shrink_qk(_random_timm(QK_NORM))
    m = from_timm(tm).eval()
    x = torch.randn(4, 3, 16, 16)
    blk = tm.blocks[0]
    q = blk.attn.qkv(blk.norm1(tm._pos_embed(tm.patch_embed(x))))[..., :16]  # head 0's queries
    assert q.var(-1).mean() < 1e-4  # eps (1e-6) is not negligible next to the variance being normalised
    diff = _max_logit_diff(m, tm, x)
    print(f"qk_norm from_timm: max abs logit diff {diff:.3g}")
    assert diff <= 1e-5
    assert _max_logit_diff(_with_qk_eps(m, 1e-5), tm, x) > 1e-4  # the test sees an eps of 1e-5


def test_qk_norm_to_timm_is_exact_and_exports(tmp_path):
    import timm

    from vitpipe.data.preprocess import InputSpec
    from vitpipe.export.timm_format import TIMM_TOLERANCE, save_timm
    from vitpipe.models.timm_compat import to_timm

    m = from_timm(_shrink_qk(_random_timm(QK_NORM))).eval()
    x = torch.randn(4, 3, 16, 16)
    tm = to_timm(m).eval()
    assert tm.blocks[0].attn.q_norm.eps == m.blocks[0].attn.q_norm.eps == 1e-6
    assert _max_logit_diff(tm, m, x) <= 1e-5
    assert _max_logit_diff(tm, _with_qk_eps(m, 1e-5), x) > 1e-4  # timm's eps, not a copy of ours
    # format=timm: the folder timm loads back through local-dir gives the network's logits
    spec = InputSpec(mode="RGB", img_size=(16, 16), in_chans=3, mean=(0.5,) * 3, std=(0.5,) * 3, crop_mode="squash",
                     crop_pct=1.0, interpolation="bilinear")
    assert save_timm(m, spec, tmp_path / "vit") <= TIMM_TOLERANCE
    loaded = timm.create_model(f"local-dir:{tmp_path / 'vit'}", pretrained=True).eval()
    assert loaded.blocks[0].attn.q_norm.eps == 1e-6
    assert _max_logit_diff(loaded, m, x) <= 1e-5


def test_from_timm_carries_another_layer_norm_eps():
    """CLIP-style eps 1e-5 (every norm, the qk norms included) converts as norm_eps, with timm's logits."""
    from functools import partial

    tm = _random_timm(dict(QK_NORM, norm_layer=partial(torch.nn.LayerNorm, eps=1e-5)))
    m = from_timm(tm)
    assert m.norm_eps == 1e-5 and m.blocks[0].attn.q_norm.eps == 1e-5
    assert _max_logit_diff(m, tm, torch.randn(2, 3, 16, 16)) <= 1e-5
