"""Lab 03 helpers — batching: the step-simulator checks, Gantt charts, the printouts and figure of the
real-engine runs (batch size, static vs continuous; the runs themselves, measure_batch_sweep and
measure_policies, are written in the notebook), the roofline of batched decode on this machine
(DecodeRoofline) and the service-level chooser.

The learner writes, with fixed signatures:

    num_steps(schedule) -> int
    utilisation(schedule) -> float                       # busy slot-steps / total slot-steps
    simulate_batching(output_lengths, num_slots, policy) -> schedule
    aggregate_tps(row) -> float                          # a sweep row's output tokens / wall time
    per_user_tps(row) -> float | None                    # 1 / the mean of the row's TPOTs
    batching_speedup(run_one_at_a_time, run_batched, clock, warmup, repeats) -> dict   # the timing harness
    largest_batch_meeting_floor(batch_sizes, per_user_tps, floor) -> int | None

and sets `answer_most_saving_slots` (the number of slots where continuous batching saves the most steps).

A schedule is a list of steps; each step is a list of `num_slots` entries, the id of the
request decoding in that slot (its index in `output_lengths`) or None for an idle slot.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from . import common
from .common import (CheckFailed, call_learner, control_panel, device_label, echo_prediction, format_si, new_figure,
                     passed)
from .lab01 import reference_arithmetic_intensity, reference_decode_bandwidth_bound_tokens_per_s, ridge_batch

POLICIES = ("static", "continuous")

# The course's example: 12 requests on 4 slots. These lengths (found by a search over lists
# of 12 lengths in 1..7) give static 19 steps and continuous 14, utilisation 62% -> 84%.
EXAMPLE_OUTPUT_LENGTHS: tuple[int, ...] = (3, 3, 4, 7, 2, 6, 3, 4, 3, 6, 1, 5)
EXAMPLE_NUM_SLOTS = 4


# =================================================================== the reference simulator
def reference_schedule(output_lengths: Sequence[int], num_slots: int, policy: str) -> list[list[int | None]]:
    """The schedule the checks expect: first come, first served; a request holds one slot for
    `output_lengths[i]` consecutive steps. Static admits a new group only when every slot is
    free; continuous refills each free slot (lowest slot first) at the start of every step."""
    _validate(output_lengths, num_slots, policy)
    waiting = list(range(len(output_lengths)))
    slots: list[int | None] = [None] * num_slots
    steps_left = [0] * num_slots
    schedule: list[list[int | None]] = []
    while waiting or any(r is not None for r in slots):
        if policy == "continuous" or all(r is None for r in slots):
            for s in range(num_slots):
                if slots[s] is None and waiting:
                    slots[s] = waiting.pop(0)
                    steps_left[s] = output_lengths[slots[s]]
        schedule.append(list(slots))
        for s in range(num_slots):
            if slots[s] is not None:
                steps_left[s] -= 1
                if steps_left[s] == 0:
                    slots[s] = None
    return schedule


def _validate(output_lengths, num_slots, policy) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} must be one of {POLICIES}")
    if not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"num_slots={num_slots!r} must be an int >= 1")
    for i, n in enumerate(output_lengths):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"output_lengths[{i}]={n!r} must be an int >= 1")


def _num_steps(schedule) -> int:
    busy = [i for i, step in enumerate(schedule) if any(r is not None for r in step)]
    return busy[-1] + 1 if busy else 0


def _utilisation(schedule) -> float:
    steps = _num_steps(schedule)
    if steps == 0:
        return 0.0
    busy = sum(r is not None for step in schedule[:steps] for r in step)
    return busy / (steps * len(schedule[0]))


# =================================================================== checks
SCHEDULE_CASES = (  # hand-made schedules: (schedule, steps, utilisation, what it shows)
    ([[0, 1], [0, None], [None, None]], 2, 0.75, "an idle step at the end does not count"),
    ([[0, 1, 2], [0, 1, None], [0, None, None]], 3, 6 / 9, "3 slots, requests of 3, 2, 1 steps"),
    ([[0], [1], [2], [3]], 4, 1.0, "one slot, always busy"),
    ([[None, None], [0, None]], 2, 0.25, "an idle step at the start counts (the slots were there)"),
    ([[None, None], [None, None]], 0, 0.0, "only idle steps: 0 steps, utilisation 0"),
    ([], 0, 0.0, "an empty schedule: 0 steps, utilisation 0 (not a ZeroDivisionError)"),
)


def check_num_steps(num_steps: Callable) -> None:
    for schedule, expected, _, why in SCHEDULE_CASES:
        got = call_learner(num_steps, ([list(s) for s in schedule],), f"num_steps({schedule})", why)
        if got != expected:
            hint = ""
            if len(schedule) != expected and got == len(schedule):
                hint = " — you counted the trailing all-idle steps; stop at the last step where a slot is busy"
            elif got == sum(any(r is not None for r in step) for step in schedule):
                hint = " — you counted the busy steps; an idle step before the last busy one still takes a step"
            elif isinstance(got, int) and got == expected - 1:
                hint = " — one short: the last busy step's index is 0-based, the count is that index + 1"
            raise CheckFailed(f"num_steps({schedule}) returned {got!r}, expected {expected} ({why}){hint}")
    passed("num_steps", len(SCHEDULE_CASES))


def check_utilisation(utilisation: Callable) -> None:
    for schedule, _, expected, why in SCHEDULE_CASES:
        got = call_learner(utilisation, ([list(s) for s in schedule],), f"utilisation({schedule})", why)
        if isinstance(got, bool) or not isinstance(got, (int, float)) or abs(got - expected) > 1e-9:
            hint = ""
            if isinstance(got, (int, float)) and schedule and abs(got - expected * 100) < 1e-6:
                hint = " — return a fraction in [0, 1], not a percentage"
            elif isinstance(got, (int, float)) and schedule and len(schedule) != _num_steps(schedule):
                busy = sum(r is not None for step in schedule for r in step)
                if abs(got - busy / (len(schedule) * len(schedule[0]))) < 1e-9:
                    hint = " — the trailing idle steps count in neither the steps nor the slot-steps (use num_steps)"
            raise CheckFailed(f"utilisation({schedule}) returned {got!r}, expected {expected:.4g} ({why}){hint}")
    passed("utilisation", len(SCHEDULE_CASES))


SIMULATION_CASES = (  # (output_lengths, num_slots)
    (EXAMPLE_OUTPUT_LENGTHS, EXAMPLE_NUM_SLOTS),
    ((5, 1, 1, 1, 1), 2),
    ((2, 2, 2), 1),
    ((1, 8, 2, 3, 3, 9, 1), 3),
    ((4, 4), 5),
    ((6,), 2),
)


def _describe_schedule(schedule, limit: int = 24) -> str:
    rows = [f"  step {t:>2}: " + " ".join(f"{'.' if r is None else r:>3}" for r in step) for t, step in enumerate(schedule[:limit])]
    if len(schedule) > limit:
        rows.append(f"  ... ({len(schedule) - limit} more steps)")
    return "\n".join(rows)


def _check_one(simulate: Callable, lengths: Sequence[int], num_slots: int, policy: str) -> None:
    call = f"simulate_batching({list(lengths)}, num_slots={num_slots}, policy={policy!r})"
    schedule = call_learner(simulate, (list(lengths), num_slots, policy), call)
    if not isinstance(schedule, (list, tuple)):
        raise CheckFailed(f"{call} returned {type(schedule).__name__}; expected a list of steps, each a list of "
                          f"{num_slots} request ids or None")
    for t, step in enumerate(schedule):
        if not isinstance(step, (list, tuple)) or len(step) != num_slots:
            raise CheckFailed(f"{call}: step {t} is {step!r}; every step must list exactly {num_slots} slots "
                              f"(a request id or None for an idle slot)")
    # Where each request ran: (step, slot) pairs in step order.
    runs: dict[int, list[tuple[int, int]]] = {}
    for t, step in enumerate(schedule):
        for s, r in enumerate(step):
            if r is None:
                continue
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < len(lengths):
                raise CheckFailed(f"{call}: step {t}, slot {s} holds {r!r}; a slot holds a request id "
                                  f"0..{len(lengths) - 1} or None")
            runs.setdefault(r, []).append((t, s))
    for r, n in enumerate(lengths):
        got = runs.get(r, [])
        if len(got) != n:
            raise CheckFailed(f"{call}: request {r} decodes in {len(got)} slot-steps, but it needs "
                              f"output_lengths[{r}] = {n} steps (one token per step)")
        steps = [t for t, _ in got]
        if len(set(steps)) != len(steps):
            raise CheckFailed(f"{call}: request {r} sits in two slots at step {steps[0]}; a request decodes "
                              f"in one slot, one token per step")
        if steps != list(range(steps[0], steps[0] + n)) or len({s for _, s in got}) != 1:
            raise CheckFailed(f"{call}: request {r} ran at steps {steps} in slots {sorted({s for _, s in got})}; once "
                              f"admitted, a request keeps its slot for {n} consecutive steps until it finishes")
    start = {r: runs[r][0][0] for r in runs}
    end = {r: start[r] + lengths[r] - 1 for r in runs}
    for a, b in zip(range(len(lengths)), range(1, len(lengths))):
        if start[b] < start[a]:
            raise CheckFailed(f"{call}: request {b} started at step {start[b]}, before request {a} (step {start[a]}); "
                              f"requests are admitted first come, first served (in id order)")
    if policy == "static":
        for r in range(len(lengths)):
            running = [q for q in range(len(lengths)) if q != r and start[q] < start[r] <= end[q]]
            if running:
                q = running[0]
                raise CheckFailed(f"static policy admitted request {r} at step {start[r]} while request {q} of the "
                                  f"same batch was still running (it runs until step {end[q]}) — static waits for the "
                                  f"whole batch to finish before admitting the next group.\n{call}:\n"
                                  f"{_describe_schedule(schedule)}")
        for t in sorted(set(start.values())):
            group = [q for q in range(len(lengths)) if start[q] == t]
            later = [q for q in range(len(lengths)) if start[q] > t]
            if len(group) < num_slots and later:
                raise CheckFailed(f"static policy started only {len(group)} request(s) at step {t} ({group}) with "
                                  f"{num_slots} slots free; request {later[0]} was waiting and should have joined "
                                  f"that batch — static fills every free slot, then waits for the whole batch.\n"
                                  f"{call}:\n{_describe_schedule(schedule)}")
    else:
        for t, step in enumerate(schedule[: _num_steps(schedule)]):
            for s, r in enumerate(step):
                waiting = [q for q in range(len(lengths)) if start[q] > t]
                if r is None and waiting:
                    raise CheckFailed(f"continuous policy left slot {s} idle at step {t} while request {waiting[0]} "
                                      f"was waiting — continuous batching refills a slot the step after it frees.\n"
                                      f"{call}:\n{_describe_schedule(schedule)}")
    expected = reference_schedule(lengths, num_slots, policy)
    if _num_steps(schedule) != _num_steps(expected):
        raise CheckFailed(f"{call} takes {_num_steps(schedule)} steps; expected {_num_steps(expected)}. Yours:\n"
                          f"{_describe_schedule(schedule)}\nexpected:\n{_describe_schedule(expected)}")


def check_simulate_batching(simulate: Callable, policies: Sequence[str] = POLICIES,
                            cases: Sequence[tuple[Sequence[int], int]] = SIMULATION_CASES) -> None:
    """Run the learner's simulator on a few workloads; say which rule a schedule breaks."""
    for policy in policies:
        for lengths, num_slots in cases:
            _check_one(simulate, lengths, num_slots, policy)
    passed(f"simulate_batching ({', '.join(policies)})", len(cases) * len(policies))


def check_largest_batch_meeting_floor(choose: Callable) -> None:
    cases = (  # (batch_sizes, per_user_tps, floor, expected, why)
        ([1, 2, 4, 8], [50.0, 45.0, 30.0, 12.0], 20.0, 4, "per-user speed falls as the batch grows"),
        ([1, 2, 4, 8], [50.0, 45.0, 30.0, 12.0], 30.0, 4, "a batch exactly at the floor meets it (>=)"),
        ([1, 2, 4, 8], [50.0, 45.0, 30.0, 12.0], 60.0, None, "no batch meets the floor: return None"),
        ([1, 2, 4, 8], [50.0, 45.0, 30.0, 12.0], 0.0, 8, "no floor: the largest batch"),
        ([8, 1, 4, 2], [12.0, 50.0, 30.0, 45.0], 40.0, 2, "sizes in any order: pair each with its own speed"),
        ([4, 8, 2, 1], [30.0, 12.0, 45.0, 50.0], 20.0, 4, "sizes in any order: the largest that meets it, wherever it stands"),
        ([1, 2, 4, 8, 16], [40.0, 41.0, 25.0, 26.0, 5.0], 25.5, 8, "noisy measurements: the largest that meets it"),
        ([], [], 1.0, None, "no measurements at all: None"),
    )
    for sizes, tps, floor, expected, why in cases:
        call = f"largest_batch_meeting_floor({sizes}, {tps}, floor={floor})"
        got = call_learner(choose, (list(sizes), list(tps), floor), call, why)
        if got != expected:
            hint = ""
            meeting = [b for b, v in zip(sizes, tps) if v >= floor]
            if expected is not None and got == max((b for b, v in zip(sizes, tps) if v > floor), default=None):
                hint = " — use >= (a batch exactly at the floor meets it)"
            elif meeting and got == meeting[-1]:
                hint = " — that is the last size in the list that meets it; the sizes come in any order: take the largest"
            elif got in range(len(sizes)) and expected in sizes and got == sizes.index(expected):
                hint = " — that is the position in the list; return the batch size itself"
            raise CheckFailed(f"{call} returned {got!r}, expected {expected!r} ({why}){hint}")
    passed("largest_batch_meeting_floor", len(cases))


def most_saving_slots(output_lengths: Sequence[int] = EXAMPLE_OUTPUT_LENGTHS) -> tuple[int, dict[int, tuple[int, int]]]:
    """The number of slots (1 .. len(output_lengths)) where continuous batching saves the most steps over
    static (the smallest on a tie), and {slots: (static steps, continuous steps)} for every one."""
    steps = {n: (_num_steps(reference_schedule(output_lengths, n, "static")),
                 _num_steps(reference_schedule(output_lengths, n, "continuous")))
             for n in range(1, len(output_lengths) + 1)}
    best = max(steps, key=lambda n: (steps[n][0] - steps[n][1], -n))
    return best, steps


def check_answer_most_saving_slots(answer, output_lengths: Sequence[int] = EXAMPLE_OUTPUT_LENGTHS) -> None:
    """The short answer of the slots toggle: where does continuous batching save the most steps?"""
    best, steps = most_saving_slots(output_lengths)
    top = len(output_lengths)
    if isinstance(answer, bool) or not isinstance(answer, int) or not 1 <= answer <= top:
        raise CheckFailed(f"answer_most_saving_slots = {answer!r}: a number of slots, an int from 1 to {top}")
    if answer != best:
        s, c = steps[answer]
        s_best, c_best = steps[best]
        hint = ""
        if answer == max(steps, key=lambda n: steps[n][0] / steps[n][1]):
            hint = (" — that is where the ratio static / continuous is largest; the question asks for the steps saved "
                    "(static steps - continuous steps)")
        elif answer == top:
            hint = " — with a slot per request both policies take the longest request's steps: nothing to save"
        raise CheckFailed(f"answer_most_saving_slots = {answer}: with {answer} slots static takes {s} steps and "
                          f"continuous {c}, {s - c} saved; another number of slots saves more ({s_best - c_best} "
                          f"steps){hint}. Move the slider through every value and compare the two policies' steps")
    s, c = steps[best]
    print(f"✓ answer_most_saving_slots = {answer}: static {s} steps, continuous {c}, {s - c} saved — more than any "
          f"other number of slots from 1 to {top}")


# =================================================================== the speeds of a sweep row
SPEED_CASES = (  # hand-made raw rows: (row, aggregate tokens/s, per-user tokens/s, what it shows)
    ({"batch": 1, "output_tokens": 10, "wall_s": 0.5, "tpots_s": [0.04]}, 20.0, 25.0,
     "one request: the wall time includes its prefill, 1 / TPOT does not"),
    ({"batch": 2, "output_tokens": 20, "wall_s": 1.0, "tpots_s": [0.02, 0.06]}, 20.0, 25.0,
     "two requests whose TPOTs differ: 1 / the mean TPOT (0.04 s), not the mean of 1/TPOT"),
    ({"batch": 4, "output_tokens": 48, "wall_s": 1.6, "tpots_s": [0.1, 0.1, 0.1, 0.1]}, 30.0, 10.0,
     "four requests of 12 tokens: aggregate counts all 48"),
    ({"batch": 3, "output_tokens": 3, "wall_s": 0.3, "tpots_s": []}, 10.0, None,
     "every request made one token: no decode step, no TPOT, per-user speed None"),
)


def _describe_row(row: dict) -> str:
    return "{" + ", ".join(f"{k!r}: {_round(v)}" for k, v in row.items()) + "}"


def _round(value):
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(str(_round(v)) for v in value[:6]) + (", ..." if len(value) > 6 else "") + "]"
    return repr(value)


def _speed_hint(name: str, got: float, row: dict) -> str:
    tokens, wall, tpots, batch = row["output_tokens"], row["wall_s"], row["tpots_s"], row["batch"]
    near = lambda value: value is not None and abs(got - value) <= 1e-6 * max(abs(value), 1e-12)  # noqa: E731
    if name == "aggregate_tps":
        if near(tokens / wall / batch):
            return " — that is per request; aggregate counts every request's tokens: don't divide by the batch"
        if near(wall / tokens):
            return " — that is seconds per token; tokens/s is output tokens / wall time"
        if tpots and near(batch / (sum(tpots) / len(tpots))):
            return " — that is batch / TPOT, which leaves out the prefills; use the measured tokens and wall time"
        return ""
    if near(tokens / wall / batch):
        return (" — aggregate / batch spreads the prefill and the wait for the first token over every token; "
                "one user's speed is 1 / TPOT, the time between that user's tokens")
    if tpots and near(sum(tpots) / len(tpots)):
        return " — that is the mean TPOT itself, in seconds per token: invert it"
    if tpots and near(sum(1 / t for t in tpots) / len(tpots)):
        return " — that is the mean of the requests' speeds; the contract is 1 / the mean TPOT (average the times first)"
    if tpots and near(1 / max(tpots)):
        return " — that is the slowest request's speed; the contract is 1 / the mean TPOT"
    return ""


def _check_speed(fn: Callable, name: str, row: dict, expected: float | None, why: str) -> None:
    call = f"{name}({_describe_row(row)})"
    got = call_learner(fn, (dict(row, tpots_s=list(row["tpots_s"])),), call, why)
    if expected is None:
        if got is not None:
            raise CheckFailed(f"{call} returned {got!r}, expected None ({why})")
        return
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        raise CheckFailed(f"{call} returned {got!r}; expected a number of tokens/s, {expected:.4g} ({why})")
    if abs(got - expected) > 1e-6 * abs(expected):
        raise CheckFailed(f"{call} returned {got:.4g}, expected {expected:.4g} tokens/s ({why})"
                          + _speed_hint(name, got, row))


def check_sweep_speeds(aggregate_tps: Callable, per_user_tps: Callable, rows: Sequence[dict] = ()) -> None:
    """The learner's two speeds on hand-made rows, then on every raw row of their own sweep (each recomputed
    here from the row's output tokens, wall time and TPOTs)."""
    for row, aggregate, per_user, why in SPEED_CASES:
        _check_speed(aggregate_tps, "aggregate_tps", row, aggregate, why)
        _check_speed(per_user_tps, "per_user_tps", row, per_user, why)
    for row in rows:
        raw = {k: row[k] for k in ("batch", "output_tokens", "wall_s", "tpots_s")}
        why = f"your sweep's row at batch {raw['batch']}"
        _check_speed(aggregate_tps, "aggregate_tps", raw, raw["output_tokens"] / raw["wall_s"], why)
        tpots = raw["tpots_s"]
        _check_speed(per_user_tps, "per_user_tps", raw, len(tpots) / sum(tpots) if tpots else None, why)
    passed("aggregate_tps and per_user_tps", len(SPEED_CASES) + len(rows))


# =================================================================== the learner's harness: batched vs one at a time
# The course's reference run, on the machine the course was written on: the notebook's measurement cell in full mode
# (MINILLM_QUICK unset: 8 requests of a 32-token prompt and 32 output tokens each, 1 warm-up and 3 timed runs per
# engine, SmolLM2-135M in fp32), i.e. batching_speedup(ServeRun(llm, prompts, 32, 1), ServeRun(llm, prompts, 32, 8),
# warmup=1, repeats=3) with the notebook's random_prompts(vocab_size, 8, 32, seed=5). The machine was shared with
# several other jobs while it ran (load ~12 on its 2 cores): the times are far slower than an idle run and the
# ratio, a quotient of two times taken under the same load, is what to compare.
REFERENCE_HARDWARE = "2-core AMD EPYC (AVX2)"
REFERENCE_NUM_REQUESTS = 8
REFERENCE_TOKENS_PER_S = {"one at a time": 2.97, "batched": 7.95}   # output tokens/s of the median run
REFERENCE_BATCHING_RATIO = 2.67                                     # batched / one at a time


class ServeRun:
    """Each call serves `prompts` (the same requests every call, `max_tokens` output tokens each, EOS ignored) on an
    engine that runs at most `max_num_seqs` sequences per step (1: one request at a time; len(prompts): all of them
    batched), and returns the number of output tokens it made. The engine is built once, outside any timing."""

    def __init__(self, llm, prompts: Sequence[dict], max_tokens: int, max_num_seqs: int):
        from .. import SamplingParams

        if max_num_seqs < 1 or max_tokens < 1:
            raise ValueError(f"ServeRun(max_tokens={max_tokens!r}, max_num_seqs={max_num_seqs!r}): both >= 1")
        self.engine = llm.with_levers(max_num_seqs=int(max_num_seqs))
        self.prompts, self.max_num_seqs = list(prompts), int(max_num_seqs)
        self.params = SamplingParams(max_tokens=int(max_tokens), temperature=0, ignore_eos=True)
        self.calls = 0

    def __call__(self) -> int:
        outs = self.engine.generate(self.prompts, self.params)
        self.calls += 1
        return sum(len(o.outputs[0].token_ids) for o in outs)


class FakeRun:
    """A stand-in for ServeRun in the check: each call moves `clock` by the next scripted cost and returns `tokens`."""

    def __init__(self, clock, costs: Sequence[float], tokens: int, label: str):
        self.clock, self.costs, self.tokens, self.label = clock, list(costs), int(tokens), label
        self.calls = 0

    def __call__(self) -> int:
        self.clock.advance(self.costs[min(self.calls, len(self.costs) - 1)])
        self.calls += 1
        return self.tokens

    def __repr__(self) -> str:
        return f"<fake run, {self.label}>"


BATCHING_CASES = (  # (the case in words, warmup, repeats, seed, tokens per run, seconds per run: one at a time, batched)
    ("8 requests x 16 tokens; 1 warm-up and 5 timed runs each", 1, 5, 1, 128, 4.0, 0.9),
    ("2 warm-up and 4 timed runs (an even count: the median averages the middle two)", 2, 4, 2, 60, 1.5, 0.5),
    ("no warm-up, 3 timed runs", 0, 3, 3, 24, 0.6, 0.3),
)


def reference_run_timing(costs: Sequence[float], warmup: int, tokens: int) -> dict:
    """What a correct harness reports for runs costing `costs` (warm-up first), each making `tokens` tokens."""
    from .common import timing_summary

    summary = timing_summary(list(costs)[warmup:])
    return {"median": summary["median"], "min": summary["min"], "max": summary["max"],
            "tokens_per_s": tokens / summary["median"]}


def check_batching_speedup(batching_speedup: Callable, cases=BATCHING_CASES) -> None:
    """batching_speedup(run_one_at_a_time, run_batched, clock, warmup, repeats) on fake runs whose calls move a
    FakeClock by known costs (warm-up runs 20x slower, one timed run 4x) and return a known token count: each run
    called warmup + repeats times, the warm-up dropped, each one's median / min / max seconds and the tokens/s of
    its median run; the ratio is batched tokens/s over one-at-a-time tokens/s."""
    from .common import FakeClock, is_close, scripted_costs, timing_mistake

    labels = ("one at a time", "batched")
    for name, warmup, repeats, seed, tokens, slow, fast in cases:
        clock = FakeClock()
        costs = {"one at a time": scripted_costs(slow, warmup, repeats, seed),
                 "batched": scripted_costs(fast, warmup, repeats, seed + 100)}
        runs = {label: FakeRun(clock, costs[label], tokens, label) for label in labels}
        call = (f"batching_speedup(<fake run one at a time>, <fake run batched>, clock=FakeClock(), warmup={warmup}, "
                f"repeats={repeats}). Case: {name}")
        got = call_learner(batching_speedup, (runs["one at a time"], runs["batched"], clock, warmup, repeats), call)
        if clock.reads == 0:
            raise CheckFailed(f"{call}: your code never read `clock`: time with the clock you are given "
                              "(start = clock() ... clock() - start), not time.perf_counter, so the check can "
                              "script what each run costs")
        for label, run in runs.items():
            if run.calls != warmup + repeats:
                raise CheckFailed(f"{call}: the {label} run was called {run.calls} times; expected warmup + repeats "
                                  f"= {warmup + repeats}")
        if not isinstance(got, dict) or not {*labels, "ratio"} <= set(got):
            raise CheckFailed(f"{call} returned {got!r}; return a dict with keys 'one at a time', 'batched' (each "
                              "{'median', 'min', 'max', 'tokens_per_s'}) and 'ratio'")
        for label in labels:
            want = reference_run_timing(costs[label], warmup, tokens)
            summary = got[label]
            if not isinstance(summary, dict) or not set(want) <= set(summary):
                raise CheckFailed(f"{call}: [{label!r}] = {summary!r}; expected a dict with {sorted(want)}")
            for key in ("median", "min", "max", "tokens_per_s"):
                value = summary[key]
                if is_close(value, want[key]):
                    continue
                why = ""
                if key == "median":
                    why = timing_mistake(value, costs[label], warmup)
                elif key == "tokens_per_s":
                    seconds = tokens / value if isinstance(value, (int, float)) and value else None
                    mistake = timing_mistake(seconds, costs[label], warmup) if seconds else ""
                    why = (f"the tokens over {mistake.split(':')[0]}, not over the median run" if mistake else
                           "seconds per token: tokens/s is the tokens of one run over the median run's seconds"
                           if is_close(value, want["median"] / tokens) else "")
                elif is_close(value, (min if key == "min" else max)(costs[label])):
                    why = "the spread kept a warm-up run: take min and max of the timed runs only"
                shown = f"{float(value):.6g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)
                raise CheckFailed(f"{call}: [{label!r}][{key!r}] = {shown}, expected {want[key]:.6g}"
                                  + (f": that is {why}" if why else ""))
        want_ratio = (reference_run_timing(costs["batched"], warmup, tokens)["tokens_per_s"]
                      / reference_run_timing(costs["one at a time"], warmup, tokens)["tokens_per_s"])
        ratio = got["ratio"]
        if not is_close(ratio, want_ratio):
            hint = ("it is upside down: batched tokens/s over one-at-a-time tokens/s (above 1 when batching helps)"
                    if is_close(ratio, 1 / want_ratio) else "batched tokens/s over one-at-a-time tokens/s")
            raise CheckFailed(f"{call}: ratio = {ratio!r}, expected {want_ratio:.6g}: {hint}")
    passed("batching_speedup", len(cases))


def batching_figure(result: dict, num_requests: int, device: str) -> go.Figure:
    """Output tokens/s of the median run, one at a time vs batched; the bars span the runs' min to max."""
    labels = ["one at a time", "batched"]
    tps = [result[k]["tokens_per_s"] for k in labels]
    # tokens/s of the fastest and the slowest run: tokens / min seconds and tokens / max seconds
    tokens = [t * result[k]["median"] for t, k in zip(tps, labels)]
    high = [n / result[k]["min"] for n, k in zip(tokens, labels)]
    low = [n / result[k]["max"] for n, k in zip(tokens, labels)]
    fig = new_figure(f"{num_requests} requests, one at a time vs batched: {result['ratio']:.1f}x", "",
                     "output tokens/s (median run; bars: slowest to fastest)", device=device)
    fig.add_bar(x=labels, y=tps, marker_color=["#e76f51", "#2a9d8f"], text=[f"{t:.0f} tok/s" for t in tps],
                textposition="outside", error_y=dict(type="data", symmetric=False,
                                                     array=[h - t for h, t in zip(high, tps)],
                                                     arrayminus=[t - lo for t, lo in zip(tps, low)]))
    return fig


def print_batching(result: dict, num_requests: int) -> None:
    """Your two runs and their ratio, beside the course's reference run."""
    from .common import format_seconds, print_beside_reference

    for label in ("one at a time", "batched"):
        r = result[label]
        print(f"{label:>13}: {r['tokens_per_s']:7.1f} output tokens/s (median run {format_seconds(r['median'])}, "
              f"min {format_seconds(r['min'])}, max {format_seconds(r['max'])})")
    print_beside_reference(f"{num_requests} requests, batched / one at a time", result["ratio"],
                           REFERENCE_BATCHING_RATIO, f"{REFERENCE_HARDWARE}, {REFERENCE_NUM_REQUESTS} requests", unit="x")


# =================================================================== the Gantt chart
def _heatmap(schedule, output_lengths: Sequence[int] | None = None) -> go.Heatmap:
    num_slots = len(schedule[0]) if schedule else 1
    z = [[step[s] if step[s] is not None else None for step in schedule] for s in range(num_slots)]
    text = [["" if r is None else f"r{r}" for r in row] for row in z]
    top = max(len(output_lengths) - 1, 1) if output_lengths else max((r for row in z for r in row if r is not None), default=1)
    return go.Heatmap(z=z, x=list(range(len(schedule))), y=[f"slot {s}" for s in range(num_slots)],
                      text=text, texttemplate="%{text}", colorscale="Turbo", zmin=0, zmax=top, showscale=False,
                      xgap=2, ygap=2, hovertemplate="step %{x}, %{y}: request %{z}<extra></extra>")


def schedule_title(schedule, policy: str) -> str:
    return f"{policy}: {_num_steps(schedule)} steps, utilisation {_utilisation(schedule):.0%}"


def gantt_figure(schedules: dict[str, list], output_lengths: Sequence[int] | None = None) -> go.Figure:
    """One Gantt row per slot, one column per step, each cell coloured by its request (blank = idle)."""
    names = list(schedules)
    fig = make_subplots(rows=len(names), cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=[schedule_title(schedules[n], n) for n in names])
    for i, name in enumerate(names, start=1):
        fig.add_trace(_heatmap(schedules[name], output_lengths), row=i, col=1)
        fig.update_yaxes(autorange="reversed", row=i, col=1)
    fig.update_xaxes(title_text="step", row=len(names), col=1)
    fig.update_layout(height=180 + 90 * sum(len(s[0]) if s else 1 for s in schedules.values()),
                      template="plotly_white", title="slot-by-step schedule (a simulation, not a measurement)",
                      margin=dict(t=90, l=70, r=30, b=50))
    return fig


class ScheduleExplorer:
    """Slider (number of slots) + dropdown (policy) -> the Gantt chart of `simulate`'s schedule."""

    def __init__(self, simulate: Callable, output_lengths: Sequence[int] = EXAMPLE_OUTPUT_LENGTHS,
                 num_slots: int = EXAMPLE_NUM_SLOTS, policy: str = "continuous"):
        import ipywidgets as widgets

        self.simulate = simulate
        self.output_lengths = list(output_lengths)
        self.slider = widgets.IntSlider(value=num_slots, min=1, max=len(self.output_lengths), description="slots",
                                        continuous_update=False)
        self.dropdown = widgets.Dropdown(options=list(POLICIES), value=policy, description="policy")
        base = new_figure("", "step", "", height=420)
        base.add_trace(_heatmap([[None] * num_slots], self.output_lengths))
        base.update_yaxes(autorange="reversed")
        control_panel(self, [self.slider, self.dropdown], base, row=True)

    def update(self) -> None:
        try:
            schedule = self.simulate(list(self.output_lengths), self.slider.value, self.dropdown.value)
        except NotImplementedError:
            self.label.value = "<b>finish exercise 2 (simulate_batching) first</b>"
            return
        self.schedule = schedule
        heat = _heatmap(schedule, self.output_lengths)
        with self.figure.batch_update():
            self.figure.data[0].z, self.figure.data[0].x = heat.z, heat.x
            self.figure.data[0].y, self.figure.data[0].text = heat.y, heat.text
            self.figure.layout.title.text = schedule_title(schedule, self.dropdown.value)
        self.label.value = (f"{len(self.output_lengths)} requests, lengths {self.output_lengths}: "
                            f"<b>{schedule_title(schedule, self.dropdown.value)}</b>")

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


# =================================================================== the roofline of batched decode
class DecodeRoofline:
    """The two ceilings of aggregate decode tokens/s at batch b, from this machine's measured read bandwidth and
    matmul FLOP/s (lab 01's bound and ridge, per batch):

    - bandwidth: a decode step reads every weight once whatever its batch, so a step of b sequences makes b tokens
      per weight read: b x lab 01's batch-1 bound, bandwidth / weight bytes;
    - compute: each token multiplies every parameter once (a multiply and an add): FLOP/s / (2 x num_params),
      whatever the batch;
    - the roofline: the smaller of the two. They meet at the crossover batch
      b* = FLOP/s x weight bytes / (2 x num_params x bandwidth): bandwidth-bound below it, compute-bound above.

    Only the weights count (each sequence's KV cache and the prefills add to the real step), so a measured run
    stays below the roofline."""

    def __init__(self, num_params: float, weight_bytes: float, bandwidth_bytes_per_s: float, flops_per_s: float):
        for name, value in (("num_params", num_params), ("weight_bytes", weight_bytes),
                            ("bandwidth_bytes_per_s", bandwidth_bytes_per_s), ("flops_per_s", flops_per_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name}={value!r} must be a finite number > 0")
        self.num_params, self.weight_bytes = float(num_params), float(weight_bytes)
        self.bandwidth_bytes_per_s, self.flops_per_s = float(bandwidth_bytes_per_s), float(flops_per_s)
        self.bytes_per_param = self.weight_bytes / self.num_params

    def bandwidth_tps(self, batch: float) -> float:
        """b tokens per read of the weights: b x bandwidth / weight bytes."""
        _check_batch(batch)
        return batch * reference_decode_bandwidth_bound_tokens_per_s(self.num_params, self.bytes_per_param,
                                                                     self.bandwidth_bytes_per_s)

    def compute_tps(self, batch: float = 1) -> float:
        """2 x num_params FLOPs per token, whatever the batch: FLOP/s / (2 x num_params)."""
        _check_batch(batch)
        return self.flops_per_s / (2 * self.num_params)

    def roofline_tps(self, batch: float) -> float:
        return min(self.bandwidth_tps(batch), self.compute_tps(batch))

    def bound(self, batch: float) -> str:
        """Which ceiling holds at this batch; at b* exactly, compute (the tie of lab 01's roofline_time_s)."""
        return "compute" if self.compute_tps(batch) <= self.bandwidth_tps(batch) else "bandwidth"

    @property
    def crossover_batch(self) -> float:
        """b* = FLOP/s x weight bytes / (2 x num_params x bandwidth): lab 01's ridge (FLOP/s / bandwidth) over the
        intensity of one sequence's decode (2 FLOPs per bytes_per_param bytes)."""
        ridge = self.flops_per_s / self.bandwidth_bytes_per_s
        return ridge / reference_arithmetic_intensity(1, self.num_params, self.bytes_per_param)

    @property
    def first_compute_bound_batch(self) -> int:
        """The smallest whole batch at or past b* (lab 01's ridge_batch)."""
        return ridge_batch(self.flops_per_s, self.bandwidth_bytes_per_s, self.num_params, self.bytes_per_param)

    def describe(self) -> str:
        return (f"read bandwidth {format_si(self.bandwidth_bytes_per_s, 'B/s')} over {self.weight_bytes / 1e6:.0f} MB "
                f"of weights: {self.bandwidth_tps(1):.1f} tok/s per sequence in a step; matmul "
                f"{format_si(self.flops_per_s, 'FLOP/s')} over 2 x {self.num_params / 1e6:.1f} M FLOPs per token: "
                f"{self.compute_tps():.1f} tok/s. The bound switches from bandwidth to compute at "
                f"b* = {self.crossover_batch:.1f}")

    def __repr__(self) -> str:
        return (f"DecodeRoofline(num_params={self.num_params:.4g}, weight_bytes={self.weight_bytes:.4g}, "
                f"bandwidth_bytes_per_s={self.bandwidth_bytes_per_s:.4g}, flops_per_s={self.flops_per_s:.4g})")


def _check_batch(batch) -> None:
    if isinstance(batch, bool) or not isinstance(batch, (int, float)) or not 1 <= batch < float("inf"):
        raise ValueError(f"batch={batch!r} must be a finite number >= 1 (sequences in a decode step)")


QUICK_BANDWIDTH_BYTES = 64 << 20  # quick mode: a 64 MB buffer (still larger than the caches) and a 512 x 512 matmul
QUICK_MATMUL_SIZE = 512
CPU_MATMUL_SIZE = 1024
GPU_MATMUL_SIZE = 4096


def measure_decode_roofline(llm, quick: bool = False) -> DecodeRoofline:
    """This machine's roofline for `llm`: its read bandwidth (a sum over a buffer far larger than the caches, the
    pattern of decode) and its matmul FLOP/s in the engine's dtype, each measured once (cached per process), and
    the engine's parameters and weight bytes as stored."""
    from ..hardware import measure_matmul_flops, measure_memory_bandwidth

    device = str(llm.engine.device)  # a torch device ("cpu", "cuda:0"); llm.device is a label for printing
    # A GPU needs a large matmul to fill its cores (a 1024 x 1024 one measures the launch); a CPU does not.
    size = GPU_MATMUL_SIZE if device.startswith("cuda") else QUICK_MATMUL_SIZE if quick else CPU_MATMUL_SIZE
    if quick:
        bandwidth = measure_memory_bandwidth(device, nbytes=QUICK_BANDWIDTH_BYTES, repeats=3)
        flops = measure_matmul_flops(device, size=size, dtype=llm.dtype, repeats=3)
    else:
        bandwidth = measure_memory_bandwidth(device)
        flops = measure_matmul_flops(device, size=size, dtype=llm.dtype)
    return DecodeRoofline(llm.model_config.num_params, llm.weight_bytes, bandwidth, flops)


# =================================================================== the real engine (measured in the notebook)
def print_raw_sweep(rows: Sequence[dict], device: str) -> None:
    """The sweep's raw numbers, before the learner turns them into speeds."""
    print(f"measured on {device}")
    print(f"{'batch':>5} {'output tokens':>14} {'wall':>9} {'TPOTs (one per request)':>24}")
    for r in rows:
        tpots = r["tpots_s"]
        spread = (f"{min(tpots) * 1e3:.1f} .. {max(tpots) * 1e3:.1f} ms" if len(tpots) > 1 else
                  f"{tpots[0] * 1e3:.1f} ms" if tpots else "none")
        print(f"{r['batch']:>5} {r['output_tokens']:>14} {r['wall_s']:>8.3f}s {spread:>24}")


def print_batch_sweep(rows: Sequence[dict], device: str, roofline: DecodeRoofline | None = None) -> None:
    """The sweep's speeds; with a roofline, each batch's ceiling, the measured aggregate as a share of it and
    which bound holds there."""
    print(f"measured on {device}")
    extra = f" {'roofline tok/s':>15} {'of roofline':>12} {'bound':>10}" if roofline else ""
    print(f"{'batch':>5} {'aggregate tok/s':>16} {'per-user tok/s':>15} {'TPOT':>9} {'vs batch 1':>11}{extra}")
    base = rows[0]["aggregate_tps"]
    for r in rows:
        tpot = f"{1e3 / r['per_user_tps']:>7.1f}ms" if r["per_user_tps"] else f"{'n/a':>9}"
        extra = ""
        if roofline:
            ceiling = roofline.roofline_tps(r["batch"])
            extra = f" {ceiling:>15.1f} {r['aggregate_tps'] / ceiling:>12.0%} {roofline.bound(r['batch']):>10}"
        print(f"{r['batch']:>5} {r['aggregate_tps']:>16.1f} {r['per_user_tps'] or float('nan'):>15.1f} {tpot} "
              f"{r['aggregate_tps'] / base:>10.2f}x{extra}")
    if roofline:
        print(roofline.describe() + f" (compute-bound from batch {roofline.first_compute_bound_batch}).")


def _roofline_batches(sizes: Sequence[int], roofline: DecodeRoofline) -> list[float]:
    """Where to draw the bounds: the measured sizes, b* itself (the corner) and, when b* lies past the sweep, a
    little beyond it so both sides of the corner show (never past 16 x the largest size measured)."""
    top = max(sizes)
    crossover = roofline.crossover_batch
    xs = set(sizes) | {1}
    if crossover <= 16 * top:
        xs |= {crossover, max(top, 2 * crossover)}
    else:
        xs.add(16 * top)
    return sorted(x for x in xs if x >= 1)


def batch_sweep_figure(rows: Sequence[dict], device: str, roofline: DecodeRoofline | None = None) -> go.Figure:
    """Aggregate and per-user tokens/s against the batch; with a roofline, its two bounds dashed (on log-log
    axes the bandwidth bound is a line of slope 1, the compute bound a flat one) and the corner b*."""
    fig = new_figure("throughput vs batch size", "batch size (max_num_seqs)", "tokens / s", device=device, log_x=False)
    sizes = [r["batch"] for r in rows]
    fig.add_scatter(x=sizes, y=[r["aggregate_tps"] for r in rows], mode="lines+markers", name="aggregate tokens/s")
    fig.add_scatter(x=sizes, y=[r["per_user_tps"] for r in rows], mode="lines+markers", name="per-user tokens/s (1/TPOT)")
    ticks = sizes
    if roofline:
        xs = _roofline_batches(sizes, roofline)
        fig.add_scatter(x=xs, y=[roofline.bandwidth_tps(x) for x in xs], mode="lines",
                        name="bandwidth bound: b x bandwidth / weight bytes", line=dict(dash="dash", color="firebrick"))
        fig.add_scatter(x=xs, y=[roofline.compute_tps(x) for x in xs], mode="lines",
                        name="compute bound: FLOP/s / (2 x params)", line=dict(dash="dash", color="darkorange"))
        b_star = roofline.crossover_batch
        if b_star <= max(xs):
            fig.add_scatter(x=[b_star], y=[roofline.roofline_tps(b_star)], mode="markers+text",
                            name="b* (the bounds meet)", text=[f"b* = {b_star:.1f}"], textposition="top left",
                            marker=dict(size=11, symbol="diamond", color="black"))
        ticks = sorted({*sizes, *(2 ** k for k in range(0, int(math.log2(max(xs))) + 1))})
        fig.update_yaxes(type="log")
        fig.update_layout(title_text="throughput vs batch size, under this machine's roofline")
    fig.update_xaxes(type="log", tickvals=ticks, ticktext=[str(s) for s in ticks])
    return fig


def print_policies(results: dict[str, dict], device: str, num_slots: int = EXAMPLE_NUM_SLOTS) -> None:
    print(f"measured on {device}: the example workload, max_num_seqs={num_slots}")
    print(f"{'policy':>11} {'decode steps':>13} {'prefill steps':>14} {'seqs/step':>10} {'wall':>8} {'tok/s':>8}")
    for policy, r in results.items():
        print(f"{policy:>11} {r['decode_steps']:>13} {r['prefill_steps']:>14} {r['mean_seqs_per_decode_step']:>10.2f} "
              f"{r['wall_s']:>7.2f}s {r['tokens_per_s']:>8.1f}")
    if set(results) == set(POLICIES):
        s, c = results["static"], results["continuous"]
        print(f"continuous / static wall time: {c['wall_s'] / s['wall_s']:.2f} "
              f"(decode steps {c['decode_steps']} / {s['decode_steps']} = {c['decode_steps'] / s['decode_steps']:.2f})")


# =================================================================== the service-level choice
class FloorExplorer:
    """Slider: a per-user tokens/s floor -> the largest measured batch that keeps above it."""

    def __init__(self, rows: Sequence[dict], choose: Callable, device: str, floor: float | None = None):
        import ipywidgets as widgets

        self.rows, self.choose = list(rows), choose
        self.sizes = [r["batch"] for r in self.rows]
        self.per_user = [r["per_user_tps"] for r in self.rows]
        self.aggregate = [r["aggregate_tps"] for r in self.rows]
        top = max(self.per_user)
        start = floor if floor is not None else round(top / 2, 1)
        self.slider = widgets.FloatSlider(value=start, min=0.0, max=round(top * 1.2, 1), step=max(round(top / 100, 1), 0.1),
                                          description="floor tok/s", continuous_update=False,
                                          style={"description_width": "initial"})
        base = batch_sweep_figure(self.rows, device)
        base.update_layout(title_text="per-user floor -> the largest batch that meets it")
        base.add_scatter(x=[min(self.sizes), max(self.sizes)], y=[start, start], mode="lines", name="floor",
                         line=dict(dash="dash", color="gray"))
        base.add_scatter(x=[], y=[], mode="markers", name="chosen batch", marker=dict(size=16, symbol="star", color="black"))
        control_panel(self, [self.slider], base)

    def update(self) -> None:
        floor = self.slider.value
        try:
            chosen = self.choose(list(self.sizes), list(self.per_user), floor)
        except NotImplementedError:
            self.label.value = "<b>finish exercise 4 (largest_batch_meeting_floor) first</b>"
            return
        self.chosen = chosen
        with self.figure.batch_update():
            self.figure.data[2].y = [floor, floor]
            if chosen is None:
                self.figure.data[3].x, self.figure.data[3].y = [], []
            else:
                i = self.sizes.index(chosen)
                self.figure.data[3].x, self.figure.data[3].y = [chosen], [self.aggregate[i]]
        if chosen is None:
            self.label.value = f"floor {floor:.1f} tok/s per user: <b>no measured batch is that fast</b> (not even batch 1)"
        else:
            i = self.sizes.index(chosen)
            self.label.value = (f"floor {floor:.1f} tok/s per user: <b>batch {chosen}</b> ({self.per_user[i]:.1f} tok/s "
                                f"each), aggregate <b>{self.aggregate[i]:.1f} tok/s</b> = "
                                f"{self.aggregate[i] / self.aggregate[0]:.2f}x batch 1")

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


__all__ = [
    "POLICIES", "EXAMPLE_OUTPUT_LENGTHS", "EXAMPLE_NUM_SLOTS", "reference_schedule", "check_num_steps",
    "check_utilisation", "check_simulate_batching", "check_largest_batch_meeting_floor", "most_saving_slots",
    "check_answer_most_saving_slots", "check_sweep_speeds", "gantt_figure", "ScheduleExplorer", "DecodeRoofline",
    "measure_decode_roofline", "print_raw_sweep",
    "print_batch_sweep", "batch_sweep_figure", "print_policies", "FloorExplorer", "device_label", "echo_prediction",
    "common", "ServeRun", "FakeRun", "check_batching_speedup", "batching_figure", "print_batching",
]
