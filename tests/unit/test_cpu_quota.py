"""A container's CPU limit (the cgroup's CFS quota) bounds the intra-op threads a service takes by default."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tandem.cpu_quota import quota_cpus


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_cpu_max_gives_the_cpus_and_max_gives_none(tmp_path: Path) -> None:
    write(tmp_path / "pod" / "cpu.max", "150000 100000\n")
    assert quota_cpus(tmp_path, "0::/pod\n") == 1.5
    write(tmp_path / "pod" / "cpu.max", "max 100000\n")
    assert quota_cpus(tmp_path, "0::/pod\n") is None


def test_the_least_limit_along_the_path_counts(tmp_path: Path) -> None:
    # A pod limited to 2 CPUs, its container to 4: the pod's limit holds.
    write(tmp_path / "pod" / "cpu.max", "200000 100000\n")
    write(tmp_path / "pod" / "container" / "cpu.max", "400000 100000\n")
    assert quota_cpus(tmp_path, "0::/pod/container\n") == 2.0


def test_cgroup_v1_quota_over_period_and_no_quota(tmp_path: Path) -> None:
    v1 = tmp_path / "cpu,cpuacct" / "docker" / "abc"
    write(v1 / "cpu.cfs_quota_us", "50000\n")
    write(v1 / "cpu.cfs_period_us", "100000\n")
    membership = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n"
    assert quota_cpus(tmp_path, membership) == 0.5
    write(v1 / "cpu.cfs_quota_us", "-1\n")
    assert quota_cpus(tmp_path, membership) is None


def test_no_cgroup_files_no_limit(tmp_path: Path) -> None:
    assert quota_cpus(tmp_path, "0::/\n1:cpu:/x\nnot a line\n") is None


def real_cpu_cgroup() -> Path | None:
    """A writable cgroup v1 cpu hierarchy (root, as CI runs), where a child cgroup can be given a quota."""
    base = Path("/sys/fs/cgroup/cpu")
    if not (base / "cpu.cfs_quota_us").is_file() or not os.access(base, os.W_OK):
        return None
    return base


@pytest.mark.skipif(real_cpu_cgroup() is None, reason="needs a writable cgroup v1 cpu hierarchy (root)")
def test_a_service_in_a_one_cpu_cgroup_takes_one_intra_op_thread() -> None:
    """A real cgroup with a quota of one CPU, a process started in it: the default is one thread, where PyTorch
    alone would take one per core; OMP_NUM_THREADS stays the user's."""
    base = real_cpu_cgroup()
    assert base is not None
    group = base / f"tandem-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("100000")
        probe = (
            "import logging, torch; from tandem.cpu_quota import applied_limit, default_intra_op_threads, quota_cpus; "
            "logging.basicConfig(level=logging.INFO); "
            "from tandem.model_thread import ModelThread; torch_threads = torch.get_num_threads(); "
            "default = default_intra_op_threads(applied_limit()); "
            "threads = ModelThread('m').call(torch.get_num_threads); "
            "print(quota_cpus(), torch_threads, default, threads)"
        )
        # The child joins the cgroup before it starts Python (and torch): `sh` writes its own pid, then execs.
        command = ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$0" -c "$1"', sys.executable, probe]
        environment = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        output = subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
        quota, torch_threads, threads, model_thread = output.stdout.split()
        assert float(quota) == 1.0 and threads == model_thread == "1"  # a service's model thread takes one
        assert "m: 1 intra-op threads (a CPU limit of 1)" in output.stderr  # and says why
        if len(os.sched_getaffinity(0)) > 1:
            assert int(torch_threads) > 1  # what PyTorch alone takes: one per core it may run on
        given = subprocess.run(command, env={**environment, "OMP_NUM_THREADS": "2"}, capture_output=True, text=True)
        assert given.stdout.split()[2:] == ["2", "2"]
        assert "m: 2 intra-op threads\n" in given.stderr  # the user's count: no limit was applied, none is named
    finally:
        group.rmdir()
