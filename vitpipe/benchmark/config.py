"""One benchmark setting (``BenchConfig``) and its check: every comparison reads the same frozen object,
so a bad value is one ConfigError line before anything is built or timed."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend

from vitpipe.errors import ConfigError
from vitpipe.models.registry import VARIANTS

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")  # Lightning's names; the plain loops autocast the same way
# name -> what differs from the eager baseline (torch's default AdamW: per-tensor loop on CPU, foreach on CUDA);
# here, not in switches.py, because the check names the valid choices
SWITCHES = {
    "adamw_foreach": dict(adamw={"foreach": True}), "adamw_fused": dict(adamw={"fused": True}),
    "compile": dict(compile=True), "channels_last": dict(channels_last=True),  # touches the patch conv only
    "sdpa_math": dict(sdpa=SDPBackend.MATH), "sdpa_flash": dict(sdpa=SDPBackend.FLASH_ATTENTION),
    "sdpa_efficient": dict(sdpa=SDPBackend.EFFICIENT_ATTENTION), "sdpa_cudnn": dict(sdpa=SDPBackend.CUDNN_ATTENTION),
}


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark setting, checked on construction (ConfigError names the bad value).

    steps: timed steps per repeat and contender; warmup: untimed steps before them (compilation,
    allocator and worker start-up land there); repeats: the reported figure is the median over
    repeats. workers: DataLoader processes of the PIL path. switches: subset to time (() = all).
    """

    variant: str = "vit_ti4"
    img_size: int | None = None  # None: the variant's own size
    batch_size: int = 64
    num_classes: int = 10
    precision: str = "32-true"
    device: str = "cpu"
    compile: bool = False
    steps: int = 20
    warmup: int = 5
    repeats: int = 3
    workers: int = 2
    seed: int = 0
    switches: tuple[str, ...] = ()
    serve_requests: int = 2000  # serve: requests per server contender (split over the repeats)
    serve_clients: int = 16  # serve: concurrent client threads

    def __post_init__(self) -> None:
        check_bench_config(self)

    @property
    def size(self) -> int:
        return self.img_size or VARIANTS[self.variant]["img_size"]

    def autocast(self):
        """The autocast context Lightning's precision plugin uses for this precision."""
        if self.precision == "32-true":
            return contextlib.nullcontext()
        return torch.autocast(self.device, dtype=torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16)


def check_bench_config(cfg: BenchConfig) -> None:
    """Raise ConfigError naming the first bad value (the benchmark's settings are not a Hydra config, so
    vitpipe.config's checks do not see them)."""

    def check(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    check(cfg.variant in VARIANTS, f"variant={cfg.variant!r} is unknown; valid choices: {', '.join(VARIANTS)}")
    check(cfg.precision in PRECISIONS, f"precision={cfg.precision!r}; valid choices: {', '.join(PRECISIONS)}")
    check(cfg.device in ("cpu", "cuda"), f"device={cfg.device!r}; valid choices: cpu, cuda")
    check(cfg.device == "cpu" or torch.cuda.is_available(), "device='cuda' but torch sees no CUDA device; use cpu")
    check(cfg.precision != "16-mixed" or cfg.device == "cuda",
          "precision='16-mixed' needs device=cuda (loss scaling); use bf16-mixed or 32-true")
    for name in ("batch_size", "num_classes", "steps", "repeats", "warmup", "serve_requests", "serve_clients"):
        check(getattr(cfg, name) >= 1, f"{name}={getattr(cfg, name)}: expected an int >= 1")
    check(cfg.workers >= 0, f"workers={cfg.workers}: expected an int >= 0")
    unknown = [n for n in cfg.switches if n not in SWITCHES]
    check(not unknown, f"switches {unknown} unknown; valid choices: {', '.join(SWITCHES)}")
    patch = VARIANTS[cfg.variant]["patch_size"]
    check(cfg.size % patch == 0, f"img_size={cfg.size} is not a multiple of {cfg.variant}'s patch size {patch}")
