"""One encoder and one typed decoder per message type, created once.

Decoding failures of client input become ValidationError with the field path rewritten
from msgspec's `$.files[0].name` form to `files[0].name`.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from shared.errors import FieldError, ValidationError
from shared.messages import (
    CtrlMessage,
    ExecuteRequest,
    JobSpec,
    ResultEvent,
    RunResult,
    StdinFrame,
    StdinRequest,
    WorkerInfo,
)

__all__ = ["decode_request", "decode_stored", "encode", "json_decoder"]

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_decoders: dict[type, msgspec.json.Decoder[Any]] = {
    cls: msgspec.json.Decoder(cls)
    for cls in (ExecuteRequest, JobSpec, ResultEvent, RunResult, CtrlMessage, StdinFrame, StdinRequest, WorkerInfo)
}

# A \u escape of a high surrogate not followed by one of a low surrogate, or of a low
# surrogate not preceded by a high one (an escaped backslash before it is not told apart:
# this only words the error for a body msgspec has refused already). It starts with the
# literal `\u`, which the regex engine looks for first: a pattern that could start with a
# look-behind was tried at every byte, 0.3-0.45 s of the API's loop for a 16 MiB body cut short.
_LONE_SURROGATE = re.compile(
    rb"\\u[dD](?:[89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD])[c-fC-F][0-9a-fA-F]{2})"
)
_PATH = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def encode(message: Any) -> bytes:
    return _encoder.encode(message)


def json_decoder(cls: type[T]) -> msgspec.json.Decoder[T]:
    decoder = _decoders.get(cls)
    if decoder is None:
        decoder = _decoders[cls] = msgspec.json.Decoder(cls)
    return decoder


def decode_request(cls: type[T], body: bytes) -> T:
    """Decode client input, turning every msgspec complaint into a ValidationError."""
    try:
        return json_decoder(cls).decode(body)
    except msgspec.DecodeError as exc:
        lone = _LONE_SURROGATE.search(body) if str(exc).startswith("Input data was truncated") else None
        if lone is not None:
            # msgspec calls this "truncated", which would send the client looking in vain.
            escape = lone.group().decode()
            why = f"{escape} at byte {lone.start()} is half of a UTF-16 surrogate pair, not a character"
            raise ValidationError([FieldError("body", f"is not valid JSON ({why})")]) from None
        if str(exc).startswith("Invalid UTF-8"):
            # (msgspec says neither where nor in which field: the byte at least.)
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as bad:
                why = f"byte {bad.start} is not UTF-8 (text must be UTF-8; send other bytes as base64)"
                raise ValidationError([FieldError("body", f"is not valid JSON: {why}")]) from None
        raise ValidationError([_field_error(str(exc))]) from None
    except msgspec.ValidationError as exc:
        raise ValidationError([_field_error(str(exc))]) from None


def decode_stored(cls: type[T], raw: bytes | str) -> T:
    """Decode a message this system wrote itself; errors propagate as msgspec errors."""
    return json_decoder(cls).decode(raw)


# How much of what the client sent an error repeats (a field's name, a bad value): a
# 10 MB unknown key or enum value came back twice, in the detail and in the sentence.
ECHO_CHARS = 200


def _clip(text: str) -> str:
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + "…"


def _field_error(text: str) -> FieldError:
    error = _field_error_unclipped(text)
    return FieldError(_clip(error.field), _clip(error.message))


def _field_error_unclipped(text: str) -> FieldError:
    match = _PATH.match(text)
    message = match.group("message") if match else text
    path = (match.group("path") or "").lstrip(".") if match else ""
    if message.startswith(("JSON is malformed", "Input data was truncated")):
        return FieldError("body", f"is not valid JSON ({message})")
    if message.startswith("Object missing required field"):
        missing = message.split("`")[1]
        return FieldError(f"{path}.{missing}" if path else missing, "is required")
    if message.startswith("Object contains unknown field"):
        # The name runs to the last backtick (it may hold some); an empty one is the body's.
        unknown = message[message.index("`") + 1 : message.rindex("`")]
        if not unknown:
            return FieldError(path or "body", "has a field with an empty name")
        return FieldError(f"{path}.{unknown}" if path else unknown, "is not a known field")
    return FieldError(path or "body", f"is invalid: {message}")
