"""Every memory ceiling the README and docs/*.md give is what ``relay/memory.py``'s
``ceiling()`` returns for the same settings.

The docs state ceilings in prose ("the ceiling of 678 MiB", "`ceiling()` gives 678 MiB",
"ceiling 749 MiB", "its 391 MiB ceiling", "the inputs term is 808 MiB", "peak 72 MiB
against 391 MiB") and in tables with a "ceiling" column. :func:`prose_figures` finds every
such figure in every document; each document's figures, in their order, must be those of
the examples :data:`PROSE` names for it, computed with ``ceiling()``; a document with a
figure that no example explains fails. A table with a ceiling column gives its settings
and baseline in its own cells.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from logjam_relay.relay import memory
from relay_harness import relay_settings

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MiB = 1024 * 1024

_NUM = r"(\d[\d,]*) MiB"
#: "ceiling of 678 MiB", "`ceiling()` gives 678 MiB", "(ceiling 749 MiB", "the ceiling's
#: inputs term is 808 MiB", "the inputs term is 808 MiB": a few plain words may come between
_AFTER = (r"\b(?:ceilings?|inputs term)\b(?:\(\))?`?(?:'s)?\s+(?:[A-Za-z]+\s+){0,4}?" + _NUM)
#: "its 391 MiB ceiling", "a 391 MiB RSS ceiling"
_BEFORE = _NUM + r" (?:RSS )?ceiling\b"
#: "peak 72 MiB against 391 MiB"
_AGAINST = r"\bagainst (?:its |the |a )?" + _NUM
FIGURE = re.compile(f"{_AFTER}|{_BEFORE}|{_AGAINST}")
KEY = re.compile(r"\b(?:ceilings?|inputs term)\b")


def _figure(m: re.Match) -> int:
    return int(next(g for g in m.groups() if g).replace(",", ""))


def _blank(text: str, keep) -> str:
    """``text`` with every line ``keep`` rejects replaced by spaces (offsets unchanged),
    lines joined by spaces."""
    return " ".join(ln if keep(ln) else " " * len(ln) for ln in text.split("\n"))


def _fenced(text: str) -> set[int]:
    """Indexes of the lines inside fenced code blocks."""
    inside, out = False, set()
    for i, ln in enumerate(text.split("\n")):
        if ln.lstrip().startswith("```"):
            inside = not inside
            out.add(i)
        elif inside:
            out.add(i)
    return out


def prose_figures(text: str) -> list[int]:
    """The ceiling figures outside tables, in the document's order."""
    prose = _blank(text, lambda ln: not ln.lstrip().startswith("|"))
    return [_figure(m) for m in FIGURE.finditer(prose)]


def unread_sentences(text: str) -> list[str]:
    """Sentences outside tables and code that speak of a ceiling and give a MiB figure
    but no figure :data:`FIGURE` reads: a ceiling written in a way this test would miss
    (or a sentence to be rephrased so that its measured figures stay apart)."""
    fenced = _fenced(text)
    lines = text.split("\n")
    prose = " ".join(" " * len(ln) if i in fenced or ln.lstrip().startswith("|") else ln
                     for i, ln in enumerate(lines))
    return [s for s in re.split(r"(?<=[.;:])\s+", prose)
            if KEY.search(s) and re.search(r"\d MiB", s) and not FIGURE.search(s)]


def ceiling_tables(text: str) -> list[list[dict[str, str]]]:
    """The markdown tables with a column whose header names the ceiling, as rows of
    {header: cell}."""
    tables, block = [], []
    for ln in [*text.split("\n"), ""]:
        if ln.lstrip().startswith("|"):
            block.append([c.strip() for c in ln.strip().strip("|").split("|")])
            continue
        if len(block) > 2 and any("ceiling" in h for h in block[0]):
            tables.append([dict(zip(block[0], row, strict=True)) for row in block[2:]])
        block = []
    return tables


# ---------------------------------------------------------------- the examples

def _storm(tmp_path) -> memory.Ceiling:
    from test_memory_ceiling import DOCS_B, DOCS_BW, STORM_INPUT_PEERS, storm_settings
    return memory.ceiling(storm_settings(tmp_path / "storm", 1, 2), baseline=DOCS_B,
                          input_peers=STORM_INPUT_PEERS, worker_baseline=DOCS_BW)


def _attack(tmp_path) -> memory.Ceiling:
    from test_combined_attack import sized_settings
    from test_memory_ceiling import DOCS_B, DOCS_BW
    return memory.ceiling(sized_settings(tmp_path / "attack", 1, 2, 3)[0],
                          baseline=DOCS_B, worker_baseline=DOCS_BW)


def _input_settings(tmp_path, params: str):
    """The sized configuration with one Lumberjack input (tests/test_inputs_memory.py)."""
    from test_inputs_memory import SIZED
    url = f"lumberjack://127.0.0.1:1?tls=off&timeout=5s&name=lj{params}"
    return relay_settings(tmp_path / f"inputs{len(params)}", inputs=[url], **SIZED)


def _inputs_row(tmp_path, params: str, idle_mib: int) -> memory.Ceiling:
    return memory.ceiling(_input_settings(tmp_path, params), baseline=idle_mib * MiB,
                          input_peers=0)


def _default_input_term(tmp_path) -> int:
    s = relay_settings(tmp_path / "default-input", inputs=["lumberjack://127.0.0.1:1?tls=off"])
    return memory.input_bytes(s)


#: per document, the examples its prose ceilings speak of, in their order
PROSE = {
    "operations.md": [
        ("the storm, relay and worker peaks", lambda t: _storm(t).total),
        ("inputs.md's table, the input's defaults", lambda t: _inputs_row(t, "", 38).total),
        ("inputs.md's table, its second configuration",
         lambda t: _inputs_row(t, "&max_batch_bytes=16MiB&max_held_bytes=64MiB", 38).total),
        ("the storm's configuration", lambda t: _storm(t).total),
        ("the storm, measured", lambda t: _storm(t).total),
        ("every attack at once", lambda t: _attack(t).total),
        ("every attack at once, measured", lambda t: _attack(t).total),
        ("every attack at once, the 2 s bound", lambda t: _attack(t).total),
    ],
    "inputs.md": [
        ("one input with its defaults, the inputs term", _default_input_term),
        ("the table's second configuration before the budget",
         lambda t: _inputs_row(t, "&max_batch_bytes=16MiB&max_held_bytes=64MiB", 38).total),
    ],
}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_prose_ceiling_is_what_ceiling_computes(doc, tmp_path):
    text = doc.read_text()
    said = prose_figures(text)
    examples = PROSE.get(doc.name, [])
    want = [round(compute(tmp_path) / MiB) for _, compute in examples]
    assert said == want, (f"{doc.name} gives the ceilings {said}; ceiling() for its examples "
                          f"({', '.join(n for n, _ in examples) or 'none'}): {want}")
    assert unread_sentences(text) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_ceiling_table_is_what_ceiling_computes(doc, tmp_path):
    """A table's ceiling column ("761 MiB (520)": the total and the inputs term) against
    ``ceiling()`` for the input settings its first cell names (in backticks, or the
    defaults) and the idle RSS its idle column gives as the baseline."""
    for table in ceiling_tables(doc.read_text()):
        assert doc.name == "inputs.md", f"{doc.name}: a ceiling table this test cannot read"
        for row in table:
            label, idle = row["input settings"], row["idle"]
            params = re.findall(r"`([^`]*)`", label)
            assert params or label.startswith("defaults"), label
            settings = "&" + params[0] if params else ""
            cell = re.fullmatch(r"(\d+) MiB \((\d+)\)", row["ceiling (inputs term)"])
            assert cell, row
            c = _inputs_row(tmp_path, settings, int(re.fullmatch(r"(\d+) MiB", idle)[1]))
            assert (int(cell[1]), int(cell[2])) == (round(c.total / MiB),
                                                    round(c.inputs / MiB)), (label, c.describe())


def test_the_docs_name_the_codes_terms():
    """The formulas' per-connection and per-batch terms are the code's (one definition
    each), and the examples' baselines are the ones the test takes."""
    from test_memory_ceiling import DOCS_B, DOCS_BW
    ops = (ROOT / "docs" / "operations.md").read_text()
    ops = ops[ops.index("\n## Memory\n"):]
    ops = ops[:ops.index("\n## ", 1)]
    assert f"B = {DOCS_B // MiB} MiB and Bw = {DOCS_BW // MiB} MiB" in ops
    assert re.search(r"\(P \+ Q\) x (\d+) KiB", ops).group(1) == \
        str(memory.ZMQ_CONNECTION_BYTES // 1024)
    assert re.search(r"max_connections x (\d+) KiB", ops).group(1) == \
        str(memory.INPUT_CONNECTION_BYTES // 1024)
    assert re.search(r"(\d+) x max_event_bytes", ops).group(1) == str(memory.JSON_EXPANSION)
    inputs = (ROOT / "docs" / "inputs.md").read_text().replace("\n", " ")
    assert f"`max_connections` × {memory.INPUT_CONNECTION_BYTES // 1024} KiB" in inputs
    assert f"+ {memory.JSON_EXPANSION} × `max_event_bytes`" in inputs


def test_the_reader_finds_every_way_the_docs_write_a_ceiling():
    """:func:`prose_figures` on the phrasings the docs use, and not on measured figures
    beside a ceiling."""
    text = ("peak RSS 196–301 MiB against the ceiling of 749 MiB; `ceiling()` gives 678 MiB,"
            " taking B = 40 MiB. (ceiling\n749 MiB with the same B) took it to 635 MiB against"
            " its 391 MiB ceiling. With the defaults the inputs term is 808 MiB; under the"
            " ceiling; measured in the storm: relay 135 MiB. test_memory_ceiling.py 5 MiB;"
            " peak 72 MiB against 391 MiB\n"
            "| a | ceiling |\n|---|---|\n| x | 12 MiB |\n")
    assert prose_figures(text) == [749, 678, 749, 391, 808, 391]
    assert unread_sentences("The ceiling is, with these settings, 500 MiB.") != []
    assert ceiling_tables(text) == [[{"a": "x", "ceiling": "12 MiB"}]]
