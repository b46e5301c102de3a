"""The MAE paper's reference forward (He et al. 2022, "Masked Autoencoders Are Scalable Vision Learners"),
written as facebookresearch/mae's ``models_mae.py`` writes it: timm's ``PatchEmbed`` and ``Block``, one
fixed position table added before masking, a gather of the kept tokens, mask tokens unshuffled before
the decoder, MSE over the masked patches. Same parameter names, so an official checkpoint's
``{"model": state_dict}`` loads into it unchanged.

The one copy of it: tests/test_mae.py checks ``vitpipe.models.mae`` (and ``load_official``) against it,
and the benchmark's MAE comparison times it against vitpipe's step. It imports nothing from vitpipe on
purpose: a reference that shared vitpipe's code could not catch vitpipe's mistakes.

Departures from models_mae.py, each so that two implementations can be compared on the same draw:
``random_masking`` takes the ``noise`` it argsorts (the paper's code draws it inside; vitpipe's
``forward(imgs, mask_ratio, noise)`` takes it the same way); ``patchify`` reads the grid and channels
from the input (models_mae.py asserts a square 3-channel image; for one, the two are the same); the
weight initialisation is left out (parity loads weights, it never trains from scratch).
"""

from __future__ import annotations

from functools import partial

import torch
from timm.layers import PatchEmbed
from timm.models.vision_transformer import Block
from torch import nn


class ReferenceMAE(nn.Module):
    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=1024, depth=24, num_heads=16,
                 decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16, mlp_ratio=4.0,
                 norm_layer=partial(nn.LayerNorm, eps=1e-6), norm_pix_loss=False):  # noqa: B008 (as mae_vit_* pass it)
        super().__init__()
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        # fixed (the paper's 2D sin-cos table); filled from the weights loaded, including its class-token row
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim), requires_grad=False)
        self.blocks = nn.ModuleList(Block(embed_dim, num_heads, mlp_ratio, qkv_bias=True, norm_layer=norm_layer)
                                    for _ in range(depth))
        self.norm = norm_layer(embed_dim)

        self.decoder_embed = nn.Linear(embed_dim, decoder_embed_dim, bias=True)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        self.decoder_pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, decoder_embed_dim), requires_grad=False)
        self.decoder_blocks = nn.ModuleList(Block(decoder_embed_dim, decoder_num_heads, mlp_ratio, qkv_bias=True,
                                                  norm_layer=norm_layer) for _ in range(decoder_depth))
        self.decoder_norm = norm_layer(decoder_embed_dim)
        p, q = self.patch_embed.patch_size
        self.decoder_pred = nn.Linear(decoder_embed_dim, p * q * in_chans, bias=True)
        self.norm_pix_loss = norm_pix_loss

    @classmethod
    def from_vitpipe(cls, mae) -> ReferenceMAE:
        """The reference with the weights of a ``vitpipe.models.mae.MaskedAutoencoderViT`` (one position
        table, one class token): the same network written the paper's way. vitpipe keeps a fixed table as
        a function of the grid, so its values are copied in as the reference stores them: (1, 1 + L, dim)."""
        (h, w), (p, q) = mae.patch_embed.grid_size, mae.patch_embed.patch_size
        dim, enc = mae.cls_token.shape[-1], mae.encoder_kwargs()
        ref = cls(img_size=(h * p, w * q), patch_size=(p, q), in_chans=mae.patch_embed.proj.in_channels, embed_dim=dim,
                  depth=len(mae.blocks), num_heads=mae.blocks[0].attn.num_heads,
                  decoder_embed_dim=mae.decoder_embed.out_features, decoder_depth=len(mae.decoder_blocks),
                  decoder_num_heads=mae.decoder_blocks[0].attn.num_heads, mlp_ratio=enc.get("mlp_ratio", 4.0),
                  norm_pix_loss=mae.norm_pix_loss)
        with torch.no_grad():
            ref.pos_embed.copy_(mae.pos_embed(torch.zeros(1, 1 + h * w, dim), (h, w)))
        missing, unexpected = ref.load_state_dict(mae.state_dict(), strict=False)
        if not set(missing) <= {"pos_embed"} or unexpected:
            raise ValueError(f"the reference MAE does not fit this model: missing {missing}, unexpected {unexpected}")
        return ref

    def patchify(self, imgs):
        """(N, C, H, W) -> (N, L, p*q*C), patches row-major, each patch's pixels (row, col, channel) flattened."""
        n, c = imgs.shape[:2]
        (h, w), (p, q) = self.patch_embed.grid_size, self.patch_embed.patch_size
        x = imgs.reshape(n, c, h, p, w, q)
        x = torch.einsum("nchpwq->nhwpqc", x)
        return x.reshape(n, h * w, p * q * c)

    def random_masking(self, x, mask_ratio, noise):
        """Keep the ``int(L * (1 - mask_ratio))`` patches of smallest noise; mask: 0 kept, 1 removed."""
        N, L, D = x.shape  # (N, L, D)
        len_keep = int(L * (1 - mask_ratio))
        ids_shuffle = torch.argsort(noise, dim=1)  # ascend: small is keep, large is remove
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        ids_keep = ids_shuffle[:, :len_keep]
        x_masked = torch.gather(x, dim=1, index=ids_keep.unsqueeze(-1).repeat(1, 1, D))  # (N, keep, D)
        mask = torch.ones([N, L], device=x.device)
        mask[:, :len_keep] = 0
        mask = torch.gather(mask, dim=1, index=ids_restore)  # unshuffled: patch order
        return x_masked, mask, ids_restore

    def forward_encoder(self, x, mask_ratio, noise):
        x = self.patch_embed(x)
        x = x + self.pos_embed[:, 1:, :]  # positions before masking: each kept token keeps its own
        x, mask, ids_restore = self.random_masking(x, mask_ratio, noise)
        cls_token = self.cls_token + self.pos_embed[:, :1, :]
        x = torch.cat((cls_token.expand(x.shape[0], -1, -1), x), dim=1)  # (N, 1 + keep, D)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x), mask, ids_restore

    def forward_decoder(self, x, ids_restore):
        x = self.decoder_embed(x)
        mask_tokens = self.mask_token.repeat(x.shape[0], ids_restore.shape[1] + 1 - x.shape[1], 1)
        x_ = torch.cat([x[:, 1:, :], mask_tokens], dim=1)  # no class token
        x_ = torch.gather(x_, dim=1, index=ids_restore.unsqueeze(-1).repeat(1, 1, x.shape[2]))  # unshuffle
        x = torch.cat([x[:, :1, :], x_], dim=1)  # (N, 1 + L, Dd)
        x = x + self.decoder_pos_embed
        for blk in self.decoder_blocks:
            x = blk(x)
        x = self.decoder_pred(self.decoder_norm(x))
        return x[:, 1:, :]  # (N, L, p*q*C)

    def forward_loss(self, imgs, pred, mask):
        target = self.patchify(imgs)
        if self.norm_pix_loss:  # per-patch normalised pixels (the paper's better targets)
            mean = target.mean(dim=-1, keepdim=True)
            var = target.var(dim=-1, keepdim=True)
            target = (target - mean) / (var + 1.0e-6) ** 0.5
        loss = ((pred - target) ** 2).mean(dim=-1)  # (N, L), mean loss per patch
        return (loss * mask).sum() / mask.sum()  # mean loss on removed patches

    def forward(self, imgs, mask_ratio, noise):
        latent, mask, ids_restore = self.forward_encoder(imgs, mask_ratio, noise)
        pred = self.forward_decoder(latent, ids_restore)
        loss = self.forward_loss(imgs, pred, mask)
        return loss, pred, mask
