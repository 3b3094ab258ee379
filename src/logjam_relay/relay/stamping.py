"""The hot path: validate a drained batch, stamp it, publish it, hand it to the spool.

Work is split in two synchronous steps so that compression can run in worker
threads between them without reordering a stream:

* :meth:`Pipeline.prepare` classifies a batch (ROUTER or PULL).  Valid data
  messages become small tuples ``(app_env, topic, body, compression,
  created_ms_bytes)``; replies for invalid requests and pings are collected.
* :meth:`Pipeline.commit` assigns sequence numbers in order, builds the meta
  frame from precomputed prefixes, publishes on PUB and returns the stamped
  records for the spool.

The common case (4 frames, cached stream and topic, good meta) takes a handful
of bytecodes per message; everything else goes through the complete
classifier in :mod:`logjam_relay.protocols.logjam`.
"""

from __future__ import annotations

import logging
from collections import Counter

from ..protocols import logjam as L
from ..ratelimit import RateLimitedLog


def _load_recompress():
    """The C batch compressor, bound to the liblz4 inside python-lz4 (or None)."""
    from .. import _native
    mod = _native.load("logjam_relay.relay._recompress")
    if mod is None:
        return None
    try:
        import lz4.block._block as lz4_ext
        mod.init(lz4_ext.__file__)
        return mod
    except (ImportError, OSError, AttributeError):
        return None


_recompress = _load_recompress()


def _load_stamp():
    from .. import _native
    return _native.load("logjam_relay.relay._stamp")


_stamp = _load_stamp()

log = RateLimitedLog(logging.getLogger("logjam_relay.ingest"))

_ZERO8 = b"\0" * 8
_MAX_LABELS = 1000  # bound label cardinality of per-stream counters
_TAGS = (b"\xca\xbd", b"\xbd\xca")
_EMPTY = b""


class Counters:
    """Plain counters read by the metrics collector at scrape time.

    ``invalid``, ``broken_meta*`` and ``pings*`` count as logjam-device counts
    (:meth:`Pipeline._slow`); ``received_max_bytes`` is the largest body since the last
    :meth:`roll_max` (the relay's stats tick, 1 s), ``max_bytes_last_second`` the
    largest of the tick before: logjam-device's ``msgs_received_max_bytes``."""

    __slots__ = ("received", "received_bytes", "received_max_bytes", "max_bytes_last_second",
                 "published", "invalid", "invalid_by_reason", "broken_meta",
                 "broken_meta_by_stream", "pings", "pings_by_stream", "bad_pings",
                 "replies_202", "replies_400", "compressed", "compressed_bytes",
                 "compress_errors", "router", "pull", "legacy")

    def __init__(self):
        self.received = 0           # valid data messages accepted
        self.received_bytes = 0     # their body bytes (as received)
        self.received_max_bytes = 0     # the largest since the last roll_max()
        self.max_bytes_last_second = 0  # the largest of the last tick (0 when idle)
        self.published = 0
        self.invalid = 0
        self.invalid_by_reason: Counter[str] = Counter()
        self.broken_meta = 0
        self.broken_meta_by_stream: Counter[str] = Counter()
        self.pings = 0              # pings that asked for a reply (logjam-device's count)
        self.pings_by_stream: Counter[str] = Counter()
        self.bad_pings = 0          # of those, answered 400
        self.replies_202 = 0
        self.replies_400 = 0
        self.compressed = 0
        self.compressed_bytes = 0
        self.compress_errors = 0
        self.router = 0
        self.pull = 0
        self.legacy = 0

    def add_bytes(self, nbytes: int, max_bytes: int) -> None:
        """A drained batch's body bytes, and its largest body."""
        self.received_bytes += nbytes
        if max_bytes > self.received_max_bytes:
            self.received_max_bytes = max_bytes

    def roll_max(self) -> None:
        """The stats tick: the largest body of the tick that ends becomes the gauge, and
        the next tick starts from 0 (logjam-device's timer does the same every second)."""
        self.max_bytes_last_second = self.received_max_bytes
        self.received_max_bytes = 0

    def count_invalid(self, reason: str) -> None:
        self.invalid += 1
        self.invalid_by_reason[reason] += 1

    def count_broken_meta(self, stream: str) -> None:
        self.broken_meta += 1
        if len(self.broken_meta_by_stream) < _MAX_LABELS or stream in self.broken_meta_by_stream:
            self.broken_meta_by_stream[stream] += 1




def safe_label(b: bytes) -> str:
    """A client-chosen name for a log line: at most 80 bytes, non-printables escaped."""
    return repr(bytes(b[:80]))[2:-1]


_relay_log = RateLimitedLog(logging.getLogger("logjam_relay.relay"))


def _label(b: bytes | None) -> str:
    if not b:
        return "unknown-unknown"
    return b[:80].decode("ascii", "replace")


def _broken_meta(frames: list[bytes], router: bool) -> tuple[str, bytes] | None:
    """``(reason, first frame)`` when the message has as many frames as logjam-device
    wants (4 on PULL; 4 after the empty frame of a ROUTER request, 4 without it) and the
    last one, its meta frame, does not decode: the device then counts a broken meta under
    the message's first frame (``ping`` for a ping).  ``frames`` without the routing id."""
    k = 1 if router and frames and frames[0] == _EMPTY else 0
    if len(frames) != 4 + k:
        return None
    why = L.meta_problem(frames[-1])
    return None if why is None else (why, frames[k])


class Pipeline:
    """Validation, stamping and publishing of drained batches.

    ``publish_batch(records)`` (records of four frames, in order) is the PUB adapter's
    hot method.
    """

    def __init__(self, device: int, first_sequence: int, publish_batch, *, fqdn: bytes,
                 allow_invalid_meta: bool = False, compress_method: int = 0, clock_ms=None):
        self.device = device
        self.seq = first_sequence - 1      # last number used
        self.publish_batch = publish_batch
        self.fqdn = fqdn
        self.allow_invalid_meta = allow_invalid_meta
        self.compress_method = compress_method
        self.validator = L.Validator()
        self.counters = Counters()
        dev = device.to_bytes(4, "big")
        # meta prefix (tag, compression, version, device) for every compression byte
        self._prefix = [b"\xca\xbd" + bytes([c, 1]) + dev for c in range(256)]
        self._clock_ms = clock_ms
        self.now8 = _ZERO8

    # -------------------------------------------------------------- prepare
    def prepare_pull(self, batch: list[list[bytes]]) -> list[tuple]:
        """Valid data messages of a PULL batch as ``(app_env, topic, body, compression,
        created_ms_8)`` tuples, in order (the C loop of ``_stamp.c`` for the fast path,
        :meth:`_slow` for each other message; :meth:`prepare_pull_py` without it)."""
        if _stamp is None:
            return self.prepare_pull_py(batch)
        gs = self.validator.good_streams
        gt = self.validator.good_topics
        c = self.counters
        n = len(batch)
        acc, i, nbytes, maxb = _stamp.prepare_pull(batch, 0, gs, gt)
        while i < n:
            self._slow(batch[i], None, acc)
            more, i, nb, mb = _stamp.prepare_pull(batch, i + 1, gs, gt)
            acc += more
            nbytes += nb
            if mb > maxb:
                maxb = mb
        c.pull += n
        c.add_bytes(nbytes, maxb)
        return acc

    def prepare_pull_py(self, batch: list[list[bytes]]) -> list[tuple]:
        acc: list[tuple] = []
        append = acc.append
        gs = self.validator.good_streams
        gt = self.validator.good_topics
        nbytes = 0
        maxb = self.counters.received_max_bytes
        for frames in batch:
            if len(frames) == 4:
                a, t, b, m = frames
                if (a in gs and t in gt) and len(m) == 24 and m[3] == 1 and m[:2] in _TAGS:
                    append((a, t, b, m[2], m[8:16]))
                    lb = len(b)
                    nbytes += lb
                    if lb > maxb:
                        maxb = lb
                    continue
            self._slow(frames, None, acc)
        c = self.counters
        c.pull += len(batch)
        c.add_bytes(nbytes, maxb)          # _slow may have seen a larger one
        return acc

    def prepare_router(self, batch: list[list[bytes]], replies: list[list[bytes]]) -> list[tuple]:
        """Like :meth:`prepare_pull`; reply frames (with routing id) go to ``replies``.

        Replies for accepted requests are appended too: the caller sends them
        only after the batch was committed (and spooled).  The C loop of ``_stamp.c``
        takes the fast path (:meth:`prepare_router_py` without it).
        """
        if _stamp is None:
            return self.prepare_router_py(batch, replies)
        gs = self.validator.good_streams
        gt = self.validator.good_topics
        c = self.counters
        n = len(batch)
        n202 = len(replies)
        acc, i, nbytes, maxb = _stamp.prepare_pull(batch, 0, gs, gt, replies, L.ACCEPTED)
        n202 = len(replies) - n202
        while i < n:
            frames = batch[i]
            self._slow(frames[1:], frames[0], acc, replies)
            k = len(replies)
            more, i, nb, mb = _stamp.prepare_pull(batch, i + 1, gs, gt, replies, L.ACCEPTED)
            n202 += len(replies) - k
            acc += more
            nbytes += nb
            if mb > maxb:
                maxb = mb
        c.router += n
        c.replies_202 += n202
        c.add_bytes(nbytes, maxb)
        return acc

    def prepare_router_py(self, batch: list[list[bytes]],
                          replies: list[list[bytes]]) -> list[tuple]:
        acc: list[tuple] = []
        append = acc.append
        rappend = replies.append
        gs = self.validator.good_streams
        gt = self.validator.good_topics
        nbytes = 0
        n202 = 0
        maxb = self.counters.received_max_bytes
        for frames in batch:
            n = len(frames)
            if n == 6 and frames[1] == _EMPTY:      # request: wants a reply
                ident, _, a, t, b, m = frames
            elif n == 5:                             # async, no empty frame: no reply
                ident, a, t, b, m = frames
            else:
                m = None
            if m is not None and (a in gs and t in gt) and len(m) == 24 and m[3] == 1 \
                    and m[:2] in _TAGS:
                append((a, t, b, m[2], m[8:16]))
                if n == 6:
                    rappend([ident, a, L.ACCEPTED])
                    n202 += 1
                lb = len(b)
                nbytes += lb
                if lb > maxb:
                    maxb = lb
                continue
            self._slow(frames[1:], frames[0], acc, replies)
        c = self.counters
        c.router += len(batch)
        c.replies_202 += n202
        c.add_bytes(nbytes, maxb)          # _slow may have seen a larger one
        return acc

    def _slow(self, frames: list[bytes], ident: bytes | None, acc: list[tuple],
              replies: list[list[bytes]] | None = None) -> None:
        """Everything off the fast path: first sight of a stream, legacy, pings, errors.

        Counted as logjam-device 0.21.4 counts (``read_router_message_and_forward`` and
        ``read_zmq_message_and_forward`` in logjam-device.c; the probe of
        shared/specs/reference/logjam-device.md): a ping counts in ``pings`` (and by the
        stream it names, when it names one) only when it asks for a reply; a bad ping
        (not 4 frames after ``ping``, or a broken meta) is invalid too; a message whose
        meta frame is where the device reads it (the full frame count) and does not
        decode counts as broken meta under its first frame (``ping`` for a ping), whatever
        else is wrong with it, and as invalid -- also when ``allow_invalid_meta`` then
        accepts it."""
        c = self.counters
        router = ident is not None
        if router:
            ev = L.classify_router(frames, self.fqdn, validator=self.validator,
                                   allow_invalid_meta=self.allow_invalid_meta)
        else:
            ev = L.classify_pull(frames, validator=self.validator,
                                 allow_invalid_meta=self.allow_invalid_meta)
        broken = _broken_meta(frames, router)
        if isinstance(ev, L.Data):
            if broken is not None:              # allow_invalid_meta took it anyway
                c.count_invalid(broken[0])
                c.count_broken_meta(_label(broken[1]))
            if ev.meta is None:
                c.legacy += 1
                acc.append((ev.app_env, ev.topic, ev.body, 0, _ZERO8))
            else:
                acc.append((ev.app_env, ev.topic, ev.body, ev.meta.compression,
                            frames[-1][8:16]))
            lb = len(ev.body)
            c.received_bytes += lb
            if lb > c.received_max_bytes:
                c.received_max_bytes = lb
            if ev.reply is not None:
                replies.append([ident, *ev.reply])
                c.replies_202 += 1
            return
        if isinstance(ev, L.Ping):
            if ev.reply is not None:
                c.pings += 1
                if ev.app_env is not None:      # the stream frame is there
                    lbl = _label(ev.app_env)
                    if len(c.pings_by_stream) < _MAX_LABELS or lbl in c.pings_by_stream:
                        c.pings_by_stream[lbl] += 1
                replies.append([ident, *ev.reply])
                if not ev.valid:
                    c.bad_pings += 1
                    c.replies_400 += 1
            if broken is not None:
                c.count_broken_meta(_label(broken[1]))
            if not ev.valid:
                reason = "ping_" + (broken[0] if broken is not None else "frame_count")
                c.count_invalid(reason)
                log.warning(reason, "invalid ping (%s) from %s: %d frames", reason,
                            _label(ev.app_env), len(frames))
            return
        # Invalid: the device checks the frame count, then the meta, then the stream name
        # and the topic; with allow_invalid_meta a broken meta counts and the checks go on
        reason = ev.reason
        if broken is not None:
            c.count_broken_meta(_label(broken[1]))
            if self.allow_invalid_meta:
                c.count_invalid(broken[0])
            else:
                reason = broken[0]
        c.count_invalid(reason)
        if ev.reply is not None:
            replies.append([ident, *ev.reply])
            c.replies_400 += 1
        log.warning(reason, "invalid message (%s) from %s: %d frames", reason,
                    _label(ev.app_env), len(frames))

    def drop_oversize(self, batch: list[list[bytes]], is_router: bool,
                      replies: list[list[bytes]], limit: int) -> list[list[bytes]]:
        """Take out the messages with a frame over max_event_bytes: never published nor
        spooled; a ROUTER request (empty frame after the routing id) is answered
        ``400 Bad Request`` (the only refusal the logjam protocol has), a PULL message is
        dropped; both counted as invalid with reason ``too_large`` and logged (rate
        limited).  Called only when the drain saw a frame over ``limit``."""
        c = self.counters
        keep = []
        for frames in batch:
            big = max(len(f) for f in frames)
            if big <= limit:
                keep.append(frames)
                continue
            c.invalid += 1
            c.invalid_by_reason["too_large"] += 1
            if is_router:
                c.router += 1
                if len(frames) > 1 and frames[1] == b"":
                    first = frames[2] if len(frames) > 2 and len(frames[2]) <= 256 else None
                    replies.append([frames[0], *L.bad_request_reply(first)])
                    c.replies_400 += 1
            else:
                c.pull += 1
            app_env = frames[2] if is_router and len(frames) > 2 and frames[1] == b"" \
                else frames[1] if is_router else frames[0]
            _relay_log.warning("too_large", "message of %d bytes over max_event_bytes (%d) from %s "
                         "on %s: %s", sum(len(f) for f in frames), limit,
                         safe_label(app_env), "router" if is_router else "pull",
                         "answered 400" if is_router else "dropped")
        return keep

    # ----------------------------------------------------------- compression
    def needs_compression(self, acc: list[tuple]) -> list[int]:
        """Indexes of accepted messages whose bodies the relay must compress."""
        if not self.compress_method:
            return []
        return [i for i, x in enumerate(acc) if x[3] == 0]

    def compress_in_place(self, acc: list[tuple], idx: list[int], start: int = 0,
                          stop: int | None = None) -> None:
        """Compress ``acc[i]`` for i in idx[start:stop]. Runs in worker threads; zlib and
        lz4 go through the C batch compressor (GIL released for the whole chunk)."""
        method = self.compress_method
        if _recompress is not None and method in (L.ZLIB_COMPRESSION, L.LZ4_COMPRESSION):
            chunk = idx[start:stop]
            outs = _recompress.compress_batch([acc[i][2] for i in chunk], method)
            for i, b in zip(chunk, outs, strict=True):
                a, t, _, _, cr = acc[i]
                acc[i] = (a, t, b, method, cr)
            return
        comp = L.compress
        for i in idx[start:stop]:
            a, t, b, _, cr = acc[i]
            try:
                acc[i] = (a, t, comp(b, method), method, cr)
            except Exception:  # pragma: no cover - compressors do not fail on bytes
                self.counters.compress_errors += 1

    def count_compressed(self, acc: list[tuple], idx: list[int]) -> None:
        c = self.counters
        c.compressed += len(idx)
        c.compressed_bytes += sum(len(acc[i][2]) for i in idx)

    # ---------------------------------------------------------------- commit
    def commit(self, acc: list[tuple], now_ms: int) -> list[tuple]:
        """Stamp and publish in order; return the records [app, topic, body, meta] to spool
        (the C loop of ``_stamp.c`` when acc is plain, else :meth:`commit_py`)."""
        got = _stamp.commit(acc, self.device, self.seq, now_ms.to_bytes(8, "big")) \
            if _stamp is not None else None
        if got is None:
            return self.commit_py(acc, now_ms)
        out, seq = got
        self.publish_batch(out)
        self.seq = seq
        n = len(acc)
        self.counters.received += n
        self.counters.published += n
        return out

    def commit_py(self, acc: list[tuple], now_ms: int) -> list[tuple]:
        now8 = now_ms.to_bytes(8, "big")
        prefix = self._prefix
        seq = self.seq
        out = []
        oappend = out.append
        for a, t, b, comp, cr in acc:
            seq += 1
            if cr == _ZERO8:
                cr = now8
            oappend((a, t, b, prefix[comp] + cr + seq.to_bytes(8, "big")))
        self.publish_batch(out)
        self.seq = seq
        n = len(acc)
        self.counters.received += n
        self.counters.published += n
        return out

    def stamp_pull(self, batch: list[list[bytes]], now_ms: int) -> list[tuple]:
        """:meth:`prepare_pull` and :meth:`commit` in one pass, for PULL batches when the
        relay does not compress (no ``-x``): the C loop of ``_stamp.c`` takes every
        fast-path message and stops at the others, which go through :meth:`_slow` one by
        one, in order.  Same records, sequence numbers, counters and publish as the two
        steps (tests/test_stamp.py); without the extension it is those two steps."""
        if _stamp is None:
            acc = self.prepare_pull(batch)
            return self.commit(acc, now_ms) if acc else []
        now8 = now_ms.to_bytes(8, "big")
        gs = self.validator.good_streams
        gt = self.validator.good_topics
        c = self.counters
        seq = self.seq
        n = len(batch)
        out, seq, i, nbytes, maxb = _stamp.stamp_pull(batch, 0, gs, gt, self.device, seq, now8)
        while i < n:
            acc: list[tuple] = []
            self._slow(batch[i], None, acc)
            prefix = self._prefix
            for a, t, b, comp, cr in acc:
                seq += 1
                out.append((a, t, b, prefix[comp] + (now8 if cr == _ZERO8 else cr)
                            + seq.to_bytes(8, "big")))
            recs, seq, i, nb, mb = _stamp.stamp_pull(batch, i + 1, gs, gt, self.device, seq,
                                                     now8)
            out += recs
            nbytes += nb
            if mb > maxb:
                maxb = mb
        c.pull += n
        c.add_bytes(nbytes, maxb)
        if out:
            self.publish_batch(out)
            self.seq = seq
            k = len(out)
            c.received += k
            c.published += k
        return out

    def next_sequence(self) -> int:
        """Take one number (heartbeats share the counter with data)."""
        self.seq += 1
        return self.seq
