"""Take a trained classifier out of vitpipe: timm's hub layout (with a model card), ONNX, the HF Hub.

``export(cfg)`` is the body of ``scripts/export.py``; each format is one small module.
"""

from vitpipe.export.command import export
from vitpipe.export.onnx_format import export_onnx
from vitpipe.export.timm_format import save_timm

__all__ = ["export", "export_onnx", "save_timm"]
