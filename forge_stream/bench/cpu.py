"""CPU seconds by process, from /proc (Linux): what each service of a deployment used, split into its own process,
vLLM's processes (by their titles) and its other children. `bench learning` reports it as `rl_cpu_seconds` and
`rl_cpu_seconds_by_process`."""

from __future__ import annotations

import os
from pathlib import Path

Processes = dict[int, tuple[int, float, str]]  # pid -> (parent pid, CPU seconds (user + system), command line)
CpuParts = dict[str, dict[str, float]]  # service -> part -> CPU seconds


def processes() -> Processes:
    """Every live process, from /proc."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, command)
    return out


def process_part(pid: int, root: int, command: str) -> str:
    """Which part of a service a process is: the service's own process, one of vLLM's (by its process title), or
    the service's children (the controller's agents)."""
    if pid == root:
        return "self"
    if command.startswith("VLLM::"):
        return command.split()[0]
    return "VLLM::APIServer" if "vllm.entrypoints" in command else "children"


def proc_tree_cpu(root: int, running: Processes) -> dict[str, float]:
    """CPU seconds of a live process and its live descendants, by part (process_part)."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in running.items():
        children.setdefault(parent, []).append(pid)
    parts: dict[str, float] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in running:
            part = process_part(pid, root, running[pid][2])
            parts[part] = parts.get(part, 0.0) + running[pid][1]
        todo += children.get(pid, [])
    return parts


def cpu_used(before: CpuParts, after: CpuParts) -> CpuParts:
    """CPU seconds each service's parts used between two readings (service -> proc_tree_cpu) (a part whose count went down
    was restarted: it counts from 0)."""
    used = {}
    for name, parts in after.items():
        old = before.get(name, {})
        used[name] = {part: round(sec - old.get(part, 0.0) if sec >= old.get(part, 0.0) else sec, 1)
                      for part, sec in parts.items()}
    return used
