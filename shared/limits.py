"""Resource limits: what a request may ask for, and the pure rule that resolves it.

A request may lower or raise any limit within the server maximum; past the maximum it is
refused with a message naming the field and the maximum (never silently clamped).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from shared.errors import FieldError, ValidationError

__all__ = [
    "COMPILE_DEFAULTS","DEFAULT_LIMITS", "DEFAULT_MAXIMA", "Limits", "RequestedLimits", "resolve_limits", "wire_name", "with_overrides"]

# No upper bound here: resolve_limits refuses anything past the server's maximum, and names
# that maximum (a type's own bound would give a message naming a number that does not apply).
Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class RequestedLimits(msgspec.Struct, frozen=True, kw_only=True, rename="camel", forbid_unknown_fields=True):
    """The optional `limits` object of an execute request."""

    wall_time_ms: Positive | None = None
    idle_ms: Positive | None = None
    cpu_ms: Positive | None = None
    # Below 16 MiB no runtime starts, and nsjail's own set-up pages are charged there too.
    memory_mb: Annotated[int, msgspec.Meta(ge=16)] | None = None
    pids: Positive | None = None
    output_kb: Positive | None = None
    max_artifacts: NonNegative | None = None
    max_artifact_bytes: NonNegative | None = None


class Limits(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """Fully resolved limits of one job (every field set)."""

    wall_time_ms: int
    idle_ms: int
    cpu_ms: int
    memory_mb: int
    pids: int
    output_kb: int
    max_artifacts: int
    max_artifact_bytes: int


# The seed product's defaults, so its users see the same behaviour.
DEFAULT_LIMITS = Limits(
    wall_time_ms=30000,
    idle_ms=10000,
    cpu_ms=15000,
    memory_mb=128,
    pids=64,
    output_kb=512,
    max_artifacts=20,
    max_artifact_bytes=4 * 1024 * 1024,
)

# Compile steps: the manifest's `compile.limits` override these; requests cannot change them.
COMPILE_DEFAULTS = Limits(
    wall_time_ms=20000,
    idle_ms=20000,
    cpu_ms=15000,
    memory_mb=512,
    pids=64,
    output_kb=64,
    max_artifacts=0,
    max_artifact_bytes=0,
)

DEFAULT_MAXIMA = Limits(
    wall_time_ms=300000,
    idle_ms=120000,
    cpu_ms=120000,
    memory_mb=2048,
    pids=256,
    output_kb=16384,
    max_artifacts=100,
    max_artifact_bytes=64 * 1024 * 1024,
)

_FIELDS = tuple(Limits.__struct_fields__)
_WIRE = dict(zip(Limits.__struct_fields__, Limits.__struct_encode_fields__, strict=False))


def wire_name(field: str) -> str:
    """The camelCase name of a limit field as it appears in requests."""
    return _WIRE[field]


def resolve_limits(requested: RequestedLimits | None, defaults: Limits, maxima: Limits) -> Limits:
    """Merge a request's limits over the language defaults and check them against the maxima.

    Raises:
        ValidationError: one detail per field above its maximum.
    """
    values: dict[str, int] = {}
    problems: list[FieldError] = []
    for field in _FIELDS:
        asked = getattr(requested, field) if requested is not None else None
        ceiling = getattr(maxima, field)
        if asked is None:
            values[field] = min(getattr(defaults, field), ceiling)
            continue
        if asked > ceiling:
            problems.append(FieldError(f"limits.{_WIRE[field]}", f"must be at most {ceiling}"))
        values[field] = asked
    if problems:
        raise ValidationError(problems)
    return Limits(**values)


def with_overrides(base: Limits, overrides: RequestedLimits) -> Limits:
    """`base` with every field that `overrides` sets replaced (a manifest's defaults)."""
    changed = {f: getattr(overrides, f) for f in _FIELDS if getattr(overrides, f) is not None}
    return msgspec.structs.replace(base, **changed) if changed else base
