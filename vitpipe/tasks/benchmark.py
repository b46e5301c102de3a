"""Benchmark training/inference throughput, peak memory and MFU; prints a table, writes JSON.

    python scripts/benchmark.py --variant vit_ti4 --batch-size 64 --out results.json
    python scripts/benchmark.py --only vit --device cuda --precision bf16-mixed --compile --batch-size 256
    python scripts/benchmark.py --only serve --batch-size 32 --requests 2000 --clients 16

Comparisons (--only, comma-separated): vit (vitpipe vs timm, same weights), lightning (plain loop vs
Trainer.fit), data (fast path vs PIL DataLoader), shards (data=shards vs data=imagefolder reading the
same JPEG files, decoding + augmenting in ``--workers`` processes), switches (fused AdamW, compile, channels-last, SDPA
backends), mae (MAE step vs the reference's way), naflex (patch-dict input: a padded batch of mixed-aspect
images vs the fixed square path at about the same valid tokens, and vs timm's NaFlexVit, same weights), serve
(scripts/serve.py under a bounded loopback load, ``--requests`` from ``--clients`` threads: dynamic batching with
max_batch_size=--batch-size vs max_batch_size=1, and vs scripts/predict.py on the same files). Contenders alternate (A B, B A, ...) so a shared machine's load hits them alike; the
figure is the median over repeats of each repeat's median step time, warm-up steps excluded.

Everything trained here is built from conf/ as ``scripts/train.py model=<variant> data=synthetic``
composes it (model, AdamW groups, schedule, label smoothing, gradient clipping), so the benchmark
times the training recipe itself. It needs a checkout (conf/); the timing, memory and FLOP tools
it uses are ``vitpipe.tasks.bench``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import json
import logging
import math
import os
import platform
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning as L
import numpy as np
import timm
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from PIL import Image
from timm.models.vision_transformer import VisionTransformer
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader

from vitpipe.data.transforms import TransformedSubset
from vitpipe.errors import ConfigError
from vitpipe.lit.optim import build_optimizer
from vitpipe.models.registry import VARIANTS
from vitpipe.models.timm_compat import from_timm
from vitpipe.run.files import atomic_write_text
from vitpipe.tasks.bench import (
    MEMORY_METHOD,
    StepClock,
    StepMemory,
    flops_per_image,
    interleave_runs,
    interleave_steps,
    paired_ratio,
    paired_repeat_ratio,
    peak_tflops,
    state_bytes,
    summarize,
    utilisation,
)
from vitpipe.tasks.train import build

CONF = Path(__file__).resolve().parents[2] / "conf"  # the checkout's conf/ (vitpipe/tasks/ -> root)
SCHEMA = "vitpipe.bench/1"
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")  # Lightning's names; the plain loops autocast the same way
COMPARISONS = ("vit", "lightning", "data", "shards", "switches", "mae", "naflex", "serve")
DEFAULT_ONLY = ("vit", "lightning", "data")
# name -> what differs from the eager baseline (torch's default AdamW: per-tensor loop on CPU, foreach on CUDA)
SWITCHES = {
    "adamw_foreach": dict(adamw={"foreach": True}), "adamw_fused": dict(adamw={"fused": True}),
    "compile": dict(compile=True), "channels_last": dict(channels_last=True),  # touches the patch conv only
    "sdpa_math": dict(sdpa=SDPBackend.MATH), "sdpa_flash": dict(sdpa=SDPBackend.FLASH_ATTENTION),
    "sdpa_efficient": dict(sdpa=SDPBackend.EFFICIENT_ATTENTION), "sdpa_cudnn": dict(sdpa=SDPBackend.CUDNN_ATTENTION),
}
PIL_NATIVE_SIZE = 32  # the data comparison's images are CIFAR-sized


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
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        check(self.variant in VARIANTS, f"variant={self.variant!r} is unknown; valid choices: {', '.join(VARIANTS)}")
        check(self.precision in PRECISIONS, f"precision={self.precision!r}; valid choices: {', '.join(PRECISIONS)}")
        check(self.device in ("cpu", "cuda"), f"device={self.device!r}; valid choices: cpu, cuda")
        check(self.device == "cpu" or torch.cuda.is_available(), "device='cuda' but torch sees no CUDA device; use cpu")
        check(self.precision != "16-mixed" or self.device == "cuda",
              "precision='16-mixed' needs device=cuda (loss scaling); use bf16-mixed or 32-true")
        for name in ("batch_size", "num_classes", "steps", "repeats", "warmup", "serve_requests", "serve_clients"):
            check(getattr(self, name) >= 1, f"{name}={getattr(self, name)}: expected an int >= 1")
        check(self.workers >= 0, f"workers={self.workers}: expected an int >= 0")
        unknown = [n for n in self.switches if n not in SWITCHES]
        check(not unknown, f"switches {unknown} unknown; valid choices: {', '.join(SWITCHES)}")
        patch = VARIANTS[self.variant]["patch_size"]
        check(self.size % patch == 0, f"img_size={self.size} is not a multiple of {self.variant}'s patch size {patch}")

    @property
    def size(self) -> int:
        return self.img_size or VARIANTS[self.variant]["img_size"]

    def autocast(self):
        """The autocast context Lightning's precision plugin uses for this precision."""
        if self.precision == "32-true":
            return contextlib.nullcontext()
        return torch.autocast(self.device, dtype=torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16)


def recipe(cfg: BenchConfig, *, batches: int = 1, native_size: int | None = None):
    """The training config as ``scripts/train.py model=<variant> data=synthetic`` composes it, with
    exactly ``batches`` training batches of random uint8 images and no validation split."""
    overrides = [
        f"model={cfg.variant}", f"model.img_size={cfg.size}", "data=synthetic", f"data.num_classes={cfg.num_classes}",
        f"data.native_size={native_size or cfg.size}", f"data.length={batches * cfg.batch_size}",
        f"data.test_length={cfg.batch_size}", f"data.batch_size={cfg.batch_size}", "data.val_split=0",
        f"data.seed={cfg.seed}", f"++data.pin_memory={cfg.device == 'cuda'}", f"compile={cfg.compile}",
        f"trainer={'gpu' if cfg.device == 'cuda' else 'cpu'}", f"trainer.precision={cfg.precision}",
        "trainer.limit_val_batches=0", f"paths.root_dir={CONF.parent}", "paths.output_dir=${paths.log_dir}/benchmark",
    ]  # paths: what @hydra.main would fill in; nothing is written there (no logger, no checkpoints)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def optimizer(train_cfg, net: torch.nn.Module) -> torch.optim.Optimizer:
    """The recipe's optimizer on the training code's parameter groups."""
    return build_optimizer(instantiate(train_cfg.module.optimizer), net)


def build_pair(cfg: BenchConfig) -> tuple[torch.nn.Module, VisionTransformer]:
    """(vitpipe ViT, timm VisionTransformer) of the variant with the same weights, on ``cfg.device``."""
    torch.manual_seed(cfg.seed)
    v = VARIANTS[cfg.variant]
    tm = VisionTransformer(img_size=cfg.size, patch_size=v["patch_size"], num_classes=cfg.num_classes,
                           embed_dim=v["dim"], depth=v["depth"], num_heads=v["num_heads"], global_pool="token")
    return from_timm(tm).to(cfg.device), tm.to(cfg.device)


def random_batch(cfg: BenchConfig, *, seed: int = 1):
    """A normalised float batch and labels on the device: isolates the model from the data path."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(cfg.batch_size, 3, cfg.size, cfg.size, generator=g)
    return x.to(cfg.device), torch.randint(0, cfg.num_classes, (cfg.batch_size,), generator=g).to(cfg.device)


def train_step(model, opt, x, y, cfg: BenchConfig):
    """forward, cross-entropy, backward, optimizer step; gradients freed after the step."""
    scaler = torch.amp.GradScaler(cfg.device, enabled=cfg.precision == "16-mixed")  # fp16 only

    def step() -> None:
        with cfg.autocast():
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def infer_step(model, x, cfg: BenchConfig):
    def step() -> None:
        with torch.no_grad(), cfg.autocast():
            model(x)

    return step


@torch.no_grad()
def max_logit_diff(a: torch.nn.Module, b: torch.nn.Module, x: torch.Tensor) -> float:
    """Largest |logit difference| in eval mode (both are left in it): 0 up to rounding = the same network."""
    return (a.eval()(x).float() - b.eval()(x).float()).abs().max().item()


def _compiled(net, cfg: BenchConfig):
    return torch.compile(net) if cfg.compile else net


# --------------------------------------------------------------------------- the comparisons


def compare_vit(cfg: BenchConfig) -> dict:
    """vitpipe's ViT vs timm's VisionTransformer: train and inference steps, same weights and optimizer."""
    nets = dict(zip(("vitpipe", "timm"), build_pair(cfg)))
    x, y = random_batch(cfg)
    logit_diff = max_logit_diff(nets["vitpipe"], nets["timm"], x)
    flops = flops_per_image(nets["vitpipe"], cfg.size)
    peak = peak_tflops(torch.cuda.get_device_name(), cfg.precision) if cfg.device == "cuda" else None
    train_cfg = recipe(cfg)
    runs = {name: _compiled(net.train(), cfg) for name, net in nets.items()}
    opts = {name: optimizer(train_cfg, net) for name, net in nets.items()}
    contenders, times = {name: {} for name in nets}, {}
    for phase, make, fl in (("train", lambda n: train_step(runs[n], opts[n], x, y, cfg), flops["train"]),
                            ("infer", lambda n: infer_step(runs[n], x, cfg), flops["forward"])):
        if phase == "infer":
            for net in nets.values():
                net.eval()
        steps = {name: make(name) for name in nets}
        times[phase] = interleave_steps(steps, steps=cfg.steps, warmup=cfg.warmup, repeats=cfg.repeats,
                                        device=cfg.device)
        for name, step in steps.items():  # one contender at a time: each peak is its own
            with StepMemory(cfg.device) as mem:
                step()
            held = state_bytes(nets[name], opts[name] if phase == "train" else None)
            s = summarize(times[phase][name], cfg.batch_size)
            contenders[name][phase] = {**s, **utilisation(fl, s["img_s"], peak),
                                       "memory": {**mem.as_dict(), "state_bytes": held}}
    ratios = {}
    for phase, key in (("train", "train_step_time"), ("infer", "infer_time")):
        ratios[f"{key} vitpipe/timm"] = contenders["vitpipe"][phase]["step_s"] / contenders["timm"][phase]["step_s"]
        ratios[f"{key} vitpipe/timm (paired)"] = paired_ratio(times[phase]["vitpipe"], times[phase]["timm"])
    return {"contenders": contenders, "ratios": ratios, "max_abs_logit_diff": logit_diff,
            "flops_per_image": flops, "peak_tflops": peak}


class _StepClockCallback(L.Callback):
    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_train_batch_end(self, *args) -> None:
        self.clock.tick()


def compare_lightning(cfg: BenchConfig) -> dict:
    """``Trainer.fit`` vs a hand-written loop doing Lightning's work in Lightning's order (zero_grad
    after the forward), on the recipe's model, optimizer, schedule, loss, clipping and fast-path data.
    Lightning runs without logger, progress bar, checkpoints or validation; gaps between step ends
    are timed, so data loading and framework hooks count."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no per-fit banner
    total = cfg.warmup + cfg.steps
    train_cfg = recipe(cfg, batches=total)
    torch.manual_seed(cfg.seed)
    dm, net0, _ = build(train_cfg)
    dm.setup("fit")

    def fresh_module():  # every run starts from the same weights, with its own compile and optimizer state
        return instantiate(train_cfg.module, net=copy.deepcopy(net0))

    def plain() -> list[float]:
        module = fresh_module()
        net = module.net
        model, opt = _compiled(net.train(), cfg), optimizer(train_cfg, net)
        sched = module.scheduler_factory(opt, t_initial=total, warmup_t=int(module.hparams.warmup_fraction * total))
        scaler = torch.amp.GradScaler(cfg.device, enabled=cfg.precision == "16-mixed")
        clock = StepClock(warmup=cfg.warmup, device=cfg.device)
        for i, (x, y) in enumerate(dm.train_dataloader()):
            x, y = x.to(cfg.device, non_blocking=True), y.to(cfg.device, non_blocking=True)
            x = dm.augment_batch(x, train=True)  # Lightning: on_after_batch_transfer
            with cfg.autocast():
                loss = F.cross_entropy(model(x), y, label_smoothing=module.hparams.label_smoothing)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), train_cfg.trainer.gradient_clip_val)
            scaler.step(opt)
            scaler.update()
            sched.step_update(num_updates=i + 1)
            clock.tick()
        return clock.times()

    def lightning() -> list[float]:
        clock = StepClock(warmup=cfg.warmup, device=cfg.device)
        trainer = instantiate(train_cfg.trainer, max_steps=total, logger=False, enable_checkpointing=False,
                              enable_progress_bar=False, enable_model_summary=False,
                              callbacks=[_StepClockCallback(clock)])
        trainer.fit(fresh_module(), datamodule=dm)
        return clock.times()

    times = interleave_runs({"plain": plain, "lightning": lightning}, repeats=cfg.repeats)
    contenders = {n: {"train": summarize(t, cfg.batch_size)} for n, t in times.items()}
    ratio = contenders["lightning"]["train"]["step_s"] / contenders["plain"]["train"]["step_s"]
    return {"contenders": contenders, "ratios": {"step_time lightning/plain": ratio}}


def loader_throughput(cfg: BenchConfig, loaders: dict) -> dict:
    """Images/s of each ``name -> (make_loader, to_input)``, the loaders taking turns (interleaved)."""

    def drain(name: str) -> list[float]:
        make_loader, to_input = loaders[name]
        clock = StepClock(warmup=cfg.warmup, device=cfg.device)
        for x, y in make_loader():
            x, y = to_input(x.to(cfg.device, non_blocking=True)), y.to(cfg.device, non_blocking=True)
            clock.tick()
        return clock.times()

    times = interleave_runs({name: lambda name=name: drain(name) for name in loaders}, repeats=cfg.repeats)
    return {name: {"load": summarize(t, cfg.batch_size)} for name, t in times.items()}


def compare_data(cfg: BenchConfig) -> dict:
    """The fast path (one uint8 tensor, crop/flip batched on the device) vs a DataLoader running the
    standard path's per-image torchvision transforms on PIL images in ``workers`` processes."""
    data_cfg = recipe(cfg, batches=cfg.warmup + cfg.steps, native_size=PIL_NATIVE_SIZE).data
    fast, standard = instantiate(data_cfg), instantiate(data_cfg, fast_path=False)
    fast.setup("fit")
    images = [Image.fromarray(im.permute(1, 2, 0).numpy()) for im in fast.data_train.images]  # uint8 CHW -> PIL
    pil = TransformedSubset(list(zip(images, fast.data_train.labels.tolist())), None, standard.transform(train=True))
    loaders = {
        "fast": (lambda: fast.train_dataloader(), lambda x: fast.augment_batch(x, train=True)),
        "pil": (lambda: DataLoader(pil, batch_size=cfg.batch_size, shuffle=True, num_workers=cfg.workers,
                                   pin_memory=cfg.device == "cuda"), lambda x: x),
    }
    contenders = loader_throughput(cfg, loaders)
    ratio = contenders["fast"]["load"]["img_s"] / contenders["pil"]["load"]["img_s"]
    return {"contenders": contenders, "ratios": {"throughput fast/pil": ratio}, "workers": cfg.workers,
            "native_size": PIL_NATIVE_SIZE}


def compare_shards(cfg: BenchConfig, *, native_size: int = 96) -> dict:
    """data=shards vs data=imagefolder over the same JPEG files (random pixels, ``native_size`` px, 2
    classes): both loaders decode and apply the training transforms (RandomResizedCrop, flip) in
    ``workers`` processes; the shards are written once by make_shards (one 64 MB chunk)."""
    import tempfile

    import numpy as np

    from vitpipe.data import ImageFolderDataModule
    from vitpipe.data.shards import ShardsDataModule
    from vitpipe.tasks.make_shards import make_shards

    n = (cfg.warmup + cfg.steps) * cfg.batch_size
    rng = np.random.default_rng(cfg.seed)
    with tempfile.TemporaryDirectory(prefix="vitpipe-bench-shards-") as tmp:
        for i in range(n):
            folder = Path(tmp, "images", "train", f"c{i % 2}")
            folder.mkdir(parents=True, exist_ok=True)
            pixels = rng.integers(0, 256, (native_size, native_size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"{i}.jpg", quality=90)
        common = dict(num_classes=2, channels=3, img_size=cfg.size, in_chans=3, batch_size=cfg.batch_size,
                      num_workers=cfg.workers, pin_memory=cfg.device == "cuda", val_split=0)
        folder_dm = ImageFolderDataModule(root=str(Path(tmp, "images")), **common)
        make_shards(folder_dm, str(Path(tmp, "shards")))
        modules = {"imagefolder": folder_dm, "shards": ShardsDataModule(root=str(Path(tmp, "shards")), **common)}
        for dm in modules.values():
            dm.setup("fit")
        contenders = loader_throughput(cfg, {name: (dm.train_dataloader, lambda x: x) for name, dm in modules.items()})
    shards, folder = contenders["shards"]["load"], contenders["imagefolder"]["load"]
    ratios = {"throughput shards/imagefolder": shards["img_s"] / folder["img_s"],
              "throughput shards/imagefolder (paired repeats)": paired_repeat_ratio(folder["per_repeat_step_s"],
                                                                                     shards["per_repeat_step_s"])}
    return {"contenders": contenders, "ratios": ratios, "workers": cfg.workers, "native_size": native_size}


def compare_switches(cfg: BenchConfig) -> dict:
    """Each speed switch against the eager baseline (torch's defaults) on the recipe's ViT, train step."""
    train_cfg = recipe(cfg)
    torch.manual_seed(cfg.seed)
    state = instantiate(train_cfg.model).to(cfg.device).state_dict()
    x, y = random_batch(cfg)
    steps, failed = {}, {}
    for name in ["baseline", *(cfg.switches or SWITCHES)]:
        spec = SWITCHES.get(name, {})
        net = instantiate(train_cfg.model).to(cfg.device)
        net.load_state_dict(state)
        # the recipe's AdamW with torch's own default kernel (build_optimizer would turn fused on on CUDA)
        opt = instantiate(train_cfg.module.optimizer, **spec.get("adamw", {}))(net.parameters())
        xs = x.contiguous(memory_format=torch.channels_last) if spec.get("channels_last") else x
        if spec.get("channels_last"):
            net = net.to(memory_format=torch.channels_last)
        step = train_step(torch.compile(net) if spec.get("compile") else net, opt, xs, y, cfg)
        if "sdpa" in spec:
            step = functools.partial(_with_backend, step, spec["sdpa"])
        try:
            step()  # a backend or kernel this device lacks (sdpa_cudnn on a CPU) fails here, not mid-timing
            steps[name] = step
        except (RuntimeError, NotImplementedError) as e:
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    times = interleave_steps(steps, steps=cfg.steps, warmup=cfg.warmup, repeats=cfg.repeats, device=cfg.device)
    contenders = {name: {"train": summarize(t, cfg.batch_size)} for name, t in times.items()}
    base, others = contenders["baseline"]["train"]["step_s"], [n for n in contenders if n != "baseline"]
    ratios = {f"step_time {n}/baseline": contenders[n]["train"]["step_s"] / base for n in others}
    ratios |= {f"step_time {n}/baseline (paired)": paired_ratio(times[n], times["baseline"]) for n in others}
    return {"contenders": contenders, "ratios": ratios, "unavailable": failed}


def _with_backend(step, backend) -> None:
    with sdpa_kernel(backend):
        step()


class ReferenceMAE(torch.nn.Module):
    """A plain-PyTorch MAE written the way facebookresearch/mae's models_mae.py is (timm's Block, a
    position table added before masking, gather of the kept tokens, mask tokens unshuffled before the
    decoder, MSE over the masked patches): the baseline of ``compare_mae``, loaded with vitpipe's weights."""

    def __init__(self, mae) -> None:
        from timm.layers import PatchEmbed
        from timm.models.vision_transformer import Block

        super().__init__()
        (h, w), (p, q) = mae.patch_embed.grid_size, mae.patch_embed.patch_size
        dim, dec = mae.cls_token.shape[-1], mae.decoder_embed.out_features
        norm = functools.partial(torch.nn.LayerNorm, eps=1e-6)
        self.p, self.grid, self.norm_pix_loss = p, (h, w), mae.norm_pix_loss
        self.patch_embed = PatchEmbed((h * p, w * q), (p, q), mae.patch_embed.proj.in_channels, dim)
        self.cls_token = torch.nn.Parameter(torch.zeros(1, 1, dim))
        with torch.no_grad():  # vitpipe's fixed table as the reference stores it: (1, 1 + L, dim), frozen
            table = mae.pos_embed(torch.zeros(1, 1 + h * w, dim), (h, w))
        self.pos_embed = torch.nn.Parameter(table, requires_grad=False)
        heads = mae.blocks[0].attn.num_heads
        self.blocks = torch.nn.ModuleList(Block(dim, heads, 4.0, qkv_bias=True, norm_layer=norm) for _ in mae.blocks)
        self.norm = norm(dim)
        self.decoder_embed = torch.nn.Linear(dim, dec)
        self.mask_token = torch.nn.Parameter(torch.zeros(1, 1, dec))
        self.decoder_pos_embed = torch.nn.Parameter(mae.decoder_pos_embed.clone(), requires_grad=False)
        dheads = mae.decoder_blocks[0].attn.num_heads
        self.decoder_blocks = torch.nn.ModuleList(Block(dec, dheads, 4.0, qkv_bias=True, norm_layer=norm)
                                                  for _ in mae.decoder_blocks)
        self.decoder_norm = norm(dec)
        self.decoder_pred = torch.nn.Linear(dec, mae.decoder_pred.out_features)
        missing, unexpected = self.load_state_dict(mae.state_dict(), strict=False)
        assert set(missing) <= {"pos_embed"} and not unexpected, (missing, unexpected)

    def forward(self, imgs, mask_ratio: float, noise):
        x = self.patch_embed(imgs) + self.pos_embed[:, 1:]
        n, length, dim = x.shape
        keep = int(length * (1 - mask_ratio))
        ids_shuffle = noise.argsort(dim=1)
        ids_restore = ids_shuffle.argsort(dim=1)
        x = x.gather(1, ids_shuffle[:, :keep, None].expand(-1, -1, dim))
        mask = torch.ones(n, length, device=x.device)
        mask[:, :keep] = 0
        mask = mask.gather(1, ids_restore)
        x = torch.cat([(self.cls_token + self.pos_embed[:, :1]).expand(n, -1, -1), x], dim=1)
        for blk in self.blocks:
            x = blk(x)
        y = self.decoder_embed(self.norm(x))
        tokens = torch.cat([y[:, 1:], self.mask_token.expand(n, length - keep, -1)], dim=1)
        tokens = tokens.gather(1, ids_restore[..., None].expand(-1, -1, y.shape[-1]))
        y = torch.cat([y[:, :1], tokens], dim=1) + self.decoder_pos_embed
        for blk in self.decoder_blocks:
            y = blk(y)
        pred = self.decoder_pred(self.decoder_norm(y))[:, 1:]
        (h, w), p, c = self.grid, self.p, imgs.shape[1]
        target = torch.einsum("nchpwq->nhwpqc", imgs.reshape(n, c, h, p, w, p)).reshape(n, h * w, p * p * c)
        if self.norm_pix_loss:
            target = (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + 1e-6) ** 0.5
        return ((pred - target) ** 2).mean(-1).mul(mask).sum() / mask.sum(), pred, mask


def compare_mae(cfg: BenchConfig, *, mask_ratio: float = 0.75) -> dict:
    """MAE pre-training steps: vitpipe's ``MaskedAutoencoderViT`` (``mae_<variant>``) against the same
    model written the reference's way (same weights, same noise, so the same loss), and against a
    supervised step of the same encoder on the whole image (how much masking saves)."""
    from vitpipe.models.registry import MAE_VARIANTS, create_mae, create_model

    name = f"mae_{cfg.variant}"
    if name not in MAE_VARIANTS:
        raise ConfigError(f"--only mae: no MAE variant {name}; MAE variants: {', '.join(MAE_VARIANTS)}")
    torch.manual_seed(cfg.seed)
    mae = create_mae(name, img_size=cfg.size, in_chans=3).to(cfg.device)
    kind = mae.encoder_kwargs().get("pos_embed")
    if kind not in ("sincos2d", "sincos1d", "learned", "none") or mae.num_prefix_tokens != 1:
        raise ConfigError(f"--only mae: the reference MAE adds one position table with one class token; "
                          f"{name} has pos_embed={kind!r} and {mae.num_prefix_tokens} prefix tokens")
    ref = ReferenceMAE(mae).to(cfg.device)
    sup = create_model(cfg.variant, img_size=cfg.size, num_classes=cfg.num_classes,
                       **{k: v for k, v in mae.encoder_kwargs().items() if k in ("pos_embed", "class_token", "pool")})
    sup = sup.to(cfg.device)
    x, y = random_batch(cfg)
    h, w = mae.patch_embed.grid_size
    noise = torch.rand(x.shape[0], h * w, generator=torch.Generator().manual_seed(2)).to(cfg.device)
    with torch.no_grad():
        loss_diff = abs(mae(x, mask_ratio, noise)[0].item() - ref(x, mask_ratio, noise)[0].item())
    opts = {k: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4, betas=(0.9, 0.95))
            for k, m in (("vitpipe", mae), ("reference", ref), ("supervised", sup))}

    def mae_step(model, opt):
        def step() -> None:
            with cfg.autocast():
                loss = model(x, mask_ratio, noise)[0]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    steps = {"vitpipe": mae_step(mae.train(), opts["vitpipe"]), "reference": mae_step(ref.train(), opts["reference"]),
             "supervised": train_step(sup.train(), opts["supervised"], x, y, cfg)}
    times = interleave_steps(steps, steps=cfg.steps, warmup=cfg.warmup, repeats=cfg.repeats, device=cfg.device)
    contenders = {}
    for key, step in steps.items():
        with StepMemory(cfg.device) as mem:
            step()
        contenders[key] = {"train": {**summarize(times[key], cfg.batch_size), "memory": mem.as_dict()}}
    s = {k: contenders[k]["train"]["step_s"] for k in contenders}
    ratios = {"mae_step vitpipe/reference": s["vitpipe"] / s["reference"],
              "mae_step vitpipe/reference (paired)": paired_ratio(times["vitpipe"], times["reference"]),
              f"mae_step (mask {mask_ratio}) / supervised step": s["vitpipe"] / s["supervised"],
              "mae_step / supervised step (paired)": paired_ratio(times["vitpipe"], times["supervised"])}
    return {"contenders": contenders, "ratios": ratios, "max_abs_loss_diff": loss_diff, "mask_ratio": mask_ratio}


def naflex_pair(cfg: BenchConfig) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(vitpipe ViT, timm NaFlexVit) of the variant with the same weights (``from_timm``), on
    ``cfg.device``: learned positions resampled aspect-preserving, average pooling (timm's
    ``naflexvit_base_patch16_par_gap`` at the variant's width, depth, heads, patch and grid)."""
    torch.manual_seed(cfg.seed)
    v = VARIANTS[cfg.variant]
    grid = cfg.size // v["patch_size"]
    tm = timm.create_model("naflexvit_base_patch16_par_gap", pretrained=False, embed_dim=v["dim"], depth=v["depth"],
                           num_heads=v["num_heads"], patch_size=v["patch_size"], num_classes=cfg.num_classes,
                           pos_embed_grid_size=(grid, grid))
    return from_timm(tm).to(cfg.device), tm.to(cfg.device)


def naflex_batches(cfg: BenchConfig, *, seed: int = 1) -> dict:
    """The inputs of ``compare_naflex``: ``square`` (B, 3, S, S) images, the same images as a patch dict
    (``square_dict``, full grid, no padding), and ``mixed``: images of aspect W/H log-uniform in [1/3, 3],
    each at the largest grid of at most (S/p)^2 patches, padded to that length, as many images as
    it takes to hold at least the square batch's B (S/p)^2 valid tokens; labels for each."""
    from vitpipe.nn.naflex import pad_batch, patchify_image

    g = torch.Generator().manual_seed(seed)
    patch = VARIANTS[cfg.variant]["patch_size"]
    seq = (cfg.size // patch) ** 2
    square = torch.randn(cfg.batch_size, 3, cfg.size, cfg.size, generator=g)
    items, valid = [], 0
    while valid < cfg.batch_size * seq:
        aspect = math.exp((2 * torch.rand((), generator=g).item() - 1) * math.log(3))  # W / H
        h = max(1, round(cfg.size / math.sqrt(aspect)))
        items.append(patchify_image(torch.randn(3, h, max(1, round(h * aspect)), generator=g), patch, seq))
        valid += len(items[-1]["patches"])
    labels = lambda n: torch.randint(0, cfg.num_classes, (n,), generator=g).to(cfg.device)
    dev = lambda d: {k: v.to(cfg.device) for k, v in d.items()}
    return {"square": (square.to(cfg.device), labels(cfg.batch_size)),
            "square_dict": (dev(pad_batch([patchify_image(im, patch, seq) for im in square])), labels(cfg.batch_size)),
            "mixed": (dev(pad_batch(items, seq_len=seq)), labels(len(items)))}


def compare_naflex(cfg: BenchConfig) -> dict:
    """Patch-dict (NaFlex) input: vitpipe's dict path on a padded batch of mixed-aspect images against its
    fixed tensor path on square images at (nearly) the same number of valid tokens (what padding and the
    per-image positions cost), and against timm's ``NaFlexVit`` on the same dict with the same weights
    (same math, logits checked). Inference and training steps (forward, cross-entropy, backward, AdamW)."""
    ours, theirs = naflex_pair(cfg)
    batches = naflex_batches(cfg)
    patch = VARIANTS[cfg.variant]["patch_size"]
    seq = (cfg.size // patch) ** 2
    tokens = {"square": cfg.batch_size * seq, "square_dict": cfg.batch_size * seq,
              "mixed": int(batches["mixed"][0]["patch_valid"].sum())}
    with torch.no_grad():  # parity on a copy with weights that matter (timm's LayerScale starts at 1e-5)
        a = copy.deepcopy(theirs).eval()
        for p in a.parameters():
            p.normal_(std=0.2, generator=torch.Generator(p.device).manual_seed(0))
        b = from_timm(a).eval()
        logit_diff = (b(batches["mixed"][0]) - a(batches["mixed"][0])).abs().max().item()
    # contender -> (network, input); vitpipe_* and timm_mixed share the mixed dict
    plan = {"vitpipe_fixed": (ours, "square"), "vitpipe_dict_sq": (ours, "square_dict"),
            "vitpipe_mixed": (ours, "mixed"), "timm_mixed": (theirs, "mixed")}
    contenders, times = {name: {} for name in plan}, {}
    for phase in ("train", "infer"):
        steps = {}
        for name, (net, key) in plan.items():
            x, y = batches[key]
            if phase == "train":  # its own optimizer per contender: the two vitpipe contenders share weights only
                opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
                steps[name] = train_step(net.train(), opt, x, y, cfg)
            else:
                steps[name] = infer_step(net.eval(), x, cfg)
        times[phase] = interleave_steps(steps, steps=cfg.steps, warmup=cfg.warmup, repeats=cfg.repeats,
                                        device=cfg.device)
        for name, (_, key) in plan.items():
            s = summarize(times[phase][name], len(batches[key][1]))
            contenders[name][phase] = {**s, "valid_tokens": tokens[key], "tokens_s": tokens[key] / s["step_s"]}
    ratios, t = {}, tokens
    for phase, key in (("train", "train_step"), ("infer", "infer")):
        c, tm = contenders, times[phase]
        ratios[f"{key} tokens/s mixed dict/fixed"] = c["vitpipe_mixed"][phase]["tokens_s"] / c["vitpipe_fixed"][phase]["tokens_s"]
        ratios[f"{key} tokens/s mixed dict/fixed (paired)"] = (
            paired_ratio(tm["vitpipe_fixed"], tm["vitpipe_mixed"]) * t["mixed"] / t["square"])
        ratios[f"{key} time square dict/tensor (paired)"] = paired_ratio(tm["vitpipe_dict_sq"], tm["vitpipe_fixed"])
        ratios[f"{key} time vitpipe/timm NaFlexVit"] = c["vitpipe_mixed"][phase]["step_s"] / c["timm_mixed"][phase]["step_s"]
        ratios[f"{key} time vitpipe/timm NaFlexVit (paired)"] = paired_ratio(tm["vitpipe_mixed"], tm["timm_mixed"])
    mixed = batches["mixed"][0]["patch_valid"]
    return {"contenders": contenders, "ratios": ratios, "max_abs_logit_diff": logit_diff,
            "mixed_batch": {"images": int(mixed.shape[0]), "seq_len": int(mixed.shape[1]), "valid_tokens": t["mixed"],
                            "padding_fraction": 1 - t["mixed"] / mixed.numel()},
            "square_batch": {"images": cfg.batch_size, "seq_len": seq, "valid_tokens": t["square"]}}


# --------------------------------------------------------------------------- serve


def serve_checkpoint(cfg: BenchConfig, folder: Path) -> Path:
    """A checkpoint of the recipe's network (random weights, data=synthetic at its own size) as a training
    run stores one: state_dict, the resolved config, class names."""
    from omegaconf import OmegaConf

    train_cfg = recipe(cfg)
    dm, net, module = build(train_cfg)
    path = folder / "run" / "checkpoints" / "bench.ckpt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": module.state_dict(), "vitpipe_config": OmegaConf.to_container(train_cfg, resolve=True),
                "class_names": [f"class_{i}" for i in range(cfg.num_classes)]}, path)
    return path


def serve_images(cfg: BenchConfig, folder: Path, count: int) -> list[Path]:
    """``count`` PNG files of random RGB pixels at the variant's size."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(cfg.seed)
    paths = []
    for i in range(count):
        pixels = torch.randint(0, 256, (cfg.size, cfg.size, 3), generator=g, dtype=torch.uint8).numpy()
        paths.append(folder / f"{i:04d}.png")
        Image.fromarray(pixels).save(paths[-1])
    return paths


def predict_throughput(cfg: BenchConfig, ckpt: Path, files: list[Path], folder: Path) -> dict:
    """Images/s of ``vitpipe.tasks.predict`` (scripts/predict.py's body, its default batch size) on
    ``files``: (n - 1) / (time for n files - time for one), the median over repeats: start-up (reading
    the checkpoint) taken out, as a running server has paid it."""
    import io
    import shutil

    from vitpipe.tasks.predict import predict

    one = folder / "one"
    one.mkdir(parents=True, exist_ok=True)
    shutil.copy(files[0], one / files[0].name)
    times = {"one": [], "all": []}
    for repeat in range(cfg.repeats):
        for name, images in (("one", one), ("all", files[0].parent)):
            GlobalHydra.instance().clear()
            with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
                pcfg = compose(config_name="predict", overrides=[
                    f"ckpt_path={ckpt}", f"images={images}", f"out={folder / f'{name}.csv'}", f"device={cfg.device}",
                    f"paths.root_dir={folder}", f"paths.output_dir={folder}"])
            start = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                predict(pcfg)
            times[name].append(time.perf_counter() - start)
    one_s, all_s = float(np.median(times["one"])), float(np.median(times["all"]))
    img_s = (len(files) - 1) / max(all_s - one_s, 1e-9)
    return {"images": len(files), "one_file_s": one_s, "all_files_s": all_s, "img_s": img_s, "step_s": 1 / img_s}


def api_throughput(cfg: BenchConfig, ckpt: Path, bodies: list[bytes]) -> dict:
    """Requests/s of the server's own model code without HTTP: ``ImageAPI`` (set up as a worker sets it
    up, in this process, torch's thread count as the worker has it) decoding, predicting and encoding
    the same JSON bodies in batches of 1 and of ``batch_size``; the median over repeats. Their ratio
    is what batching can give at most on this machine: the served ratio is bounded by it."""
    from vitpipe.tasks.serving.api import ImageAPI

    api = ImageAPI(ckpt_path=str(ckpt), paths={"log_dir": str(ckpt.parent), "data_dir": str(ckpt.parent)},
                   max_batch_size=cfg.batch_size)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        api.setup(cfg.device)
    requests = [json.loads(b) for b in bodies]

    def serve_all(size: int) -> float:
        start = time.perf_counter()
        for i in range(0, len(requests), size):
            decoded = [api.decode_request(r) for r in requests[i:i + size]]
            out = api.predict(api.batch(decoded) if size > 1 else decoded[0])
            for answer in (api.unbatch(out) if size > 1 else [out]):
                api.encode_response(answer)
        return time.perf_counter() - start

    out = {}
    for size in (1, cfg.batch_size):
        serve_all(size)  # warm-up
        wall = float(np.median([serve_all(size) for _ in range(cfg.repeats)]))
        out[f"batch_{size}"] = {"req_s": len(requests) / wall, "ms_per_request": 1e3 * wall / len(requests)}
    return out


def compare_serve(cfg: BenchConfig) -> dict:
    """scripts/serve.py under a bounded load on loopback: ``serve_requests`` requests per contender from
    ``serve_clients`` client threads, dynamic batching (``max_batch_size=batch_size``) against
    ``max_batch_size=1``, the two servers running side by side and taking turns (repeats alternate who
    goes first); requests/s, latency p50/p99, failures, the mean batch formed, each server's memory (RSS
    of all its processes) at the start and the end; and served throughput against
    ``vitpipe.tasks.predict`` on the same image files."""
    import base64
    import tempfile

    from vitpipe.tasks.serving.load import ServerProcess, hammer, load_summary

    script = CONF.parent / "scripts" / "serve.py"
    settings = {"served_batched": cfg.batch_size, "served_unbatched": 1}
    per_repeat = [cfg.serve_requests // cfg.repeats + (r < cfg.serve_requests % cfg.repeats) for r in range(cfg.repeats)]
    with tempfile.TemporaryDirectory(prefix="vitpipe-bench-serve-") as tmp:
        tmp = Path(tmp)
        ckpt = serve_checkpoint(cfg, tmp)
        files = serve_images(cfg, tmp / "images", min(cfg.serve_requests, 512))
        bodies = [json.dumps({"image": base64.b64encode(f.read_bytes()).decode()}).encode() for f in files]
        servers = {name: ServerProcess(script, [f"ckpt_path={ckpt}", f"max_batch_size={size}", f"device={cfg.device}",
                                                f"hydra.run.dir={tmp / name}"], tmp / f"{name}.log")
                   for name, size in settings.items()}
        try:
            for server in servers.values():
                server.wait_ready()
            for server in servers.values():  # warm-up, untimed: first requests, allocator, connections
                hammer(server.port, bodies, requests=cfg.warmup * cfg.serve_clients, clients=cfg.serve_clients)
            memory = {name: {"start": server.memory()} for name, server in servers.items()}
            runs = {name: [] for name in servers}
            for repeat, count in enumerate(per_repeat):
                for name in (list(servers) if repeat % 2 == 0 else list(servers)[::-1]):
                    runs[name].append(hammer(servers[name].port, bodies, requests=count, clients=cfg.serve_clients))
            for name, server in servers.items():
                memory[name]["end"] = server.memory()
        finally:
            for server in servers.values():
                server.stop()
        offline = predict_throughput(cfg, ckpt, files, tmp / "predict")
        in_process = api_throughput(cfg, ckpt, bodies)
    load = {name: {**load_summary(r), "max_batch_size": settings[name], "memory": memory[name]}
            for name, r in runs.items()}
    contenders = {name: {"serve": {"step_s": 1 / s["req_s"] if s["req_s"] > 0 else float("inf"), "img_s": s["req_s"]}}
                  for name, s in load.items()}
    contenders["predict_py"] = {"predict": {"step_s": offline["step_s"], "img_s": offline["img_s"]}}
    ib, iu = in_process[f"batch_{cfg.batch_size}"], in_process["batch_1"]
    for name, figures in (("api_batched", ib), ("api_unbatched", iu)):  # the model code, no HTTP
        contenders[name] = {"serve": {"step_s": 1 / figures["req_s"], "img_s": figures["req_s"]}}
    b, u = load["served_batched"], load["served_unbatched"]
    ratios = {"req/s batched/unbatched": b["req_s"] / u["req_s"],
              "req/s batched/unbatched without HTTP (the bound)": ib["req_s"] / iu["req_s"],
              "req/s served/without HTTP, batched": b["req_s"] / ib["req_s"],
              "req/s served/without HTTP, unbatched": u["req_s"] / iu["req_s"],
              "p50 latency batched/unbatched": b["p50_ms"] / u["p50_ms"],
              "p99 latency batched/unbatched": b["p99_ms"] / u["p99_ms"],
              "req/s served batched/predict.py img/s": b["req_s"] / offline["img_s"]}
    return {"contenders": contenders, "ratios": ratios, "serve": load, "predict": offline, "in_process": in_process,
            "clients": cfg.serve_clients, "failed": sum(s["failed"] for s in load.values())}


RUNNERS = {"vit": compare_vit, "lightning": compare_lightning, "data": compare_data, "shards": compare_shards,
           "switches": compare_switches, "mae": compare_mae,
           "naflex": compare_naflex, "serve": compare_serve}


# --------------------------------------------------------------------------- run and report


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def environment(cfg: BenchConfig) -> dict:
    return {"torch": torch.__version__, "timm": timm.__version__, "lightning": L.__version__,
            "python": platform.python_version(),
            "device_name": torch.cuda.get_device_name() if cfg.device == "cuda" else cpu_name(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


def run(cfg: BenchConfig, only: tuple[str, ...] = DEFAULT_ONLY) -> dict:
    """``{"schema", "config", "env", "memory_method", "results": {comparison: {"contenders", "ratios", ...}}}``."""
    load_start = os.getloadavg()[0]
    results = {name: RUNNERS[name](cfg) for name in only}
    return {"schema": SCHEMA, "config": {**asdict(cfg), "img_size": cfg.size},
            "env": {**environment(cfg), "loadavg_1m_start": load_start, "loadavg_1m_end": os.getloadavg()[0]},
            "memory_method": MEMORY_METHOD[cfg.device], "results": results}


def format_table(result: dict) -> str:
    """One row per contender and phase, then the ratios."""
    cfg, env = result["config"], result["env"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = [
        f"{cfg['variant']} @ {cfg['img_size']}px, batch {cfg['batch_size']}, {cfg['precision']}, {cfg['device']} "
        f"({env['device_name']}, {env['torch_threads']} threads), compile={cfg['compile']}, "
        f"{cfg['steps']} steps x {cfg['repeats']} repeats after {cfg['warmup']} warm-up; "
        f"load avg {env['loadavg_1m_start']:.1f} -> {env['loadavg_1m_end']:.1f}",
        f"{'comparison':<10} {'contender':<15} {'phase':<6} {'step ms':>9} {'img/s':>10} {'peak MB':>9} "
        f"{'TFLOP/s':>8} {'MFU':>6}",
    ]
    for comp, res in result["results"].items():
        for name, phases in res["contenders"].items():
            for phase, s in phases.items():
                peak = (s.get("memory") or {}).get("peak_step_bytes")
                mfu = None if s.get("mfu") is None else format(100 * s["mfu"], "5.1f") + "%"
                lines.append(f"{comp:<10} {name:<15} {phase:<6} {1e3 * s['step_s']:>9.2f} {s['img_s']:>10.1f} "
                             f"{fmt(None if peak is None else peak / 2**20, '9.1f'):>9} "
                             f"{fmt(s.get('tflops'), '8.3f'):>8} {fmt(mfu, ''):>6}")
    lines.append("ratios (time ratios: < 1 means the first is faster; throughput ratios: > 1):")
    for comp, res in result["results"].items():
        lines += [f"  {comp:<10} {key:<45} {value:.3f}" for key, value in res["ratios"].items()]
        if "max_abs_logit_diff" in res:
            lines.append(f"  {comp:<10} {'max |logit diff| vitpipe vs timm':<45} {res['max_abs_logit_diff']:.2e}")
        if "mixed_batch" in res:
            m, q = res["mixed_batch"], res["square_batch"]
            lines.append(f"  {comp:<10} mixed dict: {m['images']} images x {m['seq_len']} slots, {m['valid_tokens']} valid "
                         f"({100 * m['padding_fraction']:.1f}% padding); fixed: {q['images']} images x {q['seq_len']} "
                         f"= {q['valid_tokens']} tokens")
        for name, load in res.get("serve", {}).items():
            m = load["memory"]
            lines.append(f"  {comp:<10} {name}: {load['answered']}/{load['requests']} answered ({load['failed']} failed) by "
                         f"{res['clients']} clients, p50 {load['p50_ms']:.1f} ms, p99 {load['p99_ms']:.1f} ms, mean batch "
                         f"{load['mean_batch']:.1f} (max {load['max_batch']}), RSS {m['start']['rss_mb']:.0f} -> "
                         f"{m['end']['rss_mb']:.0f} MB (peak {m['start']['peak_rss_mb']:.0f} -> {m['end']['peak_rss_mb']:.0f} MB; PSS "
                         f"{m['start']['pss_mb']:.0f} -> {m['end']['pss_mb']:.0f} MB) over {m['end']['processes']} processes")
        if "max_abs_loss_diff" in res:
            lines.append(f"  {comp:<10} {'|loss diff| vitpipe vs reference MAE':<45} {res['max_abs_loss_diff']:.2e}")
        lines += [f"  {comp:<10} {name} unavailable: {why}" for name, why in res.get("unavailable", {}).items()]
    lines.append(f"memory: {result['memory_method']}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", default="vit_ti4", help="registry name (vitpipe/models/registry.py)")
    p.add_argument("--img-size", type=int, default=None, help="default: the variant's size")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--precision", default="32-true", help="32-true | bf16-mixed | 16-mixed (CUDA)")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--compile", action="store_true", help="torch.compile the models (vit, lightning)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per repeat")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers of the PIL path")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--tf32", action="store_true", help="let fp32 matmuls use TF32 on CUDA")
    p.add_argument("--only", default=",".join(DEFAULT_ONLY), help=",".join(COMPARISONS))
    p.add_argument("--switches", default="", help="subset of the switches comparison, e.g. adamw_fused,sdpa_math "
                   "(default: all; compile's warm-up takes a minute on a CPU)")
    p.add_argument("--requests", type=int, default=2000, help="serve: requests per server contender")
    p.add_argument("--clients", type=int, default=16, help="serve: concurrent client threads")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    only = tuple(n.strip() for n in args.only.split(",") if n.strip())
    try:
        bad = [n for n in only if n not in COMPARISONS]
        if bad or not only:
            raise ConfigError(f"--only {args.only!r}: unknown {bad or 'empty'}; choose among {', '.join(COMPARISONS)}")
        cfg = BenchConfig(variant=args.variant, img_size=args.img_size, batch_size=args.batch_size,
                          num_classes=args.num_classes, precision=args.precision, device=args.device,
                          compile=args.compile, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                          workers=args.workers, switches=tuple(n for n in args.switches.split(",") if n),
                          serve_requests=args.requests, serve_clients=args.clients)
    except ConfigError as e:
        print(f"benchmark: error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tf32:
        torch.set_float32_matmul_precision("high")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    result = run(cfg, only)
    print(format_table(result))
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return 0

