"""Shards in a real S3 endpoint (Ceph radosgw over TLS, tests/cluster/s3.sh), marked ``s3``:
make_shards uploads, data=shards streams from it exactly as from a folder, a killed run resumes
exactly, and a wrong key, a missing bucket or an unreachable endpoint is one line within seconds."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.s3

TINY = ["trainer=cpu", "debug=fast", "data.channels=1", "trainer.limit_val_batches=1", "test=false",
        "callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.save_top_k=0",
        "callbacks.progress_bar.refresh_rate=1000", "logger=none", "trainer.deterministic=true",
        "trainer.max_epochs=2", "trainer.limit_train_batches=6", "data.batch_size=16", "data.num_workers=1"]


@pytest.fixture(scope="session")
def s3():
    """The endpoint's client settings (the AWS_* variables), and a fresh bucket for this session."""
    if os.geteuid() != 0:
        pytest.skip("the Ceph daemons need root (tests/cluster/s3.sh start)")
    script = ROOT / "tests/cluster/s3.sh"
    r = subprocess.run(["bash", str(script), "start"], capture_output=True, text=True, timeout=300)
    if r.returncode == 3:
        pytest.skip(f"no S3 endpoint here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-2000:]
    env = {}
    for line in subprocess.run(["bash", str(script), "env"], capture_output=True, text=True, check=True).stdout.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value
    bucket = f"vitpipe-{uuid.uuid4().hex[:8]}"
    import boto3

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        boto3.client("s3").create_bucket(Bucket=bucket)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return {"env": env, "bucket": bucket}


def cli(script: str, *args, env: dict, cwd: Path, timeout: float = 300, background: bool = False):
    cmd = [sys.executable, str(ROOT / "scripts" / script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
                "PYTHONPATH": str(ROOT / "tests"), **env}  # fault_injection.SignalAtStep
    if background:
        return subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def weights(run_dir: Path) -> dict:
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    return {k: v for k, v in ckpt["state_dict"].items() if k.startswith("net.")}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="session")
def digits_shards(s3, tmp_path_factory):
    """make_shards of digits, once to a folder and once straight to the bucket."""
    work = tmp_path_factory.mktemp("s3shards")
    url = f"s3://{s3['bucket']}/digits"
    up = cli("make_shards.py", "data=digits", f"out={url}", env=s3["env"], cwd=work)
    assert up.returncode == 0, up.stderr[-3000:]
    assert f"make_shards: {url}: train 1293 images" in up.stdout
    local = cli("make_shards.py", "data=digits", f"out={work / 'local'}", env=s3["env"], cwd=work)
    assert local.returncode == 0, local.stderr[-3000:]
    return {"url": url, "local": work / "local", "work": work}


def test_shards_stream_from_s3_exactly_as_from_a_folder(s3, digits_shards, tmp_path):
    import boto3

    os_env = {**os.environ, **s3["env"]}
    keys = sorted(o["Key"] for o in boto3.Session().client(
        "s3", endpoint_url=os_env["AWS_ENDPOINT_URL"], verify=os_env["AWS_CA_BUNDLE"],
        aws_access_key_id=os_env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=os_env["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1").list_objects_v2(Bucket=s3["bucket"], Prefix="digits/")["Contents"])
    assert "digits/vitpipe_shards.json" in keys and "digits/train/index.json" in keys
    runs = {}
    for name, root in (("s3", digits_shards["url"]), ("local", digits_shards["local"])):
        r = cli("train.py", "data=shards", f"data.root={root}", *TINY, f"data.cache_dir={tmp_path / 'cache' / name}",
                f"hydra.run.dir={tmp_path / name}", env=s3["env"], cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = weights(tmp_path / name)
    assert same(runs["s3"], runs["local"])  # the same images in the same order: the same weights, bit for bit


def test_a_run_streaming_from_s3_killed_mid_epoch_resumes_exactly(s3, digits_shards, tmp_path):
    # augmentation off: crops drawn in loader workers continue from the workers' generators, which a
    # resumed epoch restarts (the order and the main process's generators are restored exactly)
    common = ["data=shards", f"data.root={digits_shards['url']}", *TINY, "data.augment=false",
              "callbacks.model_checkpoint.last_every_n_train_steps=1"]
    full = cli("train.py", *common, f"data.cache_dir={tmp_path / 'c1'}", f"hydra.run.dir={tmp_path / 'full'}",
               env=s3["env"], cwd=tmp_path)
    assert full.returncode == 0, full.stderr[-3000:]
    p = cli("train.py", *common, f"data.cache_dir={tmp_path / 'c2'}", f"hydra.run.dir={tmp_path / 'killed'}",
            "+callbacks.kill._target_=fault_injection.SignalAtStep", "+callbacks.kill.step=8",
            f"+callbacks.kill.signum={int(signal.SIGKILL)}", env=s3["env"], cwd=tmp_path, background=True)
    p.communicate(timeout=300)
    assert p.returncode == -signal.SIGKILL
    saved = torch.load(tmp_path / "killed" / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 7  # killed before step 8's save: mid-way through epoch 1 (6 steps per epoch)
    resumed = cli("train.py", *common, f"data.cache_dir={tmp_path / 'c2'}", f"hydra.run.dir={tmp_path / 'killed'}",
                  env=s3["env"], cwd=tmp_path)  # ckpt_path=auto: the run directory's own last.ckpt
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at epoch 1, global step 7" in resumed.stdout
    assert same(weights(tmp_path / "killed"), weights(tmp_path / "full"))


@pytest.mark.parametrize("case", ["wrong key", "missing bucket", "unreachable endpoint", "untrusted certificate"])
def test_a_bad_endpoint_bucket_or_key_stops_in_one_line_within_seconds(s3, digits_shards, tmp_path, case):
    env, root = dict(s3["env"]), digits_shards["url"]
    expect = {"wrong key": "refused these credentials", "missing bucket": "bucket no-such-bucket-vitpipe does not exist",
              "unreachable endpoint": "cannot reach the S3 endpoint https://127.0.0.1:9",
              "untrusted certificate": "TLS certificate of"}[case]
    if case == "wrong key":
        env["AWS_SECRET_ACCESS_KEY"] = "not-the-secret"
    elif case == "missing bucket":
        root = "s3://no-such-bucket-vitpipe/digits"
    elif case == "unreachable endpoint":
        env["AWS_ENDPOINT_URL"] = "https://127.0.0.1:9"
    else:
        env["AWS_CA_BUNDLE"] = env["SSL_CERT_FILE"] = "/etc/ssl/certs/ca-certificates.crt"
    start = time.time()
    r = cli("train.py", "data=shards", f"data.root={root}", *TINY, env=env, cwd=tmp_path, timeout=120)
    took = time.time() - start
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("vitpipe: error:")]
    assert r.returncode == 2 and len(lines) == 1 and expect in lines[0], shlex.quote(r.stderr[-2000:])
    assert "Traceback" not in r.stderr and took < 30, took


def test_multilabel_shards_stream_from_s3_with_their_label_sets(s3, tmp_path):
    """A labelled image folder made into shards straight in the bucket and in a folder: a multi-label run
    with pos_weight=balanced (the per-split label-sets file, fetched from the bucket) trains the same
    weights from both, and its predictions name each test image's own label set."""
    import csv

    from test_shards_multilabel import IDS, _folder, label_set

    root, url = _folder(tmp_path / "images"), f"s3://{s3['bucket']}/multilabel"
    for out in (url, tmp_path / "local"):
        r = cli("make_shards.py", "data=imagefolder", f"data.root={root}", "data.labels=labels.csv", f"out={out}",
                f"hydra.run.dir={tmp_path / 'make'}", env=s3["env"], cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
    runs = {}
    for name, shards in (("s3", url), ("local", tmp_path / "local")):
        r = cli("train.py", "data=shards", f"data.root={shards}", "module.task=multilabel",
                "module.class_weights=balanced", "debug=fast", "logger=none", "trainer=cpu", "trainer.deterministic=true",
                "model.img_size=8", "model.patch_size=4", "data.num_workers=0",
                f"data.cache_dir={tmp_path / 'cache' / name}", f"hydra.run.dir={tmp_path / name}",
                env=s3["env"], cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = weights(tmp_path / name)
        with open(tmp_path / name / "predictions.csv", newline="") as f:
            assert [row["labels"] for row in csv.DictReader(f)] == [";".join(label_set(i)) for i in IDS["test"]]
    assert same(runs["s3"], runs["local"])
