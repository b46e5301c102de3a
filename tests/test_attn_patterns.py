"""Local + global attention patterns (vitpipe.nn.patterns): the mask's structure, flex vs masked SDPA vs the
explicit path through the one attention core, the long-sequence benchmark at tiny sizes, and the explicit
attention memory check (vitpipe.nn.attn_memory) that visualize runs before reading images."""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
from conftest import make_cfg

import vitpipe.nn.attention as attention_module
from vitpipe.benchmark.config import BenchConfig
from vitpipe.benchmark.long_seq import METHODS, compare_long_seq, markdown
from vitpipe.benchmark.run import run
from vitpipe.benchmark.table import format_table
from vitpipe.errors import ConfigError
from vitpipe.models.vit import ViT
from vitpipe.nn.attention import MultiHeadAttention
from vitpipe.nn.attn_memory import check_explicit_attention, format_bytes
from vitpipe.nn.blocks import EncoderBlock
from vitpipe.nn.patterns import BlockMask, dense_mask, flex_support, local_global_mask
from vitpipe.tasks import visualize as viz

# (grid, num_prefix, window, global_stride): non-square grids, with and without prefix and global patches
PATTERNS = [((3, 5), 1, 1, 0), ((4, 6), 2, 1, 2), ((5, 3), 0, 2, 0), ((4, 7), 1, 0, 3)]


def reference_mask(grid, num_prefix, window, global_stride) -> torch.Tensor:
    """The pattern written out pair by pair, as the docstring states it."""
    h, w = grid
    n = num_prefix + h * w

    def is_global(t):
        if t < num_prefix:
            return True
        r, c = divmod(t - num_prefix, w)
        return global_stride > 0 and r % global_stride == 0 and c % global_stride == 0

    mask = torch.zeros(n, n, dtype=torch.bool)
    for q, k in itertools.product(range(n), range(n)):
        if is_global(q) or is_global(k):
            mask[q, k] = True
        else:
            (rq, cq), (rk, ck) = divmod(q - num_prefix, w), divmod(k - num_prefix, w)
            mask[q, k] = abs(rq - rk) <= window and abs(cq - ck) <= window
    return mask


# --------------------------------------------------------------------------- the mask


@pytest.mark.parametrize("grid,num_prefix,window,stride", PATTERNS)
def test_mask_has_the_stated_structure(grid, num_prefix, window, stride):
    mask = local_global_mask(grid, num_prefix, window=window, global_stride=stride, backend="sdpa")
    n = num_prefix + grid[0] * grid[1]
    assert mask.dtype == torch.bool and mask.shape == (n, n)
    assert torch.equal(mask, reference_mask(grid, num_prefix, window, stride))
    assert torch.equal(mask, mask.T)  # |r - r'| and |c - c'| are symmetric, and so is "global"
    assert mask[:num_prefix].all() and mask[:, :num_prefix].all()  # prefix tokens see and are seen by all
    assert mask.diagonal().all()


def test_keys_per_query_count_the_window_the_prefix_and_the_global_patches():
    grid, P = (5, 7), 1
    mask = local_global_mask(grid, P, window=1, backend="sdpa")
    counts = mask.sum(-1)[P:].view(grid)  # keys per patch query, on the grid
    assert counts[2, 3] == 9 + P  # interior: a full 3 x 3 window + the class token
    assert counts[0, 0] == 4 + P and counts[0, 3] == 6 + P  # corner 2 x 2, edge 2 x 3
    assert (mask.sum(-1)[:P] == P + 35).all()
    strided = local_global_mask(grid, P, window=1, global_stride=2, backend="sdpa")
    g = 3 * 4  # global patches: rows 0, 2, 4 x cols 0, 2, 4, 6
    assert (strided.sum(-1)[P:].view(grid)[0, 0] == P + 35).all()  # (0, 0) is global: sees everything
    # (1, 1) is not global: its 3 x 3 window holds 4 global patches, and 8 more global patches lie outside it
    assert strided.sum(-1)[P:].view(grid)[1, 1] == 9 + P + (g - 4)


@pytest.mark.parametrize("grid,num_prefix,window,stride", PATTERNS)
def test_flex_blockmask_is_the_same_pattern(grid, num_prefix, window, stride):
    block = local_global_mask(grid, num_prefix, window=window, global_stride=stride, backend="flex")
    assert isinstance(block, BlockMask) and block.shape[:2] == (1, 1)  # B=None, H=None: one pattern for all
    assert torch.equal(
        dense_mask(block), local_global_mask(grid, num_prefix, window=window, global_stride=stride, backend="sdpa")
    )


def test_auto_takes_flex_only_where_it_trains_and_compiles():
    support = flex_support("cpu")
    assert set(support) == {"forward", "backward", "compiled", "auto", "why"}
    mask = local_global_mask((2, 3), 1, window=1)  # backend="auto"
    assert isinstance(mask, BlockMask) == support["auto"]
    if not support["backward"]:  # torch 2.14 on a CPU: inference only, so auto gives the boolean mask
        assert isinstance(mask, torch.Tensor) and "backward" in support["why"]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(window=-1), r"window=-1; valid: an int >= 0"),
        (dict(window=1, global_stride=-2), r"global_stride=-2; valid: an int >= 0"),
        (dict(window=1, backend="xla"), r"backend='xla'; valid choices: auto, flex, sdpa"),
        (dict(window=1.5), r"window=1.5; valid"),
    ],
)
def test_bad_values_raise_one_line_naming_value_and_valid_ones(kwargs, match):
    with pytest.raises(ValueError, match=match) as e:
        local_global_mask((4, 4), 1, **kwargs)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"grid=\(0, 4\); valid: two positive ints"):
        local_global_mask((0, 4), 1, window=1)


# --------------------------------------------------------------------------- through the attention core


def _modules(dim=32, heads=4):
    torch.manual_seed(0)
    return MultiHeadAttention(dim, heads).eval(), EncoderBlock(dim, heads).eval()


@pytest.mark.parametrize("grid,num_prefix,window,stride", PATTERNS)
def test_masked_sdpa_equals_the_explicit_path_under_the_pattern(grid, num_prefix, window, stride):
    mask = local_global_mask(grid, num_prefix, window=window, global_stride=stride, backend="sdpa")
    x = torch.randn(2, mask.shape[0], 32)
    for m in _modules():
        fused = m(x, attn_mask=mask)
        explicit, w = m(x, attn_mask=mask, need_weights=True)
        assert (fused - explicit).abs().max() < 1e-5
        assert (w.masked_select(~mask.expand_as(w)) == 0).all()  # nothing outside the pattern
        torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)))
    dense = _modules()[0](x)
    assert (dense - _modules()[0](x, attn_mask=mask)).abs().max() > 1e-4  # the pattern does change the output


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("grid,num_prefix,window,stride", PATTERNS)
def test_flex_equals_dense_attention_under_the_same_mask(grid, num_prefix, window, stride, monkeypatch):
    """Every pattern through ``_attend_flex`` with eager flex (fast: nothing to compile); the compiled kernel is
    the next test's."""
    support = flex_support("cpu")
    monkeypatch.setattr(attention_module, "flex_support", lambda device: {**support, "compiled": False})
    block = local_global_mask(grid, num_prefix, window=window, global_stride=stride, backend="flex")
    mask = dense_mask(block)
    x = torch.randn(2, mask.shape[0], 32)
    with torch.no_grad():
        for m in _modules():
            flex = m(x, attn_mask=block)
            assert (flex - m(x, attn_mask=mask)).abs().max() < 1e-5
            assert (flex - m(x, attn_mask=mask, need_weights=True)[0]).abs().max() < 1e-5


@pytest.mark.skipif(not flex_support("cpu")["compiled"], reason="torch.compile cannot build flex_attention here")
def test_compiled_flex_equals_masked_sdpa_and_the_explicit_path():
    """The fused kernel ``_attend_flex`` runs on this CPU (one compilation, ~10 s cold on 2 cores), non-square
    grid, class token, global patches."""
    grid, P = (5, 7), 1
    block = local_global_mask(grid, P, window=1, global_stride=2, backend="flex")
    mask = dense_mask(block)
    x = torch.randn(2, P + 35, 32)
    with torch.no_grad():
        for m in _modules():  # same shapes: compiled once for both modules
            flex = m(x, attn_mask=block)
            assert (flex - m(x, attn_mask=mask)).abs().max() < 1e-5
            assert (flex - m(x, attn_mask=mask, need_weights=True)[0]).abs().max() < 1e-5


def test_flex_pattern_refuses_what_it_cannot_do_in_one_line():
    mha, block_module = _modules()
    block = local_global_mask((3, 5), 1, window=1, backend="flex")
    x = torch.randn(1, 16, 32)
    with pytest.raises(ValueError, match="takes no need_weights"):
        mha(x, attn_mask=block, need_weights=True)
    if not flex_support("cpu")["backward"]:  # CPU flex has no backward: training must say so, not crash deep in torch
        with pytest.raises(ValueError, match=r"inference only .*backend='sdpa'"):
            block_module.train()(x, attn_mask=block)


# --------------------------------------------------------------------------- the benchmark


TINY = dict(tokens=(16, 36), dim=32, heads=2, depth=1, window=1, flex=False)


def test_long_seq_comparison_runs_at_tiny_sizes_with_finite_ratios():
    res = compare_long_seq(BenchConfig(steps=1, warmup=1, repeats=1), **TINY)
    assert set(res["contenders"]) == {f"{m}/{n}" for m in METHODS if m != "local_flex" for n in (16, 36)}
    for name, phases in res["contenders"].items():
        assert set(phases) == ({"train"} if name.startswith("checkpoint") else {"train", "infer"}), name
        for s in phases.values():
            assert s["step_s"] > 0 and s["memory"]["peak_step_bytes"] > 0 and s["tokens"] == int(name.split("/")[1]) + 1
    # per size, against sdpa: time, paired time and peak memory of explicit, checkpoint, local_sdpa (train)
    # and of explicit, local_sdpa (infer)
    assert len(res["ratios"]) == 2 * (3 + 2) * 3
    assert all(math.isfinite(v) and v > 0 for v in res["ratios"].values())
    c = res["contenders"]
    assert res["ratios"]["train peak mem explicit/sdpa @36"] == pytest.approx(
        c["explicit/36"]["train"]["memory"]["peak_step_bytes"] / c["sdpa/36"]["train"]["memory"]["peak_step_bytes"]
    )
    assert set(res["unavailable"]) == {"local_flex/16", "local_flex/36"}
    kept = local_global_mask((4, 4), 1, window=1, backend="sdpa").float().mean().item()
    assert res["masks"][16]["kept_fraction"] == pytest.approx(kept)
    table = markdown(res)
    assert len(table.splitlines()) == 2 + 2 * len(METHODS) and "n/a" in table


def test_long_seq_is_a_registered_comparison(monkeypatch):
    """``--only long_seq`` reaches ``compare_long_seq`` through the harness and its table (sizes shrunk)."""
    import vitpipe.benchmark.long_seq as long_seq

    monkeypatch.setattr(long_seq, "compare_long_seq", functools.partial(long_seq.compare_long_seq, **TINY))
    result = run(BenchConfig(steps=1, warmup=1, repeats=1), ("long_seq",))
    table = format_table(result)
    assert "local_sdpa/36" in table and "train peak mem explicit/sdpa @16" in table
    assert "local_flex/16 unavailable: not asked" in table


# --------------------------------------------------------------------------- explicit attention memory


def test_check_explicit_attention_names_the_estimate_and_what_to_change():
    assert check_explicit_attention(2, 3, 100, 4, available_bytes=10**9) is None
    need = 2 * 3 * 100 * 100 * 4 * 4  # B x heads x N x N x bytes x layers
    line = check_explicit_attention(2, 3, 100, 4, available_bytes=need - 1, what="rollout")
    assert line.startswith(f"rollout would hold {format_bytes(need)} of attention matrices (2 x 3 heads x 100^2 tokens")
    assert "batch_size=1 fits" in line and "patch_size" in line and "img_size" in line and "fused" in line
    assert "\n" not in line
    line = check_explicit_attention(2, 3, 100, 4, available_bytes=1000)
    assert "not even batch_size=1" in line and "about 4 tokens fit" in line  # isqrt(1000 // (3 heads x 4 B x 4))


def test_visualize_refuses_a_rollout_that_cannot_fit_before_reading_images(tmp_path):
    """img_size 4096 at patch 4: 1 + 1024^2 tokens; rollout of 8 images would hold tens of TiB."""
    net = ViT(img_size=4096, patch_size=4, dim=8, depth=1, num_heads=1, num_classes=2, pos_embed="none")
    cfg = make_cfg(tmp_path, ["ckpt_path=unused", "images=test", "method=rollout"], config_name="visualize")
    with pytest.raises(ConfigError) as e:
        viz.check_attention_memory(net, cfg, None, torch.device("cpu"), captioner=False)
    tokens = 1 + 1024**2
    need = min(cfg.batch_size, cfg.num_images) * tokens**2 * 4
    assert str(e.value).startswith(f"method=rollout (attention rollout) would hold {format_bytes(need)}")
    assert f"{tokens}^2 tokens" in str(e.value) and "\n" not in str(e.value)
    small = ViT(img_size=32, patch_size=4, dim=8, depth=2, num_heads=2, num_classes=2)
    viz.check_attention_memory(small, cfg, None, torch.device("cpu"), captioner=False)  # fits: nothing said


def test_visualize_command_checks_memory_before_any_image_is_read(tmp_path):
    """The command itself: a checkpoint whose stored config says img_size=4096 (vit_nano's patch 2: 1 + 2048^2
    tokens) is refused with the estimate right after the network is rebuilt, before the test split loads."""
    import tiny_checkpoints as tc

    stored = torch.load(tc.checkpoint("sincos2d", tmp_path / "ck"), map_location="cpu", weights_only=True)
    stored["vitpipe_config"]["model"].update(img_size=4096, pos_embed="none")  # no position table to build
    path = tmp_path / "big" / "checkpoints" / "epoch_000.ckpt"
    path.parent.mkdir(parents=True)
    torch.save(stored, path)
    cfg = make_cfg(tmp_path, [f"ckpt_path={path}", "images=test", f"out={tmp_path / 'out'}"], config_name="visualize")
    with pytest.raises(ConfigError, match=rf"method=all \(gradient rollout\) would hold .* TiB .*{1 + 2048**2}\^2 tokens"):
        viz.visualize(cfg)
    assert not list((tmp_path / "out").rglob("*.png"))


# --------------------------------------------------------------------------- the ViT option


def _vit(**kw):
    from vitpipe.models.vit import ViT

    torch.manual_seed(0)
    return ViT(img_size=(12, 20), patch_size=4, dim=32, depth=2, num_heads=2, num_classes=3, **kw)


def test_a_vit_with_a_local_window_attends_only_inside_it_and_trains():
    """model.attn_window: the explicit maps are zero outside the pattern, a window covering the 3x5 grid is
    dense attention, a smaller one is not; training takes a backward on this CPU (auto: masked SDPA)."""
    x = torch.randn(2, 3, 12, 20)
    dense, wide, local = _vit().eval(), _vit(attn_window=4).eval(), _vit(attn_window=1).eval()
    with torch.no_grad():
        assert (wide(x) - dense(x)).abs().max() < 1e-5
        assert (local(x) - dense(x)).abs().max() > 1e-4
        _, maps = local.forward_features(x, return_attn=True)
    allowed = dense_mask(local_global_mask((3, 5), 1, window=1, backend="sdpa"))
    assert maps[0][..., ~allowed].abs().max() == 0 and maps[0][..., allowed].min() > 0
    with torch.no_grad():  # the fused forward is the explicit one
        assert (local.forward_head(local.forward_features(x, return_attn=True)[0]) - local(x)).abs().max() < 1e-5
    local.train()
    local(x).sum().backward()
    assert local.blocks[0].attn.qkv.weight.grad.abs().sum() > 0


@pytest.mark.slow  # one flex_attention compilation: 5-20 s on 2 cores
@pytest.mark.skipif(not flex_support("cpu")["compiled"], reason="torch.compile cannot build flex_attention here")
def test_a_vit_with_flex_in_eval_equals_masked_sdpa():
    x = torch.randn(1, 3, 12, 20)
    sdpa, flex = _vit(attn_window=1, attn_global_stride=2, attn_backend="sdpa").eval(), \
        _vit(attn_window=1, attn_global_stride=2, attn_backend="flex").eval()
    with torch.no_grad():
        assert (sdpa(x) - flex(x)).abs().max() < 1e-5


def test_bad_window_values_fail_when_the_model_is_built():
    with pytest.raises(ValueError, match="window=-1"):
        _vit(attn_window=-1)
    with pytest.raises(ValueError, match="backend='dense'"):
        _vit(attn_window=1, attn_backend="dense")


def test_what_timm_cannot_express_is_refused_before_an_export_writes():
    """A local window has no timm counterpart: export format=timm refuses it in one line (timm's dense
    model would differ), for a plain ViT and for one with a relative position bias."""
    from vitpipe.errors import ConfigError
    from vitpipe.models.timm_compat import timm_kwargs
    from vitpipe.models.timm_relpos import timm_relpos_target

    with pytest.raises(ConfigError, match=r"local attention \(attn_window\)") as e:
        timm_kwargs(_vit(attn_window=1))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"local attention \(attn_window\)"):
        timm_relpos_target(_vit(attn_window=1, rel_pos="mlp_cr", pos_embed="none"))


def test_a_flex_pattern_that_cannot_train_here_is_refused_before_data_loads(cfg_factory):
    from vitpipe.config.preflight import preflight
    from vitpipe.errors import ConfigError

    cfg = cfg_factory("trainer=cpu", "model.attn_window=1", "model.attn_backend=flex")
    if flex_support("cpu")["backward"]:
        preflight(cfg, "train")
        return
    with pytest.raises(ConfigError, match="model.attn_backend=flex cannot train on cpu here .*use model.attn_backend=auto"):
        preflight(cfg, "train")
    preflight(cfg_factory("trainer=cpu", "model.attn_window=1", "model.attn_backend=sdpa", sub="sdpa"), "train")
