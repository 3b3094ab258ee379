"""The durable spool: an append-only log of segment files, read by the outputs through
per-output cursors (docs/spool-format.md has the on-disk format; docs/architecture.md the
parts).

The parts, each owning its own state (modelled on Vector's disk buffer v2)::

    spool.py     Spool: composes the parts below; the API the relay and outputs use
    ledger.py    Ledger: the shared positions (segments on disk, next segno/seq, bytes);
                 the others read them, they change only through its methods
    fsyncpolicy.py  FsyncPolicy: when fdatasync is called and who waits for it; given to
                 the spool when it is built, asked by the writer, readers, tick/run and
                 the relay's group commit (never set afterwards)
    writer.py    SegmentWriter: append (syncing as the policy says), sealing, spool.state
    space.py     SpaceBudget: max_bytes, the reserve file, the full disk, drop_oldest
    damage.py    Damage: the gaps (seq ranges known to be gone) and damaged records
    recovery.py  recover(directory, cursors) -> Recovered: what is on disk and the loss
                 found; place_cursor(): where a reader starts
    reader.py    SpoolReader: one output's view (read, ack, rewind, loss accounting)
    cursors.py   the durable cursor logs
    segment.py   the segment file format (records, header, seal; scans)
    chunkread.py how much a reader reads of a segment file, and what a record its chunk
                 holds only in part means (torn, short file, read again): the relay's
                 reader and a worker's tail both ask it
    fs.py        Filesystem: the seam every file operation goes through (tests: a model)
    tail.py      reading the segment files from an output's worker process
    fsck.py      the offline check/repair; errors.py exceptions; api.py the reader protocol

Design invariants:

1. Records are appended, never rewritten: a ``.open`` segment grows by whole batches (one
   ``write()`` each; a failed write is cut off again, so nothing of it is readable), a
   sealed ``.seg`` is immutable (it may be hard-linked into the archive).
2. Sequence numbers are dense and increase by one per record, across segments and
   restarts (``spool.state`` keeps the numbering when no segment is left).
3. Every record is, for every reader, either delivered (acknowledged) or counted as lost
   exactly once, with a reason: seq ranges known to be gone are *gaps*
   (:class:`damage.Damage`), and a reader's acknowledged cursor only moves forward.
4. A reader's cursor is made durable before a segment it allows to delete is deleted; a
   cursor that does not point at a record is relocated by its seq (duplicates, no loss).
5. What ``sync``/``sync_async`` returned for is on disk (``fsync``: batch, interval,
   never; also the records of a segment whose seal runs in the background, and a new
   segment's name: they wait for the seals queued before them); recovery cuts a torn or
   damaged ``.open`` tail, never a ``.seg``, and damage costs only the damaged records.
6. A full disk never deadlocks: the reserve file gives a seal its space, the seal is
   deferred otherwise, and ``block`` pauses ingress instead of failing.
7. Every descriptor the spool opens, duplicates or closes goes through the fd reserve
   (``fs.OS``: segments, state, reserve and lock files, the recovery's scans;
   ``cursors.CursorLog``: the cursor logs), so the spool works when the process runs
   out.  (Reading the cursors at start-up, ``cursors.load``, uses ``open()``.)
8. Parts talk through small interfaces: the writer asks the budget only for the segment
   limit and the reserve; recovery is a function that returns what it found; only
   :class:`spool.Spool` knows the readers and the writer together.  No part reaches
   into another's private state (tests/test_architecture.py checks every ``x._name``).
"""
