"""Weights into a vitpipe ViT: ``load_pretrained`` from a file (safetensors, a plain state_dict, a vitpipe
checkpoint, an MAE checkpoint) or a timm hub name (offline from the Hugging Face cache where it holds the
files), with positions resampled to the model's grid and a head of another class count left fresh; and
``mismatch_summary``, the one sentence every loader uses for weights that do not fit.

Files are read with safetensors or ``torch.load(weights_only=True)`` behind the archive-size bound of
``vitpipe.run.safeload``: loading never executes pickled code. Converting between timm's modules and
vitpipe's is ``vitpipe.models.timm_compat``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor, nn

from vitpipe.errors import ConfigError
from vitpipe.models.hub import cached_or_reachable, offline_weights_message
from vitpipe.models.lora import merge_lora_state_dict
from vitpipe.models.timm_compat import timm_to_vitpipe
from vitpipe.models.vit import ViT
from vitpipe.nn.pos_embed import LearnedPosEmbed, resample_grid
from vitpipe.run.safeload import safe_torch_load

log = logging.getLogger(__name__)
WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """Tensors of a weight file: safetensors, a plain state_dict, or a vitpipe Lightning
    checkpoint (``state_dict`` with ``net.`` keys). Never unpickles arbitrary objects."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"weights file {str(path)!r} does not exist; pass an existing .safetensors/.pth/.ckpt path")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        obj = safe_torch_load(path, what="weights file")  # sizes bounded before anything inflates
    except ConfigError:
        raise
    except Exception as e:  # corrupt file, or a pickle that needs code to run
        raise ConfigError(f"cannot read weights file {str(path)!r}: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    stored = obj.get("vitpipe_config") if isinstance(obj, dict) else None  # a vitpipe checkpoint's run config
    for key in ("state_dict", "model", "module"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise ConfigError(f"weights file {str(path)!r} holds no state_dict of tensors")
    if any(k.startswith("net.") for k in obj):  # a vitpipe Lightning checkpoint
        obj = {k[4:]: v for k, v in obj.items() if k.startswith("net.")}
    # a module.finetune=lora run: its adapters merged into plain weights with the run's alpha
    lora = ((stored or {}).get("module") or {}).get("lora") if isinstance(stored, dict) else None
    return merge_lora_state_dict(obj, lora.get("alpha") if isinstance(lora, dict) else None)


def _timm_hub_state_dict(name: str) -> tuple[dict[str, Tensor], int]:
    import timm

    if not timm.is_model(name.split(".")[0]):
        raise ConfigError(f"pretrained={name!r} is neither an existing weights file nor a timm model name")
    hub = _timm_hub_files(name)
    try:  # where the cache holds the weights, timm reads that file and does not ask the Hub first
        cached = cached_or_reachable(name, *hub) if hub else None
        tm = timm.create_model(name, pretrained=True, pretrained_cfg_overlay={"file": cached} if cached else None)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(offline_weights_message(name, hub[0] if hub else f"timm/{name}", type(e).__name__)) from e
    return tm.state_dict(), (0 if tm.no_embed_class else tm.num_prefix_tokens)


def _timm_hub_files(name: str) -> tuple[str, str | None, list[str]] | None:
    """(repository, revision, files in timm's order) of timm model ``name``'s Hugging Face weights; None
    where timm does not download them from the Hub (a url, or a file timm was already told about)."""
    from timm.models import get_pretrained_cfg
    from timm.models._hub import _get_safe_alternatives, hf_split

    cfg = get_pretrained_cfg(name)
    if cfg is None or not cfg.hf_hub_id or cfg.file or cfg.state_dict or cfg.source not in (None, "", "hf-hub"):
        return None
    # timm's private helpers on purpose: its revision syntax (repo@rev) and its file order (safetensors
    # first) have no public API, and the cache must be asked for exactly what timm would download
    repo, revision = hf_split(cfg.hf_hub_id)
    wanted = cfg.hf_hub_filename or "pytorch_model.bin"
    return repo, revision, [*_get_safe_alternatives(wanted), wanted]


def load_pretrained(model: ViT, source: str | Path, *, head: bool = True) -> ViT:
    """Load weights from a file or a timm model name into ``model``, adapting positions and head.

    A file may also hold an MAE (a vitpipe MAE checkpoint with ``net.*`` keys, a bare
    ``MaskedAutoencoderViT`` state dict, a facebookresearch/mae ``.pth``): its encoder loads, its
    decoder is dropped. One log line says how many tensors loaded and which of the model's are new.

    head=False keeps this model's fresh head even when the class counts agree (transfer to other
    classes: a source head's class k means something else)."""
    src = str(source)
    if src.endswith(WEIGHT_SUFFIXES) or Path(src).exists():
        sd, decoder = split_mae_decoder(read_state_dict(src))
        prefix_rows = _prefix_rows(sd, model)
    else:
        (sd, prefix_rows), decoder = _timm_hub_state_dict(src), {}
    sd = timm_to_vitpipe(sd, num_prefix_tokens=prefix_rows, model=model)

    if "pos_embed.weight" in sd:
        if isinstance(model.pos_embed, LearnedPosEmbed):
            pe, P = sd["pos_embed.weight"], model.num_prefix_tokens
            old = _grid_of(pe.shape[1] - P, model)
            sd["pos_embed.weight"] = torch.cat([pe[:, :P], resample_grid(pe[:, P:], old, model.grid_size)], dim=1)
        else:
            log.warning("pretrained: source has a learned position table; this model's pos_embed is %s, table dropped",
                        type(model.pos_embed).__name__)
            sd.pop("pos_embed.weight")
    fresh = ("head.",)
    if decoder and isinstance(model.norm, nn.Identity) and not any(k.startswith("fc_norm.") for k in sd):
        # a mean-pool classifier from an MAE: the encoder's token norm goes, fc_norm (after pooling) starts
        # fresh, as in the MAE paper's fine-tuning with global pooling (main_finetune.py, global_pool)
        sd = {k: v for k, v in sd.items() if not k.startswith("norm.")}
        fresh = ("head.", "fc_norm.")
    head_keys = {k for k in sd if k.startswith("head.")}
    own = model.state_dict()
    if not head or any(k in own and sd[k].shape != own[k].shape for k in head_keys) or not model.num_classes:
        log.info("pretrained: head left freshly initialised (%s)", "pretrained_head=false" if not head else
                 "class count differs")
        for k in head_keys:
            sd.pop(k)
    bad = {k: (sd[k].shape, s.shape) for k, s in own.items() if k in sd and sd[k].shape != s.shape}  # model order
    missing, unexpected = model.load_state_dict({k: v for k, v in sd.items() if k not in bad}, strict=False)
    missing = [k for k in missing if not k.startswith(fresh) and k not in bad]
    name = Path(src).name if Path(src).is_file() else src  # the user named it: the name says which
    if bad or missing or unexpected:
        what = mismatch_summary(bad, missing, unexpected, "file", keys=0 if bad else 3)
        hint = ("build the classifier from the MAE's encoder (ViT(**mae.encoder_kwargs(), num_classes=...): "
                "the same dimensions and pos_embed)") if decoder else "use their model variant"
        raise ConfigError(f"weights {name!r} do not fit this model: {what}; {hint}")
    new = [k for k in own if k not in sd]
    log.info("pretrained: %s tensors loaded from %s%s; new: %s", len(sd), name,
             f" (an MAE: its decoder's {len(decoder)} tensors dropped)" if decoder else "",
             ", ".join(new) or "nothing")
    return model


MAE_DECODER_PREFIXES = ("decoder_", "mask_token")


def split_mae_decoder(sd: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(encoder, decoder) parts of a state dict: an MAE's decoder (``decoder_*``, ``mask_token``; vitpipe's
    ``MaskedAutoencoderViT`` or facebookresearch/mae's) is what a classifier does not have. A ViT's state
    dict has none of these keys: it comes back whole, with an empty decoder."""
    decoder = {k: v for k, v in sd.items() if k.startswith(MAE_DECODER_PREFIXES)}
    return {k: v for k, v in sd.items() if k not in decoder}, decoder


def mismatch_summary(wrong: dict[str, tuple], missing: list[str], unexpected: list[str], source: str, *,
                     shapes: int = 3, keys: int = 3) -> str:
    """What keeps weights from loading, as one clause short enough to read: the count of each kind of
    problem, the first ``shapes`` mismatches and the first ``keys`` missing and unexpected keys (0: counts only).
    ``wrong`` maps a key to (its shape in ``source``, its shape in the model)."""

    def listed(items: list[str], n: int) -> str:
        return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")

    def shape(s) -> str:
        return str(tuple(s)).replace(" ", "")

    parts = []
    if wrong:
        plural = "es" if len(wrong) > 1 else ""
        pairs = [f"{k} {shape(a)} vs {shape(b)}" for k, (a, b) in wrong.items()]
        parts.append(f"{len(wrong)} shape mismatch{plural} ({source} vs model): {listed(pairs, shapes)}")
    for what, names in (("missing", list(missing)), ("unexpected", list(unexpected))):
        if names:
            count = f"{len(names)} {what} key{'s' if len(names) > 1 else ''}"
            parts.append(f"{count}: {listed(names, keys)}" if keys else count)
    return "; ".join(parts)


def _prefix_rows(sd: dict[str, Tensor], model: ViT) -> int:
    """How many prefix-token rows a file's position table carries (timm files: 0 or P)."""
    pe = sd.get("pos_embed", sd.get("pos_embed.weight"))
    if pe is None:
        return model.num_prefix_tokens
    n = pe.shape[1]
    return model.num_prefix_tokens if _is_grid(n - model.num_prefix_tokens, model) else 0


def _is_grid(n: int, model: ViT) -> bool:
    try:
        _grid_of(n, model)
        return True
    except ConfigError:
        return False


def _grid_of(n: int, model: ViT) -> tuple[int, int]:
    """The grid a stored table of ``n`` patch rows was trained on: this model's grid, or a square."""
    h, w = model.grid_size
    if n == h * w:
        return h, w
    side = round(n**0.5)
    if side * side == n:
        return side, side
    raise ConfigError(f"position table with {n} patch rows matches neither the grid {h}x{w} nor a square grid")
