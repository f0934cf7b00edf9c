"""Tests of ``medusa_core.cpu``: the physical-core count that is the default torch thread count of the
app and the benchmark, on hand-written ``/proc/cpuinfo`` text and a fake sysfs tree."""

from __future__ import annotations

import os

from medusa_core.cpu import cores_in_cpuinfo, cores_in_sysfs, physical_cores


def cpuinfo(*processors: tuple[int, int, int]) -> str:
    """``/proc/cpuinfo`` text of x86 processors given as (processor, physical id, core id)."""
    return "\n\n".join(
        f"processor\t: {p}\nvendor_id\t: GenuineIntel\nmodel name\t: Fake CPU @ 2.00GHz\n"
        f"physical id\t: {socket}\nsiblings\t: 4\ncore id\t\t: {core}\ncpu cores\t: 2\nflags\t\t: fpu sse2"
        for p, socket, core in processors
    ) + "\n\n"


# 2 cores with 2 hyper-threads each: processors 0 and 2 share core 0, processors 1 and 3 share core 1.
HYPERTHREADED = cpuinfo((0, 0, 0), (1, 0, 1), (2, 0, 0), (3, 0, 1))


def test_hyper_threads_of_one_core_count_once():
    assert cores_in_cpuinfo(HYPERTHREADED) == 2


def test_the_same_core_id_on_two_sockets_is_two_cores():
    assert cores_in_cpuinfo(cpuinfo((0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1))) == 4


def test_only_the_processors_this_process_may_run_on_count():
    assert cores_in_cpuinfo(HYPERTHREADED, allowed={0, 2}) == 1  # two threads of core 0
    assert cores_in_cpuinfo(HYPERTHREADED, allowed={0, 1}) == 2
    assert cores_in_cpuinfo(HYPERTHREADED, allowed={7}) is None


def test_cpuinfo_without_core_ids_gives_no_answer_so_the_caller_falls_back():
    arm = "processor\t: 0\nBogoMIPS\t: 48.00\n\nprocessor\t: 1\nBogoMIPS\t: 48.00\n\nHardware\t: Fake SoC\n"
    assert cores_in_cpuinfo(arm) is None


def test_sysfs_topology_counts_distinct_package_and_core_ids(tmp_path):
    for cpu, (package, core) in enumerate([(0, 0), (0, 1), (0, 0), (0, 1)]):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    assert cores_in_sysfs({0, 1, 2, 3}, root=tmp_path) == 2
    assert cores_in_sysfs({1, 3}, root=tmp_path) == 1
    assert cores_in_sysfs({0, 9}, root=tmp_path) is None  # cpu9 has no topology to read


def test_this_machine_has_at_least_one_physical_core_and_no_more_than_its_allowed_cpus():
    n = physical_cores()
    assert 1 <= n <= len(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1))
