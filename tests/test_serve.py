"""scripts/serve.py: served answers equal scripts/predict.py's; batching; bad requests get a 4xx, not an outage.

Two server processes for the whole module (backend=torch with a calibration.json beside its checkpoint,
backend=onnx without one), each on 127.0.0.1 and a free port, started by a fixture and stopped by it
(SIGTERM to its PID, then SIGKILL to the process group it was started in). The other combinations
(torch without calibration, onnx with it, NaFlex, a captioner, a bad image inside a batch) run the
same ``ImageAPI`` in this process.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import tiny_checkpoints as tc
import torch
from conftest import make_cfg
from PIL import Image

from vitpipe.errors import ConfigError
from vitpipe.run.stored import load_checkpoint
from vitpipe.tasks.predict import predict

ROOT = Path(__file__).resolve().parents[1]
TEMPERATURE = 2.5
STARTUP_S = 150


# --------------------------------------------------------------------------- files


def write_images(folder: Path) -> list[Path]:
    """Images predict.py answers: sizes, modes (RGBA, palette, 16-bit gray, RGB JPEG, gray)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(3)
    Image.fromarray(rng.integers(0, 255, (23, 17, 3), dtype=np.uint8)).save(folder / "rgb.jpg", quality=95)
    Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(folder / "gray.png")
    Image.fromarray(rng.integers(0, 255, (12, 30, 4), dtype=np.uint8), "RGBA").save(folder / "rgba.png")
    Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).convert("P").save(folder / "palette.png")
    Image.fromarray(rng.integers(0, 65535, (16, 9)).astype(np.uint16)).save(folder / "deep16.png")
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (8 + 5 * i, 8 + 3 * i), dtype=np.uint8)).save(folder / f"digit{i}.png")
    return sorted(folder.iterdir())


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height gray pixels (a decompression bomb's signature; no real data)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def b64(path_or_bytes) -> str:
    data = path_or_bytes if isinstance(path_or_bytes, bytes) else Path(path_or_bytes).read_bytes()
    return base64.b64encode(data).decode()


def predicted(tmp: Path, ckpt: Path, images: Path, *overrides: str) -> dict[str, dict]:
    """scripts/predict.py's rows (JSON: unrounded) by file name."""
    cfg = make_cfg(tmp, [f"ckpt_path={ckpt}", f"images={images}", f"out={tmp / 'p.json'}", "device=cpu",
                         *overrides], config_name="predict")
    rows = json.loads(predict(cfg).read_text())
    return {Path(r["path"]).name: r for r in rows}


def ranked(row: dict) -> tuple[list[str], list[float]]:
    """(labels, probs) of a predict row, most probable first."""
    keys = [""] + [f"top{k}_" for k in range(2, 100) if f"top{k}_label" in row]
    return [row[f"{k}label"] for k in keys], [row[f"{k}prob"] for k in keys]


def assert_same(answer: dict, row: dict) -> None:
    labels, probs = ranked(row)
    assert answer["labels"] == labels
    assert np.allclose(answer["probs"], probs, atol=1e-5, rtol=0), (answer["probs"], probs)


def copy_checkpoint(src: Path, run: Path) -> Path:
    """The checkpoint in a run directory of its own (a calibration.json there touches no other test)."""
    dst = run / "checkpoints" / src.name
    dst.parent.mkdir(parents=True)
    shutil.copy(src, dst)
    return dst


def calibrate(ckpt: Path) -> None:
    from vitpipe.report.calibration import checkpoint_identity, write_calibration

    write_calibration(ckpt.parent, TEMPERATURE, identity=checkpoint_identity(ckpt, load_checkpoint(ckpt)), tta="none")


# --------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, url: str, proc: subprocess.Popen, log: Path) -> None:
        self.url, self.proc, self.log = url, proc, log

    def post(self, path: Path | bytes | None = None, *, json_body=None, query: str = "", timeout: float = 60, **kw):
        if path is not None:  # multipart upload of a file's bytes
            data = path if isinstance(path, bytes) else Path(path).read_bytes()
            kw["files"] = {"image": ("image", data, "application/octet-stream")}
        return requests.post(f"{self.url}/predict{query}", json=json_body, timeout=timeout, **kw)


def start_server(tmp: Path, *args: str) -> Server:
    """``scripts/serve.py`` as typed, from a fresh working directory, in a process group of its own."""
    tmp.mkdir(parents=True, exist_ok=True)
    port, log = free_port(), tmp / "server.log"
    cmd = [sys.executable, str(ROOT / "scripts" / "serve.py"), *args, f"port={port}", "device=cpu",
           f"hydra.run.dir={tmp / 'run'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Server(f"http://127.0.0.1:{port}", proc, log)


def wait_ready(server: Server) -> None:
    """Until /health says ok (bounded by STARTUP_S); fails with the server's log if it exits or never gets there."""
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, f"server exited {server.proc.returncode}:\n{server.log.read_text()[-3000:]}"
        try:
            if requests.get(f"{server.url}/health", timeout=2).text == "ok":
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    pytest.fail(f"server not ready in {STARTUP_S} s:\n{server.log.read_text()[-3000:]}")


def stop(servers: list[Server]) -> None:
    """SIGTERM to each server's PID (LitServe's own shutdown), then SIGKILL to whatever is left of the
    process group each was started in: only processes this test started."""
    for server in servers:
        server.proc.send_signal(signal.SIGTERM)
    for server in servers:
        try:
            server.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(server.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        server.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One checkpoint in two run directories (``calibrated`` with a calibration.json fitted on it, ``plain``
    without), its ONNX export (scripts/export.py's writer), and the images."""
    from vitpipe.export.onnx_format import export_onnx
    from vitpipe.inference.load import load_predictor

    base = tmp_path_factory.mktemp("serve")
    images = write_images(base / "images")
    made = tc.checkpoint("learned", base / "made")
    calibrated, plain = copy_checkpoint(made, base / "calibrated"), copy_checkpoint(made, base / "plain")
    calibrate(calibrated)
    loaded = load_predictor(plain)
    onnx = base / "model.onnx"
    export_onnx(loaded.net, loaded.preprocess.spec, onnx)
    return {"base": base, "images": images, "calibrated": calibrated, "plain": plain, "onnx": onnx}


@pytest.fixture(scope="module")
def servers(files):
    """backend=torch on the calibrated run directory (a 1 MB body limit), and backend=onnx on the plain
    checkpoint with the exported file; started together, stopped together."""
    base = files["base"]
    started = [start_server(base / "torch_server", f"ckpt_path={files['calibrated'].parent.parent}", "max_body_mb=1",
                            "batch_timeout_ms=30"),
               start_server(base / "onnx_server", f"ckpt_path={files['plain']}", "backend=onnx",
                            f"onnx_path={files['onnx']}")]
    try:
        for server in started:
            wait_ready(server)
        yield {"torch": started[0], "onnx": started[1]}
    finally:
        stop(started)


@pytest.fixture(scope="module")
def torch_server(servers):
    return servers["torch"]


@pytest.fixture(scope="module")
def onnx_server(servers):
    return servers["onnx"]


# --------------------------------------------------------------------------- served == predict.py


def test_torch_server_answers_equal_predict_with_calibration(files, torch_server, tmp_path):
    """Every file, JSON and multipart: predict.py's top-5 labels and probabilities (temperature 2.5 applied
    by both: the start-up banner names it), RGBA / palette / 16-bit images converted as predict converts them."""
    rows = predicted(tmp_path, files["calibrated"], files["images"][0].parent)
    assert len(rows) == len(files["images"])
    assert f"temperature {TEMPERATURE:g}" in torch_server.log.read_text()
    for path in files["images"]:
        by_json = torch_server.post(json_body={"image": b64(path)})
        by_form = torch_server.post(path)
        assert by_json.status_code == by_form.status_code == 200, (by_json.text, by_form.text)
        assert_same(by_json.json(), rows[path.name])
        assert_same(by_form.json(), rows[path.name])
    from vitpipe.inference.load import load_predictor

    loaded = load_predictor(files["calibrated"])  # the composition by hand: softmax(logits / T), not softmax(logits)
    gray = next(p for p in files["images"] if p.name == "gray.png")
    with torch.no_grad():
        logits = loaded.net(loaded.preprocess(Image.open(gray))[None])[0]  # (classes,)
    served = torch_server.post(gray).json()["probs"]
    assert np.allclose(served, (logits / TEMPERATURE).softmax(-1).sort(descending=True).values[:5], atol=1e-5)
    assert not np.allclose(served, logits.softmax(-1).sort(descending=True).values[:5], atol=1e-3)


def test_onnx_server_answers_equal_predict(files, onnx_server, tmp_path):
    rows = predicted(tmp_path, files["plain"], files["images"][0].parent)
    assert "backend=onnx" in onnx_server.log.read_text()
    for path in files["images"]:
        r = onnx_server.post(json_body={"image": b64(path)})
        assert r.status_code == 200, r.text
        assert_same(r.json(), rows[path.name])


def api_for(ckpt: Path, onnx_path: Path | None = None, **kw):
    from vitpipe.tasks.serving.api import ImageAPI

    api = ImageAPI(ckpt_path=str(ckpt), paths={"log_dir": "logs", "data_dir": "data"}, onnx_path=onnx_path and str(onnx_path),
                   max_batch_size=8, **kw)
    api.setup("cpu")
    return api


def answer(api, payloads: list[dict]) -> list:
    """What the server does with one batch of parsed bodies: (status, body) per request."""
    out = api.predict(api.batch([api.decode_request(p) for p in payloads]))
    return [(r.status_code, json.loads(r.body)) for r in map(api.encode_response, api.unbatch(out))]


def test_the_other_backend_calibration_pairs_equal_predict(files, tmp_path):
    """In this process, the server's own ImageAPI: torch without calibration, onnx with it."""
    images = files["images"]
    for name, onnx_path in (("plain", None), ("calibrated", files["onnx"])):
        rows = predicted(tmp_path / name, files[name], images[0].parent)
        api = api_for(files[name], onnx_path)
        assert (api.loaded.temperature == TEMPERATURE) == (name == "calibrated")
        for (status, body), path in zip(answer(api, [{"image": b64(p)} for p in images]), images):
            assert status == 200
            assert_same(body, rows[path.name])


def test_naflex_checkpoint_serves_its_own_rule(tmp_path):
    """A NaFlex checkpoint: patch dicts at each image's aspect, padded in a batch; equal to predict.py; explain
    offers rollout only, on the image's own grid."""
    from test_naflex_downstream import naflex_checkpoint

    from vitpipe.tasks.serving.api import explain_choices

    ckpt = naflex_checkpoint(tmp_path / "nf")
    images = write_images(tmp_path / "images")
    rows = predicted(tmp_path, ckpt, tmp_path / "images")
    api = api_for(ckpt)
    assert api.loaded.preprocess.max_seq_len is not None and explain_choices(api.loaded) == ("rollout",)
    results = answer(api, [{"image": b64(p), **({"explain": "rollout"} if p.name == "rgb.jpg" else {})} for p in images])
    for (status, body), path in zip(results, images):
        assert status == 200
        assert_same(body, rows[path.name])
    grid = np.array(results[[p.name for p in images].index("rgb.jpg")][1]["explain"]["grid"])
    item = api.loaded.preprocess(Image.open(tmp_path / "images" / "rgb.jpg").convert("L"))
    h, w = (item["patch_coord"].amax(0) + 1).tolist()
    assert grid.shape == (h, w)
    status, body = answer(api, [{"image": b64(images[0]), "explain": "gradient_rollout"}])[0]
    assert status == 400 and "valid: rollout" in body["detail"]


def test_a_timm_cnn_serves_predicts_answers_and_refuses_explain(tmp_path):
    """model=timm (a CNN): predict.py's answers; ``explain`` is a 400 naming that none is offered."""
    from vitpipe.tasks.serving.api import explain_choices

    ckpt = tc.timm_checkpoint(tmp_path)
    images = write_images(tmp_path / "images")
    rows = predicted(tmp_path, ckpt, tmp_path / "images")
    api = api_for(ckpt)
    assert explain_choices(api.loaded) == ()
    for (status, body), path in zip(answer(api, [{"image": b64(p)} for p in images]), images):
        assert status == 200
        assert_same(body, rows[path.name])
    status, body = answer(api, [{"image": b64(images[0]), "explain": "rollout"}])[0]
    assert status == 400 and "none for this checkpoint" in body["detail"]


def test_captioner_serves_captions(tmp_path):
    ckpt = tc.checkpoint("captioner", tmp_path / "made")
    images = write_images(tmp_path / "images")[:3]
    cfg = make_cfg(tmp_path, [f"ckpt_path={ckpt}", f"images={tmp_path / 'images'}", f"out={tmp_path / 'c.json'}",
                              "device=cpu"], config_name="predict")
    rows = {Path(r["path"]).name: r["caption"] for r in json.loads(predict(cfg).read_text())}
    api = api_for(ckpt)
    for (status, body), path in zip(answer(api, [{"image": b64(p)} for p in images]), images):
        assert status == 200 and body == {"caption": rows[path.name]}
    status, body = answer(api, [{"image": b64(images[0]), "explain": "rollout"}])[0]
    assert status == 400 and "none for this checkpoint" in body["detail"]


# --------------------------------------------------------------------------- batching


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(files, torch_server):
    """64 requests from 8 threads: some batches hold more than one request (X-Batch-Size), and every
    answer equals the sequential answer for its own image."""
    images = files["images"]
    sequential = {p.name: torch_server.post(p).json() for p in images}
    jobs = [images[i % len(images)] for i in range(64)]
    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda p: torch_server.post(p, timeout=60), jobs))
    assert time.monotonic() - start < 120
    assert all(r.status_code == 200 for r in responses)
    sizes = [int(r.headers["X-Batch-Size"]) for r in responses]
    assert max(sizes) > 1, sizes
    for path, r in zip(jobs, responses):
        got, want = r.json(), sequential[path.name]
        assert got["labels"] == want["labels"] and np.allclose(got["probs"], want["probs"], atol=1e-5, rtol=0)


def test_good_and_bad_images_sent_together_each_get_their_own_status(files, torch_server):
    """32 requests from 8 threads, every other one an undecodable image: the good ones answered as alone, the
    bad ones 422, while batches form (LitServe would fail a whole batch on an exception: none is raised)."""
    good = files["images"][0]
    alone = torch_server.post(good).json()
    jobs = [good if i % 2 == 0 else b"\x89PNG but not really" for i in range(32)]
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda p: torch_server.post(p, timeout=60), jobs))
    assert [r.status_code for r in responses] == [200 if i % 2 == 0 else 422 for i in range(32)]
    for r in responses[::2]:  # a batch is one forward pass: equal up to float rounding
        assert r.json()["labels"] == alone["labels"] and np.allclose(r.json()["probs"], alone["probs"], atol=1e-6)
    assert max(int(r.headers["X-Batch-Size"]) for r in responses[::2]) > 1


def test_a_bad_image_in_a_batch_fails_only_its_own_request(files):
    from vitpipe.tasks.serving.api import Decoded

    api = api_for(files["plain"])
    images = files["images"]
    payloads = [{"image": b64(images[0])}, {"image": b64(b"not an image")}, {"image": b64(images[1])}, {"x": 1},
                {"image": "data:image/png;base64," + b64(images[1])}]  # a data URL: its prefix dropped
    decoded = [api.decode_request(p) for p in payloads]
    assert [isinstance(d, Decoded) for d in decoded] == [True, False, True, False, True]
    results = answer(api, payloads)
    assert [s for s, _ in results] == [200, 422, 200, 422, 200]
    assert results[4][1] == results[2][1]
    alone = answer(api, [payloads[2]])[0][1]
    assert results[2][1]["labels"] == alone["labels"] and np.allclose(results[2][1]["probs"], alone["probs"], atol=1e-6)


# --------------------------------------------------------------------------- bad requests


def truncated_jpeg(files) -> bytes:
    return files["images"][-1].parent.joinpath("rgb.jpg").read_bytes()[:200]


BAD = {  # name -> (request kwargs builder, status, a word the one-line error must contain)
    "non_image_bytes": (lambda f: dict(path=b"just some text, not pixels"), 422, "not an image"),
    "truncated_jpeg": (lambda f: dict(path=truncated_jpeg(f)), 422, "cannot be decoded"),
    "zero_byte_image": (lambda f: dict(path=b""), 422, "empty"),
    "zero_byte_body": (lambda f: dict(data=b"", headers={"Content-Type": "application/json"}), 400, "empty"),
    "bomb_over_2x": (lambda f: dict(json_body={"image": b64(png_header(20000, 20000))}), 413, "too large"),
    "bomb_1x_to_2x": (lambda f: dict(json_body={"image": b64(png_header(9500, 9500))}), 413, "too large"),
    "missing_field_json": (lambda f: dict(json_body={"img": "abc"}), 422, "'image' is missing"),
    "missing_field_form": (lambda f: dict(files={"file": ("a.png", b"x")}), 422, "'image' is missing"),
    "bad_base64": (lambda f: dict(json_body={"image": "***"}), 400, "base64"),
    "not_json": (lambda f: dict(data=b"{nope", headers={"Content-Type": "application/json"}), 400, "JSON"),
    "json_not_object": (lambda f: dict(json_body=[1, 2]), 422, "not an object"),
    "wrong_content_type": (lambda f: dict(data=b"abc", headers={"Content-Type": "text/plain"}), 415, "Content-Type"),
    "no_content_type": (lambda f: dict(data=b"abc"), 415, "Content-Type"),
    "oversized_body": (lambda f: dict(json_body={"image": "A" * 1_200_000}), 413, "limit"),
    "oversized_chunked": (lambda f: dict(data=iter([b"{\"image\": \"" + b"A" * 600_000] * 2),
                                         headers={"Content-Type": "application/json"}), 413, "limit"),
    "unknown_explain": (lambda f: dict(path=f["images"][0], query="?explain=saliency"), 400, "explain"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_request_gets_a_4xx_line_and_the_next_good_one_is_answered(files, torch_server, case):
    build, status, word = BAD[case]
    r = torch_server.post(**build(files))
    assert r.status_code == status, r.text
    assert word in r.json()["detail"] and "\n" not in r.text, r.text
    good = torch_server.post(files["images"][0])
    assert good.status_code == 200 and len(good.json()["labels"]) == 5
    assert requests.get(f"{torch_server.url}/health", timeout=5).text == "ok"


def test_explain_adds_the_rollout_grid_and_a_png(files, torch_server):
    """?explain=rollout: the grid attention_rollout gives on predict's input tensor; the PNG is the image's size."""
    from vitpipe.data.images import open_image
    from vitpipe.inference.load import load_predictor
    from vitpipe.viz.rollout import gradient_rollout, rollout_for_model

    loaded = load_predictor(files["calibrated"])
    path = files["images"][0]
    image = open_image(path, "L")
    x = loaded.preprocess(image)[None]
    want = {"rollout": rollout_for_model(loaded.net, x)[0], "gradient": gradient_rollout(loaded.net, x)[0]}
    # both spellings of gradient rollout are taken; the answer names the canonical one (vitpipe.inference.explain)
    for method, canonical in (("rollout", "rollout"), ("gradient", "gradient"), ("gradient_rollout", "gradient")):
        grid = want[canonical]
        r = torch_server.post(path, query=f"?explain={method}")
        assert r.status_code == 200, r.text
        got = r.json()["explain"]
        assert got["method"] == canonical
        assert np.allclose(got["grid"], grid.numpy(), atol=1e-5)
        png = Image.open(io.BytesIO(base64.b64decode(got["png"])))
        assert png.format == "PNG" and png.size == image.size
    by_json = torch_server.post(json_body={"image": b64(path)}, query="?explain=rollout").json()["explain"]
    assert np.allclose(by_json["grid"], want["rollout"].numpy(), atol=1e-5)


def test_info_says_what_predict_answers(files, torch_server):
    """GET /info: the checkpoint, the task (top-k softmax here), the classes, the calibration temperature
    the answers carry, the explain methods and the batch settings, as the server applies them."""
    from vitpipe.inference.labels import label_names
    from vitpipe.inference.load import load_predictor

    loaded = load_predictor(files["calibrated"])
    r = requests.get(f"{torch_server.url}/info", timeout=30)
    assert r.status_code == 200, r.text
    info = r.json()["model"]
    assert info["task"] == "multiclass" and "thresholds" not in info
    assert info["classes"] == label_names(loaded.built.class_names, int(loaded.net.num_classes))
    assert info["temperature"] == pytest.approx(TEMPERATURE) and info["topk"] == 5
    assert info["explain"] == ["rollout", "gradient"] and info["backend"] == "torch"  # vitpipe.inference.explain's names
    assert Path(info["checkpoint"]) == Path(loaded.path)


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("override,word", [("backend=tensorrt", "backend="), ("max_batch_size=0", "max_batch_size="),
                                           ("port=70000", "port="), ("batch_timeout_ms=-1", "batch_timeout_ms="),
                                           ("onnx_path=/nonexistent.onnx", "onnx_path=")])
def test_bad_options_are_one_line_before_anything_loads(tmp_path, override, word):
    from vitpipe.config.options import check_serve as check_options

    extra = ["backend=onnx"] if override.startswith("onnx_path") else []
    cfg = make_cfg(tmp_path, ["ckpt_path=x", override, *extra], config_name="serve")
    with pytest.raises(ConfigError, match=word):
        check_options(cfg)


def test_a_missing_extra_names_the_install_command(monkeypatch):
    from vitpipe.tasks.serve import require

    monkeypatch.setitem(sys.modules, "litserve", None)  # import litserve -> ImportError
    with pytest.raises(ConfigError) as e:
        require("litserve", "scripts/serve.py")
    assert 'pip install -e ".[serve]"' in str(e.value) and "\n" not in str(e.value)


def test_torch_answers_are_unchanged_by_the_batch(files):
    """The same image alone and in a batch of others: the same answer (the batch is one forward pass)."""
    api = api_for(files["plain"])
    images = files["images"]
    together = answer(api, [{"image": b64(p)} for p in images])
    for path, (_, body) in zip(images, together):
        alone = answer(api, [{"image": b64(path)}])[0][1]
        assert body["labels"] == alone["labels"]
        assert np.allclose(body["probs"], alone["probs"], atol=1e-6, rtol=0)


def test_onnx_file_is_exported_at_start_up_or_checked_against_the_checkpoint(files, tmp_path):
    """backend=onnx without onnx_path exports into the run directory; a given file of another network
    is refused (ExportCheckError) before the server starts."""
    from vitpipe.errors import ExportCheckError
    from vitpipe.inference.load import load_predictor
    from vitpipe.tasks.serve import onnx_file

    cfg = make_cfg(tmp_path, [f"ckpt_path={files['plain']}", "backend=onnx"], config_name="serve")
    exported = Path(onnx_file(cfg, load_predictor(files["plain"])))
    assert exported == Path(cfg.paths.output_dir) / "model.onnx" and exported.stat().st_size > 0
    other = tc.checkpoint("sincos2d", files["base"] / "made")
    cfg = make_cfg(tmp_path / "other", [f"ckpt_path={other}", "backend=onnx", f"onnx_path={files['onnx']}"],
                   config_name="serve")
    with pytest.raises(ExportCheckError):
        onnx_file(cfg, load_predictor(other))
