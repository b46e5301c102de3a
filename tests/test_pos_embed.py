"""Positional encodings: golden values, grids, resampling."""

import math

import pytest
import torch

from vitpipe.nn.pos_embed import POS_EMBED_KINDS, build_pos_embed, resample_grid, sincos_1d, sincos_2d
from vitpipe.nn.rope import apply_rope, rope_2d


def test_sincos_1d_golden_values():
    pe = sincos_1d(5, 8)
    # PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...), d = 8
    assert pe[0].tolist() == [0.0, 1.0] * 4
    assert pe[3, 0].item() == pytest.approx(math.sin(3.0))
    assert pe[3, 1].item() == pytest.approx(math.cos(3.0))
    assert pe[3, 2].item() == pytest.approx(math.sin(3 / 10000 ** (2 / 8)))  # = sin(0.3)
    assert pe[3, 3].item() == pytest.approx(math.cos(0.3))
    assert pe[4, 6].item() == pytest.approx(math.sin(4 / 10000 ** (6 / 8)))


def test_sincos_2d_golden_values_row_then_column():
    pe = sincos_2d(2, 3, 8)  # token (row 1, col 2) is index 5
    expect = [math.sin(1), math.cos(1), math.sin(0.01), math.cos(0.01),  # row 1, d = 4 per axis
              math.sin(2), math.cos(2), math.sin(0.02), math.cos(0.02)]  # column 2
    assert pe.shape == (6, 8)
    assert pe[5].tolist() == pytest.approx(expect, abs=1e-6)
    assert torch.equal(pe[3, :4], pe[5, :4]) and torch.equal(pe[2, 4:], pe[5, 4:])  # same row / same column


def test_rope_preserves_norm_and_encodes_relative_offsets():
    cos, sin = rope_2d(3, 4, 8)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    qs, ks = q.expand(1, 1, 12, 8), k.expand(1, 1, 12, 8)
    rq, rk = apply_rope(qs, cos, sin), apply_rope(ks, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), qs.norm(dim=-1))
    dots = (rq[0, 0] @ rk[0, 0].T)  # (12, 12) scores between positions
    # same (row, col) offset -> same score: (0,0)->(1,1) equals (1,2)->(2,3)
    assert dots[0, 5].item() == pytest.approx(dots[6, 11].item(), abs=1e-5)
    assert abs(dots[0, 5].item() - dots[0, 6].item()) > 1e-4


@pytest.mark.parametrize("kind", POS_EMBED_KINDS)
def test_every_kind_runs_on_other_and_non_square_grids(kind):
    m = build_pos_embed(kind, dim=16, grid_size=(2, 3), num_heads=2, num_prefix_tokens=1)
    for grid in [(2, 3), (4, 5), (1, 7)]:
        x = torch.zeros(2, 1 + grid[0] * grid[1], 16)
        y = m(x, grid)
        assert y.shape == x.shape
        if kind not in ("none", "rope2d"):
            assert y[:, 1:].abs().sum() > 0  # patches got positions


def test_resample_grid_is_identity_on_same_grid_and_smooth_otherwise():
    grid = torch.arange(6.0).reshape(1, 6, 1)  # a 2x3 ramp along columns and rows
    assert torch.equal(resample_grid(grid, (2, 3), (2, 3)), grid)
    up = resample_grid(torch.linspace(0, 1, 4).repeat(4).reshape(1, 16, 1), (4, 4), (8, 8))
    row = up.reshape(8, 8)[3]
    assert (row[1:] >= row[:-1] - 1e-6).all()  # a monotone ramp stays monotone


def test_fixed_tables_are_buffers_not_state_and_learned_are_parameters():
    assert list(build_pos_embed("sincos2d", dim=8, grid_size=(2, 2), num_heads=2).state_dict()) == []
    assert len(list(build_pos_embed("learned2d", dim=8, grid_size=(2, 2), num_heads=2).parameters())) == 2


def test_unknown_kind_names_value_and_choices():
    with pytest.raises(ValueError, match=r"'sincos3d'.*learned2d"):
        build_pos_embed("sincos3d", dim=8, grid_size=(2, 2), num_heads=2)


@pytest.mark.parametrize("kind, table", [("sincos1d", lambda h, w, d: sincos_1d(h * w, d)), ("sincos2d", sincos_2d)])
def test_fixed_kinds_add_their_table_to_patches_on_any_grid(kind, table):
    m = build_pos_embed(kind, dim=8, grid_size=(2, 3), num_heads=2, num_prefix_tokens=1)
    assert [n for n, _ in m.named_buffers()] == ["table"] and list(m.state_dict()) == []  # non-persistent
    assert torch.equal(m.table, table(2, 3, 8)[None])
    for grid in [(2, 3), (3, 2)]:  # the built grid, then one recomputed
        x = torch.randn(2, 1 + grid[0] * grid[1], 8)
        y = m(x, grid)
        assert torch.equal(y[:, :1], x[:, :1])  # the class token gets no position
        assert torch.equal(y[:, 1:], x[:, 1:] + table(*grid, 8)[None])
