"""Files and requests someone hands us: class names that a spreadsheet would run as formulas (every CSV
vitpipe writes, and its readers getting the names back), JSON nested deep enough to overflow Python's
parser (calibration.json, thresholds.json, a request body), and clients that send slowly (read
deadlines and a connection bound on the endpoint, over real sockets on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import json
import re
import select
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tiny_checkpoints as tc
import torch
import yaml
from conftest import make_cfg
from PIL import Image
from user_shell import SHORT_TRAIN, fresh_checkout, run, run_dir_of

from vitpipe.errors import ConfigError
from vitpipe.run.csvfiles import csv_text, read_csv, read_csv_dicts

# names that begin like a formula (OWASP's list: = + - @ tab CR), with a quote (the escape itself), and
# plain ones; "-1" and "-0.5" are numbers a spreadsheet reads as numbers
HOSTILE = ['=HYPERLINK("http://127.0.0.1/x","cl")', "+1+2", "-2+3", "@SUM(1)", "'quoted", "''twice", "\ttab",
           "\rcr", "plain", "-1"]
FOLDER_NAMES = [n.replace("/", "_") for n in HOSTILE]  # a folder name has no slash
FORMULA = re.compile(r"[=+\-@\t\r\n\uff1d\uff0b\uff0d\uff20]")
NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
DEEP = 1000  # the body: 2 KB nested 1,000 deep


def evaluated(cell: str) -> bool:
    """Whether a spreadsheet opening the file would take ``cell`` as a formula."""
    return bool(cell) and FORMULA.match(cell) is not None and NUMBER.fullmatch(cell) is None


def raw_cells(path: Path) -> list[str]:
    """Every cell of a CSV as a spreadsheet gets it (the csv module's parse, nothing stripped)."""
    import csv

    with Path(path).open(newline="") as f:
        return [c for row in csv.reader(f) for c in row]


def assert_no_formula(path: Path) -> None:
    bad = [c for c in raw_cells(path) if evaluated(c)]
    assert bad == [], f"{path.name}: cells a spreadsheet evaluates: {bad[:5]}"


# --------------------------------------------------------------------------- 4. CSV cells


def test_csv_cells_never_start_a_formula_and_read_back_unchanged(tmp_path):
    cells = [*HOSTILE, "a\rb", "x\ny", "", "'", "-0.5", "-1e-3", "-inf", "\uff1d1+1", 7, -2.5]
    path = tmp_path / "t.csv"
    path.write_text(csv_text([[c, i] for i, c in enumerate(cells)], header=["=name", "i"]))
    assert_no_formula(path)
    rows = read_csv(path)
    assert rows[0] == ["=name", "i"]
    assert [r[0] for r in rows[1:]] == [str(c) for c in cells]  # a leading quote of the name itself survives
    assert read_csv_dicts(path)[0]["=name"] == HOSTILE[0]  # column names unescaped too
    assert "-0.5" in raw_cells(path) and "-1" in raw_cells(path)  # numbers stay numbers


def hostile_folder(root: Path) -> Path:
    """root/train/<hostile name>/ with 3 small RGB images each."""
    rng = np.random.default_rng(0)
    for name in FOLDER_NAMES:
        (root / "train" / name).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(root / "train" / name / f"{i}.png")
    return root


@pytest.mark.slow
def test_class_folder_names_in_train_eval_and_predict_csvs(tmp_path):
    """Train on class folders named like formulas, as typed, then predict: predictions.csv, the report's
    per_class.csv and confusion_matrix.csv, and predict's out= CSV hold no cell a spreadsheet evaluates,
    and vitpipe's readers give the folder names back."""
    from vitpipe.report.predictions import read_predictions

    data, cwd = hostile_folder(tmp_path / "images"), fresh_checkout(tmp_path / "w")
    proc = run(["python", "scripts/train.py", "data=imagefolder", f"data.root={data}", "debug=fast", "logger=none",
                "model.img_size=16", "model.patch_size=4", "data.test_split=0.3", *SHORT_TRAIN], cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = run_dir_of(proc.stdout)
    names = sorted(FOLDER_NAMES)  # the image folder's class order
    written = [run_dir / "predictions.csv", run_dir / "report" / "per_class.csv",
               run_dir / "report" / "confusion_matrix.csv", run_dir / "history.csv"]
    for path in written:
        assert_no_formula(path)
    rows = read_csv_dicts(run_dir / "predictions.csv")
    assert {r["target_name"] for r in rows} <= set(names) and any(r["target_name"][0] in "=+-@'\t\r" for r in rows)
    assert [Path(p).parent.name for p in read_predictions(run_dir / "predictions.csv").paths] == \
        [r["target_name"] for r in rows]  # the paths read back name the true folders
    assert [r["name"] for r in read_csv_dicts(run_dir / "report" / "per_class.csv")] == names
    assert read_csv(run_dir / "report" / "confusion_matrix.csv")[0][1:] == names

    out = tmp_path / "preds.csv"
    proc = run(["python", "scripts/predict.py", f"ckpt_path={run_dir}", f"images={data}", f"out={out}"], cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_no_formula(out)
    rows = read_csv_dicts(out)
    assert len(rows) == 3 * len(names) and {r["label"] for r in rows} <= set(names)
    assert {Path(r["path"]).parent.name for r in rows} == set(names)


def labels_file_data(root: Path) -> Path:
    """root/<i>.png and root/labels.csv: label sets of the hostile names (a labels file splits on ; and |)."""
    rng = np.random.default_rng(1)
    names = [n for n in HOSTILE if n.strip() and n[0] not in "\t\r"][:6]  # a labels file strips spaces around names
    lines = ["path,labels,split"]
    root.mkdir(parents=True)
    for i in range(24):
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(root / f"{i}.png")
        chosen = [names[i % len(names)], names[(i * 5 + 1) % len(names)]]
        cell = ";".join(dict.fromkeys(chosen)).replace('"', '""')
        lines.append(f'{i}.png,"{cell}",{("train", "train", "val", "test")[i % 4]}')
    (root / "labels.csv").write_text("\n".join(lines) + "\n")
    return root


@pytest.mark.slow
def test_labels_file_names_in_multilabel_csvs_and_tuned_thresholds(tmp_path):
    """A labels file whose class names begin like formulas: the multi-label predictions.csv, per_class.csv and
    co_occurrence.csv hold no formula; thresholds tuned from predictions.csv name the classes as the
    checkpoint does, so predict applies them; predict's out= CSV holds no formula."""
    from vitpipe.report.multilabel import read_co_occurrence
    from vitpipe.report.predictions import read_multilabel_predictions

    data, cwd = labels_file_data(tmp_path / "images"), fresh_checkout(tmp_path / "w")
    proc = run(["python", "scripts/train.py", "data=imagefolder", f"data.root={data}", "data.labels=labels.csv",
                "module.task=multilabel", "debug=fast", "logger=none", "model.img_size=16", "model.patch_size=4",
                *SHORT_TRAIN], cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = run_dir_of(proc.stdout)
    names = list(torch.load(next((run_dir / "checkpoints").glob("epoch_*.ckpt")), map_location="cpu",
                            weights_only=True)["class_names"])
    assert any(n[0] in "=+-@'" for n in names)
    for path in (run_dir / "predictions.csv", run_dir / "report" / "per_class.csv", run_dir / "report" / "co_occurrence.csv"):
        assert_no_formula(path)
    assert read_multilabel_predictions(run_dir / "predictions.csv")[0] == names
    assert [r["class"] for r in read_csv_dicts(run_dir / "report" / "per_class.csv")] == names
    assert read_co_occurrence(run_dir / "report" / "co_occurrence.csv")["true"].shape == (len(names), len(names))

    proc = run(["python", "scripts/eval.py", f"ckpt_path={run_dir}", "data=imagefolder", f"data.root={data}",
                "data.labels=labels.csv", "split=val", "tune_thresholds=true"], cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tuned = json.loads(next(run_dir.rglob("thresholds.json")).read_text())
    assert list(tuned["thresholds"]) == names
    out = tmp_path / "preds.csv"
    proc = run(["python", "scripts/predict.py", f"ckpt_path={run_dir}", f"images={data}", f"out={out}"], cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "per-class thresholds from" in proc.stderr
    assert_no_formula(out)
    assert {n for r in read_csv_dicts(out) for n in r["top1_label"].split(";")} <= set(names)


def test_sweep_summary_cells_are_not_formulas(tmp_path):
    from vitpipe.sweep.summary import write_summary

    sweep = tmp_path / "sweep"
    for i, tag in enumerate(["=1+1", "@x", "-0.5"]):
        (sweep / str(i) / ".hydra").mkdir(parents=True)
        (sweep / str(i) / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"+tag={tag}", f"seed={i}"]))
        (sweep / str(i) / "metrics.json").write_text(json.dumps({"val/acc_best": 0.5 + i / 10, "val/loss": -1.5 - i}))
    write_summary(sweep)
    assert_no_formula(sweep / "summary.csv")
    assert [r["tag"] for r in read_csv_dicts(sweep / "summary.csv")] == ["=1+1", "@x", "-0.5"]


# --------------------------------------------------------------------------- 6. deep JSON


def deep_json(depth: int = DEEP) -> str:
    return '{"temperature": 2.0, "x": ' + "[" * depth + "]" * depth + "}"


@pytest.fixture(scope="module")
def folder_ckpt(tmp_path_factory):
    """A copy of the tiny image-folder checkpoint in a run directory of this module's own."""
    import shutil

    src = tc.checkpoint("folder", tmp_path_factory.mktemp("handed_ckpts"))
    dst = tmp_path_factory.mktemp("handed_run") / "checkpoints" / src.name
    dst.parent.mkdir(parents=True)
    shutil.copy(src, dst)
    return dst


def test_deep_calibration_json_is_a_config_error_in_predict(tmp_path, folder_ckpt):
    from vitpipe.tasks.predict import predict

    calibration = folder_ckpt.parent / "calibration.json"
    calibration.write_text(deep_json())
    images = tc.write_image_folder(tmp_path / "imgs") / "train"
    cfg = make_cfg(tmp_path, [f"ckpt_path={folder_ckpt}", f"images={images}", f"out={tmp_path / 'p.csv'}", "device=cpu"],
                   config_name="predict")
    try:
        with pytest.raises(ConfigError, match=rf"cannot read .*calibration\.json: the JSON is nested {DEEP + 1} levels deep"):
            predict(cfg)
    finally:
        calibration.unlink()
    assert not (tmp_path / "p.csv").exists()


@pytest.mark.slow
def test_deep_calibration_json_is_one_line_error_before_predicting(tmp_path, folder_ckpt):
    """predict as typed with a calibration.json nested 1,000 deep beside the checkpoint: exit 2 and one line
    naming the file and the depth (it was a RecursionError traceback)."""
    calibration = folder_ckpt.parent / "calibration.json"
    calibration.write_text(deep_json())
    try:
        images = tc.write_image_folder(tmp_path / "imgs") / "train"
        proc = run(["python", "scripts/predict.py", f"ckpt_path={folder_ckpt}", f"images={images}",
                    f"out={tmp_path / 'p.csv'}"], fresh_checkout(tmp_path / "w"), timeout=120)
    finally:
        calibration.unlink()
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"vitpipe: error: cannot read {calibration}: "), lines[-3:]
    assert f"nested {DEEP + 1} levels deep" in lines[0] and "at most 32" in lines[0]
    assert not (tmp_path / "p.csv").exists()


def test_deep_thresholds_json_is_a_config_error(tmp_path):
    from vitpipe.report.multilabel import find_thresholds

    ckpt = tmp_path / "checkpoints" / "epoch_000.ckpt"
    ckpt.parent.mkdir()
    ckpt.write_bytes(b"0")
    (ckpt.parent / "thresholds.json").write_text('{"thresholds": ' + "[" * DEEP + "]" * DEEP + "}")
    with pytest.raises(ConfigError, match=rf"thresholds\.json .*nested {DEEP + 1} levels deep.*at most 32"):
        find_thresholds(ckpt, {"global_step": 1}, ["a", "b"])


def test_deep_data_set_json_files_are_config_errors(tmp_path):
    """The JSON files of a data set (COCO captions, a shard index) nested 1,000 deep: one ConfigError line."""
    from vitpipe.data.captions.coco import read_coco_captions
    from vitpipe.data.shards import INDEX_FILE, read_index

    (tmp_path / "captions.json").write_text(deep_json())
    with pytest.raises(ConfigError, match=rf"captions\.json' is not valid JSON: the JSON is nested {DEEP + 1} levels deep"):
        read_coco_captions(tmp_path / "captions.json", tmp_path)
    (tmp_path / INDEX_FILE).write_text(deep_json())
    with pytest.raises(ConfigError, match=rf"is not a shard index \(the JSON is nested {DEEP + 1} levels deep"):
        read_index(str(tmp_path))


def asgi_call(app, body: bytes, content_type: bytes = b"application/json") -> tuple[int, dict]:
    """One POST /predict through an ASGI app: (status, JSON body)."""
    sent, messages = [], [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/predict", "query_string": b"",
             "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def test_deep_json_body_is_a_json_400_at_the_edge():
    from vitpipe.tasks.serving.edge import RequestGate

    async def model(scope, receive, send):  # reached only by bodies the gate lets through
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"labels": []}'})

    gate = RequestGate(model, max_body_bytes=10**6)
    body = ('{"image": ' + "[" * DEEP + "]" * DEEP + "}").encode()
    assert len(body) < 2100
    status, answer = asgi_call(gate, body)
    assert status == 400 and f"nested {DEEP + 1} levels deep" in answer["detail"], answer
    assert asgi_call(gate, b'{"image": [[["x"]]]}')[0] == 200  # shallow nesting passes to the model


# --------------------------------------------------------------------------- 7. slow clients


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Uvicorn:
    """A uvicorn server in a thread on 127.0.0.1 running ``app`` with serve.py's HTTP options."""

    def __init__(self, app, **options) -> None:
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                                    lifespan="off", **options))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


async def echo_model(scope, receive, send):
    """Stands in for LitServe's route: 200 and a label for a POST, ok for anything else."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"labels": ["ok"], "probs": [1.0]}'})


def drip(socks: dict[socket.socket, float], payload: bytes, *, seconds: float, every: float = 0.2) -> dict:
    """Send ``payload`` then one more header byte per ``every`` on each socket until the server closes it
    (EOF or reset) or ``seconds`` pass; returns {socket: (seconds from its connect to the close, bytes it got)}."""
    got: dict[socket.socket, bytes] = {s: b"" for s in socks}
    closed: dict[socket.socket, tuple[float, bytes]] = {}
    for s in socks:
        s.sendall(payload)
    end = time.monotonic() + seconds
    while len(closed) < len(socks) and time.monotonic() < end:
        for s in [s for s in socks if s not in closed]:
            try:
                s.send(b"x")
            except OSError:
                closed[s] = (time.monotonic() - socks[s], got[s])
        readable, _, _ = select.select([s for s in socks if s not in closed], [], [], every)
        for s in readable:
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            got[s] += data
            if not data:
                closed[s] = (time.monotonic() - socks[s], got[s])
    return closed


def connect(n: int, port: int) -> dict[socket.socket, float]:
    socks = {}
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.setblocking(False)
        socks[s] = time.monotonic()
    return socks


HEADERS = b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nX-Slow: "


@pytest.mark.alone  # wall time measured: no other test beside it under xdist
def test_slow_clients_are_closed_at_the_deadline_while_good_requests_are_answered():
    """30 clients dripping their headers a byte at a time and one dripping its body: a good /predict is
    answered meanwhile, before any slow one is closed, and the server answers each slow one 408 and closes
    it at its deadline (3 s), not later; uvicorn alone kept them open for as long as they dripped. Every
    one gets its 408 although it is still sending: the close lingers instead of resetting the connection."""
    from vitpipe.tasks.serving.connections import guarded_protocol
    from vitpipe.tasks.serving.edge import RequestGate

    app = RequestGate(echo_model, max_body_bytes=10**6)
    proto = guarded_protocol(header_timeout_s=3, body_timeout_s=3, max_connections=64)
    with Uvicorn(app, http=proto, timeout_keep_alive=1) as server:
        slow = connect(30, server.port)
        body_slow = connect(1, server.port)
        result = {}
        drippers = [threading.Thread(target=lambda: result.update(drip(slow, HEADERS, seconds=8))),
                    threading.Thread(target=lambda: result.update(drip(
                        body_slow, b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                   b"Content-Length: 100000\r\n\r\n{", seconds=8)))]
        for t in drippers:
            t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        good = requests.post(f"http://127.0.0.1:{server.port}/predict", json={"image": "aGk="}, timeout=5)
        answered_in = time.monotonic() - t0
        for t in drippers:
            t.join(10)
    assert good.status_code == 200 and good.json()["labels"] == ["ok"] and answered_in < 2.0, (good.text, answered_in)
    assert set(result) == set(slow) | set(body_slow), f"{len(set(slow) | set(body_slow)) - len(result)} slow client(s) still open"
    lost = sum(not data for _, data in result.values())
    assert lost == 0, f"{lost} of {len(result)} slow clients got no 408 (a close with their bytes unread is a reset)"
    for s, (after, data) in result.items():
        assert 2.8 <= after <= 4.5, after
        s.close()
        assert data.startswith(b"HTTP/1.1 408 "), data[:80]
        detail = json.loads(data.split(b"\r\n\r\n", 1)[1])["detail"]
        assert ("header_timeout_s" if s in slow else "body_timeout_s") in detail, detail


@pytest.mark.alone  # wall time measured: no other test beside it under xdist
def test_one_connection_over_the_bound_is_refused_at_once():
    from vitpipe.tasks.serving.connections import guarded_protocol

    with Uvicorn(echo_model, http=guarded_protocol(header_timeout_s=5, body_timeout_s=5, max_connections=8),
                 timeout_keep_alive=1) as server:
        held = connect(8, server.port)
        time.sleep(0.3)  # accepted by the server's loop
        t0 = time.monotonic()
        extra = socket.create_connection(("127.0.0.1", server.port), timeout=2)
        data = extra.recv(4096)
        assert data.startswith(b"HTTP/1.1 503 ") and b"max_connections" in data, data[:200]
        assert extra.recv(4096) == b"" and time.monotonic() - t0 < 1.0  # closed by the server, at once
        extra.close()
        for s in held:
            s.close()
        time.sleep(0.3)
        ok = requests.post(f"http://127.0.0.1:{server.port}/predict", json={"image": "aGk="}, timeout=5)
        assert ok.status_code == 200  # the bound frees with the connections


def test_serve_options_for_slow_clients_are_checked(tmp_path, monkeypatch):
    import resource

    import vitpipe.tasks.serve as serve
    from vitpipe.config.options import check_serve as check_options
    from vitpipe.tasks.serve import connection_bound

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    cases = [("header_timeout_s=0", r"header_timeout_s=0: expected a number > 0"),
             ("body_timeout_s=-1", r"body_timeout_s=-1: expected a number > 0"),
             ("keep_alive_s=0", r"keep_alive_s=0: expected a number > 0"),
             ("max_connections=0", r"max_connections=0")]
    if soft != resource.RLIM_INFINITY:  # more connections than descriptors: refused before loading anything
        cases.append((f"max_connections={soft}", rf"max_connections={soft}: this process may open {soft} files"))
    for override, match in cases:
        with pytest.raises(ConfigError, match=match):
            check_options(make_cfg(tmp_path, ["ckpt_path=x", override], config_name="serve"))
    defaults = make_cfg(tmp_path, ["ckpt_path=x"], config_name="serve")
    check_options(defaults)  # the defaults pass
    monkeypatch.setattr(serve, "open_files_limit", lambda: 256)  # macOS's default ulimit -n
    assert connection_bound(defaults) == 256 - 64  # null: within the limit, so the defaults still start
    monkeypatch.setattr(serve, "open_files_limit", lambda: None)
    assert connection_bound(defaults) == 256


@pytest.mark.slow
def test_serve_as_typed_refuses_deep_json_and_closes_slow_clients(tmp_path, folder_ckpt):
    """scripts/serve.py as typed (its own process, LitServe's uvicorn): a 2 KB body nested 1,000 deep is a
    JSON 400 (it was a plain-text 500 and a RecursionError in the log); 30 clients dripping headers are
    answered 408 and closed at header_timeout_s (4 s) while a good /predict is answered meanwhile."""
    from test_serve import b64, start_server, stop, wait_ready

    image = tc.write_image_folder(tmp_path / "imgs") / "train" / "cat" / "0.png"
    server = start_server(tmp_path / "server", f"ckpt_path={folder_ckpt}", "header_timeout_s=4", "body_timeout_s=4",
                          "max_connections=64")
    try:
        wait_ready(server)
        port = int(server.url.rsplit(":", 1)[1])
        body = '{"image": ' + "[" * DEEP + "]" * DEEP + "}"
        deep = requests.post(f"{server.url}/predict", data=body, headers={"Content-Type": "application/json"}, timeout=30)
        assert deep.status_code == 400 and f"nested {DEEP + 1} levels deep" in deep.json()["detail"], deep.text

        slow, result = connect(30, port), {}
        dripper = threading.Thread(target=lambda: result.update(drip(slow, HEADERS, seconds=10)))
        dripper.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        good = server.post(json_body={"image": b64(image)}, timeout=30)
        answered_in = time.monotonic() - t0
        dripper.join(15)
        log = server.log.read_text()
    finally:
        stop([server])
    assert good.status_code == 200 and len(good.json()["labels"]) == 3 and answered_in < 3.0, (good.text, answered_in)
    assert set(result) == set(slow), f"{len(slow) - len(result)} slow client(s) still open after 10 s"
    assert all(3.8 <= after <= 6.0 and data[:13] in (b"", b"HTTP/1.1 408 ") for after, data in result.values()), \
        sorted((round(a, 2), d[:20]) for a, d in result.values())  # b"": the close reset the connection
    assert "RecursionError" not in log and "Traceback" not in log, log[-3000:]
    assert "connections: at most 64 open; headers within 4 s" in log  # the banner names the limits
