"""Readers of Linux's /proc process tables: a process's children and its CPU time."""

from __future__ import annotations

import os
from pathlib import Path


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (uvicorn's reloader-free worker, a celery pool's forks)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def scan_children(pid: int, *, zombies: bool = False) -> list[int]:
    """The child processes of ``pid`` from every /proc/*/stat: the live ones, or the ended
    ones not yet reaped (``zombies``)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and (fields[0] == "Z") == zombies and int(fields[1]) == pid:
            found.append(int(entry.parent.name))
    return found


def children_with_cmdlines(pid: int) -> dict[int, str]:
    """The direct children of ``pid``, of all its threads: {pid: command line}. Raises
    ``OSError`` (``FileNotFoundError``) when ``pid``, or a child, is gone meanwhile."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            found[int(child)] = cmdline.decode(errors="replace")
    return found
