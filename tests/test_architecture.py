"""The package's architecture, read from its own imports (docs/architecture.md, "Layers").

Every module of ``src/logjam_relay`` is parsed with ``ast``; every import counts, at module
level or inside a function, absolute or relative, and so does a C twin loaded by name
(``_native.load("logjam_relay.x._y")``, ``importlib.import_module("...")``).  Three rules:

* an import points down: a module imports modules of its own part (``outputs/`` for
  ``outputs.courier``) or of a part on a lower floor of :data:`FLOORS`;
* no import cycle between modules;
* no module imports another module's ``_private`` names (``from .x import _y``, or
  ``x._y`` on an imported module);
* parts talk through methods: no ``x._name`` where ``x`` is not ``self``, ``cls`` or the
  module itself (:func:`reaches`).  What the import check cannot see, an object's private
  state reached from outside it (``reader._read_pos``, ``r._log.compact``), fails here.
  Names bound by importing another project (``os._exit``, ``SparkContext._jvm``) are that
  project's interface, not a part of this package, and are not counted;
* the C files follow the same floors: every ``#include "..."`` of a ``.c`` or ``.h`` file
  under ``src/`` names a file of the package that exists, in its own part or a part on a
  lower floor (:func:`c_includes`, :func:`includes_against_floors`).  Code two C twins of
  different floors share lives on the lowest one (``_c/``, the base floor), never in the
  higher user's folder.  System headers are ``#include <...>`` and not counted.

The floors are listed once, here; docs/architecture.md shows the same table (checked
below).  Run: ``.venv/dev/bin/python -m pytest tests/test_architecture.py -q``.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PKG = "logjam_relay"
DOC = ROOT / "docs" / "architecture.md"

#: bottom to top: (name, the parts on that floor).  A part is a top-level package or module
#: of logjam_relay ("__init__" is the package's own __init__.py).  A part may import its own
#: modules and the parts of the floors below it, nothing on its floor or above.
FLOORS: list[tuple[str, set[str]]] = [
    ("base", {"__init__", "_native", "units", "limits", "redact", "ratelimit", "gc_tuning",
              "fdreserve", "progress", "_c"}),
    ("config", {"config"}),
    ("protocols", {"protocols"}),
    ("io", {"io"}),
    ("spool", {"spool"}),
    ("subsystems", {"outputs", "inputs", "samwise", "health", "deadletter"}),
    ("composition", {"relay"}),
    ("applications", {"tools", "pipeline"}),
    ("command", {"cli"}),
    ("entry", {"__main__"}),
]

#: cycles between modules that are allowed for now, each as the exact set of its modules
KNOWN_CYCLES: list[frozenset[str]] = []

#: (importing module, module, private name) allowed for now
KNOWN_PRIVATE: set[tuple[str, str, str]] = set()


# ------------------------------------------------------------------------------ the walk

@dataclass(frozen=True)
class Edge:
    src: str        # importing module, without the package prefix ("outputs.courier")
    dst: str        # imported module ("protocols.courier"; "" is the package itself)
    line: int

    def __str__(self) -> str:
        return f"{_show(self.src)} -> {_show(self.dst)} (line {self.line})"


@dataclass(frozen=True)
class Private:
    src: str
    module: str
    name: str
    line: int

    def key(self) -> tuple[str, str, str]:
        return (self.src, self.module, self.name)

    def __str__(self) -> str:
        return f"{_show(self.src)} uses {_show(self.module)}.{self.name} (line {self.line})"


def _show(mod: str) -> str:
    return f"{PKG}.{mod}" if mod else PKG


def modules(src: Path, pkg: str) -> tuple[dict[str, Path], set[str]]:
    """{module: path} of the Python modules under ``src/pkg`` and the set of C twins
    (a ``.c`` file that is an extension module: ``io/_zmqfast.c`` -> ``io._zmqfast``),
    names relative to the package ("" is its __init__)."""
    mods: dict[str, Path] = {}
    native: set[str] = set()
    base = src / pkg
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "__pycache__"))]
        rel = Path(dirpath).relative_to(base).parts
        for f in filenames:
            stem, ext = os.path.splitext(f)
            if ext == ".py":
                parts = rel if stem == "__init__" else (*rel, stem)
                mods[".".join(parts)] = Path(dirpath) / f
            elif ext == ".c" and "PyInit_" in (Path(dirpath) / f).read_text(errors="replace"):
                native.add(".".join((*rel, stem)))
    return mods, native


def walk(src: Path = SRC, pkg: str = PKG) -> tuple[dict[str, Path], set[str], list[Edge],
                                                     list[Private]]:
    """Every import edge and every use of another module's private name in ``pkg``."""
    mods, native = modules(src, pkg)
    known = set(mods) | native
    edges: list[Edge] = []
    private: list[Private] = []

    def rel(name: str) -> str | None:
        """'logjam_relay.x.y' -> 'x.y' (None outside the package)."""
        if name == pkg:
            return ""
        return name[len(pkg) + 1:] if name.startswith(pkg + ".") else None

    def existing(name: str) -> str:
        """The module itself, else its nearest enclosing package (an attribute of it)."""
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        here = [pkg, *mod.split(".")] if mod else [pkg]
        if not is_pkg:
            here = here[:-1]
        aliases: dict[str, str] = {}       # local name -> package module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    r = rel(a.name)
                    if r is None:
                        continue
                    edges.append(Edge(mod, existing(r), node.lineno))
                    if a.asname:
                        aliases[a.asname] = existing(r)
                    else:
                        aliases[a.name.partition(".")[0]] = ""
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = here[:len(here) - (node.level - 1)]
                    target = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                r = rel(target)
                if r is None:
                    continue
                for a in node.names:
                    full = f"{r}.{a.name}" if r else a.name
                    if full in known:                      # a module: an edge to it
                        edges.append(Edge(mod, full, node.lineno))
                        aliases[a.asname or a.name] = full
                        continue
                    edges.append(Edge(mod, existing(r), node.lineno))
                    if _is_private(a.name) and existing(r) != mod:
                        private.append(Private(mod, existing(r), a.name, node.lineno))
            elif isinstance(node, ast.Call) and node.args:
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                arg = node.args[0]
                if name in ("load", "import_module") and isinstance(arg, ast.Constant) \
                        and isinstance(arg.value, str):
                    r = rel(arg.value)
                    if r is not None:
                        edges.append(Edge(mod, existing(r), node.lineno))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in aliases and _is_private(node.attr):
                owner = aliases[node.value.id]
                full = f"{owner}.{node.attr}" if owner else node.attr
                if full not in known and owner != mod:
                    private.append(Private(mod, owner, node.attr, node.lineno))
    return mods, native, edges, private


@dataclass(frozen=True)
class Reach:
    mod: str
    expr: str
    line: int

    def __str__(self) -> str:
        return f"{_show(self.mod)} line {self.line}: {self.expr}"


def reaches(src: Path = SRC, pkg: str = PKG) -> list[Reach]:
    """Every ``x._name`` (attribute read, write or call) in ``pkg`` whose ``x`` is not
    ``self``, ``cls``, the module itself, or a name the module binds by importing from
    outside ``pkg``.  ``self.other._name`` counts: ``self.other`` is another object."""
    mods, _ = modules(src, pkg)
    out: list[Reach] = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        foreign: set[str] = set()           # names bound to another project's objects
        itself: set[str] = set()            # names bound to this very module
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    local = a.asname or a.name.partition(".")[0]
                    if a.name == pkg or a.name.startswith(pkg + "."):
                        if a.asname and a.name == ".".join(filter(None, (pkg, mod))):
                            itself.add(local)
                    else:
                        foreign.add(local)
            elif isinstance(node, ast.ImportFrom) and not node.level:
                name = node.module or ""
                if name != pkg and not name.startswith(pkg + "."):
                    foreign.update(a.asname or a.name for a in node.names)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
                continue
            v = node.value
            if isinstance(v, ast.Name) and (v.id in ("self", "cls") or v.id in foreign
                                            or v.id in itself):
                continue
            out.append(Reach(mod, ast.unparse(node), node.lineno))
    return out


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def part(mod: str) -> str:
    """The top-level part of a module: 'outputs.courier' -> 'outputs', '' -> '__init__'."""
    return mod.split(".")[0] if mod else "__init__"


def upward(edges, floors, native=frozenset()) -> list[str]:
    """Edges that point to the same floor (another part) or up.  A C twin is a leaf that
    imports nothing: it counts as the bottom floor wherever its source file sits."""
    bad = []
    for e in edges:
        if e.dst not in native and (why := against_floors(part(e.src), part(e.dst), floors)):
            bad.append(f"{e}: imports {why}")
    return bad


def against_floors(a: str, b: str, floors) -> str | None:
    """How part ``a`` using part ``b`` breaks the floors: "up ..." or "sideways ..."
    (another part of its own floor); None when it does not (its own part, a lower floor,
    or a part without a floor, which fails its own test)."""
    floor_of = {p: i for i, (_, parts) in enumerate(floors) for p in parts}
    if a == b or a not in floor_of or b not in floor_of or floor_of[b] < floor_of[a]:
        return None
    how = "sideways" if floor_of[b] == floor_of[a] else "up"
    return (f"{how}: {a} (floor {floors[floor_of[a]][0]}) -> {b} "
            f"(floor {floors[floor_of[b]][0]})")


def cycles(edges, mods) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for e in edges:
        if e.dst in mods and e.dst != e.src:
            graph[e.src].add(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@dataclass(frozen=True)
class Include:
    src: str            # the including file, relative to the package ("io/_zmqfast.c")
    dst: str | None     # the file it names, resolved ("_c/record.h"); None: not in the package
    line: int
    text: str           # as written ("../_c/record.h")

    def __str__(self) -> str:
        return f'{self.src} line {self.line}: #include "{self.text}"'


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]*)"')


def c_files(src: Path = SRC, pkg: str = PKG) -> dict[str, Path]:
    """{path relative to the package: path} of every .c and .h file under ``src/pkg``."""
    base = src / pkg
    out: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "__pycache__"))]
        for f in filenames:
            if f.endswith((".c", ".h")):
                p = Path(dirpath) / f
                out[p.relative_to(base).as_posix()] = p
    return out


def c_part(rel: str) -> str:
    """The top-level part of a C file: 'io/_zmqfast.c' -> 'io', '_c/record.h' -> '_c'; a
    file directly in the package is a part of its own ('_x.h' -> '_x')."""
    first, sep, _ = rel.partition("/")
    return first if sep else os.path.splitext(first)[0]


def c_includes(src: Path = SRC, pkg: str = PKG) -> list[Include]:
    """Every ``#include "..."`` line of every C file of ``pkg``, resolved as the compiler
    does for quotes (from the including file's folder; setup.py gives no -I of its own)."""
    base = (src / pkg).resolve()
    out: list[Include] = []
    for rel, path in sorted(c_files(src, pkg).items()):
        for no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = _INCLUDE.match(line)
            if not m:
                continue
            target = (path.parent / m.group(1)).resolve()
            inside = target.is_file() and target.is_relative_to(base)
            out.append(Include(rel, target.relative_to(base).as_posix() if inside else None,
                               no, m.group(1)))
    return out


def includes_against_floors(incs, floors) -> list[str]:
    """Includes that name no file of the package, or a file of another part on the same
    floor (sideways) or on a higher one (up)."""
    bad = []
    for inc in incs:
        if inc.dst is None:
            bad.append(f"{inc}: names no file of the package (a system header is <...>)")
        elif why := against_floors(c_part(inc.src), c_part(inc.dst), floors):
            bad.append(f"{inc}: includes {why}")
    return bad


@pytest.fixture(scope="module")
def package():
    return walk()


# ------------------------------------------------------------------------------ the rules

def test_every_part_has_a_floor(package):
    """Every top-level part, of Python modules or of C files (``_c/`` has only headers),
    is on exactly one floor."""
    mods, _, _, _ = package
    parts = {part(m) for m in mods} | {c_part(f) for f in c_files()}
    placed = [p for _, parts in FLOORS for p in parts]
    assert len(placed) == len(set(placed)), "a part is on two floors"
    missing = sorted(parts - set(placed))
    assert not missing, (f"new top-level part(s) {missing}: give each a floor in FLOORS "
                         "(tests/test_architecture.py) and in docs/architecture.md")
    gone = sorted(set(placed) - parts)
    assert not gone, f"FLOORS names part(s) that no longer exist: {gone}"


def test_no_import_points_up_a_floor(package):
    _, native, edges, _ = package
    bad = upward(edges, FLOORS, native)
    assert not bad, "imports that do not point down:\n" + "\n".join(bad)


def test_no_c_include_points_up_or_sideways():
    """The C files keep the floors too: ``io/_zmqfast.c`` (io) may include ``_c/`` (base),
    not ``spool/`` (above it); ``outputs/`` may include ``spool/`` (below it)."""
    incs = c_includes()
    assert incs, "no C include found: the walk is blind"
    bad = includes_against_floors(incs, FLOORS)
    assert not bad, "C includes that do not point down:\n" + "\n".join(bad)


def test_no_import_cycle_between_modules(package):
    mods, _, edges, _ = package
    found = cycles(edges, mods)
    new = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert not new, f"import cycles: {new}"
    stale = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not stale, f"KNOWN_CYCLES lists cycles that are gone (remove them): {stale}"


def test_no_module_uses_another_modules_private_names(package):
    _, _, _, private = package
    new = sorted({str(p) for p in private if p.key() not in KNOWN_PRIVATE})
    assert not new, "private names used across modules:\n" + "\n".join(new)
    stale = sorted(KNOWN_PRIVATE - {p.key() for p in private})
    assert not stale, f"KNOWN_PRIVATE lists uses that are gone (remove them): {stale}"


def test_no_part_reaches_into_another_objects_private_state():
    """Parts talk through methods: every ``x._name`` is on ``self``/``cls``/the module."""
    found = reaches()
    assert not found, ("private state reached from outside its object (give the owner a "
                       "method or a property):\n" + "\n".join(map(str, found)))


def test_docs_show_the_same_floors():
    """docs/architecture.md's layer table: one row per floor, bottom first, same parts."""
    rows = []
    for line in DOC.read_text().splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|\s*([\w-]+)\s*\|([^|]*)\|", line)
        if m:
            rows.append((int(m.group(1)), m.group(2), set(re.findall(r"`([\w/.]+?)/?`",
                                                                     m.group(3)))))
    assert [n for n, _, _ in rows] == list(range(len(FLOORS))), rows
    doc = [(name, {p.removesuffix(".py") for p in parts}) for _, name, parts in rows]
    assert doc == FLOORS


# -------------------------------------------------------- the walk itself sees what it must

def test_the_walk_finds_every_kind_of_import_and_each_violation(tmp_path):
    """A small package with one of each kind of import and each kind of violation: the
    rules above fail on it (so they are not blind)."""
    files = {
        "__init__.py": "",
        "base.py": "_SECRET = 1\nPUBLIC = 2\n",
        "low/__init__.py": "",
        "low/core.py": "from .. import base\nfrom ..base import PUBLIC\nfrom .. import _native\n"
                       "def f():\n    from ..high import app  # function-level, up\n"
                       "_hx = _native.load('fake.high._hx')  # a C twin: a leaf\n",
        "low/_twin.c": "PyMODINIT_FUNC PyInit__twin(void) { return 0; }\n",
        "low/a.py": "from . import b\n",
        "low/b.py": "import fake.low.a\n",                     # absolute; a <-> b cycle
        "high/__init__.py": "",
        "high/_hx.c": "PyMODINIT_FUNC PyInit__hx(void) { return 0; }\n",
        "high/app.py": "from fake.base import _SECRET\nfrom ..low import core as c\n"
                       "from .. import base\nx = base._SECRET + c.PUBLIC\n"
                       "from fake import _native\n_native.load('fake.low._twin')\n",
        "_native.py": "def load(name): return None\n",
    }
    for name, text in files.items():
        p = tmp_path / "fake" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    mods, native, edges, private = walk(tmp_path, "fake")
    assert native == {"low._twin", "high._hx"}
    got = {(e.src, e.dst) for e in edges}
    assert {("low.core", "base"), ("low.core", "high.app"), ("low.core", "high._hx"),
            ("low.a", "low.b"), ("low.b", "low.a"), ("high.app", "base"),
            ("high.app", "low.core"), ("high.app", "_native"),
            ("high.app", "low._twin")} <= got
    floors = [("base", {"__init__", "base", "_native"}), ("low", {"low"}),
              ("high", {"high"})]
    bad = upward(edges, floors, native)
    assert len(bad) == 1 and ".low.core -> " in bad[0] and ".high.app (line 5)" in bad[0], bad
    assert set(cycles(edges, mods)) == {frozenset({"low.a", "low.b"}),      # absolute import
                                        frozenset({"low.core", "high.app"})}  # function-level
    assert {(p.src, p.module, p.name) for p in private} == {("high.app", "base", "_SECRET")}
    assert len(private) == 2      # the from-import and the attribute



def test_the_reach_rule_sees_each_kind_of_access(tmp_path):
    """Reads, writes and calls of another object's private names fail the rule, through
    a parameter, an attribute chain or a call; ``self``/``cls``, the module itself and
    another project's names (``os._exit``) do not."""
    files = {
        "__init__.py": "",
        "a.py": ("import os\nfrom pyspark import SparkContext\nimport fake.a as me\n"
                 "_X = 1\n"
                 "class A:\n"
                 "    def __init__(self):\n        self._p = 1\n"
                 "    @classmethod\n    def k(cls):\n        return cls._q\n"
                 "    def f(self, r):\n"
                 "        r._pos = 2\n"                      # a write: counted
                 "        self.reader._spool.x()\n"          # a chain: counted
                 "        r._log.compact()\n"                # a call through it: counted
                 "        make()._y\n"                       # on a call: counted
                 "        os._exit(0)\n"                     # another project
                 "        SparkContext._jvm\n"              # another project
                 "        return me._X + self._p\n"),        # the module itself, self
    }
    for name, text in files.items():
        p = tmp_path / "fake" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    got = sorted((r.line, r.expr) for r in reaches(tmp_path, "fake"))
    assert got == [(12, "r._pos"), (13, "self.reader._spool"), (14, "r._log"),
                   (15, "make()._y")], got


def test_the_include_walk_sees_each_kind_of_include(tmp_path):
    """A small package with one include of each kind: down, its own part, a top-level
    header, a system header (not counted), up, sideways, a file that is not there and a
    file outside the package: the rule fails on exactly the last four."""
    files = {
        "__init__.py": "",
        "_top.h": "#define TOP 1\n",
        "base/z.h": '#include "../_top.h"\n',                          # down
        "low/l.h": "",
        "low/a.c": ('#include <Python.h>\n#include "l.h"\n'
                    '  #  include  "../base/z.h"  /* spaces */\n'       # down
                    '#include "../high/h.h"\n'),                        # up
        "low2/b.c": '#include "../low/l.h"\n',                          # sideways
        "high/h.h": '#include "../low/../low/l.h"\n',                   # down, by a detour
        "high/c.c": ('#include "h.h"\n#include "missing.h"\n'          # not there
                     '#include "../../outside.h"\n'                     # outside the package
                     '/* #include "../nothing.h" in a comment */\n'),
    }
    for name, text in files.items():
        p = tmp_path / "fake" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (tmp_path / "outside.h").write_text("")
    assert set(c_files(tmp_path, "fake")) == {n for n in files if n.endswith((".c", ".h"))}
    incs = c_includes(tmp_path, "fake")
    got = {(i.src, i.dst, i.line) for i in incs}
    assert got == {("base/z.h", "_top.h", 1), ("low/a.c", "low/l.h", 2),
                   ("low/a.c", "base/z.h", 3), ("low/a.c", "high/h.h", 4),
                   ("low2/b.c", "low/l.h", 1), ("high/h.h", "low/l.h", 1),
                   ("high/c.c", "high/h.h", 1), ("high/c.c", None, 2),
                   ("high/c.c", None, 3)}, got
    floors = [("bottom", {"__init__", "_top"}), ("base", {"base"}), ("low", {"low", "low2"}),
              ("high", {"high"})]
    bad = includes_against_floors(incs, floors)
    assert len(bad) == 4, bad
    assert any(b.startswith("low/a.c line 4") and "includes up" in b for b in bad), bad
    assert any(b.startswith("low2/b.c line 1") and "includes sideways" in b for b in bad), bad
    assert sum("names no file of the package" in b for b in bad) == 2, bad
    assert c_part("_top.h") == "_top" and c_part("_c/record.h") == "_c"


# ------------------------------------------------------------------ module sizes

#: a module longer than this needs its reason in docs/architecture.md ("Module size")
MAX_LINES = 600


def test_every_module_over_600_lines_has_a_written_reason():
    """docs/architecture.md's table of long modules: one row per module over
    :data:`MAX_LINES` lines, with a reason; no row for a module that is no longer long."""
    mods, _ = modules(SRC, PKG)
    long = {str(p.relative_to(SRC / PKG)) for p in mods.values()
            if len(p.read_text().splitlines()) > MAX_LINES}
    text = DOC.read_text()
    section = text[text.index("### Module size"):]
    section = section[:section.index("\n#", 1)] if "\n#" in section[1:] else section
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*`([\w/.]+\.py)`\s*\|\s*(\d+)\s*\|([^|]*)\|", line)
        if m:
            rows[m.group(1)] = m.group(3).strip()
    missing = sorted(long - set(rows))
    assert not missing, f"modules over {MAX_LINES} lines without a reason in {DOC.name}: {missing}"
    stale = sorted(set(rows) - long)
    assert not stale, f"{DOC.name} gives a reason for modules that are not long: {stale}"
    empty = sorted(p for p, why in rows.items() if len(why) < 40)
    assert not empty, f"no real reason given for: {empty}"


# ------------------------------------------------------------------ the relay built whole

#: the composition's object: built whole from its parts (relay/app.py ``RelayParts``)
RELAY = ("relay.app", "Relay")


def _is_relay_type(ann: ast.expr | None) -> bool:
    """An annotation that names the relay class: ``Relay``, ``app.Relay``, ``"Relay"``,
    ``Relay | None``."""
    if ann is None:
        return False
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        return ann.value.split("|")[0].strip().rsplit(".", 1)[-1] == RELAY[1]
    if isinstance(ann, ast.BinOp):
        return _is_relay_type(ann.left) or _is_relay_type(ann.right)
    return (isinstance(ann, ast.Name) and ann.id == RELAY[1]) or \
        (isinstance(ann, ast.Attribute) and ann.attr == RELAY[1])


def relay_fills(src: Path = SRC, pkg: str = PKG, relay: tuple[str, str] = RELAY) -> list[str]:
    """Where a relay is filled in after it was built:

    * outside its class, an attribute of a relay assigned (``relay.spool = ...``,
      ``relay.x += 1``, ``x: T = ...`` on one, ``setattr(relay, ...)``).  A relay is a name
      or attribute called ``relay`` (as the package calls it: ``service.py``, the inputs,
      the metrics), a name annotated with the class, or bound to a call of it;
    * in the class's ``__init__``, an attribute set to None that no other method of the
      class assigns: a part left for someone else to fill in.  (What ``run()`` makes from
      the bound sockets, the pipeline and the PUB, it assigns itself.)"""
    mods, _ = modules(src, pkg)
    out: list[str] = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        inside: set[int] = set()              # the nodes of the class itself
        names = {"relay"}                     # names bound to a relay in this module
        for node in ast.walk(tree):
            if mod == relay[0] and isinstance(node, ast.ClassDef) and node.name == relay[1]:
                inside.update(id(n) for n in ast.walk(node))
                out += _filled_later(mod, node)
            elif isinstance(node, ast.arg) and _is_relay_type(node.annotation):
                names.add(node.arg)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and _is_relay_type(node.annotation):
                names.add(node.target.id)
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                f = node.value.func
                if (isinstance(f, ast.Name) and f.id == relay[1]) or \
                        (isinstance(f, ast.Attribute) and f.attr == relay[1]):
                    names.update(t.id for t in node.targets if isinstance(t, ast.Name))

        def is_relay(e: ast.expr) -> bool:
            return (isinstance(e, ast.Name) and e.id in names) or \
                (isinstance(e, ast.Attribute) and e.attr == "relay")

        for node in ast.walk(tree):
            if id(node) in inside:
                continue
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "setattr" and node.args and is_relay(node.args[0]):
                out.append(f"{_show(mod)} line {node.lineno}: {ast.unparse(node)}")
            for t in targets:
                for el in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]):
                    if isinstance(el, ast.Attribute) and is_relay(el.value):
                        out.append(f"{_show(mod)} line {node.lineno}: {ast.unparse(el)} "
                                   "assigned on a built relay")
    return out


def _filled_later(mod: str, cls: ast.ClassDef) -> list[str]:
    """``self.x = None`` in ``__init__`` with no other method of the class assigning x."""
    def self_targets(fn) -> list[tuple[ast.Attribute, ast.expr | None]]:
        got = []
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                pairs = [(t, node.value) for t in node.targets]
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                pairs = [(node.target, node.value)]
            else:
                continue
            for t, value in pairs:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                        and t.value.id == "self":
                    got.append((t, value))
        return got

    methods = [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    init = next((m for m in methods if m.name == "__init__"), None)
    if init is None:
        return []
    later = {t.attr for m in methods if m is not init for t, _ in self_targets(m)}
    return [f"{_show(mod)} line {t.lineno}: {cls.name}.__init__ sets {t.attr} to None and "
            "only someone outside the class fills it in"
            for t, value in self_targets(init)
            if isinstance(value, ast.Constant) and value.value is None and t.attr not in later]


def test_the_relay_is_built_whole_from_its_parts():
    """``Relay`` gets its parts when it is built (``RelayParts``, made by
    ``relay/service.py``): nothing outside the class assigns an attribute of a relay, and
    its ``__init__`` sets no part to None for someone else to fill in."""
    found = relay_fills()
    assert not found, ("a relay filled in after it was built (give the part to "
                       "RelayParts):\n" + "\n".join(found))


def test_the_relay_rule_sees_each_way_of_filling_it_in(tmp_path):
    files = {
        "__init__.py": "",
        "relay/__init__.py": "",
        "relay/app.py": ("class Relay:\n"
                         "    def __init__(self, parts):\n"
                         "        self.spool = None\n"                # filled outside: counted
                         "        self.pipeline = None\n"             # run() makes it: not
                         "        self.outputs = parts.outputs\n"
                         "    def run(self):\n"
                         "        self.pipeline = object()\n"),
        "relay/service.py": ("from .app import Relay\n"
                             "def build(parts):\n"
                             "    relay = Relay(parts)\n"
                             "    relay.spool = 1\n"                  # 4
                             "    relay.endpoints['x'] = 2\n"         # a dict's item: not
                             "    r = Relay(parts)\n"
                             "    r.x, y = 3, 4\n"                    # 7
                             "    setattr(relay, 'y', 5)\n"           # 8
                             "    return relay\n"
                             "def attach(box: 'Relay | None', other):\n"
                             "    box.http += 1\n"                    # 11
                             "    other.spool = 6\n"),                # not a relay: not
        "inputs.py": ("class Input:\n"
                      "    def __init__(self, relay):\n"
                      "        self.relay = relay\n"                  # its own attribute: not
                      "        self.relay.inputs = [self]\n"),        # 4
    }
    for name, text in files.items():
        p = tmp_path / "fake" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    got = sorted(line.split(":")[0].split(".", 1)[1] for line in relay_fills(tmp_path, "fake"))
    assert got == ["inputs line 4", "relay.app line 3", "relay.service line 11",
                   "relay.service line 4", "relay.service line 7", "relay.service line 8"], got
