"""Forwarding the workers' stdout and stderr into the notebook (or the terminal)."""

from __future__ import annotations

import codecs
import sys
from collections import deque

from enot_nb._processes.protocol import OUTPUT_FENCE

TAIL_CHARS = 8192  # kept per stream for failure reports


class StreamSink:
    """Decodes one worker stream and writes it where the user sees it, keeping a tail.

    ``prefix`` (``"[rank N] "``) is put at the start of every line when several ranks share
    the screen. Alone on the screen (no prefix), ``\\r`` progress bars pass through intact;
    with several ranks, one rank's ``\\r`` would draw over another's line, so each redraw starts
    a fresh line of its own rank instead, and a line one rank left open (a bar, drawn without a
    newline) is ended before another rank writes (``_OPEN``): each rank's lines stay whole.
    """

    def __init__(self, target: str, show: bool, prefix: str = "") -> None:
        self.target = target  # "stdout" or "stderr", looked up at write time (IPython swaps them)
        self.show = show
        self.prefix = prefix
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at_line_start = True
        self._tail: deque[str] = deque()
        self._tail_len = 0

    def feed(self, data: bytes, final: bool = False, force_show: bool = False) -> None:
        text = self._decoder.decode(data, final)
        if not text:
            return
        self._remember(text)
        if self.show or force_show:
            stream = getattr(sys, self.target)
            stream.write(self._shared(text) if self.prefix else text)
            stream.flush()

    def _shared(self, text: str) -> str:
        """``text`` prefixed, on a line of its own where another rank left the line open."""
        lead = ""
        owner = _OPEN.get(self.target)
        if owner is not None and owner is not self:
            lead, owner._at_line_start = "\n", True
            del _OPEN[self.target]
        out = lead + self._prefixed(text)
        if self._at_line_start:
            if _OPEN.get(self.target) is self:
                del _OPEN[self.target]
        elif out:
            _OPEN[self.target] = self
        return out

    def _prefixed(self, text: str) -> str:
        pieces = []
        for line in text.splitlines(keepends=True):
            if line.endswith("\r"):  # a redraw (tqdm writes "\r" + bar): a line of its own
                if line == "\r":
                    if not self._at_line_start:
                        pieces.append("\n")
                        self._at_line_start = True
                    continue
                line = line[:-1] + "\n"
            if self._at_line_start:
                pieces.append(self.prefix)
            pieces.append(line)
            self._at_line_start = line.endswith("\n")
        return "".join(pieces)

    def _remember(self, text: str) -> None:
        self._tail.append(text)
        self._tail_len += len(text)
        while self._tail_len > TAIL_CHARS and len(self._tail) > 1:
            self._tail_len -= len(self._tail.popleft())

    def tail(self) -> str:
        return "".join(self._tail)[-TAIL_CHARS:]


_OPEN: dict[str, StreamSink] = {}
"""The prefixed sink whose line is open (written without its newline yet), per target stream."""


class Fenced:
    """One worker stream cut at the fences the worker writes before each message it sends (see
    protocol.OUTPUT_FENCE): a piece after the k-th fence is released once the k-th message has
    been handled, so output and messages reach the notebook in the order the worker made them."""

    def __init__(self) -> None:
        self.fences = 0
        self._pieces: deque[tuple[int, bytes]] = deque()
        self._partial = b""  # the stream's end, if it may be the start of a fence

    def add(self, data: bytes, final: bool = False) -> None:
        data, self._partial = self._partial + data, b""
        while (at := data.find(OUTPUT_FENCE)) >= 0:
            if at:
                self._pieces.append((self.fences, data[:at]))
            self.fences += 1
            data = data[at + len(OUTPUT_FENCE) :]
        if not final:
            keep = next(
                (n for n in range(min(len(data), len(OUTPUT_FENCE) - 1), 0, -1) if data.endswith(OUTPUT_FENCE[:n])), 0
            )
            if keep:
                data, self._partial = data[:-keep], data[-keep:]
        if data:
            self._pieces.append((self.fences, data))

    def release(self, handled: int, everything: bool = False) -> bytes:
        """What may be shown once ``handled`` messages have been: every piece before fence
        ``handled + 1`` (or everything, when the stream has ended)."""
        out = []
        while self._pieces and (everything or self._pieces[0][0] <= handled):
            out.append(self._pieces.popleft()[1])
        return b"".join(out)
