"""Caption data: tokenizer, procedural shapes captions (determinism, captions match pixels), COCO format."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from PIL import Image

from vitpipe.data.captions import COCOCaptionDataModule, ShapesCaptionDataModule
from vitpipe.data.captions.shapes import COLORS, describe, make_split, render
from vitpipe.errors import ConfigError
from vitpipe.text import WordTokenizer, split_words

# ------------------------------------------------------------------ tokenizer


def test_split_words_lowercases_and_splits_punctuation():
    assert split_words("A red, round ball.") == ["a", "red", ",", "round", "ball", "."]
    assert split_words("It's a dog's (big) café!") == ["it's", "a", "dog's", "(", "big", ")", "café", "!"]


def test_tokenizer_round_trip_and_specials():
    tok = WordTokenizer.build(["a red circle", "a blue square", "a red square"])
    assert tok.itos[:4] == ["<pad>", "<bos>", "<eos>", "<unk>"] and tok.pad_id == 0
    assert tok.itos[4:7] == ["a", "red", "square"]  # by frequency, ties alphabetical
    ids = tok.encode("A red square.")
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == "a red square <unk>"  # "." was never seen
    assert tok.decode([tok.bos_id, *tok.encode("a blue circle", add_special=False), tok.eos_id, 4, 5]) == "a blue circle"


def test_batch_encode_pads_and_truncates():
    tok = WordTokenizer.build(["a red circle left of a blue square"])
    batch = tok.batch_encode(["a red circle", "a red circle left of a blue square"])
    assert batch.shape == (2, 10) and batch.dtype == torch.long
    assert batch[0, 4].item() == tok.eos_id and (batch[0, 5:] == tok.pad_id).all()
    assert tok.batch_decode(batch) == ["a red circle", "a red circle left of a blue square"]
    cut = tok.batch_encode(["a red circle left of a blue square"], max_len=4)
    assert cut.shape == (1, 4) and cut[0, 0].item() == tok.bos_id


def test_tokenizer_state_dict_round_trip_and_min_freq():
    tok = WordTokenizer.build(["a a a b b c"], min_freq=2)
    assert tok.itos[4:] == ["a", "b"]
    again = WordTokenizer.from_state_dict(tok.state_dict())
    assert again.itos == tok.itos and again.encode("a b c") == tok.encode("a b c")
    assert json.loads(json.dumps(tok.state_dict())) == tok.state_dict()  # plain data: safe in a weights-only checkpoint
    with pytest.raises(ValueError, match="specials"):
        WordTokenizer(["a", "b"])


# ------------------------------------------------------------------ shapes


def test_shapes_are_deterministic_from_the_seed():
    a, sa = make_split(20, img_size=32, max_shapes=3, seed=7)
    b, sb = make_split(20, img_size=32, max_shapes=3, seed=7)
    c, _ = make_split(20, img_size=32, max_shapes=3, seed=8)
    assert np.array_equal(a, b) and sa == sb
    assert not np.array_equal(a, c)
    dm1, dm2 = (ShapesCaptionDataModule(num_train=16, num_val=8, num_test=8, seed=3) for _ in range(2))
    for split in ("train", "val", "test"):
        d1, d2 = dm1._dataset(split), dm2._dataset(split)
        assert d1.refs == d2.refs and torch.equal(d1.image(0), d2.image(0))
    assert dm1._dataset("train").refs[:8] != dm1._dataset("val").refs  # splits use different streams
    # the data module serves exactly the rendered scenes and their descriptions
    img = dm1._dataset("val").image(2)  # normalised (3, H, W)
    mean, std = (torch.tensor(v).view(3, 1, 1) for v in ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)))
    pixels = torch.from_numpy(render(dm1.scenes["val"][2], 32)).permute(2, 0, 1).float() / 255
    torch.testing.assert_close(img * std + mean, pixels)
    assert dm1._dataset("val").refs[2] == describe(dm1.scenes["val"][2])


PHRASE = re.compile(r"a (small|large) (\w+) (circle|square|triangle)")
RELATIONS = ("left of", "right of", "above", "below")


def observed(img: np.ndarray, color: str) -> tuple[str, str, float, float]:
    """(size, kind, centre y, centre x) of the pixels in ``color``, measured from the image."""
    mask = (img == np.array(COLORS[color])).all(-1)
    ys, xs = np.nonzero(mask)
    assert len(ys), f"no {color} pixels"
    box = mask[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1]
    widths, third = box.sum(1), max(1, len(box) // 3)  # per row
    if box.mean() > 0.95:
        kind = "square"
    elif widths[-third:].mean() > 3 * widths[:third].mean():
        kind = "triangle"  # apex up: the bottom third is much wider than the top third
    else:
        kind = "circle"
    return ("large" if len(box) > 10 else "small"), kind, ys.mean(), xs.mean()  # small: <= 9 px tall at 32 px


def test_captions_describe_the_pixels():
    images, scenes = make_split(80, img_size=32, max_shapes=3, seed=0)
    counts = set()
    for img, refs in zip(images, map(describe, scenes)):
        drawn = {tuple(int(v) for v in px) for px in img.reshape(-1, 3)} - {(0, 0, 0)}
        for caption in refs:
            phrases = PHRASE.findall(caption)
            colours = [c for _, c, _ in phrases]
            assert {COLORS[c] for c in colours} == drawn and len(set(colours)) == len(colours), caption
            seen = {c: observed(img, c) for c in colours}
            for size, colour, kind in phrases:
                assert seen[colour][:2] == (size, kind), (caption, colour, seen[colour])
            # the words between consecutive phrases state where the first stands relative to the second
            links = [w.strip() for w in PHRASE.split(caption)[4::4][:-1]]
            assert len(links) == len(phrases) - 1 and all(r in RELATIONS for r in links), caption
            for (_, a, _), (_, b, _), rel in zip(phrases, phrases[1:], links):
                (ya, xa), (yb, xb) = seen[a][2:], seen[b][2:]
                ok = {"left of": xa < xb, "right of": xa > xb, "above": ya < yb, "below": ya > yb}[rel]
                assert ok, (caption, rel, seen[a], seen[b])
        counts.add(len(PHRASE.findall(refs[0])))
    assert counts == {1, 2, 3}


def test_shapes_datamodule_batches_and_kwargs():
    dm = ShapesCaptionDataModule(num_train=32, num_val=10, num_test=6, batch_size=8, eval_batch_size=5, max_len=24)
    kw = dm.model_kwargs()
    tok = dm.module_kwargs()["tokenizer"]
    assert kw == {"vocab_size": tok.vocab_size, "pad_id": 0, "bos_id": 1, "eos_id": 2}
    assert {"red", "circle", "left", "above"} <= set(tok.itos)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["images"].shape == (8, 3, 32, 32) and batch["images"].dtype == torch.float32
    assert abs(batch["images"].mean().item()) < 3 and batch["images"].min() < -1  # normalised, black is negative
    tokens = batch["tokens"]
    assert (tokens[:, 0] == tok.bos_id).all() and ((tokens == tok.eos_id).sum(1) == 1).all()
    for row, refs in zip(tok.batch_decode(tokens), batch["refs"]):
        assert row in refs
    val = next(iter(dm.val_dataloader()))
    assert val["images"].shape[0] == 5 and val["image_ids"].tolist() == [0, 1, 2, 3, 4]
    assert tok.batch_decode(val["tokens"]) == [r[0] for r in val["refs"]]  # evaluation: the first reference
    dm.setup("test")
    assert sum(b["images"].shape[0] for b in dm.test_dataloader()) == 6


def test_training_draws_every_reference():
    dm = ShapesCaptionDataModule(num_train=8, num_val=1, num_test=1, seed=1)
    data = dm._dataset("train")
    i = next(k for k, refs in enumerate(data.refs) if len(refs) > 1)
    torch.manual_seed(0)
    assert {data[i]["caption"] for _ in range(40)} == set(data.refs[i])


def test_shapes_config_errors():
    with pytest.raises(ConfigError, match="in_chans=1"):
        ShapesCaptionDataModule(in_chans=1)
    with pytest.raises(ConfigError, match="max_shapes=5"):
        ShapesCaptionDataModule(max_shapes=5)
    with pytest.raises(ConfigError, match="channels=1"):
        ShapesCaptionDataModule(channels=1)
    with pytest.raises(ConfigError, match="num_val=0"):
        ShapesCaptionDataModule(num_val=0)


# ------------------------------------------------------------------ COCO format


def write_coco(root, *, with_karpathy: bool = False):
    """A tiny COCO-format folder: 2014-style train/val caption files, JPEGs, optional Karpathy split."""
    rng = np.random.default_rng(0)
    layout = {"train2014": {1: ["A dog runs.", "a brown dog running"], 2: ["A cat sleeps", "a sleeping cat"],
                            3: ["a red bus"]},
              "val2014": {10: ["A man rides a horse.", "a horse and a man"], 11: ["two birds on a wire"]}}
    (root / "annotations").mkdir(parents=True)
    for folder, items in layout.items():
        (root / folder).mkdir()
        images, anns = [], []
        for image_id, caps in items.items():
            name = f"COCO_{folder}_{image_id:012d}.jpg"
            Image.fromarray(rng.integers(0, 255, (20 + image_id, 30, 3), dtype=np.uint8)).save(root / folder / name)
            images.append({"id": image_id, "file_name": name, "height": 20 + image_id, "width": 30})
            anns += [{"id": 100 * image_id + k, "image_id": image_id, "caption": c} for k, c in enumerate(caps)]
        split = folder.removesuffix("2014")
        (root / "annotations" / f"captions_{split}2014.json").write_text(json.dumps({"images": images, "annotations": anns}))
    if with_karpathy:
        splits = {1: "train", 2: "restval", 3: "test", 10: "val", 11: "train"}
        (root / "dataset_coco.json").write_text(json.dumps(
            {"images": [{"cocoid": i, "split": s, "sentences": []} for i, s in splits.items()]}))
    return {"train": {"captions": "annotations/captions_train2014.json", "images": "train2014"},
            "val": {"captions": "annotations/captions_val2014.json", "images": "val2014"}}


def test_coco_reads_splits_and_builds_vocabulary_from_train(tmp_path):
    splits = write_coco(tmp_path)
    dm = COCOCaptionDataModule(root=str(tmp_path), splits=splits, img_size=16, batch_size=2, eval_batch_size=4)
    tok = dm.tokenizer
    assert "dog" in tok.stoi and "horse" not in tok.stoi  # vocabulary from the training captions only
    dm.setup("fit")
    batch = next(iter(dm.val_dataloader()))
    assert batch["images"].shape == (2, 3, 16, 16)  # any source size is resized to img_size
    assert batch["image_ids"].tolist() == [10, 11]
    assert batch["refs"] == [["A man rides a horse.", "a horse and a man"], ["two birds on a wire"]]
    assert tok.batch_decode(batch["tokens"])[0] == "a <unk> <unk> a <unk> ."  # only "a" and "." occur in train
    dm.setup("test")
    assert next(iter(dm.test_dataloader()))["image_ids"].tolist() == [10, 11]  # no test files: test on val
    train = [b for b in dm.train_dataloader()]
    assert sorted(i for b in train for i in b["image_ids"].tolist()) == [1, 2, 3]
    gray = COCOCaptionDataModule(root=str(tmp_path), splits=splits, img_size=8, in_chans=1)
    assert gray._dataset("train").image(0).shape == (1, 8, 8)


def test_coco_karpathy_split_reassigns_pooled_images(tmp_path):
    splits = write_coco(tmp_path, with_karpathy=True)
    dm = COCOCaptionDataModule(root=str(tmp_path), splits=splits, karpathy_split="dataset_coco.json", img_size=16)
    ids = {s: dm._dataset(s).image_ids for s in ("train", "val", "test")}
    assert ids == {"train": [1, 2, 11], "val": [10], "test": [3]}  # restval joins train
    assert "birds" in dm.tokenizer.stoi  # image 11 came from the val2014 file into train


def test_coco_missing_or_bad_files_raise_config_error(tmp_path):
    splits = write_coco(tmp_path)
    with pytest.raises(ConfigError, match="captions_val2017.json"):
        COCOCaptionDataModule(root=str(tmp_path), splits={**splits, "val": {"captions": "annotations/captions_val2017.json",
                                                                         "images": "val2014"}})
    with pytest.raises(ConfigError, match="val2017"):
        COCOCaptionDataModule(root=str(tmp_path), splits={**splits, "val": {**splits["val"], "images": "val2017"}})
    with pytest.raises(ConfigError, match="nowhere"):
        COCOCaptionDataModule(root=str(tmp_path / "nowhere"), splits=splits)
    with pytest.raises(ConfigError, match="karpathy.json"):
        COCOCaptionDataModule(root=str(tmp_path), splits=splits, karpathy_split="karpathy.json")
    with pytest.raises(ConfigError, match="'train' and 'val'"):
        COCOCaptionDataModule(root=str(tmp_path), splits={"val": splits["val"]})
    (tmp_path / "annotations" / "captions_train2014.json").write_text("{not json")
    dm = COCOCaptionDataModule(root=str(tmp_path), splits=splits)
    with pytest.raises(ConfigError, match="not valid JSON"):
        dm.model_kwargs()


def test_coco_config_composes_and_builds_on_a_written_folder(cfg_factory, tmp_path):
    from vitpipe.run.build import build_from_config

    splits = write_coco(tmp_path / "coco")
    cfg = cfg_factory("experiment=caption_shapes", "data=coco_captions", "debug=fast", f"data.root={tmp_path / 'coco'}",
                      *(f"data.splits.{s}.{k}={v}" for s, spec in splits.items() for k, v in spec.items()),
                      "data.min_word_freq=1", "data.num_workers=0", "data.pin_memory=false")
    dm, net, module = build_from_config(cfg)
    assert net.vocab_size == dm.tokenizer.vocab_size and module.tokenizer is dm.tokenizer
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["images"].shape[1:] == (3, 32, 32)  # the encoder's img_size
    assert net(batch["images"], batch["tokens"]).shape[:2] == batch["tokens"].shape
