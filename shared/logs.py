"""One logging set-up for every entry point. Control characters in messages are escaped
(defence R6): job output and file names are hostile bytes and must not forge log lines."""

from __future__ import annotations

import logging

__all__ = ["configure_logging"]

_ESCAPES = {i: f"\\x{i:02x}" for i in range(32) if i not in (9,)}
_ESCAPES[0x7F] = "\\x7f"


class _EscapingFormatter(logging.Formatter):
    def formatMessage(self, record: logging.LogRecord) -> str:
        # The message line is escaped; a traceback the base class appends keeps its newlines.
        return super().formatMessage(record).translate(_ESCAPES)


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(_EscapingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
