"""Vision Transformer (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words").

Patch stem -> [class token, registers] + positions -> pre-norm encoder blocks -> norm -> pool
-> head. Parameter names follow timm's ``VisionTransformer`` (see ``timm_compat``), with the
positional table living in ``pos_embed.weight``.

Besides images, ``forward`` takes timm ``NaFlexVit``'s patch dict (``vitpipe.nn.naflex``): images
at their own aspect and size, as flattened patches with their (row, col) and a validity mask.
The same weights embed them (the patchify conv as a linear map), positions come from each token's
coordinates on its own image's grid, padding is masked out of attention and of mean pooling.

FlexiViT (Beyer et al. 2023): with ``flexi_patch_sizes`` each training forward cuts its batch at a
size drawn uniformly from the list (torch's global generator, which vitpipe's checkpoints restore,
so a resumed run draws the same sizes); the patch kernel is PI-resized to it (``nn.patch_embed``) and
the positions resampled to its grid. In eval mode the model embeds at ``patch_size`` or at the size
``set_patch_size`` chose, any that divides ``img_size``. The parameters stay at ``patch_size``. A patch
dict is embedded at ``patch_size`` always: its patches were cut by the data at that size.

Fewer tokens per step: ``patch_drop_rate`` trains on a random subset of the patch tokens (PatchDropout,
Liu et al. 2023; timm's module, where timm's ``VisionTransformer`` applies it: after the positions); ``tome_r``
merges r tokens in every block at inference (ToMe, Bolya et al. 2023; ``vitpipe.nn.tome``), with
proportional attention and size-weighted mean pooling. Both need positions that travel with the tokens
(absolute ones added before the blocks) and dense attention: rope, relative position bias and a local
window are refused, as are NaFlex patch dicts.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from timm.layers import AttentionPoolLatent, PatchDropout
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from vitpipe.nn.blocks import EncoderBlock, mlp_act_layer
from vitpipe.nn.naflex import check_batch, grid_sizes
from vitpipe.nn.patch_embed import STEMS, to_2tuple
from vitpipe.nn.pos_embed import RoPE2D, build_pos_embed
from vitpipe.nn.rel_pos import REL_POS_KINDS, build_rel_pos
from vitpipe.nn.tome import TokenMerger, max_merge

POOLS = ("cls", "mean", "map")


class ViT(nn.Module):
    """Image classifier. ``forward(x (B, C, H, W) or patch dict) -> logits (B, num_classes)``.

    Any input size divisible by the patch runs (positions are resampled or recomputed).
    ``pool="mean"`` averages patch tokens and, as in timm, moves the final norm after pooling.
    ``reg_tokens`` adds register tokens (Darcet et al. 2024) after the class token.
    ``dist_token`` adds DeiT's distillation token (after the class token) and a second head
    ``head_dist``: ``forward_heads`` returns both heads' logits (training on labels and teacher),
    ``forward`` their mean (Touvron et al. 2021, "Training data-efficient image transformers").
    ``stem="conv"`` replaces the patchify conv with a small conv stem (Xiao et al. 2021). ``stem_depth``
    (>= 2) adds stride-1 3x3 convs to each of its stages (a hybrid stem; ``ConvStem``).
    ``flexi_patch_sizes`` trains at random patch sizes (FlexiViT, module docstring); ``set_patch_size``
    picks the eval-time one. ``pos_embed_ar_preserving``: how learned tables are resampled for a patch
    dict's grids (``vitpipe.nn.pos_embed``; timm NaFlexVit's ``pos_embed_ar_preserving``);
    ``pos_embed_naflex_rule`` resamples them by that rule for image tensors too (timm NaFlexVit runs a
    tensor as the patch dict of its whole grid; ``from_timm`` sets it for a converted NaFlexVit).
    ``patch_drop_rate`` drops that fraction of the patch tokens in training (PatchDropout); ``tome_r`` merges
    that many tokens per block in eval mode (ToMe; ``set_tome_r`` changes it). See the module docstring.

    Options met in timm's zoo (``timm_compat.from_timm``; defaults are the plain ViT): ``norm_eps`` of every
    LayerNorm (CLIP, DINOv3: 1e-5); ``pre_norm`` a LayerNorm on the embedded tokens before the blocks (CLIP's
    ``ln_pre``, timm's ``norm_pre``); ``final_norm=False`` no norm after the blocks; ``mlp_act`` the MLP
    activation (``gelu``, ``gelu_tanh``: SigLIP, ``quick_gelu``: OpenAI CLIP); ``pool="map"`` multihead
    attention pooling of the patch tokens by one learned query (SigLIP; timm's ``AttentionPoolLatent``,
    Zhai et al. 2022 / Lee et al. 2019's PMA); ``pool_include_prefix`` pools (mean or map) over the prefix
    tokens too (timm's Eva, Perception Encoder); ``pool_num_heads`` / ``pool_mlp_ratio`` size that pooling
    (default: the blocks' heads and MLP ratio); ``mlp="swiglu"`` a SwiGLU MLP (EVA-02, DINOv3 ViT-S+),
    ``mlp_norm`` a LayerNorm on the MLP's hidden units (EVA-02), ``attn_norm`` one on the attention's output
    before its projection (EVA-02 CLIP, BEiT-3; NormFormer's sub-LN). ``rope=True`` adds 2D rotary positions on
    q/k to ``pos_embed`` (EVA-02: learned + rope; ``pos_embed='rope2d'`` is rope alone); ``rope_base``,
    ``rope_coords``, ``rope_ref_grid`` and ``rope_offset`` choose its frequencies and coordinates (``vitpipe.nn.rope``).
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
        stem_depth: int = 1,
        class_token: bool = True,
        dist_token: bool = False,
        reg_tokens: int = 0,
        pool: str = "cls",
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        init_values: float | None = None,
        grad_checkpointing: bool = False,
        flexi_patch_sizes: list[int] | None = None,
        pos_embed_ar_preserving: bool = True,
        pos_embed_naflex_rule: bool = False,
        rel_pos: str = "none",
        rel_pos_shared: bool = False,
        rel_pos_dim: int | None = None,
        res_post_norm: bool = False,
        fc_norm: bool | None = None,
        attn_window: int | None = None,
        attn_global_stride: int = 0,
        attn_backend: str = "auto",
        patch_drop_rate: float = 0.0,
        tome_r: int = 0,
        norm_eps: float = 1e-6,
        pre_norm: bool = False,
        final_norm: bool = True,
        mlp_act: str = "gelu",
        mlp: str = "mlp",
        mlp_norm: bool = False,
        attn_norm: bool = False,
        pool_include_prefix: bool = False,
        pool_num_heads: int | None = None,
        pool_mlp_ratio: float | None = None,
        rope: bool = False,
        rope_base: float = 10000.0,
        rope_coords: str = "index",
        rope_ref_grid: tuple[int, int] | None = None,
        rope_offset: float = 0.0,
    ) -> None:
        super().__init__()
        # pos_embed and num_heads are checked where they are used: build_pos_embed, MultiHeadAttention
        if stem not in STEMS:
            raise ValueError(f"unknown stem={stem!r}; valid choices: {', '.join(STEMS)}")
        if pool not in POOLS:
            raise ValueError(f"unknown pool={pool!r}; valid choices: {', '.join(POOLS)}")
        if pool == "cls" and not class_token:
            raise ValueError("pool='cls' needs class_token=True; use pool='mean' for a model without a class token")
        mlp_act_layer(mlp_act)  # ValueError naming the choices
        if not isinstance(norm_eps, (int, float)) or isinstance(norm_eps, bool) or not 0 < norm_eps < 1:
            raise ValueError(f"norm_eps={norm_eps!r}; use a small positive float (1e-6: ViT, timm; 1e-5: CLIP)")
        if dist_token and pool != "cls":
            raise ValueError("dist_token=True reads its head from a token, as the class head does: it needs pool='cls'")
        if rel_pos not in REL_POS_KINDS:
            raise ValueError(f"unknown rel_pos={rel_pos!r}; valid choices: {', '.join(REL_POS_KINDS)}")
        if fc_norm is not None and not isinstance(fc_norm, bool):
            raise TypeError(f"fc_norm={fc_norm!r}; use null (by pool), true or false")

        if stem_depth != 1 and stem != "conv":
            raise ValueError(f"stem_depth={stem_depth!r} sets the conv stem's layers per stage: it needs stem='conv' "
                             f"(got stem={stem!r}); leave stem_depth=1 for the patchify stem")
        self.patch_embed = STEMS[stem](img_size, patch_size, in_chans, dim, **({"depth": stem_depth} if stem == "conv" else {}))
        self.img_size, self.patch_size = self.patch_embed.img_size, self.patch_embed.patch_size
        self.stem = stem
        self.flexi_patch_sizes = self._check_flexi(flexi_patch_sizes, stem)
        self._eval_patch_size: tuple[int, int] | None = None  # set_patch_size; None: patch_size
        self.grid_size = self.patch_embed.grid_size
        self.in_chans, self.num_classes, self.dim, self.pool = in_chans, num_classes, dim, pool
        self.class_token = class_token
        self.num_prefix_tokens = int(class_token) + int(dist_token) + reg_tokens
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if class_token else None
        # DeiT's distillation token (Touvron et al. 2021): right after the class token, its own head
        self.dist_token = nn.Parameter(torch.zeros(1, 1, dim)) if dist_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, reg_tokens, dim)) if reg_tokens else None
        rope_kw = {"base": rope_base, "coords": rope_coords,
                   "ref_grid": None if rope_ref_grid is None else tuple(to_2tuple(rope_ref_grid)), "offset": rope_offset}
        self.pos_embed = build_pos_embed(pos_embed, dim=dim, grid_size=self.grid_size, num_heads=num_heads,
                                         num_prefix_tokens=self.num_prefix_tokens, rope=rope_kw)
        if rope and isinstance(self.pos_embed, RoPE2D):
            raise ValueError("rope=True adds rotary positions to an absolute pos_embed; pos_embed='rope2d' has them "
                             "already (use rope=false, or pos_embed=learned with rope=true as EVA-02)")
        # rotary positions besides an absolute table (EVA-02); with pos_embed='rope2d' the table is the rope
        self.rope = RoPE2D(dim // num_heads, self.num_prefix_tokens, **rope_kw) if rope else None
        if not isinstance(pos_embed_ar_preserving, bool):
            raise TypeError(f"pos_embed_ar_preserving={pos_embed_ar_preserving!r}; use true or false")
        if hasattr(self.pos_embed, "ar_preserving"):  # the learned tables' patch-dict resampling rule
            self.pos_embed.ar_preserving = pos_embed_ar_preserving
            self.pos_embed.naflex_rule = bool(pos_embed_naflex_rule)
        self.pos_drop = nn.Dropout(drop_rate)
        self.norm_pre = nn.LayerNorm(dim, eps=norm_eps) if pre_norm else nn.Identity()  # CLIP's ln_pre
        self.norm_eps, self.pre_norm, self.final_norm, self.mlp_act = norm_eps, pre_norm, final_norm, mlp_act
        self.pool_include_prefix = pool_include_prefix
        self.rel_pos_kind, self.attn_window = rel_pos, attn_window  # read by the token-count checks below
        if isinstance(patch_drop_rate, bool) or not isinstance(patch_drop_rate, (int, float)) \
                or not 0 <= patch_drop_rate < 1:
            raise ValueError(f"patch_drop_rate={patch_drop_rate!r}; use a fraction in [0, 1) (0: off; Liu et al. "
                             "2023 train at 0.5)")
        self._check_token_positions("patch_drop_rate", patch_drop_rate)
        self.patch_drop_rate = float(patch_drop_rate)
        # prefix tokens are kept; an Identity when off, as timm (the same module names, no state either way)
        self.patch_drop = PatchDropout(patch_drop_rate, num_prefix_tokens=self.num_prefix_tokens) \
            if patch_drop_rate > 0 else nn.Identity()
        self.set_tome_r(tome_r)

        # stochastic depth grows linearly with depth (Huang et al. 2016; DeiT)
        rates = torch.linspace(0, drop_path_rate, depth).tolist()
        self.blocks = nn.ModuleList(
            EncoderBlock(dim, num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, qk_norm=qk_norm,
                         proj_drop=drop_rate, attn_drop=attn_drop_rate, drop_path=r, init_values=init_values,
                         res_post_norm=res_post_norm, norm_eps=norm_eps, mlp_act=mlp_act, mlp=mlp, mlp_norm=mlp_norm,
                         attn_norm=attn_norm)
            for r in rates
        )
        # relative position bias (vitpipe.nn.rel_pos): one module shared by every block, or one per block
        rel_kw = dict(grid_size=self.grid_size, num_heads=num_heads, num_prefix_tokens=self.num_prefix_tokens,
                      hidden_dim=rel_pos_dim)
        self.rel_pos = build_rel_pos(rel_pos, **rel_kw) if rel_pos_shared else None
        for blk in self.blocks:
            blk.rel_pos = None if rel_pos_shared else build_rel_pos(rel_pos, **rel_kw)
        # local + global attention (vitpipe.nn.patterns): None = dense; checked by the pattern builder
        self.attn_global_stride, self.attn_backend = attn_global_stride, attn_backend
        self._patterns: dict = {}
        if attn_window is not None:
            from vitpipe.nn.patterns import BACKENDS

            if attn_backend not in BACKENDS:
                raise ValueError(f"unknown attn_backend={attn_backend!r}; valid choices: {', '.join(BACKENDS)}")
            self.attn_pattern((1, 1), torch.device("cpu"), explicit=True)  # bad values: ValueError now
        # fc_norm (timm's name): the final norm after pooling instead of before; default by pool
        fc_norm = pool == "mean" if fc_norm is None else fc_norm
        self.norm = nn.Identity() if fc_norm or not final_norm else nn.LayerNorm(dim, eps=norm_eps)
        self.fc_norm = nn.LayerNorm(dim, eps=norm_eps) if fc_norm and final_norm else nn.Identity()
        # attention pooling (timm's module and parameter names, built as timm's VisionTransformer builds it)
        self.attn_pool = AttentionPoolLatent(dim, num_heads=pool_num_heads or num_heads,
                                             mlp_ratio=pool_mlp_ratio or mlp_ratio,
                                             norm_layer=partial(nn.LayerNorm, eps=norm_eps),
                                             act_layer=mlp_act_layer(mlp_act)) if pool == "map" else None
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

    def _valid_patch_sizes(self) -> str:
        H, W = self.img_size
        return ", ".join(str(d) for d in range(1, math.gcd(H, W) + 1) if H % d == 0 and W % d == 0)

    def _check_flexi(self, sizes, stem: str) -> tuple[int, ...] | None:
        """FlexiViT's patch-size list: positive ints dividing img_size, for the patchify stem."""
        if sizes is None:
            return None
        H, W = self.img_size
        if isinstance(sizes, (int, str)) or not sizes or \
                not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
            raise ValueError(f"flexi_patch_sizes={sizes!r}; use null or a list of patch sizes dividing img_size "
                             f"{H}x{W}: {self._valid_patch_sizes()}")
        if stem != "patch":
            raise ValueError(f"flexi_patch_sizes needs stem='patch' (the conv stem cannot change its patch), got stem={stem!r}")
        for s in sizes:
            if H % s or W % s:
                raise ValueError(f"flexi_patch_sizes: {s} does not divide img_size {H}x{W}; valid patch sizes: "
                                 f"{self._valid_patch_sizes()}")
        return tuple(int(s) for s in sizes)

    def set_patch_size(self, patch_size: int | tuple[int, int] | None) -> None:
        """Embed at ``patch_size`` in eval mode (and in training without ``flexi_patch_sizes``), the
        kernel PI-resized to it; None goes back to the built ``patch_size``. The weights do not change."""
        if patch_size is None:
            self._eval_patch_size = None
            return
        H, W = self.img_size
        try:
            size = to_2tuple(patch_size)
        except (TypeError, ValueError):
            size = None
        if size is None or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in size) \
                or H % size[0] or W % size[1]:
            raise ValueError(f"patch size {patch_size!r} does not divide img_size {H}x{W}; valid patch sizes: "
                             f"{self._valid_patch_sizes()}")
        if size != self.patch_size and self.stem != "patch":
            raise ValueError(f"stem='conv' embeds at its built patch {self.patch_size[0]} only, got patch size "
                             f"{patch_size!r}; use stem='patch' for other patch sizes (FlexiViT)")
        self._eval_patch_size = None if size == self.patch_size else size

    def _check_token_positions(self, name: str, value) -> None:
        """Dropping or merging tokens keeps what each token holds, not where it sits: refuse the schemes
        that read a token's place in the sequence (ValueError, one line)."""
        if not value:
            return
        what = [w for w, on in [("pos_embed='rope2d'", isinstance(self.pos_embed, RoPE2D)),
                                ("rope=True", getattr(self, "rope", None) is not None),
                                (f"rel_pos={self.rel_pos_kind!r}", self.rel_pos_kind != "none"),
                                (f"attn_window={self.attn_window}", self.attn_window is not None)] if on]
        if what:
            raise ValueError(f"{name}={value} with {' and '.join(what)}: dropped or merged tokens lose the grid these "
                             f"read positions from; use {name}=0, or absolute positions (learned, sincos2d, ...) "
                             "with rel_pos=none and attn_window=null")

    def set_tome_r(self, r: int) -> None:
        """Merge ``r`` tokens in every block of an eval-mode forward (ToMe); 0 turns it off. At most half the
        patches of ``img_size`` (later blocks merge fewer where fewer are left, as the paper's algorithm does)."""
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"tome_r={r!r}; use an int >= 0 (tokens merged per block at inference; 0: off)")
        self._check_token_positions("tome_r", r)
        n = self.grid_size[0] * self.grid_size[1]
        if r > max_merge(n):
            raise ValueError(f"tome_r={r} is more than a block can merge: {n} patches at img_size "
                             f"{self.img_size[0]}x{self.img_size[1]} allow at most tome_r={max_merge(n)} (half of them)")
        self.tome_r = r

    @property
    def num_tokens(self) -> int:
        """Tokens an eval-mode forward of an ``img_size`` image attends over: prefix + patches at
        ``current_patch_size`` (the N of the (B, heads, N, N) attention matrices)."""
        (H, W), (p, q) = self.img_size, self.current_patch_size
        return self.num_prefix_tokens + (H // p) * (W // q)

    @property
    def current_patch_size(self) -> tuple[int, int]:
        """The patch size an eval-mode forward embeds at (``set_patch_size``, else ``patch_size``)."""
        return self._eval_patch_size or self.patch_size

    def _draw_patch_size(self) -> tuple[int, int] | None:
        """This forward's patch size: FlexiViT's uniform draw in training (the paper's schedule), else
        the eval-time one (None: the built size, the stored kernel as is)."""
        if self.training and self.flexi_patch_sizes:
            i = int(torch.randint(len(self.flexi_patch_sizes), ()).item())  # torch's global generator
            return to_2tuple(self.flexi_patch_sizes[i])
        return self._eval_patch_size

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute block activations in backward: memory for compute (Chen et al. 2016)."""
        self.grad_checkpointing = enable

    def no_weight_decay(self) -> set[str]:
        """Parameter names that weight decay must skip (besides norms and biases): positions, prefix
        tokens, relative position tables (timm's ``relative_position_bias_table``)."""
        prefixes = ("pos_embed.", "cls_token", "dist_token", "reg_token")
        return {n for n, _ in self.named_parameters()
                if n.startswith(prefixes) or n.endswith("relative_position_bias_table")}

    def attn_pattern(self, grid: tuple[int, int], device, *, explicit: bool = False):
        """The local + global mask of ``attn_window`` at ``grid`` (None when dense): a flex ``BlockMask``
        where the backend allows it, a boolean (N, N) mask for the explicit path, a relative position
        bias, attention dropout in training or ``attn_backend='sdpa'``. Built once per grid and device."""
        if self.attn_window is None:
            return None
        from vitpipe.nn.patterns import local_global_mask

        dense = explicit or self.rel_pos_kind != "none" or (self.training and self.blocks[0].attn.attn_drop > 0)
        backend = "sdpa" if dense else self.attn_backend
        key = (tuple(grid), str(device), backend)
        if key not in self._patterns:
            self._patterns[key] = local_global_mask(tuple(grid), self.num_prefix_tokens, window=self.attn_window,
                                                    global_stride=self.attn_global_stride, backend=backend,
                                                    device=device)
        return self._patterns[key]

    def attn_biases(self, grid: tuple[int, int]) -> list[Tensor | None]:
        """Each block's relative position bias (1, heads, N, N) at ``grid``; None without one."""
        if self.rel_pos is not None:
            shared = self.rel_pos(grid)
            return [shared] * len(self.blocks)
        return [None if blk.rel_pos is None else blk.rel_pos(grid) for blk in self.blocks]

    def group_matcher(self, coarse: bool = False) -> dict:
        """Layer groups for timm's ``param_groups_layer_decay`` (``timm.models.group_parameters``):
        the stem (patch embedding, positions, prefix tokens) is layer 0, block i is layer i + 1, and
        what matches nothing (final norm, fc_norm, head) is the last layer, at the full lr.

        timm's VisionTransformer merges its final ``norm`` into the last block's group (decay^1);
        here it goes with the head, as in BEiT's ``get_num_layer_for_vit`` and MAE's ``lrd.py``.
        ``coarse`` is accepted for timm's signature; the grouping is the same.
        """
        return {"stem": r"^cls_token|^dist_token|^reg_token|^pos_embed|^patch_embed|^rel_pos|^norm_pre",
                "blocks": [(r"^blocks\.(\d+)", None)]}

    def get_classifier(self) -> nn.Module:
        """The head (timm's name for it): what a linear probe trains; everything else is the encoder.
        With a distillation token both heads (timm's VisionTransformerDistilled returns the pair)."""
        return self.head if self.head_dist is None else nn.ModuleList([self.head, self.head_dist])

    @property
    def rope_embed(self) -> RoPE2D | None:
        """The rotary positions the blocks apply: ``pos_embed='rope2d'`` or ``rope=True``; None without."""
        return self.pos_embed if isinstance(self.pos_embed, RoPE2D) else self.rope

    def _embed(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        x, grid = self.patch_embed(x, self._draw_patch_size())  # (B, h*w, dim): grid of this patch size
        tokens = (self.cls_token, self.dist_token, self.reg_token)
        prefix = [t.expand(x.shape[0], -1, -1) for t in tokens if t is not None]
        x = torch.cat([*prefix, x], dim=1)  # (B, P + h*w, dim)
        x = self.patch_drop(self.pos_drop(self.pos_embed(x, grid)))  # training: (B, P + kept, dim)
        return self.norm_pre(x), grid

    def _embed_naflex(self, batch: dict) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
        """Patch dict -> tokens (B, P + N, dim), key padding mask (B, P + N) (True = padding), rope phases."""
        patches, coord, valid = check_batch(batch, self.patch_embed.patch_dim)
        sizes = grid_sizes(coord, valid)  # (B, 2): each image's own grid
        x = self.patch_embed.embed_patches(patches)  # (B, N, dim)
        tokens = (self.cls_token, self.dist_token, self.reg_token)
        prefix = [t.expand(x.shape[0], -1, -1) for t in tokens if t is not None]
        x = torch.cat([*prefix, x], dim=1)  # (B, P + N, dim)
        x = self.norm_pre(self.pos_drop(self.pos_embed.forward_naflex(x, coord, sizes)))
        padding = torch.cat([valid.new_zeros(x.shape[0], self.num_prefix_tokens), ~valid], dim=1)  # (B, P + N)
        rope = self.rope_embed.phases_naflex(coord, sizes) if self.rope_embed is not None else None
        return x, padding, rope

    @property
    def merges_tokens(self) -> bool:
        """Whether a forward now merges tokens (ToMe): ``tome_r`` > 0 in eval mode."""
        return self.tome_r > 0 and not self.training

    def forward_features(self, x: Tensor | dict, *, return_attn: bool = False, return_logits: bool = False):
        """Tokens (B, P + h*w, dim) after the final norm; with ``return_attn`` also the list of
        ``depth`` attention tensors (B, heads, N, N) from the explicit path, for this call only;
        with ``return_logits`` the list of their pre-softmax logits instead (scaled q.k plus any bias).

        For a patch dict the tokens are (B, P + N, dim) in its order; padding tokens hold values
        that no valid token has seen (``forward_head`` takes ``patch_valid`` to pool without them).
        In training with ``patch_drop_rate`` the tokens are (B, P + kept, dim); in eval mode with
        ``tome_r`` (B, P + merged, dim) in merge order (``forward_merged`` gives their sizes too)."""
        if (return_attn or return_logits) and self.merges_tokens:
            raise ValueError(f"attention maps with tome_r={self.tome_r}: merged tokens change the token count per "
                             "layer; set_tome_r(0) (model.tome_r=0) for attention maps")
        x, attentions, _ = self._encode(x, return_attn=return_attn, return_logits=return_logits)
        return (x, attentions) if return_attn or return_logits else x

    def forward_merged(self, x: Tensor, *, trace_source: bool = False) -> tuple[Tensor, TokenMerger | None]:
        """Eval-mode ToMe forward: tokens (B, P + n, dim) after the final norm and the ``TokenMerger`` holding
        each token's size (B, P + n, 1) and, with ``trace_source``, its source map (B, P + n, P + h*w);
        None for the merger when no token is merged (training, or tome_r=0)."""
        x, _, merger = self._encode(x, trace_source=trace_source)
        return x, merger

    def _encode(self, x: Tensor | dict, *, return_attn: bool = False, return_logits: bool = False,
                trace_source: bool = False) -> tuple[Tensor, list, TokenMerger | None]:
        """(tokens after the final norm, the per-block attentions asked for, the ToMe merger or None)."""
        if isinstance(x, dict):
            if self.merges_tokens or (self.training and self.patch_drop_rate > 0):
                what = f"tome_r={self.tome_r}" if self.merges_tokens else f"patch_drop_rate={self.patch_drop_rate}"
                raise ValueError(f"{what} takes image tensors: a NaFlex patch dict's padding and coordinates do not "
                                 "survive dropped or merged tokens; use image batches, or set it to 0")
            if self.rel_pos_kind != "none" or self.attn_window is not None:
                what = f"rel_pos={self.rel_pos_kind!r}" if self.rel_pos_kind != "none" else "attn_window"
                raise ValueError(f"{what} takes image tensors; NaFlex patch dicts need rel_pos='none' and "
                                 "attn_window=null (absolute or rope2d positions, dense attention)")
            x, padding, rope = self._embed_naflex(x)
            biases, pattern = [None] * len(self.blocks), None
        else:
            x, grid = self._embed(x)
            padding = None
            rope = self.rope_embed.phases(grid, device=x.device) if self.rope_embed is not None else None
            biases = self.attn_biases(grid)
            pattern = self.attn_pattern(grid, x.device, explicit=return_attn or return_logits)
        attentions = []
        # ToMe: checked against rope, rel_pos, attn_window and patch dicts above, so no other bias or mask here
        merger = TokenMerger(x, self.tome_r, self.num_prefix_tokens, trace_source=trace_source) \
            if self.merges_tokens else None
        for blk, bias in zip(self.blocks, biases, strict=True):
            if merger is not None:
                x = blk(x, attn_bias=merger.attn_bias(), merge=merger)  # proportional attention, then merge
            elif return_attn or return_logits:
                x, w = blk(x, rope=rope, key_padding_mask=padding, attn_bias=bias, attn_mask=pattern,
                           need_weights=return_attn and not return_logits, need_logits=return_logits)
                attentions.append(w)
            elif self.grad_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(blk, x, rope=rope, key_padding_mask=padding, attn_bias=bias, attn_mask=pattern,
                               use_reentrant=False)
            else:
                x = blk(x, rope=rope, key_padding_mask=padding, attn_bias=bias, attn_mask=pattern)
        return self.norm(x), attentions, merger

    def forward_head(self, x: Tensor, *, pre_logits: bool = False, patch_valid: Tensor | None = None,
                     token_sizes: Tensor | None = None) -> Tensor:
        """Pooled tokens -> logits; ``patch_valid`` (B, N) restricts mean pooling to valid patches;
        ``token_sizes`` (B, N) weights it by the patches each token holds (ToMe's merged tokens)."""
        if self.pool == "cls":
            x = x[:, 0]  # (B, dim)
        elif self.pool == "map":
            if token_sizes is not None:
                raise ValueError("pool='map' with tome_r: attention pooling has no size weighting for merged tokens; "
                                 "set_tome_r(0)")
            bias = None if patch_valid is None else \
                torch.zeros_like(patch_valid, dtype=x.dtype).masked_fill(~patch_valid, float("-inf"))[:, None, None]
            if self.pool_include_prefix:  # the prefix tokens are keys too (timm's Eva); they are never padding
                bias = None if bias is None else F.pad(bias, (self.num_prefix_tokens, 0))
                x = self.attn_pool(x, attn_mask=bias)  # (B, dim); bias (B, 1, 1, P + N)
            else:
                x = self.attn_pool(x[:, self.num_prefix_tokens :], attn_mask=bias)  # (B, dim); bias (B, 1, 1, N)
        elif patch_valid is None and token_sizes is None:
            x = x[:, 0 if self.pool_include_prefix else self.num_prefix_tokens :].mean(dim=1)  # (B, dim)
        else:
            keep = (patch_valid if token_sizes is None else token_sizes).to(x.dtype)[..., None]  # (B, N, 1)
            P = self.num_prefix_tokens
            if self.pool_include_prefix:  # prefix tokens count once each
                keep, P = torch.cat([keep.new_ones(keep.shape[0], P, 1), keep], dim=1), 0  # (B, P + N, 1)
            x = (x[:, P:] * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1)  # (B, dim)
        x = self.head_drop(self.fc_norm(x))
        return x if pre_logits else self.head(x)

    def forward_heads(self, x: Tensor | dict) -> tuple[Tensor, Tensor]:
        """DeiT training: (class-token logits, distillation-token logits), each (B, num_classes).
        Without a distillation token both are the one head's logits."""
        tokens, _, merger = self._encode(x)
        sizes = None if merger is None else merger.size[:, self.num_prefix_tokens :, 0]  # (B, n) patches per token
        logits = self.forward_head(tokens, patch_valid=x["patch_valid"] if isinstance(x, dict) else None,
                                   token_sizes=sizes)
        if self.dist_token is None:
            return logits, logits
        return logits, self.head_dist(self.head_drop(tokens[:, 1]))  # token 1: right after the class token

    def forward(self, x: Tensor | dict) -> Tensor:
        if self.dist_token is None:
            return self.forward_heads(x)[0]  # checks a patch dict before its patch_valid is read
        cls_logits, dist_logits = self.forward_heads(x)
        return (cls_logits + dist_logits) / 2  # DeiT at test time: the two heads averaged

    def reset_classifier(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.head = nn.Linear(self.dim, num_classes) if num_classes > 0 else nn.Identity()
        if self.dist_token is not None:
            self.head_dist = nn.Linear(self.dim, num_classes) if num_classes > 0 else nn.Identity()

