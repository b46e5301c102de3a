"""FLOPs per image and model FLOPs utilisation (MFU, Chowdhery et al. 2022, PaLM appendix B).

FLOPs are counted by ``torch.utils.flop_counter`` on a meta-device copy (no real compute), with
attention decomposed into matmuls (SDPA's math backend) so its FLOPs count on every device. For
a ViT this equals the closed form per block 24*N*d^2 + 4*N^2*d (forward) and backward = 2x forward.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

# Dense (no sparsity) peak TFLOP/s per GPU from NVIDIA's data sheets, by the math the precision runs:
# bf16/fp16 tensor cores; tf32 when fp32 matmuls may use TF32; plain fp32 otherwise. First match wins
# ("H100 PCIe" before "H100", "L40S" before "L4").
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 66.9},  # SXM
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}


def math_kind(precision: str) -> str:
    if precision == "bf16-mixed":
        return "bf16"
    if precision == "16-mixed":
        return "fp16"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The data-sheet peak for this GPU and precision, or None when the GPU is not in the table."""
    for key, peaks in PEAK_TFLOPS.items():
        if key.lower() in device_name.lower():
            return peaks.get(math_kind(precision))
    return None


def flops_per_image(model: nn.Module, img_size: int, in_chans: int = 3) -> dict[str, int]:
    """{"forward": ..., "train": forward + backward} FLOPs for one image (a multiply-add = 2 FLOPs)."""
    meta = copy.deepcopy(model).to("meta")
    x = torch.empty(1, in_chans, img_size, img_size, device="meta")
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        meta(x)
    forward = counter.get_total_flops()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        meta(x).sum().backward()
    return {"forward": forward, "train": counter.get_total_flops()}


def utilisation(flops_per_img: int, img_s: float, peak: float | None) -> dict:
    """Achieved TFLOP/s, and MFU when the peak is known."""
    achieved = flops_per_img * img_s / 1e12
    return {"tflops": achieved, "mfu": None if peak is None else achieved / peak}
