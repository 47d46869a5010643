"""Generation options as request fields: the CLI's own generation flags (`xattn caption --help`), same names
(`--max-new-tokens` -> `max_new_tokens`), same parsers and range checks (xattn/argtypes.py), so a value the CLI
refuses is refused here with the CLI's message; then the engine's own checks of the combination
(GenerationOptions), before a request waits in any queue."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from ..cli import _add_generation_flags
from ..generate import GenerationOptions


class OptionError(ValueError):
    """A request field the CLI would refuse (422), one line naming the field."""


def shown(value, limit: int = 80) -> str:
    """A client's value as a message quotes it: its repr, cut to `limit` characters (a message stays one line)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(frozen=True)
class Field:
    name: str  # the CLI flag's dest: max_new_tokens, do_sample, seed...
    kind: type  # int, float or bool
    help: str  # the CLI flag's help
    parse: object  # the CLI flag's argparse type (None for a switch)


def _cli_fields() -> dict[str, Field]:
    parser = argparse.ArgumentParser(add_help=False)
    _add_generation_flags(parser)
    fields = {}
    for action in parser._actions:
        if action.nargs == 0:  # a switch (--do-sample / --no-do-sample)
            fields[action.dest] = Field(action.dest, bool, action.help, None)
        else:
            kind = int if getattr(action.type, "__name__", "") == "integer" else float
            fields[action.dest] = Field(action.dest, kind, action.help, action.type)
    return fields


FIELDS = _cli_fields()
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off", "")


def parse_field(name: str, value) -> int | float | bool | None:
    """One field's value (a form string or a JSON value) through the CLI's parser; None when absent."""
    if value is None:
        return None
    field = FIELDS[name]
    if isinstance(value, str) and not value.strip():  # an empty form field: absent
        return None
    if field.kind is bool:
        return parse_bool(name, value)
    if isinstance(value, bool):  # JSON true is not a number
        raise OptionError(f"{name}: expected a number, got {value!r}")
    text = value.strip() if isinstance(value, str) else repr(value)
    if len(text) > 100:  # longer than any number the parsers take; not quoted back whole
        raise OptionError(f"{name}: expected a number, got {shown(text)}")
    try:
        return field.parse(text)
    except argparse.ArgumentTypeError as error:
        raise OptionError(f"{name}: {error}") from None


def parse_bool(name: str, value) -> bool:
    """A switch as a form or JSON value: true/false, 1/0, yes/no, on/off (empty: false)."""
    if isinstance(value, bool):
        return value
    text = str(value if value is not None else "").strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise OptionError(f"{name}: expected true or false, got {shown(str(value))}")


@dataclass(frozen=True)
class Generation:
    """A request's generation options: the generate() keyword arguments and the sampling seed."""

    kwargs: tuple[tuple[str, object], ...]  # sorted (name, value): hashable, so equal options can share a batch
    seed: int | None  # a seeded request runs alone, so its result is the CLI's with --seed

    def generate_kwargs(self) -> dict:
        """Keyword arguments for the task APIs, a fresh generator for a seeded request."""
        kwargs = dict(self.kwargs)
        if self.seed is not None:
            kwargs["generator"] = torch.Generator().manual_seed(self.seed)
        return kwargs

    @property
    def num_return_sequences(self) -> int:
        return dict(self.kwargs).get("num_return_sequences", 1)

    @property
    def rows(self) -> int:
        """Decoding rows the request takes: its beams, or its samples (at least 1)."""
        kwargs = dict(self.kwargs)
        return max(kwargs.get("num_beams", 1), kwargs.get("num_return_sequences", 1))


def generation(values: dict, generation_config=None) -> Generation:
    """Parse the request's generation fields (absent ones: the model's default, as the CLI; do_sample false turns
    off a model's default sampling, as --no-do-sample) and check their combination with the engine's own rules
    against the model's generation_config; OptionError otherwise."""
    kwargs = {}
    for name, value in values.items():
        parsed = parse_field(name, value)
        if parsed is not None:
            kwargs[name] = parsed
    seed = kwargs.pop("seed", None)
    try:
        GenerationOptions.from_kwargs(generation_config, 1, **kwargs)
    except ValueError as error:
        raise OptionError(str(error)) from None
    return Generation(tuple(sorted(kwargs.items())), seed)
