"""Scale and sweeps: real 2-process DDP (equal to one process; resumed mid-epoch exactly), multirun
summaries, atomic checkpoints, compiled/DDP checkpoints loading into plain models, mixed precision,
non-finite losses."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from vitpipe import create_model
from vitpipe.config.build import build_trainer
from vitpipe.models.weights import load_pretrained

ROOT = Path(__file__).resolve().parents[1]
TINY = ["debug=fast", "trainer.limit_val_batches=1", "test=false", "callbacks.model_checkpoint.monitor=null",
        "callbacks.model_checkpoint.save_top_k=0", "callbacks.progress_bar.refresh_rate=1000"]
# a run that draws from the global generators, as real ones do: drop path (torch's; depth 2, since
# the stochastic-depth rule gives the first block rate 0) and mixup/cutmix (numpy's)
RANDOM = ["model.depth=2", "model.drop_path_rate=0.1", "module.mixup={mixup_alpha:0.8,cutmix_alpha:1.0}"]


def _train_cli(*args, timeout=600, multirun=False, script="train.py", env=None):
    return _finish(_start_cli(*args, multirun=multirun, script=script, env=env), timeout)


def _start_cli(*args, multirun=False, script="train.py", env=None) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "scripts" / script), *(["-m"] if multirun else []), *args]
    # its own session, so a timeout reaches every process it started (DDP ranks, loader workers);
    # PYTHONFAULTHANDLER: each of them prints its threads' stacks on the SIGABRT that timeout sends
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
                                 "PYTHONFAULTHANDLER": "1", **(env or {})})


def _finish(p: subprocess.Popen, timeout=600) -> subprocess.CompletedProcess:
    """Wait for ``p``; past ``timeout`` every process of its session dumps its stacks and is killed,
    and the failure shows where each one stood (a hang names its frame instead of only its time)."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_session(p, signal.SIGABRT)
        try:
            out, err = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            out, err = "", ""
        _signal_session(p, signal.SIGKILL)
        p.wait()
        raise AssertionError(f"timed out after {timeout} s: {' '.join(map(str, p.args))[-500:]}\n"
                             f"stdout: {out[-2000:]}\nstderr (stacks of every process): {err[-12000:]}") from None
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _signal_session(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # the session's process group: its id is the leader's pid
    except ProcessLookupError:
        pass


def _free_port() -> str:
    with socket.socket() as s:  # each side-by-side DDP launch its own rendezvous port
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _last(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)


def _net(ckpt: dict) -> dict:
    return {k: v for k, v in ckpt["state_dict"].items() if k.startswith("net.")}


class RecordSampler(L.Callback):
    """Writes ``<out>/rank<r>.json``: the class of this rank's training sampler, its epoch-0 indices
    and the size of the training split (imported by the subprocess through PYTHONPATH=tests)."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def on_train_start(self, trainer, pl_module) -> None:
        sampler = trainer.train_dataloader.sampler
        self.out.mkdir(parents=True, exist_ok=True)
        record = {"sampler": type(sampler).__name__, "indices": list(sampler), "n": len(trainer.datamodule.data_train)}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """The 2-process runs, started side by side (a DDP launch mostly waits while its second process
    imports): DDP 2x8 and one process x16 without randomness, and an uninterrupted DDP run that draws
    drop path and mixup/cutmix and keeps its step-8 checkpoint; then the run resumed from that one."""
    tmp = tmp_path_factory.mktemp("ddp")
    plain = [*TINY, "trainer.max_epochs=1", "trainer.limit_train_batches=4", "data.shuffle=false",
             "data.augment=false", "trainer.deterministic=true"]
    stochastic = [*TINY, *RANDOM, "logger=none", "trainer=ddp_cpu", "trainer.devices=2", "trainer.max_epochs=2",
                  "trainer.limit_train_batches=6", "data.batch_size=8", "trainer.deterministic=true"]
    keep_step_8 = ["+callbacks.step8._target_=lightning.pytorch.callbacks.ModelCheckpoint",
                   f"+callbacks.step8.dirpath={tmp / 'steps'}", "+callbacks.step8.every_n_train_steps=8",
                   "+callbacks.step8.save_top_k=-1", "+callbacks.step8.filename='step_{step}'",
                   "+callbacks.step8.auto_insert_metric_name=false"]
    record = ["+callbacks.record._target_=test_scale.RecordSampler", f"+callbacks.record.out={tmp / 'ranks'}"]
    started = {
        "ddp": _start_cli(*plain, "trainer=ddp_cpu", "trainer.devices=2", "data.batch_size=8",
                          f"hydra.run.dir={tmp / 'ddp'}", env={"MASTER_PORT": _free_port()}),
        "one": _start_cli(*plain, "trainer=cpu", "data.batch_size=16", f"hydra.run.dir={tmp / 'one'}"),
        "full": _start_cli(*stochastic, *keep_step_8, *record, f"hydra.run.dir={tmp / 'full'}",
                           env={"PYTHONPATH": str(ROOT / "tests"), "MASTER_PORT": _free_port()}),
    }
    r = {"tmp": tmp, **{k: _finish(p) for k, p in started.items()}}
    assert r["full"].returncode == 0, r["full"].stderr[-3000:]
    r["step8"] = tmp / "steps" / "step_8.ckpt"
    r["resumed"] = _train_cli(*stochastic, f"ckpt_path={r['step8']}", f"hydra.run.dir={tmp / 'resumed'}")
    return r


@pytest.mark.slow  # the shared 2-process DDP runs (~35 s): .ci/run runs it after the default suite
def test_ddp_two_processes_equal_one_process_with_the_same_global_batch(ddp_runs):
    ddp, single, tmp_path = ddp_runs["ddp"], ddp_runs["one"], ddp_runs["tmp"]
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert "effective batch 16 = 8 per device x 2 device(s)" in ddp.stdout
    assert single.returncode == 0, single.stderr[-3000:]
    a, b = _last(tmp_path / "ddp"), _last(tmp_path / "one")
    assert a["global_step"] == b["global_step"] == 4
    wa, wb = _net(a), _net(b)
    assert wa.keys() == wb.keys() and not any(".module." in k or "_orig_mod" in k for k in wa)
    worst = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    print(f"DDP(2x8) vs 1x16 after 4 steps: max |dw| = {worst:.2e}")
    assert worst < 1e-5
    # the DDP checkpoint loads into a plain model
    model = create_model("vit_nano", in_chans=1, num_classes=10, dim=32, depth=1, num_heads=2, pos_embed="sincos2d")
    ckpt_file = tmp_path / "ddp" / "checkpoints" / "last.ckpt"
    load_pretrained(model, str(ckpt_file))
    torch.testing.assert_close(model.head.weight, wa["net.head.weight"])


@pytest.mark.slow  # 8-25 s of subprocesses: .ci/run runs it after the default suite
def test_multirun_of_three_jobs_writes_a_summary_row_per_job(tmp_path):
    sweep = tmp_path / "sweep"
    r = _train_cli(*TINY, "trainer.max_epochs=1", "trainer.limit_train_batches=2", "test=true",
                   "trainer.limit_test_batches=1", "model.pos_embed=learned,sincos2d,learned2d",
                   f"hydra.sweep.dir={sweep}", multirun=True)
    assert r.returncode == 0, r.stderr[-3000:]
    csv = (sweep / "summary.csv").read_text().strip().splitlines()
    assert len(csv) == 1 + 3 and "model.pos_embed" in csv[0] and "test/acc" in csv[0]
    col = csv[0].split(",").index("model.pos_embed")
    assert col == 1  # the varied parameter comes first
    assert {line.split(",")[col] for line in csv[1:]} == {"learned", "sincos2d", "learned2d"}
    md = [line for line in (sweep / "summary.md").read_text().splitlines() if line.startswith("|")]
    assert len(md) == 2 + 3 and all(line.endswith("done |") for line in md[2:])
    assert (sweep / "summary.png").stat().st_size > 1000
    # the report script rebuilds the same table from the job folders alone
    for f in ("summary.csv", "summary.md", "summary.png"):
        (sweep / f).unlink()
    rebuilt = subprocess.run([sys.executable, str(ROOT / "scripts" / "sweep_report.py"), str(sweep)],
                             capture_output=True, text=True, timeout=120)
    assert rebuilt.returncode == 0 and (sweep / "summary.csv").read_text().strip().splitlines() == csv


@pytest.mark.slow  # the shared 2-process DDP runs (~35 s): .ci/run runs it after the default suite
def test_ddp_resume_from_a_mid_epoch_step_checkpoint_matches_an_uninterrupted_run(ddp_runs):
    """2-process DDP, drop path and mixup/cutmix on: every rank draws from torch's and numpy's global
    generators. The uninterrupted run kept its step-8 checkpoint (mid-way through epoch 1: what a
    kill -9 right after that save leaves); resumed from it, the run ends with the same weights, bit for
    bit. The same run recorded each rank's training sampler: vitpipe's own, the shards disjoint and
    covering the split (Lightning did not put its DistributedSampler in its place)."""
    tmp, resumed = ddp_runs["tmp"], ddp_runs["resumed"]
    assert torch.load(ddp_runs["step8"], weights_only=True)["epoch"] == 1  # mid-way through the second epoch
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at epoch 1, global step 8" in resumed.stdout and "start fresh" not in resumed.stdout + resumed.stderr
    a, b = _last(tmp / "full"), _last(tmp / "resumed")
    assert a["global_step"] == b["global_step"] == 12
    wa, wb = _net(a), _net(b)
    assert wa.keys() == wb.keys() and wa
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []

    ranks = [json.loads((tmp / "ranks" / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["sampler"] for r in ranks] == ["ShardedSampler"] * 2
    n, (r0, r1) = ranks[0]["n"], (r["indices"] for r in ranks)
    assert len(r0) == len(r1) == -(-n // 2) and sorted(set(r0) | set(r1)) == list(range(n))
    assert len(set(r0) & set(r1)) == len(r0) + len(r1) - n  # only the padding repeats an image


def test_atomic_checkpoint_write_survives_a_kill_during_save(tmp_path, monkeypatch):
    from vitpipe.lit.checkpointing import AtomicCheckpointIO

    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 1}, path)

    def dying_save(obj, f, *a, **k):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt  # the process is killed mid-write

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "global_step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True)["global_step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temp file left behind


def test_compiled_module_checkpoint_has_plain_keys_and_loads(tmp_path):
    from functools import partial

    from vitpipe.lit import ImageClassifier

    net = create_model("vit_micro", num_classes=4, depth=1)
    module = ImageClassifier(net, partial(torch.optim.AdamW, lr=1e-3), compile=True)
    keys = [k for k in module.state_dict() if "net." in k]
    assert keys and all(k.startswith("net.") and "_orig_mod" not in k for k in keys)
    torch.save({"state_dict": module.state_dict()}, tmp_path / "m.ckpt")
    plain = load_pretrained(create_model("vit_micro", num_classes=4, depth=1), str(tmp_path / "m.ckpt"))
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(plain.eval()(x), net.eval()(x))


def test_bf16_mixed_gives_the_same_classes_as_fp32_on_cpu(cfg_factory):
    from vitpipe.run.build import build_from_config
    from vitpipe.tasks.train import train

    preds = {}
    for precision in ("32-true", "bf16-mixed"):
        cfg = cfg_factory(*TINY[:1], "trainer.max_epochs=1", "trainer.limit_train_batches=8", "test=false",
                          f"trainer.precision={precision}", "callbacks.model_checkpoint.monitor=null",
                          sub=precision)
        train(cfg)
        ckpt = torch.load(Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt", weights_only=True)
        dm, net, _ = build_from_config(cfg)
        net.load_state_dict({k[4:]: v for k, v in _net(ckpt).items()})
        dm.setup("test")
        x, y = next(iter(dm.test_dataloader()))
        with torch.no_grad():
            preds[precision] = net.eval()(dm.augment_batch(x, False)).argmax(1)
    agree = (preds["32-true"] == preds["bf16-mixed"]).float().mean().item()
    print(f"fp32 vs bf16-mixed training: {agree:.1%} of test predictions agree")
    assert agree >= 0.8


def _nan_after(net, calls: int):
    count = {"n": 0}
    forward = net.forward

    def wrapped(x):
        count["n"] += 1
        out = forward(x)
        return out * float("nan") if net.training and count["n"] == calls else out

    net.forward = wrapped
    return net


@pytest.mark.parametrize("policy", ["error", "skip"])
def test_nonfinite_loss_stops_naming_the_step_or_is_skipped(cfg_factory, policy):

    from vitpipe.lit.classifier import NonFiniteLossError
    from vitpipe.run.build import build_from_config

    cfg = cfg_factory(*TINY[:1], "trainer.max_epochs=1", "trainer.limit_train_batches=4", f"module.nonfinite={policy}")
    dm, net, module = build_from_config(cfg)
    _nan_after(net, 3)  # the third training forward returns NaN
    trainer = build_trainer(cfg.trainer, logger=False, enable_checkpointing=False)
    if policy == "error":
        with pytest.raises(NonFiniteLossError, match=r"at global step 2 .*module.nonfinite=skip"):
            trainer.fit(module, dm)
    else:
        trainer.fit(module, dm)
        assert module.skipped_batches == 1  # the NaN batch was dropped (its optimizer step had no gradients)
        assert all(torch.isfinite(p).all() for p in net.parameters())
        # AdamW never saw the dropped step: 4 batches, 3 updates of every parameter (moments included)
        assert {int(s["step"]) for s in trainer.optimizers[0].state.values()} == {3}
        assert trainer.callback_metrics["train/skipped_batches"] == 1


@pytest.mark.parametrize("rule, factor", [("none", 1.0), ("linear", 2.0), ("sqrt", 2.0 ** 0.5)])
def test_lr_scaling_rule_and_effective_batch(cfg_factory, capsys, rule, factor):
    """Effective batch 32 x 4 devices x 2 accumulation = 256 against a base of 128: the linear rule
    doubles the lr, sqrt multiplies it by sqrt(2), none leaves it."""
    from vitpipe.config.build import apply_lr_scaling

    cfg = cfg_factory(f"lr_scaling.rule={rule}", "lr_scaling.base_batch_size=128", "data.batch_size=32",
                      "module.optimizer.lr=0.001")
    fake = SimpleNamespace(accumulate_grad_batches=2, world_size=4, num_devices=4, num_nodes=1, is_global_zero=True)
    apply_lr_scaling(cfg, fake)
    assert cfg.module.optimizer.lr == pytest.approx(0.001 * factor, rel=1e-9)
    out = capsys.readouterr().out
    assert "effective batch 256 = 32 per device x 4 device(s) x 1 node(s) x 2 accumulation" in out
    assert f"lr {0.001 * factor:.3g} (lr_scaling.rule={rule}" in out
    # a smaller effective batch scales down: 16 / 64 -> x0.25 (linear), x0.5 (sqrt); other ranks print nothing
    cfg = cfg_factory(f"lr_scaling.rule={rule}", "data.batch_size=16", "lr_scaling.base_batch_size=64",
                      "module.optimizer.lr=0.001")
    apply_lr_scaling(cfg, SimpleNamespace(accumulate_grad_batches=1, world_size=1, num_devices=1, num_nodes=1,
                                          is_global_zero=False))
    down = {"none": 1.0, "linear": 0.25, "sqrt": 0.5}[rule]
    assert cfg.module.optimizer.lr == pytest.approx(0.001 * down, rel=1e-9)
    assert capsys.readouterr().out == ""


def test_sweeper_and_launcher_configs_compose(cfg_factory):
    cfg = cfg_factory("hparams_search=optuna")
    assert "OptunaSweeper" in cfg.hydra.sweeper._target_ and cfg.hydra.sweeper.direction == "maximize"
    assert cfg.optimized_metric == "val/acc_best"
    cfg = cfg_factory("hydra/launcher=slurm", "trainer=ddp", "trainer.devices=4", "trainer.num_nodes=2")
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert "SlurmLauncher" in launcher["_target_"] and launcher["tasks_per_node"] == 4 and launcher["nodes"] == 2


@pytest.mark.slow  # 8-25 s of subprocesses: .ci/run runs it after the default suite
def test_optuna_sweep_runs_two_trials(tmp_path):
    sweep = tmp_path / "optuna"
    r = _train_cli(*TINY, "trainer.max_epochs=1", "trainer.limit_train_batches=2", "hparams_search=optuna",
                   "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.n_startup_trials=2",
                   f"hydra.sweep.dir={sweep}", multirun=True)
    assert r.returncode == 0, r.stderr[-3000:]
    best = OmegaConf.load(sweep / "optimization_results.yaml")
    assert 0.0 <= best.best_value <= 1.0 and "module.optimizer.lr" in best.best_params
    assert r.stdout.count("vitpipe: sweep summary of 2 job(s)") == 1  # once, at the end
    assert (sweep / "optuna_history.png").is_file() and (sweep / "optuna_slice.png").is_file()
