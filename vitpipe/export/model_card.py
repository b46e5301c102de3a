"""The model card (``README.md``) written beside exported timm weights.

Front matter and the first sections come from timm's own ``generate_readme`` (the card
``push_to_hf_hub`` writes); vitpipe adds what a reader of a trained model needs: the data and its
classes, the test metrics of the run (``metrics.json`` of the checkpoint's run directory), the
training command and config, and the intended use and limits.

No local path reaches the card (``vitpipe.export.local_paths``): the machine's own sections and
overrides (``paths``, ``hydra``, loggers, callbacks) are left out, and every other absolute path, in the
config or in the command, becomes relative to the directory training was started in
(``paths.root_dir``) when it lies under it, else ``<local path>``.

Class names are data: they are listed once, as the JSON list of ``label_names`` in a code block
(``<``, ``>``, ``&`` as JSON's ``\\u`` escapes), so a name with a comma, a pipe, a link or a tag is one
name, rendered as text, and ``json.loads`` of the block gives them back exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from torch import nn

from vitpipe.data.preprocess import InputSpec
from vitpipe.export.local_paths import scrub_override, scrub_tree
from vitpipe.report.markdown import fenced

# config keys that describe the machine, not the model (paths, loggers, Hydra's own settings, a resume file)
_LOCAL_KEYS = ("paths", "logger", "hydra", "callbacks", "ckpt_path")
_LOCAL_OVERRIDES = ("paths.", "hydra.")  # command-line overrides of the same kind (``paths.log_dir=/x``)


def run_metrics(run_dir: Path) -> dict[str, float]:
    """The test metrics of a run's ``metrics.json`` ({} when absent or unreadable)."""
    try:
        metrics = json.loads((run_dir / "metrics.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in metrics.items() if k.startswith("test/") and isinstance(v, (int, float))}


def root_dir(train_config: dict) -> str | None:
    """The directory the run was started in (its stored ``paths.root_dir``), which card paths are relative to."""
    paths = train_config.get("paths")
    root = paths.get("root_dir") if isinstance(paths, dict) else None
    return root if isinstance(root, str) else None


def train_command(run_dir: Path, root: str | None = None) -> str | None:
    """``python scripts/train.py <overrides>`` from Hydra's record of the run, if it is there: without the
    ``paths.*`` / ``hydra.*`` overrides, other paths relative to ``root`` or ``<local path>``."""
    try:
        overrides = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()) or []
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(overrides, list):
        return None
    kept = [scrub_override(str(o), root) for o in overrides
            if not str(o).lstrip("+~").startswith(_LOCAL_OVERRIDES)]
    return " ".join(["python scripts/train.py", *kept])


def shareable_config(train_config: dict) -> str:
    """The training config (as stored in the checkpoint) as YAML, without machine-specific keys, every other
    path relative to the run's ``paths.root_dir`` or ``<local path>``."""
    root = root_dir(train_config)
    data = json.loads(json.dumps(train_config, default=str))  # a copy holding only YAML-safe values
    for key in _LOCAL_KEYS:
        data.pop(key, None)
    return yaml.safe_dump(scrub_tree(data, root), sort_keys=False)


def class_list(class_names: list[str]) -> str:
    """The names as a JSON list, one a line, with no raw ``<``, ``>`` or ``&`` (no tag, even inside code)."""
    text = json.dumps([str(n) for n in class_names], ensure_ascii=False, indent=1)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def model_card(*, name: str, net: nn.Module, arch: str, spec: InputSpec, train_config: dict,
               class_names: list[str] | None, run_dir: Path | None, temperature: float | None,
               thresholds: list[float] | None = None) -> str:
    """README.md text for an exported timm folder named ``name``; ``train_config``: the run's config as the
    checkpoint stores it (shown as text, never instantiated); ``thresholds`` (one per class): a multi-label
    model, one sigmoid per class, a class predicted at score >= its threshold (config.json's ``thresholds``)."""
    # timm's private generate_readme on purpose: the card text timm's push_to_hf_hub writes has no public writer
    # (push_to_hf_hub itself uploads), and the card should read like timm's own
    from timm.models._hub import generate_readme

    model_cfg = train_config.get("model") or {}
    data_name = str((train_config.get("data") or {}).get("_target_", "?")).rsplit(".", 1)[-1].removesuffix("DataModule")
    num_params = sum(p.numel() for p in net.parameters())
    metrics = run_metrics(run_dir) if run_dir else {}
    details = {
        "Model Type": "Image classification",
        "Architecture": (f"ViT (vitpipe {model_cfg.get('name', '?')}): dim {net.dim}, depth {len(net.blocks)}, "
                         f"heads {net.blocks[0].attn.num_heads}, patch {net.patch_size[0]}x{net.patch_size[1]}, "
                         f"pos_embed {model_cfg.get('pos_embed', '?')}, pool {net.pool}; timm `{arch}` with the "
                         "`model_args` of config.json"),
        "Params (M)": f"{num_params / 1e6:.3f} ({num_params:,} parameters)",
        "Image size": f"{spec.img_size[0]} x {spec.img_size[1]}, {spec.in_chans} channel(s)",
        "Preprocessing": (f"{spec.interpolation} resize, crop_mode {spec.crop_mode}, crop_pct {spec.crop_pct}, "
                          f"mean {list(spec.mean)}, std {list(spec.std)} (from config.json's pretrained_cfg)"),
        "Data": data_name,
        "Classes": (f"{net.num_classes}, named under Classes below" if class_names
                    else f"{net.num_classes} (names not stored: indices)"),
    }
    if metrics:
        details["Test metrics"] = {k: f"{v:.4f}" for k, v in sorted(metrics.items())}
    if thresholds is not None:
        details["Outputs"] = ("multi-label: one sigmoid score per class (`.sigmoid()`, not a softmax); a class is "
                              "predicted at score >= its threshold, config.json's `thresholds` (index order)")
    if temperature:
        details["Calibration"] = f"temperature {temperature:g} (divide the logits by it before the softmax)"
    card = {
        "description": f"A Vision Transformer image classifier trained with vitpipe on {data_name} "
                       f"({net.num_classes} classes), exported to timm's format.",
        "details": details,
        "license": "other",
        "usage": _usage(name, spec, multilabel=thresholds is not None),
    }
    text = generate_readme(card, name, task_name="image-classification")
    if class_names:
        text += ("\n## Classes\n\nIn index order (the logits' order), as in config.json's `label_names`:\n\n"
                 + fenced(class_list(class_names), "json"))
    command = train_command(run_dir, root_dir(train_config)) if run_dir else None
    text += "\n## Training\n"
    text += f"\n{fenced(command, 'bash')}" if command else "\nThe training command was not recorded.\n"
    text += ("\nPaths are relative to the directory training was started in; `<local path>` stands for one "
             "outside it, and the machine's own settings (`paths`, `hydra`, loggers, callbacks) are left out.\n")
    text += f"\n<details><summary>Run config</summary>\n\n{fenced(shareable_config(train_config), 'yaml')}</details>\n"
    answers = ("its label sets are only as good as its thresholds on such images" if thresholds is not None
               else "it always answers with one of its classes")
    text += (
        "\n## Intended use and limits\n\n"
        f"Classifies images into the {net.num_classes} classes above, for images like those of the training "
        f"data ({data_name}). It has not been evaluated on any other distribution: on other kinds of images "
        f"its probabilities are not meaningful, and {answers}. Accuracy figures "
        "above are on the run's own test split only. Check the licence of the training data before use and "
        "set this card's `license` accordingly.\n"
    )
    return text


def _usage(name: str, spec: InputSpec, *, multilabel: bool = False) -> str:
    convert = "L" if spec.in_chans == 1 else "RGB"
    if spec.max_seq_len is not None:
        return _naflex_usage(name, spec, convert)
    if multilabel:
        return _multilabel_usage(name, convert)
    return (
        "```python\n"
        "import timm, torch\n"
        "from PIL import Image\n\n"
        f'model = timm.create_model("local-dir:{name}", pretrained=True).eval()  # or "hf-hub:<user>/<repo>"\n'
        "cfg = timm.data.resolve_data_config({}, model=model)\n"
        "transform = timm.data.create_transform(**cfg)\n"
        f'x = transform(Image.open("image.png").convert("{convert}"))[None]\n'
        "probs = model(x).softmax(-1)\n"
        "label = model.pretrained_cfg['label_names'][probs.argmax().item()]\n"
        "```\n"
    )


def _multilabel_usage(name: str, convert: str) -> str:
    """One sigmoid per class; the label set: every class at or above its threshold (config.json)."""
    return (
        "```python\n"
        "import json, timm, torch\n"
        "from PIL import Image\n\n"
        f'model = timm.create_model("local-dir:{name}", pretrained=True).eval()  # or "hf-hub:<user>/<repo>"\n'
        f'thresholds = torch.tensor(json.load(open("{name}/config.json"))["thresholds"], dtype=torch.float64)\n'
        "cfg = timm.data.resolve_data_config({}, model=model)\n"
        "transform = timm.data.create_transform(**cfg)\n"
        f'x = transform(Image.open("image.png").convert("{convert}"))[None]\n'
        "scores = model(x).sigmoid()[0]  # one independent probability per class\n"
        "names = model.pretrained_cfg['label_names']\n"
        "labels = [names[c] for c in (scores >= thresholds).nonzero()[:, 0].tolist()]\n"
        "```\n"
    )


def _naflex_usage(name: str, spec: InputSpec, convert: str) -> str:
    """A NaFlexVit takes timm's patch dictionary: timm's NaFlex transform (the image at its own aspect, the
    largest grid of at most ``max_seq_len`` patches), a batch of one; several images: pad with
    ``timm.data.naflex_dataset``'s collate or vitpipe's ``vitpipe.nn.naflex.pad_batch``."""
    return (
        "```python\n"
        "import json, timm, torch\n"
        "from PIL import Image\n"
        "from torchvision.transforms.functional import to_tensor\n\n"
        f'model = timm.create_model("local-dir:{name}", pretrained=True).eval()  # or "hf-hub:<user>/<repo>"\n'
        f'naflex = json.load(open("{name}/config.json"))["naflex"]  # max_seq_len {spec.max_seq_len}, patch_size\n'
        "cfg = timm.data.resolve_data_config({}, model=model)\n"
        "transform = timm.data.create_transform(**cfg, naflex=True, patch_size=tuple(naflex['patch_size']),\n"
        "                                       max_seq_len=naflex['max_seq_len'], patchify=True)\n"
        "# a float tensor, resized by torch (bicubic, antialiased) as in training; PIL's resize differs slightly\n"
        f'x = transform(to_tensor(Image.open("image.png").convert("{convert}")))  # patches, patch_coord, patch_valid\n'
        "probs = model({k: v[None] for k, v in x.items()}).softmax(-1)\n"
        "label = model.pretrained_cfg['label_names'][probs.argmax().item()]\n"
        "```\n"
    )
