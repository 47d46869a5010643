"""xattn's own Tortoise-style TTS: text and a voice -> a small BERT text encoder -> GPT-2 with cross-attention
over the text -> audio codes (xattn.codes) -> waveform. A standard transformers `EncoderDecoderModel` plus a
codebook, decoded by the xattn engine: sampling, N candidates from one prefill, streaming."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import numpy as np
import torch

from . import SHIPPED_MODELS
from .audio_codes import SAMPLE_RATE, Codebook, log_mel

ALPHABET = "abcdefghijklmnopqrstuvwxyz '"
MAX_TEXT = 120  # characters; the decoder's positions bound the audio length too
DEFAULT_MODEL = os.path.join(SHIPPED_MODELS, "speaker")


def text_tokenizer(voices: list[str]):
    """One token per character of ALPHABET, a token per voice (`<name>`), <pad>/<unk>; a transformers fast
    tokenizer."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>"] + [f"<{v}>" for v in voices]
    vocab = {token: i for i, token in enumerate(specials + list(ALPHABET))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>",
                                   additional_special_tokens=specials[2:])


def new_speaker(tokenizer, codebook_size: int, max_codes: int = 400):
    """EncoderDecoderModel: BERT (hidden 192, 3 layers) over characters + GPT-2 (hidden 192, 4 layers) with
    cross-attention over audio codes. Code ids: 0..K-1 the codebook, K start, K+1 stop, K+2 pad."""
    from transformers import BertConfig, EncoderDecoderConfig, EncoderDecoderModel, GPT2Config

    start, stop, pad = codebook_size, codebook_size + 1, codebook_size + 2
    encoder = BertConfig(vocab_size=len(tokenizer), hidden_size=192, num_hidden_layers=3, num_attention_heads=4,
                         intermediate_size=384, max_position_embeddings=MAX_TEXT + 8,
                         pad_token_id=tokenizer.pad_token_id)
    decoder = GPT2Config(vocab_size=codebook_size + 3, n_positions=max_codes + 2, n_embd=192, n_layer=4, n_head=4,
                         add_cross_attention=True, is_decoder=True, bos_token_id=start, eos_token_id=stop,
                         pad_token_id=pad)
    config = EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.eos_token_id, config.pad_token_id = start, stop, pad
    model = EncoderDecoderModel(config)
    model.generation_config.update(decoder_start_token_id=start, bos_token_id=start, eos_token_id=stop,
                                   pad_token_id=pad, max_new_tokens=max_codes, do_sample=True, top_k=0,
                                   top_p=0.9, temperature=0.7)
    return model


def tts_prompt(voice: str, text: str) -> str:
    """What the text encoder reads, in training and in speaking alike: the voice token, then the text."""
    return f"<{voice}>{check_text(text)}"


def check_text(text: str) -> str:
    """Lower-cased, single-spaced text; ValueError for empty, unknown characters or too long."""
    normal = re.sub(r"\s+", " ", text.strip().lower())
    if not normal:
        raise ValueError("the text is empty: give some words to say")
    unknown = sorted(set(normal) - set(ALPHABET))
    if unknown:
        shown = "".join(unknown[:20]) + ("..." if len(unknown) > 20 else "")
        raise ValueError(f"the text has characters this voice cannot say: {shown!r}; use letters a-z, "
                         "spaces and apostrophes (spell digits as words: 'four two')")
    if len(normal) > MAX_TEXT:
        raise ValueError(f"the text is {len(normal)} characters long; at most {MAX_TEXT} at once (split it)")
    return normal


class CodeBatches:
    """Examples {"path", "text", "voice_name"} -> encoder input_ids/attention_mask and code labels (+ stop);
    each file's codes are computed once and kept."""

    def __init__(self, tokenizer, codebook: Codebook):
        self.tokenizer, self.codebook = tokenizer, codebook
        self._codes: dict[str, np.ndarray] = {}

    def codes(self, path: str) -> np.ndarray:
        if path not in self._codes:
            from .audio import load_audio

            self._codes[path] = self.codebook.encode(log_mel(load_audio(path, SAMPLE_RATE)))
        return self._codes[path]

    def __call__(self, examples: list[dict]) -> dict:
        texts = [tts_prompt(e["voice_name"], e["text"]) for e in examples]
        encoded = self.tokenizer(texts, padding=True, return_tensors="pt")
        stop = self.codebook.size + 1
        rows = [torch.tensor(np.append(self.codes(e["path"]), stop)) for e in examples]
        labels = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=-100)
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"], "labels": labels}


class Speaker:
    """A TTS checkpoint (EncoderDecoderModel + tokenizer + codebook) decoded by the xattn engine."""

    def __init__(self, model: str | None = None, revision: str | None = None):
        from transformers import EncoderDecoderModel

        from ..hf.hub import resolve_checkpoint
        from ..hf.loading import checkpoint_model_type, load_model, load_tokenizer
        from ..hf.model import from_hf

        path = DEFAULT_MODEL if model is None else resolve_checkpoint(model, revision)
        if not os.path.isdir(path):
            raise ValueError(f"the shipped speaker is not at {path}; pass --model with a checkpoint")
        self.codebook = Codebook.from_pretrained(path)
        if checkpoint_model_type(path) != "encoder-decoder":
            raise ValueError(f"{path} is not a text-to-speech checkpoint (an EncoderDecoderModel with a codebook)")
        self.model = load_model(EncoderDecoderModel, path).eval()
        self.tokenizer = load_tokenizer(path)
        self.engine = from_hf(self.model.decoder)
        self.engine.generation_config = self.model.generation_config
        vocab = self.tokenizer.get_vocab()  # voices are the <name> tokens besides <pad> and <unk>
        self.voices = [t[1:-1] for t in sorted(vocab, key=vocab.get)
                       if t.startswith("<") and t.endswith(">") and t not in ("<pad>", "<unk>")]
        if not self.voices:
            raise ValueError(f"{path}: its tokenizer has no voices (<name> tokens); not a speaker's checkpoint")
        rows = self.model.encoder.get_input_embeddings().num_embeddings
        past = [t for t, i in vocab.items() if not 0 <= i < rows]
        if past:  # a token the encoder has no embedding for would fail mid-synthesis
            raise ValueError(f"{path}: its tokenizer's {past[0]!r} (id {vocab[past[0]]}) is past the encoder's "
                             f"{rows} embeddings")

    @property
    def stop_code(self) -> int:
        return self.codebook.size + 1

    def check_voice(self, voice: str | None) -> str:
        """The voice to use (the first by default); ValueError naming the choices for an unknown one."""
        voice = voice or self.voices[0]
        if voice not in self.voices:
            raise ValueError(f"unknown voice {voice!r}; this model speaks {', '.join(self.voices)}")
        return voice

    @torch.no_grad()
    def _plan(self, text: str, voice: str | None, kwargs: dict) -> dict:
        voice = self.check_voice(voice)
        encoded = self.tokenizer([tts_prompt(voice, text)], return_tensors="pt")
        states = self.model.encoder(**encoded).last_hidden_state
        start = self.model.config.decoder_start_token_id
        return dict(decoder_input_ids=torch.tensor([[start]]), encoder_hidden_states=states,
                    encoder_attention_mask=encoded["attention_mask"], **kwargs)

    def codes(self, text: str, voice: str | None = None, **generate_kwargs) -> list[np.ndarray]:
        """Audio codes of num_return_sequences candidates (from one prefill), each cut at its stop code."""
        out = self.engine.generate(**self._plan(text, voice, generate_kwargs))[:, 1:]
        return [self._until_stop(row) for row in out.numpy()]

    def speak(self, text: str, voice: str | None = None, **generate_kwargs) -> np.ndarray:
        """The waveform (float32 at SAMPLE_RATE) of the first candidate."""
        return self.codebook.vocode(self.codes(text, voice, **generate_kwargs)[0])

    def stream(self, text: str, voice: str | None = None, **generate_kwargs) -> Iterator[np.ndarray]:
        """Audio in pieces of CHUNK codes (Codebook.vocode_stream), each yielded as soon as its codes and a few
        after it exist; concatenated they equal speak() with the same seed."""
        return self.codebook.vocode_stream(self._codes_as_made(text, voice, generate_kwargs))

    def _codes_as_made(self, text: str, voice: str | None, generate_kwargs: dict) -> Iterator[int]:
        for tokens in self.engine.stream(**self._plan(text, voice, generate_kwargs)):
            code = int(tokens[0])
            if code >= self.codebook.size:  # stop (or pad after it)
                return
            yield code

    def _until_stop(self, row: np.ndarray) -> np.ndarray:
        ends = np.flatnonzero(row >= self.codebook.size)
        return row[: ends[0]] if len(ends) else row
