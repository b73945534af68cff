"""engine/thread_policy.py: threads from the other processes' load, on a fake clock and fake /proc samples,
and once with a real busy process."""

import subprocess
import sys
import time

import pytest
import torch

from minillm.engine.thread_policy import ThreadPolicy
from minillm.threads import _jiffies_per_s, usable_cpus


class FakeProc:
    """(busy, steal, own) jiffies as /proc would give them, advanced by hand."""

    def __init__(self):
        self.busy = self.own = 0

    def run(self, seconds: float, others: float, mine: float):
        hz = _jiffies_per_s()
        self.busy += round(seconds * hz * (others + mine))
        self.own += round(seconds * hz * mine)

    def __call__(self):
        return self.busy, 0, self.own


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_drop_when_others_keep_a_core_busy_and_come_back(restore_threads):
    if len(usable_cpus()) < 2:
        pytest.skip("one usable CPU: nothing to drop")
    torch.set_num_threads(2)                         # a pytest-xdist worker starts with its share
    now = [0.0]
    proc = FakeProc()
    policy = ThreadPolicy(max_threads=2, interval_s=1.0, clock=lambda: now[0], sample=proc)
    assert policy.update() == 2                      # first sample: nothing to compare yet
    for others, want in [(0.1, 2), (1.0, 1), (0.9, 1), (0.4, 2), (0.6, 1), (0.0, 2)]:
        proc.run(1.0, others=others, mine=1.9 if want == 2 else 1.0)   # our own busy threads never count
        now[0] += 1.0
        assert policy.update() == want, (others, policy.busy_other)
        assert torch.get_num_threads() == want
        assert policy.busy_other == pytest.approx(others, abs=0.02)
    assert [c[1] for c in policy.changes] == [1, 2, 1, 2]


def test_it_decides_at_most_once_per_interval(restore_threads):
    now = [0.0]
    proc = FakeProc()
    policy = ThreadPolicy(max_threads=2, interval_s=1.0, clock=lambda: now[0], sample=proc)
    policy.update()
    proc.run(0.5, others=2.0, mine=0.0)
    now[0] = 0.5
    assert policy.update() == 2 and policy.busy_other == 0.0   # too soon: not re-decided


def test_without_proc_it_keeps_its_threads():
    def missing():
        raise OSError("no /proc/stat")

    policy = ThreadPolicy(max_threads=2, sample=missing)
    assert policy.update() == 2 and policy.update() == 2


def test_a_real_busy_process_is_seen(restore_threads):
    if len(usable_cpus()) < 2:
        pytest.skip("needs two usable CPUs")
    policy = ThreadPolicy(max_threads=2, interval_s=0.3)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        policy.update()
        time.sleep(0.6)
        assert policy.update() == 1 and policy.busy_other > 0.6
    finally:
        hog.kill()
        hog.wait()


def test_cpu_threads_lever_is_checked():
    from minillm.config import EngineConfig

    for bad in (0, -1, 10 ** 6, "many", 1.5, True):
        with pytest.raises(ValueError, match="cpu_threads="):
            EngineConfig(cpu_threads=bad).validate()
    EngineConfig(cpu_threads=1).validate()
