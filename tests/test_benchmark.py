"""The benchmark (scripts/benchmark.py, its body the package vitpipe.benchmark) and the experiment recipes."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from hydra.utils import instantiate

from vitpipe.benchmark.common import (
    StepMemory,
    flops_per_image,
    interleave_steps,
    max_logit_diff,
    paired_ratio,
    paired_repeat_ratio,
    peak_tflops,
    random_batch,
    train_step,
)
from vitpipe.benchmark.config import BenchConfig
from vitpipe.benchmark.naflex import naflex_batches
from vitpipe.benchmark.recipe import optimizer, recipe
from vitpipe.benchmark.run import SCHEMA, main, run
from vitpipe.benchmark.table import format_table
from vitpipe.benchmark.vit import build_pair
from vitpipe.data.fashion_mnist import DEBIAN_DIR
from vitpipe.errors import ConfigError
from vitpipe.lit.distill import load_teacher
from vitpipe.nn.patch_embed import ConvStem
from vitpipe.nn.pos_embed import SinCos2DPosEmbed
from vitpipe.run.build import build_from_config
from vitpipe.tasks.train import train

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(variant="vit_micro", batch_size=4, steps=2, warmup=1, repeats=1, workers=0)
PHASES = {"vit": ("train", "infer"), "lightning": ("train",), "data": ("load",), "switches": ("train",)}


def _check_schema(result: dict, only) -> None:
    assert result["schema"] == SCHEMA
    assert result["config"]["variant"] == "vit_micro" and result["config"]["img_size"] == 32
    assert {"torch", "timm", "lightning", "device_name", "loadavg_1m_start"} <= set(result["env"])
    assert set(result["results"]) == set(only)
    for comp, res in result["results"].items():
        assert res["ratios"] and all(math.isfinite(v) and v > 0 for v in res["ratios"].values()), comp
        for name, phases in res["contenders"].items():
            for phase in PHASES[comp]:
                s = phases[phase]
                assert math.isfinite(s["img_s"]) and s["img_s"] > 0, (comp, name, phase)
                assert s["step_s"] > 0 and s["timed_steps"] == 2
                assert s["img_s"] == pytest.approx(4 / s["step_s"])


def test_harness_runs_every_comparison_and_writes_the_schema(tmp_path):
    only = ("vit", "lightning", "data", "switches")
    cfg = BenchConfig(**TINY, switches=("adamw_fused", "sdpa_math"))
    result = run(cfg, only)
    _check_schema(result, only)
    vit = result["results"]["vit"]
    assert vit["max_abs_logit_diff"] < 1e-5
    for name in ("vitpipe", "timm"):  # the same network: the same peak step memory and resident state
        mem = vit["contenders"][name]["train"]["memory"]
        assert mem["peak_step_bytes"] > 0 and mem["state_bytes"] > 0
    assert vit["contenders"]["vitpipe"]["train"]["memory"] == vit["contenders"]["timm"]["train"]["memory"]
    assert vit["flops_per_image"]["train"] == pytest.approx(3 * vit["flops_per_image"]["forward"], rel=0.01)
    assert set(result["results"]["switches"]["contenders"]) == {"baseline", "adamw_fused", "sdpa_math"}
    assert "lightning/plain" in format_table(result)
    json.dumps(result)  # plain JSON types only


def test_shards_comparison_reads_the_same_images_and_pairs_repeats():
    result = run(BenchConfig(**{**TINY, "repeats": 2}), ("shards",))
    res = result["results"]["shards"]
    assert set(res["contenders"]) == {"imagefolder", "shards"}
    for name in res["contenders"]:
        assert len(res["contenders"][name]["load"]["per_repeat_step_s"]) == 2
        assert res["contenders"][name]["load"]["timed_steps"] == 4
    assert set(res["ratios"]) == {"throughput shards/imagefolder", "throughput shards/imagefolder (paired repeats)"}
    assert all(math.isfinite(v) and v > 0 for v in res["ratios"].values())


def test_mae_comparison_times_the_same_math_as_the_reference_and_a_supervised_step():
    result = run(BenchConfig(**{**TINY, "variant": "vit_nano"}), ("mae",))
    res = result["results"]["mae"]
    assert set(res["contenders"]) == {"vitpipe", "reference", "supervised"}
    for name, phases in res["contenders"].items():
        assert phases["train"]["timed_steps"] == 2 and phases["train"]["img_s"] > 0, name
    assert res["max_abs_loss_diff"] < 1e-5  # the reference way, same weights and noise: the same loss
    assert all(math.isfinite(v) and v > 0 for v in res["ratios"].values())
    assert "mae_step vitpipe/reference" in format_table(result)


def test_teacher_comparison_times_the_precompute_pass_against_contiguous_batches_on_the_same_logits(monkeypatch):
    """``--only teacher``: the shipped teacher's pass as ``teacher_targets`` runs it (channels-last, batches of
    128) and as contiguous batches of 1,000 give the same logits; the teacher's weights are contiguous again after."""
    from vitpipe.benchmark.teacher import SHIPPED, shipped_teacher
    from vitpipe.lit.distill import teacher_targets

    monkeypatch.setattr("vitpipe.benchmark.teacher.PASS_IMAGES", 200)  # a step of 200 images: one batch of
    result = run(BenchConfig(**TINY), ("teacher",))                      # 200 against two of 128 and 72
    res = result["results"]["teacher"]
    assert res["teacher"] == str(SHIPPED)  # the checkout's file
    assert set(res["contenders"]) == {"nchw_b1000", "nhwc_b128"}
    for phases in res["contenders"].values():
        assert phases["pass"]["timed_steps"] == 2 and phases["pass"]["img_s"] == pytest.approx(200 / phases["pass"]["step_s"])
    assert res["max_abs_target_diff"] < 1e-4
    assert all(math.isfinite(v) and v > 0 for v in res["ratios"].values())
    assert "max |logit diff| of the two passes" in format_table(result)
    teacher = shipped_teacher()
    convs = [p for p in teacher.parameters() if p.dim() == 4 and p.shape[1] > 1 and p.shape[-1] > 1]
    assert convs and all(w.is_contiguous() for w in convs)
    teacher_targets(teacher, torch.zeros(3, 1, 28, 28, dtype=torch.uint8), lambda x: x.float(), mirror=True)
    assert all(w.is_contiguous() for w in teacher.parameters())  # handed back as it came, not channels-last


def test_mae_comparison_refuses_a_variant_without_an_mae():
    with pytest.raises(ConfigError, match="no MAE variant mae_vit_micro"):
        run(BenchConfig(**TINY), ("mae",))


def test_naflex_comparison_times_mixed_aspect_dicts_against_the_fixed_path_and_timm():
    cfg = BenchConfig(**TINY)
    batches = naflex_batches(cfg)
    mixed, seq = batches["mixed"][0], 64  # vit_micro: 32 px / 4 = an 8x8 grid at most
    valid = mixed["patch_valid"]
    grids = {tuple(g) for g in ((mixed["patch_coord"] * valid[..., None]).amax(1) + 1).tolist()}
    assert mixed["patches"].shape[1] == seq and (~valid).any() and len({h / w for h, w in grids}) >= 2
    assert 4 * seq <= valid.sum() < 5 * seq  # the square batch's 4 x 64 tokens, within one image
    assert batches["square_dict"][0]["patch_valid"].all()  # square images fill their grid: no padding
    result = run(cfg, ("naflex",))
    res = result["results"]["naflex"]
    assert res["max_abs_logit_diff"] < 1e-5  # vitpipe and timm's NaFlexVit: same weights, same logits
    assert res["mixed_batch"]["valid_tokens"] == valid.sum() and 0 < res["mixed_batch"]["padding_fraction"] < 1
    assert set(res["contenders"]) == {"vitpipe_fixed", "vitpipe_dict_sq", "vitpipe_mixed", "timm_mixed"}
    for name, phases in res["contenders"].items():
        for phase in ("train", "infer"):
            s = phases[phase]
            assert s["timed_steps"] == 2 and s["tokens_s"] == pytest.approx(s["valid_tokens"] / s["step_s"]), name
    c = res["contenders"]
    assert res["ratios"]["infer time vitpipe/timm NaFlexVit"] == pytest.approx(
        c["vitpipe_mixed"]["infer"]["step_s"] / c["timm_mixed"]["infer"]["step_s"])
    assert len(res["ratios"]) == 10 and all(math.isfinite(v) and v > 0 for v in res["ratios"].values())
    assert "vitpipe/timm NaFlexVit" in format_table(result) and "% padding" in format_table(result)
    json.dumps(result)


def test_cli_writes_json_and_rejects_bad_names(tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["--variant", "vit_micro", "--batch-size", "4", "--steps", "2", "--warmup", "1", "--repeats", "1",
            "--only", "vit", "--out", str(out)]
    assert main(argv) == 0
    _check_schema(json.loads(out.read_text()), ("vit",))
    assert "vitpipe/timm" in capsys.readouterr().out
    assert main(["--only", "vit,bogus"]) == 2
    assert main(["--variant", "vit_zz"]) == 2
    assert "vit_zz" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [dict(precision="bf16"), dict(device="tpu"), dict(steps=0), dict(img_size=30),
                                 dict(switches=("turbo",))])
def test_bad_settings_raise_config_error(bad):
    with pytest.raises(ConfigError):
        BenchConfig(**{**TINY, **bad})


def test_harness_pair_is_the_same_network():
    """Equal logits before and after one identical AdamW step: same weights, config and optimizer."""
    cfg = BenchConfig(**TINY)
    ours, theirs = build_pair(cfg)
    renamed = lambda sd: {("pos_embed.weight" if k == "pos_embed" else k): v for k, v in sd.items()}  # noqa: E731
    shapes = lambda sd: {k: tuple(v.shape) for k, v in sd.items()}  # noqa: E731
    assert shapes(ours.state_dict()) == shapes(renamed(theirs.state_dict()))
    with torch.no_grad():  # timm's init leaves biases and tokens ~0: randomise so every weight matters
        for p in theirs.parameters():
            p.normal_(std=0.2)
    ours.load_state_dict(renamed(theirs.state_dict()))
    x, y = random_batch(cfg)
    assert max_logit_diff(ours, theirs, x) < 1e-5
    train_cfg = recipe(cfg)
    for net in (ours, theirs):
        train_step(net.train(), optimizer(train_cfg, net), x, y, cfg)()
    assert max_logit_diff(ours, theirs, x) < 1e-4


def test_interleaving_alternates_who_goes_first():
    calls = []
    times = interleave_steps({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                             steps=2, warmup=1, repeats=2, device="cpu")
    assert calls == ["a", "b"] + ["a", "b", "b", "a"] * 2
    assert [len(r) for r in times["a"]] == [2, 2]
    assert paired_ratio([[2.0, 4.0, 6.0]], [[1.0, 1.0, 2.0]]) == 3.0
    # repeat by repeat: a load spike in repeat 2 slows both contenders and cancels in their ratio
    assert paired_repeat_ratio([1.0, 10.0, 1.2], [0.5, 5.0, 1.0]) == 2.0
    with pytest.raises(ValueError):
        paired_repeat_ratio([1.0, 2.0], [1.0])


def test_cpu_step_memory_counts_what_the_step_allocates():
    with StepMemory("cpu") as mem:
        x = torch.ones(1024, 1024)  # 4 MiB
        y = x + 1  # another 4 MiB
        del x, y
    assert 8 * 2**20 <= mem.peak_step_bytes < 9 * 2**20


def test_flops_match_the_closed_form():
    cfg = BenchConfig(**TINY)
    ours, _ = build_pair(cfg)
    n, d, depth = 65, 64, 4  # 8x8 patches + class token
    forward = depth * (24 * n * d * d + 4 * n * n * d) + 2 * 64 * (3 * 16) * d + 2 * d * 10
    flops = flops_per_image(ours, 32)
    assert flops["forward"] == forward
    assert flops["train"] == pytest.approx(3 * forward, rel=0.01)
    assert peak_tflops("NVIDIA H200", "bf16-mixed") == 989.0 and peak_tflops("NVIDIA H100 PCIe", "32-true") == 51.2
    assert peak_tflops("Some Future GPU", "bf16-mixed") is None


# ---- the experiment recipes --------------------------------------------------------------


def test_fmnist_recipe_composes_and_instantiates(cfg_factory):
    full = cfg_factory("experiment=fmnist_vit")
    assert full.data._target_.endswith("FashionMNISTDataModule") and full.trainer.accelerator == "cpu"
    assert (full.model.patch_size, full.model.img_size, full.model.pos_embed) == (4, 28, "sincos2d")
    cfg = cfg_factory("experiment=fmnist_vit", "debug=fast", sub="fast")
    net = instantiate(cfg.model)
    assert isinstance(net.pos_embed, SinCos2DPosEmbed) and net.grid_size == (7, 7) and net.in_chans == 1
    assert isinstance(net.patch_embed, ConvStem) and net.patch_embed.depth == full.model.stem_depth == 2  # hybrid stem
    assert (full.model.depth, full.model.patch_drop_rate) == (4, 0.25)
    dm = instantiate(cfg.data)
    assert dm.img_size == (28, 28) and dm.num_classes == 10 and dm.fast_path
    assert full.data.random_erasing == 0.0 and full.data.hflip  # the mirror TTA relies on flipped training
    module = instantiate(cfg.module, net=net)
    assert module.hparams.label_smoothing == 0.1 and module.mixup is None
    with torch.no_grad():
        assert net(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    # soft distillation from the shipped teacher, its logits computed once before the first step: a small
    # file, the architecture experiment=fmnist_teacher trains, frozen; flips only, so the targets are exact
    d = full.module.distill
    assert (d.type, d.alpha, d.tau, d.precompute) == ("soft", 1.0, 1.0, True) and d.arch is d.kwargs is d.img_size is None
    # the teacher's KL alone, with linear decay: the pair measured at the steps the slowest CPU fits (docs/results.md)
    sched = full.module.scheduler
    assert (sched._target_, sched.power, sched.lr_min) == ("timm.scheduler.PolyLRScheduler", 1.0, 1.0e-5)
    assert full.data.crop_padding == 0 and full.data.fast_path and full.module.mixup is None  # what precompute needs
    assert Path(d.teacher).is_file() and Path(d.teacher).stat().st_size < 5 * 2**20  # the checkout's; the cap
    assert Path(d.teacher) == Path(full.paths.root_dir) / "assets/teachers/fmnist_resnet10t.safetensors"
    teacher_cfg = cfg_factory("experiment=fmnist_teacher", sub="teacher")  # what rebuilds the file
    tm = teacher_cfg.model
    from vitpipe.lit.distill import file_metadata

    meta = file_metadata(Path(d.teacher))
    assert (tm.name, tuple(tm.kwargs.channels), tm.img_size) == (meta["arch"], meta["kwargs"]["channels"], 56)
    assert meta["img_size"] == (56, 56)
    teacher = load_teacher(d.teacher, num_classes=10, in_chans=1)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    assert teacher.img_size == (56, 56)  # the 28-px batches are resized for it (distill.teacher_input)
    with torch.no_grad():
        assert teacher(torch.randn(2, 1, 56, 56)).shape == (2, 10)


# the recipe's seed-42 runs without its teacher (docs/results.md), as (optimizer steps that fitted, test accuracy),
# on a 2-core 2.0 GHz AMD EPYC (0.32-0.39 s a step, as their plan lines measured): its 10-, 20-, 30- and
# 60-minute budgets. Accuracy follows the steps a machine fits, not the minutes: the bar is the measured curve
# at the steps this machine fitted (one that fits more than 10,319: the last point), less the seed-to-seed
# spread of the three 30-minute seeds (0.0030), rounded up. The recipe distils from its teacher (+0.6 points
# on 3 seeds at 30 minutes, its logits computed inside the budget): it must not fall below the curve without it
FMNIST_SEED42_CURVE = ((1633, 0.8796), (3522, 0.9018), (4971, 0.9097), (10319, 0.9233))
FMNIST_SEED_SPREAD, FMNIST_BUDGET_S = 0.005, 1800


@pytest.mark.slow
@pytest.mark.skipif(not Path(DEBIAN_DIR).is_dir(), reason="needs Debian's dataset-fashion-mnist package")
def test_fmnist_recipe_reproduces_its_reported_accuracy(cfg_factory):
    # the whole recipe at its default seed (42), as docs/results.md measures it (its 30-minute budget on
    # whatever machine runs this), then its optional TTA evaluation; CPUs differ in the last bits and in
    # how many steps fit the budget
    import numpy as np

    from vitpipe.tasks.evaluate import evaluate

    cfg = cfg_factory("experiment=fmnist_vit", "callbacks.progress_bar.refresh_rate=0")
    metrics = train(cfg)
    assert metrics["time/budget_s"] == FMNIST_BUDGET_S and metrics["time/run_s"] <= FMNIST_BUDGET_S, metrics
    steps, accs = zip(*FMNIST_SEED42_CURVE)
    bar = float(np.interp(metrics["time/planned_steps"], steps, accs)) - FMNIST_SEED_SPREAD
    assert metrics["test/acc"] >= bar, (bar, metrics)
    tta = evaluate(cfg_factory(f"ckpt_path={cfg.paths.output_dir}", "tta=hflip", "trainer.accelerator=cpu",
                               "trainer.precision=32-true", config_name="eval", sub="tta"))
    # optional at test time; at 11 fixed epochs it added 0.24 to 0.70 points on each of 11 checkpoints: never below
    assert tta["test/acc"] >= metrics["test/acc"] - FMNIST_SEED_SPREAD, tta


def write_cifar10(root: Path, *, per_batch: int, n_test: int) -> None:
    """CIFAR-10's python layout (pickled dicts, rows R|G|B), random pixels: stand-in files."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, n in [(f"data_batch_{i}", per_batch) for i in range(1, 6)] + [("test_batch", n_test)]:
        with open(folder / name, "wb") as f:
            pickle.dump({"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                         "labels": rng.integers(0, 10, n).tolist()}, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, f)


def test_cifar10_recipe_composes_and_fast_dev_runs_on_cpu(cfg_factory, tmp_path, monkeypatch):
    full = cfg_factory("experiment=cifar10_vit", sub="full")
    assert full.trainer.accelerator == "gpu" and full.trainer.max_epochs == 200
    assert (full.model.name, full.model.patch_size, full.data.batch_size) == ("vit_s4", 4, 512)
    assert full.data.auto_augment and not full.data.fast_path and full.module.mixup.cutmix_alpha == 1.0
    # torchvision checks the files' md5 against the real archive; these are stand-ins
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *a, **k: True)
    cfg = cfg_factory("experiment=cifar10_vit", "debug=fast", "trainer.fast_dev_run=true", "data.num_workers=0",
                      "data.val_split=8", "data.pin_memory=false", sub="dev")
    write_cifar10(Path(cfg.paths.data_dir), per_batch=8, n_test=16)
    dm, net, module = build_from_config(cfg)
    assert module.mixup is not None and dm.auto_augment == "rand-m9-n2-mstd0.5"
    metrics = train(cfg)
    assert math.isfinite(metrics["test/loss"]) and 0.0 <= metrics["test/acc"] <= 1.0


@pytest.mark.slow  # two server processes start (~30-60 s on 2 busy cores)
def test_serve_comparison_loads_both_servers_and_predict_with_no_failures():
    """Tiny mode of ``--only serve``: every request answered by both servers, every ratio computed from the
    contenders' own figures, batches formed only where batching is on, memory read at both ends."""
    cfg = BenchConfig(**{**TINY, "batch_size": 8}, serve_requests=24, serve_clients=4)
    result = run(cfg, ("serve",))
    res = result["results"]["serve"]
    assert res["failed"] == 0
    load = res["serve"]
    for name in ("served_batched", "served_unbatched"):
        s = load[name]
        assert s["requests"] == s["answered"] == 24 and s["failed"] == 0, name
        assert 0 < s["p50_ms"] <= s["p99_ms"] and s["req_s"] > 0
        assert s["memory"]["start"]["rss_mb"] > 0 and s["memory"]["end"]["processes"] >= 2
    assert load["served_unbatched"]["max_batch"] == 1 and 1 <= load["served_batched"]["max_batch"] <= 8
    r, b, u = res["ratios"], load["served_batched"], load["served_unbatched"]
    assert r["req/s batched/unbatched"] == pytest.approx(b["req_s"] / u["req_s"])
    assert r["p99 latency batched/unbatched"] == pytest.approx(b["p99_ms"] / u["p99_ms"])
    assert r["req/s served batched/predict.py img/s"] == pytest.approx(b["req_s"] / res["predict"]["img_s"])
    ib, iu = res["in_process"]["batch_8"], res["in_process"]["batch_1"]  # the model code without HTTP
    assert r["req/s batched/unbatched without HTTP (the bound)"] == pytest.approx(ib["req_s"] / iu["req_s"])
    assert r["req/s served/without HTTP, batched"] == pytest.approx(b["req_s"] / ib["req_s"])
    assert ib["ms_per_request"] == pytest.approx(1e3 / ib["req_s"])
    assert len(r) == 7 and all(math.isfinite(v) and v > 0 for v in r.values())
    assert "served_batched: 24/24 answered (0 failed)" in format_table(result)
    json.dumps(result)
