"""How many CPU threads the next steps use: all of this process's cores on a quiet machine, fewer when
other processes keep cores busy.

Why: a CPU decode step is ~150 parallel regions (every matmul, every attention), and at the end of each
one the threads wait for the slowest. When another process takes one of the cores, the thread that
shares it runs in time slices of a few milliseconds, and every region waits for its next slice: a busy
machine made decode 10-20x slower, not the ~2x its share would predict. One thread fewer never waits for
a core it does not have: with one of two cores busy, one thread decodes at roughly the speed of one
core (~60% of two, as bandwidth allows) instead of a few percent.

    policy = ThreadPolicy()          # max_threads: torch's threads, at most the cores this process may use
    policy.update()                  # each engine step: re-decides at most once per interval_s

It reads /proc/stat (all CPUs' busy time) and /proc/self/stat (this process's own) between two calls,
so it measures only what the *other* processes used (minillm/threads.py). Off where /proc is missing
(macOS, Windows): the threads stay at max_threads.
"""

from __future__ import annotations

import math
import time

import torch

from ..threads import BUSY_CORES_WARN, _busy_and_self_jiffies, cores_between, usable_cpus


class ThreadPolicy:
    def __init__(self, max_threads: int | None = None, interval_s: float = 1.0, clock=time.monotonic,
                 sample=_busy_and_self_jiffies):
        self.max_threads = max_threads or max(1, min(torch.get_num_threads(), len(usable_cpus())))
        self.threads = self.max_threads
        self.interval_s = interval_s
        self.busy_other = 0.0          # cores' worth of other processes' CPU time, last interval
        self.changes: list[tuple[float, int, float]] = []   # (time, threads, busy_other) at each change
        self._clock, self._sample = clock, sample
        self._last: tuple[float, tuple[int, int, int]] | None = None
        self._off = False

    def reset(self) -> None:
        """Back to max_threads, forgetting the last sample (the next update() starts a fresh interval)."""
        self.threads, self.busy_other, self._last = self.max_threads, 0.0, None
        torch.set_num_threads(self.max_threads)

    def want(self, busy_other: float) -> int:
        """Threads for `busy_other` cores kept busy by others: one fewer per busy core past the first half."""
        lost = math.ceil(busy_other - BUSY_CORES_WARN) if busy_other > BUSY_CORES_WARN else 0
        return max(1, min(self.max_threads, len(usable_cpus()) - lost))

    def update(self) -> int:
        """The thread count for the next step (torch.set_num_threads when it changes)."""
        if self._off:
            return self.threads
        now = self._clock()
        if self._last is not None and now - self._last[0] < self.interval_s:
            return self.threads
        try:
            sample = self._sample()
        except OSError:            # no /proc: keep max_threads
            self._off = True
            return self.threads
        if self._last is not None:
            t0, before = self._last
            self.busy_other = cores_between(before, sample, now - t0)[0]
            wanted = self.want(self.busy_other)
            if wanted != self.threads:
                self.threads = wanted
                torch.set_num_threads(wanted)
                self.changes.append((now, wanted, self.busy_other))
        self._last = (now, sample)
        return self.threads
