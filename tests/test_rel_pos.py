"""Relative position bias for images (vitpipe.nn.rel_pos): the index and both bias kinds equal timm's,
the ViTs equal timm's vit_relpos_* and beit_* both ways (fused and explicit attention), the bias reaches
rollout, resizes to other grids as timm does, and a trained run exports to timm."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import tiny_checkpoints as tc
import torch
from timm.layers import RelPosBias as TimmRelPosBias
from timm.layers import RelPosMlp as TimmRelPosMlp
from timm.layers.pos_embed_rel import gen_relative_position_index

from vitpipe.models.timm_compat import from_timm, to_timm
from vitpipe.models.vit import ViT
from vitpipe.nn.rel_pos import RelPosBias, RelPosMlp, relative_position_index

ROOT = Path(__file__).resolve().parents[1]
tc.KINDS.setdefault("relpos_bias", ["model.pos_embed=learned", "model.rel_pos=bias"])
tc.KINDS.setdefault("relpos_mlp", ["model.pos_embed=none", "model.rel_pos=mlp_cr", "model.class_token=false",
                                   "model.pool=mean"])

ARCHS = ["vit_relpos_small_patch16_224", "vit_relpos_medium_patch16_cls_224", "vit_srelpos_small_patch16_224",
         "vit_relpos_base_patch16_rpn_224", "beit_base_patch16_224"]


@pytest.mark.parametrize("grid", [(3, 4), (5, 2), (4, 4)])
@pytest.mark.parametrize("cls", [False, True])
def test_the_index_is_timms(grid, cls):
    ours = relative_position_index(*grid, num_prefix=int(cls))
    assert torch.equal(ours, gen_relative_position_index(grid, class_token=cls))
    assert ours.max() == (2 * grid[0] - 1) * (2 * grid[1] - 1) - 1 + (3 if cls else 0)


@pytest.mark.parametrize("prefix", [0, 1])
def test_the_table_and_its_resize_are_timms(prefix):
    """Same table, same bias at the built grid; at another (non-square) grid the bias timm's
    set_window_size gives (its resize_rel_pos_bias_table: BEiT's geometric interpolation)."""
    torch.manual_seed(0)
    ours, theirs = RelPosBias((3, 4), 4, prefix), TimmRelPosBias((3, 4), 4, prefix_tokens=prefix)
    with torch.no_grad():
        ours.relative_position_bias_table.normal_()
        theirs.relative_position_bias_table.copy_(ours.relative_position_bias_table)
    assert torch.equal(ours((3, 4)), theirs.get_bias())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # timm's interpolator warns about its own indexing
        theirs.set_window_size((5, 6))
        resized = ours((5, 6))
    assert resized.shape == (1, 4, 30 + prefix, 30 + prefix)
    torch.testing.assert_close(resized, theirs.get_bias(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode", ["cr", "swin"])
@pytest.mark.parametrize("prefix", [0, 1])
def test_the_log_coordinate_mlp_is_timms(mode, prefix):
    torch.manual_seed(0)
    ours = RelPosMlp(4, hidden_dim=16, num_prefix_tokens=prefix, mode=mode).eval()
    for grid in [(3, 5), (4, 4)]:
        theirs = TimmRelPosMlp(grid, num_heads=4, hidden_dim=16, prefix_tokens=prefix, mode=mode).eval()
        theirs.load_state_dict(ours.state_dict())
        bias = ours(grid)
        assert bias.shape == (1, 4, prefix + grid[0] * grid[1], prefix + grid[0] * grid[1])
        torch.testing.assert_close(bias, theirs.get_bias(), atol=1e-6, rtol=1e-6)
        if prefix:
            assert bias[:, :, :prefix].abs().max() == 0 and bias[:, :, :, :prefix].abs().max() == 0


def _randomize(tm: torch.nn.Module) -> None:
    """Every weight that carries position or scale away from its init (timm zero-inits BEiT's tables and
    starts LayerScale at 1e-6, under which any bias would pass unseen)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in tm.named_parameters():
            if "relative_position_bias_table" in name or "rel_pos" in name:
                p.normal_(0, 0.5)
            elif "gamma" in name or name.endswith(("norm1.weight", "norm2.weight")):
                p.normal_(1.0, 0.3)
            elif name.endswith(("q_bias", "v_bias")) or name.startswith("head."):
                p.normal_(0, 0.3)


def _logits(model, x, fused: bool):
    """timm models: their fused_attn switch; vitpipe's: the explicit path is return_attn."""
    with torch.no_grad():
        if hasattr(model, "rel_pos_kind"):
            return model(x) if fused else model.forward_head(model.forward_features(x, return_attn=True)[0])
        for blk in model.blocks:
            blk.attn.fused_attn = fused
        return model(x)


@pytest.mark.parametrize("arch", ARCHS)
def test_timm_relpos_and_beit_models_convert_both_ways_to_equal_logits(arch):
    """The named architectures (depth 2, a 3x4 grid), random tables, eval mode, fused and unfused:
    from_timm, then to_timm back; equal logits, and the bias moves them (zeroing it changes them)."""
    import timm

    tm = timm.create_model(arch, pretrained=False, img_size=(48, 64), depth=2, num_classes=7).eval()
    _randomize(tm)
    x = torch.randn(2, 3, 48, 64, generator=torch.Generator().manual_seed(1))
    ours = from_timm(tm).eval()
    back = to_timm(ours).eval()
    assert type(back) is type(tm)
    for fused in (True, False):
        ref = _logits(tm, x, fused)
        assert (_logits(ours, x, fused) - ref).abs().max() < 1e-5
        assert (_logits(back, x, fused) - ref).abs().max() < 1e-5
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "rel_pos" in name:
                p.zero_()
    assert (_logits(ours, x, True) - ref).abs().max() > 1e-2


def test_the_bias_is_in_the_attention_maps_and_rollout_sees_it():
    """The explicit path (rollout, gradient rollout) reads softmax(scale q.k + bias): block 0's weights
    by hand; and the fused forward equals the explicit one for a non-square grid."""
    torch.manual_seed(0)
    net = ViT(img_size=(8, 12), patch_size=4, dim=32, depth=2, num_heads=4, num_classes=3, rel_pos="bias").eval()
    with torch.no_grad():
        net.blocks[0].rel_pos.relative_position_bias_table.normal_()
    x = torch.randn(2, 1 * 3, 8, 12)
    tokens, maps = net.forward_features(x, return_attn=True)
    torch.testing.assert_close(net.forward_head(tokens), net(x), atol=1e-5, rtol=1e-5)
    blk = net.blocks[0]
    h = blk.norm1(net._embed(x)[0])
    q, k, _ = blk.attn.qkv(h).view(2, 7, 3, 4, 8).permute(2, 0, 3, 1, 4)
    expected = ((q @ k.transpose(-2, -1)) * 8**-0.5 + blk.rel_pos((2, 3))).softmax(-1)
    torch.testing.assert_close(maps[0], expected, atol=1e-5, rtol=1e-5)
    from vitpipe.inference.explain import explain

    maps = {m: explain(net, x, m) for m in ("rollout", "gradient")}
    with torch.no_grad():
        net.blocks[0].rel_pos.relative_position_bias_table.zero_()
    for method, before in maps.items():  # the bias reaches both explanations
        assert before.shape == (2, 2, 3) and torch.isfinite(before).all()
        assert (explain(net, x, method) - before).abs().max() > 1e-3, method


def test_rel_pos_with_a_patch_dict_is_refused_in_one_line():
    net = ViT(img_size=8, patch_size=4, dim=16, depth=1, num_heads=2, num_classes=2, rel_pos="mlp_cr")
    batch = {"patches": torch.zeros(1, 4, 48), "patch_coord": torch.zeros(1, 4, 2, dtype=torch.long),
             "patch_valid": torch.ones(1, 4, dtype=torch.bool)}
    with pytest.raises(ValueError, match="rel_pos='mlp_cr' takes image tensors") as e:
        net(batch)
    assert "\n" not in str(e.value)


def test_unknown_rel_pos_names_the_choices():
    with pytest.raises(ValueError, match="unknown rel_pos='t5'; valid choices: none, bias, mlp_cr, mlp_swin"):
        ViT(img_size=8, patch_size=4, dim=16, depth=1, num_heads=2, rel_pos="t5")


def test_a_checkpoint_with_rel_pos_exports_to_timm_as_typed(tmp_path_factory, tmp_path):
    """scripts/export.py format=timm on a stored run with mlp_cr and no absolute positions: timm's
    VisionTransformerRelPos (export's own check compares the logits before the folder is renamed)."""
    import timm

    ckpt = tc.checkpoint("relpos_mlp", tmp_path_factory.mktemp("ckpts"))
    out = tmp_path / "exported"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "scripts/export.py", f"ckpt_path={ckpt}", "format=timm", f"out={out}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert type(timm.create_model(f"local-dir:{out}", pretrained=True)).__name__ == "VisionTransformerRelPos"


def test_a_table_with_learned_positions_exports_as_beit(tmp_path_factory, tmp_path):
    """The stored run with rel_pos=bias, learned positions and a class token becomes timm's Beit through
    the export's own path (save_timm: written, loaded back by timm, logits compared)."""
    import timm

    from vitpipe.export.timm_format import save_timm
    from vitpipe.inference.load import load_predictor

    loaded = load_predictor(tc.checkpoint("relpos_bias", tmp_path_factory.mktemp("ckpts")))
    diff = save_timm(loaded.net, loaded.preprocess.spec, tmp_path / "beit")
    assert diff < 1e-5
    assert type(timm.create_model(f"local-dir:{tmp_path / 'beit'}", pretrained=True)).__name__ == "Beit"


@pytest.mark.parametrize("kind", ["relpos_bias", "relpos_mlp"])
def test_a_checkpoint_with_rel_pos_exports_to_onnx(kind, tmp_path_factory, tmp_path):
    """format=onnx of a stored run with a relative position bias: onnxruntime's logits against PyTorch's
    (the export's own check; torch.onnx cannot decompose SDPA with a float mask, the export takes the
    explicit softmax for it)."""
    from vitpipe.export.onnx_format import export_onnx
    from vitpipe.inference.load import load_predictor

    loaded = load_predictor(tc.checkpoint(kind, tmp_path_factory.mktemp("ckpts")))
    assert export_onnx(loaded.net, loaded.preprocess.spec, tmp_path / "m.onnx", kind=loaded.kind) < 1e-5
