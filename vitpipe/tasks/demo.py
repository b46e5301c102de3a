"""``demo(cfg)``: the body of ``scripts/demo.py``, a Gradio page over the predict path (the page; what it
shows for one image is ``vitpipe.tasks.demo_model``'s).

checkpoint (``ckpt_path`` = file | run dir | last, ``vitpipe.run.paths``) -> network + the run's eval
transform (``vitpipe.data.preprocess.Preprocess``, NaFlex rule included) -> one page:

* an image to drop, paste or pick (examples: images of the data's test split, written as PNG files
  under the run's output folder, when that data is present here);
* the top-k labels (``gr.Label``): ``vitpipe.inference.probs.class_probs`` with the same ``tta`` and the
  same ``calibration.json`` temperature as ``scripts/predict.py``, on the file opened the same way
  (``open_image``), so the page and the CSV give the same probabilities;
* the image as the model sees it beside its attention overlay: attention rollout (Abnar & Zuidema
  2020) or gradient rollout for the predicted class (Chefer et al. 2021), switchable
  (``vitpipe.inference.explain``, drawn by ``vitpipe.viz.overlay``); NaFlex checkpoints: rollout on the
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
import os
import re
import sys
from pathlib import Path

from omegaconf import DictConfig
from PIL import Image
from torch import Tensor

from vitpipe.config.preflight import preflight
from vitpipe.errors import ConfigError
from vitpipe.inference.explain import METHODS, check_method, methods_for
from vitpipe.tasks.demo_model import (  # what the page shows for one image
    DemoModel,
    caption_image,
    label_set_text,
    load_model,
    show,
)

METHOD_TITLES = {"rollout": "attention rollout", "gradient": "gradient rollout (predicted class)"}  # METHODS' names
INSTALL = 'pip install -e ".[serve]"'
# the page's API endpoints (gradio_client: Client(url).predict(handle_file(path), "rollout", api_name="/classify")),
# documented in docs/demo.md: a classifier's page offers /classify, a captioner's /caption, nothing else
API_CLASSIFY, API_CAPTION = "classify", "caption"
# small inputs (8x8 digits) shown as crisp enlarged pixels, filling their panels
CSS = ("#image img, #model-input img, #overlay img {image-rendering: pixelated; object-fit: contain; "
       "width: 100%; height: 100%}")


# --------------------------------------------------------------------------- Gradio


def import_gradio():
    """The ``gradio`` module, with analytics off for anything it reads at import; ConfigError (one line
    with the install command) when it is not installed."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # this process serves the page; no internet
    try:
        import gradio
    except ImportError:
        raise ConfigError(f"the demo page needs Gradio, which is not installed here: {INSTALL}") from None
    return gradio


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
    kind = "captioner" if model.kind.generates else "classifier"
    with gr.Blocks(title="vitpipe demo", analytics_enabled=False) as page:
        gr.Markdown(f"## vitpipe: {model.facts['Data'].split(',')[0]} {kind}\n\n{facts_markdown(model.facts)}",
                    elem_id="facts")
        with gr.Row():
            with gr.Column(scale=1):
                image = gr.Image(type="filepath", image_mode=None, label="image (drop, paste or pick)",
                                 sources=["upload", "clipboard"], height=300, elem_id="image")
                if not model.kind.generates:
                    methods = list(methods_for(model.net, naflex=model.naflex) or METHODS)  # a CNN: hidden
                    method = gr.Radio([(METHOD_TITLES[m], m) for m in methods], label="attention map",
                                      value=check_method(cfg.method) if check_method(cfg.method) in methods
                                      else "rollout", elem_id="method", visible=model.explainable)
                if examples:
                    gr.Examples([[str(p)] for p in examples], inputs=image, label="test split examples",
                                elem_id="examples")
            with gr.Column(scale=2):
                if model.kind.generates:
                    _caption_panels(gr, model, image, style)
                else:
                    _classifier_panels(gr, model, image, method, {**style, "topk": cfg.topk,
                                                                  "head_fusion": cfg.head_fusion,
                                                                  "discard_ratio": cfg.discard_ratio})
    return page


def _classifier_panels(gr, model: DemoModel, image, method, style: dict) -> None:
    multilabel = model.kind.name == "multilabel"  # answered as a label set
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

    preflight(cfg, "demo")  # every option, before Gradio is imported or the checkpoint read
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
