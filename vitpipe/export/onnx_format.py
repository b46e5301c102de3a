"""format=onnx: one self-contained ``.onnx`` file with a dynamic batch, checked with onnxruntime.

torch's dynamo exporter (the default since torch 2.9) saves weights to a separate ``.onnx.data`` file by
default, and always above 2 GB; vitpipe serializes the exported model itself, weights inside, so an
export is one file (protobuf caps it at 2 GB; larger networks are refused with a line). Every vitpipe
position kind and stem exports: RoPE and the recomputed sin-cos tables are ordinary tensor ops.

A NaFlex checkpoint (``spec.max_seq_len`` set) exports its patch-dict forward: inputs ``patches`` (B, N,
p*q*C) float, ``patch_coord`` (B, N, 2) int64, ``patch_valid`` (B, N) bool, dynamic B and N (``NaFlexGraph``:
the positions of every grid of at most ``max_seq_len`` patches precomputed by the model itself, looked up
per token, so the graph has no per-image Python loop).

Every file carries what someone holding only it needs (``consumer_metadata``, in ``metadata_props``:
onnxruntime's ``session.get_modelmeta().custom_metadata_map``): the task and how to read the outputs, the
class names in logit order (the indices as strings when the run has none), the input size and image mode,
mean, std, interpolation and crop rule of the run's eval transform (timm's ``pretrained_cfg`` terms), and for
NaFlex the sequence limit and patch size; a multi-label file adds its thresholds.

The file is written through ``atomic_write``: the exporter's bytes go to a temporary file beside
``out`` and are run in onnxruntime against PyTorch before that file is renamed to ``out``. A kill at
any moment leaves the old ``out`` (or none) plus at worst a temporary file, which the next export to
the same ``out`` removes; a failed check removes it at once. The exporter's per-node Python stack
traces (absolute source paths of this machine) are left out of the file.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path

import torch
from torch import Tensor, nn

from vitpipe.data.preprocess import InputSpec
from vitpipe.errors import ConfigError, ExportCheckError
from vitpipe.export.check import check_logits
from vitpipe.kinds import KINDS, TaskKind
from vitpipe.nn.naflex import NAFLEX_KEYS
from vitpipe.run.files import atomic_write, remove_stale_temp_files

ONNX_TOLERANCE = 1e-4  # max abs logit difference between onnxruntime and PyTorch, fp32
ONNX_MAX_BYTES = 2**31  # protobuf's limit on one serialized message: the whole self-contained file


def export_onnx(net: nn.Module, spec: InputSpec, out: Path, *, kind: TaskKind | None = None,
                metadata: dict[str, str] | None = None, class_names: list | None = None) -> float:
    """Write ``net`` (images (B, in_chans, H, W) -> logits (B, classes)) to ``out``; returns the max
    abs difference of onnxruntime's logits from PyTorch's on a random batch of 3. A model failing that
    check is not written (ExportCheckError; an earlier ``out`` stays as it was). The file's ``metadata_props``
    (onnxruntime: ``session.get_modelmeta().custom_metadata_map``) hold ``consumer_metadata(net, spec,
    class_names, kind)`` updated with ``metadata``, e.g. a multi-label model's ``multi_label``, ``outputs: sigmoid``
    and thresholds. ``kind``: the run's task kind (``vitpipe.kinds``; default multi-class)."""
    kind = kind or KINDS["multiclass"]
    if not kind.classifies:
        raise ConfigError("format=onnx exports classifiers; this checkpoint is a captioner "
                          "(its decoding loop is not one graph): use scripts/predict.py for captions")
    net = net.eval().cpu()
    graph = NaFlexGraph(net, spec.max_seq_len).eval() if spec.max_seq_len is not None else None
    module = graph if graph is not None else net  # a NaFlex graph also holds every grid's positions
    size = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
    if size >= ONNX_MAX_BYTES:
        raise ConfigError(f"format=onnx writes one self-contained file, and ONNX (protobuf) holds at most 2 GB in "
                          f"one: this network's weights are {size / 1e9:.2f} GB; use format=timm")
    metadata = {**consumer_metadata(net, spec, class_names, kind=kind), **(metadata or {})}
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(out.parent, name=out.name)  # what earlier killed exports left
    diffs = []

    def write(f) -> None:  # called on the temporary file; returning lets atomic_write rename it to out
        if graph is None:
            model = with_metadata(_onnx_bytes(net, spec), metadata)
            f.write(model)
            f.flush()
            diffs.append(check_onnx(net, model, torch.randn(3, spec.in_chans, *spec.img_size)))
            return
        from vitpipe.export.timm_format import naflex_probe

        model = with_metadata(_onnx_bytes_naflex(graph, naflex_probe(spec, net.patch_size)), metadata)
        f.write(model)
        f.flush()
        for n in (max(1, spec.max_seq_len // 2), spec.max_seq_len):  # two sequence lengths: N really is dynamic
            diffs.append(check_onnx(net, model, naflex_probe(spec, net.patch_size, max_seq_len=n)))

    try:
        atomic_write(out, write)
    except ExportCheckError as e:
        raise ExportCheckError(f"{e}; nothing was written to {out}") from None
    return max(diffs)


def consumer_metadata(net: nn.Module, spec: InputSpec, class_names: list | None = None, *,
                      kind: TaskKind | None = None) -> dict[str, str]:
    """The ``metadata_props`` of a classifier export: strings (lists and sizes as JSON) that let someone
    with only the file feed it an image and name its answer, as ``vitpipe.data.preprocess`` does."""
    n = int(net.num_classes)
    names = [str(c) for c in class_names] if class_names and len(class_names) == n else [str(i) for i in range(n)]
    kind = kind or KINDS["multiclass"]
    read = kind.onnx_outputs  # how the logits become probabilities: softmax, or a sigmoid per class
    meta = {
        "producer": "vitpipe",
        "task": kind.name,
        "num_classes": str(n),
        "label_names": json.dumps(names),  # in logit order
        "outputs": f"logits (batch, {n}) in label_names order; {read}",
        "image_mode": spec.mode,  # PIL mode a file is converted to first
        "input_size": json.dumps([spec.in_chans, *spec.img_size]),  # (C, H, W) of the input
        "mean": json.dumps(list(spec.mean)),  # per input channel
        "std": json.dumps(list(spec.std)),
        "interpolation": spec.interpolation,
        "crop_mode": spec.crop_mode,
        "crop_pct": str(spec.crop_pct),
    }
    if spec.max_seq_len is not None:
        meta |= {"inputs": ", ".join(NAFLEX_KEYS), "max_seq_len": str(spec.max_seq_len),
                 "patch_size": json.dumps(list(net.patch_size)),
                 "preprocess": "convert to image_mode, pixels / 255, (x - mean) / std per channel, then resize at the "
                               f"image's own aspect ({spec.interpolation}) to the largest grid of at most max_seq_len "
                               "patches of patch_size; patches in timm NaFlex order (row-major, (p, q, C) each)"}
    else:
        fit = ("resize the shorter side to the input size / crop_pct, centre crop to input_size"
               if spec.crop_mode == "center" else "resize (squash) to input_size")
        meta |= {"inputs": "images", "preprocess": f"convert to image_mode, {fit} ({spec.interpolation}), pixels / 255, "
                                                   "(x - mean) / std per channel; a grayscale image repeated to "
                                                   "input_size's channels"}
    return meta


def with_metadata(model: bytes, metadata: dict[str, str] | None) -> bytes:
    """``model`` with ``metadata`` added to its ``metadata_props`` (unchanged when there is none)."""
    if not metadata:
        return model
    import onnx

    proto = onnx.load_from_string(model)
    for key, value in metadata.items():
        proto.metadata_props.add(key=str(key), value=str(value))
    return proto.SerializeToString()


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


def _quiet_export(module: nn.Module, args: tuple, dynamic_shapes, input_names: list[str]) -> bytes:
    for name in ("onnx_ir", "onnxscript"):  # their INFO lines narrate graph passes
        logging.getLogger(name).setLevel(logging.WARNING)
    with contextlib.redirect_stdout(io.StringIO()):  # the exporter narrates each step on stdout
        program = torch.onnx.export(module, args, None, dynamo=True, dynamic_shapes=dynamic_shapes,
                                    input_names=input_names, output_names=["logits"], verbose=False)
    model = program.model_proto
    _drop_stack_traces(model)
    return model.SerializeToString()


def _onnx_bytes_naflex(graph: nn.Module, batch: dict) -> bytes:
    B, N = torch.export.Dim("batch", min=1), torch.export.Dim("seq", min=1)
    args = tuple(batch[k] for k in NAFLEX_KEYS)
    return _quiet_export(graph, args, tuple({0: B, 1: N} for _ in args), list(NAFLEX_KEYS))


class NaFlexGraph(nn.Module):
    """``net``'s patch-dict forward as one traceable graph, for images of at most ``max_seq_len`` patches.

    ``forward(patches (B, N, p*q*C), patch_coord (B, N, 2), patch_valid (B, N)) -> logits (B, classes)``.
    The model computes positions per image grid (a Python loop over the batch's grids: not one graph);
    here the positions of every grid h * w <= max_seq_len are computed once by the model's own
    ``pos_embed.forward_naflex`` and read per token at ``offset[h, w] + row * w + col``."""

    def __init__(self, net: nn.Module, max_seq_len: int) -> None:
        super().__init__()
        from vitpipe.nn.pos_embed import RoPE2D

        if isinstance(net.pos_embed, RoPE2D):
            raise ConfigError("format=onnx for a NaFlex checkpoint takes additive positions (learned, learned2d, "
                              "sincos1d/2d, none); pos_embed=rope2d rotates q/k per image grid: not exported")
        if getattr(net, "rope", None) is not None:  # EVA-02's rotary phases beside the table: per grid, like rope2d
            raise ConfigError("format=onnx for a NaFlex checkpoint takes additive positions only; model.rope=true "
                              "rotates q/k per image grid: not exported (export format=timm, or train with rope=false)")
        self.net, P, L = net, net.num_prefix_tokens, max_seq_len
        offsets, tables, n = torch.zeros(L + 1, L + 1, dtype=torch.long), [], 0
        with torch.no_grad():
            for h in range(1, L + 1):
                for w in range(1, L // h + 1):
                    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
                    coord = torch.stack([rows.flatten(), cols.flatten()], dim=1)[None]  # (1, h*w, 2)
                    zeros = torch.zeros(1, P + h * w, net.dim)
                    pe = net.pos_embed.forward_naflex(zeros, coord, torch.tensor([[h, w]]))[0]  # (P + h*w, dim)
                    offsets[h, w] = n
                    tables.append(pe[P:])
                    n += h * w
        self.register_buffer("offsets", offsets)  # (L + 1, L + 1): first row of grid (h, w) in table
        self.register_buffer("table", torch.cat(tables))  # (sum of h*w, dim)
        self.register_buffer("prefix_pos", pe[:P].clone())  # (P, dim): the same for every grid

    def forward(self, patches: Tensor, patch_coord: Tensor, patch_valid: Tensor) -> Tensor:
        net, valid = self.net, patch_valid
        coord = patch_coord.long() * valid[..., None]  # padding at (0, 0), as check_batch does
        sizes = coord.amax(dim=1) + 1  # (B, 2): each image's grid
        h, w = sizes[:, 0:1], sizes[:, 1:2]  # (B, 1) each
        idx = self.offsets[h, w] + coord[..., 0] * w + coord[..., 1]  # (B, N)
        x = net.patch_embed.embed_patches(patches) + self.table[idx.clamp(max=self.table.shape[0] - 1)]  # (B, N, dim)
        tokens = [t for t in (net.cls_token, net.dist_token, net.reg_token) if t is not None]
        if tokens:
            prefix = torch.cat(tokens, dim=1) + self.prefix_pos[None]  # (1, P, dim)
            x = torch.cat([prefix.expand(x.shape[0], -1, -1), x], dim=1)  # (B, P + N, dim)
        padding = torch.cat([valid.new_zeros(x.shape[0], net.num_prefix_tokens), ~valid], dim=1)  # (B, P + N)
        for blk in net.blocks:
            x = blk(x, key_padding_mask=padding)
        x = net.norm(x)
        logits = net.forward_head(x, patch_valid=valid)
        if net.dist_token is not None:  # DeiT at test time: the two heads averaged (ViT.forward)
            logits = (logits + net.head_dist(net.head_drop(x[:, 1]))) / 2
        return logits


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
    feeds = {k: x[k].numpy() for k in NAFLEX_KEYS} if isinstance(x, dict) else {"images": x.numpy()}
    got = torch.from_numpy(session.run(None, feeds)[0])
    where = "" if isinstance(model, bytes) else f" from {model}"
    return check_logits(got, net, x, tolerance=ONNX_TOLERANCE, differs=f"onnxruntime's logits{where} differ from PyTorch's")
