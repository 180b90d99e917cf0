"""The machine's processes as /proc shows them: what the simulated hosts and kubelet kill, and how a test tells a
process has ended."""

from __future__ import annotations

from pathlib import Path


def parents() -> dict[int, int]:
    """pid -> parent pid of every process on the machine."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat_line = (entry / "stat").read_text()
            except OSError:
                continue  # exited meanwhile
            found[int(entry.name)] = int(stat_line.rsplit(")", 1)[1].split()[1])
    return found


def descendants(root: int) -> set[int]:
    """Every process `root` started, and theirs, still parented (an orphan re-parents to pid 1)."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents().items():
        children.setdefault(parent, []).append(pid)
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def process_gone(pid: int) -> bool:
    """Dead: no longer in /proc, or a zombie (orphans are reaped by pid 1, whenever it gets to it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
