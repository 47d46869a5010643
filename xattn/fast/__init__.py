"""The fast paths: weight formats for the decoder's projections, the fused decode step, the int8-screened greedy
head, the ViT encoder kernel, and xattn's C++ kernels with their build. The core (cache, decoder, generate) never
imports this package; it is entered through `accelerate` (a decoder) and `accelerate_encoder` (an encoder)."""
