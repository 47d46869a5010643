"""The transformers boundary: wrapping transformers models (`from_hf`), loading checkpoints without running their
code (`load`, xattn.hf.loading; hub ids: xattn.hf.hub), and transformers-style generate() arguments."""

from .loading import load
from .model import GenerateOutput, XattnModel, from_hf

__all__ = ["GenerateOutput", "XattnModel", "from_hf", "load"]
