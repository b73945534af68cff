"""The autoscale demo: a load ramp up then down against an autoscaling fleet, its 1 -> 2 -> 1 timeline printed live."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

from .handle import Fleet


def replica_count_path(timeline: list[tuple[float, int, str]]) -> list[int]:
    """The running-replica counts the monitor saw, repeats dropped: [1, 2, 1] for a scale up then down."""
    path: list[int] = []
    for _, running, text in timeline:
        if text.startswith(("replicas:", "autoscaler decided:")) and running and (not path or path[-1] != running):
            path.append(running)
    return path


def print_new_events(fleet: Fleet, printed: int, out) -> int:
    events = fleet.timeline()
    for t, running, text in events[printed:]:
        print(f"  t={t:7.2f} s  [{running} running]  {text}", file=out, flush=True)
    return len(events)


def autoscale_demo(fleet: Fleet, *, high_clients: int = 8, max_tokens: int = 32, low_s: float = 3.0,
                   hold_s: float = 4.0, timeout_s: float = 240.0, out=sys.stdout) -> list[int]:
    """A load ramp against an autoscaling fleet: one client for `low_s`, then `high_clients` clients until a second
    replica runs (plus `hold_s`), then none until the fleet is back to its minimum. Prints the timeline as it
    happens; returns replica_count_path(fleet.timeline()), e.g. [1, 2, 1]."""
    if fleet.autoscaling is None:
        raise ValueError("autoscale_demo needs a fleet started with autoscaling=AutoscalingConfig(...)")
    import httpx

    low, high = fleet.autoscaling.min_replicas, fleet.autoscaling.max_replicas
    clients = {"n": 1}
    stop = threading.Event()
    done = {"requests": 0, "failed": 0}

    async def client(index: int) -> None:
        async with httpx.AsyncClient(timeout=120.0) as http:
            while not stop.is_set():
                if index >= clients["n"]:
                    await asyncio.sleep(0.05)
                    continue
                body = {"prompt": [100 + (index * 7 + k) % 300 for k in range(12)], "max_tokens": max_tokens,
                        "ignore_eos": True, "stream": True}
                try:
                    async with http.stream("POST", fleet.base_url + "/v1/completions", json=body) as response:
                        async for _ in response.aiter_lines():
                            pass
                    done["requests"] += 1
                except httpx.HTTPError:
                    done["failed"] += 1

    async def load() -> None:
        await asyncio.gather(*(client(i) for i in range(high_clients)))

    loader = threading.Thread(target=asyncio.run, args=(load(),), name="minillm-fleet-load", daemon=True)
    printed = print_new_events(fleet, 0, out)
    t0 = time.monotonic()

    def phase(text: str) -> None:
        print(f"  t={time.time() - fleet.started_at:7.2f} s  load: {text}", file=out, flush=True)

    def wait(predicate, seconds: float) -> bool:
        nonlocal printed
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            printed = print_new_events(fleet, printed, out)
            if predicate():
                return True
            time.sleep(0.5)
        return predicate()

    try:
        phase(f"1 streaming client ({max_tokens} tokens per request) for {low_s:.0f} s")
        loader.start()
        wait(lambda: False, low_s)
        clients["n"] = high_clients
        phase(f"{high_clients} streaming clients (target {fleet.autoscaling.target_ongoing_requests:g} ongoing "
              f"requests per replica) until {high} replicas run")
        if not wait(lambda: fleet.num_replicas() >= high, timeout_s):
            raise TimeoutError(f"the fleet did not scale to {high} replicas within {timeout_s:.0f} s")
        wait(lambda: False, hold_s)
        clients["n"] = 0
        phase(f"no clients until the fleet is back to {low} replica(s)")
        if not wait(lambda: fleet.num_replicas() <= low, timeout_s):
            raise TimeoutError(f"the fleet did not scale back to {low} replica(s) within {timeout_s:.0f} s")
        wait(lambda: False, 1.0)
    finally:
        stop.set()
        loader.join(30.0)
        print_new_events(fleet, printed, out)
    path = replica_count_path(fleet.timeline())
    print(f"replica count: {' -> '.join(map(str, path))} over {time.monotonic() - t0:.0f} s "
          f"({done['requests']} requests served, {done['failed']} failed)", file=out, flush=True)
    return path
