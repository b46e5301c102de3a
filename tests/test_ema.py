"""module.ema_decay: the EMA (timm ModelEmaV3) is updated once per optimizer step, as timm's train
loop does, whatever trainer.accumulate_grad_batches is; a step that module.nonfinite=skip drops
leaves it alone.

The EMA is checked against the formula, recomputed from the weights after every optimizer step:
ModelEmaV3's defaults (``update_after_step=0``, ``use_warmup=False``) give decay 0 at step 1 (a
copy of the weights) and ``ema_decay`` from step 2 on: ema_t = d * ema_{t-1} + (1 - d) * w_t.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from fault_injection import NaNLossOnRank
from lightning.pytorch.plugins import MixedPrecision

from vitpipe.config.build import build_trainer
from vitpipe.run.build import build_from_config

DECAY, STEPS = 0.5, 3


class PostStepWeights(L.Callback):
    """The network's parameters after each optimizer step, keyed by Lightning's step count."""

    def __init__(self) -> None:
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step not in self.weights and trainer.global_step > 0:  # this batch ended a step
            self.weights[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.net.named_parameters()}


def ema_by_formula(initial: dict, weights: dict[int, dict], steps) -> dict:
    ema = {k: v.clone() for k, v in initial.items()}
    for t in steps:
        d = 0.0 if t <= 1 else DECAY  # timm's get_decay(step) with ModelEmaV3's defaults
        ema = {k: d * ema[k] + (1 - d) * weights[t][k] for k in ema}
    return ema


def fit(cfg_factory, accumulate: int, *overrides: str, steps: int = STEPS, callbacks=(), **trainer_kwargs):
    cfg = cfg_factory("debug=fast", "logger=none", "test=false", "data.batch_size=8",
                      f"trainer.limit_train_batches={steps * accumulate}",
                      f"trainer.accumulate_grad_batches={accumulate}", f"module.ema_decay={DECAY}", *overrides)
    dm, net, module = build_from_config(cfg)
    initial = {k: v.detach().clone() for k, v in net.named_parameters()}
    recorder = PostStepWeights()
    trainer = build_trainer(cfg.trainer, logger=False, enable_checkpointing=False, callbacks=[recorder, *callbacks],
                          **trainer_kwargs)
    trainer.fit(module, dm)
    assert trainer.global_step == steps and sorted(recorder.weights) == list(range(1, steps + 1))
    return module, initial, recorder.weights


@pytest.mark.parametrize("accumulate", [1, 4])
def test_ema_follows_the_decay_formula_per_optimizer_step(cfg_factory, accumulate):
    module, initial, weights = fit(cfg_factory, accumulate)
    expected = ema_by_formula(initial, weights, range(1, STEPS + 1))
    ema = dict(module.ema.module.named_parameters())
    for k, v in expected.items():
        torch.testing.assert_close(ema[k], v, rtol=0, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    final = weights[STEPS]
    assert any((ema[k] - final[k]).abs().max() > 1e-4 for k in final)  # it trails the weights: a real average


class InfGradientAtStep(L.Callback):
    """An inf in one gradient of optimizer step ``step``, before GradScaler unscales: it skips the step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step == self.step - 1:
            next(pl_module.net.parameters()).grad.fill_(float("inf"))


@pytest.mark.parametrize("how", ["nonfinite-skip", "grad-scaler"])
def test_a_step_that_left_the_weights_alone_leaves_the_ema_alone(cfg_factory, how):
    # optimizer step 3 is not applied. (Not step 2: after step 1 the EMA is a copy of the weights,
    # so averaging them in again would change nothing.)
    if how == "nonfinite-skip":  # a NaN loss in batch 2, dropped by module.nonfinite=skip
        module, initial, weights = fit(cfg_factory, 1, "module.nonfinite=skip", steps=4,
                                       callbacks=[NaNLossOnRank(rank=0, step=2)])
        assert module.skipped_batches == 1
    else:  # 16-mixed (fp16 autocast, on the CPU here) whose GradScaler finds an inf gradient at step 3
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)  # low enough that fp16 gradients never overflow
        module, initial, weights = fit(cfg_factory, 1, steps=4, callbacks=[InfGradientAtStep(3)], precision=None,
                                       plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
        assert scaler.get_scale() == 128.0  # halved once: one step skipped
    assert weights[2].keys() == weights[3].keys() and all(torch.equal(weights[3][k], weights[2][k]) for k in weights[2])
    assert any(not torch.equal(weights[4][k], weights[3][k]) for k in weights[3])
    expected = ema_by_formula(initial, weights, [1, 2, 4])
    ema = dict(module.ema.module.named_parameters())
    for k, v in expected.items():
        torch.testing.assert_close(ema[k], v, rtol=0, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
