"""``--only mae``: vitpipe's MAE step against the MAE paper's reference forward (``reference_mae``, same
weights and noise) and against a supervised step of the same encoder."""

from __future__ import annotations

import torch

from vitpipe.benchmark.common import StepMemory, interleave_steps, paired_ratio, random_batch, summarize, train_step
from vitpipe.benchmark.config import BenchConfig
from vitpipe.benchmark.reference_mae import ReferenceMAE
from vitpipe.errors import ConfigError
from vitpipe.models.registry import MAE_VARIANTS, create_mae, create_model


def compare_mae(cfg: BenchConfig, *, mask_ratio: float = 0.75) -> dict:
    """MAE pre-training steps: vitpipe's ``MaskedAutoencoderViT`` (``mae_<variant>``) against the same
    model written the reference's way (same weights, same noise, so the same loss), and against a
    supervised step of the same encoder on the whole image (how much masking saves)."""
    name = f"mae_{cfg.variant}"
    if name not in MAE_VARIANTS:
        raise ConfigError(f"--only mae: no MAE variant {name}; MAE variants: {', '.join(MAE_VARIANTS)}")
    torch.manual_seed(cfg.seed)
    mae = create_mae(name, img_size=cfg.size, in_chans=3).to(cfg.device)
    kind = mae.encoder_kwargs().get("pos_embed")
    if kind not in ("sincos2d", "sincos1d", "learned", "none") or mae.num_prefix_tokens != 1:
        raise ConfigError(f"--only mae: the reference MAE adds one position table with one class token; "
                          f"{name} has pos_embed={kind!r} and {mae.num_prefix_tokens} prefix tokens")
    ref = ReferenceMAE.from_vitpipe(mae).to(cfg.device)
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
