"""A transformers ViTModel's inference pass through xattn's kernel: every layer in one call per batch.

The final layer norm and the patch embeddings stay transformers' own modules (but for the patch projection's product
where the layers run on AMX tiles: there it runs on the tiles too); the layers run in
xattn_kernels::encoder_layers (kernels/encoder.cpp) with int8 (fbgemm, as weights="int8" runs them elsewhere),
bfloat16 (xattn's own products and attention on AMX tiles where the CPU has AMX-BF16, each image's rows computed
independently of the batch's others, else torch's products, which oneDNN runs on AVX-512 BF16, and torch's flash
attention) or fp32 projections, their intermediate results in a workspace kept between calls: on these machines the
page faults of torch's fresh output tensors cost a quarter of a batch's encoder time. Outputs differ from
transformers' by rounding (fp32), by the bfloat16 products' rounding or by the int8 products' error.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from . import kernels, torch_ops
from .torch_ops import prepack_int8

# a layer's projections, in the kernel's order, under transformers 5.x's names and 4.x's
_PROJECTIONS = {
    "5": (("attention.q_proj", "attention.k_proj", "attention.v_proj"), "attention.o_proj", "mlp.fc1", "mlp.fc2"),
    "4": (("attention.attention.query", "attention.attention.key", "attention.attention.value"),
          "attention.output.dense", "intermediate.dense", "output.dense"),
}
KINDS = ("packed", "bf16", "int8")


def supports(encoder: nn.Module, kind: str) -> bool:
    """Whether ViTEncoder can run this encoder in this weight format."""
    config = getattr(encoder, "config", None)
    if kind == "int8" and not torch_ops.fbgemm_available():  # the kernel calls fbgemm's packed products
        return False
    return (kind in KINDS and kernels.available() and type(encoder).__name__ == "ViTModel"
            and getattr(config, "hidden_act", None) == "gelu" and _naming(_layers(encoder)[0]) is not None)


def _layers(encoder: nn.Module):
    return encoder.layers if hasattr(encoder, "layers") else encoder.encoder.layer


def _naming(layer: nn.Module) -> str | None:
    names = dict(layer.named_modules())
    for version, (qkv, *rest) in _PROJECTIONS.items():
        if all(name in names for name in (*qkv, *rest)):
            return version
    return None


class ViTEncoder(nn.Module):
    """Stands in for a ViTModel at inference: `encoder(pixel_values)[0]` is its last_hidden_state [B, S, D]."""

    def __init__(self, vit: nn.Module, kind: str, tiles: bool | None = None):
        """tiles: bf16's products on xattn's AMX tiles (None: where the CPU has AMX-BF16 and the widths fit the
        tiles; False: oneDNN's)."""
        super().__init__()
        if not supports(vit, kind):
            raise ValueError(f"ViTEncoder runs a transformers ViTModel with GELU in formats {KINDS} (with xattn's "
                             f"kernels built); got {type(vit).__name__}, weights={kind!r}")
        self.config, self.kind = vit.config, kind
        width, inner = vit.config.hidden_size, vit.config.intermediate_size
        fits = kind == "bf16" and kernels.amx_bf16() and width % 32 == 0 and inner % 32 == 0
        if tiles and not fits:
            raise ValueError("tiles=True needs weights='bf16', a CPU with AMX-BF16 and widths that are multiples of 32")
        self.tiles = fits if tiles is None else tiles
        self.embeddings, self.layernorm = vit.embeddings, vit.layernorm
        layers = _layers(vit)
        qkv_names, *rest = _PROJECTIONS[_naming(layers[0])]
        # fp32 or bfloat16 weights with fp32 biases, or fbgemm's int8 ones
        self._weights, self._biases, self._packed = [], [], []
        for layer in layers:
            modules = dict(layer.named_modules())
            qkv = [modules[name] for name in qkv_names]
            projections = [(torch.cat([m.weight for m in qkv]), _cat_biases(qkv))]
            projections += [(modules[name].weight, _cat_biases([modules[name]])) for name in rest]
            for weight, bias in projections:
                weight, bias = weight.detach().float().clone(), bias.detach().float().clone()
                if kind == "int8":  # one quantization per output row, so the fused qkv equals three separate ones
                    self._packed.append(prepack_int8(weight, bias)[1])
                else:
                    if kind == "bf16":
                        weight = weight.to(torch.bfloat16)
                        weight = kernels.bf16_tiles(weight) if self.tiles else weight
                    self._weights.append(weight)
                    self._biases.append(bias)
        norms = [(layer.layernorm_before, layer.layernorm_after) for layer in layers]
        self._norm_weight = torch.stack([torch.stack([a.weight, b.weight]) for a, b in norms]).detach().float()
        self._norm_bias = torch.stack([torch.stack([a.bias, b.bias]) for a, b in norms]).detach().float()
        self._eps = norms[0][0].eps
        self._patch_tiles, self._patch_bias = self._tile_patches(vit.embeddings.patch_embeddings.projection)
        self._heads = vit.config.num_attention_heads
        self._inner = projections[2][0].shape[0]
        self._workspace: list[torch.Tensor] = []
        self._lock = threading.Lock()

    @property
    def rows_independent(self) -> bool:
        """Each image's rows computed as they are alone, whatever the batch (the tiles): what in-flight serving
        encodes together."""
        return self.tiles

    @torch.no_grad()
    def forward(self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool = False,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor]:
        if attention_mask is not None:
            raise ValueError("xattn's ViT kernel attends over every patch: pass no attention_mask, or use "
                             "encoder_weights=None to run transformers' own ViT")
        pixel_values = pixel_values.to(self.embeddings.patch_embeddings.projection.weight.dtype)
        hidden = self._embed(pixel_values, interpolate_pos_encoding).float().contiguous()
        with self._lock:  # one workspace: a concurrent call waits rather than double the memory
            kernels.encoder_layers(hidden, self._norm_weight, self._norm_bias, self._weights, self._biases,
                                   self._packed, self._heads, self._eps, self._workspace_for(hidden))
        return (self.layernorm(hidden),)

    def _tile_patches(self, conv: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The patch projection's weight as AMX tiles and its fp32 bias, where the layers run on the tiles and the
        projection is a plain patch-by-patch product (stride = kernel, no padding) of a width the tiles take."""
        weight = conv.weight.detach()
        plain = (isinstance(conv, nn.Conv2d) and conv.stride == conv.kernel_size and conv.padding == (0, 0)
                 and conv.dilation == (1, 1) and conv.groups == 1)
        if not (self.tiles and plain and weight[0].numel() % 32 == 0 and weight.shape[0] % 16 == 0):
            return None, None
        bias = conv.bias.detach().float().clone() if conv.bias is not None else torch.zeros(weight.shape[0])
        return kernels.bf16_tiles(weight.reshape(weight.shape[0], -1).to(torch.bfloat16)), bias

    def _embed(self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool) -> torch.Tensor:
        """transformers' embeddings (patches, [CLS], positions), with the patch projection on the tiles where it
        runs there: its pixels and weights rounded to bfloat16 as every other product's inputs are, each image's rows
        its own. Other sizes, interpolated positions: transformers' module (and its errors)."""
        patching = self.embeddings.patch_embeddings
        (p, q), (height, width) = patching.patch_size, patching.image_size
        b, c, h, w = pixel_values.shape
        if (self._patch_tiles is None or interpolate_pos_encoding or (c, h, w) != (patching.num_channels, height, width)
                or h % p or w % q):
            return self.embeddings(pixel_values, interpolate_pos_encoding=interpolate_pos_encoding)
        # [B, C, H, W] -> rows of patches [B * (H / p) * (W / q), C * p * q], in the conv weight's (c, i, j) order
        patches = torch.empty(b, h // p, w // q, c, p, q, dtype=torch.bfloat16)
        patches.copy_(pixel_values.view(b, c, h // p, p, w // q, q).permute(0, 2, 4, 1, 3, 5))
        projected = kernels.tile_linear(patches.view(-1, c * p * q), self._patch_tiles, self._patch_bias)
        cls = self.embeddings.cls_token.expand(b, -1, -1)
        return torch.cat((cls, projected.view(b, -1, projected.shape[-1])), dim=1) + self.embeddings.position_embeddings

    def _workspace_for(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """x, qkv, ctx, tmp [M, D or 3D] and ff [M, F] for M = B * S rows, kept for the next batch of this size;
        bf16: the products' bfloat16 inputs and outputs [M, D] and their wide results [M, max(3D, F)]."""
        rows, width = hidden.shape[0] * hidden.shape[1], hidden.shape[2]
        if not self._workspace or self._workspace[0].shape[0] != rows:
            self._workspace = []  # the old one freed first
            if self.kind == "bf16":
                self._workspace = [torch.empty(rows, n, dtype=torch.bfloat16)
                                   for n in (width, width, max(3 * width, self._inner))]
            else:
                self._workspace = [torch.empty(rows, n) for n in (width, 3 * width, width, width, self._inner)]
        return self._workspace

    def extra_repr(self) -> str:
        return f"layers={self._norm_weight.shape[0]}, heads={self._heads}, weights={self.kind}"


def _cat_biases(modules: list[nn.Linear]) -> torch.Tensor:
    return torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features) for m in modules])
