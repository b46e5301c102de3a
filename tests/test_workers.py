"""num_workers: null chooses the DataLoader workers from the CPUs this process may use, divided among the
processes of the node (vitpipe.data.workers); no too-many-workers warning on a 2-core machine."""

from __future__ import annotations

import warnings

import hydra
import pytest
import tiny_checkpoints as tc
from lightning.fabric.utilities import data as fabric_data

from vitpipe.data.workers import resolve_num_workers


@pytest.mark.parametrize("cpus, processes, expect", [(2, 1, 1), (2, 2, 1), (16, 1, 15), (16, 4, 3), (64, 8, 7)])
def test_workers_from_the_cpus(monkeypatch, cpus, processes, expect):
    monkeypatch.setattr(fabric_data, "_num_cpus_available", lambda: cpus)
    assert resolve_num_workers(None, processes) == expect
    assert resolve_num_workers(3, processes) == 3  # a number the user set wins
    assert resolve_num_workers(0, processes) == 0


def test_image_folder_default_on_two_cores_does_not_warn(tmp_path, cfg_factory, monkeypatch):
    monkeypatch.setattr(fabric_data, "_num_cpus_available", lambda: 2)
    root = tc.write_image_folder(tmp_path / "images")
    cfg = cfg_factory("debug=fast", "data=imagefolder", f"data.root={root}", "data.num_classes=3",
                      "model.img_size=16", "model.patch_size=4", "data.batch_size=2")
    assert cfg.data.num_workers is None  # the shipped default
    dm = hydra.utils.instantiate(cfg.data)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert loader.num_workers == 1  # 2 cores, 1 process: one worker beside the main process
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PyTorch's "will create 4 worker processes ... suggested max" would raise
        x, y = next(iter(loader))
    assert x.shape == (2, 3, 16, 16) and y.shape == (2,)
