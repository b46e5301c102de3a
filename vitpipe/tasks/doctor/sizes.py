"""Sizes: checks 5 (heads: dim % num_heads, a head width near the usual 64) and 6 (memory: the
(B x heads x N x N) matrices the explicit attention path holds at the configured size, against the memory
available)."""

from __future__ import annotations

import math

import torch
from torch import nn

from vitpipe.models.captioner import Captioner
from vitpipe.nn.attn_memory import attention_matrix_bytes, format_bytes
from vitpipe.nn.attn_memory import available_memory as free_bytes
from vitpipe.tasks.doctor.check import FAIL, PASS, SKIP, Check, encoder_of

HEAD_DIM_RANGE = (16, 256)  # head widths outside it are refused; ViT/BERT/GPT use 64
USUAL_HEAD_DIM = 64


def attention_stacks(net: nn.Module) -> list[tuple[str, int, int]]:
    """(where, dim, num_heads) of each attention stack: the encoder's, and a captioner's decoder."""
    enc = encoder_of(net)
    stacks = [("encoder", enc.blocks[0].attn.dim, enc.blocks[0].attn.num_heads)] if len(enc.blocks) else []
    if isinstance(net, Captioner) and len(net.blocks):
        stacks.append(("decoder", net.blocks[0].self_attn.dim, net.blocks[0].self_attn.num_heads))
    return stacks


def usual_heads(dim: int) -> int:
    """The divisor of ``dim`` whose head width is nearest the usual 64."""
    return min((h for h in range(1, dim + 1) if dim % h == 0), key=lambda h: abs(math.log(dim / h / USUAL_HEAD_DIM)))


def check_heads(stacks: list[tuple[str, int, int]]) -> Check:
    """dim % num_heads == 0 and a head width in ``HEAD_DIM_RANGE`` for each stack."""
    if not stacks:
        return Check("heads", SKIP, None, "no attention blocks")
    parts, problems, widths = [], [], []
    lo, hi = HEAD_DIM_RANGE
    for where, dim, heads in stacks:
        good = usual_heads(dim)
        advice = f"num_heads={good} gives head dim {dim // good}"
        if heads <= 0 or dim % heads:
            parts.append(f"{where} {dim} / {heads} heads = {dim / heads:.3g}" if heads > 0 else f"{where} {heads} heads")
            problems.append(f"{where} dim {dim} is not divisible by num_heads={heads}; {advice}")
            widths.append(dim / heads if heads > 0 else 0.0)
            continue
        d = dim // heads
        parts.append(f"{where} {dim} / {heads} heads = head dim {d}")
        widths.append(float(d))
        if not lo <= d <= hi:
            why = "too narrow to hold a query/key match" if d < lo else "few heads, each costly"
            problems.append(f"{where} head dim {d} is outside {lo}..{hi} ({why}; ~{USUAL_HEAD_DIM} is usual); {advice}")
    measured = ", ".join(parts)
    value = min(widths)
    if problems:
        return Check("heads", FAIL, value, measured, "; ".join(problems) + " (model.num_heads)")
    return Check("heads", PASS, value, measured)


# --------------------------------------------------------------------------- 6. memory


def available_memory(device: torch.device) -> tuple[int, str]:
    """Free bytes where the network runs (``vitpipe.nn.attn_memory.available_memory``) and their name."""
    return free_bytes(device), f"free on {device}" if device.type == "cuda" else "RAM available"


def explicit_attention(net: nn.Module, batch_size: int, element_size: int = 4) -> list[tuple[str, int]]:
    """(what, bytes) of the attention matrices the explicit path keeps for one batch: the encoder's
    (B x heads x N x N x depth), and a captioner's decoder at its max_len."""
    enc = encoder_of(net)
    n = enc.num_tokens
    heads = enc.blocks[0].attn.num_heads if len(enc.blocks) else 0
    parts = [
        (
            f"encoder {batch_size} x {heads} heads x {n} x {n} x {element_size} B x {len(enc.blocks)} layers",
            attention_matrix_bytes(batch_size, heads, n, element_size=element_size, layers=len(enc.blocks)),
        )
    ]
    if isinstance(net, Captioner) and len(net.blocks):
        T, dh = net.max_len, net.blocks[0].self_attn.num_heads
        if net.decoder == "prefix":
            size = attention_matrix_bytes(batch_size, dh, n + T, element_size=element_size, layers=len(net.blocks))
            parts.append((f"decoder {batch_size} x {dh} heads x {n + T} x {n + T} x {len(net.blocks)} layers", size))
        else:
            size = attention_matrix_bytes(
                batch_size, dh, T, element_size=element_size, layers=len(net.blocks)
            ) + attention_matrix_bytes(batch_size, dh, T, n, element_size=element_size, layers=len(net.blocks))
            parts.append((f"decoder {batch_size} x {dh} heads x {T} x ({T} + {n}) x {len(net.blocks)} layers", size))
    return parts


def check_memory(net: nn.Module, batch_size: int, device: torch.device) -> Check:
    """The explicit path's attention matrices at the configured size against the memory available."""
    parts = explicit_attention(net, batch_size)
    total = sum(b for _, b in parts)
    free, where = available_memory(device)
    measured = (
        f"explicit attention (need_weights, rollout) holds {format_bytes(total)} "
        f"({'; '.join(w for w, _ in parts)}, float32) of {format_bytes(free)} {where}"
    )
    if total > free:
        return Check(
            "memory",
            FAIL,
            float(total),
            measured,
            "the attention maps of one batch do not fit: use a smaller batch for visualize / need_weights "
            "(batch_size=), a larger patch or smaller img_size; the fused path (SDPA) never builds them",
        )
    return Check("memory", PASS, float(total), measured)
