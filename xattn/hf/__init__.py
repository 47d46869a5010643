"""The transformers boundary: wrapping transformers models (`from_hf`), loading checkpoints without running their
code (`load`, xattn.hf.loading), and transformers-style generate() arguments."""

from .model import GenerateOutput, XattnModel, from_hf, load

__all__ = ["GenerateOutput", "XattnModel", "from_hf", "load"]
