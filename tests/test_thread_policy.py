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


@pytest.mark.parametrize("chunked", [True, False])
def test_a_long_prefill_is_re_decided_between_its_chunks(restore_threads, chunked):
    """A prompt of 600 tokens on a tiny model, each model pass taking 0.6 s of a fake clock; another process keeps
    a core busy from the start. With chunked prefill (the default) the policy re-decides between the prompt's
    chunks and the rest of the prefill runs on one thread; whole-prompt prefill is one step, decided before it."""
    if len(usable_cpus()) < 2:
        pytest.skip("one usable CPU: nothing to drop")
    from minillm import LLM, SamplingParams

    torch.set_num_threads(2)
    llm = LLM("random:tiny-llama", max_model_len=1024, max_num_batched_tokens=64 if chunked else None,
              chunked_prefill=None if chunked else False)
    assert llm.engine.config.chunked_prefill is chunked
    now = [0.0]
    proc = FakeProc()
    policy = llm.engine.thread_policy = ThreadPolicy(max_threads=2, interval_s=1.0, clock=lambda: now[0], sample=proc)
    runner, passes = llm.engine.runner, []
    original = runner.run

    def timed_pass(seqs):
        passes.append((seqs[0].num_cached_tokens, seqs[0].num_scheduled_tokens, torch.get_num_threads()))
        proc.run(0.6, others=1.0, mine=1.0)
        now[0] += 0.6
        return original(seqs)

    runner.run = timed_pass
    prompt = [(i * 13 + 5) % 500 + 3 for i in range(600)]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    prefill = [p for p in passes if p[0] < len(prompt)]
    if chunked:
        assert [p[1] for p in prefill] == [64] * 9 + [24], prefill       # ten chunks of at most 64 tokens
        # decided at the second interval's end (the first update only samples): the chunks after it run on one thread
        assert [p[2] for p in prefill] == [2, 2, 1, 1, 1, 1, 1, 1, 1, 1], prefill
        assert policy.changes[0][1:] == (1, pytest.approx(1.0, abs=0.02))
    else:
        assert [(p[1], p[2]) for p in prefill] == [(600, 2)], prefill   # one step: no decision inside it
