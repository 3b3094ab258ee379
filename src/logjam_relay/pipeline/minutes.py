"""The minute a record counts at: one rule for every engine of the stats tables.

A record's times are epoch-millisecond integers that nobody checked: ``created_ms`` is
whatever the producer wrote into the meta frame (the relay does not judge clocks),
``started_ms`` whatever the request body says.  The tables key rows by minute and by date,
and a time beyond the calendar can be neither: Spark's ``timestamp_millis`` overflows beyond
about ±292,000 years, Python's ``datetime`` stops at the year 9999, and PySpark's
``collect()`` turns a timestamp into a local ``datetime`` (a minute on 9999-12-31 UTC is in
the year 10000 east of Greenwich).  One such record used to fail the whole run, and a
streaming query at every restart.

The rule (:data:`MIN_MS` .. :data:`MAX_MS`: from the Unix epoch to the end of 9999-12-30
UTC, every minute of which any engine and any time zone can show):

* a request counts at its ``started_ms`` (or ``started_at``) when that lies in the range,
  else at its ``created_ms`` -- a started time out of range is treated as absent;
* a time that is still out of range (``created_ms`` before 1970 or after 9999-12-30) is no
  time: the record counts at minute 0, **1970-01-01 00:00 UTC**, where a producer whose
  clock was never set puts its records anyway.  Nothing is dropped: the record is in
  request_stats/topics and in its device's loss accounting, at that minute.

``started_ms`` and ``created_ms`` are kept as they came in the decoded columns; only the
minute is decided here.  Twins: ``Constants.minute`` / ``Constants.inRange`` (the JVM
reader's aggregation and loss runs), :func:`minutes_of` / :func:`request_times` (numpy,
pyarrow) and :func:`minute_col` / :func:`request_time_col` (Spark SQL, streaming); the tests
compare them with :func:`minute_of` and :func:`request_time`.
"""

from __future__ import annotations

import numpy as np

#: the first time that counts as itself: 1970-01-01T00:00:00.000Z
MIN_MS = 0
#: the last: 9999-12-30T23:59:59.999Z
MAX_MS = 253_402_214_399_999
MINUTE_MS = 60_000


def in_range(ms: int) -> bool:
    return MIN_MS <= ms <= MAX_MS


def minute_of(ms: int) -> int:
    """The minute (epoch ms) a time counts at: floored to the minute; out of range: 0."""
    return ms - ms % MINUTE_MS if MIN_MS <= ms <= MAX_MS else 0


def request_time(started: int | None, created: int) -> int:
    """The time a request counts at: ``started`` when it is in range, else ``created``."""
    return started if started is not None and MIN_MS <= started <= MAX_MS else created


def minutes_of(ms: np.ndarray) -> np.ndarray:
    """:func:`minute_of` of an int64 array."""
    v = ms.astype(np.int64, copy=False)
    return np.where((v >= MIN_MS) & (v <= MAX_MS), v - np.mod(v, MINUTE_MS), 0)


def minute_col(c):
    """:func:`minute_of` of a Spark long column (nulls stay null)."""
    from pyspark.sql import functions as F
    return F.when(c.between(F.lit(MIN_MS), F.lit(MAX_MS)), c - F.pmod(c, F.lit(MINUTE_MS))) \
        .when(c.isNotNull(), F.lit(0))


def request_time_col(started, created):
    """:func:`request_time` of two Spark long columns."""
    from pyspark.sql import functions as F
    return F.when(started.between(F.lit(MIN_MS), F.lit(MAX_MS)), started).otherwise(created)


def request_times(started, created):
    """:func:`request_time` of two pyarrow int64 arrays (nulls in ``started``)."""
    import pyarrow.compute as pc
    ok = pc.fill_null(pc.and_(pc.greater_equal(started, MIN_MS),
                              pc.less_equal(started, MAX_MS)), False)
    return pc.if_else(ok, started, created)
