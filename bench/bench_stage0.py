"""Stage 0 of the ``jvm`` engine alone, without Spark: the JVM reader's decode, extraction
and partial aggregation of every segment of an archive (``bench/jvm/.../Stage0Bench.java``
driving ``SegmentDecoder`` + ``Partials`` as ``PartialScan.Reader`` does), in a plain JVM
with Spark's jars on the class path.  Prints per pass the worker threads' CPU (per record),
the process CPU (JIT compiler and GC threads included), wall time, the JIT's compilation
time so far and a digest of the partial rows (equal digests: equal partial rows).

    python bench/bench_stage0.py ARCHIVE [--passes 3] [--threads 2] [--rev GITREV]
                                 [--java-opts "-XX:..."]

``--rev``: the reader's sources of that git revision (to compare before/after in one
session); the harness is compiled with them, with Janino as ``jvmreader.build`` does.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from logjam_relay.pipeline import jvmreader  # noqa: E402
from logjam_relay.pipeline.jvmcache import find_java, spark_jars  # noqa: E402

REL = "src/logjam_relay/pipeline/jvm/logjamrelay/spark"
HARNESS = os.path.join(HERE, "jvm", "logjamrelay", "spark", "Stage0Bench.java")


def sources(rev: str | None, tmp: str) -> list[str]:
    if rev is None:
        return jvmreader.sources()
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=HERE, check=True,
                          capture_output=True, text=True).stdout.strip()
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{REL}"], cwd=root,
                           check=True, capture_output=True, text=True).stdout.split()
    out = []
    d = os.path.join(tmp, "src")
    os.makedirs(d)
    for n in names:
        if n.endswith(".java"):
            p = os.path.join(d, n)
            with open(p, "wb") as fh:
                fh.write(subprocess.run(["git", "show", f"{rev}:{REL}/{n}"], cwd=root,
                                        check=True, capture_output=True).stdout)
            out.append(p)
    return sorted(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("archive")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rev", default=None)
    ap.add_argument("--java-opts", default="")
    ap.add_argument("--heap", default="2g")
    ap.add_argument("--no-native", action="store_true",
                    help="leave the native zlib path (_jinflate) out: Inflater alone")
    ap.add_argument("--mode", default="agg", choices=("agg", "walk", "bodies"),
                    help="agg: as PartialScan (default); walk: the record walk and CRC "
                         "only; bodies: the walk, decompression and UTF-8 check")
    a = ap.parse_args()
    jars = spark_jars()
    java = find_java()
    compiler = [j for j in jars if os.path.basename(j).startswith(("janino-", "commons-compiler-"))]
    with tempfile.TemporaryDirectory(prefix="stage0-") as tmp:
        classes = os.path.join(tmp, "classes")
        os.mkdir(classes)
        t0 = time.perf_counter()
        r = subprocess.run([java, "-cp", os.pathsep.join(compiler), jvmreader._COMPILER,
                            "-d", classes, "-classpath", os.pathsep.join(jars),
                            *sources(a.rev, tmp), HARNESS], capture_output=True, text=True)
        out = (r.stdout + r.stderr).strip()
        if r.returncode != 0 or "CompileException" in out:
            print(out[-3000:])
            return 1
        print(f"compiled ({a.rev or 'working tree'}) in {time.perf_counter() - t0:.1f} s",
              flush=True)
        # the native zlib path, where the jar has it (jvmreader.build), unless --no-native
        native = jvmreader.native_library()
        if native and not a.no_native and os.path.exists(os.path.join(
                classes, "logjamrelay", "spark", "NativeInflate.class")):
            dest = os.path.join(classes, jvmreader.NATIVE_RESOURCE)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copyfile(native, dest)
        print(f"native zlib path: {'yes' if native and not a.no_native else 'no'}",
              flush=True)
        cmd = [java, f"-Xmx{a.heap}", *shlex.split(a.java_opts), "-cp",
               os.pathsep.join([classes, *jars]), "logjamrelay.spark.Stage0Bench",
               a.archive, str(a.passes), str(a.threads), a.mode]
        t0 = time.perf_counter()
        r = subprocess.run(cmd)
        print(f"java exited {r.returncode} after {time.perf_counter() - t0:.2f} s "
              f"(opts: {a.java_opts or 'default'})")
        return r.returncode


if __name__ == "__main__":
    raise SystemExit(main())
