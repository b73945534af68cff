"""How busy is this CPU: the cores this process may use, its thread settings, and how many cores other processes keep busy.

    >>> from minillm.threads import cpu_load_report, busy_other_cores
    >>> busy_other_cores(0.5)          # cores' worth of CPU time other processes used over the last 0.5 s
    0.03
    >>> cpu_load_report()["warnings"]  # [] on an idle machine

Batch-1 decode on a CPU runs one OpenMP thread per core, and those threads wait for each other at
every matmul: when another process takes one of the cores, the whole step waits for the thread
that lost it, so a busy machine can cost many times its share. `minillm doctor` prints this report;
the engine can use `busy_other_cores` to pick its thread count. Linux only for the busy measurement
(/proc/stat and /proc/self/stat); elsewhere `busy_other_cores` raises OSError and the report says so.
"""

from __future__ import annotations

import os
import time

# The thread settings that decide how OpenMP (torch's CPU kernels) and MKL run, reported as set.
THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS")
# Cores' worth of other processes' CPU time above which decode is warned to slow down.
BUSY_CORES_WARN = 0.5
MAX_INTERVAL_S = 60.0
OVERSUBSCRIBED = "decode may be many times slower; minillm uses fewer threads when the machine is busy"


def usable_cpus() -> list[int]:
    """The CPU ids this process may run on (its affinity mask; all CPUs where the OS has no such call)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _busy_and_self_jiffies() -> tuple[int, int, int]:
    """(busy jiffies of all CPUs, steal jiffies of all CPUs, this process's own user + system jiffies)."""
    with open("/proc/stat") as f:
        first = f.readline().split()
    if first[0] != "cpu":
        raise OSError(f"/proc/stat starts with {first[0]!r}, not the 'cpu' totals line")
    # user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is already inside user.
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in first[1:9])
    with open("/proc/self/stat") as f:
        own = f.read()
    # Fields after the command name (which may hold spaces, so split after its closing paren): state is
    # field 3, utime and stime are fields 14 and 15 (1-based), i.e. 11 and 12 after the paren.
    after = own[own.rindex(")") + 2:].split()
    return user + nice + system + irq + softirq, steal, int(after[11]) + int(after[12])


def _jiffies_per_s() -> int:
    return os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _check_interval(interval_s) -> None:
    if not isinstance(interval_s, (int, float)) or not 0 < interval_s <= MAX_INTERVAL_S:
        raise ValueError(f"interval_s={interval_s!r}: give seconds in (0, {MAX_INTERVAL_S:g}]")


def _measure(interval_s: float) -> tuple[float, float]:
    """(cores' worth of CPU time other processes used, cores' worth stolen by the hypervisor) over interval_s."""
    _check_interval(interval_s)
    if not os.path.exists("/proc/stat"):
        raise OSError("no /proc/stat on this system: the busy-core measurement is Linux only")
    busy0, steal0, own0 = _busy_and_self_jiffies()
    t0 = time.perf_counter()
    time.sleep(interval_s)
    return cores_between((busy0, steal0, own0), _busy_and_self_jiffies(), time.perf_counter() - t0)


def cores_between(before: tuple[int, int, int], after: tuple[int, int, int], seconds: float) -> tuple[float, float]:
    """(cores' worth of CPU time other processes used, cores' worth stolen by the hypervisor) between two
    (busy, steal, own) jiffy samples taken `seconds` apart: all CPUs' busy time minus this process's own."""
    (busy0, steal0, own0), (busy1, steal1, own1) = before, after
    ticks = max(seconds * _jiffies_per_s(), 1e-9)
    return max(0, (busy1 - busy0) - (own1 - own0)) / ticks, max(0, steal1 - steal0) / ticks


def busy_other_cores(interval_s: float = 0.5) -> float:
    """How many cores' worth of CPU time the OTHER processes used over the next `interval_s` seconds.

    All CPUs' busy jiffies from /proc/stat minus this process's own (all its threads, /proc/self/stat),
    divided by the wall time: 1.0 means one core kept fully busy by something else. Linux only
    (OSError elsewhere); jiffies are 10 ms, so an interval under ~0.2 s reads coarsely.
    """
    return _measure(interval_s)[0]


def thread_settings() -> dict:
    """torch's thread count, the cores this process may use, and the OpenMP / MKL environment as set."""
    import torch

    cpus = usable_cpus()
    return {
        "usable_cores": len(cpus),
        "affinity": cpus,
        "logical_cpus": os.cpu_count() or len(cpus),
        "torch_threads": torch.get_num_threads(),
        "env": {name: os.environ.get(name) for name in THREAD_ENV},
    }


def load_warnings(torch_threads: int, usable_cores: int, busy_other: float | None) -> list[str]:
    """The warnings, in words with their numbers, for these figures (empty when decode should run at full speed)."""
    if torch_threads > usable_cores:
        return [f"torch runs {torch_threads} threads on {usable_cores} usable cores: {OVERSUBSCRIBED}"]
    if busy_other is None:
        return []
    over = torch_threads + busy_other > usable_cores + BUSY_CORES_WARN
    if busy_other <= BUSY_CORES_WARN and not over:
        return []
    why = f"other processes keep {busy_other:.1f} cores busy"
    if over:
        why += (f" and torch runs {torch_threads} threads on {usable_cores} usable cores (oversubscribed: "
                f"{torch_threads} + {busy_other:.1f} > {usable_cores})")
    return [f"{why}: {OVERSUBSCRIBED}"]


def cpu_load_report(interval_s: float = 0.5) -> dict:
    """thread_settings() plus the load average, the other processes' busy cores over `interval_s` (None where
    it cannot be measured, with `busy_error` saying why), steal, `oversubscribed` and `warnings` in words."""
    report = thread_settings()
    report["loadavg"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    try:
        busy, steal = _measure(interval_s)
        report.update(busy_other_cores=busy, steal_cores=steal, busy_error=None)
    except OSError as exc:
        report.update(busy_other_cores=None, steal_cores=None, busy_error=str(exc))
    busy = report["busy_other_cores"]
    report["oversubscribed"] = report["torch_threads"] + (busy or 0.0) > report["usable_cores"] + BUSY_CORES_WARN
    report["warnings"] = load_warnings(report["torch_threads"], report["usable_cores"], busy)
    return report


def format_cpu_load(report: dict) -> tuple[str, str]:
    """Two lines for doctor: (threads, load)."""
    env = ", ".join(f"{k}={v}" for k, v in report["env"].items() if v is not None) or "no OMP/MKL variables set"
    threads = (f"torch {report['torch_threads']} threads on {report['usable_cores']} usable cores "
               f"(affinity {_ranges(report['affinity'])} of {report['logical_cpus']} logical CPUs); {env}")
    load = "load average " + (" / ".join(f"{v:.2f}" for v in report["loadavg"]) if report["loadavg"] else "unknown")
    if report["busy_other_cores"] is None:
        load += f"; other processes' busy cores not measured ({report['busy_error']})"
    else:
        load += f"; other processes keep {report['busy_other_cores']:.2f} cores busy"
        if report["steal_cores"] and report["steal_cores"] >= 0.05:
            load += f", the hypervisor steals {report['steal_cores']:.2f}"
    if report["warnings"]:
        load = "WARNING: " + "; ".join(report["warnings"]) + f" ({load})"
    return threads, load


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts, start = [], None
    for i, cpu in enumerate(ids):
        if start is None:
            start = cpu
        if i + 1 == len(ids) or ids[i + 1] != cpu + 1:
            parts.append(str(start) if start == cpu else f"{start}-{cpu}")
            start = None
    return ",".join(parts) or "none"
