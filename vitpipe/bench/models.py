"""The contenders' models and the steps the harness times.

vitpipe's ViT and timm's ``VisionTransformer`` are built at one config and share weights through
``from_timm``, so any time difference is the implementation's. Both train with the project's own
AdamW (``vitpipe.lit.optim.build_optimizer``: two weight-decay groups, fused on CUDA).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import Tensor, nn

from vitpipe.bench.settings import BenchConfig
from vitpipe.lit.optim import build_optimizer
from vitpipe.models import ViT, create_model
from vitpipe.models.registry import VARIANTS
from vitpipe.models.timm_compat import from_timm

# The optimizer of conf/module/classifier.yaml.
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.05, betas=(0.9, 0.999))


def timm_kwargs(cfg: BenchConfig) -> dict:
    """timm ``VisionTransformer`` kwargs for the variant: learned positions, class-token pooling."""
    v = VARIANTS[cfg.variant]
    return dict(img_size=cfg.size, patch_size=v["patch_size"], in_chans=3, num_classes=cfg.num_classes,
                embed_dim=v["dim"], depth=v["depth"], num_heads=v["num_heads"], mlp_ratio=4.0, qkv_bias=True,
                class_token=True, global_pool="token")


def build_pair(cfg: BenchConfig) -> tuple[ViT, VisionTransformer]:
    """(vitpipe ViT, timm VisionTransformer) with the same weights, on ``cfg.device``."""
    torch.manual_seed(cfg.seed)
    tm = VisionTransformer(**timm_kwargs(cfg))
    return from_timm(tm).to(cfg.device), tm.to(cfg.device)


def build_vit(cfg: BenchConfig) -> ViT:
    """vitpipe's ViT of the variant (registry defaults), seeded, on ``cfg.device``."""
    torch.manual_seed(cfg.seed)
    return create_model(cfg.variant, img_size=cfg.size, num_classes=cfg.num_classes).to(cfg.device)


def random_batch(cfg: BenchConfig, *, seed: int = 1) -> tuple[Tensor, Tensor]:
    """A normalised float batch and labels on the device: isolates the model from the data path."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(cfg.batch_size, 3, cfg.size, cfg.size, generator=g)
    y = torch.randint(0, cfg.num_classes, (cfg.batch_size,), generator=g)
    return x.to(cfg.device), y.to(cfg.device)


def make_optimizer(model: nn.Module, **overrides) -> torch.optim.Optimizer:
    return build_optimizer(functools.partial(ADAMW, **overrides) if overrides else ADAMW, model)


def grad_scaler(cfg: BenchConfig):
    """Loss scaling for fp16 (Micikevicius et al. 2018); None for bf16/fp32, which need none."""
    return torch.amp.GradScaler("cuda") if cfg.precision == "16-mixed" else None


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor,
               cfg: BenchConfig) -> Callable[[], None]:
    """forward, cross-entropy, backward, AdamW step; gradients freed after the step."""
    scaler = grad_scaler(cfg)

    def step() -> None:
        with cfg.autocast():
            loss = F.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return step


def infer_step(model: nn.Module, x: Tensor, cfg: BenchConfig) -> Callable[[], None]:
    """One forward pass without autograd."""

    def step() -> None:
        with torch.no_grad(), cfg.autocast():
            model(x)

    return step


def maybe_compile(model: nn.Module, cfg: BenchConfig) -> nn.Module:
    return torch.compile(model) if cfg.compile else model
