"""coco_captions: COCO-format caption annotations + image folders, optional Karpathy split.

A COCO caption file is ``{"images": [{"id", "file_name"}...], "annotations": [{"image_id",
"caption"}...]}``. ``splits`` names one file and one image folder per split (``test`` may be
left out: it then reuses ``val``, as the 2017 release has no public test captions). With
``karpathy_split`` (Karpathy & Fei-Fei 2015, ``dataset_coco.json``: ``{"images": [{"cocoid",
"split"}...]}``) the images of all listed files are pooled and re-split by that file's
``split`` field; ``restval`` joins ``train``, as in the papers that report on this split.

Images are read with PIL, converted to RGB (or L for ``in_chans=1``), resized to ``img_size``
(bicubic, timm's default) and normalised with the ImageNet statistics.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torchvision import transforms as T

from vitpipe.data.captions.base import SPLITS, CaptionDataModule
from vitpipe.errors import ConfigError
from vitpipe.run.jsonfiles import loads

KARPATHY_SPLITS = {"train": "train", "restval": "train", "val": "val", "test": "test"}


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ConfigError(f"{what} {str(path)!r} does not exist; check data.root and the file name")
    try:
        return loads(path.read_text())  # depth-bounded (vitpipe.run.jsonfiles): never a RecursionError
    except ValueError as e:
        raise ConfigError(f"{what} {str(path)!r} is not valid JSON: {e}") from e


def read_coco_captions(path: Path, image_dir: Path) -> dict[int, tuple[Path, list[str]]]:
    """{image id: (image path, captions)} of one COCO-format caption file; images without captions are left out."""
    data = _read_json(path, "COCO caption file")
    try:
        files = {int(im["id"]): image_dir / im["file_name"] for im in data["images"]}
        caps = defaultdict(list)
        for ann in data["annotations"]:
            caps[int(ann["image_id"])].append(str(ann["caption"]).strip())
    except (KeyError, TypeError) as e:
        raise ConfigError(f"COCO caption file {str(path)!r} lacks {e} (needs images[id, file_name] and "
                          f"annotations[image_id, caption])") from e
    return {i: (files[i], caps[i]) for i in files if caps[i]}


class COCOCaptionDataModule(CaptionDataModule):
    """COCO captions. ``splits``: {split: {"captions": json path, "images": folder}}, paths relative to ``root``."""

    def __init__(self, *, root: str, splits: Mapping[str, Mapping[str, str]], karpathy_split: str | None = None,
                 img_size: int = 224, in_chans: int = 3, **kwargs) -> None:
        super().__init__(**kwargs)
        self.root = Path(root)
        if not self.root.is_dir():
            raise ConfigError(f"data root {str(self.root)!r} does not exist; set data.root to the COCO folder")
        unknown = set(splits) - set(SPLITS)
        if unknown or "train" not in splits or "val" not in splits:
            raise ConfigError(f"splits must name 'train' and 'val' (and optionally 'test'), got {sorted(splits)}")
        self.files = {}
        for split, spec in splits.items():
            if spec is None:
                continue
            if not {"captions", "images"} <= set(spec):
                raise ConfigError(f"splits.{split} needs 'captions' and 'images' keys, got {sorted(spec)}")
            captions, images = self.root / spec["captions"], self.root / spec["images"]
            if not captions.is_file():
                raise ConfigError(f"COCO caption file {str(captions)!r} (splits.{split}.captions) does not exist")
            if not images.is_dir():
                raise ConfigError(f"image folder {str(images)!r} (splits.{split}.images) does not exist")
            self.files[split] = (captions, images)
        self.karpathy_split = None if karpathy_split is None else self.root / karpathy_split
        if self.karpathy_split is not None and not self.karpathy_split.is_file():
            raise ConfigError(f"Karpathy split file {str(self.karpathy_split)!r} does not exist")
        if in_chans not in (1, 3):
            raise ConfigError(f"in_chans={in_chans}: COCO images load as RGB (3) or grayscale (1)")
        self.in_chans = in_chans
        mean, std = IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
        if in_chans == 1:
            mean, std = (sum(mean) / 3,), (sum(std) / 3,)
        self.transform = T.Compose([T.Resize((img_size, img_size), interpolation=T.InterpolationMode.BICUBIC),
                                    T.ToTensor(), T.Normalize(mean, std)])
        self._splits: dict[str, dict[int, tuple[Path, list[str]]]] | None = None

    def _assign(self) -> dict[str, dict[int, tuple[Path, list[str]]]]:
        """{split: {image id: (path, captions)}}, read once for all splits."""
        if self._splits is None:
            per_file = {s: read_coco_captions(*self.files[s]) for s in self.files}
            if self.karpathy_split is None:
                self._splits = {s: per_file.get(s, per_file["val"]) for s in SPLITS}
            else:
                pooled = {i: v for items in per_file.values() for i, v in items.items()}
                self._splits = {s: {} for s in SPLITS}
                for im in _read_json(self.karpathy_split, "Karpathy split file").get("images", []):
                    split, i = KARPATHY_SPLITS.get(im.get("split")), int(im.get("cocoid", im.get("id", -1)))
                    if split is not None and i in pooled:
                        self._splits[split][i] = pooled[i]
            empty = [s for s in SPLITS if not self._splits[s]]
            if empty:
                raise ConfigError(f"COCO split(s) {empty} hold no captioned image; check the caption files"
                                  + (" and the Karpathy split's cocoid values" if self.karpathy_split else ""))
        return self._splits

    def _load(self, split: str):
        items = sorted(self._assign()[split].items())
        ids, paths, refs = [i for i, _ in items], [p for _, (p, _) in items], [c for _, (_, c) in items]
        return ImageFiles(paths, "RGB" if self.in_chans == 3 else "L", self.transform), refs, ids


class ImageFiles:
    """``(k) -> (C, H, W)`` tensor of the k-th file; a class so DataLoader workers can pickle it."""

    def __init__(self, paths: list[Path], mode: str, transform) -> None:
        self.paths, self.mode, self.transform = paths, mode, transform

    def __call__(self, k: int):
        with Image.open(self.paths[k]) as im:
            return self.transform(im.convert(self.mode))
