"""``visualize(cfg) -> written paths``: the testable body of ``scripts/visualize_attention.py``, the command
(options -> images -> maps -> figures); the images it reads are ``vitpipe.viz.inputs``', the maps
``vitpipe.inference.explain``'s, the overlays ``vitpipe.viz.overlay``'s.

checkpoint -> network (+ data module) -> images (a folder, or the val/test split) -> maps -> PNGs:

    <out>/<kind>/<NNN_name>.png   one figure per image: the input, then its overlay(s)
    <out>/<kind>_grid.png         every image's overlay in one figure

Classifiers: kind ``rollout`` (Abnar & Zuidema 2020), ``gradient`` (Chefer et al. 2021, for the
predicted class, or the class ``target=`` names, e.g. one label of a multi-label model) and ``heads``
(each head of the last layer, the class token's row). Captioners:
kind ``caption`` (the generated caption, one cross-attention overlay per generated word), plus
``rollout``/``heads`` of the ViT encoder when the method asks for them.

``per_image=false`` writes the grids only. ``side_by_side=true`` draws each grid entry as the image beside its
overlay, titled with the class names;
``faithfulness=true`` (classifiers) also measures rollout and gradient rollout against a random patch order
by deletion / insertion AUC (vitpipe.viz.faithfulness), prints the table and writes <out>/faithfulness.csv.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import torch
from matplotlib.figure import Figure
from omegaconf import DictConfig
from torch import Tensor
from tqdm import tqdm

from vitpipe.config.build import resolve_device
from vitpipe.config.options import SPLITS
from vitpipe.config.preflight import preflight
from vitpipe.data.images import open_image
from vitpipe.data.preprocess import naflex_settings
from vitpipe.errors import ConfigError
from vitpipe.inference.explain import METHODS as EXPLAIN_METHODS
from vitpipe.inference.explain import explain, method_name
from vitpipe.inference.labels import class_index
from vitpipe.kinds import KINDS, TaskKind
from vitpipe.models.vit import ViT
from vitpipe.nn.attn_memory import available_memory, check_explicit_attention
from vitpipe.run.checkpoint import rebuild
from vitpipe.run.csvfiles import dict_csv_text
from vitpipe.run.files import atomic_write_text
from vitpipe.run.outputs import Input, checkpoint_inputs, prepare_output
from vitpipe.run.paths import needs_kinds, resolve_ckpt_path
from vitpipe.run.stored import config_of, load_checkpoint
from vitpipe.viz.faithfulness import faithfulness_table, format_table
from vitpipe.viz.inputs import IMAGE_SUFFIXES, data_stats, folder_images, naflex_display, split_images
from vitpipe.viz.overlay import overlay, overlay_grid, save_figure, to_numpy_image
from vitpipe.viz.rollout import attention_maps, cross_attention_maps

# what visualize draws, per method= (each also the name of its folder and grid file: <out>/gradient/,
# gradient_grid.png); the options themselves are checked by preflight(cfg, "visualize")



# --------------------------------------------------------------------------- methods


def canonical(method) -> str:
    """``method=`` with an explain alias mapped to its canonical name (``vitpipe.inference.explain``)."""
    return method_name(method) or method


def kinds_for(method: str, captioner: bool) -> list[str]:
    method = canonical(method)
    if not captioner:
        return ["rollout", "gradient", "heads"] if method == "all" else [method]
    if method == "gradient":
        raise ConfigError(
            "method=gradient needs a class logit, and this checkpoint is a captioner; "
            "use method=rollout, heads or all (captions are always drawn)"
        )
    return ["caption", *(["rollout", "heads"] if method == "all" else [method])]


# --------------------------------------------------------------------------- figures


def panel_figure(image, heatmaps, titles, *, suptitle: str | None = None, ncols: int = 5, alpha: float = 0.5,
                 cmap: str = "jet", panel_size: float = 2.5) -> Figure:
    """The image alone, then one overlay per heatmap; ``titles`` has one entry per panel (image first)."""
    n = 1 + len(heatmaps)
    ncols = min(ncols, n)
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(panel_size * ncols, panel_size * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    axes[0].imshow(to_numpy_image(image))
    axes[0].set_axis_off()
    for ax, heat in zip(axes[1:], heatmaps):
        overlay(image, heat, alpha=alpha, cmap=cmap, ax=ax)
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=9)
    for ax in axes[n:]:
        ax.set_axis_off()
    if suptitle:
        fig.suptitle(suptitle, fontsize=10)
    return fig


def map_figure(kind: str, image, maps: Tensor, label: str, name: str, style: dict) -> tuple[Figure, tuple]:
    """One image's rollout / gradient figure ((h, w) map) or per-head figure ((heads, h, w)), and its grid
    entry (titled by ``label``, the prediction, else by the image's ``name``)."""
    if kind == "heads":
        heads = list(maps)
        fig = panel_figure(image, heads, ["input", *(f"head {h}" for h in range(len(heads)))], ncols=len(heads) + 1,
                           suptitle=f"last layer, per head. {label}".strip(), **style)
        return fig, (heads, None)
    what = "attention rollout" if kind == "rollout" else "gradient rollout"  # gradient: for the predicted class
    return panel_figure(image, [maps], ["input", what], suptitle=label or None, **style), (maps, label or name)


def caption_figure(image, words: list[str], maps: Tensor, reference: str | None, grid_size,
                   style: dict) -> tuple[Figure, tuple]:
    """The caption over one overlay per word ((T, h, w) maps); the grid shows the mean over words."""
    caption = " ".join(words)
    fig = panel_figure(image, list(maps), ["input", *words], ncols=6, **style,
                       suptitle=_wrap(caption, 60) + (f"\nref: {reference}" if reference else ""))
    mean_map = maps.mean(dim=0) if len(words) else torch.zeros(tuple(grid_size))
    return fig, (mean_map, _wrap(caption))


def _wrap(text: str, width: int = 28) -> str:
    return "\n".join(textwrap.wrap(text, width)) or "(empty)"


# --------------------------------------------------------------------------- maps


def check_attention_memory(net, cfg: DictConfig, naflex: dict | None, device, *, captioner: bool) -> None:
    """Refuse in one line a run whose explicit attention cannot fit on ``device``: every method reads the
    weights of all layers (``forward_features(return_attn=True)``, B x heads x N x N each, N = prefix +
    patches), gradient rollout also their gradients. The estimate is a lower bound of what one batch holds
    at once, so past the available memory the run could only die of it, after reading its images."""
    encoder = net.encoder if captioner else net
    if not isinstance(encoder, ViT) or not len(encoder.blocks):
        return  # no attention to draw: the command says so itself
    tokens = encoder.num_prefix_tokens + naflex["max_seq_len"] if naflex else encoder.num_tokens
    gradient = not captioner and not naflex and canonical(cfg.method) in ("gradient", "all")
    # gradient rollout: each layer's weights and their gradients, beside the maps of the first forward pass
    layers = len(encoder.blocks) * (3 if gradient else 1)
    line = check_explicit_attention(min(cfg.batch_size, cfg.num_images or cfg.batch_size),
                                    encoder.blocks[0].attn.num_heads, tokens, layers,
                                    available_bytes=available_memory(device),
                                    what=f"method={cfg.method} ({'gradient' if gradient else 'attention'} rollout)")
    if line:
        raise ConfigError(line)


def classifier_maps(net, x: Tensor, kinds: list[str], *, head_fusion: str, discard_ratio: float,
                    target: int | None = None, kind: TaskKind | None = None) -> dict:
    """{method: maps} for one batch; "heads": (B, heads, h, w), others (B, h, w); plus "probs" (B, classes),
    ``kind.probabilities`` of the logits (softmax; a sigmoid per class for a multi-label kind). ``target``: the
    class gradient rollout explains (None: each image's predicted class); ``kind`` None: multi-class."""
    kind = kind or KINDS["multiclass"]
    prefix = net.num_prefix_tokens
    query = "cls" if getattr(net, "pool", "cls") == "cls" and prefix >= 1 else "mean"
    grid = tuple(net.grid_size)  # inputs were resized to the model's img_size
    out = {}
    with torch.no_grad():
        tokens, attentions = net.forward_features(x, return_attn=True)  # explicit-path weights, this call only
        if hasattr(net, "forward_head") and getattr(net, "num_classes", 0) > 0:
            logits = net.forward_head(tokens).float()
            out["probs"] = kind.probabilities(logits)
    for method in (k for k in EXPLAIN_METHODS if k in kinds):  # the maps serve and the demo draw, the same way
        out[method] = explain(net, x, method, target=target, head_fusion=head_fusion, discard_ratio=discard_ratio)
    if "heads" in kinds:
        out["heads"] = attention_maps(attentions, layer=-1, num_prefix_tokens=prefix, grid_size=grid,
                                      query=query)[:, 0]  # (B, heads, h, w)
    return out


def caption_maps(net, tokenizer, x: Tensor, max_words: int | None = None) -> tuple[list[list[str]], list[Tensor]]:
    """Greedy captions' words and, per image, their cross-attention maps (T_i, h, w)."""
    ids, attn = net.generate(x, max_len=max_words, return_cross_attn=True)  # (B, T), (B, depth, heads, T, M)
    maps = cross_attention_maps(attn, tuple(net.grid_size), num_prefix_tokens=net.num_prefix_tokens)  # (B, T, h, w)
    words, per_image = [], []
    for row, m in zip(ids.tolist(), maps):
        length = row.index(tokenizer.eos_id) if tokenizer.eos_id in row else len(row)
        words.append([tokenizer.itos[i] for i in row[:length]])
        per_image.append(m[:length])
    return words, per_image


# --------------------------------------------------------------------------- main


def visualize(cfg: DictConfig) -> list[Path]:
    """Write the attention figures ``cfg`` asks for; returns the paths written."""
    preflight(cfg, "visualize")  # every option, before the checkpoint or an image is read
    device = resolve_device(cfg.device)
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, log_dir=cfg.paths.log_dir, which="best",
                                  usable=needs_kinds("classifier", "captioner", command="visualize"))
    # out= is not, holds or lies inside the run or the image folder read (figures there would be read as images)
    folder = [] if str(cfg.images) in SPLITS else [Input(Path(str(cfg.images)), f"the images images={cfg.images} reads")]
    prepare_output(cfg.out, [*checkpoint_inputs(ckpt_path, cfg.ckpt_path), *folder], key="out", folder=True)
    checkpoint = load_checkpoint(ckpt_path)
    run = rebuild(checkpoint, ckpt_path, data=cfg.get("data"), paths=cfg.paths, task_name=cfg.task_name)
    net, dm, task = run.net, run.datamodule, run.module.kind  # the task kind, chosen once by the module
    naflex = naflex_settings(config_of(checkpoint))
    check_attention_memory(net, cfg, naflex, device, captioner=task.generates)  # before any image is read
    if naflex is not None:
        if cfg.get("target") is not None:
            raise ConfigError(f"target={cfg.target}: NaFlex checkpoints draw attention rollout only; drop target")
        return visualize_naflex(cfg, net, dm, naflex, device, task)
    captioner = task.generates
    kinds = kinds_for(cfg.method, captioner)
    if cfg.get("faithfulness") and captioner:
        raise ConfigError("faithfulness=true needs a class probability, and this checkpoint is a captioner; "
                          "use it with classifier checkpoints")
    encoder = net.encoder if captioner else net
    if not isinstance(encoder, ViT):  # e.g. a timm CNN (model=timm): no attention to show
        raise ConfigError(f"attention maps need a vitpipe ViT; {ckpt_path} holds a {type(encoder).__name__}")
    mean, std, channels = data_stats(dm, encoder)
    target = class_index(cfg.get("target"), getattr(dm, "class_names", None) or run.class_names, encoder.num_classes)

    source = str(cfg.images)
    if source in SPLITS:
        images = split_images(dm, source, cfg.num_images, mean=mean, std=std, channels=channels)
    else:
        images = folder_images(Path(source), cfg.num_images, encoder=encoder, mean=mean, std=std, channels=channels)

    tokenizer = run.module.tokenizer if captioner else None  # the checkpoint's vocabulary

    net.to(device)
    out = Path(cfg.out)
    style = {"alpha": cfg.alpha, "cmap": cfg.cmap}
    side_by_side = bool(cfg.get("side_by_side", False))
    per_image = bool(cfg.get("per_image", True))  # false: the grids only (e.g. a figure for a README)
    written: list[Path] = []
    grid: dict[str, list] = {k: [] for k in kinds}  # per kind: (heatmap(s), title) per image
    bar = tqdm(total=len(images.x), desc="attention maps", unit="img")
    for start in range(0, len(images.x), cfg.batch_size):
        sl = slice(start, start + cfg.batch_size)
        x = images.x[sl].to(device)
        maps = classifier_maps(encoder, x, [k for k in kinds if k != "caption"], head_fusion=cfg.head_fusion,
                               discard_ratio=cfg.discard_ratio, target=target, kind=task)
        maps = {k: v.cpu() for k, v in maps.items()}
        if captioner:
            words, word_maps = caption_maps(net, tokenizer, x, cfg.max_words)
        for i, name in enumerate(images.names[sl]):
            image = images.display[start + i]
            truth = images.labels[start + i] if images.labels else None
            label = ""
            if "probs" in maps:
                p, c = maps["probs"][i].max(dim=0)
                if target is not None:  # the class explained, and its probability
                    p, c, what = maps["probs"][i][target], target, "class"
                else:
                    what = "pred"
                label = f"{what} {_class_name(dm, int(c))} ({p:.0%})" + (f", true {truth}" if truth else "")
            for kind in kinds:
                if kind == "caption":
                    fig, entry = caption_figure(image, words[i], word_maps[i], truth, encoder.grid_size, style)
                else:
                    fig, entry = map_figure(kind, image, maps[kind][i], label, name, style)
                grid[kind].append(entry)
                if per_image:
                    written.append(save_figure(fig, out / kind / f"{name}.png", dpi=cfg.dpi))
            bar.update(1)
    bar.close()

    for kind, rows in grid.items():  # rows: (heatmap, title) per image; heads: (list of maps, None)
        if kind == "heads":
            num_heads = len(rows[0][0])
            fig = overlay_grid([im for im in images.display for _ in range(num_heads)],
                               [h for heads, _ in rows for h in heads],
                               [f"{n} h{h}" for n in images.names for h in range(num_heads)], ncols=num_heads, **style)
        else:
            fig = overlay_grid(images.display, [m for m, _ in rows], [t for _, t in rows], ncols=cfg.ncols,
                               side_by_side=side_by_side and kind != "caption", **style)
        written.append(save_figure(fig, out / f"{kind}_grid.png", dpi=cfg.dpi))
    print(f"vitpipe visualize: {len(written)} PNG files ({', '.join(kinds)}) under {out}")
    if cfg.get("faithfulness"):
        written.append(write_faithfulness(encoder, images.x, out, cfg, device))
    return written


def visualize_naflex(cfg: DictConfig, net, dm, naflex: dict, device: torch.device, task: TaskKind) -> list[Path]:
    """A NaFlex checkpoint: each file of ``images=<folder>`` patchified at its own aspect (the predict rule,
    ``vitpipe.data.preprocess``), batches padded, attention rollout on each image's own grid, overlays drawn
    at each image's aspect. Rollout only (``method=rollout`` or ``all``)."""
    from vitpipe.data.preprocess import Preprocess
    from vitpipe.nn.naflex import pad_batch

    if task.generates or not isinstance(net, ViT):
        raise ConfigError("attention maps of a NaFlex checkpoint need a vitpipe ViT classifier")
    if canonical(cfg.method) not in ("rollout", "all") or cfg.get("faithfulness"):
        raise ConfigError(f"method={cfg.method} (faithfulness={cfg.get('faithfulness')}) on a NaFlex checkpoint: its "
                          "images have one grid each, and visualize draws attention rollout for them; use method=rollout")
    if str(cfg.images) in SPLITS:
        raise ConfigError(f"images={cfg.images} on a NaFlex checkpoint: pass a folder of images (shown at their "
                          "own aspect)")
    pre = Preprocess(dm, net, naflex=naflex)
    mean, std, channels = data_stats(dm, net)
    folder = Path(str(cfg.images))
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)[:cfg.num_images]
    if not files:
        raise ConfigError(f"images={folder} holds no images ({', '.join(IMAGE_SUFFIXES)}); pass a folder of images")
    items = []
    for f in files:
        try:
            items.append(pre(open_image(f, pre.spec.mode)))
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read image {f}: {e}; remove it or pass another folder") from None
    net.to(device).eval()
    out, style, written = Path(cfg.out), {"alpha": cfg.alpha, "cmap": cfg.cmap}, []
    displays, maps, titles = [], [], []
    for start in range(0, len(items), cfg.batch_size):
        chunk = items[start : start + cfg.batch_size]
        batch = {k: v.to(device) for k, v in pad_batch(chunk).items()}
        rollouts = explain(net, batch, "rollout", head_fusion=cfg.head_fusion, discard_ratio=cfg.discard_ratio)
        with torch.no_grad():
            probs = task.probabilities(net(batch).float()).cpu()
        for j, (item, m) in enumerate(zip(chunk, rollouts)):
            i = start + j
            name, (pr, c) = f"{i:03d}_{files[i].stem}", probs[j].max(dim=0)
            label = f"pred {_class_name(dm, int(c))} ({pr:.0%}), grid {m.shape[0]}x{m.shape[1]}"
            display = naflex_display(item, net.patch_size, mean, std, channels)
            displays.append(display)
            maps.append(m.cpu())
            titles.append(label)
            if cfg.get("per_image", True):
                fig = panel_figure(display, [m.cpu()], ["input", "attention rollout"], suptitle=label, **style)
                written.append(save_figure(fig, out / "rollout" / f"{name}.png", dpi=cfg.dpi))
    fig = overlay_grid(displays, maps, titles, ncols=cfg.ncols, **style)
    written.append(save_figure(fig, out / "rollout_grid.png", dpi=cfg.dpi))
    print(f"vitpipe visualize: {len(written)} PNG files (rollout, NaFlex: each image on its own grid) under {out}")
    return written


def write_faithfulness(net, x: Tensor, out: Path, cfg: DictConfig, device: torch.device) -> Path:
    """Deletion / insertion AUC of rollout and gradient rollout vs a random order: printed, and as CSV."""
    maps: dict[str, list[Tensor]] = {"rollout": [], "gradient": []}
    for start in range(0, len(x), cfg.batch_size):
        batch = classifier_maps(net, x[start:start + cfg.batch_size].to(device), list(maps),
                                head_fusion=cfg.head_fusion, discard_ratio=cfg.discard_ratio)
        for k in maps:
            maps[k].append(batch[k])
    rows = faithfulness_table(net, x.to(device), {k: torch.cat(v) for k, v in maps.items()},
                              fill=cfg.get("faithfulness_fill", "mean"), steps=cfg.get("faithfulness_steps"),
                              batch_size=cfg.batch_size)
    print(f"faithfulness (fill={cfg.get('faithfulness_fill', 'mean')}; the probability of the predicted class as "
          "patches are deleted / inserted in each map's order):")
    print(format_table(rows))
    text = dict_csv_text(({**r, "deletion_auc": f"{r['deletion_auc']:.4f}", "insertion_auc": f"{r['insertion_auc']:.4f}",
                           "fill": cfg.get("faithfulness_fill", "mean")} for r in rows), [*rows[0], "fill"])
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "faithfulness.csv", text)
    return out / "faithfulness.csv"


def _class_name(dm, index: int) -> str:
    names = getattr(dm, "class_names", None)
    return str(names[index]) if names and index < len(names) else str(index)
