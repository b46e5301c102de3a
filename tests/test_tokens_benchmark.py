"""``python scripts/benchmark.py --only tokens``: patch dropout and token merging against the unmodified model."""

from __future__ import annotations

import functools
import json
import math

import pytest

from vitpipe.benchmark.config import BenchConfig
from vitpipe.benchmark.run import COMPARISONS, run
from vitpipe.benchmark.table import format_table

TINY = dict(shapes=("fmnist",), overrides=dict(dim=32, depth=2, num_heads=2), batches=(4, 4), agree_images=16)
CFG = dict(steps=2, warmup=1, repeats=1)


def test_tokens_comparison_gives_sane_ratios_on_a_tiny_model():
    from vitpipe.benchmark.tokens import compare_tokens, markdown

    res = compare_tokens(BenchConfig(**CFG), **TINY)
    c, r = res["contenders"], res["ratios"]
    assert set(c) == {"fmnist/drop0", "fmnist/drop0.25", "fmnist/drop0.5", "fmnist/tome0", "fmnist/tome4",
                      "fmnist/tome8"}
    # tokens into the blocks: all 49 patches, then timm's int(49 * (1 - rate)); ToMe: 49 - depth * r
    assert [c[f"fmnist/drop{p}"]["train"]["tokens"] for p in ("0", "0.25", "0.5")] == [49, 36, 24]
    assert [c[f"fmnist/tome{k}"]["infer"]["tokens_after_last_block"] for k in (0, 4, 8)] == [49, 41, 33]
    assert len(r) == 8 and all(math.isfinite(v) and 0 < v < 50 for v in r.values())
    assert r["train time drop0.5/drop0 @fmnist"] == pytest.approx(
        c["fmnist/drop0.5"]["train"]["step_s"] / c["fmnist/drop0"]["train"]["step_s"])
    for name in ("fmnist/tome4", "fmnist/tome8"):
        fig = res["agreement"][name]
        assert 0 <= fig["top1_agreement"] <= 1 and math.isfinite(fig["max_abs_logit_diff"]) and fig["images"] == 16
    table = markdown(res)
    assert len(table.splitlines()) == 2 + 6 and "| fmnist | tome8 | infer | 33 |" in table
    json.dumps(res)  # plain JSON types only


def test_tokens_is_a_registered_comparison(monkeypatch):
    """``--only tokens`` reaches ``compare_tokens`` through the harness and its table (shapes shrunk)."""
    import vitpipe.benchmark.tokens as tokens

    assert "tokens" in COMPARISONS
    monkeypatch.setattr(tokens, "compare_tokens", functools.partial(tokens.compare_tokens, **TINY))
    table = format_table(run(BenchConfig(**CFG), ("tokens",)))
    assert "fmnist/drop0.5" in table and "train time drop0.5/drop0 @fmnist" in table
    assert "fmnist/tome8 vs tome0: max |logit diff|, top-1 agreement" in table


def test_unknown_shape_is_refused_naming_the_choices():
    from vitpipe.benchmark.tokens import compare_tokens

    with pytest.raises(ValueError, match="shapes \\['b16'\\] unknown; valid choices: fmnist, s16"):
        compare_tokens(BenchConfig(**CFG), shapes=("b16",))
