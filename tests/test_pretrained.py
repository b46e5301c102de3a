"""Pretrained weights through the Hugging Face cache (offline), and the headline recipe
``model=vit_b16 data=cifar10`` (recipe/vit_b16_cifar10.yaml) from composition to a fast_dev_run.

huggingface_hub reads HF_HOME / HF_HUB_OFFLINE when it is imported, so every run that loads
weights from a cache written here is a subprocess with those variables set.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import timm
import torch
import torchvision
from safetensors.torch import load_file, save_file

from vitpipe.data import CIFAR10DataModule
from vitpipe.errors import ConfigError
from vitpipe.models.registry import TIMM_NAMES
from vitpipe.run.build import build_from_config

ROOT = Path(__file__).resolve().parents[1]
TI_NAME = TIMM_NAMES["vit_ti16"]  # vit_tiny_patch16_224.augreg_in21k_ft_in1k
B16_RECIPE_NAME = "vit_base_patch16_224.augreg_in21k"  # the tag recipe/vit_b16_cifar10.yaml names


def fill_hf_cache(home: Path, name: str, seed: int = 0) -> Path:
    """Random weights for timm model ``name`` in the Hugging Face cache layout timm reads offline:
    hub/models--timm--<name>/snapshots/<rev>/model.safetensors with refs/main holding <rev>."""
    torch.manual_seed(seed)
    tm = timm.create_model(name, pretrained=False)
    repo = home / "hub" / f"models--timm--{name}"
    rev = f"{seed:040x}"
    snapshot = repo / "snapshots" / rev
    snapshot.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tm.state_dict().items()}, str(snapshot / "model.safetensors"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    return snapshot / "model.safetensors"


def offline_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    return {**env, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def ti_cache(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf")
    return home, fill_hf_cache(home, TI_NAME)


def test_pretrained_true_offline_loads_exactly_the_cached_weights(ti_cache, tmp_path):
    home, weights = ti_cache
    script = textwrap.dedent(f"""
        import sys, torch, timm, vitpipe
        torch.manual_seed(1)
        x = torch.randn(2, 3, 224, 224)
        ours = vitpipe.create_model("vit_ti16", pretrained=True, num_classes=1000).eval()
        ref = timm.create_model("{TI_NAME}", pretrained=True).eval()
        with torch.no_grad():
            torch.save({{"ours": ours(x), "ref": ref(x), "state": ours.state_dict(), "ref_state": ref.state_dict()}},
                       sys.argv[1])
    """)
    out = tmp_path / "out.pt"
    r = subprocess.run([sys.executable, "-c", script, str(out)], env=offline_env(home), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = torch.load(out, weights_only=True)
    written = load_file(str(weights))
    # timm read the cache (nothing else holds these random weights) and vitpipe holds the same tensors
    assert all(torch.equal(got["ref_state"][k], v) for k, v in written.items())
    renamed = {("pos_embed.weight" if k == "pos_embed" else k): v for k, v in written.items()}
    assert renamed.keys() == got["state"].keys()
    assert all(torch.equal(got["state"][k], v) for k, v in renamed.items())
    assert torch.equal(got["ours"], got["ref"])


def _train_cli(*args: str, env: dict, cwd: Path = ROOT, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_pretrained_offline_without_cache_fails_in_one_line(tmp_path):
    r = _train_cli("model=vit_ti16", "model.pretrained=true", "logger=none", f"paths.log_dir={tmp_path}/logs",
                   f"hydra.run.dir={tmp_path}/run", env=offline_env(tmp_path / "empty_hf"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("vitpipe: error:")]
    assert len(errors) == 1, r.stderr[-2000:]
    line = errors[0]
    assert f"could not fetch timm weights '{TI_NAME}'" in line
    assert f"hf download timm/{TI_NAME}" in line and f"models--timm--{TI_NAME}" in line  # way 1: the cache
    assert "model.pretrained=/path/to/model.safetensors" in line  # way 2: a file
    assert not (tmp_path / "run").exists()  # the command line's check: no run directory was made


@pytest.mark.parametrize("network", ["offline", "unreachable"])
def test_pretrained_true_without_the_weights_is_the_runs_own_line_before_torch_loads(tmp_path, network, monkeypatch):
    """The command line answers ``model.pretrained=true`` with the line the model's loader gives, before torch
    and timm load (``vitpipe.tasks.cli.pretrained_mistake``): HF_HUB_OFFLINE with an empty cache, and no
    HF_HUB_OFFLINE with the Hub unreachable (one request). The loader's own line, in process and after timm
    has read its pretrained config, is the same but for the reason in parentheses."""
    env = offline_env(tmp_path / "empty_hf") if network == "offline" else online_env(tmp_path / "empty_hf")
    code = ("import sys\nfrom vitpipe.commands import run\ntry:\n    run('train', ['model=vit_ti16', "
            "'model.pretrained=true', 'logger=none', 'hydra.run.dir=run'])\nexcept SystemExit as e:\n"
            "    print('exit', e.code, sorted(m for m in ('torch', 'lightning', 'timm') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.strip() == "exit 2 []", (r.stdout, r.stderr[-2000:])
    (line,) = [line for line in r.stderr.splitlines() if line.startswith("vitpipe:")]
    why = re.search(r"\(([^():]+): offline, and not in the Hugging Face cache", line).group(1)
    assert why == "HF_HUB_OFFLINE is set" if network == "offline" else why.isidentifier(), line  # the error's name
    from huggingface_hub import constants

    from vitpipe.models.hub import offline_weights_message
    from vitpipe.models.weights import _timm_hub_files

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty_hf" / "hub"))  # the command's HF_HOME
    assert line == f"vitpipe: error: model: {offline_weights_message(TI_NAME, _timm_hub_files(TI_NAME)[0], why)}"
    assert not (tmp_path / "run").exists()  # no run directory


def test_the_loaders_own_line_offline_is_the_command_lines(tmp_path, monkeypatch):
    """In process, past the command line (``vitpipe.create_model`` from Python): the same line, from timm's
    pretrained config, before timm is asked to download."""
    from huggingface_hub import constants

    import vitpipe
    from vitpipe.models.hub import offline_weights_message

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError) as e:
        vitpipe.create_model("vit_ti16", pretrained=True)
    assert str(e.value) == offline_weights_message(TI_NAME, f"timm/{TI_NAME}", "HF_HUB_OFFLINE is set")


def test_the_variant_tables_hub_files_are_what_timm_downloads():
    """The command line's check reads the weights' repository and files from the variant table without timm
    (``vitpipe.models.hub.variant_hub_files``); the loader asks timm's pretrained config. Equal for every
    variant with timm weights."""
    from vitpipe.models.hub import variant_hub_files
    from vitpipe.models.weights import _timm_hub_files

    assert TIMM_NAMES and all(variant_hub_files(n) == _timm_hub_files(n) for n in TIMM_NAMES.values()), \
        {n: (variant_hub_files(n), _timm_hub_files(n)) for n in TIMM_NAMES.values()}


def online_env(home: Path) -> dict[str, str]:
    """As a user's shell: HF_HUB_OFFLINE unset (huggingface_hub would try the network; here there is none)."""
    return {k: v for k, v in offline_env(home).items() if k != "HF_HUB_OFFLINE"}


def _hub_noise(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines()
            if not line.startswith("vitpipe:") and ("huggingface" in line.lower() or "requesting" in line)]


@pytest.mark.alone  # wall time measured: no other test beside it under xdist
def test_pretrained_without_network_or_cache_fails_fast_in_one_line(tmp_path):
    """No HF_HUB_OFFLINE, no network, an empty cache: one attempt, no retry warnings, the one line."""
    start = time.monotonic()
    r = _train_cli("model=vit_ti16", "model.pretrained=true", "logger=none", f"paths.log_dir={tmp_path}/logs",
                   f"hydra.run.dir={tmp_path}/run", env=online_env(tmp_path / "empty_hf"), timeout=300)
    elapsed = time.monotonic() - start
    assert r.returncode == 2, r.stderr[-2000:]
    assert _hub_noise(r.stderr) == [], _hub_noise(r.stderr)[:3]
    errors = [line for line in r.stderr.splitlines() if line.startswith("vitpipe: error:")]
    assert len(errors) == 1 and f"could not fetch timm weights '{TI_NAME}'" in errors[0], r.stderr[-2000:]
    assert elapsed < 40, elapsed  # huggingface_hub's retries alone sleep 2 x 23 s


def test_pretrained_from_the_cache_without_hf_hub_offline_asks_no_network(ti_cache, tmp_path):
    home, weights = ti_cache
    script = textwrap.dedent("""
        import sys, torch, vitpipe
        torch.save(vitpipe.create_model("vit_ti16", pretrained=True, num_classes=1000).state_dict(), sys.argv[1])
    """)
    out = tmp_path / "state.pt"
    r = subprocess.run([sys.executable, "-c", script, str(out)], env=online_env(home), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert _hub_noise(r.stderr) == [], _hub_noise(r.stderr)[:3]
    got = torch.load(out, weights_only=True)
    written = {("pos_embed.weight" if k == "pos_embed" else k): v for k, v in load_file(str(weights)).items()}
    assert got.keys() == written.keys() and all(torch.equal(got[k], v) for k, v in written.items())


def test_weights_of_other_shapes_name_the_first_mismatches_in_a_short_line(tmp_path):
    """A vit_nano file (64 wide, 4 blocks) into the debug=fast model (32 wide, 1 block)."""
    import vitpipe

    file = tmp_path / "nano64.safetensors"
    save_file(vitpipe.create_model("vit_nano", num_classes=10, in_chans=1).state_dict(), str(file))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    r = _train_cli("debug=fast", "logger=none", f"model.pretrained={file}", f"hydra.run.dir={tmp_path}/run", env=env,
                   timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = [line for line in r.stderr.splitlines() if line.startswith("vitpipe:")]
    assert len(line) < 300, (len(line), line)
    model = vitpipe.create_model("vit_nano", num_classes=10, in_chans=1, dim=32, depth=1, num_heads=2)
    first = next(iter(model.state_dict()))  # cls_token: the model's first weight, 64 wide in the file
    assert f"'{file.name}' do not fit this model: 17 shape mismatches (file vs model): {first} (1,1,64) vs (1,1,32), " \
        in line, line
    assert "and 14 more; 36 unexpected keys; " in line, line


# ---- the headline recipe --------------------------------------------------------------------


def test_headline_command_composes_to_the_recipe(cfg_factory, capsys):
    from vitpipe.config.preflight import check_config
    from vitpipe.config.recipe import announce_recipe, applied_recipe

    cfg = cfg_factory("model=vit_b16", "data=cifar10")
    assert cfg.hydra.runtime.choices.recipe == "vit_b16_cifar10"
    assert cfg.model.pretrained == B16_RECIPE_NAME and cfg.model.drop_path_rate == 0.0
    opt = cfg.module.optimizer  # the ViT paper's fine-tuning: SGD 0.9, no weight decay (no AdamW keys left)
    assert dict(opt) == {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.03, "momentum": 0.9,
                         "weight_decay": 0.0}
    assert cfg.trainer.max_steps == 10_000 and cfg.trainer.max_epochs == -1 and cfg.trainer.gradient_clip_val == 1.0
    assert cfg.module.warmup_fraction * cfg.trainer.max_steps == 500 and cfg.module.scheduler.lr_min == 0.0
    assert cfg.data.batch_size == 512 and list(cfg.data.mean) == [0.5] * 3 and list(cfg.data.std) == [0.5] * 3
    assert cfg.data.download is True and cfg.module.label_smoothing == 0.0 and cfg.module.finetune == "full"
    check_config(cfg)  # every value fits what it builds (SGD takes these arguments)

    announce_recipe(cfg)
    line = capsys.readouterr().out.strip()
    assert line.startswith("vitpipe: recipe recipe/vit_b16_cifar10.yaml applied (")
    assert "trainer.max_steps=10000" in line and "module.optimizer=SGD(lr=0.03, momentum=0.9, weight_decay=0.0)" in line

    overridden = cfg_factory("model=vit_b16", "data=cifar10", "trainer.max_steps=20", sub="o")
    assert overridden.trainer.max_steps == 20  # the command line wins over the recipe
    other = cfg_factory("model=vit_s16", "data=cifar10", sub="s")  # no file for this pair: nothing applied
    assert applied_recipe() is None and other.module.optimizer._target_ == "torch.optim.AdamW"
    announce_recipe(other)
    assert capsys.readouterr().out == ""


@pytest.fixture
def fake_cifar(tmp_path, monkeypatch):
    from test_data import write_cifar10

    # tiny stand-ins in CIFAR's format: torchvision's md5 checks bypassed (in this process only)
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *args, **kwargs: True)
    write_cifar10(tmp_path / "data")
    return tmp_path / "data"


# subprocesses run the CLI; the md5 bypass above does not reach them, so they get it from a sitecustomize
SITE = """
import torchvision.datasets, torchvision.datasets.cifar
torchvision.datasets.CIFAR10._check_integrity = lambda self: True
torchvision.datasets.cifar.check_integrity = lambda *a, **k: True
"""


def _recipe_run(tmp_path: Path, data: Path, hf_home: Path, *extra: str) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITE)
    env = {**offline_env(hf_home), "PYTHONPATH": str(site)}
    return _train_cli("model=vit_b16", "data=cifar10", "trainer.fast_dev_run=true", "trainer.accelerator=cpu",
                      "trainer.precision=32-true", "data.batch_size=2", "data.eval_batch_size=2", "data.val_split=5",
                      "logger=none", f"paths.data_dir={data}", f"paths.log_dir={tmp_path}/logs",
                      f"hydra.run.dir={tmp_path}/run", *extra, env=env)


def test_recipe_fast_dev_run_on_a_small_variant(fake_cifar, ti_cache, tmp_path):
    """The headline path (recipe, pretrained from the cache offline, CIFAR files, SGD, timm cosine)
    with ViT-Ti/16 dimensions in place of ViT-B/16 so that it runs in seconds."""
    home, _ = ti_cache
    r = _recipe_run(tmp_path, fake_cifar, home, "model.dim=192", "model.num_heads=3", f"model.pretrained={TI_NAME}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "vitpipe: recipe recipe/vit_b16_cifar10.yaml applied (" in r.stdout
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert 0.0 <= metrics["test/acc"] <= 1.0


@pytest.mark.slow
def test_recipe_fast_dev_run_with_vit_b16_weights(fake_cifar, tmp_path):
    """The headline command itself, with 410 MB of random ViT-B/16 in21k weights in the cache."""
    home = tmp_path / "hf"
    fill_hf_cache(home, B16_RECIPE_NAME)
    r = _recipe_run(tmp_path, fake_cifar, home)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "vitpipe: recipe recipe/vit_b16_cifar10.yaml applied (" in r.stdout


def test_headline_without_data_fails_in_one_line(cfg_factory, monkeypatch):
    # no files and no download: the check before anything is built
    with pytest.raises(ConfigError) as err:
        build_from_config(cfg_factory("model=vit_b16", "data=cifar10", "data.download=false", "model.pretrained=null"))
    assert "\n" not in str(err.value) and "cifar-10-batches-py lacks data_batch_1" in str(err.value)
    assert "data.download=true" in str(err.value)

    # download on (the default) but no network: prepare_data says what is missing and both ways to get it
    def offline(*args, **kwargs):
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(torchvision.datasets.cifar, "download_and_extract_archive", offline)
    cfg = cfg_factory("model=vit_b16", "data=cifar10", sub="dl")
    dm = CIFAR10DataModule(**{k: v for k, v in cfg.data.items() if k != "_target_"})
    with pytest.raises(ConfigError) as err:
        dm.prepare_data()
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("cifar10 is missing (") and "lacks data_batch_1" in msg
    assert "downloading it failed (OSError" in msg
    assert "data.download=true fetches it" in msg and "cifar-10-python.tar.gz" in msg and "by hand" in msg


def test_download_skips_files_that_are_present(fake_cifar, monkeypatch):
    def network(*args, **kwargs):
        raise AssertionError("no download may start when the files are there")

    monkeypatch.setattr(torchvision.datasets.cifar, "download_and_extract_archive", network)
    dm = CIFAR10DataModule(img_size=32, in_chans=3, num_classes=10, channels=3, root=str(fake_cifar), download=True)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.data_train) + len(dm.data_val) == 15
