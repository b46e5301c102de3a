"""format=onnx: one self-contained ``.onnx`` file with a dynamic batch, checked with onnxruntime.

torch's dynamo exporter (the default since torch 2.9) saves weights to a separate ``.onnx.data`` file by
default, and always above 2 GB; vitpipe serializes the exported model itself, weights inside, so an
export is one file (protobuf caps it at 2 GB; larger networks are refused with a line). Every vitpipe
position kind and stem exports: RoPE and the recomputed sin-cos tables are ordinary tensor ops.

The file is written through ``atomic_write``: the exporter's bytes go to a temporary file beside
``out`` and are run in onnxruntime against PyTorch before that file is renamed to ``out``. A kill at
any moment leaves the old ``out`` (or none) plus at worst a temporary file, which the next export to
the same ``out`` removes; a failed check removes it at once. The exporter's per-node Python stack
traces (absolute source paths of this machine) are left out of the file.
"""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path

import torch
from torch import nn

from vitpipe.data.preprocess import InputSpec
from vitpipe.errors import ConfigError, ExportCheckError
from vitpipe.export.check import check_logits
from vitpipe.run.files import atomic_write, remove_stale_temp_files

ONNX_TOLERANCE = 1e-4  # max abs logit difference between onnxruntime and PyTorch, fp32
ONNX_MAX_BYTES = 2**31  # protobuf's limit on one serialized message: the whole self-contained file


def export_onnx(net: nn.Module, spec: InputSpec, out: Path) -> float:
    """Write ``net`` (images (B, in_chans, H, W) -> logits (B, classes)) to ``out``; returns the max
    abs difference of onnxruntime's logits from PyTorch's on a random batch of 3. A model failing that
    check is not written (ExportCheckError; an earlier ``out`` stays as it was)."""
    if hasattr(net, "generate"):
        raise ConfigError("format=onnx exports classifiers; this checkpoint is a captioner "
                          "(its decoding loop is not one graph): use scripts/predict.py for captions")
    net = net.eval().cpu()
    size = sum(t.numel() * t.element_size() for t in [*net.parameters(), *net.buffers()])
    if size >= ONNX_MAX_BYTES:
        raise ConfigError(f"format=onnx writes one self-contained file, and ONNX (protobuf) holds at most 2 GB in "
                          f"one: this network's weights are {size / 1e9:.2f} GB; use format=timm")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(out.parent, name=out.name)  # what earlier killed exports left
    diffs = []

    def write(f) -> None:  # called on the temporary file; returning lets atomic_write rename it to out
        model = _onnx_bytes(net, spec)
        f.write(model)
        f.flush()
        diffs.append(check_onnx(net, model, torch.randn(3, spec.in_chans, *spec.img_size)))

    try:
        atomic_write(out, write)
    except ExportCheckError as e:
        raise ExportCheckError(f"{e}; nothing was written to {out}") from None
    return diffs[0]


def _onnx_bytes(net: nn.Module, spec: InputSpec) -> bytes:
    x = torch.randn(3, spec.in_chans, *spec.img_size)
    batch = torch.export.Dim("batch", min=1)
    for name in ("onnx_ir", "onnxscript"):  # their INFO lines narrate graph passes
        logging.getLogger(name).setLevel(logging.WARNING)
    with contextlib.redirect_stdout(io.StringIO()):  # the exporter narrates each step on stdout
        program = torch.onnx.export(net, (x,), None, dynamo=True, dynamic_shapes=({0: batch},),
                                    input_names=["images"], output_names=["logits"], verbose=False)
    model = program.model_proto
    _drop_stack_traces(model)
    return model.SerializeToString()  # what ONNXProgram.save writes, weights inside


STACK_TRACE = "pkg.torch.onnx.stack_trace"


def _drop_stack_traces(model) -> None:
    """Remove the Python stack the exporter records on each node (``File "/home/<user>/.../vit.py", line
    177``): absolute paths of this machine in a file meant for sharing. The graph is unchanged."""
    graphs = [model.graph]
    nodes = [n for f in model.functions for n in f.node]
    while graphs:
        g = graphs.pop()
        for n in g.node:
            nodes.append(n)
            for a in n.attribute:  # If / Loop / Scan bodies
                graphs += ([a.g] if a.HasField("g") else []) + list(a.graphs)
    for n in nodes:
        kept = [p for p in n.metadata_props if p.key != STACK_TRACE]
        if len(kept) != len(n.metadata_props):
            del n.metadata_props[:]
            n.metadata_props.extend(kept)


@torch.no_grad()
def check_onnx(net: nn.Module, model: Path | bytes, x: torch.Tensor) -> float:
    """Max abs difference between onnxruntime's and PyTorch's logits on ``x``; ExportCheckError above tolerance.
    ``model``: an .onnx file, or its bytes."""
    import onnxruntime as ort

    session = ort.InferenceSession(model if isinstance(model, bytes) else str(model),
                                   providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(None, {"images": x.numpy()})[0])
    where = "" if isinstance(model, bytes) else f" from {model}"
    return check_logits(got, net, x, tolerance=ONNX_TOLERANCE, differs=f"onnxruntime's logits{where} differ from PyTorch's")
