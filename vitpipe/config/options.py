"""The options of the commands that read a stored run (predict, visualize, demo, serve, export): each value against its
type, range and choices, one ``ConfigError`` line naming the key, run by ``vitpipe.config.preflight`` before
any checkpoint, image or optional dependency is touched.

The choices the options take live here, below the libraries that act on them, so the one config check can
read them: ``TTAS`` (``vitpipe.inference.tta``), the explanation methods ``METHODS`` with their alias
(``vitpipe.inference.explain`` dispatches them), the rollout settings and the faithfulness fills.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from omegaconf import DictConfig

from vitpipe.errors import ConfigError, check_int

TTAS = ("none", "hflip")  # test-time augmentation: none, or the mean of an image's and its mirror's softmax

# attention-map methods (canonical names): attention rollout (Abnar & Zuidema 2020), gradient rollout
# (Chefer et al. 2021); ``gradient_rollout``, the spelling serve's ``?explain=`` used, reads as ``gradient``
METHODS = ("rollout", "gradient")
ALIASES = {"gradient_rollout": "gradient"}
FUSIONS = ("mean", "max", "min")  # how attention rollout fuses heads (vitpipe.viz.rollout)
FILLS = ("mean", "blur")  # what a deleted patch becomes in the faithfulness curves (vitpipe.viz.faithfulness)

VISUALIZE_METHODS = (*METHODS, "heads", "all")  # also the names of visualize's folders and grid files
SPLITS = ("val", "test")  # the data splits visualize's images= may name
OUT_SUFFIXES = (".csv", ".json")  # predict's out=
BACKENDS = ("torch", "onnx")  # serve's backend=
DEVICES = ("auto", "cpu", "cuda")  # serve's device=
FD_MARGIN = 64  # descriptors the server process holds besides its connections (sockets, pipes, files)
FORMATS = ("timm", "onnx")  # export's format=
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # export's push_to_hub=: a Hub repository id


# --------------------------------------------------------------------------- shared vocabulary


def method_name(method) -> str | None:
    """The canonical name of ``method`` (an alias mapped), or None when it names no method."""
    if not isinstance(method, str):
        return None
    return method if method in METHODS else ALIASES.get(method)


def check_method(method, valid: tuple[str, ...] = METHODS, *, key: str = "method") -> str:
    """``method``'s canonical name when it is one of ``valid``; ConfigError (one line, the valid names) otherwise."""
    name = method_name(method)
    if name is None or name not in valid:
        raise ConfigError(f"{key}={method!r} is not valid; choose one of {list(valid)}")
    return name


def check_tta(tta) -> None:
    if tta not in TTAS:
        raise ConfigError(f"tta={tta!r}; valid choices: {', '.join(TTAS)}")


def check_threshold(t) -> None:
    """``threshold=`` of predict and serve: null or a probability in [0, 1] (ConfigError otherwise)."""
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0):
        raise ConfigError(f"threshold={t!r}: null (tuned thresholds.json, else the run's module.threshold) "
                          "or a probability in [0, 1]")


def check_rollout_settings(*, head_fusion: str = "mean", discard_ratio: float = 0.0) -> None:
    """The one rule for the rollout options, applied where they enter: ``vitpipe.viz.rollout``'s functions,
    and before any data by ``visualize``, ``demo`` and ``RolloutCallback``."""
    if head_fusion not in FUSIONS:
        raise ConfigError(f"head_fusion={head_fusion!r} is not valid; choose one of {list(FUSIONS)}")
    if isinstance(discard_ratio, bool) or not isinstance(discard_ratio, (int, float)) or not 0 <= discard_ratio < 1:
        raise ConfigError(f"discard_ratio={discard_ratio!r} is not valid; use a number in [0, 1)")


def check_faithfulness_steps(steps) -> None:
    """``faithfulness_steps``: points on a deletion/insertion curve, a positive int or null (one per patch)."""
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ConfigError(f"faithfulness_steps={steps!r} is not valid; use a positive int, or null for one per patch")


def _at_least(cfg: DictConfig, minimums: tuple[tuple[str, int], ...]) -> None:
    for key, minimum in minimums:
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ConfigError(f"{key}={v!r}: expected an int >= {minimum}")


# --------------------------------------------------------------------------- predict


def check_out(spec) -> Path:
    """The file predict's ``out=`` names, after checking that it can be written: a .csv or .json name, not a
    folder, under folders that are folders (or can be made) in which this process may create files.
    ConfigError (one line naming ``out=`` and why) otherwise; nothing is created."""
    out = Path(str(spec))
    fix = "pass out=<a writable folder>/<name>.csv or .json"
    if out.suffix.lower() not in OUT_SUFFIXES:
        raise ConfigError(f"out={spec}: the file name must end in .csv or .json")
    if out.is_dir():
        raise ConfigError(f"out={spec} is a folder; {fix}")
    folder = out.parent
    while not folder.exists() and folder != folder.parent:  # the nearest folder that exists: the file goes under it
        folder = folder.parent
    if not folder.is_dir():
        raise ConfigError(f"out={spec}: {folder} is a file, not a folder; {fix}")
    try:  # the real test of permission (root ignores mode bits, read-only mounts refuse root too)
        tempfile.TemporaryFile(dir=folder).close()  # O_TMPFILE where it exists: never visible in the folder
    except OSError as e:
        raise ConfigError(f"out={spec}: cannot create files in {folder} ({e.strerror or e}); {fix}") from None
    return out


def check_model_tome_r(r) -> int | None:
    """``model_tome_r`` of eval and predict (ToMe at inference, ``vitpipe.inference.vit_options``), checked before anything
    loads: null (the run's own ``model.tome_r``) or an int >= 0."""
    if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
        raise ConfigError(f"model_tome_r={r!r}; use null (the run's own model.tome_r) or an int >= 0 (tokens merged "
                          "per block at inference; 0: off)")
    return r


def check_predict(cfg: DictConfig) -> None:
    _at_least(cfg, (("topk", 1), ("batch_size", 1), ("num_workers", 0)))
    check_tta(cfg.tta)
    check_threshold(cfg.get("threshold"))
    check_model_tome_r(cfg.get("model_tome_r"))
    check_out(cfg.out)


# --------------------------------------------------------------------------- visualize


def check_visualize(cfg: DictConfig) -> None:
    method = method_name(cfg.method) or cfg.method
    if method not in VISUALIZE_METHODS:
        raise ConfigError(f"method={cfg.method!r} is not valid; choose one of {list(VISUALIZE_METHODS)}")
    check_rollout_settings(head_fusion=cfg.head_fusion, discard_ratio=cfg.discard_ratio)
    for key in ("num_images", "max_words"):
        n = cfg.get(key)
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError(f"{key}={n!r} is not valid; use a positive int, or null for " +
                              ("every image" if key == "num_images" else "the decoder's max_len"))
    if cfg.get("faithfulness_fill", "mean") not in FILLS:
        raise ConfigError(f"faithfulness_fill={cfg.faithfulness_fill!r} is not valid; choose one of {list(FILLS)}")
    check_faithfulness_steps(cfg.get("faithfulness_steps"))
    t = cfg.get("target")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, str)) or (isinstance(t, int) and t < 0)):
        raise ConfigError(f"target={t!r} is not valid; use null (the predicted class), a class name or a class index >= 0")
    if t is not None and method not in ("gradient", "all"):
        raise ConfigError(f"target={t} picks the class gradient rollout explains; use method=gradient (or all)")
    if cfg.images is None or str(cfg.images) == "":
        raise ConfigError(f"images is not set; pass a folder of images or a data split: {list(SPLITS)}")
    if str(cfg.images) not in SPLITS and not Path(str(cfg.images)).is_dir():
        raise ConfigError(
            f"images={cfg.images}: neither a folder nor a data split; pass a folder of images or one of {list(SPLITS)}"
        )


# --------------------------------------------------------------------------- demo


def check_demo(cfg: DictConfig) -> None:
    check_method(cfg.method)  # either spelling
    check_tta(cfg.tta)
    check_rollout_settings(head_fusion=cfg.head_fusion, discard_ratio=cfg.discard_ratio)
    _at_least(cfg, (("topk", 1), ("num_examples", 0), ("display_size", 8)))
    port = cfg.get("port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535):
        raise ConfigError(f"port={port!r}: expected an int in 1..65535, or null for the first free one from 7860")
    if not isinstance(cfg.get("server_name"), str) or not cfg.server_name:
        raise ConfigError(f"server_name={cfg.get('server_name')!r}: expected a host name or address, e.g. 127.0.0.1")
    if not isinstance(cfg.alpha, (int, float)) or not 0.0 <= cfg.alpha <= 1.0:
        raise ConfigError(f"alpha={cfg.alpha!r} is not valid; use a number in [0, 1]")
    from matplotlib import colormaps

    if cfg.cmap not in colormaps:
        raise ConfigError(f"cmap={cfg.cmap!r} is not a matplotlib colormap; e.g. 'jet', 'viridis', 'inferno'")


# --------------------------------------------------------------------------- serve


def open_files_limit() -> int | None:
    """The soft ``ulimit -n`` of this process (None: unlimited)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def check_connection_bound(max_connections: int) -> None:
    """``max_connections`` must leave the server process descriptors of its own under ``ulimit -n``: past
    that, accepting one more connection fails in the server instead of refusing the client."""
    soft = open_files_limit()
    if soft is not None and max_connections > soft - FD_MARGIN:
        raise ConfigError(f"max_connections={max_connections}: this process may open {soft} files (ulimit -n); "
                          f"use at most {max(1, soft - FD_MARGIN)} or raise the limit")


def check_serve(cfg: DictConfig) -> None:
    check_int(cfg.port, "port", 1)
    if cfg.port > 65535:
        raise ConfigError(f"port={cfg.port}: expected an int in 1..65535")
    for key in ("max_batch_size", "workers_per_device", "topk"):
        check_int(cfg.get(key), key, 1)
    for key in ("batch_timeout_ms", "max_body_mb", "timeout_s", "header_timeout_s", "body_timeout_s", "keep_alive_s"):
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (key != "batch_timeout_ms" and v == 0):
            raise ConfigError(f"{key}={v!r}: expected a number {'>= 0' if key == 'batch_timeout_ms' else '> 0'}")
    if cfg.get("max_connections") is not None:
        check_int(cfg.max_connections, "max_connections", 1)
        check_connection_bound(int(cfg.max_connections))
    if cfg.backend not in BACKENDS:
        raise ConfigError(f"backend={cfg.backend!r}; valid choices: {', '.join(BACKENDS)}")
    if cfg.device not in DEVICES:
        raise ConfigError(f"device={cfg.device!r}; valid choices: {', '.join(DEVICES)}")
    if cfg.get("onnx_path") and cfg.backend != "onnx":
        raise ConfigError(f"onnx_path={cfg.onnx_path} is served with backend=onnx; add backend=onnx or drop onnx_path")
    if cfg.get("onnx_path") and not Path(str(cfg.onnx_path)).is_file():
        raise ConfigError(f"onnx_path={cfg.onnx_path}: no such file; export one with scripts/export.py format=onnx")
    check_threshold(cfg.get("threshold"))
    check_rollout_settings(head_fusion=cfg.head_fusion, discard_ratio=cfg.discard_ratio)


# --------------------------------------------------------------------------- export


def check_repo_id(repo_id: str) -> None:
    if not REPO_ID.fullmatch(str(repo_id)):
        raise ConfigError(f"push_to_hub={repo_id!r}: expected a Hub repository id <user or org>/<name>")


def check_export(cfg: DictConfig) -> None:
    """``format``, ``push_to_hub``, ``overwrite`` and the name of ``out`` against the format; whether ``out``
    can be written there is the command's (``vitpipe.tasks.export.output_path``: it needs the run layer)."""
    if cfg.format not in FORMATS:
        raise ConfigError(f"format={cfg.format!r}; valid choices: {', '.join(FORMATS)}")
    if cfg.get("push_to_hub"):
        if cfg.format != "timm":
            raise ConfigError(f"push_to_hub uploads a timm folder: use format=timm, not format={cfg.format}")
        check_repo_id(cfg.push_to_hub)
    if not isinstance(cfg.get("overwrite", False), bool):
        raise ConfigError(f"overwrite={cfg.overwrite!r}; valid: true (replace a non-empty out folder), false")
    if cfg.get("out") in (None, ""):
        return
    out = Path(str(cfg.out))
    if cfg.format == "onnx" and out.suffix.lower() != ".onnx":
        raise ConfigError(f"out={cfg.out}: an ONNX export is one file whose name ends in .onnx")
    if cfg.format == "onnx" and out.is_dir():
        raise ConfigError(f"out={cfg.out} is a folder; format=onnx writes one .onnx file: pass a file path")
    if cfg.format == "timm" and out.exists() and not out.is_dir():
        raise ConfigError(f"out={cfg.out} is a file; format=timm writes a folder: pass a folder path")
