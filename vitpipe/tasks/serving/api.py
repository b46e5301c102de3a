"""``ImageAPI``: LitServe's LitAPI over the predict path (the ``vitpipe.inference`` library predict calls).

``setup`` loads the checkpoint as ``scripts/predict.py`` does (``load_predictor``: the resolver, the
safe loader, the eval transform, the calibration temperature); ``decode_request`` turns one request
into the transformed image or a ``RequestError``; ``predict`` runs the good ones of a batch as one
forward pass (``class_probs``, or ``captions``); ``encode_response`` answers each request on its own:
``{"labels", "probs"}`` (plus ``"explain"``) or ``{"caption"}``; for a multi-label checkpoint ``labels``
are every class at or above its threshold, with ``"topk": {"labels", "probs"}`` (``label_sets``), with the
number of requests its batch held in the ``X-Batch-Size`` header; a refused request gets its status and ``{"detail": "..."}``.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import litserve as ls
import numpy as np
import torch
from fastapi.responses import JSONResponse
from omegaconf import OmegaConf
from PIL import Image

from vitpipe.inference.explain import explain, method_name, methods_for
from vitpipe.inference.images import to_device
from vitpipe.inference.labels import label_names, label_sets, top_labels
from vitpipe.inference.load import captions, load_predictor
from vitpipe.inference.probs import class_probs
from vitpipe.tasks.serving.decode import Refused, RequestError, image_bytes, read_image

BATCH_HEADER = "X-Batch-Size"
# a classifier's answers per kind (``kind.name``) from (probabilities, names, the Predictor, topk): the top-k
# ranking, or the label set at the Predictor's thresholds with the top-k beside it
BODIES = {
    "multiclass": lambda probs, names, loaded, topk: top_labels(probs, names, topk),
    "multilabel": lambda probs, names, loaded, topk: label_sets(probs, names, loaded.thresholds, topk),
}


def explain_choices(loaded) -> tuple[str, ...]:
    """What ``explain`` can draw for a ``load_predictor`` result (canonical names,
    ``vitpipe.inference.explain.methods_for``): both rollouts for a fixed-size classifier, attention rollout
    on each image's own grid for a NaFlex one, nothing for a captioner or a network without attention
    (``model=timm``, e.g. a CNN)."""
    if not loaded.kind.classifies:
        return ()
    return methods_for(loaded.net, naflex=loaded.preprocess.max_seq_len is not None)


@dataclass
class Decoded:
    x: object  # (C, H, W) tensor or a NaFlex patch dict
    image: Image.Image | None  # kept for explain (the overlay is drawn on it)
    explain: str | None  # the method's canonical name (vitpipe.inference.explain)


@dataclass
class Answer:
    body: dict
    batch_size: int


class OnnxNet:
    """An exported ONNX file (``scripts/export.py format=onnx``) called like the network: images
    (B, C, H, W) or a NaFlex patch dict -> logits (B, classes), in onnxruntime on the CPU."""

    def __init__(self, path: str, patch_size) -> None:
        import onnxruntime as ort

        self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        self.patch_size = patch_size

    def __call__(self, x) -> torch.Tensor:
        feeds = {k: v.cpu().numpy() for k, v in x.items()} if isinstance(x, dict) else {"images": x.cpu().numpy()}
        return torch.from_numpy(self.session.run(None, feeds)[0])


class ImageAPI(ls.LitAPI):
    """Settings only (plain values: this object is pickled into each worker); the model loads in ``setup``."""

    def __init__(self, *, ckpt_path: str, paths: dict, topk: int = 5, tta: str = "none", onnx_path: str | None = None,
                 head_fusion: str = "mean", discard_ratio: float = 0.0, threshold: float | None = None, **litapi) -> None:
        super().__init__(**litapi)
        self.ckpt_path, self.paths, self.topk, self.tta, self.onnx_path = ckpt_path, paths, topk, tta, onnx_path
        self.threshold = threshold  # multi-label: one threshold for all classes; None: thresholds.json or the run's
        self.head_fusion, self.discard_ratio = head_fusion, discard_ratio

    def setup(self, device) -> None:
        self.loaded = load_predictor(self.ckpt_path, paths=OmegaConf.create(self.paths), task_name="serve",
                                     device=device, tta=self.tta, threshold=self.threshold)
        self.device = torch.device(device)
        net = self.loaded.net
        self.model = OnnxNet(self.onnx_path, getattr(net, "patch_size", None)) if self.onnx_path else net
        self.names = label_names(self.loaded.built.class_names, int(net.num_classes)) if self.loaded.kind.classifies else None
        self.explain_choices = explain_choices(self.loaded)

    # ------------------------------------------------------------------ one request

    def decode_request(self, request):
        """The parsed body -> ``Decoded``, or the ``RequestError`` it is refused with."""
        try:
            explain = request.get("explain") if hasattr(request, "get") else None
            if explain is not None and method_name(explain) not in self.explain_choices:
                valid = ", ".join(self.explain_choices) or "none for this checkpoint"
                raise Refused(400, f"explain={explain!r} is not available; valid: {valid}")
            explain = None if explain is None else method_name(explain)
            image = read_image(image_bytes(request), self.loaded.preprocess.spec.mode)
            try:
                x = self.loaded.preprocess(image)
            except Exception as e:  # noqa: BLE001 - an image the transform cannot take (e.g. too small to patchify)
                why = (str(e).splitlines() or [type(e).__name__])[0]
                raise Refused(422, f"the image cannot be preprocessed ({why})") from None
            return Decoded(x=x, image=image if explain else None, explain=explain)
        except Refused as e:
            return e.error

    def batch(self, inputs):
        return inputs  # stacked in predict, the refused ones left out

    def unbatch(self, output):
        return output

    # ------------------------------------------------------------------ a batch

    def predict(self, x):
        """Answers for a batch (a list; with max_batch_size=1 LitServe passes one request, not a list)."""
        items = x if isinstance(x, list) else [x]
        good = [i for i, item in enumerate(items) if isinstance(item, Decoded)]
        out = list(items)
        if good:
            batch = to_device(self.loaded.preprocess.collate([items[i].x for i in good]), self.device)
            with torch.inference_mode():
                kind = self.loaded.kind
                if kind.generates:
                    bodies = [{"caption": c} for c in captions(self.loaded, batch)]
                else:
                    probs = class_probs(self.model, batch, kind=kind, tta=self.tta, temperature=self.loaded.temperature)
                    bodies = BODIES[kind.name](probs.cpu(), self.names, self.loaded, self.topk)
            for i, body in zip(good, bodies):
                out[i] = Answer(body=body, batch_size=len(items))
                if items[i].explain:
                    try:
                        body["explain"] = self.explain(items[i])
                    except Exception as e:  # noqa: BLE001 - this request's map only; the others are answered
                        out[i] = RequestError(500, f"explain={items[i].explain} failed: {str(e).splitlines()[0]}")
        return out if isinstance(x, list) else out[0]

    def explain(self, item: Decoded) -> dict:
        """``{"method", "grid": [[...]] (h, w), "png": base64 PNG of the map over the image}`` (torch network);
        ``method`` is the canonical name (``gradient_rollout`` is answered as ``gradient``)."""
        from vitpipe.nn.naflex import pad_batch
        from vitpipe.viz.overlay import overlay

        # a batch of one: NaFlex (the edge offers rollout only) on the image's own grid; gradient: the predicted class
        x = to_device(pad_batch([item.x]), self.device) if isinstance(item.x, dict) else item.x[None].to(self.device)
        grid = explain(self.loaded.net, x, item.explain, head_fusion=self.head_fusion,
                       discard_ratio=self.discard_ratio)[0]
        grid = grid.float().cpu()  # (h, w)
        blended = overlay(item.image, grid)  # (H, W, 3) in [0, 1]
        buf = io.BytesIO()
        Image.fromarray((blended * 255).round().astype(np.uint8)).save(buf, format="PNG")
        return {"method": item.explain, "grid": grid.tolist(), "png": base64.b64encode(buf.getvalue()).decode()}

    def encode_response(self, output):
        if isinstance(output, RequestError):
            return JSONResponse({"detail": output.message}, status_code=output.status)
        return JSONResponse(output.body, headers={BATCH_HEADER: str(output.batch_size)})
