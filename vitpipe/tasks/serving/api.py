"""``ImageAPI``: LitServe's LitAPI over the predict path (``vitpipe.tasks.predict``).

``setup`` loads the checkpoint as ``scripts/predict.py`` does (``load_predictor``: the resolver, the
safe loader, the eval transform, the calibration temperature); ``decode_request`` turns one request
into the transformed image or a ``RequestError``; ``predict`` runs the good ones of a batch as one
forward pass (``class_probs``, or ``captions``); ``encode_response`` answers each request on its own:
``{"labels", "probs"}`` (plus ``"explain"``) or ``{"caption"}``; for a multi-label checkpoint ``labels``
are every class at or above its threshold, with ``"topk": {"labels", "probs"}`` (``label_sets``), with the number of requests its batch
held in the ``X-Batch-Size`` header; a refused request gets its status and ``{"detail": "..."}``.
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

from vitpipe.tasks.predict import (
    captions,
    class_probs,
    label_names,
    label_sets,
    load_predictor,
    to_device,
    top_labels,
)
from vitpipe.tasks.serving.decode import Refused, RequestError, image_bytes, read_image

BATCH_HEADER = "X-Batch-Size"


def explain_choices(loaded) -> tuple[str, ...]:
    """What ``explain`` can draw for a ``load_predictor`` result: both rollouts for a fixed-size classifier,
    attention rollout on each image's own grid for a NaFlex one, nothing for a captioner or a network
    without attention (``model=timm``, e.g. a CNN)."""
    from vitpipe.models.vit import ViT

    if loaded.captioner or not isinstance(loaded.net, ViT):
        return ()
    return ("rollout",) if loaded.preprocess.max_seq_len is not None else ("rollout", "gradient_rollout")


@dataclass
class Decoded:
    x: object  # (C, H, W) tensor or a NaFlex patch dict
    image: Image.Image | None  # kept for explain (the overlay is drawn on it)
    explain: str | None


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
        self.names = None if self.loaded.captioner else label_names(self.loaded.built.class_names, int(net.num_classes))
        self.explain_choices = explain_choices(self.loaded)

    # ------------------------------------------------------------------ one request

    def decode_request(self, request):
        """The parsed body -> ``Decoded``, or the ``RequestError`` it is refused with."""
        try:
            explain = request.get("explain") if hasattr(request, "get") else None
            if explain is not None and explain not in self.explain_choices:
                valid = ", ".join(self.explain_choices) or "none for this checkpoint"
                raise Refused(400, f"explain={explain!r} is not available; valid: {valid}")
            image = read_image(image_bytes(request), self.loaded.preprocess.spec.mode)
            try:
                x = self.loaded.preprocess(image)
            except Exception as e:  # noqa: BLE001 - an image the transform cannot take (e.g. too small to patchify)
                raise Refused(422, f"the image cannot be preprocessed ({(str(e).splitlines() or [type(e).__name__])[0]})")
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
                if self.loaded.captioner:
                    bodies = [{"caption": c} for c in captions(self.loaded, batch)]
                else:
                    probs = class_probs(self.model, batch, tta=self.tta, temperature=self.loaded.temperature,
                                        multilabel=self.loaded.multilabel)
                    bodies = (label_sets(probs.cpu(), self.names, self.loaded.thresholds, self.topk)
                              if self.loaded.multilabel else top_labels(probs.cpu(), self.names, self.topk))
            for i, body in zip(good, bodies):
                out[i] = Answer(body=body, batch_size=len(items))
                if items[i].explain:
                    try:
                        body["explain"] = self.explain(items[i])
                    except Exception as e:  # noqa: BLE001 - this request's map only; the others are answered
                        out[i] = RequestError(500, f"explain={items[i].explain} failed: {str(e).splitlines()[0]}")
        return out if isinstance(x, list) else out[0]

    def explain(self, item: Decoded) -> dict:
        """``{"method", "grid": [[...]] (h, w), "png": base64 PNG of the map over the image}`` (torch network)."""
        from vitpipe.nn.naflex import pad_batch
        from vitpipe.viz.overlay import overlay
        from vitpipe.viz.rollout import gradient_rollout, naflex_rollout_for_model, rollout_for_model

        net, kw = self.loaded.net, dict(discard_ratio=self.discard_ratio)
        if isinstance(item.x, dict):  # NaFlex: the image on its own grid (the edge offers rollout only)
            grid = naflex_rollout_for_model(net, to_device(pad_batch([item.x]), self.device),
                                            head_fusion=self.head_fusion, **kw)[0]
        elif item.explain == "rollout":
            grid = rollout_for_model(net, item.x[None].to(self.device), head_fusion=self.head_fusion, **kw)[0]
        else:
            with torch.inference_mode(False), torch.enable_grad():
                grid = gradient_rollout(net, item.x[None].to(self.device).clone(), **kw)[0]  # predicted class
        grid = grid.detach().float().cpu()  # (h, w)
        blended = overlay(item.image, grid)  # (H, W, 3) in [0, 1]
        buf = io.BytesIO()
        Image.fromarray((blended * 255).round().astype(np.uint8)).save(buf, format="PNG")
        return {"method": item.explain, "grid": grid.tolist(), "png": base64.b64encode(buf.getvalue()).decode()}

    def encode_response(self, output):
        if isinstance(output, RequestError):
            return JSONResponse({"detail": output.message}, status_code=output.status)
        return JSONResponse(output.body, headers={BATCH_HEADER: str(output.batch_size)})
