"""Only for the optional C extensions; all metadata is in pyproject.toml.

``logjam_relay.io._zmqfast`` (batch receive/publish on pyzmq sockets),
``logjam_relay.outputs._ljencode`` and ``_courierenc`` (the Lumberjack and Courier event
mappings),
``logjam_relay.relay._recompress`` (batch recompression without the GIL),
``logjam_relay.relay._stamp`` (the PULL validate + stamp loop, and its halves for -x) and
``logjam_relay.spool._segscan`` (record parsing, the Spark data source's walk) and
``_segenc`` (record encoding, the spool's write side) and ``_syncthread`` (the group
commit's fdatasync thread) and
``logjam_relay.pipeline._jinflate`` (the JVM reader's fast zlib path) are built when a C
compiler and the Python headers (and zlib.h) are there; if a build fails, the install
goes on and the pure-Python code is used (``logjam-relay --version`` says which).
"""

from setuptools import Extension, setup

# the shared headers (docs/architecture.md, "The C twins' shared code"): each extension
# depends on those it includes, directly or through another header
_C = "src/logjam_relay/_c/"
META = [_C + "meta.h"]                                   # the logjam meta frame: check, stamp
RECORD = [_C + "record_crc.h", _C + "record.h", _C + "crc32.h"]  # the spool record: encoding, checks
WALK = ["src/logjam_relay/spool/_walk.h", *RECORD]       # the spool readers' record walk
RECBLOCK = ["src/logjam_relay/spool/_recblock.h", _C + "record.h"]  # a worker's reads, one buffer

setup(ext_modules=[
    # (and the relay's ingest pass: drain + stamp + publish + spool records; zlib.h: crc32)
    Extension("logjam_relay.io._zmqfast", ["src/logjam_relay/io/_zmqfast.c"],
              depends=[*META, *RECORD],
              optional=True, libraries=["z"], extra_compile_args=["-O2", "-std=c11"]),
    # batch recompression (-x zlib|lz4) with the GIL released
    Extension("logjam_relay.relay._recompress", ["src/logjam_relay/relay/_recompress.c"],
              optional=True, libraries=["z"], extra_compile_args=["-O2", "-std=c11"]),
    # the relay's PULL validate + stamp loop (relay/stamping.py: Pipeline.stamp_pull)
    Extension("logjam_relay.relay._stamp", ["src/logjam_relay/relay/_stamp.c"],
              depends=META, optional=True, extra_compile_args=["-O2", "-std=c11"]),
    # the Courier output's event mapping (common case)
    Extension("logjam_relay.outputs._courierenc", ["src/logjam_relay/outputs/_courierenc.c"],
              depends=[*META, *RECBLOCK, "src/logjam_relay/outputs/_jsonvalid.h",
                       "src/logjam_relay/outputs/_decimal.h"],
              optional=True, extra_compile_args=["-O2", "-std=c11"]),
    # the Lumberjack output's event mapping
    Extension("logjam_relay.outputs._ljencode", ["src/logjam_relay/outputs/_ljencode.c"],
              depends=[*META, *RECBLOCK, "src/logjam_relay/outputs/_decimal.h"],
              optional=True, libraries=["z", "pthread"], extra_compile_args=["-O2", "-std=c11"]),
    # the spool's record parsing and the Spark data source's segment walk (zlib.h: crc32)
    Extension("logjam_relay.spool._segscan", ["src/logjam_relay/spool/_segscan.c"],
              depends=[*META, *WALK],
              optional=True, libraries=["z"], extra_compile_args=["-O2", "-std=c11"]),
    # the spool's record encoder, write side (zlib.h: crc32)
    Extension("logjam_relay.spool._segenc", ["src/logjam_relay/spool/_segenc.c"],
              depends=RECORD, optional=True, libraries=["z"],
              extra_compile_args=["-O2", "-std=c11"]),
    # the group commit's fdatasync thread (spool/syncthread.py), never takes the GIL
    Extension("logjam_relay.spool._syncthread", ["src/logjam_relay/spool/_syncthread.c"],
              optional=True, libraries=["pthread"], extra_compile_args=["-O2", "-std=c11"]),
    # an output worker's reads of the spool segments (spool/tail.py)
    Extension("logjam_relay.spool._tailread", ["src/logjam_relay/spool/_tailread.c"],
              depends=[*WALK, *RECBLOCK], optional=True, libraries=["z"],
              extra_compile_args=["-O2", "-std=c11"]),
    # the request fields of logs bodies for the Spark data source (pipeline/extract.py)
    Extension("logjam_relay.pipeline._extract", ["src/logjam_relay/pipeline/_extract.c"],
              optional=True, extra_compile_args=["-O2", "-std=c11"]),
    # the JVM reader's fast zlib path (libdeflate, loaded with dlopen, behind zlib's rules):
    # a JNI library with primitive arguments only (no jni.h needed); jvmreader puts it in
    # the reader's jar
    Extension("logjam_relay.pipeline._jinflate", ["src/logjam_relay/pipeline/_jinflate.c"],
              depends=["src/logjam_relay/pipeline/_fastinflate.h"],
              optional=True, libraries=["dl"], extra_compile_args=["-O2", "-std=c11"]),
    # the body decompression (zlib, snappy, lz4) and UTF-8 check of the Spark data source
    # (zlib bodies through the same fast path as the JVM reader's, _fastinflate.h)
    Extension("logjam_relay.pipeline._bodies", ["src/logjam_relay/pipeline/_bodies.c"],
              depends=["src/logjam_relay/pipeline/_fastinflate.h"],
              optional=True, libraries=["z", "dl"], extra_compile_args=["-O2", "-std=c11"]),
])
