"""xattn: a static cross-attention cache and a fast generation engine for GPT-2 decoders that
cross-attend to an encoder (image captioning, speech transcription, Tortoise-style TTS)."""

from .cache import CrossAttentionCache
from .decoder import GPT2CrossAttentionDecoder
from .generate import GenerationOptions
from .hf import XattnModel, from_hf, load

__version__ = "0.1.0"
__all__ = ["CrossAttentionCache", "GPT2CrossAttentionDecoder", "GenerationOptions", "XattnModel", "from_hf", "load"]
