"""Pure checks of submitted files, stdin and args (defence R11), shared by API and worker.

The API refuses bad input with a 400 naming the field; the worker runs the same checks
again before it writes anything, because Redis is not a trust boundary.
"""

from __future__ import annotations

import base64
import binascii
import unicodedata
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
from msgspec import UNSET

from shared.blobs import parse_ref
from shared.errors import FieldError, ValidationError
from shared.messages import MAX_ARGS, MAX_TESTS, FileInput, FileSpec, TestCase

__all__ = [
    "MAX_FILES",
    "MAX_NAME_BYTES",
    "check_args",
    "check_array_lengths",
    "check_file_name",
    "check_files",
    "check_stdin",
    "check_tests",
    "decode_files",
    "file_refs",
    "spec_files",
    "visible_name",
]

MAX_FILES = 100
MAX_NAME_BYTES = 255
MAX_DEPTH = 16
MAX_STDIN_BYTES = 1024 * 1024
MAX_ARG_TOTAL_BYTES = 64 * 1024


def _bad_char(ch: str) -> bool:
    # Cc: C0/C1 controls incl. NUL, CR, LF, ESC. Cf: invisible formatting such as U+202E
    # (right-to-left override), which makes names lie about their extension.
    # Zl/Zp: line and paragraph separators.
    return unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Cs")


def visible_name(name: str) -> str:
    """`name` with every character a submitted name may not hold (controls, invisible
    formatting, line separators) written as a visible escape (`\\x1b`, `\\u202e`): for a name
    that comes out of a jail, which a page or a terminal would otherwise show as a line break,
    an escape sequence, or text running backwards over a false extension."""
    if not any(_bad_char(ch) for ch in name):
        return name
    return "".join(_escape(ch) if _bad_char(ch) else ch for ch in name)


def _escape(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def check_file_name(name: str) -> str | None:
    """Why `name` is not acceptable as a workspace-relative path, or None if it is."""
    if not name:
        return "must not be empty"
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        return "must be valid UTF-8"
    if len(encoded) > MAX_NAME_BYTES:
        return f"must be at most {MAX_NAME_BYTES} bytes"
    if any(_bad_char(ch) for ch in name):
        return "must not contain control or invisible formatting characters"
    if "\\" in name:
        return "must use '/' as the only separator"
    if name.startswith("/"):
        return "must be a relative path"
    if name.startswith("@"):
        # Sources go on compilers' command lines as their relative names.
        return "must not start with '@' (compilers read '@name' as a file of options)"
    parts = name.split("/")
    if len(parts) > MAX_DEPTH:
        return f"must be at most {MAX_DEPTH} components deep ({MAX_DEPTH - 1} folders and the file)"
    for part in parts:
        if part == "":
            return "must not contain empty path components (leading, trailing or double '/')"
        if part in (".", ".."):
            return "must not contain '.' or '..' components"
        if part.startswith("-"):
            return "must not start a component with '-' (it would read as an option)"
    return None


def file_refs(files: list[FileInput]) -> list[str]:
    """The blob digests the files name by `ref`, in order (each once), after checking that
    every file has exactly one of `content` and `ref`, and that each ref is well formed.

    Raises:
        ValidationError: naming the first offending file.
    """
    if len(files) > MAX_FILES:
        raise ValidationError([FieldError("files", f"must contain at most {MAX_FILES} files")])
    digests: dict[str, None] = {}
    for index, file in enumerate(files):
        if file.content is UNSET and file.ref is UNSET:
            raise ValidationError([FieldError(f"files[{index}].content", "is required (or `ref`, naming an uploaded blob)")])
        if file.content is not UNSET and file.ref is not UNSET:
            raise ValidationError([FieldError(f"files[{index}]", "must have only one of `content` and `ref`")])
        if file.ref is not UNSET:
            digest = parse_ref(file.ref)
            if digest is None:
                raise ValidationError([FieldError(f"files[{index}].ref", "must be sha256:<64 lowercase hex digits>")])
            digests[digest] = None
    return list(digests)


def spec_files(files: list[FileInput]) -> list[FileSpec]:
    """The files as a job's spec holds them (call `file_refs` first): inline ones as given,
    the others by their `ref`, which the worker resolves when it claims the job."""
    out: list[FileSpec] = []
    for file in files:
        if file.ref is not UNSET:
            out.append(FileSpec(name=file.name, ref=file.ref))
        else:
            content = file.content if file.content is not UNSET else ""
            out.append(FileSpec(name=file.name, content=content, encoding=file.encoding))
    return out


_NO_BLOB = "names no blob of yours: upload it first (POST /v1/blobs/check, then PUT to its uploadUrl), or it has expired"


def check_files(files: list[FileSpec], max_total_bytes: int, blob_sizes: Mapping[str, int]) -> int:
    """Validate the files as `decode_files` does, a blob counting by its size (its bytes stay
    in Redis); their total size.

    Raises:
        ValidationError: naming the first offending field (e.g. `files[2].ref`).
    """
    return sum(len(data) if isinstance(data, bytes) else data for _, data in _files(files, max_total_bytes, blob_sizes.get))


def decode_files(files: list[FileSpec], max_total_bytes: int, blobs: Mapping[str, bytes] | None = None) -> list[tuple[str, bytes]]:
    """Validate and decode files to `(relative path, exact bytes)`; a file given by `ref`
    takes the bytes of that digest in `blobs`.

    Raises:
        ValidationError: naming the first offending field (e.g. `files[2].name`).
    """
    found = blobs or {}
    return [(name, data) for name, data in _files(files, max_total_bytes, found.get) if isinstance(data, bytes)]


def _files(
    files: list[FileSpec], max_total_bytes: int, blob: Callable[[str], bytes | int | None]
) -> list[tuple[str, bytes | int]]:
    if not files:
        raise ValidationError([FieldError("files", "must contain at least one file")])
    if len(files) > MAX_FILES:
        raise ValidationError([FieldError("files", f"must contain at most {MAX_FILES} files")])
    out: list[tuple[str, bytes | int]] = []
    seen: set[str] = set()
    directories: set[str] = set()
    total = 0
    for index, spec in enumerate(files):
        why = check_file_name(spec.name)
        if why:
            raise ValidationError([FieldError(f"files[{index}].name", why)])
        if spec.name in seen:
            raise ValidationError([FieldError(f"files[{index}].name", "is given twice")])
        parents = spec.name.split("/")[:-1]
        prefixes = {"/".join(parents[: i + 1]) for i in range(len(parents))}
        if spec.name in directories or prefixes & seen:
            raise ValidationError([FieldError(f"files[{index}].name", "clashes with a directory of another file")])
        seen.add(spec.name)
        directories |= prefixes
        data: bytes | int
        if spec.ref is not UNSET:
            digest = parse_ref(spec.ref)
            if digest is None:
                raise ValidationError([FieldError(f"files[{index}].ref", "must be sha256:<64 lowercase hex digits>")])
            held = blob(digest)
            if held is None:
                raise ValidationError([FieldError(f"files[{index}].ref", _NO_BLOB)])
            data = held
        elif spec.encoding == "base64":
            try:
                data = base64.b64decode(spec.content, validate=True)
            except (binascii.Error, ValueError):
                raise ValidationError([FieldError(f"files[{index}].content", "is not valid base64")]) from None
        else:
            try:
                data = spec.content.encode("utf-8")  # (once: a big file's encoding is its cost)
            except UnicodeEncodeError:  # a lone surrogate (JSON's \ud800 escape)
                raise ValidationError([FieldError(f"files[{index}].content", "is not valid UTF-8 text")]) from None
        total += len(data) if isinstance(data, bytes) else data
        if total > max_total_bytes:
            raise ValidationError([FieldError("files", f"must total at most {max_total_bytes} bytes")])
        out.append((spec.name, data))
    return out


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_args(args: list[str], field: str = "args") -> None:
    total = 0
    for index, arg in enumerate(args):
        if "\x00" in arg:
            raise ValidationError([FieldError(f"{field}[{index}]", "must not contain NUL")])
        if _has_lone_surrogate(arg):
            raise ValidationError([FieldError(f"{field}[{index}]", "must be valid UTF-8")])
        total += len(arg.encode())
    if total > MAX_ARG_TOTAL_BYTES:
        raise ValidationError([FieldError(field, f"must total at most {MAX_ARG_TOTAL_BYTES} bytes")])


def check_stdin(stdin: str | None, field: str = "stdin") -> None:
    if stdin is None:
        return
    if _has_lone_surrogate(stdin):
        raise ValidationError([FieldError(field, "must be valid UTF-8 text")])
    if len(stdin.encode()) > MAX_STDIN_BYTES:
        raise ValidationError([FieldError(field, f"must be at most {MAX_STDIN_BYTES} bytes")])


def check_tests(tests: list[TestCase], files_bytes: int, max_bytes: int) -> None:
    """A test batch: 1 to MAX_TESTS cases, each input valid, inputs and expected outputs
    together with the files within `max_bytes` (MAX_FILES_BYTES)."""
    if not 1 <= len(tests) <= MAX_TESTS:
        raise ValidationError([FieldError("tests", f"must hold 1 to {MAX_TESTS} cases")])
    total = files_bytes
    for index, case in enumerate(tests):
        check_stdin(case.stdin, f"tests[{index}].stdin")
        check_args(case.args, f"tests[{index}].args")
        if case.expected_output is not None and _has_lone_surrogate(case.expected_output):
            raise ValidationError([FieldError(f"tests[{index}].expectedOutput", "must be valid UTF-8 text")])
        if case.name is not None and any(_bad_char(ch) for ch in case.name):
            # A label shown in every test_result event: control bytes there would cost six
            # times their size in each (and could push the result past soketi's payload limit).
            raise ValidationError(
                [FieldError(f"tests[{index}].name", "must not contain control or invisible formatting characters")]
            )
        total += len((case.stdin or "").encode()) + len((case.expected_output or "").encode())
    if total > max_bytes:
        raise ValidationError([FieldError("tests", f"inputs, expected outputs and files must total at most {max_bytes} bytes")])


# msgspec checks an array's length only once it has built every element: a 16 MiB execute of
# `"tests": [{}, {}, ...]` became 5.6 million cases (785 MB, and 3 s of the API's event loop)
# before their cap refused it, and 16 such bodies fit the bodies' budget at once. A struct
# decoded from an array (array_like) with N optional fields stops at element N+1, and Raw
# builds nothing of what it skips: a first pass of such shapes checks the caps first.
_ABSENT = msgspec.Raw(b"null")


def _capped(name: str, size: int) -> type[msgspec.Struct]:
    fields = [(f"e{i}", msgspec.Raw, _ABSENT) for i in range(size)]
    return msgspec.defstruct(name, fields, array_like=True, forbid_unknown_fields=True)


_ARGS = msgspec.json.Decoder(_capped("_Args", MAX_ARGS))
_FILES = msgspec.json.Decoder(_capped("_Files", MAX_FILES))
_CASES = msgspec.json.Decoder(_capped("_Cases", MAX_TESTS))
# (Each array is taken whole first, then against its cap: the cap's error does not say where.)
_EXECUTE = msgspec.json.Decoder(
    msgspec.defstruct("_Execute", [(name, msgspec.Raw, _ABSENT) for name in ("files", "args", "tests")])
)
_CASE = msgspec.json.Decoder(msgspec.defstruct("_Case", [("args", msgspec.Raw, _ABSENT)]))
_TOO_LONG = "Expected `array` of at most length"


def check_array_lengths(body: bytes) -> None:
    """An execute body's arrays (files, args, tests and each case's args) within their caps,
    before the body is decoded. Anything else wrong with it is left to that decoding, which
    says what.

    Raises:
        ValidationError: naming the first array past its cap, as the checks after decoding do.
    """
    shape = _shape(_EXECUTE, body)
    if shape is None:
        return
    _within(_FILES, shape.files, "files")
    _within(_ARGS, shape.args, "args")
    cases = _within(_CASES, shape.tests, "tests")
    if cases is None:
        return
    for index, raw in enumerate(getattr(cases, name) for name in cases.__struct_fields__):
        case = _shape(_CASE, raw) if raw is not _ABSENT else None
        if case is not None:
            _within(_ARGS, case.args, f"tests[{index}].args")  # type: ignore[attr-defined]


def _shape(decoder: msgspec.json.Decoder[Any], raw: bytes | msgspec.Raw) -> Any:
    try:
        return decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None  # (the decoding proper says what is wrong with it)


def _within(capped: msgspec.json.Decoder[Any], raw: msgspec.Raw, field: str) -> Any:
    """`raw` (an array) decoded against its cap: None when absent or not an array."""
    if raw is _ABSENT:
        return None
    try:
        return capped.decode(raw)
    except msgspec.ValidationError as exc:
        if str(exc).startswith(_TOO_LONG):
            raise ValidationError([_too_long(field)]) from None
        return None
    except (msgspec.DecodeError, RecursionError):
        return None


def _too_long(field: str) -> FieldError:
    if field == "files":
        return FieldError("files", f"must contain at most {MAX_FILES} files")
    if field == "tests":
        return FieldError("tests", f"must hold 1 to {MAX_TESTS} cases")
    return FieldError(field, f"is invalid: Expected `array` of length <= {MAX_ARGS}")
