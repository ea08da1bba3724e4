"""The CPU time a process may use, as a container's CPU limit caps it: read
from /proc and cgroup files laid out as the kernel lays them out, and from a
real cgroup where the test may make one."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import projections.catalog
from catalog_es import cpu


def _proc(tmp_path: Path, cgroup: str, *mounts: str) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text("".join(f"{mount}\n" for mount in mounts))
    return proc


def _write(directory: Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("_", ".", 1)).write_text(f"{text}\n")


def test_a_container_s_own_cgroup_v2_limit_is_its_quota(tmp_path: Path) -> None:
    # What a pod's container sees in its cgroup namespace: its cgroup at the top.
    top = tmp_path / "sys-fs-cgroup"
    _write(top, cpu_max="150000 100000")
    proc = _proc(
        tmp_path,
        "0::/\n",
        f"30 22 0:26 / {top} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate",
        "24 1 8:1 / / rw,relatime - ext4 /dev/vda1 rw",
    )
    assert cpu.cgroup_quota(proc) == 1.5


def test_the_tightest_limit_on_the_way_up_is_the_quota(tmp_path: Path) -> None:
    top = tmp_path / "cgroup"
    _write(top, cpu_max="max 100000")
    _write(top / "kubepods" / "pod-a", cpu_max="100000 100000")
    _write(top / "kubepods" / "pod-a" / "ctr", cpu_max="200000 100000")
    # A tighter limit on a cgroup beside the path is another process's.
    _write(top / "kubepods" / "pod-b", cpu_max="10000 100000")
    proc = _proc(
        tmp_path, "0::/kubepods/pod-a/ctr\n", f"30 22 0:26 / {top} rw - cgroup2 cgroup2 rw"
    )
    assert cpu.cgroup_quota(proc) == 1.0


def test_a_mount_with_no_source_and_a_path_not_in_utf_8_are_read(tmp_path: Path) -> None:
    # The kernel prints an empty source as nothing between two spaces, and
    # paths as their bytes.
    top = tmp_path / "cgroup"
    _write(top, cpu_max="50000 100000")
    proc = _proc(tmp_path, "0::/\n", f"30 22 0:26 / {top} rw - cgroup2  rw")
    with (proc / "mountinfo").open("ab") as mountinfo:
        mountinfo.write(b"31 22 0:27 / /mnt/caf\xe9 rw - tmpfs tmpfs rw\n")
    assert cpu.cgroup_quota(proc) == 0.5
    # What the process may use: the quota, below the cores it may run on.
    assert cpu.allowance(proc) == 0.5


def test_a_cgroup_v1_quota_counts_where_the_cpu_controller_is_mounted(tmp_path: Path) -> None:
    # A bind mount of the container's own cgroup (its root is not "/"), at a
    # path with a space in it, as mountinfo escapes it.
    top = tmp_path / "cpu,cpuacct dir"
    _write(top, cpu_cfs_quota_us="50000", cpu_cfs_period_us="100000")
    escaped = str(top).replace(" ", "\\040")
    proc = _proc(
        tmp_path,
        "7:memory:/docker/abc\n5:cpu,cpuacct:/docker/abc\n0::/\n",
        f"33 25 0:29 /docker/abc {escaped} ro,nosuid - cgroup cgroup rw,cpu,cpuacct",
        f"34 25 0:30 /docker/abc {tmp_path / 'memory'} ro - cgroup cgroup rw,memory",
    )
    assert cpu.cgroup_quota(proc) == 0.5


@pytest.mark.parametrize(
    ("cgroup", "files", "reason"),
    [
        ("0::/\n", {"cpu_max": "max 100000"}, "v2 without a limit"),
        ("4:cpu:/\n", {"cpu_cfs_quota_us": "-1", "cpu_cfs_period_us": "100000"}, "v1 unlimited"),
        ("0::/\n", {"cpu_max": "garbage"}, "a file that cannot be read as a quota"),
        ("0::/\n", {"cpu_max": "100000 0"}, "no period"),
        ("0::/\n", {"cpu_max": "-50000 100000"}, "a negative quota"),
        ("0::/\n", {"cpu_max": f"{'9' * 400} 1"}, "a quota too large for a float"),
        ("4:cpu:/\n", {"cpu_cfs_quota_us": "0", "cpu_cfs_period_us": "100000"}, "a zero quota"),
        ("0::/elsewhere\n", {"cpu_max": "50000 100000"}, "a cgroup the mount does not show"),
        ("0::/../../user.slice\n", {"cpu_max": "50000 100000"}, "a cgroup outside the mount's"),
        ("", {"cpu_max": "50000 100000"}, "no cgroup"),
        (
            "3:cpuset:/\n4:cpu:/\n",
            {"cpu_cfs_quota_us": "50000", "cpu_cfs_period_us": "100000"},
            "cpuset is not the cpu controller",
        ),
    ],
)
def test_no_quota(tmp_path: Path, cgroup: str, files: dict[str, str], reason: str) -> None:
    top = tmp_path / "cgroup"
    _write(top, **files)
    if "cpu_max" in files:
        kind = "cgroup2 cgroup2 rw"
    else:
        kind = f"cgroup cgroup rw,{'cpuset' if 'cpuset' in cgroup else 'cpu'}"
    # The mount's root: what "elsewhere" is not under.
    root = "/mine" if "elsewhere" in cgroup else "/"
    proc = _proc(tmp_path, cgroup, f"30 22 0:26 {root} {top} rw - {kind}")
    assert cpu.cgroup_quota(proc) is None, reason


def test_without_proc_files_there_is_no_quota_and_every_core_counts(tmp_path: Path) -> None:
    assert cpu.cgroup_quota(tmp_path / "no-proc") is None
    assert cpu.allowance(tmp_path / "no-proc") == len(os.sched_getaffinity(0))


def _cpu_hierarchy() -> tuple[Path, dict[str, str]] | None:
    """Where a cgroup limited in CPU can be made, and the files that limit it:
    a mounted hierarchy with the CPU controller, as the kernel lists it."""
    for line in Path("/proc/self/mountinfo").read_text(errors="replace").splitlines():
        fields, _, source = line.partition(" - ")
        described = source.split()
        point = Path(fields.split()[4])
        if described[:1] == ["cgroup"] and "cpu" in described[-1].split(","):
            return point, {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "120000"}
        controllers = point / "cgroup.subtree_control"
        if (
            described[:1] == ["cgroup2"]
            and controllers.exists()
            and "cpu" in controllers.read_text().split()
        ):
            return point, {"cpu.max": "120000 100000"}
    return None


def _write_control(path: Path, text: str) -> None:
    # Never created: a file that is not there is no cgroup control.
    descriptor = os.open(path, os.O_WRONLY)
    try:
        os.write(descriptor, text.encode())
    finally:
        os.close(descriptor)


@pytest.fixture
def quota_of_1_2_cores() -> Iterator[Path]:
    """A real cgroup whose processes get 1.2 cores' worth of time: where this
    test may make one (as root, with the CPU controller mounted)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a quota of 1.2 cores changes nothing on one core")
    found = _cpu_hierarchy()
    if found is None:
        pytest.skip("no cgroup hierarchy with the CPU controller is mounted")
    hierarchy, limits = found
    group = hierarchy / f"catalog-es-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as error:
        pytest.skip(f"no cgroup can be made here: {error}")
    try:
        try:
            for name, value in limits.items():
                _write_control(group / name, value)
        except OSError as error:
            pytest.skip(f"no CPU quota can be set here: {error}")
        yield group
    finally:
        # Empty once its one process has ended; a cgroup's files go with it.
        with contextlib.suppress(OSError):
            group.rmdir()


# The CPU time a process started there has, and whether it splits a replay
# (of an empty log: the split is tried from any length).
_PROBE = """
import sys
import projections.catalog
from catalog_es import cpu
from catalog_es.catalog import Catalog
from catalog_es.persistence import SQLRecorder, create_engine

projections.catalog.SPLIT_AFTER = 0
recorder = SQLRecorder(create_engine(sys.argv[1]))
with recorder.read() as conn:
    halves = projections.catalog._split_replay(Catalog(), recorder, conn, None)
print(cpu.allowance(), halves is not None)
"""


def _probe(url: str, group: Path | None = None) -> tuple[float, bool]:
    def join() -> None:
        if group is not None:
            _write_control(group / "cgroup.procs", str(os.getpid()))

    result = subprocess.run(
        [sys.executable, "-c", _PROBE, url],
        preexec_fn=join,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    allowance, split = result.stdout.split()
    return float(allowance), split == "True"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="cgroups are Linux's")
def test_a_replay_under_a_quota_below_one_and_a_half_cores_is_not_split(
    tmp_path: Path, quota_of_1_2_cores: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    # At most 1.2: a limit above the new cgroup may be tighter still.
    allowance, split = _probe(url, quota_of_1_2_cores)
    assert allowance <= 1.2
    assert not split
    # Outside it, as this process may: split where that is one and a half cores or more.
    free = cpu.allowance()
    assert _probe(url) == (free, free >= projections.catalog.SPLIT_CORES)
