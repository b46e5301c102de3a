"""LoRA adapters on a network's linear layers (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
Models"), through Hugging Face ``peft``, and their merge back into plain weights.

An adapted linear layer computes ``W x + (alpha / r) * B A x`` with ``W`` frozen, ``A`` (r, in) and ``B``
(out, r) trained, ``B`` zero at the start (the adapted network starts equal to the pretrained one). Which
layers: ``targets``, the last names of the linear layers outside the head (vitpipe's ViT and timm's
VisionTransformer: ``qkv``, ``proj``, ``fc1``, ``fc2``); by default the attention's ``qkv`` and the MLP's
``fc1``/``fc2``. The head is not adapted: it trains in full, as peft's ``modules_to_save`` would have it,
but left outside peft so its keys stay ``head.weight``/``head.bias``.

Stored form. ``peft.inject_adapter_in_model`` replaces each target in place (the network keeps its class),
so a training checkpoint holds ``<layer>.base_layer.weight`` and ``<layer>.lora_A.default.weight`` /
``lora_B``: a resume restores the adapters and their optimizer state exactly. A run is rebuilt for inference
(eval, predict, serve, export, visualize) with its adapters, then ``merge_lora`` folds ``(alpha / r) B A``
into ``W`` and puts the plain ``nn.Linear`` back: from there on it is an ordinary network, the same keys as a
full fine-tuning run's, which timm and ONNX export as any other. ``merge_lora_state_dict`` does the same on
a state dict (``model.pretrained=<a LoRA run>``).

``peft`` is imported only when a network is adapted or merged: the rest of vitpipe runs without it.
"""

from __future__ import annotations

from torch import Tensor, nn

from vitpipe.errors import ConfigError

LORA_TARGETS = ("qkv", "fc1", "fc2")
DEFAULTS = {"r": 16, "alpha": 16, "dropout": 0.0, "targets": list(LORA_TARGETS)}
ADAPTER = "default"  # peft's adapter name: part of the stored keys (lora_A.default.weight)


def lora_settings(lora: dict | None) -> dict:
    """``module.lora`` with the defaults filled in and checked; ConfigError (one line) for a bad value."""
    given = dict(lora or {})
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"module.lora.{unknown[0]} is not a LoRA setting; valid: {', '.join(DEFAULTS)}")
    s = {**DEFAULTS, **given}
    r, alpha, dropout, targets = s["r"], s["alpha"], s["dropout"], s["targets"]
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise ConfigError(f"module.lora.r={r!r} must be a positive integer (the adapters' rank), e.g. 16")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ConfigError(f"module.lora.alpha={alpha!r} must be a number > 0 (the adapters scale by alpha / r)")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ConfigError(f"module.lora.dropout={dropout!r} must be in [0, 1)")
    if isinstance(targets, str):
        targets = [targets]
    if not targets or not all(isinstance(t, str) for t in targets):
        raise ConfigError(f"module.lora.targets={targets!r}: a list of linear layer names, e.g. "
                          f"[{', '.join(LORA_TARGETS)}]")
    return {"r": r, "alpha": alpha, "dropout": float(dropout), "targets": list(targets)}


def _head_modules(net: nn.Module) -> set[int]:
    head = net.get_classifier() if hasattr(net, "get_classifier") else getattr(net, "head", None)
    return {id(m) for m in head.modules()} if isinstance(head, nn.Module) else set()


def adaptable_layers(net: nn.Module) -> dict[str, list[str]]:
    """``{last name: [full module names]}`` of the ``nn.Linear`` layers outside the head."""
    head = _head_modules(net)
    found: dict[str, list[str]] = {}
    for name, m in net.named_modules():
        if type(m) is nn.Linear and id(m) not in head:
            found.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    return found


def add_lora(net: nn.Module, lora: dict | None = None) -> nn.Module:
    """Adapt ``net`` in place (returned): LoRA on the ``targets`` layers, every other parameter frozen but the
    head's (``get_classifier()``). ConfigError (one line) for a target the network does not have."""
    s = lora_settings(lora)
    layers = adaptable_layers(net)
    unknown = [t for t in s["targets"] if t not in layers]
    if unknown:
        what = "the head trains in full, it takes no adapter" if set(unknown) <= {"head", "head_dist"} else \
            f"{type(net).__name__} has no linear layer of that name outside its head"
        raise ConfigError(f"module.lora.targets: {unknown[0]!r}: {what}; valid: {', '.join(sorted(layers))}")
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise ConfigError("module.finetune=lora needs Hugging Face peft: pip install 'peft>=0.7'") from None
    # full module names: a last name alone would also catch a Conv2d of that name (patch_embed.proj)
    names = [n for t in s["targets"] for n in layers[t]]
    config = LoraConfig(r=s["r"], lora_alpha=s["alpha"], lora_dropout=s["dropout"], target_modules=names,
                        bias="none")
    inject_adapter_in_model(config, net, adapter_name=ADAPTER)  # freezes all but the adapters
    head = _head_modules(net)
    for m in net.modules():
        if id(m) in head:
            m.requires_grad_(True)
    return net


def has_lora(net: nn.Module) -> bool:
    return any(hasattr(m, "lora_A") and hasattr(m, "base_layer") for m in net.modules())


def merge_lora(net: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (``W + (alpha / r) B A``) and put the plain layer back, in
    place; ``net`` returned, every parameter trainable as in any rebuilt network. A network without
    adapters comes back unchanged."""
    if not has_lora(net):
        return net
    for name, m in list(net.named_modules()):
        if hasattr(m, "lora_A") and hasattr(m, "base_layer"):
            m.merge(safe_merge=True)  # safe: refuses a merge that would write NaN/inf into the weights
            parent, _, leaf = name.rpartition(".")
            setattr(net.get_submodule(parent) if parent else net, leaf, m.get_base_layer())
    return net.requires_grad_(True)


def merge_lora_state_dict(sd: dict[str, Tensor], alpha: float | None) -> dict[str, Tensor]:
    """A state dict with adapters (``<layer>.base_layer.*``, ``<layer>.lora_A/B.default.weight``) as the
    merged network's: ``<layer>.weight = W + (alpha / r) B A``. Without adapters, ``sd`` itself."""
    suffix_a = f".lora_A.{ADAPTER}.weight"
    layers = [k[: -len(suffix_a)] for k in sd if k.endswith(suffix_a)]
    if not layers:
        return sd
    if alpha is None:
        raise ConfigError("these weights hold LoRA adapters but no module.lora.alpha to merge them with; pass the "
                          "LoRA run's checkpoint (.ckpt), which stores its config")
    out = {k: v for k, v in sd.items() if ".lora_" not in k and ".base_layer." not in k}
    for layer in layers:
        a, b = sd[layer + suffix_a], sd[f"{layer}.lora_B.{ADAPTER}.weight"]  # (r, in), (out, r)
        w = sd[f"{layer}.base_layer.weight"]
        out[f"{layer}.weight"] = (w.float() + (b.float() @ a.float()) * (alpha / a.shape[0])).to(w.dtype)
        if f"{layer}.base_layer.bias" in sd:
            out[f"{layer}.bias"] = sd[f"{layer}.base_layer.bias"]
    return out
