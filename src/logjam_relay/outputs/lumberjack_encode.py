"""The Lumberjack output's event mapping: logjam records -> ``1D`` frames.

The documented, stable mapping (``docs/lumberjack.md``), in C (``_ljencode.c``) when it
is built and in Python (:meth:`EventEncoder.encode_py`, the reference).  Bodies are
inflated through :func:`logjam_relay.limits.inflate_bounded`: an event whose body is
(or inflates to) more than ``max_event_bytes`` is not mapped but handed back as
rejected, for the dead-letter store.
"""

from __future__ import annotations

import os
import struct

import trio

from .. import _native
from ..limits import BadBody, EventTooLarge, inflate_bounded
from ..protocols import lumberjack as lj
from ..protocols.logjam import HEARTBEAT, split_app_env, unpack_meta
from ..spool.api import KIND_LOGJAM, Record

#: what ``max_event_bytes`` defaults to (config/settings.py): Filebeat's ``max_bytes`` default
DEFAULT_MAX_EVENT_BYTES = 10 * 1024 * 1024

# ----------------------------------------------------------------- event mapping

_u32 = struct.Struct(">I").pack
_ljencode = _native.load("logjam_relay.outputs._ljencode")   # the optional C event mapping
_encode_block = getattr(_ljencode, "encode_block", None)
_tailread = _native.load("logjam_relay.spool._tailread")
#: an output worker's reads (spool/tail.py): records as one buffer, mapped from it in C
_RecordBlock = getattr(_tailread, "RecordBlock", None) if getattr(_ljencode, "BLOCKS", False) \
    else None
_hdr_d = struct.Struct(">2sII").pack


def _k(key: bytes) -> bytes:
    return _u32(len(key)) + key


def _kv(key: bytes, value: bytes) -> bytes:
    return _k(key) + _u32(len(value)) + value


_K_LINE = _k(b"line")
_K_DEVICE = _k(b"device")
_K_SEQUENCE = _k(b"sequence")
_K_CREATED = _k(b"created_ms")
_TAG_DECODE_ERROR = _kv(b"tags", b"logjam_decode_error")
_PAIRS_OK = 9
_PAIRS_ERROR = 10


class EventEncoder:
    """Maps logjam records to ``1D`` frames (the documented, stable event mapping).

    Fields: ``line`` (decompressed JSON body), ``app``, ``env`` (app-env split at the
    last ``-``), ``topic``, ``device``, ``sequence``, ``created_ms``, ``host`` (relay host),
    ``type`` = ``logjam``; plus ``tags`` = ``logjam_decode_error`` when the body or the
    meta frame cannot be decoded (``line`` is then the raw body as text).

    Heartbeats (first frame ``heartbeat``) are skipped unless ``heartbeats``: then they
    are mapped like any message (app ``heartbeat``, env ``""``, topic ``tcp://fqdn:port``,
    line ``{}`` or a restart marker's body).
    """

    def __init__(self, relay_host: str, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
                 heartbeats: bool = False):
        self.heartbeats = heartbeats
        self._tail = _kv(b"host", relay_host.encode()) + _kv(b"type", b"logjam")
        self._stream_cache: dict[tuple[bytes, bytes], bytes] = {}
        self.decode_errors = 0
        self.max_event_bytes = max_event_bytes
        limit = max_event_bytes

        too_large = self._too_large = {}    # id(body) -> why, seen by the C mapping

        def decompress(body: bytes, comp: int) -> bytes:
            try:
                return inflate_bounded(comp, body, limit)
            except EventTooLarge as e:
                too_large[id(body)] = e.reason      # the fallback need not inflate it again
                raise
        self._decompress = decompress
        # id(frames) -> reason detail, for the records the last encode refused
        self._rejected: dict[int, str] = {}

    def _stream_pairs(self, app_env: bytes, topic: bytes) -> bytes:
        key = (app_env, topic)
        r = self._stream_cache.get(key)
        if r is None:
            app, env = split_app_env(app_env)
            r = (_kv(b"app", app.encode()) + _kv(b"env", env.encode())
                 + _kv(b"topic", topic.decode("utf-8", "replace").encode()))
            if len(self._stream_cache) >= 10_000:
                self._stream_cache.clear()
            self._stream_cache[key] = r
        return r

    def encode(self, records: list[Record]) -> tuple[bytes, int]:
        """``1D`` frames (seq 1..n) for the logjam records; (bytes, n).

        Records of other kinds are skipped (not forwarded), and heartbeats unless the
        encoder was made with ``heartbeats``.  Uses the C mapping
        (``_ljencode.c``) when it is built; :meth:`encode_py` otherwise (same bytes).
        An event that inflates past ``max_event_bytes`` gives an empty frame here (its
        sequence number is used), and a plain body over it is mapped by the C twin but
        not by :meth:`encode_py`: :meth:`encode_checked`, which takes both out and
        re-encodes, is what outputs call (same bytes either way).
        """
        if _ljencode is None:
            return self.encode_py(records)
        if type(records) is _RecordBlock:
            res = _encode_block(records, KIND_LOGJAM, self._tail, self._stream_cache,
                                self._stream_pairs, -1, self.heartbeats)
            if res is not None:
                return res
            records = records.tolist()
        self._too_large.clear()          # ids are only meaningful within one call
        return _ljencode.encode(records, KIND_LOGJAM, self._tail, self._stream_cache,
                                self._stream_pairs, self._decompress, self._encode_one,
                                self.heartbeats)

    def encode_checked(self, records: list[Record], prescan: bool = False
                       ) -> tuple[bytes, int, list[Record], list[tuple[Record, str]]]:
        """(frames, n, kept records, [(rejected record, why)]): events over the limit left out.

        The common case costs one length comparison: a window whose frames total at most
        ``max_event_bytes`` cannot hold an event over it (and nothing was refused while
        inflating).  Otherwise the plain bodies are measured and the window re-encoded
        without the rejected records.  ``prescan``: take plain bodies over the limit out
        first (for windows known to hold large bodies: they are then never copied).
        """
        self._rejected.clear()
        limit = self.max_event_bytes
        if type(records) is _RecordBlock:
            # a worker's read: the common case (plain bodies within the limit, good meta)
            # mapped from its buffer; anything else as a list (rejections are by identity)
            if not prescan:
                res = _encode_block(records, KIND_LOGJAM, self._tail, self._stream_cache,
                                    self._stream_pairs, limit, self.heartbeats)
                if res is not None:
                    return res[0], res[1], records, []
            records = records.tolist()
        if prescan:
            big = {id(r.frames) for r in records
                   if r.kind == KIND_LOGJAM and len(r.frames) > 2 and len(r.frames[2]) > limit}
            if big:
                out = [(r, f"body of {len(r.frames[2])} bytes is over {limit} bytes")
                       for r in records if id(r.frames) in big]
                data, n, kept, more = self.encode_checked(
                    [r for r in records if id(r.frames) not in big])
                return data, n, kept, sorted(out + more, key=lambda x: x[0].position)
        data, n = self.encode(records)
        if not self._rejected and len(data) <= limit:
            return data, n, records, []
        rejected = self._rejected
        for rec in records:
            fr = rec.frames
            if rec.kind == KIND_LOGJAM and len(fr) > 2 and len(fr[2]) > limit \
                    and id(fr) not in rejected:
                rejected[id(fr)] = f"body of {len(fr[2])} bytes is over {limit} bytes"
        if not rejected:
            return data, n, records, []
        kept = [r for r in records if id(r.frames) not in rejected]
        out = [(r, rejected[id(r.frames)]) for r in records if id(r.frames) in rejected]
        self._rejected = {}
        data, n = self.encode(kept)
        return data, n, kept, out

    def encode_py(self, records: list[Record]) -> tuple[bytes, int]:
        """:meth:`encode` in Python alone (the reference for the C mapping)."""
        self._too_large.clear()
        parts: list[bytes] = []
        append = parts.append
        seq = 0
        encode_one = self._encode_one
        skip_heartbeats = not self.heartbeats
        for rec in records:
            frames = rec.frames
            if rec.kind != KIND_LOGJAM or (skip_heartbeats and frames and frames[0] == HEARTBEAT):
                continue            # heartbeats are spooled for the gapless archive only
            seq += 1
            append(encode_one(frames, seq))
        return b"".join(parts), seq

    def _encode_one(self, frames, seq: int) -> bytes:
        """The ``1D`` frame of one logjam message (any frames, decodable or not)."""
        ok = True
        try:
            app_env, topic, body, meta = frames
            _tag, comp, _ver, device, created_ms, sequence = unpack_meta(meta)
        except (ValueError, struct.error):
            ok = False
            app_env = frames[0] if frames else b""
            topic = frames[1] if len(frames) > 1 else b""
            body = frames[2] if len(frames) > 2 else b""
            d = s = c = b""
        else:
            d = b"%d" % device
            s = b"%d" % sequence
            c = b"%d" % created_ms
            if comp:
                why = self._too_large.pop(id(body), None)
                if why is not None:
                    self._rejected[id(frames)] = why
                    return b""
                try:
                    body = inflate_bounded(comp, body, self.max_event_bytes)
                except EventTooLarge as e:
                    self._rejected[id(frames)] = e.reason
                    return b""
                except BadBody:
                    ok = False
        if len(body) > self.max_event_bytes:
            self._rejected[id(frames)] = (f"body of {len(body)} bytes is over "
                                          f"{self.max_event_bytes} bytes")
            return b""
        if not ok:
            self.decode_errors += 1
            body = bytes(body).decode("utf-8", "replace").encode()
        return b"".join((
            _hdr_d(b"1D", seq, _PAIRS_OK if ok else _PAIRS_ERROR), _K_LINE, _u32(len(body)),
            body, self._stream_pairs(app_env, topic),
            _K_DEVICE, _u32(len(d)), d, _K_SEQUENCE, _u32(len(s)), s,
            _K_CREATED, _u32(len(c)), c, self._tail,
            b"" if ok else _TAG_DECODE_ERROR))


# ------------------------------------------------------------- window compression

_WINDOW_C = _ljencode is not None and hasattr(_ljencode, "window_start") and \
    hasattr(os, "eventfd")


async def compress_window(frames: bytes, n: int, level: int) -> bytes:
    """``protocols.lumberjack.encode_window(frames, n, level)`` off the event loop.

    With the C twin, a thread of its own compresses without ever taking the GIL and
    signals an eventfd the loop waits on.  ``trio.to_thread`` (the fallback) needs the
    GIL three times per window (to start the thread's Python code, when zlib returns,
    to hand the result back); with ingest keeping the loop thread busy, each waited up
    to the interpreter's switch interval (5 ms), so an inline Lumberjack output did a
    fraction of its rate.  Same bytes either way
    (tests/test_lumberjack_writer.py).
    """
    if not _WINDOW_C or level <= 0:
        return await trio.to_thread.run_sync(lj.encode_window, frames, n, level)
    if not 1 <= n <= 0xFFFFFFFF:
        raise ValueError(f"window of {n} events")
    efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
    job = None
    try:
        job = _ljencode.window_start(frames, n, level, efd)
        while not job.done():
            await trio.lowlevel.wait_readable(efd)
        return job.finish()
    finally:
        if job is not None:
            job.join()          # cancelled: the thread must be done with efd before close
        os.close(efd)
