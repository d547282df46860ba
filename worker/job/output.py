"""The output budget and the exact bytes of stdout/stderr.

`outputKb` caps what the live events and the stored result hold, across both streams;
the rest is dropped (the program keeps running, its pipes keep draining) and `truncated`
is set. Text chunks for events never split a UTF-8 character; the exact bytes are kept
for the pullable result.
"""

from __future__ import annotations

from shared.chunking import Utf8Chunker

__all__ = ["CompileOutput", "OutputBudget", "StreamTail", "output_encoding"]


class StreamTail:
    """The last bytes a program wrote to a stream, whatever the budget kept: a runtime's
    last words (see shared.manifest.HeapLimit) come after any amount of output."""

    SIZE = 4096

    def __init__(self) -> None:
        self.data = b""

    def feed(self, data: bytes) -> None:
        self.data = data[-self.SIZE :] if len(data) >= self.SIZE else (self.data + data)[-self.SIZE :]


class OutputBudget:
    def __init__(self, limit_bytes: int, keep_bytes: bool) -> None:
        self.left = limit_bytes
        self.truncated = False
        self._keep = keep_bytes
        self.data: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self._chunkers = {"stdout": Utf8Chunker(), "stderr": Utf8Chunker()}

    def feed(self, stream: str, data: bytes) -> list[str]:
        """Account for bytes read from `stream`; returns the text chunks to publish.

        The budget counts the text that goes out: an invalid byte is published as U+FFFD,
        three bytes of text, and charged as such (or a program writing 0xff would send three
        times outputKb through events and the log). The kept bytes are the ones whose text
        went out, so binary output keeps about a third as many as text would. Once the
        budget cuts, nothing after the cut goes out, on either stream: what was published
        stays a prefix of what the program wrote, even when the cut fell short of the limit
        (an invalid byte's text not fitting the bytes left).
        """
        if self.truncated:
            return []
        chunker = self._chunkers[stream]
        cut = len(data) > self.left
        if cut:
            data = data[: self.left]
        cost = chunker.cost(data)
        if cost > self.left:
            data = data[: chunker.fitting(data, self.left)]
            cost = chunker.cost(data)
            cut = True
        chunks: list[str] = []
        if data:
            self.left -= cost
            if self._keep:
                self.data[stream] += data
            chunks = chunker.feed(data)
        if cut:
            self.truncated, self.left = True, 0
        return chunks

    def spent(self) -> bool:
        """Whether what comes now is dropped (the budget cut something)."""
        return self.truncated

    def flush(self, stream: str) -> list[str]:
        """The text held back at the stream's end.

        After a cut, an unfinished character is the budget's doing (its rest was dropped),
        not the program's: it is left out of both the events and the kept bytes, which then
        stay valid UTF-8 where the program wrote it, instead of ending in U+FFFD (and turning
        the result to base64). Otherwise it goes out as U+FFFD, which costs more than the
        bytes it was charged as: where that does not fit what is left, it is dropped and the
        output is truncated, so the events never pass the limit.
        """
        chunker = self._chunkers[stream]
        pending = chunker.pending
        if pending:
            extra = len(pending.decode("utf-8", "replace").encode()) - len(pending)
            if self.truncated or extra > self.left:
                chunker.drop_pending()
                if self._keep:
                    del self.data[stream][-len(pending) :]
                if not self.truncated:
                    self.truncated, self.left = True, 0
                return []
            self.left -= extra
        return chunker.flush()


def output_encoding(data: bytes) -> str:
    """How the pullable result shows output bytes: as text when they are valid UTF-8, else
    as base64 (the bytes themselves are stored raw either way)."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return "base64"
    return "utf8"


class CompileOutput:
    """Compiler output: interleaved as it arrived (`output`, the live `compile_output`
    events) and per stream (`stdout`, `stderr`, as the seed's CompileResult has them), each
    capped; the cap adds one visible marker, then drops.

    The two streams come through separate pipes, so their interleaving is the order in
    which the worker read them, which is the order written except within a few µs.
    """

    def __init__(self, limit_bytes: int) -> None:
        # Each stream is decoded on its own (a character split across two reads of one pipe,
        # with the other pipe's output read in between, stays whole); the log interleaves
        # the decoded text.
        self._budget = OutputBudget(limit_bytes, keep_bytes=False)
        self._streams = OutputBudget(2 * limit_bytes, keep_bytes=True)
        self._log: list[str] = []
        self._limit_kb = limit_bytes // 1024
        self._marked = False

    def spent(self) -> bool:
        """Whether what comes now is dropped, from the log and from both streams."""
        return self._marked and self._streams.spent()

    def feed(self, data: bytes, stream: str = "stdout") -> list[str]:
        self._streams.feed(stream, data)
        if self._marked:
            return []
        chunks = self._budget.feed(stream, data)
        if self._budget.truncated:
            self._marked = True
            chunks = [*chunks, *self._budget.flush("stdout"), *self._budget.flush("stderr"), self.marker]
        self._log += chunks
        return chunks

    def flush(self) -> list[str]:
        if self._marked:
            return []
        chunks = [*self._budget.flush("stdout"), *self._budget.flush("stderr")]
        self._log += chunks
        return chunks

    @property
    def marker(self) -> str:
        return f"\n[compiler output truncated at {self._limit_kb} KiB]\n"

    @property
    def text(self) -> str:
        return "".join(self._log)

    def stream_text(self, stream: str) -> str:
        return bytes(self._streams.data[stream]).decode("utf-8", "replace")
