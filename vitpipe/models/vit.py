"""Vision Transformer (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words").

Patch stem -> [class token, registers] + positions -> pre-norm encoder blocks -> norm -> pool
-> head. Parameter names follow timm's ``VisionTransformer`` (see ``timm_compat``), with the
positional table living in ``pos_embed.weight``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from vitpipe.nn.blocks import EncoderBlock
from vitpipe.nn.patch_embed import STEMS
from vitpipe.nn.pos_embed import RoPE2D, build_pos_embed

POOLS = ("cls", "mean")


class ViT(nn.Module):
    """Image classifier. ``forward(x (B, C, H, W)) -> logits (B, num_classes)``.

    Any input size divisible by the patch runs (positions are resampled or recomputed).
    ``pool="mean"`` averages patch tokens and, as in timm, moves the final norm after pooling.
    ``reg_tokens`` adds register tokens (Darcet et al. 2024) after the class token.
    ``dist_token`` adds DeiT's distillation token (after the class token) and a second head
    ``head_dist``: ``forward_heads`` returns both heads' logits (training on labels and teacher),
    ``forward`` their mean (Touvron et al. 2021, "Training data-efficient image transformers").
    ``stem="conv"`` replaces the patchify conv with a small conv stem (Xiao et al. 2021).
    """

    def __init__(
        self,
        *,
        img_size: int | tuple[int, int] = 224,
        patch_size: int | tuple[int, int] = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        pos_embed: str = "learned",
        stem: str = "patch",
        class_token: bool = True,
        dist_token: bool = False,
        reg_tokens: int = 0,
        pool: str = "cls",
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        init_values: float | None = None,
        grad_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        # pos_embed and num_heads are checked where they are used: build_pos_embed, MultiHeadAttention
        if stem not in STEMS:
            raise ValueError(f"unknown stem={stem!r}; valid choices: {', '.join(STEMS)}")
        if pool not in POOLS:
            raise ValueError(f"unknown pool={pool!r}; valid choices: {', '.join(POOLS)}")
        if pool == "cls" and not class_token:
            raise ValueError("pool='cls' needs class_token=True; use pool='mean' for a model without a class token")
        if dist_token and pool != "cls":
            raise ValueError("dist_token=True reads its head from a token, as the class head does: it needs pool='cls'")

        self.patch_embed = STEMS[stem](img_size, patch_size, in_chans, dim)
        self.img_size, self.patch_size = self.patch_embed.img_size, self.patch_embed.patch_size
        self.grid_size = self.patch_embed.grid_size
        self.in_chans, self.num_classes, self.dim, self.pool = in_chans, num_classes, dim, pool
        self.class_token = class_token
        self.num_prefix_tokens = int(class_token) + int(dist_token) + reg_tokens
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if class_token else None
        # DeiT's distillation token (Touvron et al. 2021): right after the class token, its own head
        self.dist_token = nn.Parameter(torch.zeros(1, 1, dim)) if dist_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, reg_tokens, dim)) if reg_tokens else None
        self.pos_embed = build_pos_embed(pos_embed, dim=dim, grid_size=self.grid_size, num_heads=num_heads,
                                         num_prefix_tokens=self.num_prefix_tokens)
        self.pos_drop = nn.Dropout(drop_rate)

        # stochastic depth grows linearly with depth (Huang et al. 2016; DeiT)
        rates = torch.linspace(0, drop_path_rate, depth).tolist()
        self.blocks = nn.ModuleList(
            EncoderBlock(dim, num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, qk_norm=qk_norm,
                         proj_drop=drop_rate, attn_drop=attn_drop_rate, drop_path=r, init_values=init_values)
            for r in rates
        )
        self.norm = nn.LayerNorm(dim, eps=1e-6) if pool == "cls" else nn.Identity()
        self.fc_norm = nn.LayerNorm(dim, eps=1e-6) if pool == "mean" else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(dim, num_classes) if num_classes > 0 else nn.Identity()
        self.head_dist = (nn.Linear(dim, num_classes) if num_classes > 0 else nn.Identity()) if dist_token else None
        self.grad_checkpointing = grad_checkpointing
        self._init_weights()

    def _init_weights(self) -> None:
        # timm/DeiT init: truncated normal .02 for linears, small normal for the prefix tokens
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        for t in (self.cls_token, self.reg_token):
            if t is not None:
                nn.init.normal_(t, std=1e-6)
        if self.dist_token is not None:
            nn.init.trunc_normal_(self.dist_token, std=0.02)  # timm's VisionTransformerDistilled

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute block activations in backward: memory for compute (Chen et al. 2016)."""
        self.grad_checkpointing = enable

    def no_weight_decay(self) -> set[str]:
        """Parameter names that weight decay must skip (besides norms and biases)."""
        prefixes = ("pos_embed.", "cls_token", "dist_token", "reg_token")
        return {n for n, _ in self.named_parameters() if n.startswith(prefixes)}

    def group_matcher(self, coarse: bool = False) -> dict:
        """Layer groups for timm's ``param_groups_layer_decay`` (``timm.models.group_parameters``):
        the stem (patch embedding, positions, prefix tokens) is layer 0, block i is layer i + 1, and
        what matches nothing (final norm, fc_norm, head) is the last layer, at the full lr.

        timm's VisionTransformer merges its final ``norm`` into the last block's group (decay^1);
        here it goes with the head, as in BEiT's ``get_num_layer_for_vit`` and MAE's ``lrd.py``.
        ``coarse`` is accepted for timm's signature; the grouping is the same.
        """
        return dict(stem=r"^cls_token|^dist_token|^reg_token|^pos_embed|^patch_embed",
                    blocks=[(r"^blocks\.(\d+)", None)])

    def get_classifier(self) -> nn.Module:
        """The head (timm's name for it): what a linear probe trains; everything else is the encoder.
        With a distillation token both heads (timm's VisionTransformerDistilled returns the pair)."""
        return self.head if self.head_dist is None else nn.ModuleList([self.head, self.head_dist])

    def _embed(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        x, grid = self.patch_embed(x)  # (B, h*w, dim)
        tokens = (self.cls_token, self.dist_token, self.reg_token)
        prefix = [t.expand(x.shape[0], -1, -1) for t in tokens if t is not None]
        x = torch.cat([*prefix, x], dim=1)  # (B, P + h*w, dim)
        return self.pos_drop(self.pos_embed(x, grid)), grid

    def forward_features(self, x: Tensor, *, return_attn: bool = False):
        """Tokens (B, P + h*w, dim) after the final norm; with ``return_attn`` also the list of
        ``depth`` attention tensors (B, heads, N, N) from the explicit path, for this call only."""
        x, grid = self._embed(x)
        rope = self.pos_embed.phases(grid, device=x.device) if isinstance(self.pos_embed, RoPE2D) else None
        attentions = []
        for blk in self.blocks:
            if return_attn:
                x, w = blk(x, rope=rope, need_weights=True)
                attentions.append(w)
            elif self.grad_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(blk, x, rope=rope, use_reentrant=False)
            else:
                x = blk(x, rope=rope)
        x = self.norm(x)
        return (x, attentions) if return_attn else x

    def forward_head(self, x: Tensor, *, pre_logits: bool = False) -> Tensor:
        x = x[:, 0] if self.pool == "cls" else x[:, self.num_prefix_tokens :].mean(dim=1)  # (B, dim)
        x = self.head_drop(self.fc_norm(x))
        return x if pre_logits else self.head(x)

    def forward_heads(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """DeiT training: (class-token logits, distillation-token logits), each (B, num_classes).
        Without a distillation token both are the one head's logits."""
        tokens = self.forward_features(x)
        logits = self.forward_head(tokens)
        if self.dist_token is None:
            return logits, logits
        return logits, self.head_dist(self.head_drop(tokens[:, 1]))  # token 1: right after the class token

    def forward(self, x: Tensor) -> Tensor:
        if self.dist_token is None:
            return self.forward_head(self.forward_features(x))
        cls_logits, dist_logits = self.forward_heads(x)
        return (cls_logits + dist_logits) / 2  # DeiT at test time: the two heads averaged

    def reset_classifier(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.head = nn.Linear(self.dim, num_classes) if num_classes > 0 else nn.Identity()
        if self.dist_token is not None:
            self.head_dist = nn.Linear(self.dim, num_classes) if num_classes > 0 else nn.Identity()

