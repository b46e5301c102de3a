"""Random erasing (data.random_erasing): timm's distribution on both paths; the batched fast-path
version is a function of the resume state's generator, so a resumed run erases the same boxes."""

import random

import pytest
import torch
from test_resume_state import fake_trainer
from timm.data.random_erasing import RandomErasing

from vitpipe.data import DigitsDataModule
from vitpipe.data.erasing import random_erasing
from vitpipe.data.resume import ResumeState
from vitpipe.errors import ConfigError

N, H, W = 4000, 32, 32


def erased_fractions(x: torch.Tensor) -> torch.Tensor:
    """(B,) fraction of each zero image's pixels that now hold noise."""
    return (x != 0).flatten(1).float().mean(1)


def test_fast_path_erasing_matches_timm_probability_and_area():
    torch.manual_seed(0)
    ours = erased_fractions(random_erasing(torch.zeros(N, 1, H, W), 0.25))
    random.seed(0)  # timm draws from Python's random module
    ref = erased_fractions(RandomErasing(probability=0.25, mode="pixel", device="cpu")(torch.zeros(N, 1, H, W)))
    for frac in (ours, ref):
        hit = frac[frac > 0]
        assert abs(len(hit) / N - 0.25) < 0.03  # the probability (binomial sd 0.007)
        # box area U(0.02, 1/3) of the image, up to rounding of h and w to whole pixels
        assert hit.min() > 0.01 and hit.max() < 0.40
        assert abs(hit.mean().item() - (0.02 + 1 / 3) / 2) < 0.02
    assert abs(ours[ours > 0].mean() - ref[ref > 0].mean()) < 0.02  # same distribution as timm
    # noise is per pixel (mode "pixel"), N(0, 1)
    x = random_erasing(torch.zeros(N, 1, H, W), 1.0)
    assert abs(x[x != 0].std().item() - 1.0) < 0.05


def test_probability_zero_is_identity_and_bad_values_refused():
    x = torch.randn(8, 3, H, W)
    assert random_erasing(x, 0.0) is x
    dm = DigitsDataModule(img_size=8, in_chans=1, num_classes=10, channels=1, random_erasing=0.0)
    names = [type(op).__name__ for op in dm.transform(train=True).transforms]
    assert "RandomErasing" not in names
    from omegaconf import OmegaConf

    from vitpipe.config.preflight import check_data_arguments  # the config check, before the module is built

    with pytest.raises(ConfigError, match="data.random_erasing=1.5"):
        check_data_arguments(OmegaConf.create({"_target_": "vitpipe.data.digits.DigitsDataModule", "img_size": 8,
                                               "in_chans": 1, "num_classes": 10, "channels": 1, "random_erasing": 1.5}))


def test_standard_path_uses_timm_random_erasing_after_normalisation():
    dm = DigitsDataModule(img_size=8, in_chans=1, num_classes=10, channels=1, random_erasing=0.25, fast_path=False)
    ops = dm.transform(train=True).transforms
    assert type(ops[-1]).__name__ == "RandomErasing" and ops[-1].probability == 0.25 and ops[-1].per_pixel
    assert [type(op).__name__ for op in ops].index("Normalize") < len(ops) - 1
    assert "RandomErasing" not in [type(op).__name__ for op in dm.transform(train=False).transforms]


def test_fast_path_erasing_is_deterministic_and_identical_after_resume():
    images = torch.randint(0, 256, (64, 1, 8, 8), dtype=torch.uint8)

    def module(state=None, step=9):
        dm = DigitsDataModule(img_size=8, in_chans=1, num_classes=10, channels=1, random_erasing=1.0, seed=3)
        dm.trainer = fake_trainer(ready=step)
        if state is not None:
            dm.load_state_dict(state)
        return dm

    first = module()
    out = first.augment_batch(images, train=True)
    assert torch.equal(out, module().augment_batch(images, train=True))  # same seed, same step
    resumed = module(first.state_dict(), step=9)  # a run restored from a checkpoint at that step
    assert resumed.resume.step == 9
    assert torch.equal(out, resumed.augment_batch(images, train=True))
    assert not torch.equal(out, module(step=10).augment_batch(images, train=True))  # each batch its own boxes
    plain = DigitsDataModule(img_size=8, in_chans=1, num_classes=10, channels=1, seed=3)
    plain.trainer = fake_trainer(ready=9)
    base = plain.augment_batch(images, train=True)  # same crops/flips, no erasing
    changed = (out != base).flatten(1).any(1)
    assert changed.float().mean() > 0.5  # p=1: (nearly) every image erased...
    assert torch.equal(plain.augment_batch(images, train=False), module().augment_batch(images, train=False))

    # ...and the state the checkpoint carries is all it takes
    state = ResumeState(3)
    state.load_state_dict(first.state_dict())
    again = random_erasing(torch.zeros(64, 1, 8, 8), 1.0, generator=state.generator("cpu", 0))
    assert torch.equal(again, random_erasing(torch.zeros(64, 1, 8, 8), 1.0, generator=state.generator("cpu", 0)))
