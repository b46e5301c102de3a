"""format=timm: ``config.json`` + ``model.safetensors`` in timm's hub layout, written by timm's ``save_for_hf``.

The network is converted to a timm ``VisionTransformer`` (``timm_compat.to_timm``), so
``timm.create_model("local-dir:DIR", pretrained=True)`` rebuilds it from timm's own registry and
``model_args``. Its ``pretrained_cfg`` states vitpipe's preprocessing rule (``vitpipe.data.preprocess``),
so ``resolve_data_config({}, model=m)`` + ``create_transform(**cfg)`` feed it as ``scripts/predict.py``
does. The folder is built beside ``out`` (``vitpipe.export.staging``), loaded back through timm and
checked against the network, and only then renamed to ``out``: a failed check or a kill leaves
``out`` as it was.

A NaFlex checkpoint (``spec.max_seq_len`` set: ``data.naflex.enabled``) becomes a timm ``NaFlexVit``
(``timm_compat.to_timm_naflex``) where the architecture matches (learned / learned2d / no positions, the
patchify stem), checked on a padded patch dict of two images of other aspects; its ``pretrained_cfg``
``config.json`` carries ``naflex: {max_seq_len, patch_size}`` for timm's ``create_transform(naflex=True, ...)``
(timm's ``pretrained_cfg`` has no field for it).
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import torch
from torch import nn

from vitpipe.data.preprocess import InputSpec
from vitpipe.export.check import check_logits
from vitpipe.export.staging import staged_folder
from vitpipe.models.registry import TIMM_NAMES, VARIANTS
from vitpipe.models.timm_compat import (
    naflex_arch,
    naflex_timm_kwargs,
    timm_arch_of,
    timm_kwargs,
    to_timm,
    to_timm_naflex,
)
from vitpipe.nn.naflex import pad_batch, patchify_image
from vitpipe.run.files import DiskFullError, user_permissions

TIMM_TOLERANCE = 1e-5  # max abs logit difference, fp32
GENERIC_ARCH = "vit_base_patch16_224"  # any timm ViT entry point: the model_args set every dimension


def timm_arch(net: nn.Module, spec: InputSpec | None = None) -> str:
    """timm's entry point of the same variant (e.g. ``vit_small_patch16_224``), else a generic ViT one;
    for a NaFlex ``spec`` the ``NaFlexVit`` entry point of the same positional rule."""
    if spec is not None and spec.max_seq_len is not None:
        naflex_timm_kwargs(net)  # ConfigError naming what a NaFlexVit cannot express
        return naflex_arch(net)
    if getattr(net, "rel_pos_kind", "none") != "none":
        return timm_arch_of(net, GENERIC_ARCH)  # VisionTransformerRelPos or Beit; ConfigError where neither fits
    kw = timm_kwargs(net)
    for name, dims in VARIANTS.items():
        same = (dims["dim"], dims["depth"], dims["num_heads"]) == (kw["embed_dim"], kw["depth"], kw["num_heads"])
        if same and (dims["patch_size"],) * 2 == kw["patch_size"] and name in TIMM_NAMES:
            return TIMM_NAMES[name].split(".")[0]
    return GENERIC_ARCH


def save_timm(net: nn.Module, spec: InputSpec, out: Path, *, class_names: list[str] | None = None,
              readme: str | None = None, overwrite: bool = False, thresholds: list[float] | None = None) -> float:
    """Write the folder ``out``: ``config.json`` + ``model.safetensors`` (+ ``README.md`` = ``readme``); returns
    the max abs logit difference between the model timm loads back and ``net`` (ExportCheckError above
    ``TIMM_TOLERANCE``, and ``out`` untouched). ConfigError, before anything is written, when timm cannot
    express a part of ``net`` or ``out`` is a non-empty folder and not ``overwrite``.

    ``thresholds`` (one per class): a multi-label network, its outputs are read as sigmoid scores; config.json
    records ``"multi_label": true`` and the thresholds at its top level (timm's ``PretrainedCfg`` refuses
    unknown fields, as for ``naflex``)."""
    from timm.models import save_for_hf

    arch = timm_arch(net, spec)
    naflex = spec.max_seq_len is not None
    tm = (to_timm_naflex(net.eval(), arch) if naflex else to_timm(net.eval(), arch)).eval()
    # a clean pretrained_cfg: the entry point's own (weights source, tag, licence) does not describe these weights
    tm.pretrained_cfg = tm.default_cfg = dict(architecture=arch, num_classes=tm.num_classes, classifier="head",
                                              first_conv="embeds.proj" if naflex else "patch_embed.proj",
                                              **spec.timm_data_config())
    labels = {"label_names": list(class_names)} if class_names else {}
    if thresholds is not None:
        labels |= {"multi_label": True, "thresholds": [float(t) for t in thresholds]}  # timm's PretrainedCfg has no field
    if naflex:
        labels["naflex"] = {"max_seq_len": spec.max_seq_len, "patch_size": list(net.patch_size)}
    with staged_folder(out, overwrite=overwrite) as folder:
        try:
            save_for_hf(tm, str(folder), model_config=labels or None, safe_serialization=True)
        except Exception as e:  # noqa: BLE001 - safetensors' writer raises SafetensorError, not OSError
            error = os_error_of(e, out / "model.safetensors")
            if error is None:
                raise
            raise error from e
        user_permissions(folder / "model.safetensors")
        if readme is not None:
            (folder / "README.md").write_text(readme, encoding="utf-8")
        return check_timm(net, folder, spec, name=out)


def os_error_of(e: Exception, path: Path) -> OSError | None:
    """The ``OSError`` (a ``DiskFullError`` for ENOSPC/EDQUOT) naming ``path`` that safetensors' writer reports
    only as text (``SafetensorError: ... I/O error: No space left on device (os error 28)``); None for others."""
    found = re.search(r"\(os error (\d+)\)", str(e))
    if isinstance(e, OSError) or found is None:
        return None
    code = int(found.group(1))
    return DiskFullError(code, path) if code in (errno.ENOSPC, errno.EDQUOT) else OSError(code, os.strerror(code), str(path))


@torch.no_grad()
def check_timm(net: nn.Module, folder: Path, spec: InputSpec, batch: int = 3, *, name: Path | None = None) -> float:
    """Max abs logit difference of ``timm.create_model("local-dir:<folder>")`` from ``net``; ExportCheckError
    above tolerance (``name``: the folder the message names, when ``folder`` is its staging copy)."""
    import timm

    loaded = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    x = naflex_probe(spec, net.patch_size) if spec.max_seq_len is not None else torch.randn(batch, spec.in_chans,
                                                                                             *spec.img_size)
    left = f"; {name} was left as it was" if name is not None else ""
    return check_logits(loaded(x), net, x, tolerance=TIMM_TOLERANCE, measure="max abs logit difference", then=left,
                        differs=f"the timm model written for {name or folder} differs from the checkpoint's network")


def naflex_probe(spec: InputSpec, patch_size, max_seq_len: int | None = None) -> dict:
    """A padded patch dict of two random images of other aspects (wide, tall) at ``max_seq_len`` (default
    ``spec.max_seq_len``): the check input for a NaFlex export (two lengths, so padding is in it)."""
    g = torch.Generator().manual_seed(0)
    H, W = spec.img_size
    images = [torch.randn(spec.in_chans, H, 2 * W, generator=g), torch.randn(spec.in_chans, 3 * H, W, generator=g)]
    return pad_batch([patchify_image(im, patch_size, max_seq_len or spec.max_seq_len) for im in images])
