"""``demo(cfg)``: the body of ``scripts/demo.py``, a Gradio page over the predict path.

checkpoint (``ckpt_path`` = file | run dir | last, ``vitpipe.run.paths``) -> network + the run's eval
transform (``vitpipe.data.preprocess.Preprocess``, NaFlex rule included) -> one page:

* an image to drop, paste or pick (examples: images of the data's test split, written as PNG files
  under the run's output folder, when that data is present here);
* the top-k labels (``gr.Label``): ``vitpipe.tasks.predict.class_probs`` with the same ``tta`` and the
  same ``calibration.json`` temperature as ``scripts/predict.py``, on the file opened the same way
  (``open_image``), so the page and the CSV give the same probabilities;
* the image as the model sees it beside its attention overlay: attention rollout (Abnar & Zuidema
  2020) or gradient rollout for the predicted class (Chefer et al. 2021), switchable
  (``vitpipe.viz.rollout``, drawn by ``vitpipe.viz.overlay``); NaFlex checkpoints: rollout on the
  image's own grid;
* the checkpoint's facts: architecture, data, test accuracy (the run's ``metrics.json``, as the
  exported model card reads it).

Multi-label checkpoints (``module.task=multilabel``): the label set predict writes (every class at or
above its threshold: thresholds.json or ``module.threshold``) above the top-k sigmoid scores; gradient
rollout explains the highest-scoring class; the facts give test mAP.

Captioners: the caption ``scripts/predict.py`` writes (the run's decoding settings) and, per generated
word, its cross-attention over the image (``vitpipe.viz.rollout.cross_attention_maps``: mean over decoder
layers and heads) as an overlay, in a gallery. Gradio is imported only here; without it one line says
how to install it. Analytics are off, the server binds ``server_name`` (127.0.0.1 by default).
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from PIL import Image
from torch import Tensor, nn

from vitpipe.data.images import open_image
from vitpipe.data.preprocess import Preprocess
from vitpipe.errors import ConfigError
from vitpipe.report.tta import TTAS
from vitpipe.tasks.predict import (
    Predictor,
    class_probs,
    label_names,
    label_sets,
    load_predictor,
    to_device,
    top_labels,
)
from vitpipe.viz.overlay import overlay, to_numpy_image, unnormalize
from vitpipe.viz.rollout import check_rollout_options, gradient_rollout, naflex_rollout_for_model, rollout_for_model

METHODS = ("rollout", "gradient")
METHOD_TITLES = {"rollout": "attention rollout", "gradient": "gradient rollout (predicted class)"}
INSTALL = 'pip install -e ".[serve]"'
# the page's API endpoints (gradio_client: Client(url).predict(handle_file(path), "rollout", api_name="/classify")),
# documented in docs/demo.md: a classifier's page offers /classify, a captioner's /caption, nothing else
API_CLASSIFY, API_CAPTION = "classify", "caption"
# small inputs (8x8 digits) shown as crisp enlarged pixels, filling their panels
CSS = ("#image img, #model-input img, #overlay img {image-rendering: pixelated; object-fit: contain; "
       "width: 100%; height: 100%}")


@dataclass
class DemoModel:
    """What the page needs from a checkpoint, loaded once: predict's ``Predictor`` and the display facts."""

    loaded: Predictor  # vitpipe.tasks.predict.load_predictor: network, eval transform, tta, temperature
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
    def explainable(self) -> bool:
        """Whether the page can draw an attention map: a vitpipe ViT (a timm CNN has no attention)."""
        from vitpipe.models.vit import ViT

        return isinstance(self.loaded.net.encoder if self.captioner else self.loaded.net, ViT)


    @property
    def preprocess(self) -> Preprocess:
        return self.loaded.preprocess

    @property
    def captioner(self) -> bool:
        return self.loaded.captioner

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


# --------------------------------------------------------------------------- checks


def check_options(cfg: DictConfig) -> None:
    """Everything checkable before Gradio is imported or the checkpoint is read."""
    if cfg.method not in METHODS:
        raise ConfigError(f"method={cfg.method!r} is not valid; choose one of {list(METHODS)}")
    if cfg.tta not in TTAS:
        raise ConfigError(f"tta={cfg.tta!r}; valid choices: {', '.join(TTAS)}")
    check_rollout_options(head_fusion=cfg.head_fusion, discard_ratio=cfg.discard_ratio)
    for key, minimum in (("topk", 1), ("num_examples", 0), ("display_size", 8)):
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ConfigError(f"{key}={v!r}: expected an int >= {minimum}")
    port = cfg.get("port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535):
        raise ConfigError(f"port={port!r}: expected an int in 1..65535, or null for the first free one from 7860")
    if not isinstance(cfg.get("server_name"), str) or not cfg.server_name:
        raise ConfigError(f"server_name={cfg.get('server_name')!r}: expected a host name or address, e.g. 127.0.0.1")
    if not isinstance(cfg.alpha, (int, float)) or not 0.0 <= cfg.alpha <= 1.0:
        raise ConfigError(f"alpha={cfg.alpha!r} is not valid; use a number in [0, 1]")
    from matplotlib import colormaps

    if cfg.cmap not in colormaps:
        raise ConfigError(f"cmap={cfg.cmap!r} is not a matplotlib colormap; e.g. 'jet', 'viridis', 'inferno'")


def import_gradio():
    """The ``gradio`` module, with analytics off for anything it reads at import; ConfigError (one line
    with the install command) when it is not installed."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # this process serves the page; no internet
    try:
        import gradio
    except ImportError:
        raise ConfigError(f"the demo page needs Gradio, which is not installed here: {INSTALL}") from None
    return gradio


# --------------------------------------------------------------------------- the model side


def load_model(cfg: DictConfig) -> DemoModel:
    """The checkpoint ``cfg.ckpt_path`` names, loaded by predict's own ``load_predictor`` (data is never code)."""
    from vitpipe.config.build import resolve_device
    from vitpipe.models.vit import ViT
    from vitpipe.tasks.visualize import data_stats

    device = resolve_device(cfg.device)
    loaded = load_predictor(cfg.ckpt_path, paths=cfg.paths, task_name=cfg.task_name, device=device, tta=cfg.tta)
    encoder = loaded.net.encoder if loaded.captioner else loaded.net
    if not isinstance(encoder, ViT):  # e.g. model=timm (a CNN): its labels, no attention to show
        print(f"vitpipe demo: note: {loaded.path} holds a {type(encoder).__name__}, not a vitpipe ViT: the page "
              "shows its labels without an attention map", file=sys.stderr, flush=True)
    mean, std, channels = data_stats(loaded.built.datamodule, encoder)
    names = [] if loaded.captioner else label_names(loaded.built.class_names, loaded.net.num_classes)
    return DemoModel(loaded=loaded, names=names, device=device, mean=mean, std=std, channels=channels,
                     facts=model_facts(loaded.checkpoint, loaded.net, loaded.path, cfg.tta, loaded.temperature,
                                       thresholds=loaded.thresholds))


def model_facts(checkpoint: dict, net: nn.Module, path: Path, tta: str,
                temperature: float | None = None, thresholds: Tensor | None = None) -> dict[str, str]:
    """Architecture, data, test accuracy and the checkpoint, as lines for the page (the terms of the
    exported model card, ``vitpipe.export.model_card``: its ``run_metrics`` reads the test metrics)."""
    from vitpipe.export.model_card import run_metrics
    from vitpipe.run.paths import run_dir_of

    from vitpipe.models.vit import ViT

    stored = checkpoint.get("vitpipe_config") or {}
    model_cfg, data_cfg = stored.get("model") or {}, stored.get("data") or {}
    captioner = hasattr(net, "generate")
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
    title, key, checkpoint_line = "Test accuracy", "test/acc", f"{path.name} (tta={tta}{calibrated})"
    if thresholds is not None:  # multi-label: a sigmoid per class, a label set per image; no tta, no temperature
        t = thresholds.double()
        at = f"{float(t[0]):g}" if bool((t == t[0]).all()) else f"per class, {float(t.min()):.3g}..{float(t.max()):.3g}"
        data += f", multi-label (a sigmoid per class; labels at score >= {at})"
        title, key, checkpoint_line = "Test mAP", "test/map", path.name
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
    multilabel = model.loaded.multilabel
    with torch.inference_mode():
        probs = class_probs(model.net, x, tta=model.loaded.tta, temperature=model.loaded.temperature,
                            multilabel=multilabel)  # (1, classes)
    probs = probs.cpu()
    if multilabel:
        answer = label_sets(probs, model.names, model.loaded.thresholds, k)[0]
        top, labels = answer["topk"], answer["labels"]
    else:
        top, labels = top_labels(probs, model.names, k)[0], None
    return dict(zip(top["labels"], top["probs"])), int(probs[0].argmax()), labels


def attention_map(model: DemoModel, x, method: str, target: int, *, head_fusion: str = "mean",
                  discard_ratio: float = 0.0) -> Tensor:
    """(h, w) map on the patch grid: attention rollout, or gradient rollout for class ``target``."""
    if method not in METHODS:
        raise ConfigError(f"method={method!r} is not valid; choose one of {list(METHODS)}")
    if model.naflex:
        if method != "rollout":
            raise ConfigError("a NaFlex checkpoint's images have one grid each; the demo draws attention rollout "
                              "for them: choose rollout")
        return naflex_rollout_for_model(model.net, x, head_fusion=head_fusion, discard_ratio=discard_ratio)[0].cpu()
    if method == "gradient":
        return gradient_rollout(model.net, x, target, discard_ratio=discard_ratio)[0].detach().cpu()
    return rollout_for_model(model.net, x, head_fusion=head_fusion, discard_ratio=discard_ratio)[0].cpu()


def display_image(model: DemoModel, x, size: int) -> Tensor:
    """The input as the model sees it, (channels, H, W) in [0, 1], enlarged by the integer factor
    (nearest) that brings its longer side to at least ``size`` pixels: its aspect is kept exactly."""
    if model.naflex:
        from vitpipe.tasks.visualize import naflex_display

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
    """A captioner's page for the file ``path``: predict's decoding (``vitpipe.tasks.predict.captions``: the
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


# --------------------------------------------------------------------------- examples


def split_examples(dm, n: int, folder: Path) -> list[Path]:
    """Up to ``n`` images of the data's test split as PNG files in ``folder`` (one class after another,
    named ``<index>_<class>.png``); [] with one line on stderr when that data is not present here."""
    from vitpipe.data.base import ClassificationDataModule
    from vitpipe.run.files import atomic_write

    if n == 0 or not isinstance(dm, ClassificationDataModule):  # caption data: no examples offered
        return []
    try:
        dm.check()  # files present, or a ConfigError saying how to get them
        split = dm._load("test")  # (PIL image or uint8 (C, H, W) tensor, label) items: the data modules' contract
    except Exception as e:  # noqa: BLE001 - examples are optional: the page works without them
        print(f"vitpipe demo: note: no examples (the test split cannot be read here: {str(e).splitlines()[0]})",
              file=sys.stderr)
        return []
    if split is None or len(split) == 0:
        return []
    names = getattr(dm, "class_names", None)
    picked, seen = [], set()
    for i in range(min(len(split), 50 * n)):  # one image per class first; bounded for big test splits
        image, label = split[i]
        if int(label) not in seen or len(seen) >= (len(names) if names else n):
            seen.add(int(label))
            picked.append((i, image, int(label)))
        if len(picked) >= n:
            break
    written = []
    for i, image, label in picked:
        if isinstance(image, Tensor):  # uint8 (C, H, W)
            array = image.permute(1, 2, 0).numpy()
            image = Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array)
        name = names[label] if names and label < len(names) else str(label)
        path = folder / f"{i:05d}_{re.sub(r'[^A-Za-z0-9_-]+', '_', str(name))}.png"
        atomic_write(path, lambda f, im=image: im.save(f, format="PNG"))
        written.append(path)
    return written


# --------------------------------------------------------------------------- the page


def facts_markdown(facts: dict[str, str]) -> str:
    return "\n".join(f"- **{k}**: {v}" for k, v in facts.items())


def build_page(model: DemoModel, cfg: DictConfig, examples: list[Path]):
    """The Gradio Blocks page; its one callback is ``show`` (classifiers) or ``caption_image`` (captioners)."""
    gr = import_gradio()
    style = dict(alpha=cfg.alpha, cmap=cfg.cmap, display_size=cfg.display_size)
    kind = "captioner" if model.captioner else "classifier"
    with gr.Blocks(title="vitpipe demo", analytics_enabled=False) as page:
        gr.Markdown(f"## vitpipe: {model.facts['Data'].split(',')[0]} {kind}\n\n{facts_markdown(model.facts)}",
                    elem_id="facts")
        with gr.Row():
            with gr.Column(scale=1):
                image = gr.Image(type="filepath", image_mode=None, label="image (drop, paste or pick)",
                                 sources=["upload", "clipboard"], height=300, elem_id="image")
                if not model.captioner:
                    methods = ["rollout"] if model.naflex else list(METHODS)
                    method = gr.Radio([(METHOD_TITLES[m], m) for m in methods], label="attention map",
                                      value=cfg.method if cfg.method in methods else "rollout", elem_id="method",
                                      visible=model.explainable)
                if examples:
                    gr.Examples([[str(p)] for p in examples], inputs=image, label="test split examples",
                                elem_id="examples")
            with gr.Column(scale=2):
                if model.captioner:
                    _caption_panels(gr, model, image, style)
                else:
                    _classifier_panels(gr, model, image, method, {**style, "topk": cfg.topk,
                                                                  "head_fusion": cfg.head_fusion,
                                                                  "discard_ratio": cfg.discard_ratio})
    return page


def _classifier_panels(gr, model: DemoModel, image, method, style: dict) -> None:
    multilabel = model.loaded.multilabel
    if multilabel:  # the label set first; the top-k bars are sigmoid scores, each in [0, 1] on its own
        label_set = gr.Textbox(label="labels (score >= the class's threshold)", interactive=False, elem_id="label-set")
    label = gr.Label(num_top_classes=style["topk"], elem_id="topk",
                     label=f"top-{style['topk']} sigmoid scores" if multilabel else f"top-{style['topk']}")
    with gr.Row():
        model_view = gr.Image(label="model input", type="numpy", format="png", interactive=False, height=300,
                              elem_id="model-input")
        overlay_view = gr.Image(label="attention overlay", type="numpy", format="png", interactive=False,
                                height=300, elem_id="overlay", visible=model.explainable)  # a CNN: none

    def on_image(image, method):  # the names a client passes them by (docs/demo.md)
        if not image:
            return (None,) * (4 if multilabel else 3)
        shown = _on_page(gr, lambda: show(model, image, method, **style))
        answer = (shown.probs, shown.display, shown.overlay)
        return (label_set_text(shown.labels, shown.probs), *answer) if multilabel else answer

    outputs = [label_set, label, model_view, overlay_view] if multilabel else [label, model_view, overlay_view]
    # one endpoint for both triggers, under a name clients call (Gradio would expose /on_image and /on_image_1)
    gr.on([image.change, method.change], on_image, inputs=[image, method], outputs=outputs, api_name=API_CLASSIFY)


def _caption_panels(gr, model: DemoModel, image, style: dict) -> None:
    caption = gr.Textbox(label="caption", interactive=False, elem_id="caption")
    with gr.Row():
        model_view = gr.Image(label="model input", type="numpy", format="png", interactive=False, height=300,
                              elem_id="model-input", scale=1)
        words = gr.Gallery(label="cross-attention per generated word", columns=5, height=420, object_fit="contain",
                           elem_id="words", scale=2)

    def on_image(image):
        if not image:
            return None, None, None
        shown = _on_page(gr, lambda: caption_image(model, image, **style))
        return shown.caption, shown.display, list(zip(shown.overlays, shown.words))

    image.change(on_image, inputs=[image], outputs=[caption, model_view, words], api_name=API_CAPTION)


def _on_page(gr, compute):
    """``compute()``, its one-line errors shown on the page (``gr.Error``) instead of a traceback."""
    try:
        return compute()
    except ConfigError as e:
        raise gr.Error(str(e)) from None
    except (OSError, ValueError) as e:  # a file PIL cannot decode
        raise gr.Error(f"cannot read that file as an image: {str(e).splitlines()[0]}") from None


def demo(cfg: DictConfig) -> None:
    """Serve the page for ``cfg.ckpt_path`` until interrupted."""
    from vitpipe.run.info import output_dir

    check_options(cfg)
    import_gradio()  # before the checkpoint is read: a missing install costs nothing
    model = load_model(cfg)
    folder = output_dir(cfg) / "examples"
    examples = split_examples(model.loaded.built.datamodule, cfg.num_examples, folder)
    page = build_page(model, cfg, examples)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Gradio's own startup requests to itself, not news
    page.queue(default_concurrency_limit=1)  # one model, one image at a time
    try:
        _, url, _ = page.launch(server_name=cfg.server_name, server_port=cfg.port, share=False, inbrowser=False,
                                prevent_thread_lock=True, show_error=True, ssr_mode=False, quiet=True, css=CSS,
                                allowed_paths=[str(folder)] if examples else None)
    except OSError as e:  # the port is taken ("Cannot find empty port"), or the address is not this machine's
        why = str(e).splitlines()[0]
        raise ConfigError(f"server_name={cfg.server_name} port={cfg.port}: cannot serve there ({why}); "
                          "pass another port=, or port=null for the first free one") from None
    print(f"vitpipe demo: {url} ({model.facts['Checkpoint']}; {len(examples)} example(s); Ctrl-C stops)", flush=True)
    try:
        page.block_thread()  # until Ctrl-C (Gradio closes the server; exit status 0); SIGTERM ends it as it is
    finally:
        page.close(verbose=False)
    print("vitpipe demo: stopped", flush=True)
