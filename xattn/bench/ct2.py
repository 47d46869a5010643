"""CTranslate2 on the same work per decode step.

CTranslate2 cannot run GPT-2 with cross-attention, so the comparison model is a Whisper-shaped one with the
benchmark decoder's dimensions (12 layers x 768, 12 heads, MLP 3072, vocabulary 50257: self-attention,
cross-attention over the same number of encoder positions, MLP, LM head per step), random weights, built
with transformers and converted by CTranslate2's own converter.

CTranslate2's Whisper decoding looks its special tokens up by name in the vocabulary, and its converter writes
a dummy one, so the names are placed on ids of their own. The number of steps is counted from what it returns
(its max_length does not map one to one onto generated tokens), and blank/token suppression is off so that
every step is a plain step.
"""

from __future__ import annotations

import json
import os

import numpy as np

SPECIAL_TOKENS = ("<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>", "<|translate|>", "<|transcribe|>",
                  "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|nospeech|>")
VOCAB = 50257
MELS = 80


def available() -> bool:
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        return False
    return True


def version() -> str | None:
    try:
        import ctranslate2
    except ImportError:
        return None
    return ctranslate2.__version__


def build_whisper_like(directory: str, encoder_positions: int = 197, hidden: int = 768, layers: int = 12,
                       heads: int = 12, ffn: int = 3072, seed: int = 0) -> str:
    """Write a converted CTranslate2 model with those decoder dimensions into directory (returned)."""
    import torch
    from ctranslate2.converters import TransformersConverter
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=VOCAB, d_model=hidden, encoder_layers=1, encoder_attention_heads=heads, encoder_ffn_dim=ffn,
        decoder_layers=layers, decoder_attention_heads=heads, decoder_ffn_dim=ffn, num_mel_bins=MELS,
        max_source_positions=encoder_positions, max_target_positions=448, suppress_tokens=[],
        begin_suppress_tokens=[], decoder_start_token_id=1, eos_token_id=0, pad_token_id=0, bos_token_id=0,
    )
    torch.manual_seed(seed)
    hf_dir = directory + "-transformers"
    WhisperForConditionalGeneration(config).eval().save_pretrained(hf_dir)
    TransformersConverter(hf_dir).convert(directory, force=True)
    vocabulary = [f"<|token{i}|>" for i in range(VOCAB)]
    vocabulary[: len(SPECIAL_TOKENS)] = SPECIAL_TOKENS
    with open(os.path.join(directory, "vocabulary.json"), "w") as f:
        json.dump(vocabulary, f)
    return directory


class CT2Decoder:
    """A converted Whisper-shaped model: encode random features once, then time decoding."""

    def __init__(self, directory: str, compute_type: str, threads: int, encoder_positions: int = 197):
        import ctranslate2
        import torch

        torch_threads = torch.get_num_threads()
        self.model = ctranslate2.models.Whisper(directory, device="cpu", intra_threads=threads,
                                                compute_type=compute_type)
        torch.set_num_threads(torch_threads)  # CTranslate2 sets the OpenMP thread count it shares with torch
        self.frames = 2 * encoder_positions  # Whisper's encoder halves the frame rate

    def encode(self, batch: int, seed: int = 0):
        import ctranslate2

        features = np.random.RandomState(seed).randn(batch, MELS, self.frames).astype(np.float32)
        return self.model.encode(ctranslate2.StorageView.from_array(features))

    def generate(self, encoded, batch: int, beams: int, max_length: int) -> int:
        """Decode; returns the number of tokens generated (the longest row)."""
        start = [[SPECIAL_TOKENS.index("<|startoftranscript|>"), SPECIAL_TOKENS.index("<|notimestamps|>")]]
        results = self.model.generate(encoded, start * batch, beam_size=beams, max_length=max_length,
                                      suppress_blank=False, suppress_tokens=[])
        return max(len(r.sequences_ids[0]) for r in results)
