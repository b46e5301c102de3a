"""``serve(cfg)``: the body of ``scripts/serve.py``: an HTTP endpoint over the predict path (LitServe).

    python scripts/serve.py ckpt_path=<ckpt | run dir | last> [port=8000 max_batch_size=32 batch_timeout_ms=10
                            workers_per_device=1 backend=torch|onnx]

``POST /predict`` with ``{"image": "<base64 of the file>"}`` or a multipart form (file in field
``image``) -> ``{"labels": [...], "probs": [...]}`` (top-k, ``scripts/predict.py``'s probabilities:
the checkpoint's eval transform, its calibration temperature), ``{"caption": ...}`` for captioners;
``?explain=rollout|gradient`` adds the attention map (``vitpipe.inference.explain``; ``gradient_rollout``
is read as ``gradient``). Requests are batched dynamically
(LitServe's ``max_batch_size`` / ``batch_timeout``). ``backend=onnx`` runs an exported ONNX file
(``onnx_path``, checked against the checkpoint at start-up; exported here when not given) in
onnxruntime. ``GET /health`` is 200 ``ok`` once the workers are ready; ``GET /info`` shows the model
and the batch settings. Slow clients: ``header_timeout_s`` / ``body_timeout_s`` (408, closed),
``keep_alive_s`` and ``max_connections`` (``vitpipe.tasks.serving.connections``). docs/serving.md has the
request and error reference.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from vitpipe.config.options import FD_MARGIN, open_files_limit
from vitpipe.config.preflight import preflight
from vitpipe.errors import ConfigError

INSTALL = 'pip install -e ".[serve]"'


def require(module: str, what: str):
    """``importlib.import_module(module)``, or ConfigError with the install command."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{what} needs {module}, which is not installed: {INSTALL}") from None


DEFAULT_CONNECTIONS = 256  # max_connections=null: this, or fewer where ulimit -n is low (macOS: 256)


def connection_bound(cfg: DictConfig) -> int:
    """``max_connections``, or for null ``DEFAULT_CONNECTIONS`` within ``ulimit -n`` less ``FD_MARGIN``."""
    if cfg.get("max_connections") is not None:
        return int(cfg.max_connections)
    soft = open_files_limit()
    return DEFAULT_CONNECTIONS if soft is None else max(1, min(DEFAULT_CONNECTIONS, soft - FD_MARGIN))


def onnx_file(cfg: DictConfig, loaded) -> str:
    """The ONNX file to serve: ``onnx_path`` checked against the checkpoint's network (logits within
    1e-4 in onnxruntime, as scripts/export.py checks its own), or, when not given, exported now
    (``vitpipe.export.onnx_format.export_onnx``) into the run directory."""
    import torch

    from vitpipe.export.onnx_format import check_onnx, export_onnx
    from vitpipe.export.timm_format import naflex_probe

    require("onnxruntime", "backend=onnx")
    if not loaded.kind.classifies:
        raise ConfigError("backend=onnx serves classifiers; this checkpoint is a captioner: use backend=torch")
    net, spec = loaded.net.cpu(), loaded.preprocess.spec
    if not cfg.get("onnx_path"):
        from vitpipe.tasks.export import onnx_metadata

        out = Path(cfg.paths.output_dir) / "model.onnx"
        thresholds = None if loaded.thresholds is None else loaded.thresholds.tolist()  # as export's file says
        diff = export_onnx(net, spec, out, kind=loaded.kind, metadata=onnx_metadata(thresholds, loaded.built.class_names),
                           class_names=loaded.built.class_names)
        print(f"vitpipe serve: exported {out} (onnxruntime logits within {diff:.2g} of PyTorch's)", flush=True)
        return str(out)
    probe = (naflex_probe(spec, net.patch_size) if spec.max_seq_len is not None
             else torch.randn(3, spec.in_chans, *spec.img_size))
    check_onnx(net, Path(str(cfg.onnx_path)), probe)  # ExportCheckError: another network's file
    return str(cfg.onnx_path)


def banner(cfg: DictConfig, loaded, onnx_path: str | None) -> str:
    """What start-up prints: the URL, the model, the classes, the batch settings."""
    net = loaded.net
    url = f"http://{cfg.host}:{cfg.port}"
    model = f"{type(net).__name__} {loaded.built.cfg.model.get('name', '')}".strip()
    lines = [f"vitpipe serve: POST {url}/predict  (health: {url}/health, info: {url}/info)",
             f"  model: {loaded.path} ({model}; backend={cfg.backend}{f' {onnx_path}' if onnx_path else ''}, "
             f"device={cfg.device})"]
    if loaded.kind.generates:
        lines.append("  answers: captions")
    else:
        from vitpipe.inference.labels import label_names

        names = label_names(loaded.built.class_names, int(net.num_classes))
        shown = ", ".join(names[:20]) + (f", ... ({len(names) - 20} more)" if len(names) > 20 else "")
        temp = f"; temperature {loaded.temperature:g} (calibration.json)" if loaded.temperature else ""
        lines.append(f"  classes ({len(names)}): {shown}; top-{min(cfg.topk, len(names))}, tta={cfg.tta}{temp}")
        if loaded.thresholds is not None:  # multi-label
            t = loaded.thresholds
            lines.append(f"  multi-label: every class with sigmoid >= its threshold ({float(t.min()):.3g}..{float(t.max()):.3g})")
    lines.append(f"  batching: max_batch_size={cfg.max_batch_size}, batch_timeout_ms={cfg.batch_timeout_ms:g}, "
                 f"workers_per_device={cfg.workers_per_device}; body limit {cfg.max_body_mb:g} MB")
    lines.append(f"  connections: at most {connection_bound(cfg)} open; headers within {cfg.header_timeout_s:g} s, "
                 f"body within {cfg.body_timeout_s:g} s (else 408), idle keep-alive closed after {cfg.keep_alive_s:g} s")
    return "\n".join(lines)


def build_server(cfg: DictConfig, loaded, onnx_path: str | None):
    """The LitServer: ``ImageAPI`` behind the ``RequestGate`` edge."""
    ls = require("litserve", "scripts/serve.py")
    from vitpipe.tasks.serving.api import ImageAPI, explain_choices
    from vitpipe.tasks.serving.edge import RequestGate

    api = ImageAPI(ckpt_path=str(loaded.path), paths=OmegaConf.to_container(cfg.paths, resolve=True), topk=cfg.topk,
                   tta=cfg.tta, onnx_path=onnx_path, head_fusion=cfg.head_fusion, discard_ratio=cfg.discard_ratio,
                   threshold=cfg.get("threshold"),
                   max_batch_size=cfg.max_batch_size, batch_timeout=cfg.batch_timeout_ms / 1000)
    gate = (RequestGate, {"path": "/predict", "max_body_bytes": int(cfg.max_body_mb * 1e6),
                          "explain_choices": explain_choices(loaded)})
    return ls.LitServer(api, accelerator=cfg.device, workers_per_device=cfg.workers_per_device,
                        timeout=cfg.timeout_s, middlewares=[gate], model_metadata=server_info(cfg, loaded, onnx_path))


def server_info(cfg: DictConfig, loaded, onnx_path: str | None) -> dict:
    """What ``GET /info`` answers: the checkpoint, the backend, the batch settings, the ``explain``
    methods, and what ``/predict`` answers: ``task`` (``multiclass``: top-k softmax; ``multilabel``:
    every class with sigmoid >= its threshold, ``thresholds`` per class; ``caption``), the classes, top-k,
    TTA and the calibration temperature applied."""
    from vitpipe.tasks.serving.api import explain_choices

    info = {"checkpoint": str(loaded.path), "backend": cfg.backend, "onnx_path": onnx_path,
            "captioner": loaded.kind.generates, "max_batch_size": cfg.max_batch_size,
            "batch_timeout_ms": cfg.batch_timeout_ms, "explain": list(explain_choices(loaded))}
    if loaded.kind.generates:
        return {**info, "task": "caption"}
    from vitpipe.inference.labels import label_names

    names = label_names(loaded.built.class_names, int(loaded.net.num_classes))
    info.update(task=loaded.kind.name, classes=names,
                topk=min(int(cfg.topk), len(names)), tta=cfg.tta,
                temperature=float(loaded.temperature) if loaded.temperature else None)
    if loaded.thresholds is not None:  # multi-label
        info["thresholds"] = {n: float(t) for n, t in zip(names, loaded.thresholds.tolist())}
    return info


def http_options(cfg: DictConfig) -> dict:
    """uvicorn's options for slow clients: its own idle keep-alive timeout, and its HTTP protocol with read
    deadlines and a connection bound (``vitpipe.tasks.serving.connections``; uvicorn has neither)."""
    from vitpipe.tasks.serving.connections import guarded_protocol

    return {"timeout_keep_alive": cfg.keep_alive_s,
            "http": guarded_protocol(header_timeout_s=cfg.header_timeout_s, body_timeout_s=cfg.body_timeout_s,
                                     max_connections=connection_bound(cfg))}


def stop_on_sigterm() -> None:
    """SIGTERM to this process runs LitServe's Ctrl-C shutdown (its worker and HTTP processes stopped with
    it); the HTTP processes it forks inherit the handler and get the default behaviour back."""
    main = os.getpid()

    def handler(signum, frame):
        if os.getpid() == main:
            raise KeyboardInterrupt
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)


def serve(cfg: DictConfig) -> None:
    """Load, check, print the banner, serve until stopped (Ctrl-C or SIGTERM)."""
    from vitpipe.inference.load import load_predictor

    preflight(cfg, "serve")  # every option, before litserve is imported or the checkpoint read
    require("litserve", "scripts/serve.py")
    loaded = load_predictor(cfg.ckpt_path, paths=cfg.paths, task_name=cfg.task_name, device="cpu", tta=cfg.tta,
                            threshold=cfg.get("threshold"))
    onnx_path = onnx_file(cfg, loaded) if cfg.backend == "onnx" else None
    server = build_server(cfg, loaded, onnx_path)
    print(banner(cfg, loaded, onnx_path), flush=True)
    del loaded  # the workers load their own copy on their device
    stop_on_sigterm()
    server.run(host=cfg.host, port=cfg.port, generate_client_file=False, log_level=cfg.log_level, **http_options(cfg))
    sys.stdout.flush()
