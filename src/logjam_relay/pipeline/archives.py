"""Where an archive is: a local directory, or a Hadoop file system URI (pure).

``--input`` and the data source take either:

* a **plain path**: a directory of the local file system.  The driver reads it for the
  origin walk (:mod:`.originindex`), and every executor must see it at the same path;
* a **URI with a scheme** -- ``file://``, ``hdfs://``, ``s3a://``, whatever the cluster's
  Hadoop has a file system for: the JVM reader lists and reads it through Hadoop's
  ``FileSystem`` with Spark's Hadoop configuration (``spark.hadoop.*``;
  ``pipeline/jvm/.../Store.java``), on the executors, and the origin walk runs as a Spark
  job too (:meth:`.originindex.OriginIndex.add_archive_spark`): the driver reads no file.

The Python parts of the pipeline (the ``python`` engine, ``--stream``, ``--remote``) read
local files: a plain path, or a ``file://`` URI as its path; they refuse other schemes.
"""

from __future__ import annotations

import os
import re
from urllib.parse import unquote, urlsplit

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def is_uri(p: str) -> bool:
    """Whether ``p`` names a file system by a scheme (``file://``, ``hdfs://``, ...)."""
    return bool(_SCHEME.match(str(p)))


def scheme(p: str) -> str | None:
    return str(p).split("://", 1)[0].lower() if is_uri(p) else None


def local_path(p: str) -> str | None:
    """The local path of ``p``: itself when plain, the path of a ``file://`` URI, None for
    any other scheme."""
    p = os.fspath(p)
    if not is_uri(p):
        return p
    if scheme(p) == "file":
        return unquote(urlsplit(p).path)
    return None


def dir_key(p: str) -> str:
    """One spelling of an archive directory (the key of its segments'
    :attr:`.originindex.OriginIndex.exclude` entries)."""
    lp = local_path(p)
    return os.path.abspath(lp) if lp is not None else os.fspath(p).rstrip("/")


def segment_key(archive: str, name: str) -> str:
    """The key of the segment file ``name`` of ``archive``: its absolute local path, or
    the URI of a file on another file system."""
    d = dir_key(archive)
    return os.path.join(d, name) if local_path(archive) is not None else f"{d}/{name}"


def local_only(inputs, what: str) -> list[str]:
    """The local paths of ``inputs`` for a part that reads local files (``what``); raises
    ``ValueError`` naming the first input on another file system."""
    out = []
    for p in inputs:
        lp = local_path(p)
        if lp is None:
            raise ValueError(f"{what} reads local archives only (a path or file://), "
                             f"not {p}")
        out.append(lp)
    return out
