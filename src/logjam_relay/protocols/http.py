"""HTTP/1.1 request heads and responses for the health endpoint, sans-IO.

Only what ``health/http.py`` serves needs: one small request per connection (GET/HEAD of
``/metrics``, ``/healthz``, ``/readyz``), no request bodies, every response closes the
connection.  Bytes in, one :class:`Request` out; no sockets, no trio, no clock.

* :class:`RequestReader`: ``receive_data(bytes)`` (``b""`` = end of stream) and
  ``next_event()`` -> :class:`Request`, :data:`NEED_DATA` or :data:`CLOSED` (the peer
  closed before a complete head).  A head longer than ``max_request`` bytes, a malformed
  request line, a header line without ``:``, an obsolete line folding or control
  characters in the target raise :class:`HTTPError` with a ``reason`` (metric label) and
  the status to answer (400, 431).
* :func:`encode_response`: the status line, ``Content-Type``, ``Content-Length``, extra
  header lines and ``Connection: close``.

The head ends at the first empty line (``CRLF CRLF``; a bare ``LF LF`` is accepted, as
the earlier inline parser and most servers do).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["HTTPError", "Request", "RequestReader", "NEED_DATA", "CLOSED",
           "encode_response", "REASONS", "MAX_REQUEST"]

MAX_REQUEST = 8192

REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
           405: "Method Not Allowed", 408: "Request Timeout",
           431: "Request Header Fields Too Large", 500: "Internal Server Error",
           503: "Service Unavailable"}

_METHOD = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")      # RFC 9110 token
_VERSION = re.compile(r"^HTTP/\d\.\d$")
_HEADER_NAME = _METHOD
_CTL = re.compile(r"[\x00-\x20\x7f]")


class HTTPError(Exception):
    """A request the server cannot parse: answer ``status`` and close."""

    def __init__(self, reason: str, message: str = "", status: int = 400):
        super().__init__(message or reason)
        self.reason = reason
        self.status = status


class _Sentinel:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


NEED_DATA = _Sentinel("NEED_DATA")
CLOSED = _Sentinel("CLOSED")


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    target: str
    path: str             # the target without its query
    version: str          # "HTTP/1.1"; "" for a two-part request line
    headers: dict         # lower-case name -> value (the last one wins)


class RequestReader:
    """The head of one request."""

    def __init__(self, max_request: int = MAX_REQUEST):
        self.max_request = max_request
        self._buf = bytearray()
        self._scanned = 0        # where to resume looking for the end of the head
        self._eof = False
        self._done = False

    def receive_data(self, data: bytes) -> None:
        if not data:
            self._eof = True
            return
        if self._eof:
            raise RuntimeError("receive_data after end of stream")
        self._buf += data

    def next_event(self):
        if self._done:
            return NEED_DATA
        buf = self._buf
        start = max(0, self._scanned - 3)
        end, sep = -1, 0
        crlf = buf.find(b"\r\n\r\n", start)
        lf = buf.find(b"\n\n", start)
        if crlf >= 0 and (lf < 0 or crlf <= lf):
            end, sep = crlf, 4
        elif lf >= 0:
            end, sep = lf, 2
        if end < 0:
            self._scanned = len(buf)
            if len(buf) > self.max_request:
                raise HTTPError("too_large", f"request head over {self.max_request} bytes",
                                431)
            return CLOSED if self._eof else NEED_DATA
        if end + sep > self.max_request:
            raise HTTPError("too_large", f"request head over {self.max_request} bytes", 431)
        self._done = True
        return parse_head(bytes(buf[:end]))


def parse_head(head: bytes) -> Request:
    """Parse a request head (without its terminating empty line)."""
    lines = head.decode("latin-1").replace("\r\n", "\n").split("\n")
    while lines and lines[0] == "":
        lines.pop(0)                  # RFC 9112 2.2: empty lines before the request line
    if not lines:
        raise HTTPError("bad_request_line", "empty request")
    parts = lines[0].split(" ")
    if len(parts) == 3:
        method, target, version = parts
        if not _VERSION.match(version):
            raise HTTPError("bad_request_line", "bad HTTP version")
    elif len(parts) == 2:
        (method, target), version = parts, ""
    else:
        raise HTTPError("bad_request_line", "request line is not METHOD TARGET VERSION")
    if not _METHOD.match(method):
        raise HTTPError("bad_request_line", "bad method")
    if not target or _CTL.search(target):
        raise HTTPError("bad_request_line", "bad request target")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line[:1] in (" ", "\t"):
            raise HTTPError("bad_header", "obsolete header line folding")
        name, sep, value = line.partition(":")
        if not sep or not _HEADER_NAME.match(name):
            raise HTTPError("bad_header", "header line without a valid name")
        headers[name.lower()] = value.strip(" \t\r")
    return Request(method, target, target.split("?", 1)[0], version, headers)


def encode_response(status: int, ctype: str, body: bytes, *, length: int | None = None,
                    extra: str = "") -> bytes:
    """A whole response; ``length`` overrides ``Content-Length`` (HEAD), ``extra`` are
    header lines, each ending in CRLF."""
    n = len(body) if length is None else length
    head = (f"HTTP/1.1 {status} {REASONS.get(status, '')}\r\n"
            f"Content-Type: {ctype}\r\nContent-Length: {n}\r\n{extra}"
            f"Connection: close\r\n\r\n").encode("latin-1")
    return head + body
