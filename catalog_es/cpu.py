"""How much CPU time this process may use.

The cores it may run on say too much in a container: a CPU limit (a cgroup's
quota) lets it run on every core of the node, for a share of the time. Work
split over two processes under a quota of one core takes longer than in one
(a million-event replay: 4.5-4.9 s split, 3.7-3.9 s whole). What the files
say is never trusted to be well formed: anything unreadable is no quota.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

PROC_SELF = Path("/proc/self")


def allowance(proc: Path = PROC_SELF) -> float:
    """Cores' worth of CPU time: the cores this process may run on, capped by
    the tightest CPU quota of its cgroup and those above it."""
    if hasattr(os, "sched_getaffinity"):
        cores = float(len(os.sched_getaffinity(0)))
    else:
        cores = float(os.cpu_count() or 1)
    quota = cgroup_quota(proc)
    return cores if quota is None else min(cores, quota)


def cgroup_quota(proc: Path = PROC_SELF) -> float | None:
    """The tightest CPU quota, in cores, on the cgroup of the process whose
    ``/proc`` entry is ``proc`` or on any cgroup above it (``cpu.max`` in
    cgroup v2, ``cpu.cfs_quota_us`` in v1); ``None`` where none is set or
    none can be read, as off Linux."""
    try:
        # Paths are the kernel's bytes, not always UTF-8: decoded as the file
        # system decodes them, so they open as they were written.
        memberships = _memberships(os.fsdecode((proc / "cgroup").read_bytes()))
        mounts = os.fsdecode((proc / "mountinfo").read_bytes()).splitlines()
    except (OSError, ValueError):
        return None
    return min((quota for mount in mounts for quota in _quotas(mount, memberships)), default=None)


def _memberships(text: str) -> dict[str, str]:
    """Each controller's cgroup path, from ``/proc/<pid>/cgroup``; cgroup v2's
    single hierarchy under the empty name."""
    paths: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                paths[controller] = parts[2]
    return paths


def _quotas(mount: str, memberships: dict[str, str]) -> Iterator[float]:
    """The quotas set along the process's cgroup path, if ``mount`` (a line of
    ``/proc/<pid>/mountinfo``) is a cgroup hierarchy with the CPU controller."""
    fields, _, source = mount.partition(" - ")
    # After the dash: the type, the source (empty for some mounts, and then
    # not there at all once split) and the options.
    mounted, described = fields.split(), source.split()
    if len(mounted) < 5 or len(described) < 2:
        return
    read: Callable[[Path], float | None]
    if described[0] == "cgroup2":
        path, read = memberships.get(""), _cpu_max
    elif described[0] == "cgroup" and "cpu" in described[-1].split(","):
        path, read = memberships.get("cpu"), _cfs_quota
    else:
        return
    # ".." in the path: the process sits outside the cgroup namespace whose
    # hierarchy the mount shows (entered from the host), so no limit there is its.
    if path is None or ".." in PurePosixPath(path).parts:
        return
    # The mount shows the hierarchy from ``root`` down (a container sees its own
    # cgroup as the top); the levels above it are not ours to read.
    try:
        below = PurePosixPath(path).relative_to(_unescape(mounted[3]))
    except ValueError:
        return
    top = Path(_unescape(mounted[4]))
    level = top / below
    while True:
        quota = read(level)
        if quota is not None:
            yield quota
        if level == top:
            return
        level = level.parent


def _cpu_max(level: Path) -> float | None:
    """cgroup v2: ``cpu.max`` holds "QUOTA PERIOD", QUOTA "max" for none."""
    try:
        quota, period = (level / "cpu.max").read_text().split()
        return None if quota == "max" else _cores(int(quota), int(period))
    except (OSError, ValueError):
        return None


def _cfs_quota(level: Path) -> float | None:
    """cgroup v1: a quota in microseconds per period, -1 for none."""
    try:
        quota = int((level / "cpu.cfs_quota_us").read_text())
        if quota == -1:
            return None
        return _cores(quota, int((level / "cpu.cfs_period_us").read_text()))
    except (OSError, ValueError):
        return None


def _cores(quota: int, period: int) -> float | None:
    """A quota per period as cores; ``None`` for what no kernel writes."""
    if quota <= 0 or period <= 0:
        return None
    try:
        return quota / period
    except OverflowError:
        return None


def _unescape(field: str) -> str:
    """A mountinfo path: space, tab, newline and backslash come as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)
