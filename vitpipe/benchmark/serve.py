"""``--only serve``: scripts/serve.py under a bounded loopback load (dynamic batching against
max_batch_size=1), the server's model code without HTTP, and scripts/predict.py on the same files.

The checkpoint served is written as a training run stores one (weights, the stored config by the run
format's rule, class names) without training: the figures are about serving, not accuracy."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from PIL import Image

from vitpipe.benchmark.config import BenchConfig
from vitpipe.benchmark.recipe import CONF, compose_conf, recipe
from vitpipe.run.build import build_from_config
from vitpipe.run.files import atomic_write
from vitpipe.run.stored import CLASS_NAMES, CONFIG, STATE_DICT, stored_config
from vitpipe.tasks.predict import predict
from vitpipe.tasks.serving.api import ImageAPI
from vitpipe.tasks.serving.load import ServerProcess, hammer, load_summary


def serve_checkpoint(cfg: BenchConfig, folder: Path) -> Path:
    """A checkpoint of the recipe's network (random weights, data=synthetic at its own size) as a training
    run stores one: state_dict, the resolved config, class names."""
    train_cfg = recipe(cfg)
    dm, net, module = build_from_config(train_cfg)
    path = folder / "run" / "checkpoints" / "bench.ckpt"
    checkpoint = {STATE_DICT: module.state_dict(),
                  # by the rule a training run's checkpoints store their config (vitpipe.run.stored)
                  CONFIG: stored_config(OmegaConf.to_container(train_cfg, resolve=True)),
                  CLASS_NAMES: [f"class_{i}" for i in range(cfg.num_classes)]}
    atomic_write(path, lambda f: torch.save(checkpoint, f))
    return path


def serve_images(cfg: BenchConfig, folder: Path, count: int) -> list[Path]:
    """``count`` PNG files of random RGB pixels at the variant's size."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(cfg.seed)
    paths = []
    for i in range(count):
        pixels = torch.randint(0, 256, (cfg.size, cfg.size, 3), generator=g, dtype=torch.uint8).numpy()
        paths.append(folder / f"{i:04d}.png")
        Image.fromarray(pixels).save(paths[-1])
    return paths


def predict_throughput(cfg: BenchConfig, ckpt: Path, files: list[Path], folder: Path) -> dict:
    """Images/s of ``vitpipe.tasks.predict`` (scripts/predict.py's body, its default batch size) on
    ``files``: (n - 1) / (time for n files - time for one), the median over repeats: start-up (reading
    the checkpoint) taken out, as a running server has paid it."""
    one = folder / "one"
    one.mkdir(parents=True, exist_ok=True)
    shutil.copy(files[0], one / files[0].name)
    times = {"one": [], "all": []}
    for _ in range(cfg.repeats):
        for name, images in (("one", one), ("all", files[0].parent)):
            pcfg = compose_conf("predict", [
                f"ckpt_path={ckpt}", f"images={images}", f"out={folder / f'{name}.csv'}", f"device={cfg.device}",
                f"paths.root_dir={folder}", f"paths.output_dir={folder}"])
            start = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                predict(pcfg)
            times[name].append(time.perf_counter() - start)
    one_s, all_s = float(np.median(times["one"])), float(np.median(times["all"]))
    img_s = (len(files) - 1) / max(all_s - one_s, 1e-9)
    return {"images": len(files), "one_file_s": one_s, "all_files_s": all_s, "img_s": img_s, "step_s": 1 / img_s}


def api_throughput(cfg: BenchConfig, ckpt: Path, bodies: list[bytes]) -> dict:
    """Requests/s of the server's own model code without HTTP: ``ImageAPI`` (set up as a worker sets it
    up, in this process, torch's thread count as the worker has it) decoding, predicting and encoding
    the same JSON bodies in batches of 1 and of ``batch_size``; the median over repeats. Their ratio
    is what batching can give at most on this machine: the served ratio is bounded by it."""
    api = ImageAPI(ckpt_path=str(ckpt), paths={"log_dir": str(ckpt.parent), "data_dir": str(ckpt.parent)},
                   max_batch_size=cfg.batch_size)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        api.setup(cfg.device)
    requests = [json.loads(b) for b in bodies]

    def serve_all(size: int) -> float:
        start = time.perf_counter()
        for i in range(0, len(requests), size):
            decoded = [api.decode_request(r) for r in requests[i:i + size]]
            out = api.predict(api.batch(decoded) if size > 1 else decoded[0])
            for answer in (api.unbatch(out) if size > 1 else [out]):
                api.encode_response(answer)
        return time.perf_counter() - start

    out = {}
    for size in (1, cfg.batch_size):
        serve_all(size)  # warm-up
        wall = float(np.median([serve_all(size) for _ in range(cfg.repeats)]))
        out[f"batch_{size}"] = {"req_s": len(requests) / wall, "ms_per_request": 1e3 * wall / len(requests)}
    return out


def compare_serve(cfg: BenchConfig) -> dict:
    """scripts/serve.py under a bounded load on loopback: ``serve_requests`` requests per contender from
    ``serve_clients`` client threads, dynamic batching (``max_batch_size=batch_size``) against
    ``max_batch_size=1``, the two servers running side by side and taking turns (repeats alternate who
    goes first); requests/s, latency p50/p99, failures, the mean batch formed, each server's memory (RSS
    of all its processes) at the start and the end; and served throughput against
    ``vitpipe.tasks.predict`` on the same image files."""
    script = CONF.parent / "scripts" / "serve.py"
    settings = {"served_batched": cfg.batch_size, "served_unbatched": 1}
    per_repeat = [cfg.serve_requests // cfg.repeats + (r < cfg.serve_requests % cfg.repeats) for r in range(cfg.repeats)]
    with tempfile.TemporaryDirectory(prefix="vitpipe-bench-serve-") as tmp:
        tmp = Path(tmp)
        ckpt = serve_checkpoint(cfg, tmp)
        files = serve_images(cfg, tmp / "images", min(cfg.serve_requests, 512))
        bodies = [json.dumps({"image": base64.b64encode(f.read_bytes()).decode()}).encode() for f in files]
        servers = {name: ServerProcess(script, [f"ckpt_path={ckpt}", f"max_batch_size={size}", f"device={cfg.device}",
                                                f"hydra.run.dir={tmp / name}"], tmp / f"{name}.log")
                   for name, size in settings.items()}
        try:
            for server in servers.values():
                server.wait_ready()
            for server in servers.values():  # warm-up, untimed: first requests, allocator, connections
                hammer(server.port, bodies, requests=cfg.warmup * cfg.serve_clients, clients=cfg.serve_clients)
            memory = {name: {"start": server.memory()} for name, server in servers.items()}
            runs = {name: [] for name in servers}
            for repeat, count in enumerate(per_repeat):
                for name in (list(servers) if repeat % 2 == 0 else list(servers)[::-1]):
                    runs[name].append(hammer(servers[name].port, bodies, requests=count, clients=cfg.serve_clients))
            for name, server in servers.items():
                memory[name]["end"] = server.memory()
        finally:
            for server in servers.values():
                server.stop()
        offline = predict_throughput(cfg, ckpt, files, tmp / "predict")
        in_process = api_throughput(cfg, ckpt, bodies)
    load = {name: {**load_summary(r), "max_batch_size": settings[name], "memory": memory[name]}
            for name, r in runs.items()}
    contenders = {name: {"serve": {"step_s": 1 / s["req_s"] if s["req_s"] > 0 else float("inf"), "img_s": s["req_s"]}}
                  for name, s in load.items()}
    contenders["predict_py"] = {"predict": {"step_s": offline["step_s"], "img_s": offline["img_s"]}}
    ib, iu = in_process[f"batch_{cfg.batch_size}"], in_process["batch_1"]
    for name, figures in (("api_batched", ib), ("api_unbatched", iu)):  # the model code, no HTTP
        contenders[name] = {"serve": {"step_s": 1 / figures["req_s"], "img_s": figures["req_s"]}}
    b, u = load["served_batched"], load["served_unbatched"]
    ratios = {"req/s batched/unbatched": b["req_s"] / u["req_s"],
              "req/s batched/unbatched without HTTP (the bound)": ib["req_s"] / iu["req_s"],
              "req/s served/without HTTP, batched": b["req_s"] / ib["req_s"],
              "req/s served/without HTTP, unbatched": u["req_s"] / iu["req_s"],
              "p50 latency batched/unbatched": b["p50_ms"] / u["p50_ms"],
              "p99 latency batched/unbatched": b["p99_ms"] / u["p99_ms"],
              "req/s served batched/predict.py img/s": b["req_s"] / offline["img_s"]}
    return {"contenders": contenders, "ratios": ratios, "serve": load, "predict": offline, "in_process": in_process,
            "clients": cfg.serve_clients, "failed": sum(s["failed"] for s in load.values())}
