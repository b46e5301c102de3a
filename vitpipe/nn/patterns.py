"""Sparse attention patterns on the patch grid: a local 2D window plus global tokens.

Longformer (Beltagy et al. 2020) and BigBird (Zaheer et al. 2020) keep attention linear in the
sequence by letting each token see a local window plus a few global tokens that see, and are seen
by, everything; neighbourhood attention (Hassani et al. 2023) makes the window a square on the
image grid. Here the tokens are ``[num_prefix prefix tokens, then h * w patches row-major]``:

- prefix tokens (class, registers) are global;
- patch (r, c) attends to patch (r', c') when |r - r'| <= window and |c - c'| <= window;
- with ``global_stride`` s > 0, the patches with r % s == 0 and c % s == 0 are global too.

One ``mask_mod`` defines the pattern; ``local_global_mask`` gives it as a boolean (N, N) mask
(masked SDPA, the explicit path) or as a flex ``BlockMask`` (``flex_attention`` computes only the
128 x 128 blocks the pattern touches and never builds the (N, N) matrix once compiled).

What flex does depends on the device, found out here once (``flex_support``): in torch 2.14 on a CPU,
``flex_attention`` is inference only (any input that requires grad raises ``NotImplementedError``);
``torch.compile`` turns it into a fused C++ kernel (needs a C++ compiler and AVX2), while eager flex
materialises the full score matrix. So ``backend="auto"`` takes flex only where it also trains (CUDA
with Triton) and the boolean mask elsewhere.
"""

from __future__ import annotations

import functools
import sys
import warnings

import torch
from torch import Tensor

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # pragma: no cover - older torch: boolean masks only
    BlockMask, create_block_mask, flex_attention = None, None, None

BACKENDS = ("auto", "flex", "sdpa")


def local_global_mod(grid: tuple[int, int], num_prefix: int, *, window: int, global_stride: int = 0):
    """The pattern as a flex ``mask_mod(b, h, q_idx, kv_idx) -> bool``; broadcasts over index tensors.

    Indices past the last token (flex pads the sequence to whole blocks) get harmless values.
    """
    h, w = _check(grid, num_prefix, window, global_stride)
    P, s = num_prefix, global_stride

    def is_global(t: Tensor) -> Tensor:
        g = t < P
        if s:  # prefix tokens give negative patch indices: already global, whatever r and c are
            p = t - P
            g = g | (((p // w) % s == 0) & ((p % w) % s == 0))
        return g

    def mask_mod(b, head, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        pq, pk = q_idx - P, kv_idx - P
        near = ((pq // w - pk // w).abs() <= window) & ((pq % w - pk % w).abs() <= window)
        return near | is_global(q_idx) | is_global(kv_idx)

    return mask_mod


def local_global_mask(
    grid: tuple[int, int], num_prefix: int, *, window: int, global_stride: int = 0, backend: str = "auto", device=None
) -> Tensor | BlockMask:
    """The local + global pattern for ``num_prefix + h * w`` tokens, ``grid = (h, w)``.

    backend: ``"sdpa"`` -> bool (N, N), True = may attend; ``"flex"`` -> ``BlockMask`` (B=None,
    H=None: one pattern for every image and head); ``"auto"`` -> flex where ``flex_support(device)``
    says it trains and compiles, else sdpa. device: where the mask lives (default CPU).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; valid choices: {', '.join(BACKENDS)}")
    mask_mod = local_global_mod(grid, num_prefix, window=window, global_stride=global_stride)
    device = torch.device("cpu" if device is None else device)
    n = num_prefix + grid[0] * grid[1]
    if backend == "auto":
        backend = "flex" if flex_support(device)["auto"] else "sdpa"
    if backend == "flex":
        if BlockMask is None:
            raise ValueError(
                f"backend='flex' needs torch.nn.attention.flex_attention (torch >= 2.5; this is "
                f"torch {torch.__version__}); valid choices here: auto, sdpa"
            )
        return create_block_mask(mask_mod, None, None, n, n, device=device)
    idx = torch.arange(n, device=device)
    return mask_mod(None, None, idx[:, None], idx[None, :])  # (N, N)


def dense_mask(mask: Tensor | BlockMask) -> Tensor:
    """The bool (N, M) mask of a pattern: a ``BlockMask``'s ``mask_mod`` evaluated at every (query,
    key) pair, or a boolean mask as it is. For tests and for the paths that need the dense form."""
    if BlockMask is None or not isinstance(mask, BlockMask):
        return mask.to(torch.bool)
    n_q, n_kv = mask.seq_lengths
    device = mask.kv_num_blocks.device
    q, kv = torch.arange(n_q, device=device)[:, None], torch.arange(n_kv, device=device)[None, :]
    return torch.broadcast_to(mask.mask_mod(None, None, q, kv), (n_q, n_kv))


@functools.cache
def _flex_support(device_type: str) -> dict:
    if flex_attention is None:
        return {
            "forward": False,
            "backward": False,
            "compiled": False,
            "auto": False,
            "why": f"torch {torch.__version__} has no flex_attention",
        }
    # Probe rather than hard-code a torch version: a CPU without backward refuses an input that requires
    # grad before computing anything (the probe is 16 tokens on this device otherwise).
    try:
        with torch.inference_mode(False), torch.enable_grad(), warnings.catch_warnings():
            q = torch.zeros(1, 1, 16, 16, device=device_type, requires_grad=True)
            warnings.simplefilter("ignore")  # "called without torch.compile()": this probe is meant to be eager
            flex_attention(q, q, q)
        backward, why = True, ""
    except NotImplementedError as e:
        backward, why = False, str(e).split(". ")[0]
    compiled = _compiles(device_type)
    if not compiled:
        why = (why + "; " if why else "") + "torch.compile cannot build flex_attention here (eager flex builds N x N)"
    return {"forward": True, "backward": backward, "compiled": compiled, "auto": backward and compiled, "why": why}


def flex_support(device=None) -> dict:
    """What ``flex_attention`` does on ``device`` (a type or a device; default CPU), probed once per type:
    ``{"forward", "backward", "compiled", "auto", "why"}``. ``auto``: both trains and compiles to a fused
    kernel, the condition for ``backend="auto"`` to pick flex; ``why``: what is missing, in words."""
    return dict(_flex_support(torch.device("cpu" if device is None else device).type))


def _compiles(device_type: str) -> bool:
    """Whether inductor can lower flex_attention on this device type (its own requirements, checked
    without compiling: a C++ compiler and AVX2 on x86 CPUs, Triton on GPUs)."""
    if device_type == "cpu":
        if sys.platform == "darwin" or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
            return False
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
            return True
        except Exception:  # noqa: BLE001 - any failure to find the compiler means: no fused kernel
            return False
    from torch.utils._triton import has_triton

    return device_type in ("cuda", "xpu") and has_triton()


@functools.cache
def compiled_flex_attention():
    """``torch.compile(flex_attention)``, built once: the fused kernel that computes only the kept blocks.
    Each new sequence length or pattern compiles again (10-20 s on a 2-core CPU), then is cached."""
    return torch.compile(flex_attention, dynamic=False)


def _check(grid, num_prefix, window, global_stride) -> tuple[int, int]:
    if (
        not isinstance(grid, (tuple, list))
        or len(grid) != 2
        or not all(isinstance(g, int) and not isinstance(g, bool) and g > 0 for g in grid)
    ):
        raise ValueError(f"grid={grid!r}; valid: two positive ints (rows, cols) of the patch grid")
    for name, value, valid in (
        ("num_prefix", num_prefix, "an int >= 0 (class and register tokens)"),
        ("window", window, "an int >= 0 (patch rows/cols each side; 0 = the patch itself)"),
        ("global_stride", global_stride, "an int >= 0 (0 = no global patches)"),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}={value!r}; valid: {valid}")
    return int(grid[0]), int(grid[1])
