"""Take a trained classifier out of vitpipe: timm's hub layout (with a model card), ONNX, the HF Hub.

Each format is one small module; ``vitpipe.tasks.export.export(cfg)`` (the body of
``scripts/export.py``) picks them.
"""

from vitpipe.export.onnx_format import export_onnx
from vitpipe.export.timm_format import save_timm

__all__ = ["export_onnx", "save_timm"]
