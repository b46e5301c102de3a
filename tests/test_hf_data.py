"""data=hf: Hugging Face data sets built and saved here (save_to_disk), never downloaded.

- the same images saved as a DatasetDict train to the same weights and metrics as the image folder
  they came from (data=imagefolder), bit for bit: both list the images in the same order (class, then
  file name), decode them with vitpipe's open_image and carve the same validation split;
- a streamed run stopped mid-epoch and resumed (ckpt_path=auto) ends with the weights of a run never stopped;
- a Hub id with no cache and HF_HUB_OFFLINE stops in one line before training; a wrong column is named
  with the columns there are.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[1]
CLASSES = ("ant", "bee", "cat")
COUNTS = {"train": 8, "val": 3, "test": 3}  # images per class
HF_SPLIT = {"train": "train", "val": "validation", "test": "test"}
COMMON = ("debug=fast", "logger=none", "data.num_workers=0", "data.batch_size=4", "data.eval_batch_size=8",
          "trainer.limit_train_batches=null", "trainer.limit_val_batches=null", "trainer.limit_test_batches=null",
          "trainer.max_epochs=2", "callbacks.progress_bar.refresh_rate=1000")


def make_images(root: Path, splits=("train", "val", "test")) -> dict[str, list[tuple[str, int]]]:
    """root/<split>/<class>/NNN.png: 12x12 RGB noise with a per-class offset; ``{split: [(path, label)]}``
    in the order the image folder lists them (class, then file name)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    rows = {}
    for split in splits:
        rows[split] = []
        for label, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(COUNTS[split]):
                pixels = (rng.integers(0, 128, (12, 12, 3)) + 60 * label).astype(np.uint8)
                path = folder / f"{i:03d}.png"
                Image.fromarray(pixels).save(path)
                rows[split].append((str(path), label))
    return rows


def save_dataset(rows: dict, out: Path, image_column: str = "img") -> Path:
    features = datasets.Features({image_column: datasets.Image(), "label": datasets.ClassLabel(names=list(CLASSES))})
    dd = datasets.DatasetDict({
        HF_SPLIT[split]: datasets.Dataset.from_dict(
            {image_column: [p for p, _ in items], "label": [label for _, label in items]}, features=features)
        for split, items in rows.items()})  # fmt: skip
    dd.save_to_disk(str(out))
    return out


def _weights(run: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {p.name: torch.load(p, weights_only=True)["state_dict"] for p in sorted((run / "checkpoints").glob("*.ckpt"))}


@pytest.mark.parametrize("splits", [("train", "val", "test"), ("train", "test")], ids=["own-val", "val-carved"])
def test_a_saved_dataset_trains_exactly_like_the_same_image_folder(cfg_factory, tmp_path, splits):
    from vitpipe.tasks.train import train

    rows = make_images(tmp_path / "folder", splits)
    saved = save_dataset(rows, tmp_path / "saved")
    shutil.move(tmp_path / "folder", tmp_path / "images")  # the data set holds the pixels, not links to files
    folder = tmp_path / "images"
    if "val" not in splits:  # the image folder carves val from train/ (data.val_split), as the data set must
        assert not (folder / "val").exists()
    results = {}
    for kind, data in (("imagefolder", ["data=imagefolder", f"data.root={folder}"]),
                       ("hf", ["data=hf", f"data.name={saved}", "data.image_column=img"])):
        cfg = cfg_factory(*COMMON, *data, "data.val_split=4", sub=kind)
        metrics = train(cfg)
        results[kind] = ({k: v for k, v in metrics.items() if not k.startswith("time/")},
                         _weights(Path(cfg.paths.output_dir)))
    (m_folder, w_folder), (m_hf, w_hf) = results["imagefolder"], results["hf"]
    assert m_hf == m_folder  # same metrics, to the last bit
    assert list(w_hf) == list(w_folder) and w_hf
    for name in w_hf:
        assert w_hf[name].keys() == w_folder[name].keys()
        for key in w_hf[name]:
            assert torch.equal(w_hf[name][key], w_folder[name][key]), (name, key)


def test_class_names_come_from_the_classlabel(cfg_factory, tmp_path):
    from hydra.utils import instantiate

    from vitpipe.config.preflight import preflight

    saved = save_dataset(make_images(tmp_path / "images"), tmp_path / "saved", image_column="image")
    cfg = cfg_factory("debug=fast", "data=hf", f"data.name={saved}")
    preflight(cfg, "train")  # fills data.num_classes from the ClassLabel
    assert cfg.data.num_classes == 3 and cfg.model.num_classes == 3
    dm = instantiate(cfg.data)
    dm.setup("fit")
    assert dm.class_names == list(CLASSES) and len(dm.data_train) == 24 and len(dm.data_val) == 9


def test_a_column_that_is_not_there_is_named_with_the_columns_there_are(cfg_factory, tmp_path):
    from vitpipe.config.preflight import preflight
    from vitpipe.errors import ConfigError

    saved = save_dataset(make_images(tmp_path / "images", ("train",)), tmp_path / "saved")
    cfg = cfg_factory("debug=fast", "data=hf", f"data.name={saved}")  # image_column defaults to "image"
    with pytest.raises(ConfigError) as e:
        preflight(cfg, "train")
    assert str(e.value) == f"data.image_column='image' is not a column of {saved} (train); its columns: img, label"
    cfg = cfg_factory("debug=fast", "data=hf", f"data.name={saved}", "data.image_column=img",
                      "data.label_column=fine_label", sub="label")
    with pytest.raises(ConfigError, match=r"data.label_column='fine_label' is not a column .*its columns: img, label$"):
        preflight(cfg, "train")


def test_a_hub_id_without_cache_offline_stops_in_one_line_before_the_run(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "OMP_NUM_THREADS": "1"}
    env.pop("HF_DATASETS_CACHE", None)
    env.pop("HF_HUB_CACHE", None)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "debug=fast", "logger=none", "data=hf",
                        "data.name=vitpipe-tests/no-such-dataset", f"hydra.run.dir={run}",
                        f"paths.log_dir={tmp_path}/logs"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=180)  # fmt: skip
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("vitpipe: error: data.name=vitpipe-tests/no-such-dataset: not a local path and not "
                               f"in the Hugging Face cache ({tmp_path / 'hf' / 'hub'}), and HF_HUB_OFFLINE is set")
    assert "`huggingface-cli download --repo-type dataset vitpipe-tests/no-such-dataset`" in lines[0]
    assert not (run / "checkpoints").exists() and not (run / "config.yaml").exists()  # stopped at the config check


STREAM = (*COMMON, "data=hf", "data.image_column=img", "data.streaming=true", "data.shuffle_buffer=8",
          "trainer.max_epochs=2", "test=false", "callbacks.model_checkpoint.monitor=null",
          "callbacks.model_checkpoint.save_top_k=0")


def test_a_streamed_run_stopped_mid_epoch_resumes_to_the_weights_of_a_run_never_stopped(cfg_factory, tmp_path):
    """24 training images in batches of 4: 6 steps an epoch, 12 in all; stopped (SIGTERM: last.ckpt at the
    batch boundary) at step 8, in the second epoch, then ckpt_path=auto continues in the same run dir."""
    from vitpipe.tasks.train import train

    saved = save_dataset(make_images(tmp_path / "images"), tmp_path / "saved")
    whole = cfg_factory(*STREAM, f"data.name={saved}", sub="whole")
    whole_dir = Path(whole.paths.output_dir)  # now: paths.output_dir follows the newest composed config
    train(whole)
    stop = ("+callbacks.stop._target_=fault_injection.SignalAtStep", "+callbacks.stop.step=8",
            f"+callbacks.stop.signum={int(signal.SIGTERM)}")
    cfg = cfg_factory(*STREAM, f"data.name={saved}", *stop, sub="stopped")
    with pytest.raises(SystemExit):
        train(cfg)
    last = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    assert last.parent.parent != whole_dir
    assert torch.load(last, weights_only=True)["global_step"] == 8
    train(cfg_factory(*STREAM, f"data.name={saved}", "ckpt_path=auto", sub="stopped"))
    a = torch.load(whole_dir / "checkpoints" / "last.ckpt", weights_only=True)
    b = torch.load(last, weights_only=True)
    assert a["global_step"] == b["global_step"] == 12
    for key in a["state_dict"]:
        assert torch.equal(a["state_dict"][key], b["state_dict"][key]), key


def test_stream_parts_cover_the_split_once_and_have_equal_lengths(tmp_path):
    """Two ranks: each yields ceil(24 / 2 / 4) = 3 batches; together every image once (padded when short)."""
    from vitpipe.data.hf import open_source
    from vitpipe.data.stream import StreamingSource

    saved = save_dataset(make_images(tmp_path / "images", ("train",)), tmp_path / "saved")
    stream = open_source(str(saved), streaming=True)["train"]
    source = StreamingSource(stream, "img", "label", "RGB", "test", 24,
                             transform=lambda im: torch.as_tensor(np.asarray(im)[0, 0]))  # fmt: skip
    seen = []
    for rank in (0, 1):
        batches = source.batches(batch_size=4, rank=rank, world=2, shuffle=True, buffer=8, seed=0, train=True)
        got = list(batches)
        assert len(got) == len(batches) == 3
        seen += [tuple(px.tolist()) for x, _ in got for px in x]
    assert len(seen) == 24 and len(set(seen)) == 24


@pytest.mark.parametrize("form", ["parquet", "imagefolder-builder"])
def test_parquet_files_and_the_imagefolder_builder_read_the_same_images(cfg_factory, tmp_path, form):
    from hydra.utils import instantiate

    from vitpipe.config.preflight import preflight

    rows = make_images(tmp_path / "images", ("train",))
    if form == "parquet":
        saved = save_dataset(rows, tmp_path / "saved", image_column="image")
        datasets.load_from_disk(str(saved))["train"].to_parquet(str(tmp_path / "train.parquet"))
        data = [f"data.name={tmp_path / 'train.parquet'}"]
    else:
        data = ["data.name=imagefolder", f"data.data_dir={tmp_path / 'images'}"]
    cfg = cfg_factory("debug=fast", "data=hf", *data, "data.val_split=0", "data.augment=false", sub=form)
    preflight(cfg, "train")
    dm = instantiate(cfg.data)
    dm.setup("fit")
    assert dm.class_names == list(CLASSES) and len(dm.data_train) == 24
    from vitpipe.data.images import open_image

    got = sorted(np.asarray(dm.data_train.base[i][0]).tobytes() for i in range(24))
    want = sorted(np.asarray(open_image(path)).tobytes() for path, _ in rows["train"])
    assert got == want  # the same pixels (the builder may list the files in another order)
    assert sorted(dm.data_train.base.targets) == sorted(label for _, label in rows["train"])


def test_a_stored_runs_data_config_builds_where_its_data_is_not(tmp_path):
    """predict, export and serve rebuild a run's data module for its transforms: with num_classes stored, a
    data set that is not here is opened only by check() (training, eval), which names it."""
    from vitpipe.data.hf import HFDataModule
    from vitpipe.errors import ConfigError

    gone = tmp_path / "moved" / "away"
    gone.mkdir(parents=True)
    (gone / "state.json").write_text("{}")  # looks saved, reads as nothing
    dm = HFDataModule(name=str(gone), num_classes=3, img_size=8, in_chans=3)
    assert dm.num_classes == 3 and dm.transform(False) is not None
    with pytest.raises(ConfigError, match=f"data.name={gone}"):
        dm.check()
    with pytest.raises(ConfigError, match=f"data.name={gone}"):
        HFDataModule(name=str(gone), img_size=8, in_chans=3)  # nothing stored: the data set is needed now


@pytest.mark.slow  # a 2-process gloo run (~30 s on 2 cores): .ci/run runs it after the default suite
def test_ddp_two_ranks_stream_every_training_image_once_an_epoch_in_equal_steps(tmp_path):
    """data.streaming=true under DDP, as typed: split_dataset_by_node gives each rank its part of the stream,
    both ranks take the same number of steps (a rank with one batch more would hang the other's all-reduce), every
    training image is trained once an epoch across the ranks, the shuffle buffer is reseeded each epoch, and
    the map-style validation split is scored once. Image ids ride in the red channel of flat-colour images."""
    from PIL import Image
    from test_scale import _train_cli

    ids = {"train": range(0, 24), "val": range(100, 106)}
    rows = {}
    for split, numbers in ids.items():
        folder = tmp_path / "images" / split
        folder.mkdir(parents=True)
        rows[split] = []
        for i in numbers:
            path = folder / f"{i:03d}.png"
            Image.new("RGB", (8, 8), (i, 0, 0)).save(path)
            rows[split].append((str(path), i % len(CLASSES)))
    saved = save_dataset(rows, tmp_path / "saved")
    record = tmp_path / "ids"
    r = _train_cli(*STREAM, f"data.name={saved}",
                   "data.batch_size=4", "data.eval_batch_size=3", "data.augment=false", "trainer=ddp_cpu",
                   "trainer.devices=2", "+callbacks.ids._target_=test_shards.RecordIds", f"+callbacks.ids.out={record}",
                   f"hydra.run.dir={tmp_path / 'run'}", env={"PYTHONPATH": str(ROOT / "tests")}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [[__import__("json").loads(line) for line in (record / f"rank{k}.jsonl").read_text().splitlines()]
             for k in range(2)]
    orders = []
    for epoch in (0, 1):
        train = [[row["ids"] for row in rows if row["kind"] == "train" and row["epoch"] == epoch] for rows in ranks]
        assert len(train[0]) == len(train[1]) == 3, train  # 24 images, 2 ranks, batches of 4
        seen = [i for rank in train for batch in rank for i in batch]
        assert sorted(seen) == list(ids["train"]), seen  # each once: the two parts are disjoint and whole
        val = [i for rows in ranks for row in rows if row["kind"] == "val" and row["epoch"] == epoch for i in row["ids"]]
        assert sorted(val) == list(ids["val"]), val
        orders.append([i for batch in train[0] for i in batch])
    assert orders[0] != orders[1]  # the buffer reshuffles each epoch
