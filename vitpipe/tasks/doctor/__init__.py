"""``doctor(cfg) -> [Check]``: the body of ``scripts/doctor.py``: the attention troubleshooting list on the
user's own model, one line per check (docs/doctor.md).

    python scripts/doctor.py ckpt_path=<run dir | .ckpt | last>   a trained classifier or captioner
    python scripts/doctor.py model=vit_micro [model.num_heads=8 ...]   a model config, freshly initialised

Each check feeds the network a probe whose right answer is known without the network and measures the
distance to it (``run_checks``), in float64 so that "equal" means round-off:

    scale      the attention core applies 1/sqrt(d_k)                      (doctor.encoder)
    positions  shuffled patches move the output iff positions are on       (doctor.encoder)
    causal     no word sees later words; cached decoding = the full pass   (doctor.decoder, captioners)
    cross_kv   cross-attention K/V: the image's, constant, cached once     (doctor.decoder, cross decoder)
    heads      dim % num_heads == 0, head width in 16..256                 (doctor.sizes)
    memory     the explicit attention matrices against the memory free     (doctor.sizes)

A stored run is rebuilt as every command rebuilds one (resolve, safe load, the stored-config rule,
``vitpipe.run.checkpoint.rebuild``); a model config is instantiated as training does, with the data's
channels and classes (``data=<name>``, else 3 channels and 10 classes) and, for a captioner, a stand-in
vocabulary: no data is read. A config whose ``dim`` is not divisible by ``num_heads`` cannot be built; the
heads check names it and the others are skipped. ``main`` is the command: exit status 1 when a check failed.
"""

from __future__ import annotations

import sys

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from vitpipe.config.build import instantiate_checked, resolve_device
from vitpipe.config.preflight import preflight
from vitpipe.errors import ConfigError
from vitpipe.models.captioner import Captioner
from vitpipe.models.variants import VARIANTS
from vitpipe.models.vit import ViT
from vitpipe.run.checkpoint import rebuild
from vitpipe.run.paths import needs_kinds, resolve_ckpt_path
from vitpipe.run.stored import load_checkpoint
from vitpipe.tasks.doctor.check import FAIL, PASS, SKIP, Check
from vitpipe.tasks.doctor.decoder import check_causal, check_cross_kv
from vitpipe.tasks.doctor.encoder import check_positions, check_scale, positions_on
from vitpipe.tasks.doctor.sizes import attention_stacks, check_heads, check_memory

EXIT_FAILED = 1  # a check failed (2 stays a configuration mistake: vitpipe.tasks.cli)
STAND_IN_DATA = {"channels": 3, "num_classes": 10}  # what a model config reads from data= when none is given
STAND_IN_VOCAB = 64  # a captioner's vocabulary size without data: the checks need words, not these words
CHECK_NAMES = ("scale", "positions", "causal", "cross_kv", "heads", "memory")


def main(cfg: DictConfig) -> list[Check]:
    """The command: ``doctor(cfg)``, then exit status ``EXIT_FAILED`` when a check failed."""
    checks = doctor(cfg)
    if any(c.failed for c in checks):
        sys.exit(EXIT_FAILED)
    return checks


def doctor(cfg: DictConfig) -> list[Check]:
    """Run the checks on the run ``ckpt_path`` names or on the model ``model=`` composes; print one line
    per check and a summary; return the checks."""
    preflight(cfg, "doctor")  # ckpt_path or model, batch_size, device: before anything loads
    device = resolve_device(cfg.device)
    if cfg.get("ckpt_path") is not None:
        net, source, batch_size = stored_model(cfg)
    else:
        source = f"model={_model_name(cfg.model)}"
        stacks = config_stacks(cfg.model)
        heads = check_heads(stacks)
        if any(n <= 0 or dim % n for _, dim, n in stacks):  # MultiHeadAttention would refuse to build it
            return report(
                [
                    heads
                    if name == "heads"
                    else Check(name, SKIP, None, "the model cannot be built with these heads (see heads)")
                    for name in CHECK_NAMES
                ],
                f"vitpipe doctor: {source}: not built",
            )
        net = config_model(cfg)
        batch_size = _batch_size(cfg.get("data"))
    batch_size = cfg.batch_size or batch_size
    header = f"vitpipe doctor: {source}: {describe(net)}; probes in float64 on {device}"
    return report(run_checks(net, batch_size=batch_size, device=device, seed=cfg.seed), header)


@torch.no_grad()
def run_checks(net: nn.Module, *, batch_size: int = 1, device: torch.device | str = "cpu", seed: int = 0) -> list[Check]:
    """The six checks on ``net`` (a ``ViT`` or a ``Captioner``), which is converted in place to float64 on
    ``device`` and put in eval mode (dropout off); ``batch_size``: the batch the memory check sizes."""
    device = torch.device(device)
    net.to(device=device, dtype=torch.float64).eval()
    gen = torch.Generator().manual_seed(seed)
    return [
        check_scale(net, gen),
        check_positions(net, gen),
        check_causal(net, gen),
        check_cross_kv(net, gen),
        check_heads(attention_stacks(net)),
        check_memory(net, batch_size, device),
    ]


def report(checks: list[Check], header: str) -> list[Check]:
    """Print ``header``, one line per check and the tally."""
    print(header)
    for c in checks:
        print(c.line())
    count = {s: sum(c.status == s for c in checks) for s in (PASS, FAIL, SKIP)}
    tail = ": docs/doctor.md says how to read a FAIL" if count[FAIL] else ""
    print(f"doctor: {count[PASS]} passed, {count[FAIL]} failed, {count[SKIP]} skipped{tail}", flush=True)
    return checks


# --------------------------------------------------------------------------- the network


def stored_model(cfg: DictConfig) -> tuple[nn.Module, str, int]:
    """The network of the run ``cfg.ckpt_path`` names (its best checkpoint), as every command rebuilds it,
    the checkpoint's path, and the run's training batch size."""
    path = resolve_ckpt_path(
        cfg.ckpt_path, log_dir=cfg.paths.log_dir, which="best", usable=needs_kinds("classifier", "captioner", command="doctor")
    )
    run = rebuild(load_checkpoint(path), path, paths=cfg.paths, task_name=cfg.task_name)
    _check_kind(run.net, str(path))
    return run.net, str(path), _batch_size(run.cfg.get("data"))


def config_model(cfg: DictConfig) -> nn.Module:
    """The network ``model=`` composes, initialised as training initialises it (seeded by ``seed``)."""
    data = cfg.get("data")
    node = OmegaConf.create(
        {
            "model": OmegaConf.to_container(cfg.model, resolve=False),
            "data": OmegaConf.to_container(data, resolve=False) if data is not None else STAND_IN_DATA,
        }
    )
    extra = {"vocab_size": STAND_IN_VOCAB} if _is_captioner(node.model) and "vocab_size" not in node.model else {}
    torch.manual_seed(cfg.seed)
    net = instantiate_checked(node.model, "model", **extra)
    _check_kind(net, f"model={_model_name(cfg.model)}")
    return net


def _check_kind(net: nn.Module, source: str) -> None:
    encoder = net.encoder if isinstance(net, Captioner) else net
    if not isinstance(encoder, ViT):  # e.g. a timm network (model=timm): not vitpipe's attention core
        raise ConfigError(
            f"{source} is a {type(net).__name__}; doctor checks vitpipe's attention: a ViT classifier or a Captioner"
        )


def _is_captioner(model: DictConfig) -> bool:
    return str(model.get("_target_", "")).endswith("Captioner")


def _model_name(model: DictConfig) -> str:
    if _is_captioner(model):
        return "captioner"
    return str(model.get("name") or str(model.get("_target_", "?")).rsplit(".", 1)[-1])


def config_stacks(model: DictConfig) -> list[tuple[str, int, int]]:
    """(where, dim, num_heads) of each attention stack a model config would build, read before building
    (a ViT refuses a ``dim`` that ``num_heads`` does not divide): the encoder's, a captioner's decoder's."""
    if _is_captioner(model):
        enc = model.get("encoder")
        enc = {k: enc.get(k) for k in ("name", "dim", "num_heads") if k in enc} if isinstance(enc, DictConfig) else {}
        row = {**VARIANTS.get(enc.get("name"), {}), **enc}  # the variant's row, then the overrides
        stacks = [("encoder", row.get("dim"), row.get("num_heads")), ("decoder", model.get("dim"), model.get("num_heads"))]
    else:
        stacks = [("encoder", model.get("dim"), model.get("num_heads"))]
    return [s for s in stacks if all(isinstance(v, int) and not isinstance(v, bool) for v in s[1:])]


def _batch_size(data) -> int:
    """The training batch of a data config (the memory check's batch), 1 without one."""
    size = data.get("batch_size") if isinstance(data, DictConfig) else None
    return size if isinstance(size, int) and size > 0 else 1


def describe(net: nn.Module) -> str:
    """The network in one phrase: what the checks' numbers are about."""
    enc = net.encoder if isinstance(net, Captioner) else net
    (H, W), (p, q) = enc.img_size, enc.current_patch_size
    heads = enc.blocks[0].attn.num_heads if len(enc.blocks) else 0
    on = positions_on(enc)
    vit = (
        f"ViT dim {enc.dim}, depth {len(enc.blocks)}, {heads} heads, {H}x{W} px in {p}x{q} patches "
        f"({(H // p) * (W // q)} + {enc.num_prefix_tokens} tokens), {', '.join(on) or 'pos_embed=none'}, "
        f"pool={enc.pool}"
    )
    if not isinstance(net, Captioner):
        return vit
    dh = net.blocks[0].self_attn.num_heads if len(net.blocks) else 0
    return f"Captioner decoder={net.decoder}, dim {net.dim}, depth {net.depth}, {dh} heads, max_len {net.max_len}, on a {vit}"
