"""minillm.threads: the cores this process may use, the thread settings, other processes' busy cores (doctor's report)."""

import subprocess
import sys
import time

import pytest

from minillm import threads
from minillm.threads import busy_other_cores, cpu_load_report, format_cpu_load, load_warnings

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux only")


@linux_only
def test_a_spinning_process_counts_as_a_busy_core():
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)   # let it start spinning (interpreter start-up is not what is measured)
        busy = busy_other_cores(0.5)
        assert spinner.poll() is None, "the spinner exited early"
    finally:
        spinner.kill()
        spinner.wait()
    assert busy > 0.5, f"a process spinning on its own core counted as {busy:.2f} busy cores"


def test_interval_out_of_range_is_refused_with_the_range():
    for bad in (0, -1, 61, "1"):
        with pytest.raises(ValueError, match=r"interval_s=.*\(0, 60\]"):
            busy_other_cores(bad)


@linux_only
def test_report_has_the_settings_and_a_measurement(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    report = cpu_load_report(interval_s=0.2)
    assert report["usable_cores"] == len(report["affinity"]) >= 1
    assert report["env"]["OMP_NUM_THREADS"] == "3" and report["env"]["OMP_WAIT_POLICY"] is None
    assert report["busy_other_cores"] >= 0 and report["busy_error"] is None
    assert len(report["loadavg"]) == 3
    threads_line, _ = format_cpu_load(report)
    assert "OMP_NUM_THREADS=3" in threads_line and f"torch {report['torch_threads']} threads" in threads_line


@pytest.mark.parametrize("torch_threads, usable, busy, expect", [
    (2, 2, 0.1, None),                               # idle enough
    (2, 2, 0.8, "oversubscribed: 2 + 0.8 > 2"),      # one other process on a 2-core machine
    (1, 4, 0.8, "other processes keep 0.8 cores busy:"),   # busy, but cores to spare
    (8, 2, 0.0, "torch runs 8 threads on 2 usable cores"),
    (2, 2, None, None),                              # not measured: no warning from a guess
])
def test_warnings_name_the_numbers(torch_threads, usable, busy, expect):
    got = load_warnings(torch_threads, usable, busy)
    if expect is None:
        assert got == []
    else:
        assert len(got) == 1 and expect in got[0] and "fewer threads when the machine is busy" in got[0], got


def test_report_elsewhere_says_why_not_measured(monkeypatch):
    def no_proc(interval_s):
        raise OSError("no /proc/stat on this system: the busy-core measurement is Linux only")

    monkeypatch.setattr(threads, "_measure", no_proc)
    report = cpu_load_report(interval_s=0.1)
    assert report["busy_other_cores"] is None and "Linux only" in report["busy_error"]
    _, load = format_cpu_load(report)
    assert "not measured" in load and "Linux only" in load


def test_cpu_ranges():
    assert threads._ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert threads._ranges([3]) == "3"
