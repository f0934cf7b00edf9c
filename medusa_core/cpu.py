"""The CPU cores this process may use: the default torch thread count of the app and the benchmark.

A person's own CPU is not shared with other jobs, so decoding takes every physical core. Hyper-threads
are not counted: two threads on one core compete for the same arithmetic units, and torch's intra-op
threads then wait for each other. The count honours the process's CPU affinity (``taskset``,
``os.sched_getaffinity``); it does not see a container's CPU quota (cgroups), where ``--threads``
is the way to say it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Collection

CPUINFO = Path("/proc/cpuinfo")
SYSFS_CPUS = Path("/sys/devices/system/cpu")


def cores_in_cpuinfo(text: str, allowed: Collection[int] | None = None) -> int | None:
    """Distinct (``physical id``, ``core id``) pairs among the processors of ``/proc/cpuinfo`` ``text``
    whose ``processor`` number is in ``allowed`` (every one when None).

    None when the text names no core ids (some ARM and virtual machines), or no allowed processor.
    """
    cores: set[tuple[str, str]] = set()
    for block in re.split(r"\n[ \t]*\n", text):
        info = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                info[key.strip()] = value.strip()
        if not info.get("processor", "").isdigit():
            continue
        if "core id" not in info:
            return None
        if allowed is None or int(info["processor"]) in allowed:
            cores.add((info.get("physical id", "0"), info["core id"]))
    return len(cores) or None


def cores_in_sysfs(allowed: Collection[int], root: Path = SYSFS_CPUS) -> int | None:
    """Distinct (``physical_package_id``, ``core_id``) pairs of the ``allowed`` CPUs under
    ``/sys/devices/system/cpu/cpuN/topology``; None when a CPU's topology cannot be read."""
    cores = set()
    for cpu in allowed:
        topology = root / f"cpu{cpu}" / "topology"
        try:
            cores.add(tuple((topology / name).read_text().strip() for name in ("physical_package_id", "core_id")))
        except OSError:
            return None
    return len(cores) or None


def physical_cores() -> int:
    """Physical cores this process may run on (Linux: ``/proc/cpuinfo``, else sysfs topology), else the
    logical CPUs it may run on, else ``os.cpu_count()``; at least 1."""
    try:
        allowed: set[int] | None = os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux
        allowed = None
    try:
        count = cores_in_cpuinfo(CPUINFO.read_text(encoding="utf-8", errors="replace"), allowed)
    except OSError:
        count = None
    if count is None and allowed:
        count = cores_in_sysfs(allowed)
    if count is None:
        count = len(allowed) if allowed else os.cpu_count()
    return max(count or 1, 1)
