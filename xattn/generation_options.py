"""Generation options: transformers' generate() keywords as one frozen dataclass, checked once where they come in
(GenerationOptions.from_kwargs), each refused with a message that says what to pass instead."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class GenerationOptions:
    max_new_tokens: int  # tokens generated after the prompt, at most
    min_new_tokens: int = 0  # EOS is forbidden before this many new tokens
    do_sample: bool = False  # sample from the distribution instead of taking the argmax
    temperature: float = 1.0  # sampling only: logits / temperature
    top_k: int | None = 50  # sampling only: keep the k most likely tokens (None or 0: all)
    top_p: float = 1.0  # sampling only: keep the smallest set whose probability reaches top_p
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the sequence (CTRL-style)
    num_beams: int = 1  # beam search when > 1
    length_penalty: float = 1.0  # beam only: score = logprob / length ** length_penalty
    early_stopping: bool | str = False  # beam only: True, False or "never", as in transformers
    num_return_sequences: int = 1  # sequences per input (best beams, or independent samples)
    eos_token_id: tuple[int, ...] = ()  # generation stops on any of these
    pad_token_id: int | None = None  # fills rows that have stopped
    generator: torch.Generator | None = field(default=None, compare=False)  # sampling RNG (global if None)

    def __post_init__(self):
        _check(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
               f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        _check(isinstance(self.min_new_tokens, int) and self.min_new_tokens >= 0,
               f"min_new_tokens must be an int >= 0, got {self.min_new_tokens!r}")
        _check(self.temperature > 0 and math.isfinite(self.temperature),
               f"temperature must be a positive number, got {self.temperature!r}; use do_sample=False for greedy")
        _check(self.top_k is None or (isinstance(self.top_k, int) and self.top_k >= 0),
               f"top_k must be an int >= 0 (0 or None disables it), got {self.top_k!r}")
        _check(0.0 <= self.top_p <= 1.0, f"top_p must be in [0, 1], got {self.top_p!r}")
        _check(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        _check(isinstance(self.num_beams, int) and self.num_beams >= 1,
               f"num_beams must be an int >= 1, got {self.num_beams!r}")
        _check(isinstance(self.num_return_sequences, int) and self.num_return_sequences >= 1,
               f"num_return_sequences must be an int >= 1, got {self.num_return_sequences!r}")
        _check(self.early_stopping in (True, False, "never"),
               f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if self.num_beams > 1:
            _check(self.num_return_sequences <= self.num_beams,
                   f"num_return_sequences ({self.num_return_sequences}) must be <= num_beams ({self.num_beams})")
            _check(not self.do_sample, "beam sampling is not supported: pass do_sample=False with num_beams > 1, "
                                       "or num_beams=1 with do_sample=True")
        elif not self.do_sample:
            _check(self.num_return_sequences == 1,
                   "greedy search returns one sequence per input: pass num_beams >= num_return_sequences "
                   "or do_sample=True")

    @classmethod
    def from_kwargs(cls, generation_config, prompt_length: int, **kwargs) -> GenerationOptions:
        """transformers-style generate() kwargs over a model's generation_config over transformers' defaults."""
        unknown = set(kwargs) - _KWARGS
        if unknown:
            raise ValueError(f"unsupported generate() arguments: {sorted(unknown)}; supported: {sorted(_KWARGS)}")

        def pick(name, default=None):
            value = kwargs.get(name)
            if value is None and generation_config is not None:
                value = getattr(generation_config, name, None)
            return default if value is None else value

        eos = pick("eos_token_id")  # None means "not given", as in transformers; [] means no EOS
        eos = () if eos is None else tuple(_int("eos_token_id", e) for e in (eos if isinstance(eos, (list, tuple))
                                                                              else [eos]))
        pad = pick("pad_token_id")
        if pad is None and eos:
            pad = eos[0]  # as transformers: stopped rows are filled with EOS
        if kwargs.get("max_new_tokens") is not None:
            max_new = _int("max_new_tokens", kwargs["max_new_tokens"])
        elif kwargs.get("max_length") is None and getattr(generation_config, "max_new_tokens", None) is not None:
            max_new = generation_config.max_new_tokens
        else:
            max_new = _int("max_length", pick("max_length", 20)) - prompt_length
        if max_new < 1:
            raise ValueError(f"nothing to generate: max_new_tokens={max_new!r} (prompt length {prompt_length}); "
                             "pass max_new_tokens >= 1")
        top_k = pick("top_k", 50)
        return cls(
            max_new_tokens=max_new,
            min_new_tokens=max(_int("min_new_tokens", pick("min_new_tokens", 0)),
                               _int("min_length", pick("min_length", 0)) - prompt_length, 0),
            do_sample=_bool("do_sample", pick("do_sample", False)),
            temperature=_float("temperature", pick("temperature", 1.0)),
            top_k=None if top_k is None else _int("top_k", top_k),
            top_p=_float("top_p", pick("top_p", 1.0)),
            repetition_penalty=_float("repetition_penalty", pick("repetition_penalty", 1.0)),
            num_beams=_int("num_beams", pick("num_beams", 1)),
            length_penalty=_float("length_penalty", pick("length_penalty", 1.0)),
            early_stopping=pick("early_stopping", False),
            num_return_sequences=_int("num_return_sequences", pick("num_return_sequences", 1)),
            eos_token_id=eos,
            pad_token_id=None if pad is None else _int("pad_token_id", pad),
            generator=kwargs.get("generator"),
        )

    @property
    def group_size(self) -> int:
        """Decoding rows per input: beams, or independent samples."""
        return self.num_beams if self.num_beams > 1 else self.num_return_sequences


_KWARGS = {
    "max_new_tokens", "max_length", "min_new_tokens", "min_length", "do_sample", "temperature", "top_k", "top_p",
    "repetition_penalty", "num_beams", "length_penalty", "early_stopping", "num_return_sequences", "eos_token_id",
    "pad_token_id", "bos_token_id", "decoder_start_token_id", "generator",
}


def _int(name: str, value) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return int(value)


def _float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _bool(name: str, value) -> bool:
    if not isinstance(value, (bool, int)) or value not in (0, 1):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
