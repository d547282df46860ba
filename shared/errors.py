"""Exceptions shared by the API and the worker.

    RunnerError
    ├── ConfigError          settings or a sandbox profile are unusable
    ├── ValidationError      a request (or stored message) breaks the contract; carries field details
    └── ManifestError        a language manifest is malformed
"""

from __future__ import annotations

import re

import msgspec

__all__ = ["ConfigError", "FieldError", "ManifestError", "RunnerError", "ValidationError", "detail_json"]

_INDEX = re.compile(r"\[(\d+)\]")


class RunnerError(Exception):
    """Base of every error raised by coderunner code."""


class ConfigError(RunnerError):
    """Configuration is missing or inconsistent; the message says which setting."""


class ManifestError(RunnerError):
    """A language manifest in sandbox-profiles/ is malformed."""


class FieldError(msgspec.Struct, frozen=True):
    """One problem with one field of a request; `field` is a dotted path like `limits.cpuMs`."""

    field: str
    message: str


def detail_json(detail: FieldError) -> dict[str, str]:
    """A detail as error bodies carry it: `field` (`files[0].name`), and the same place as
    the seed product named it, `path` (its validator's path joined by dots, `files.0.name`),
    so a client written against the seed's errors finds it too."""
    return {"field": detail.field, "path": _INDEX.sub(r".\1", detail.field), "message": detail.message}


class ValidationError(RunnerError):
    """A request broke the contract. The first detail becomes the human sentence."""

    def __init__(self, details: list[FieldError]) -> None:
        if not details:
            raise ValueError("ValidationError needs at least one detail")
        self.details = details
        super().__init__(self.sentence)

    @property
    def sentence(self) -> str:
        first = self.details[0]
        return f"{first.field} {first.message}" if first.field else first.message
