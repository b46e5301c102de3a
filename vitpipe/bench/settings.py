"""What one benchmark run measures: a model variant at a size, batch, precision and device."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch

from vitpipe.errors import ConfigError
from vitpipe.models.registry import VARIANTS

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")  # Lightning's names; the plain loops autocast the same way
COMPARISONS = ("vit", "lightning", "data", "switches")
SWITCHES = ("adamw_foreach", "adamw_fused", "compile", "channels_last", "sdpa_math", "sdpa_flash", "sdpa_efficient",
            "sdpa_cudnn")  # vitpipe.bench.switches; the last two exist on CUDA only


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark setting, checked on construction (ConfigError names the bad value).

    steps: timed steps per repeat and contender; warmup: untimed steps before them (compilation,
    allocator and worker start-up land there); repeats: the reported figure is the median over
    repeats. workers: DataLoader processes of the PIL path (the fast path uses none).
    switches: which speed switches to time (names in vitpipe.bench.switches; () for all).
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
    switches: tuple[str, ...] = ()  # the "switches" comparison's subset; () = every switch

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ConfigError(f"variant={self.variant!r} is unknown; valid choices: {', '.join(VARIANTS)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r}; valid choices: {', '.join(PRECISIONS)}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device={self.device!r}; valid choices: cpu, cuda")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device='cuda' but torch sees no CUDA device; use device=cpu")
        if self.precision == "16-mixed" and self.device != "cuda":
            raise ConfigError("precision='16-mixed' needs device=cuda (loss scaling); use bf16-mixed or 32-true")
        for name in ("batch_size", "num_classes", "steps", "repeats"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: expected an int >= 1")
        if self.warmup < 1 or self.workers < 0:
            raise ConfigError(f"warmup={self.warmup}, workers={self.workers}: expected warmup >= 1, workers >= 0")
        unknown = [n for n in self.switches if n not in SWITCHES]
        if unknown:
            raise ConfigError(f"switches {unknown} unknown; valid choices: {', '.join(SWITCHES)}")
        patch = VARIANTS[self.variant]["patch_size"]
        if self.size % patch:
            raise ConfigError(f"img_size={self.size} is not a multiple of {self.variant}'s patch size {patch}")

    @property
    def size(self) -> int:
        return self.img_size or VARIANTS[self.variant]["img_size"]

    @property
    def lightning_accelerator(self) -> str:
        return "gpu" if self.device == "cuda" else "cpu"

    def autocast(self):
        """The autocast context Lightning's precision plugin uses for this precision."""
        if self.precision == "32-true":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16
        return torch.autocast(self.device, dtype=dtype)

    def to_dict(self) -> dict:
        return {**asdict(self), "img_size": self.size}


def parse_only(text: str) -> tuple[str, ...]:
    """``"vit,data"`` -> ("vit", "data"); ConfigError for an unknown name."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in COMPARISONS]
    if bad or not names:
        raise ConfigError(f"--only {text!r}: unknown {bad or 'empty'}; choose among {', '.join(COMPARISONS)}")
    return names
