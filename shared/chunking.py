"""Turn a byte stream into UTF-8 text chunks of bounded size, never splitting a character.

Invalid UTF-8 becomes U+FFFD in the text chunks (the exact bytes are kept elsewhere for
the pullable result). A character cut by a read boundary is held back until its
remaining bytes arrive.
"""

from __future__ import annotations

__all__ = ["CHUNK_MAX_BYTES", "Utf8Chunker", "split_utf8", "utf8_prefix"]

CHUNK_MAX_BYTES = 8192


def _incomplete_tail(buf: bytes | bytearray) -> int:
    """How many trailing bytes of `buf` start a UTF-8 sequence that is not finished yet."""
    n = len(buf)
    for back in range(1, min(4, n) + 1):
        byte = buf[n - back]
        if byte & 0xC0 == 0x80:  # continuation byte: keep looking for the lead
            continue
        if byte >= 0xF0:
            need = 4
        elif byte >= 0xE0:
            need = 3
        elif byte >= 0xC0:
            need = 2
        else:
            return 0
        return back if back < need else 0
    return 0


def utf8_prefix(data: bytes, size: int) -> bytes:
    """At most `size` bytes of `data`, not ending inside a character the cut would split
    (text that was valid stays valid). All of `data` when it fits, unfinished or not."""
    if size >= len(data):
        return data
    cut = data[: max(0, size)]
    return cut[: len(cut) - _incomplete_tail(cut)]


def split_utf8(text: str, max_bytes: int = CHUNK_MAX_BYTES) -> list[str]:
    """Split text into pieces whose UTF-8 encoding is at most `max_bytes`, on character boundaries."""
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= max_bytes:
        return [text] if text else []
    out: list[str] = []
    start = 0
    while start < len(data):
        end = min(start + max_bytes, len(data))
        while end < len(data) and data[end] & 0xC0 == 0x80:
            end -= 1
        out.append(data[start:end].decode("utf-8", "surrogatepass"))
        start = end
    return out


class Utf8Chunker:
    """Incremental decoder: feed bytes, get text chunks of at most `max_bytes` each."""

    def __init__(self, max_bytes: int = CHUNK_MAX_BYTES) -> None:
        self._max_bytes = max_bytes
        self._pending = b""

    def feed(self, data: bytes) -> list[str]:
        buf = self._pending + data if self._pending else data
        keep = _incomplete_tail(buf)
        if keep:
            self._pending = buf[-keep:]
            buf = buf[:-keep]
        else:
            self._pending = b""
        if not buf:
            return []
        return split_utf8(buf.decode("utf-8", "replace"), self._max_bytes)

    def cost(self, data: bytes) -> int:
        """The bytes of text a feed of `data` adds, counting each byte as at least one: its
        length, plus two for every invalid byte (U+FFFD is three bytes of text)."""
        if data.isascii() and not self._pending:
            return len(data)
        buf = self._pending + data
        done = len(buf) - _incomplete_tail(buf)
        try:
            buf[:done].decode("utf-8")
        except UnicodeDecodeError:
            return len(data) + len(buf[:done].decode("utf-8", "replace").encode()) - done
        return len(data)

    def fitting(self, data: bytes, budget: int) -> int:
        """How many bytes of `data` a feed can take at a `cost` of at most `budget`."""
        if self.cost(data) <= budget:
            return len(data)
        low, high = 0, min(len(data), budget)  # (cost is at least the length, and grows with it)
        while low < high:
            mid = (low + high + 1) // 2
            if self.cost(data[:mid]) <= budget:
                low = mid
            else:
                high = mid - 1
        return low

    @property
    def pending(self) -> bytes:
        """The unfinished character held back for the next feed."""
        return self._pending

    def drop_pending(self) -> int:
        """Forget the unfinished character held back (its rest will never come); its length."""
        dropped, self._pending = len(self._pending), b""
        return dropped

    def flush(self) -> list[str]:
        """Decode whatever is held back (an unfinished character becomes U+FFFD)."""
        buf, self._pending = self._pending, b""
        return split_utf8(buf.decode("utf-8", "replace"), self._max_bytes) if buf else []
