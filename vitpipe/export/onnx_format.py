"""format=onnx: one self-contained ``.onnx`` file with a dynamic batch, checked with onnxruntime.

torch's dynamo exporter (the default since torch 2.9) writes weights over 2 GB, and by default any
weights, to a separate ``.onnx.data`` file; ``external_data=False`` keeps them inside. Every vitpipe
position kind and stem exports: RoPE and the recomputed sin-cos tables are ordinary tensor ops.
"""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path

import torch
from torch import nn

from vitpipe.errors import ConfigError, ExportCheckError
from vitpipe.preprocess import InputSpec

ONNX_TOLERANCE = 1e-4  # max abs logit difference between onnxruntime and PyTorch, fp32


def export_onnx(net: nn.Module, spec: InputSpec, out: Path) -> float:
    """Write ``net`` (images (B, in_chans, H, W) -> logits (B, classes)) to ``out``; returns the max
    abs difference of onnxruntime's logits from PyTorch's on a random batch of 3. A file failing that
    check is removed and ExportCheckError raised."""
    if hasattr(net, "generate"):
        raise ConfigError("format=onnx exports classifiers; this checkpoint is a captioner "
                          "(its decoding loop is not one graph): use scripts/predict.py for captions")
    net = net.eval().cpu()
    out.parent.mkdir(parents=True, exist_ok=True)
    x = torch.randn(3, spec.in_chans, *spec.img_size)
    batch = torch.export.Dim("batch", min=1)
    for name in ("onnx_ir", "onnxscript"):  # their INFO lines narrate graph passes
        logging.getLogger(name).setLevel(logging.WARNING)
    with contextlib.redirect_stdout(io.StringIO()):  # the exporter narrates each step on stdout
        torch.onnx.export(net, (x,), str(out), dynamo=True, external_data=False, dynamic_shapes=({0: batch},),
                          input_names=["images"], output_names=["logits"], verbose=False)
    try:
        return check_onnx(net, out, torch.randn(3, spec.in_chans, *spec.img_size))
    except ExportCheckError:
        out.unlink(missing_ok=True)
        raise


@torch.no_grad()
def check_onnx(net: nn.Module, path: Path, x: torch.Tensor) -> float:
    """Max abs difference between onnxruntime's and PyTorch's logits on ``x``; ExportCheckError above tolerance."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(None, {"images": x.numpy()})[0])
    diff = (got - net.eval()(x)).abs().max().item()
    if not diff <= ONNX_TOLERANCE:
        raise ExportCheckError(f"onnxruntime's logits from {path} differ from PyTorch's: max abs difference "
                               f"{diff:.3g} > {ONNX_TOLERANCE}; the file was removed")
    return diff
