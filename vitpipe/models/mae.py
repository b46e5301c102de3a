"""Masked Autoencoders (He et al. 2022, "Masked Autoencoders Are Scalable Vision Learners").

Structure and names of facebookresearch/mae ``models_mae.py``: the encoder sees only the visible
patches (a random ``1 - mask_ratio`` subset, gathered, no attention mask), a light decoder fills
the masked positions with a shared mask token and predicts their pixels, the loss is the MSE on
the masked patches only. Masking is a pure argsort of a noise tensor, so a step is reproducible
from its noise.

The encoder is vitpipe's ViT machinery (patch stem, EncoderBlock, every ``pos_embed`` kind,
class/register tokens), registered at the top level so the state dict reads like the
reference's: ``patch_embed.*``, ``cls_token``, ``pos_embed*``, ``blocks.N.*``, ``norm.*``,
``decoder_embed.*``, ``mask_token``, ``decoder_pos_embed``, ``decoder_blocks.N.*``,
``decoder_norm.*``, ``decoder_pred.*``. ``encoder_kwargs()`` gives the matching classifier
(``ViT(**mae.encoder_kwargs(), num_classes=...)``), and ``weights.load_pretrained`` loads
the encoder part of an MAE checkpoint into it.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from torch import Tensor, nn

from vitpipe.errors import ConfigError
from vitpipe.models.variants import DEFAULT_DECODER, VARIANTS
from vitpipe.models.vit import ViT
from vitpipe.nn.blocks import EncoderBlock
from vitpipe.nn.pos_embed import RoPE2D, sincos_2d

log = logging.getLogger(__name__)

class MaskedAutoencoderViT(nn.Module):
    """``forward(imgs, mask_ratio=0.75, noise=None) -> (loss, pred (B, L, p*q*C), mask (B, L), 1 = masked)``."""

    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=1024, depth=24, num_heads=16,
                 decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16, mlp_ratio=4.0,
                 norm_pix_loss=False, *, pos_embed: str = "sincos2d", class_token: bool = True,
                 pool: str = "cls", reg_tokens: int = 0, drop_path_rate: float = 0.0) -> None:
        super().__init__()
        # --- encoder: vitpipe's ViT parts, registered here so the names are the reference's
        kwargs = dict(img_size=img_size, patch_size=patch_size, in_chans=in_chans, dim=embed_dim, depth=depth,
                      num_heads=num_heads, mlp_ratio=mlp_ratio, pos_embed=pos_embed, class_token=class_token,
                      reg_tokens=reg_tokens, pool=pool)
        vit = ViT(num_classes=0, drop_path_rate=drop_path_rate, **kwargs)
        self._encoder_kwargs = {**kwargs, "img_size": vit.img_size, "patch_size": vit.patch_size}
        self.patch_embed = vit.patch_embed
        self.img_size, self.patch_size, self.grid_size = vit.img_size, vit.patch_size, vit.grid_size
        self.in_chans, self.embed_dim = in_chans, embed_dim
        self.num_prefix_tokens = vit.num_prefix_tokens
        self.cls_token, self.reg_token = vit.cls_token, vit.reg_token
        self.pos_embed = vit.pos_embed
        self.blocks = vit.blocks
        # the reference always normalises the encoder output (a mean-pool ViT moves its norm after pooling)
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)

        # --- decoder
        h, w = self.grid_size
        P, p, q = self.num_prefix_tokens, *self.patch_size
        self.decoder_embed = nn.Linear(embed_dim, decoder_embed_dim, bias=True)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        # fixed 2D sin-cos, zero rows for the prefix tokens; a buffer in the state dict, as the reference stores it
        table = torch.cat([torch.zeros(P, decoder_embed_dim), sincos_2d(h, w, decoder_embed_dim)])
        self.register_buffer("decoder_pos_embed", table[None], persistent=True)  # (1, P + L, decoder_embed_dim)
        self.decoder_blocks = nn.ModuleList(
            EncoderBlock(decoder_embed_dim, decoder_num_heads, mlp_ratio=mlp_ratio, qkv_bias=True)
            for _ in range(decoder_depth)
        )
        self.decoder_norm = nn.LayerNorm(decoder_embed_dim, eps=1e-6)
        self.decoder_pred = nn.Linear(decoder_embed_dim, p * q * in_chans, bias=True)  # decoder to patch pixels
        self.norm_pix_loss = norm_pix_loss
        self.initialize_weights()

    def initialize_weights(self) -> None:
        # the reference's init: xavier_uniform linears (official JAX ViT), unit LayerNorms, the patch conv as
        # a linear on its flattened view, tokens normal(.02); learned position tables keep vitpipe's init
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        conv = self.patch_embed.proj
        if isinstance(conv, nn.Conv2d):
            nn.init.xavier_uniform_(conv.weight.data.view(conv.weight.shape[0], -1))
        for t in (self.cls_token, self.reg_token, self.mask_token):
            if t is not None:
                nn.init.normal_(t, std=0.02)

    def encoder_kwargs(self) -> dict:
        """``ViT`` kwargs of the classifier whose encoder is this one (add ``num_classes``)."""
        return dict(self._encoder_kwargs)

    def no_weight_decay(self) -> set[str]:
        """Parameter names that weight decay must skip (besides norms and biases): tokens and positions."""
        prefixes = ("pos_embed.", "cls_token", "reg_token", "mask_token")
        return {n for n, _ in self.named_parameters() if n.startswith(prefixes)}

    # --- pixels <-> patches (the reference's order: nchpwq -> nhwpqc)
    def patchify(self, imgs: Tensor) -> Tensor:
        """imgs (B, C, H, W) -> (B, L, p*q*C), each patch row-major over its pixels, channels last."""
        (p, q), C = self.patch_size, self.in_chans
        B, c, H, W = imgs.shape
        if c != C or H % p or W % q:
            raise ValueError(f"patchify needs images (B, {C}, H, W) with H % {p} == 0 and W % {q} == 0, "
                             f"got shape {tuple(imgs.shape)}")
        h, w = H // p, W // q
        x = imgs.reshape(B, C, h, p, w, q)
        x = torch.einsum("nchpwq->nhwpqc", x)
        return x.reshape(B, h * w, p * q * C)

    def unpatchify(self, x: Tensor, grid_size: tuple[int, int] | None = None) -> Tensor:
        """(B, L, p*q*C) -> imgs (B, C, h*p, w*q); the grid is the build grid unless given."""
        (p, q), C = self.patch_size, self.in_chans
        h, w = grid_size or self.grid_size
        if x.shape[1] != h * w or x.shape[2] != p * q * C:
            raise ValueError(f"unpatchify expected (B, {h * w}, {p * q * C}) for a {h}x{w} grid, got {tuple(x.shape)}")
        x = x.reshape(x.shape[0], h, w, p, q, C)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(x.shape[0], C, h * p, w * q)

    # --- masking
    def random_masking(self, x: Tensor, mask_ratio: float, noise: Tensor | None = None):
        """Per-sample random masking by argsort of noise (B, L): the smallest ``int(L * (1 - mask_ratio))`` are kept.

        x (B, L, D) -> (x_masked (B, keep, D), mask (B, L) with 0 kept / 1 masked, ids_restore (B, L)).
        """
        B, L, D = x.shape
        if not 0.0 <= mask_ratio < 1.0:
            raise ValueError(f"mask_ratio={mask_ratio!r}: expected 0 <= mask_ratio < 1")
        len_keep = int(L * (1 - mask_ratio))
        if noise is None:
            noise = torch.rand(B, L, device=x.device)  # in [0, 1)
        elif tuple(noise.shape) != (B, L):
            raise ValueError(f"noise has shape {tuple(noise.shape)}; expected (batch, patches) = ({B}, {L})")
        ids_shuffle = torch.argsort(noise.to(x.device), dim=1)  # ascending: small is kept, large is removed
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        ids_keep = ids_shuffle[:, :len_keep]
        x_masked = torch.gather(x, 1, ids_keep.unsqueeze(-1).expand(-1, -1, D))
        mask = torch.ones(B, L, device=x.device)
        mask[:, :len_keep] = 0
        mask = torch.gather(mask, 1, ids_restore)  # unshuffle: mask[b, l] = 1 where patch l is removed
        return x_masked, mask, ids_restore

    def forward_encoder(self, imgs: Tensor, mask_ratio: float, noise: Tensor | None = None):
        """-> (latent (B, P + keep, D) after the norm, mask (B, L), ids_restore (B, L))."""
        x, grid = self.patch_embed(imgs)  # (B, L, D)
        B = x.shape[0]
        P = self.num_prefix_tokens
        prefix = [t.expand(B, -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        # positions go on before masking, so each kept token carries its own (prefix tokens their rows)
        x = self.pos_embed(torch.cat([*prefix, x], dim=1), grid)
        patches, mask, ids_restore = self.random_masking(x[:, P:], mask_ratio, noise)
        x = torch.cat([x[:, :P], patches], dim=1)  # (B, P + keep, D)
        rope = None
        if isinstance(self.pos_embed, RoPE2D):  # rotary: the phases of the kept tokens, per sample
            keep = patches.shape[1]
            ids_keep = torch.argsort(ids_restore, dim=1)[:, :keep]  # = ids_shuffle[:, :keep]
            index = torch.cat([torch.arange(P, device=x.device).expand(B, P), P + ids_keep], dim=1)
            rope = tuple(t[index].unsqueeze(1) for t in self.pos_embed.phases(grid, device=x.device))  # (B, 1, N, hd)
        for blk in self.blocks:
            x = blk(x, rope=rope)
        return self.norm(x), mask, ids_restore

    def forward_decoder(self, latent: Tensor, ids_restore: Tensor) -> Tensor:
        """latent (B, P + keep, D), ids_restore (B, L) -> pred (B, L, p*q*C)."""
        P = self.num_prefix_tokens
        x = self.decoder_embed(latent)
        B, N, Dd = x.shape
        L = ids_restore.shape[1]
        if self.decoder_pos_embed.shape[1] != P + L:
            raise ValueError(f"the decoder's positions are for {self.decoder_pos_embed.shape[1] - P} patches "
                             f"(grid {self.grid_size[0]}x{self.grid_size[1]}); got {L}: pre-train at img_size")
        mask_tokens = self.mask_token.expand(B, P + L - N, -1)
        x_ = torch.cat([x[:, P:], mask_tokens], dim=1)  # visible tokens, then mask tokens (no prefix)
        x_ = torch.gather(x_, 1, ids_restore.unsqueeze(-1).expand(-1, -1, Dd))  # unshuffle to patch order
        x = torch.cat([x[:, :P], x_], dim=1) + self.decoder_pos_embed.to(x.dtype)
        for blk in self.decoder_blocks:
            x = blk(x)
        x = self.decoder_pred(self.decoder_norm(x))
        return x[:, P:]  # drop the prefix tokens

    def forward_loss(self, imgs: Tensor, pred: Tensor, mask: Tensor) -> Tensor:
        """Mean squared error per patch, averaged over the masked patches only."""
        target = self.patchify(imgs)
        if self.norm_pix_loss:  # each target patch normalised by its own mean and (unbiased) variance
            mean = target.mean(dim=-1, keepdim=True)
            var = target.var(dim=-1, keepdim=True)
            target = (target - mean) / (var + 1.0e-6) ** 0.5
        loss = ((pred - target) ** 2).mean(dim=-1)  # (B, L)
        return (loss * mask).sum() / mask.sum()

    def forward(self, imgs: Tensor, mask_ratio: float = 0.75, noise: Tensor | None = None):
        latent, mask, ids_restore = self.forward_encoder(imgs, mask_ratio, noise)
        pred = self.forward_decoder(latent, ids_restore)  # (B, L, p*q*C)
        loss = self.forward_loss(imgs, pred, mask)
        return loss, pred, mask


def _depth(sd: dict[str, Tensor], prefix: str) -> int:
    found = {int(m.group(1)) for k in sd if (m := re.match(rf"{prefix}\.(\d+)\.", k))}
    return max(found) + 1 if found else 0


def official_kwargs(sd: dict[str, Tensor], img_size=None) -> dict:
    """``MaskedAutoencoderViT`` kwargs read from the shapes of a facebookresearch/mae state dict.

    Heads are not in the shapes: the encoder's are those of the ViT variant with its width and depth
    (ViT-H/14: 16 heads of 80), else embed_dim // 64; the decoder's 16, as in every released model.
    ``img_size`` (for a non-square table) replaces the square grid read from ``pos_embed``.
    """
    D, C, p, q = sd["patch_embed.proj.weight"].shape
    depth = _depth(sd, "blocks")
    if img_size is None:
        n = sd["pos_embed"].shape[1] - int("cls_token" in sd)
        side = int(round(n**0.5))
        if side * side != n:
            raise ConfigError(f"official MAE pos_embed holds {n} patch rows, not a square grid; "
                              "pass img_size=(height, width)")
        img_size = (side * p, side * q)
    heads = [v["num_heads"] for v in VARIANTS.values() if (v["dim"], v["depth"]) == (D, depth)]
    kw = dict(img_size=img_size, patch_size=(p, q), in_chans=C, embed_dim=D, depth=depth,
              num_heads=heads[0] if heads else max(D // 64, 1), mlp_ratio=sd["blocks.0.mlp.fc1.weight"].shape[0] / D,
              pos_embed="learned", class_token="cls_token" in sd, pool="cls" if "cls_token" in sd else "mean")
    if "decoder_embed.weight" in sd:
        kw.update(decoder_embed_dim=sd["decoder_embed.weight"].shape[0], decoder_depth=_depth(sd, "decoder_blocks"),
                  decoder_num_heads=DEFAULT_DECODER["decoder_num_heads"])
    return kw


def load_official(path: str | Path, **overrides) -> MaskedAutoencoderViT:
    """A facebookresearch/mae checkpoint (``{"model": state_dict}``) as a ``MaskedAutoencoderViT``.

    ``mae_pretrain_vit_*.pth`` hold the encoder only (the decoder is built fresh, and logged);
    the ``*_full`` files add the decoder. Sizes are read from the shapes (``official_kwargs``).
    The stored ``pos_embed`` (1, 1 + L, D) is the reference's fixed sin-cos table (its own layout:
    sin block then cos block, column half first): it is loaded as stored into a frozen
    ``pos_embed="learned"`` table (``requires_grad=False``, as in the reference), so the classifier
    it transfers to fine-tunes it, as MAE's fine-tuning does. ``overrides``: any constructor
    argument (``norm_pix_loss``, heads, a fresh decoder's sizes, ...). Any key left missing or
    unexpected, or of another shape, raises one ConfigError line naming them.
    """
    from vitpipe.models.weights import MAE_DECODER_PREFIXES, mismatch_summary, read_state_dict

    sd = read_state_dict(path)
    name = Path(path).name
    needed = ("patch_embed.proj.weight", "pos_embed", "blocks.0.mlp.fc1.weight")
    if not all(k in sd for k in needed):
        absent = ", ".join(k for k in needed if k not in sd)
        raise ConfigError(f"{name!r} is not a facebookresearch/mae checkpoint: it has no {absent}")
    kwargs = {**DEFAULT_DECODER, **official_kwargs(sd, overrides.get("img_size")), **overrides}
    model = MaskedAutoencoderViT(**kwargs)
    sd = {("pos_embed.weight" if k == "pos_embed" else k): v for k, v in sd.items()}
    own = model.state_dict()
    encoder_only = not any(k.startswith(MAE_DECODER_PREFIXES) for k in sd)
    wrong = {k: (sd[k].shape, v.shape) for k, v in own.items() if k in sd and sd[k].shape != v.shape}
    missing = [k for k in own if k not in sd and not (encoder_only and k.startswith(MAE_DECODER_PREFIXES))]
    unexpected = [k for k in sd if k not in own]
    if wrong or missing or unexpected:
        raise ConfigError(f"official MAE weights {name!r} do not fit MaskedAutoencoderViT"
                          f"({', '.join(f'{k}={v!r}' for k, v in overrides.items())}): "
                          f"{mismatch_summary(wrong, missing, unexpected, 'file')}")
    model.load_state_dict(sd, strict=not encoder_only)
    if isinstance(getattr(model.pos_embed, "weight", None), nn.Parameter):
        model.pos_embed.weight.requires_grad_(False)  # the reference's fixed sin-cos table
    if encoder_only:
        log.info("load_official: %s holds the encoder only; the decoder (%d wide, %d deep, %d heads) is freshly "
                 "initialised", name, kwargs["decoder_embed_dim"], kwargs["decoder_depth"], kwargs["decoder_num_heads"])
    return model
