"""minillm.serve beside a long prompt: live /metrics, a disconnected client aborted at its next chunk, and no
request stuck behind another's prefill (head-of-line blocking) with the server's chunked prefill.

The default model, a prompt of a few thousand tokens (seconds of prefill on a CPU). Timing is asserted as
orderings and ratios with wide margins, never as absolute times: the machine may be busy.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from conftest import assert_engine_idle
from minillm.serve import serve_in_thread
from minillm.serve.chunking import CPU_CHUNK_TOKENS, default_max_num_batched_tokens, server_levers

LONG_TOKENS = 3000     # the head-of-line test: ~16 chunks of 192
STEP_TOKENS = 2000     # the live-metrics test: one whole-prompt step of seconds


def long_prompt(num_tokens: int, salt: int = 0) -> list[int]:
    """Token ids no prefix cache shares with another call's (salt), none special."""
    return [(i * 7919 + salt * 104729) % 40000 + 100 for i in range(num_tokens)]


def gauges(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(("minillm_num_requests_running", "minillm_num_requests_waiting", "minillm_kv_blocks_used")):
            name, value = line.split("{")[0], line.rsplit(" ", 1)[1]
            out[name.removeprefix("minillm_")] = float(value)
    return out


class Timed(threading.Thread):
    """POST one completion in a thread; .start_s / .end_s on time.perf_counter(), .response or .error."""

    def __init__(self, url: str, body: dict, timeout_s: float = 300):
        super().__init__(daemon=True)
        self.url, self.body, self.timeout_s = url, body, timeout_s
        self.response = self.error = None
        self.start_s = self.end_s = None

    def run(self) -> None:
        self.start_s = time.perf_counter()
        try:
            self.response = httpx.post(self.url + "/v1/completions", json=self.body, timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            self.error = exc
        self.end_s = time.perf_counter()

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s


def wait_until(condition, timeout_s: float = 60, what: str = "the condition"):
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what} did not happen within {timeout_s} s")


def test_server_levers_default_to_chunked_prefill_per_device(default_llm):
    engine = default_llm.engine
    # LLM() chunks by default (as vLLM), with the device's budget
    assert (engine.config.chunked_prefill, engine.config.max_num_batched_tokens) == (True, CPU_CHUNK_TOKENS)
    assert default_max_num_batched_tokens("cpu") == CPU_CHUNK_TOKENS == 512
    assert default_max_num_batched_tokens("cuda") == 2048
    assert default_max_num_batched_tokens("cpu", chunked_prefill=False) == 8192
    # the server adds a cap per prompt (half the budget); a change of mode takes that mode's default budget
    assert server_levers(engine) == {"long_prefill_token_threshold": 256}
    assert server_levers(engine, chunked_prefill=None) == {}
    assert server_levers(engine, chunked_prefill=False) == {"chunked_prefill": False, "max_num_batched_tokens": 8192}
    assert server_levers(engine, max_num_batched_tokens=64) == {"max_num_batched_tokens": 64,
                                                                "long_prefill_token_threshold": 32}
    whole = default_llm.with_levers(chunked_prefill=False)
    assert (whole.engine.config.chunked_prefill, whole.engine.config.max_num_batched_tokens) == (False, 8192)
    assert server_levers(whole.engine) == {"chunked_prefill": True, "max_num_batched_tokens": 512,
                                           "long_prefill_token_threshold": 256}
    del whole
    with serve_in_thread(default_llm) as server:
        assert (engine.config.chunked_prefill, engine.config.max_num_batched_tokens,
                engine.config.long_prefill_token_threshold) == (True, 512, 256)
        assert engine.scheduler.config.long_prefill_token_threshold == 256
        assert httpx.post(server.base_url + "/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}).status_code == 200
    assert (engine.config.chunked_prefill, engine.config.max_num_batched_tokens,
            engine.config.long_prefill_token_threshold) == (True, 512, 0)   # given back
    with pytest.raises(ValueError, match="max_num_batched_tokens=0 must be an integer >= 1"):
        serve_in_thread(default_llm, max_num_batched_tokens=0)
    assert engine.owner_thread is None   # a refused lever leaves the engine free


def test_metrics_are_live_during_a_long_prefill_step(default_llm):
    """Whole-prompt prefill: one step of seconds. A scrape inside it sees the long request running and the
    short one sent meanwhile waiting (before, the gauges changed only after a step: 0 and 0)."""
    with serve_in_thread(default_llm, chunked_prefill=False) as server:
        engine = default_llm.engine
        long = Timed(server.url, {"prompt": long_prompt(STEP_TOKENS), "max_tokens": 1})
        long.start()
        wait_until(lambda: engine.scheduler.running, what="the long prompt's admission")
        steps_before = len(engine.stats.steps)
        short = Timed(server.url, {"prompt": [11, 12, 13], "max_tokens": 2})
        short.start()
        seen = wait_until(lambda: (g := gauges(server))["num_requests_waiting"] >= 1 and g, 30,
                          "the short request showing as waiting")
        inside_step = len(engine.stats.steps) == steps_before and long.end_s is None
        long.join()
        short.join()
    assert inside_step, "the scrape came after the long step: the prompt is too short for this machine"
    assert seen["num_requests_running"] == 1 and seen["num_requests_waiting"] == 1, seen
    assert seen["kv_blocks_used"] >= STEP_TOKENS // engine.block_manager.block_size, seen
    assert long.response.status_code == 200 and short.response.status_code == 200
    assert_engine_idle(default_llm)


def test_a_disconnected_client_is_aborted_at_its_next_chunk(default_llm):
    """Two long prompts whose clients leave after 0.5 s stop being prefilled a chunk later (not in full)."""
    chunk = 256
    num_tokens = 6000
    with serve_in_thread(default_llm, max_num_batched_tokens=chunk) as server:
        engine = default_llm.engine
        steps_before = len(engine.stats.steps)
        clients = [Timed(server.url, {"prompt": long_prompt(num_tokens, salt), "max_tokens": 4}, timeout_s=0.5)
                   for salt in (1, 2)]
        for client in clients:
            client.start()
        for client in clients:
            client.join()
        assert all(isinstance(c.error, httpx.TimeoutException) for c in clients), [c.error for c in clients]
        wait_until(lambda: not engine.scheduler.running and not engine.scheduler.waiting, 120,
                   "the aborts of the disconnected requests")
        after = engine.stats.steps[steps_before:]
        metrics = httpx.get(server.url + "/metrics").text
    prefilled = sum(s.num_tokens for s in after)
    aborted = [line for line in metrics.splitlines() if line.startswith("minillm_request_success_total")
               and 'finished_reason="abort"' in line]
    assert len(aborted) == 1 and aborted[0].endswith(" 2"), aborted
    # the disconnect is seen within 0.25 s (DISCONNECT_POLL_S) and acted on a chunk later: far from the whole
    # 12000 prompt tokens (a loaded machine may run a few chunks meanwhile)
    assert prefilled < num_tokens, f"{prefilled} of {2 * num_tokens} prompt tokens were prefilled after the clients left"
    assert all(s.num_tokens <= chunk for s in after)
    assert_engine_idle(default_llm)


def head_of_line(default_llm, chunked: bool) -> tuple[Timed, Timed]:
    # 192-token chunks: the long prompt takes ~16 steps, the short request 2 or 3 of them
    with serve_in_thread(default_llm, chunked_prefill=chunked, max_num_batched_tokens=192 if chunked else None) \
            as server:
        engine = default_llm.engine
        long = Timed(server.url, {"prompt": long_prompt(LONG_TOKENS, salt=3 + chunked), "max_tokens": 1})
        long.start()
        wait_until(lambda: engine.scheduler.running, what="the long prompt's admission")
        time.sleep(0.3)   # well inside the long prefill (seconds)
        short = Timed(server.url, {"prompt": [21, 22, 23, 24], "max_tokens": 2, "ignore_eos": True})
        short.start()
        long.join()
        short.join()
    assert long.response.status_code == 200 and short.response.status_code == 200
    assert_engine_idle(default_llm)
    return long, short


def test_no_request_waits_behind_a_long_prefill_with_chunked_prefill(default_llm):
    """Chunked (the server's default): the short request is prefilled beside the long prompt's next chunk, its
    second token decodes beside the chunk after, and it finishes in well under a third of the long one's time."""
    long, short = head_of_line(default_llm, chunked=True)
    ratio = short.latency_s / long.latency_s
    print(f"chunked: short {short.latency_s:.2f} s, long {long.latency_s:.2f} s, ratio {ratio:.3f}")
    assert short.end_s < long.end_s and ratio < 1 / 3, \
        f"chunked: short {short.latency_s:.2f} s beside long {long.latency_s:.2f} s (ratio {ratio:.2f}, want < 0.33)"


@pytest.mark.slow
def test_without_chunked_prefill_a_short_request_waits_for_the_whole_prefill(default_llm):
    """The baseline the test above is measured against: whole-prompt prefill is one step, the short request
    joins only after it (head-of-line blocking)."""
    long, short = head_of_line(default_llm, chunked=False)
    print(f"whole-prompt: short {short.latency_s:.2f} s, long {long.latency_s:.2f} s, "
          f"ratio {short.latency_s / long.latency_s:.3f}")
    assert short.end_s > long.end_s, "without chunking the short request should finish after the long prefill"
    waited = short.latency_s / (long.end_s - short.start_s)
    assert waited > 0.9, f"without chunking the short request waited {waited:.2f} of the long prefill's rest"
