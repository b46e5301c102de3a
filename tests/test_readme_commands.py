"""Every command the README (and any docs page) shows runs as a user types it.

From one fresh working directory per module (``scripts/`` linked, ``conf/``, ``assets/`` copied, no logs/ or
data/), through the real CLI in subprocesses, in the order a reader meets them. What may be added
to a shown command is only what shortens it (``SHORT_TRAIN``, ``hydra.sweeper.n_trials=2``,
``--steps 1``, ``num_images=16``), never a ``hydra.*`` path; placeholders (``<time>``, ``<ckpt>``,
``/data/imagenet``) become the run or the tiny data the test made. A command that cannot run here
(no GPU, no network, no SLURM) is checked to fail with its one-line message, exit status 2.

``SPECS`` holds one entry per shown command; a command shown without an entry (or an entry no page
shows any more) fails ``test_every_shown_command_has_a_spec``.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from readme_commands import shown_commands
from user_shell import ROOT, SHORT_TRAIN, argv, run_dir_of, user_env

FMNIST = Path("/usr/share/datasets/fashion-mnist")
GPU_LINE = r"trainer\.accelerator=gpu needs a CUDA GPU and torch sees none here; use trainer=cpu"
SLURM_LINE = r"hydra/launcher=slurm submits each job with SLURM's sbatch, which is not on PATH here"


@dataclass(frozen=True)
class Spec:
    append: tuple[str, ...] = ()          # shortening only
    fails: str | None = None              # regex of the one `vitpipe: error:` line (exit 2)
    needs: tuple[str, ...] = ()           # shown commands that must have run first (in the same directory)
    time_of: str | None = None            # the shown command whose run dir `logs/<task>/runs/<time>` means
    skip: str | None = None               # why this shown command is not run by this test
    quick: bool = False                   # in the default suite; the others are marked slow (.ci/run runs them)
    own_dir: bool = False                 # in a working directory of its own, where only `needs` ran before
    session: str = "reader"               # commands with the same session share one working directory
                                          # (`last` is the newest checkpoint under its logs/, of any task: "e2e"
                                          # is where only the default run trains)
    needs_fmnist: bool = False
    expect: tuple[str, ...] = field(default=())   # substrings its stdout must hold
    files: tuple[str, ...] = field(default=())    # paths (relative to the working dir) it must leave
    server: str | None = None             # a server: run with port=<free> until GET <this path> answers 200,
                                          # then `ask` (each must exit 0 printing "labels"), then Ctrl-C: exit 0
    ask: tuple[str, ...] = field(default=())      # shell lines sent to a running server ({port}: its port)
    needs_chromium: bool = False


TRAIN = "python scripts/train.py"
DEFAULT = TRAIN
PNGS = ("python -c \"from sklearn.datasets import load_digits; from PIL import Image; import os; "
        "os.makedirs('digits_png', exist_ok=True); d = load_digits(); [Image.fromarray((d.images[-1-i] * 255 / 16)"
        ".astype('uint8')).resize((64, 64)).save(f'digits_png/{i:02d}_true{d.target[-1-i]}.png') for i in range(12)]\"")
CAPTION = f"{TRAIN} experiment=caption_shapes"
FMNIST_RUN = f"{TRAIN} experiment=fmnist_vit"
FMNIST_REG4 = f"{TRAIN} experiment=fmnist_vit model.reg_tokens=4"
TEACHER = f"{TRAIN} experiment=fmnist_teacher"
SWEEP = f"{TRAIN} -m model.pos_embed=learned,sincos2d,learned2d"
SOURCE = f"{TRAIN} experiment=transfer_source"
MAE_FMNIST = f"{TRAIN} experiment=mae_fmnist"
LORA_WEIGHTS = ("python -c \"import os; from safetensors.torch import save_file; from vitpipe.models import create_model; "
                "os.makedirs('logs', exist_ok=True); m = create_model('vit_s16', num_classes=10); save_file({k: "
                "v.contiguous() for k, v in m.state_dict().items()}, 'logs/vit_s16_random.safetensors')\"")
FLEXI = f'{TRAIN} model=vit_micro model.img_size=28 data=fashion_mnist "model.flexi_patch_sizes=[4,7,14]"'
ASPECT = "python scripts/make_aspect_data.py --out data/fmnist_aspect --train 3000 --val 500 --test 1000 --seed 0"
MOSAICS = "python scripts/make_mosaics.py --out data/fmnist_mosaics --train 4000 --val 500 --test 500 --seed 0"
MOSAIC_TRAIN = (f"{TRAIN} data=imagefolder data.root=data/fmnist_mosaics data.labels=labels.csv module.task=multilabel "
                "model.img_size=56 model.patch_size=14 model.dim=64 model.depth=2 model.num_heads=2 data.augment=false "
                "module.optimizer.lr=3e-3 module.label_smoothing=0 data.batch_size=64 trainer=cpu trainer.max_epochs=20 seed=0")
DEMO_FMNIST = f"{TRAIN} experiment=fmnist_vit module.distill=null trainer.max_epochs=2 logger=none"
SERVE = "python scripts/serve.py ckpt_path=last"
ASK = ("curl -sf -X POST localhost:{port}/predict -F image=@digits_png/00_true8.png",
       'curl -sf -X POST "localhost:{port}/predict?explain=rollout" -F image=@digits_png/00_true8.png')
HF_SAVE = ("python -c \"from sklearn.datasets import load_digits; from datasets import ClassLabel, Dataset, DatasetDict, "
           "Features, Image; d = load_digits(); f = Features({'image': Image(), 'label': ClassLabel(names=[str(i) for i in "
           "range(10)])}); part = lambda a, b: Dataset.from_dict({'image': [(x * 255 / 16).astype('uint8') for x in "
           "d.images[a:b]], 'label': d.target[a:b]}, features=f); DatasetDict(train=part(0, 1300), validation=part(1300, "
           "1500), test=part(1500, None)).save_to_disk('data/digits_hf')\"")
HF_TRAIN = f"{TRAIN} data=hf data.name=data/digits_hf"
ML_DATA = "data=imagefolder data.root=data/fmnist_mosaics data.labels=labels.csv"
ML_EVAL = f"python scripts/eval.py ckpt_path=logs/train/runs/<time> {ML_DATA}"
ML_SHARDS = ("python scripts/make_shards.py data=imagefolder data.root=data/fmnist_mosaics data.labels=labels.csv "
             "out=data/fmnist_mosaics_shards")
ML_SHARDS_TRAIN = MOSAIC_TRAIN.replace("data=imagefolder data.root=data/fmnist_mosaics data.labels=labels.csv",
                                       "data=shards data.root=data/fmnist_mosaics_shards")
ML_TUNE = f"{ML_EVAL} split=val tune_thresholds=true"
ML_PREDICT = "python scripts/predict.py ckpt_path=logs/train/runs/<time> images=data/fmnist_mosaics/test out=mosaic_preds.csv"
ML_EXPORT = "python scripts/export.py ckpt_path=logs/train/runs/<time> format=timm out=mosaics_vit"
ML_VIS = ("python scripts/visualize_attention.py ckpt_path=logs/train/runs/<time> images=data/fmnist_mosaics/test "
          "method=gradient target=Bag num_images=4")
ML_SERVE = "python scripts/serve.py ckpt_path=logs/train/runs/<time>"
ML_ASK = ("curl -sf -X POST localhost:{port}/predict -F image=@data/fmnist_mosaics/test/00000.png",)
S = tuple(SHORT_TRAIN)
SB = (*S, "data.batch_size=8", "data.eval_batch_size=8")   # 2 batches of a big model: small ones
LONG_SEQ = "python scripts/benchmark.py --only long_seq --steps 2 --warmup 1 --repeats 1 --out long_seq.json"
HEADLINE_FAILS = (r"model: could not fetch timm weights 'vit_base_patch16_224\.augreg_in21k'")

SPECS: dict[str, Spec] = {
    # docs/serving.md
    'pip install -e ".[serve]"': Spec(skip="an install step: .ci/run installs .[dev], which holds the serve extra"),
    SERVE: Spec(needs=(DEFAULT, PNGS), session="e2e", server="/health", ask=ASK,
                expect=("vitpipe serve: POST http://127.0.0.1:", "classes (10)")),
    "python scripts/serve.py ckpt_path=logs/train/runs/<time> port=8080 max_batch_size=32 batch_timeout_ms=10 "
    "workers_per_device=1": Spec(needs=(DEFAULT, PNGS), time_of=DEFAULT, session="e2e", server="/health", ask=ASK[:1],
                                 expect=("max_batch_size=32, batch_timeout_ms=10",)),
    f"{SERVE} backend=onnx": Spec(needs=(DEFAULT, PNGS), session="e2e", server="/health", ask=ASK[:1],
                                  expect=("backend=onnx",)),
    "python scripts/benchmark.py --only serve --variant vit_ti4 --batch-size 32 --requests 2000 --clients 16": Spec(
        append=("--variant", "vit_micro", "--batch-size", "8", "--requests", "24", "--clients", "4", "--repeats", "1",
                "--warmup", "1"), expect=("served_batched: 24/24 answered (0 failed)",)),
    # docs/demo.md
    "python scripts/demo.py ckpt_path=last": Spec(needs=(DEFAULT,), session="e2e", server="/",
                                                  expect=("vitpipe demo: http://127.0.0.1:", "vitpipe demo: stopped")),
    DEMO_FMNIST: Spec(append=SB, needs_fmnist=True),
    "python tests/drivers/demo_screenshot.py --ckpt logs/fmnist_vit/runs/<time> --example 0 --out docs/img/demo.png": Spec(
        needs=(DEMO_FMNIST,), time_of=DEMO_FMNIST, needs_fmnist=True, needs_chromium=True, files=("docs/img/demo.png",)),
    # docs/hf-datasets.md
    HF_SAVE: Spec(files=("data/digits_hf/dataset_dict.json",)),
    HF_TRAIN: Spec(append=S, needs=(HF_SAVE,), expect=("vit_nano on HFDataModule", "test/acc")),
    f"{HF_TRAIN} data.streaming=true": Spec(append=S, needs=(HF_SAVE,), expect=("vit_nano on HFDataModule",)),
    f"{TRAIN} data=hf data.name=uoft-cs/cifar10 data.image_column=img": Spec(
        fails=r"data\.name=uoft-cs/cifar10: not a local path and not in the Hugging Face cache"),
    # docs/multilabel.md
    MOSAICS: Spec(needs_fmnist=True, files=("data/fmnist_mosaics/labels.csv", "data/fmnist_mosaics/manifest.csv")),
    MOSAIC_TRAIN: Spec(append=S, needs=(MOSAICS,), needs_fmnist=True, expect=("test/map",)),
    ML_EVAL: Spec(needs=(MOSAICS, MOSAIC_TRAIN), time_of=MOSAIC_TRAIN, needs_fmnist=True, expect=("test/map",)),
    ML_TUNE: Spec(needs=(MOSAICS, MOSAIC_TRAIN), time_of=MOSAIC_TRAIN, needs_fmnist=True, expect=("== vitpipe eval:",)),
    ML_PREDICT: Spec(needs=(MOSAICS, MOSAIC_TRAIN, ML_TUNE), time_of=MOSAIC_TRAIN, needs_fmnist=True,
                     expect=("vitpipe predict: 500 image(s)",), files=("mosaic_preds.csv",)),
    ML_EXPORT: Spec(needs=(MOSAICS, MOSAIC_TRAIN), time_of=MOSAIC_TRAIN, needs_fmnist=True,
                    files=("mosaics_vit/config.json", "mosaics_vit/README.md")),
    ML_VIS: Spec(needs=(MOSAICS, MOSAIC_TRAIN), time_of=MOSAIC_TRAIN, needs_fmnist=True, expect=("PNG files (gradient)",)),
    ML_SHARDS: Spec(needs=(MOSAICS,), needs_fmnist=True, expect=("module.task=multilabel",),
                    files=("data/fmnist_mosaics_shards/vitpipe_shards.json",)),
    ML_SHARDS_TRAIN: Spec(append=S, needs=(MOSAICS, ML_SHARDS), needs_fmnist=True, expect=("test/map",)),
    ML_SERVE: Spec(needs=(MOSAICS, MOSAIC_TRAIN), time_of=MOSAIC_TRAIN, needs_fmnist=True, server="/health", ask=ML_ASK,
                   expect=("multi-label: every class with sigmoid",)),
    # docs/attention.md
    f"{TRAIN} model.rel_pos=bias": Spec(append=S, expect=("test/acc",)),
    f"{TRAIN} model.rel_pos=mlp_cr model.pos_embed=none": Spec(append=S, expect=("test/acc",)),
    f"{TRAIN} model.rel_pos=mlp_swin model.rel_pos_shared=true": Spec(append=S, expect=("test/acc",)),
    f"{TRAIN} model.rel_pos=mlp_cr model.pos_embed=none model.res_post_norm=true model.init_values=1e-6": Spec(
        append=S, expect=("test/acc",)),
    f"{TRAIN} model.attn_window=1 model.attn_global_stride=2": Spec(append=S, expect=("test/acc",)),
    # docs/performance.md: the long-sequence table (~2 min)
    LONG_SEQ: Spec(files=("long_seq.json",)),
    "python -c \"import json; from vitpipe.benchmark.long_seq import markdown; print(markdown(json.load(open("
    "'long_seq.json'))['results']['long_seq']))\"": Spec(needs=(LONG_SEQ,), expect=("| 4096 (+1) | local_flex |",)),
    # docs/attention-health.md
    f"{TRAIN} callbacks=attention_health": Spec(append=S, expect=("test/acc",)),
    f'{TRAIN} "callbacks=[rollout,attention_health]" callbacks.attention_health.every_n_steps=100': Spec(
        append=S, expect=("test/acc",)),
    f"{TRAIN} callbacks=attention_health module.optimizer.lr=1e-1 module.warmup_fraction=0": Spec(
        append=S, expect=("test/acc",)),
    f"{TRAIN} callbacks=attention_health module.optimizer.lr=1e-1 module.warmup_fraction=0 model.qk_norm=true": Spec(
        append=S, expect=("test/acc",)),
    # docs/doctor.md, README.md
    "python scripts/doctor.py ckpt_path=last": Spec(needs=(DEFAULT,), session="e2e",
                                                    expect=("doctor: 4 passed, 0 failed, 2 skipped",)),
    "python scripts/doctor.py model=vit_micro": Spec(expect=("doctor: 4 passed, 0 failed, 2 skipped",)),
    "python scripts/doctor.py ckpt_path=logs/train/runs/<time>": Spec(needs=(DEFAULT,), time_of=DEFAULT,
                                                                      expect=("doctor: 4 passed, 0 failed, 2 skipped",)),
    # docs/mae.md
    f"{TRAIN} model=mae_vit_nano module=mae": Spec(append=S, expect=("mae_vit_nano on DigitsDataModule", "test/loss")),
    MAE_FMNIST: Spec(append=SB, needs_fmnist=True, expect=("test/loss",)),
    f"{TRAIN} model=mae_vit_s4 module=mae data=imagefolder data.root=/data/imagenet data.labels=none": Spec(
        append=SB, expect=("test/loss",)),
    f"{TRAIN} experiment=mae_fmnist_finetune model.pretrained=logs/mae_fmnist/runs/<time>": Spec(
        append=SB, needs=(MAE_FMNIST,), time_of=MAE_FMNIST, needs_fmnist=True, expect=("test/acc",)),
    f"{TRAIN} experiment=mae_fmnist_finetune model.pretrained=logs/mae_fmnist/runs/<time> data.train_per_class=60": Spec(
        append=SB, needs=(MAE_FMNIST,), time_of=MAE_FMNIST, needs_fmnist=True, expect=("test/acc",)),
    f"{TRAIN} experiment=mae_fmnist_probe model.pretrained=logs/mae_fmnist/runs/<time>": Spec(
        append=SB, needs=(MAE_FMNIST,), time_of=MAE_FMNIST, needs_fmnist=True, expect=("test/acc",)),
    # docs/mae.md's measured table: sweeps over the MAE run and from scratch, 3 seeds
    f"{TRAIN} -m experiment=mae_fmnist_finetune model.pretrained=logs/mae_fmnist/runs/<time>,null "
    "data.train_per_class=60,600 seed=0,1,2": Spec(
        append=SB, needs=(MAE_FMNIST,), time_of=MAE_FMNIST, needs_fmnist=True, expect=("sweep summary of 12 job(s)",)),
    f"{TRAIN} -m experiment=mae_fmnist_probe model.pretrained=logs/mae_fmnist/runs/<time> "
    "data.train_per_class=60,600 seed=0,1,2": Spec(
        append=SB, needs=(MAE_FMNIST,), time_of=MAE_FMNIST, needs_fmnist=True, expect=("sweep summary of 6 job(s)",)),
    f"{TRAIN} -m experiment=mae_fmnist_finetune model.pretrained=logs/mae_fmnist/runs/<time>,null "
    "data.train_per_class=60 trainer.max_epochs=100 trainer.check_val_every_n_epoch=10 seed=0,1,2": Spec(
        append=SB, needs=(MAE_FMNIST,), time_of=MAE_FMNIST, needs_fmnist=True, expect=("sweep summary of 6 job(s)",)),
    f"{TRAIN} -m experiment=mae_fmnist_probe model.pretrained=logs/mae_fmnist/runs/<time> "
    "data.train_per_class=60 trainer.max_epochs=100 trainer.check_val_every_n_epoch=10 seed=0,1,2": Spec(
        append=SB, needs=(MAE_FMNIST,), time_of=MAE_FMNIST, needs_fmnist=True, expect=("sweep summary of 3 job(s)",)),
    "python scripts/benchmark.py --variant vit_ti4 --only mae --batch-size 64 --steps 10 --warmup 3 --repeats 5": Spec(
        append=("--batch-size", "4", "--steps", "1", "--warmup", "1", "--repeats", "1"),
        expect=("mae_step vitpipe/reference",)),
    # docs/naflex.md
    "python scripts/naflex_curve.py --out logs/naflex_curve --epochs 10 --train-per-class 600 --seed 0": Spec(
        append=("--epochs", "1", "--train-per-class", "3", "--grids", "2", "3"), needs_fmnist=True,
        expect=("wrote",), files=("logs/naflex_curve/results.csv", "logs/naflex_curve/seq_len_curve.png")),
    ASPECT: Spec(needs_fmnist=True, files=("data/fmnist_aspect/manifest.csv",)),
    f"{ASPECT.replace('fmnist_aspect', 'fmnist_aspect_sq')} --squash 28": Spec(
        needs_fmnist=True, files=("data/fmnist_aspect_sq/manifest.csv",)),
    f"{TRAIN} model=vit_micro model.img_size=28 data=imagefolder data.root=data/fmnist_aspect "
    'data.naflex.enabled=true "data.naflex.seq_lens=[49]" data.naflex.max_seq_len=49': Spec(
        append=S, needs=(ASPECT,), needs_fmnist=True, expect=("test/acc",)),
    f"{TRAIN} model=vit_micro model.img_size=28 data=imagefolder data.root=data/fmnist_aspect_sq "
    "data.augment=false data.hflip=false trainer.max_epochs=20 seed=0": Spec(
        append=S, needs=(f"{ASPECT.replace('fmnist_aspect', 'fmnist_aspect_sq')} --squash 28",), needs_fmnist=True,
        expect=("test/acc",)),
    f"{TRAIN} model=vit_micro model.img_size=28 data=imagefolder data.root=data/fmnist_aspect "
    'data.hflip=false trainer.max_epochs=20 seed=0 data.naflex.enabled=true "data.naflex.seq_lens=[49]" '
    "data.naflex.max_seq_len=49": Spec(append=S, needs=(ASPECT,), needs_fmnist=True, expect=("test/acc",)),
    f'{TRAIN} data=fashion_mnist data.naflex.enabled=true model=vit_micro model.img_size=28 '
    '"data.naflex.seq_lens=[16,25,49]" data.naflex.max_seq_len=49': Spec(append=S, needs_fmnist=True,
                                                                         expect=("test/acc",)),
    FLEXI: Spec(append=S, needs_fmnist=True, expect=("test/acc",)),
    "python scripts/eval.py ckpt_path=logs/train/runs/<time> model_patch_size=14": Spec(
        needs=(FLEXI,), time_of=FLEXI, needs_fmnist=True, expect=("test/acc",)),
    f'{TRAIN} callbacks=progressive "callbacks.progressive.img_sizes=[4,6,8]" '
    '"callbacks.progressive.start_epochs=[0,2,4]"': Spec(append=S, expect=("test/acc",)),
    "python scripts/benchmark.py --only naflex --variant vit_micro --batch-size 32 --threads 1": Spec(
        append=("--batch-size", "4", "--steps", "1", "--warmup", "1", "--repeats", "1"),
        expect=("vitpipe/timm NaFlexVit",)),
    'pip install -e ".[dev]"': Spec(skip="the install step: .ci/run runs it in a fresh venv"),
    "pip install .": Spec(skip="an install step: tests/test_install.py builds the wheel and installs it in a fresh venv"),
    "pip wheel --no-deps . -w dist/": Spec(skip="tests/test_install.py builds the wheel (from a copy of the package's files)"),
    "pip install dist/vitpipe-0.1.0-py3-none-any.whl": Spec(skip="tests/test_install.py installs the wheel in a fresh venv"),
    # docs/timm-zoo.md
    "python -m vitpipe.models.timm_zoo": Spec(skip="the full scan (~5 min): tests/test_timm_zoo.py -m slow runs its code"),
    "python -m vitpipe.models.timm_zoo --filter 'eva02*'": Spec(expect=("parity",)),
    "python -m vitpipe.models.timm_zoo --families 'vit_*,deit*' --max-params 30e6": Spec(
        skip="a scan of ~100 entry points: tests/test_timm_zoo.py -m slow runs the full scan"),
    "python -m pytest -q": Spec(skip="the test command itself: .ci/run runs it"),
    "python -m pytest -q -m slow": Spec(skip="a test command: .ci/run runs the slow README commands"),
    "python -m pytest -q -m slow tests/test_benchmark.py": Spec(skip="a test command (27 min of training)"),
    "python -m pytest -q -m slow tests/test_readme_commands.py": Spec(skip="the test command of this file: .ci/run runs it"),
    'python -m pytest -q -m "slurm or s3"': Spec(skip="a test command: .ci/run runs it after starting the services"),
    "python scripts/make_shards.py data=imagefolder data.root=/data/imagenet out=s3://bucket/imagenet-shards": Spec(
        fails=r"out=s3://bucket/imagenet-shards: no S3 credentials", quick=True),
    DEFAULT: Spec(append=S, quick=True, expect=("== vitpipe train: vit_nano on DigitsDataModule ==", "test/acc")),
    f"{TRAIN} model=vit_b16 data=cifar10": Spec(fails=HEADLINE_FAILS),
    f"{TRAIN} model=vit_s4 data=fashion_mnist": Spec(append=SB, needs_fmnist=True, expect=("FashionMNISTDataModule",)),
    f"{TRAIN} model.pos_embed=sincos2d model.depth=6": Spec(append=S),
    SWEEP: Spec(append=S, quick=True, expect=("sweep summary of 3 job(s)",)),
    "python scripts/sweep_report.py logs/train/multiruns/<time>": Spec(
        needs=(SWEEP,), time_of=SWEEP, quick=True, expect=(": 3 job(s)", "pos_embed")),
    CAPTION: Spec(append=S),
    f"{TRAIN} ckpt_path=last": Spec(append=S, needs=(DEFAULT,), own_dir=True,
                                    expect=("ckpt_path=last -> run", "resuming from")),
    "python scripts/eval.py ckpt_path=logs/train/runs/<time>": Spec(
        append=("++trainer.limit_test_batches=2",), needs=(DEFAULT,), time_of=DEFAULT, expect=("test/acc",)),
    # docs/time-budget.md: ToMe at inference on any trained run
    "python scripts/eval.py ckpt_path=logs/train/runs/<time> model_tome_r=8": Spec(
        append=("++trainer.limit_test_batches=2",), needs=(DEFAULT,), time_of=DEFAULT, expect=("test/acc",)),
    "python scripts/predict.py ckpt_path=last images=digits_png out=preds.csv model_tome_r=8": Spec(
        needs=(DEFAULT, PNGS), session="e2e", files=("preds.csv",)),
    f"{TRAIN} model.num_classes=7": Spec(quick=True),   # the README shows its line
    f"{TRAIN} data.batch_size=abc": Spec(quick=True),
    f"{TRAIN} trainer.max_epoch=3": Spec(quick=True),
    SOURCE: Spec(append=SB, needs_fmnist=True, files=("logs/transfer_source/checkpoints/last.ckpt",)),
    f"{TRAIN} -m experiment=transfer_target seed=0,1,2 model.pretrained=null": Spec(
        append=S, needs_fmnist=True, expect=("sweep summary of 3 job(s)",)),
    f"{TRAIN} -m experiment=transfer_target seed=0,1,2 module.finetune=linear_probe module.optimizer.lr=1e-2": Spec(
        append=S, needs=(SOURCE,), needs_fmnist=True, expect=("sweep summary of 3 job(s)",)),
    f"{TRAIN} -m experiment=transfer_target seed=0,1,2": Spec(
        append=S, needs=(SOURCE,), needs_fmnist=True, expect=("sweep summary of 3 job(s)",)),
    f"{TRAIN} -m experiment=transfer_target seed=0,1,2 module.layer_decay=0.65": Spec(
        append=S, needs=(SOURCE,), needs_fmnist=True, expect=("sweep summary of 3 job(s)",)),
    # README and docs/finetuning.md, LoRA
    f"{TRAIN} experiment=transfer_target module.finetune=lora": Spec(
        append=S, needs=(SOURCE,), needs_fmnist=True, expect=("parameters trainable", "module.finetune=lora)")),
    f'{TRAIN} experiment=transfer_target module.finetune=lora module.lora.r=16 module.lora.alpha=16 '
    'module.lora.dropout=0.0 "module.lora.targets=[qkv,fc1,fc2]"': Spec(
        append=S, needs=(SOURCE,), needs_fmnist=True, expect=("parameters trainable", "module.finetune=lora)")),
    f"{TRAIN} -m experiment=transfer_target seed=0,1,2 module.finetune=lora": Spec(
        append=S, needs=(SOURCE,), needs_fmnist=True, expect=("sweep summary of 3 job(s)", "module.finetune=lora)")),
    f"{TRAIN} -m experiment=transfer_target seed=0,1,2 module.finetune=lora module.optimizer.lr=5e-3": Spec(
        append=S, needs=(SOURCE,), needs_fmnist=True, expect=("sweep summary of 3 job(s)",)),
    f"{TRAIN} -m experiment=transfer_target seed=0,1,2 module.finetune=lora module.lora.r=4 module.optimizer.lr=5e-3": Spec(
        append=S, needs=(SOURCE,), needs_fmnist=True, expect=("sweep summary of 3 job(s)",)),
    LORA_WEIGHTS: Spec(files=("logs/vit_s16_random.safetensors",)),
    f"{TRAIN} model=vit_s16 data=synthetic trainer=cpu logger=none test=false data.length=256 data.test_length=32 "
    "data.num_workers=0 data.batch_size=4 trainer.max_steps=3 trainer.max_epochs=-1 trainer.limit_val_batches=0 "
    "model.pretrained=logs/vit_s16_random.safetensors module.finetune=lora": Spec(
        needs=(LORA_WEIGHTS,), expect=("1,036,042 of 22,701,706 parameters trainable", "peak memory")),
    "python scripts/eval.py ckpt_path=<run_dir_or_ckpt_or_last> split=test calibrate=true": Spec(
        needs=(DEFAULT,), session="e2e", expect=("test/acc",)),
    "python scripts/predict.py ckpt_path=<ckpt | run dir | last> images=<folder | file | 'glob/*.jpg'> out=preds.csv "
    "topk=5": Spec(needs=(DEFAULT, PNGS), session="e2e", files=("preds.csv",)),
    "python scripts/export.py ckpt_path=<...> format=timm out=my_vit": Spec(
        needs=(DEFAULT,), session="e2e", files=("my_vit/config.json",)),
    "python scripts/export.py ckpt_path=<...> format=onnx out=my_vit.onnx": Spec(
        needs=(DEFAULT,), session="e2e", files=("my_vit.onnx",)),
    "python scripts/export.py ckpt_path=<...> format=timm out=my_vit overwrite=true push_to_hub=<user>/<repo>": Spec(
        needs=(DEFAULT, "python scripts/export.py ckpt_path=<...> format=timm out=my_vit"), session="e2e",
        fails=r"push_to_hub=someone/my-vit.*(failed|offline|nothing was uploaded)"),
    PNGS: Spec(files=("digits_png/00_true8.png",)),
    "python scripts/predict.py ckpt_path=last images=digits_png out=preds.csv topk=3": Spec(
        needs=(DEFAULT, PNGS), session="e2e", files=("preds.csv",)),
    "python scripts/export.py ckpt_path=last format=timm out=vit_nano_digits": Spec(
        needs=(DEFAULT,), session="e2e", files=("vit_nano_digits/model.safetensors",)),
    "python scripts/export.py ckpt_path=last format=onnx out=vit_nano_digits.onnx": Spec(
        needs=(DEFAULT,), session="e2e", files=("vit_nano_digits.onnx",)),
    f"{TRAIN} model=vit_s4 data=cifar10 trainer=gpu": Spec(fails=GPU_LINE, quick=True),
    f"{TRAIN} trainer=ddp trainer.devices=4 data.batch_size=128 lr_scaling.rule=linear": Spec(fails=GPU_LINE),
    f"{TRAIN} model=vit_h14 trainer=fsdp": Spec(fails=GPU_LINE),
    f"{TRAIN} experiment=cifar10_vit data.download=true": Spec(fails=GPU_LINE),   # its trainer is gpu
    f"{TRAIN} compile=true model.grad_checkpointing=true": Spec(append=SB),
    f"{TRAIN} trainer=ddp_cpu trainer.devices=2": Spec(append=S),
    f"{TRAIN} -m hydra/launcher=slurm trainer=ddp trainer.devices=4 trainer.num_nodes=2 hydra.launcher.partition=gpu "
    "hydra.launcher.timeout_min=720 model=vit_b16 data=cifar10": Spec(fails=SLURM_LINE, quick=True),
    "torchrun --nnodes=2 --nproc_per_node=4 --node_rank=$NODE_RANK --master_addr=$MASTER --master_port=29500 "
    "scripts/train.py trainer=ddp trainer.devices=4 trainer.num_nodes=2 hydra.run.dir=/shared/runs/exp1": Spec(
        fails=GPU_LINE),
    "python scripts/make_shards.py data=imagefolder data.root=/data/imagenet out=/data/imagenet-shards "
    "shard_size=64MB": Spec(files=("imagenet-shards/vitpipe_shards.json",)),
    f"{TRAIN} -m hydra/launcher=slurm trainer=ddp trainer.devices=4 trainer.num_nodes=2 hydra.launcher.partition=gpu "
    "model=vit_b16 data=shards data.root=s3://bucket/imagenet-shards data.cache_dir=/local/scratch/shards": Spec(
        fails=SLURM_LINE),
    f"{TRAIN} -m model.pos_embed=learned,sincos2d,learned2d data=digits": Spec(
        append=S, expect=("sweep summary of 3 job(s)",)),
    f"{TRAIN} -m hparams_search=optuna hydra.sweeper.n_trials=30": Spec(
        append=(*S, "hydra.sweeper.n_trials=2"), expect=("sweep summary of 2 job(s)",)),
    f"{TRAIN} -m experiment=mae_fmnist hparams_search=optuna_mae": Spec(
        append=(*SB, "hydra.sweeper.n_trials=2"), needs_fmnist=True, expect=("sweep summary of 2 job(s)",)),
    f"{CAPTION} model.decoder=prefix": Spec(append=S),
    "python scripts/eval.py ckpt_path=<caption ckpt>": Spec(
        append=("++trainer.limit_test_batches=2",), needs=(CAPTION,), expect=("test/bleu4",)),
    "python scripts/visualize_attention.py ckpt_path=logs/train/runs/<time> images=test method=rollout out=figs": Spec(
        needs=(DEFAULT,), time_of=DEFAULT, append=("num_images=8",), files=("figs/rollout_grid.png",)),
    "python scripts/visualize_attention.py ckpt_path=<ckpt> images=path/to/images method=all out=figs": Spec(
        needs=(DEFAULT, PNGS), session="e2e", files=("figs/rollout_grid.png",)),
    # the recipe's teacher logits on 500 images (of 55,000: 70 to 230 s of a 2-core CPU), read back by the others
    FMNIST_RUN: Spec(append=(*SB, "data.train_per_class=50"), needs_fmnist=True,
                     expect=("vitpipe: distillation targets of 500 images x 2 view(s) ready in",)),
    f"{FMNIST_RUN} module.distill=null": Spec(append=SB, needs_fmnist=True),
    f"{FMNIST_RUN} module.distill=null trainer.time_budget=10min": Spec(append=SB, needs_fmnist=True,
                                                                        expect=("vitpipe: time budget 10.0 min: used",)),
    "python scripts/visualize_attention.py ckpt_path=logs/fmnist_vit/runs/<time> images=test num_images=8 "
    "method=rollout side_by_side=true per_image=false out=notebooks/figures/fmnist_rollout": Spec(
        needs=(FMNIST_RUN,), time_of=FMNIST_RUN, needs_fmnist=True,
        files=("notebooks/figures/fmnist_rollout/rollout_grid.png",)),
    "python scripts/visualize_attention.py ckpt_path=<ckpt> images=test num_images=200 method=rollout "
    "faithfulness=true per_image=false out=figs": Spec(needs=(DEFAULT,), session="e2e", append=("num_images=16",)),
    "python -m vitpipe.viz.pointing --seeds 0 1 2 3 4 5 6 7 --registers 0 4": Spec(
        append=("--seeds", "0", "--registers", "0", "--steps", "20")),
    FMNIST_REG4: Spec(append=(*SB, "data.train_per_class=50"), needs_fmnist=True),
    "python scripts/visualize_attention.py ckpt_path=logs/fmnist_vit/runs/<time> images=test num_images=8 "
    "method=rollout side_by_side=true per_image=false out=notebooks/figures/fmnist_rollout_reg4": Spec(
        needs=(FMNIST_REG4,), time_of=FMNIST_REG4, needs_fmnist=True,
        files=("notebooks/figures/fmnist_rollout_reg4/rollout_grid.png",)),
    "python scripts/benchmark.py --variant vit_ti4 --img-size 32 --batch-size 64 --steps 10 --warmup 3 --repeats 5 "
    "--only vit,lightning,data": Spec(append=("--steps", "1", "--warmup", "1", "--repeats", "1")),
    "python scripts/eval.py ckpt_path=logs/fmnist_vit/runs/<time> tta=hflip": Spec(
        append=("++trainer.limit_test_batches=2",), needs=(FMNIST_RUN,), time_of=FMNIST_RUN, needs_fmnist=True,
        expect=("test/acc",)),
    # docs/time-budget.md (and the README's command list)
    f"{TRAIN} trainer.time_budget=5min": Spec(
        append=("trainer.max_epochs=2", "logger=none"),
        expect=("the learning-rate schedule is fitted to them (capped by trainer.max_epochs=2",
                "final learning-rate progress 1.000")),
    "python scripts/benchmark.py --only tokens --steps 5 --warmup 2 --repeats 3": Spec(
        append=("--steps", "1", "--warmup", "1", "--repeats", "1")),
    TEACHER: Spec(append=SB, needs_fmnist=True),
    "python scripts/make_teacher.py logs/fmnist_teacher/runs/<time> assets/teachers/fmnist_resnet10t.safetensors": Spec(
        needs=(TEACHER,), time_of=TEACHER, needs_fmnist=True,
        files=("assets/teachers/fmnist_resnet10t.safetensors",)),
}

SHOWN = shown_commands()
SHOWN_SPECS = list(dict.fromkeys(s.command for s in SHOWN if s.command in SPECS))


def test_every_shown_command_has_a_spec():
    missing = [f"{s.page}:{s.line}: {s.command}" for s in SHOWN if s.command not in SPECS]
    assert not missing, "shown commands without an entry in SPECS:\n" + "\n".join(missing)
    shown = {s.command for s in SHOWN}
    stale = [c for c in SPECS if c not in shown]
    assert not stale, "SPECS entries no page shows:\n" + "\n".join(stale)
    assert len(SHOWN_SPECS) >= 40


class Session:
    """One reader's working directory, and what their commands printed so far."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.results: dict[str, subprocess.CompletedProcess] = {}
        (home / "scripts").symlink_to(ROOT / "scripts", target_is_directory=True)
        (home / "tests").symlink_to(ROOT / "tests", target_is_directory=True)  # docs/demo.md's screenshot driver
        shutil.copytree(ROOT / "conf", home / "conf")  # a checkout's layout (the commands read the package's configs)
        shutil.copytree(ROOT / "assets", home / "assets")  # a copy: make_teacher writes into assets/teachers/
        self.env = user_env(HF_HOME=str(home / ".hf"), XDG_CACHE_HOME=str(home / ".cache"), NODE_RANK="0",
                            MASTER="127.0.0.1")
        _tiny_imagenet(home / "imagenet")

    def text(self, command: str, spec: Spec) -> str:
        text = command
        if spec.time_of and re.search(r"logs/\w+/runs/<time>", text):
            run = run_dir_of(self.results[spec.time_of].stdout).relative_to(self.home)
            text = re.sub(r"logs/\w+/runs/<time>", str(run), text)
        if spec.time_of and re.search(r"logs/\w+/multiruns/<time>", text):  # the sweep dir the sweep printed
            sweep = re.search(r"sweep summary of \d+ job\(s\) in (\S+)summary\.md", self.results[spec.time_of].stdout)
            text = re.sub(r"logs/\w+/multiruns/<time>", str(Path(sweep.group(1)).relative_to(self.home)), text)
        if "<caption ckpt>" in text:
            text = text.replace("<caption ckpt>", str(run_dir_of(self.results[CAPTION].stdout)))
        for old, new in (("<run_dir_or_ckpt_or_last>", "last"), ("<ckpt | run dir | last>", "last"),
                         ("<...>", "last"), ("<ckpt>", "last"), ("<folder | file | 'glob/*.jpg'>", "digits_png"),
                         ("path/to/images", "digits_png"), ("<user>/<repo>", "someone/my-vit"),
                         ("/data/imagenet-shards", "imagenet-shards"), ("/data/imagenet", "imagenet"),
                         ("/local/scratch/shards", "scratch"), ("/shared/runs/exp1", str(self.home / "runs/exp1")),
                         ("$NODE_RANK", "0"), ("$MASTER", "127.0.0.1")):
            text = text.replace(old, new)
        assert text.startswith("python -c") or not re.search(r"<[^>]*>", text), f"placeholder left in {text}"
        return text

    def run(self, command: str) -> subprocess.CompletedProcess:
        if command in self.results:
            return self.results[command]
        spec = SPECS[command]
        for need in spec.needs:
            got = self.run(need)
            assert got.returncode == 0, f"{need} (needed by {command}) failed:\n{got.stderr[-3000:]}"
        args = argv(self.text(command, spec)) + list(spec.append)
        started = time.monotonic()
        if command.startswith("torchrun"):  # two node groups on this machine, as the README's two nodes
            procs = [subprocess.Popen([*args[:3], *[a.replace("--node_rank=0", f"--node_rank={rank}") for a in args[3:]]],
                                      cwd=self.home, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True) for rank in (0, 1)]
            outs = [p.communicate(timeout=600) for p in procs]
            result = subprocess.CompletedProcess(args, procs[0].returncode, outs[0][0], outs[0][1])
        elif spec.server:
            result = self.serve(args, spec)
        else:
            result = subprocess.run(args, cwd=self.home, env=self.env, capture_output=True, text=True, timeout=900)
        result.seconds = time.monotonic() - started
        self.results[command] = result
        return result


    def serve(self, args: list[str], spec: Spec, timeout: float = 300.0) -> subprocess.CompletedProcess:
        """A server command as typed plus ``port=<free>`` (Hydra takes the last value): once it has printed
        its address and GET ``spec.server`` answers 200 (at most ``timeout`` s), the ``spec.ask`` lines, then Ctrl-C (SIGINT) to
        its PID; SIGKILL to its own process group if it outlives 30 s more. Exit 0 only when the server
        answered, every line printed an answer and the server stopped with status 0."""
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        log = self.home / f"server-{port}.log"
        with log.open("w") as out:
            proc = subprocess.Popen([*args, f"port={port}"], cwd=self.home, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_as_in_a_terminal)
        ready, asked = False, []
        try:
            deadline = time.monotonic() + timeout
            while not ready and proc.poll() is None and time.monotonic() < deadline:
                if f"127.0.0.1:{port}" not in log.read_text():  # it printed its address: up, not only bound
                    time.sleep(0.5)
                    continue
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}{spec.server}", timeout=5) as r:
                        ready = r.status == 200
                except OSError:
                    time.sleep(0.5)
            if ready:
                asked = [subprocess.run(line.format(port=port), shell=True, cwd=self.home, env=self.env,
                                        capture_output=True, text=True, timeout=60) for line in spec.ask]
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
        answered = all(a.returncode == 0 and '"labels"' in a.stdout for a in asked)
        text = log.read_text() + "".join(a.stdout for a in asked) + ("" if ready else "\n(the server never answered)")
        ok = ready and answered and proc.returncode == 0
        return subprocess.CompletedProcess(args, 0 if ok else 1, text, text)


def _as_in_a_terminal() -> None:
    """Ctrl-C as a terminal delivers it: a job started in the background by a non-interactive shell (CI
    under ``cmd &``) inherits SIGINT ignored, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _tiny_imagenet(root: Path, classes: int = 1000) -> None:
    """The ImageNet layout (train/<class>/, val/<class>/) with one 8x8 JPEG per class and split."""
    from PIL import Image

    for split in ("train", "val"):
        for c in range(classes):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True)
            Image.new("RGB", (8, 8), ((c * 37) % 256, (c * 11) % 256, c % 256)).save(folder / "0.JPEG")


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    made: dict[str, Session] = {}

    def get(spec: Spec) -> Session:
        if spec.own_dir:
            return Session(tmp_path_factory.mktemp("own"))
        if spec.session not in made:
            made[spec.session] = Session(tmp_path_factory.mktemp(spec.session))
        return made[spec.session]

    return get


def _one_line(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("vitpipe: error:")]


@pytest.mark.parametrize("command", [pytest.param(c, marks=[pytest.mark.slow] if not SPECS[c].quick else [],
                                                  id=re.sub(r"\W+", "_", c)[:90]) for c in SHOWN_SPECS])
def test_shown_command_runs_as_typed(sessions, command):
    spec = SPECS[command]
    session = sessions(spec)
    if spec.skip:
        pytest.skip(spec.skip)
    if spec.needs_fmnist and not FMNIST.is_dir():
        pytest.skip(f"Fashion-MNIST is not installed ({FMNIST}: apt-get install dataset-fashion-mnist)")
    if spec.needs_chromium and not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.skip("chromium / chromedriver are not installed (apt-get install chromium chromium-driver)")
    if (spec.fails in (GPU_LINE,) and torch.cuda.is_available()) or (spec.fails == SLURM_LINE and shutil.which("sbatch")):
        pytest.skip("this machine can run it: the gpu and slurm suites do")
    shown_output = next((s.output for s in SHOWN if s.command == command and s.output), None)
    result = session.run(command)
    if spec.fails or shown_output:
        errors = _one_line(result.stderr)
        # torchrun reports its workers' failure as its own exit status 1
        assert result.returncode == (1 if command.startswith("torchrun") else 2), result.stderr[-3000:]
        # under torchrun every rank stops with the same mistake; only local rank 0 prints it
        assert len(errors) == 1, result.stderr[-3000:]
        if shown_output:
            assert errors[0] == shown_output
        else:
            assert re.search(spec.fails, errors[0]), errors[0]
        assert len(errors[0]) < 600
        return
    assert result.returncode == 0, f"rc {result.returncode}:\n{result.stdout[-1500:]}\n{result.stderr[-4000:]}"
    for text in spec.expect:
        assert text in result.stdout, f"{text!r} not in:\n{result.stdout[-3000:]}"
    for path in spec.files:
        assert (session.home / path).is_file(), f"{path} missing after {command}"
    if "sweep summary of" in " ".join(spec.expect):
        summary = re.search(r"sweep summary of (\d+) job\(s\) in (\S+)summary\.md", result.stdout)
        rows = list(csv.DictReader((Path(summary.group(2)) / "summary.csv").open()))
        assert len(rows) == int(summary.group(1)) and all(r["status"] == "done" for r in rows), rows
