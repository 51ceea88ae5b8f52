"""One JSON document read from a text stream a value at a time.

``json.loads`` needs the whole document in memory, and its parsed form takes several times
that. A Message Batches create body is one object whose ``requests`` array may hold 256 MB of
requests; :class:`JsonReader` walks the object's members and the array's items so that only
the value being read is held (``json.JSONDecoder.raw_decode`` over a sliding buffer). It reads
exactly what ``json.loads`` reads: the same values, the same documents refused
(``json.JSONDecodeError``), with duplicate keys left to the caller (``json.loads`` keeps the
last).

Memory: the buffer holds the value being decoded and at most one read beyond it. A value that
ends past the buffer is decoded again once more text has come, each read at least doubling the
buffer, so a long value costs linear time; a document that is invalid early is refused without
reading the rest.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

WHITESPACE = " \t\n\r"  # what JSON allows between tokens (str.isspace allows more)
READ_CHARS = 64 * 1024
#: A value that ends, or a decode error that comes, this close to the end of the buffer may be
#: the end of the buffer, not of the value (``2.`` of ``2.5``, ``tru``, ``\\u12``): read more
#: before believing it.
NEAR_END_CHARS = 16


class JsonReader:
    """A JSON document from ``read(n)`` (up to ``n`` characters, ``""`` at the end), read one
    token or value at a time: :meth:`members` of an object, :meth:`items` of an array,
    :meth:`value` for anything whole, then :meth:`end`."""

    def __init__(self, read: Callable[[int], str], read_chars: int = READ_CHARS) -> None:
        self._read = read
        self._read_chars = read_chars
        self._decoder = json.JSONDecoder()
        self._buf = ""
        self._pos = 0
        self._eof = False

    def _fill(self, chars: int) -> bool:
        """Read up to ``chars`` more characters; False at the end of the stream."""
        if self._eof:
            return False
        text = self._read(chars)
        if not text:
            self._eof = True
            return False
        if self._pos > len(self._buf) // 2:  # drop what was read, at most once per doubling
            self._buf = self._buf[self._pos :]
            self._pos = 0
        self._buf += text
        return True

    def _error(self, message: str) -> json.JSONDecodeError:
        return json.JSONDecodeError(message, self._buf, self._pos)

    def peek(self) -> str:
        """The next character that is not whitespace, without taking it; ``""`` at the end."""
        while True:
            while self._pos < len(self._buf) and self._buf[self._pos] in WHITESPACE:
                self._pos += 1
            if self._pos < len(self._buf):
                return self._buf[self._pos]
            if not self._fill(self._read_chars):
                return ""

    def take(self, char: str, expected: str) -> None:
        """Take ``char`` (after whitespace), else JSONDecodeError("Expecting <expected>")."""
        if self.peek() != char:
            raise self._error(f"Expecting {expected}")
        self._pos += 1

    def value(self) -> Any:
        """The next value, whole."""
        self.peek()
        want = self._read_chars
        while True:
            more = max(want, len(self._buf) - self._pos)  # at least double what the value has
            want *= 2
            try:
                value, end = self._decoder.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError as error:
                if self._may_go_on(error) and self._fill(more):
                    continue
                raise
            # A number near the end of the buffer may go on in the next read ("2." of "2.5").
            if end > len(self._buf) - NEAR_END_CHARS and self._fill(more):
                continue
            self._pos = end
            return value

    def _may_go_on(self, error: json.JSONDecodeError) -> bool:
        """Whether ``error`` may only mean that the value goes on past the buffer."""
        if self._eof:
            return False
        return error.msg.startswith("Unterminated string") or (
            error.pos >= len(self._buf) - NEAR_END_CHARS
        )

    def members(self) -> Iterator[str]:
        """The names of the object that comes next; after each, the caller reads its value
        (:meth:`value`, :meth:`items` or :meth:`members`) before asking for the next name."""
        self.take("{", "value")
        if self.peek() == "}":
            self._pos += 1
            return
        while True:
            if self.peek() != '"':
                raise self._error("Expecting property name enclosed in double quotes")
            name = self.value()
            self.take(":", "':' delimiter")
            yield name
            following = self.peek()
            self._pos += 1
            if following == "}":
                return
            if following != ",":
                self._pos -= 1
                raise self._error("Expecting ',' delimiter")

    def items(self) -> Iterator[Any]:
        """The items of the array that comes next, each whole."""
        self.take("[", "value")
        if self.peek() == "]":
            self._pos += 1
            return
        while True:
            yield self.value()
            following = self.peek()
            self._pos += 1
            if following == "]":
                return
            if following != ",":
                self._pos -= 1
                raise self._error("Expecting ',' delimiter")

    def end(self) -> None:
        """Only whitespace is left, else JSONDecodeError("Extra data")."""
        if self.peek() != "":
            raise self._error("Extra data")
