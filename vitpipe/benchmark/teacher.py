"""``--only teacher``: the pass that precomputes a teacher's logits (``module.distill.precompute``), as
``vitpipe.lit.distill.teacher_targets`` runs it (channels-last, batches of 128) against contiguous
batches of 1,000 (the evaluation batch of ``experiment=fmnist_vit``), same weights, same images.

The teacher is the checkout's shipped one (``assets/teachers/fmnist_resnet10t.safetensors``, 56-px input;
like the rest of the benchmark it needs a checkout), fed 28-px single-channel images as the recipe feeds it,
one view; a "step" is 1,000 images. ``--steps``, ``--warmup`` and ``--repeats`` apply; the image count and
batches are this module's, and the pass runs on the CPU whatever ``--device`` says (the recipe's case).
"""

from __future__ import annotations

import torch

from vitpipe.benchmark.common import interleave_steps, paired_ratio, summarize
from vitpipe.benchmark.config import BenchConfig
from vitpipe.data.fashion_mnist import FASHION_MNIST
from vitpipe.errors import ConfigError
from vitpipe.lit.distill import load_teacher, teacher_input, teacher_targets
from vitpipe.run.paths import CONF_DIR

SHIPPED = CONF_DIR.parent / "assets" / "teachers" / "fmnist_resnet10t.safetensors"
PASS_IMAGES = 1000  # one timed step: this many images
BEFORE_BATCH = 1000  # the recipe's data.eval_batch_size, which the pass used as its batch


def shipped_teacher() -> torch.nn.Module:
    """The shipped teacher, as the recipe loads it; ConfigError in one line where the checkout lacks it."""
    if not SHIPPED.is_file():
        raise ConfigError(f"--only teacher times the shipped teacher, and {SHIPPED} is not here: run it from a checkout")
    return load_teacher(str(SHIPPED), num_classes=10, in_chans=1)


def compare_teacher(cfg: BenchConfig) -> dict:
    """Contenders ``nchw_b1000`` (contiguous, batches of 1,000) and ``nhwc_b128`` (``teacher_targets``:
    channels-last, batches of ``CPU_BATCH``), phase ``pass``, 1,000 images a step;
    the ratio of their times per image, and the largest |logit difference| between them."""
    teacher = shipped_teacher()
    g = torch.Generator().manual_seed(cfg.seed)
    n = PASS_IMAGES
    images = torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=g)
    (mean,), (std,) = FASHION_MNIST.mean, FASHION_MNIST.std
    to_input = lambda x: (x.float() / 255 - mean) / std  # noqa: E731 - the data module's evaluation transform at 28 px

    @torch.no_grad()
    def contiguous() -> torch.Tensor:
        return torch.cat([teacher(teacher_input(to_input(images[i:i + BEFORE_BATCH]), teacher.img_size))
                          for i in range(0, n, BEFORE_BATCH)])

    def channels_last() -> torch.Tensor:  # the recipe's call: its evaluation batch, which the pass caps on a CPU
        return teacher_targets(teacher, images, to_input, mirror=False, batch_size=BEFORE_BATCH)[:, 0]

    diff = (contiguous() - channels_last()).abs().max().item()
    fns = {"nchw_b1000": contiguous, "nhwc_b128": channels_last}
    times = interleave_steps(fns, steps=cfg.steps, warmup=cfg.warmup, repeats=cfg.repeats, device="cpu")
    contenders = {name: {"pass": summarize(t, n)} for name, t in times.items()}
    before, after = (contenders[name]["pass"]["step_s"] for name in fns)
    ratios = {"time nhwc_b128/nchw_b1000": after / before,
              "time nhwc_b128/nchw_b1000 (paired)": paired_ratio(times["nhwc_b128"], times["nchw_b1000"])}
    return {"contenders": contenders, "ratios": ratios, "teacher": str(SHIPPED), "max_abs_target_diff": diff}
