"""Request fields beyond the generation options: the multipart endpoints' generation form fields (the CLI's
flags, in the docs with the CLI's help), the speech endpoint's JSON body (OpenAI's fields + the generation options),
and OpenAI's `temperature` for transcriptions."""

from __future__ import annotations

import argparse
import functools
import inspect
from typing import Annotated

from fastapi import Form
from pydantic import BaseModel, ConfigDict, create_model
from pydantic import Field as PydanticField

from ..argtypes import number
from .limits import ApiError
from .options import FIELDS, OptionError, generation, parse_bool, shown


def request_options(fields: dict | None, generation_config):
    try:
        return generation(fields or {}, generation_config)
    except OptionError as error:
        raise ApiError(422, str(error)) from None


def flag(name: str, value: str | None) -> bool:
    try:
        return parse_bool(name, value)
    except OptionError as error:
        raise ApiError(422, str(error)) from None


def openai_temperature(value: str | None) -> float:
    if value is None or not value.strip():
        return 0.0
    try:
        return number(0)(value.strip())
    except argparse.ArgumentTypeError as error:
        raise ApiError(422, f"temperature: {error}") from None


def with_generation_fields(exclude: tuple[str, ...] = ()):
    """Adds the CLI's generation options as optional form fields to a multipart endpoint, handed to it as the
    dict `generation_fields` (FastAPI reads the signature: each field is in the docs with the CLI's help). The
    endpoint takes `request`; a field it does not declare, or one given twice, is refused (422), as the CLI refuses
    an unknown or repeated flag's value would be lost: a misspelt option must not pass unnoticed."""
    def decorate(endpoint):
        names = [n for n in FIELDS if n not in exclude]

        @functools.wraps(endpoint)
        async def wrapper(*args, **kwargs):
            await check_form(kwargs["request"], declared)
            kwargs["generation_fields"] = {n: kwargs.pop(n, None) for n in names}
            return await endpoint(*args, **kwargs)

        signature = inspect.signature(endpoint)
        params = [p for p in signature.parameters.values() if p.name != "generation_fields"]
        declared = {p.name for p in params if p.name != "request"} | set(names)
        kind = {int: "integer", float: "number", bool: "true or false"}
        params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
            str | None, Form(description=f"{kind[FIELDS[n].kind]}: {FIELDS[n].help}")]) for n in names]
        wrapper.__signature__ = signature.replace(parameters=params)
        return wrapper
    return decorate


async def check_form(request, declared: set[str]) -> None:
    """422 for a form field the endpoint does not declare, or a field sent more than once."""
    form = await request.form()  # parsed once by FastAPI already: this is its cached copy
    for name in dict.fromkeys(form.keys()):
        if name not in declared:
            raise ApiError(422, f"{shown(name)}: not a field of this endpoint; it takes {', '.join(sorted(declared))}")
        count = len(form.getlist(name))
        if count > 1:
            raise ApiError(422, f"{shown(name)}: sent {count} times; send it once (one request per file)")


def _speech_request() -> type[BaseModel]:
    from ..tasks.speech_synthesis import MAX_TEXT

    fields = {
        "input": (str, {"description": f"what to say: letters a-z, spaces, apostrophes, at most {MAX_TEXT}"}),
        "voice": (str | None, {"default": None, "description": "one of the model's voices (default: its first)"}),
        "response_format": (str, {"default": "wav", "description": "wav (streamed, 16-bit) or pcm (raw 16-bit)"}),
        "model": (str | None, {"default": None, "description": "accepted for OpenAI clients; one speaker per server"}),
        "speed": (float, {"default": 1.0, "description": "1.0 only"}),
    }
    for name, field in FIELDS.items():  # strict: JSON true is not seed 1, "5" is not 5
        fields[name] = (field.kind | None, {"default": None, "description": field.help, "strict": True})
    return create_model("SpeechRequest", __config__=ConfigDict(extra="forbid"),
                        **{n: (t, PydanticField(**kw)) for n, (t, kw) in fields.items()})


SpeechRequest = _speech_request()
