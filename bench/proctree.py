"""The processes under a pid, from one pass over /proc (bench_pipeline.py, profile_stats.py)."""

from __future__ import annotations

import os

TICK = os.sysconf("SC_CLK_TCK")


def scan() -> tuple[dict[int, list[int]], dict[int, float]]:
    """Children by parent pid, and CPU seconds (user + system) by pid."""
    kids: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as fh:
                st = fh.read()
        except OSError:
            continue
        f = st[st.rindex(")") + 2:].split()
        kids.setdefault(int(f[1]), []).append(int(p))
        cpu[int(p)] = (int(f[11]) + int(f[12])) / TICK
    return kids, cpu


def descendants(root: int, kids: dict[int, list[int]]) -> list[int]:
    """Every process under ``root`` (not ``root`` itself)."""
    out, stack = [], [root]
    while stack:
        for c in kids.get(stack.pop(), []):
            out.append(c)
            stack.append(c)
    return out
