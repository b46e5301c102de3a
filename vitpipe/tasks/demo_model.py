"""What the demo page shows for one image file, without Gradio: a checkpoint loaded by predict's own
``load_predictor`` (``DemoModel``, with the facts the page lists), the top-k labels (``class_probs``, the
label set for a multi-label run), the attention overlay (``vitpipe.inference.explain``) and a captioner's
caption with one cross-attention overlay per word."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor, nn

from vitpipe.data.images import open_image
from vitpipe.data.preprocess import Preprocess
from vitpipe.inference.explain import explain
from vitpipe.inference.images import to_device
from vitpipe.inference.labels import label_names, label_sets, top_labels
from vitpipe.inference.load import Predictor, load_predictor
from vitpipe.inference.probs import class_probs
from vitpipe.kinds import TaskKind
from vitpipe.viz.inputs import data_stats, naflex_display
from vitpipe.viz.overlay import overlay, to_numpy_image, unnormalize


@dataclass
class DemoModel:
    """What the page needs from a checkpoint, loaded once: predict's ``Predictor`` and the display facts."""

    loaded: Predictor  # vitpipe.inference.load.load_predictor: network, eval transform, tta, temperature
    names: list[str]  # label index -> name ([] for a captioner)
    device: torch.device
    mean: tuple[float, ...]  # display: the data's statistics, ``channels`` of them
    std: tuple[float, ...]
    channels: int
    facts: dict[str, str] = field(default_factory=dict)

    @property
    def net(self) -> nn.Module:
        return self.loaded.net

    @property
    def kind(self) -> TaskKind:
        """The run's task kind (``vitpipe.kinds``), chosen once when the checkpoint loaded."""
        return self.loaded.kind

    @property
    def explainable(self) -> bool:
        """Whether the page can draw an attention map: a vitpipe ViT (a timm CNN has no attention)."""
        from vitpipe.models.vit import ViT

        return isinstance(self.loaded.net.encoder if self.kind.generates else self.loaded.net, ViT)

    @property
    def preprocess(self) -> Preprocess:
        return self.loaded.preprocess

    @property
    def naflex(self) -> bool:
        return self.preprocess.max_seq_len is not None


@dataclass
class Shown:
    """One image on the page: top-k ``{label: probability}``, the model's input and its overlay."""

    probs: dict[str, float]  # the k most probable classes, most probable first (multi-label: sigmoid scores)
    display: np.ndarray  # (H, W, 3) uint8: the input as the model sees it, enlarged by an integer factor
    overlay: np.ndarray  # (H, W, 3) uint8: the same size, the attention map blended over it
    attention: Tensor | None  # (h, w) the map on the patch grid; None for a network without attention (timm CNN)
    labels: list[str] | None = None  # multi-label: every class at or above its threshold, most probable first


@dataclass
class Captioned:
    """One image on a captioner's page: the caption, and per generated word its cross-attention overlay."""

    caption: str  # as scripts/predict.py writes it (the run's decoding settings)
    words: list[str]  # the caption's words, in order
    display: np.ndarray  # (H, W, 3) uint8, as in ``Shown``
    overlays: list[np.ndarray]  # one (H, W, 3) uint8 overlay per word
    attention: Tensor  # (words, h, w): each word's cross-attention over the image tokens, mean over layers and heads




def load_model(cfg: DictConfig) -> DemoModel:
    """The checkpoint ``cfg.ckpt_path`` names, loaded by predict's own ``load_predictor`` (data is never code)."""
    from vitpipe.config.build import resolve_device
    from vitpipe.models.vit import ViT

    device = resolve_device(cfg.device)
    loaded = load_predictor(cfg.ckpt_path, paths=cfg.paths, task_name=cfg.task_name, device=device, tta=cfg.tta)
    encoder = loaded.net.encoder if loaded.kind.generates else loaded.net
    if not isinstance(encoder, ViT):  # e.g. model=timm (a CNN): its labels, no attention to show
        print(f"vitpipe demo: note: {loaded.path} holds a {type(encoder).__name__}, not a vitpipe ViT: the page "
              "shows its labels without an attention map", file=sys.stderr, flush=True)
    mean, std, channels = data_stats(loaded.built.datamodule, encoder)
    names = label_names(loaded.built.class_names, loaded.net.num_classes) if loaded.kind.classifies else []
    return DemoModel(loaded=loaded, names=names, device=device, mean=mean, std=std, channels=channels,
                     facts=model_facts(loaded.checkpoint, loaded.net, loaded.path, cfg.tta, loaded.temperature,
                                       thresholds=loaded.thresholds, kind=loaded.kind))


# per classifier kind (``kind.name``): the facts' test score line (its title, the metrics.json key)
SCORES = {"multiclass": ("Test accuracy", "test/acc"), "multilabel": ("Test mAP", "test/map")}


def model_facts(checkpoint: dict, net: nn.Module, path: Path, tta: str, temperature: float | None = None,
                thresholds: Tensor | None = None, *, kind: TaskKind) -> dict[str, str]:
    """Architecture, data, test score and the checkpoint, as lines for the page (the terms of the
    exported model card, ``vitpipe.export.model_card``: its ``run_metrics`` reads the test metrics)."""
    from vitpipe.export.model_card import run_metrics
    from vitpipe.models.vit import ViT
    from vitpipe.run.paths import run_dir_of
    from vitpipe.run.stored import config_of

    stored = config_of(checkpoint) or {}
    model_cfg, data_cfg = stored.get("model") or {}, stored.get("data") or {}
    captioner = kind.generates
    vit = net.encoder if captioner else net
    params = sum(p.numel() for p in net.parameters())
    name = (model_cfg.get("encoder") or {}).get("name", "?") if captioner else model_cfg.get("name", "?")
    if isinstance(vit, ViT):
        (p, q), (h, w) = vit.patch_size, vit.img_size
        encoder = (f"ViT {name}: dim {vit.dim}, depth {len(vit.blocks)}, heads {vit.blocks[0].attn.num_heads}, "
                   f"patch {p}x{q} on {h}x{w}, pos_embed {_pos(model_cfg, captioner)}")
    else:  # model=timm: any timm network
        encoder = f"timm {name} ({type(vit).__name__}; no attention map)"
    data = str(data_cfg.get("_target_", "?")).rsplit(".", 1)[-1].removesuffix("DataModule")
    metrics = run_metrics(run_dir_of(path))
    calibrated = f", calibration temperature {temperature:g}" if temperature else ""
    if captioner:
        scores = ", ".join(f"{k.removeprefix('test/')} {v:.4f}" for k, v in sorted(metrics.items()) if k != "test/loss")
        return {
            "Architecture": (f"captioner: {encoder}; a {net.decoder} text decoder (dim {net.dim}, depth {net.depth}, "
                             f"{net.vocab_size} words); {params / 1e6:.3f} M parameters"),
            "Data": data,
            "Test scores": (f"{scores} (the run's metrics.json)" if scores
                            else "not recorded (no test metrics in a metrics.json beside the checkpoint's run)"),
            "Checkpoint": f"{path.name} (decoding as the run validated: the captions scripts/predict.py writes)",
        }
    data = f"{data}, {net.num_classes} classes"
    title, key = SCORES[kind.name]
    checkpoint_line = f"{path.name} (tta={tta}{calibrated})"
    if thresholds is not None:  # multi-label: a sigmoid per class, a label set per image; no tta, no temperature
        t = thresholds.double()
        at = f"{float(t[0]):g}" if bool((t == t[0]).all()) else f"per class, {float(t.min()):.3g}..{float(t.max()):.3g}"
        data += f", multi-label (a sigmoid per class; labels at score >= {at})"
        checkpoint_line = path.name
    score = metrics.get(key)
    return {
        "Architecture": f"{encoder}{_pool(net)}; {params / 1e6:.3f} M parameters",
        "Data": data,
        title: (f"{score:.4f} ({key} of the run's metrics.json)" if score is not None
                else f"not recorded (no {key} in a metrics.json beside the checkpoint's run)"),
        "Checkpoint": checkpoint_line,
    }


def _pool(net: nn.Module) -> str:
    pool = getattr(net, "pool", None)
    return f", pool {pool}" if isinstance(pool, str) else ""


def _pos(model_cfg: dict, captioner: bool) -> str:
    node = (model_cfg.get("encoder") or {}) if captioner else model_cfg
    return str(node.get("pos_embed", "?"))


def model_input(model: DemoModel, path) -> Tensor | dict:
    """The batch of one file, built exactly as ``scripts/predict.py`` builds it: (1, C, H, W) or a patch dict."""
    x = model.preprocess(open_image(Path(path), model.preprocess.spec.mode))
    return to_device(model.preprocess.collate([x]), model.device)


def top_k(model: DemoModel, x, k: int) -> tuple[dict[str, float], int, list[str] | None]:
    """``({label: probability}`` of the ``k`` most probable classes, the top class index, the label set)``:
    predict's probabilities (``class_probs``: TTA, then the calibration temperature, then softmax) and
    ranking. Multi-label checkpoints: predict's sigmoid scores, and the label set (every class at or
    above its threshold, ``label_sets``); None for single-label ones."""
    with torch.inference_mode():
        probs = class_probs(model.net, x, kind=model.kind, tta=model.loaded.tta,
                            temperature=model.loaded.temperature).cpu()  # (1, classes)
    top, labels = ANSWERS[model.kind.name](probs, model.names, model.loaded.thresholds, k)
    return dict(zip(top["labels"], top["probs"])), int(probs[0].argmax()), labels


def _label_set(probs: Tensor, names: list[str], thresholds: Tensor, k: int) -> tuple[dict, list[str]]:
    answer = label_sets(probs, names, thresholds, k)[0]
    return answer["topk"], answer["labels"]


# per classifier kind (``kind.name``): (the top-k ``{"labels", "probs"}``, the label set or None) of one image
ANSWERS = {"multiclass": lambda probs, names, thresholds, k: (top_labels(probs, names, k)[0], None),
           "multilabel": _label_set}


def attention_map(model: DemoModel, x, method: str, target: int, *, head_fusion: str = "mean",
                  discard_ratio: float = 0.0) -> Tensor:
    """(h, w) map on the patch grid of the batch of one ``x``: attention rollout, or gradient rollout for
    class ``target`` (``vitpipe.inference.explain``; NaFlex: rollout on the image's own grid)."""
    return explain(model.net, x, method, target=target, head_fusion=head_fusion, discard_ratio=discard_ratio)[0].cpu()


def display_image(model: DemoModel, x, size: int) -> Tensor:
    """The input as the model sees it, (channels, H, W) in [0, 1], enlarged by the integer factor
    (nearest) that brings its longer side to at least ``size`` pixels: its aspect is kept exactly."""
    if model.naflex:
        valid = x["patch_valid"][0].bool()  # a batch of one: no padding, but the rule is the rule
        item = {k: x[k][0][valid].cpu() for k in ("patches", "patch_coord")}  # (n, p*q*C), (n, 2) row-major
        image = naflex_display(item, model.net.patch_size, model.mean, model.std, model.channels)
    else:
        image = unnormalize(x[0, : model.channels].float().cpu(), model.mean, model.std)  # (channels, H, W)
    factor = max(1, math.ceil(size / max(image.shape[-2:])))
    return F.interpolate(image[None], scale_factor=factor, mode="nearest")[0] if factor > 1 else image


def show(model: DemoModel, path, method: str, *, topk: int = 5, head_fusion: str = "mean",
         discard_ratio: float = 0.0, alpha: float = 0.5, cmap: str = "jet", display_size: int = 256) -> Shown:
    """Everything the page shows for the image file ``path`` (the page's function, without Gradio)."""
    x = model_input(model, path)
    probs, top, labels = top_k(model, x, topk)
    display = display_image(model, x, display_size)
    if not model.explainable:  # a timm CNN: the labels, and the input where the overlay would be
        image = _uint8(to_numpy_image(display))
        return Shown(probs=probs, display=image, overlay=image, attention=None, labels=labels)
    attention = attention_map(model, x, method, top, head_fusion=head_fusion, discard_ratio=discard_ratio)
    blended = overlay(display, attention, alpha=alpha, cmap=cmap)  # (H, W, 3) in [0, 1]
    return Shown(probs=probs, display=_uint8(to_numpy_image(display)), overlay=_uint8(blended), attention=attention,
                 labels=labels)


def label_set_text(labels: list[str] | None, probs: dict[str, float]) -> str:
    """The page's line for a multi-label answer: the label set (with the scores shown in the top-k)."""
    if not labels:
        return "no class at or above its threshold"
    return ", ".join(f"{n} ({probs[n]:.1%})" if n in probs else n for n in labels)


def caption_image(model: DemoModel, path, *, alpha: float = 0.5, cmap: str = "jet",
                  display_size: int = 256) -> Captioned:
    """A captioner's page for the file ``path``: predict's decoding (``vitpipe.inference.load.captions``: the
    run's beam size, length penalty, max length) asked for its cross-attention, one map per word kept."""
    from vitpipe.viz.rollout import cross_attention_maps

    x = model_input(model, path)
    hp, tokenizer = model.loaded.built.module.hparams, model.loaded.built.module.tokenizer
    with torch.inference_mode():
        ids, attn = model.net.generate(x, max_len=hp.max_gen_len, beam_size=hp.beam_size,
                                       length_penalty=hp.length_penalty, return_cross_attn=True)
    maps = cross_attention_maps(attn, tuple(model.net.grid_size),
                                num_prefix_tokens=model.net.num_prefix_tokens)[0].cpu()  # (T, h, w)
    words, keep = [], []
    for t, i in enumerate(ids[0].tolist()):
        if i == tokenizer.eos_id:
            break
        word = tokenizer.decode([i])  # "" for the specials the caption drops
        if word:
            words.append(word)
            keep.append(t)
    display = display_image(model, x, display_size)
    overlays = [_uint8(overlay(display, maps[t], alpha=alpha, cmap=cmap)) for t in keep]
    return Captioned(caption=tokenizer.batch_decode(ids)[0], words=words, display=_uint8(to_numpy_image(display)),
                     overlays=overlays, attention=maps[keep])


def _uint8(image: np.ndarray) -> np.ndarray:
    return (np.clip(image, 0.0, 1.0) * 255.0).round().astype(np.uint8)
