"""The C Lumberjack mapping (_ljencode.encode) on records that share frame objects (as
the worker's spool reads give them, spool/_tailread.c) and on edge numbers equals the
Python mapping: the memo of the last (app_env, topic) never gives a wrong pair."""

import random

from conftest import require_native
from logjam_relay.outputs import lumberjack_encode as le
from logjam_relay.protocols.logjam import encode_meta
from logjam_relay.spool.api import KIND_LOGJAM, Position, Record


def clear_cache_while_encoding(c) -> None:
    """Make encoder ``c`` clear its stream cache on every lookup (while encoding)."""
    orig = c._stream_pairs

    def pairs_and_clear(app_env, topic):
        r = orig(app_env, topic)
        c._stream_cache.clear()
        return r
    c._stream_pairs = pairs_and_clear

def test_shared_and_changing_frame_objects():
    require_native(le._ljencode, "logjam_relay.outputs._ljencode")
    a, b = b"shop-prod", b"other-env"
    ta, tb = b"logs.a", b"logs.b"
    rnd = random.Random(5)
    recs = []
    for i in range(500):
        app = rnd.choice((a, b, bytes(a)))          # the same object, or an equal copy
        topic = rnd.choice((ta, tb, bytes(tb)))
        if rnd.random() < 0.1:
            app = b"x-" + str(i).encode()            # a new pair now and then
        meta = encode_meta(0, rnd.choice((0, 1, 9, 10, 2**32 - 1)),
                           rnd.choice((0, 9, 10, 99, 2**64 - 1)), rnd.choice((0, 10**19, 2**64 - 1)))
        recs.append(Record(Position(0, i), KIND_LOGJAM, [app, topic, b'{"i":%d}' % i, meta]))
    for cut in (1, 2, 17, 500):
        c, py = le.EventEncoder("relay"), le.EventEncoder("relay")
        assert c.encode(recs[:cut]) == py.encode_py(recs[:cut])


def test_a_small_pair_cache_is_cleared_and_still_right(monkeypatch):
    require_native(le._ljencode, "logjam_relay.outputs._ljencode")
    recs = [Record(Position(0, i), KIND_LOGJAM,
                   [b"app-%d" % (i % 7), b"t", b"{}", encode_meta(0, 1, 2, 3)]) for i in range(50)]
    c, py = le.EventEncoder("relay"), le.EventEncoder("relay")
    c._stream_cache.clear()
    clear_cache_while_encoding(c)
    assert c.encode(recs) == py.encode_py(recs)
