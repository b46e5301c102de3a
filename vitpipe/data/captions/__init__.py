"""Captioning data: procedural shapes captions and COCO-format captions."""

from vitpipe.data.captions.base import CaptionCollate, CaptionDataModule, CaptionDataset
from vitpipe.data.captions.coco import COCOCaptionDataModule
from vitpipe.data.captions.shapes import ShapesCaptionDataModule

__all__ = ["COCOCaptionDataModule", "CaptionCollate", "CaptionDataModule", "CaptionDataset", "ShapesCaptionDataModule"]
