"""Lab 04 helpers — PagedAttention: allocator checks (against the engine's BlockManager), the
adapter that plugs the learner's allocator into the engine, the reserved-vs-real KV printout and
figure, the concurrency explorer, and the paged decode kernel's checks, engine backend and timing.
The experiments themselves (run_with_allocator, measure_waste, run_with_kernel, block_size_tradeoff)
are written in the notebook, next to the cells that call them.

The learner writes, with fixed signatures:

    class BlockAllocator(num_blocks, block_size):       # plain Python, no torch
        num_free_blocks                                 # int
        allocate(num_tokens) -> list[int]               # a block table
        append(table, num_tokens) -> list[int]          # grow `table` in place to hold num_tokens
        fork(table) -> list[int]                        # a second owner of the same blocks
        free(table) -> None                             # drop one owner; blocks at 0 owners return
        slot(table, position) -> int                   # pool slot of the token at `position`
    kv_utilization(steps) -> float                     # mean of used / reserved over the steps (measure_)
    peak_at_once(steps) -> int                          # the most num_running after any step
    answer_utilization_8192 = ...                       # a fraction (answer_)
    max_concurrent(budget_tokens, lengths, max_model_len, block_size, paged) -> int
    paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, block_size) -> out   # Triton

Errors the allocator raises: MemoryError when the free blocks do not suffice, ValueError when a
table holds a block that is already free (double free, fork of a freed table), IndexError when
`slot` is asked for a position the table has no room for. A failed call changes nothing.

Nothing here imports triton at module level: the notebook picks the interpreter first.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from ..engine.block_manager import BlockManager, PoolSizes
from . import common
from .common import (CheckFailed, Stopwatch, call_learner, control_panel, echo_prediction, format_seconds,  # noqa: F401
                     new_figure, passed, require_kernel)

# The vLLM paper (Kwon et al., SOSP 2023, Fig. 2): in systems that reserve a contiguous region per
# request, only 20.4% - 38.2% of the KV cache memory held the tokens' states.
VLLM_PAPER_UTILIZATION = (0.204, 0.382)
MiB = 1 << 20


# =================================================================== A. the block allocator
def _new(cls, num_blocks: int, block_size: int):
    try:
        return cls(num_blocks, block_size)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - the message names the learner's error
        raise CheckFailed(f"BlockAllocator({num_blocks}, {block_size}) raised {type(exc).__name__}: {exc}") from exc


class _Raised:
    """An exception the caller expects (MemoryError, ValueError) carried past call_learner."""

    def __init__(self, exc: BaseException):
        self.exc = exc


def _arg(value) -> str:
    return repr(value) if not isinstance(value, list) or len(value) < 12 else f"[{len(value)} blocks]"


def _invoke(obj, method: str, *args, expect: tuple = ()):
    """obj.method(*args) through call_learner: a crash is a CheckFailed naming the call; the exceptions in
    `expect` (the contract's MemoryError / ValueError / IndexError) reach the caller as raised."""
    call = f"{method}({', '.join(_arg(a) for a in args)})"

    def run():
        try:
            return getattr(obj, method)(*args)
        except expect as exc:
            return _Raised(exc)

    result = call_learner(run, (), call)
    if isinstance(result, _Raised):
        raise result.exc
    return result


def _free_count(alloc, context: str) -> int:
    value = call_learner(lambda: getattr(alloc, "num_free_blocks", None), (), f"{context}: num_free_blocks")
    if callable(value):
        value = call_learner(value, (), f"{context}: num_free_blocks()")
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckFailed(f"{context}: num_free_blocks is {value!r}; it must be an int attribute (or property) "
                          "counting the blocks no table owns")
    return value


def _expect_free(alloc, expected: int, context: str, hint: str = "") -> None:
    got = _free_count(alloc, context)
    if got != expected:
        raise CheckFailed(f"{context}: num_free_blocks is {got}, expected {expected}" + (f" — {hint}" if hint else ""))


def _expect_table(table, num_blocks: int, pool_blocks: int, context: str, block_size: int, num_tokens: int) -> None:
    if not isinstance(table, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in table):
        raise CheckFailed(f"{context} returned {table!r}; a block table is a list of int block ids")
    if len(table) != num_blocks:
        hint = ""
        if len(table) == num_tokens // block_size:
            hint = (f" — {num_tokens} tokens in blocks of {block_size} need ceil({num_tokens}/{block_size}) = "
                    f"{num_blocks} blocks; floor division drops the partly filled last block")
        elif len(table) == num_tokens // block_size + 1:
            hint = " — off by one: a full last block needs no extra block; use -(-num_tokens // block_size)"
        raise CheckFailed(f"{context} returned a table of {len(table)} blocks {table}, expected {num_blocks}{hint}")
    bad = [b for b in table if not 0 <= b < pool_blocks]
    if bad:
        raise CheckFailed(f"{context} returned block id {bad[0]}; ids run from 0 to num_blocks - 1 = {pool_blocks - 1}")
    if len(set(table)) != len(table):
        raise CheckFailed(f"{context} returned {table}: block {table[[table.count(b) > 1 for b in table].index(True)]} "
                          "appears twice in one table; each block holds block_size different positions")


def _expect_raises(kind: type, fn: Callable, context: str, why: str):
    try:
        result = fn()
    except kind:
        return
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CheckFailed(f"{context} raised {type(exc).__name__}: {exc}; expected {kind.__name__} ({why})") from exc
    raise CheckFailed(f"{context} returned {result!r}; expected it to raise {kind.__name__} ({why})")


def check_allocate_and_slot(cls) -> None:
    """allocate() hands out ceil(n / block_size) free blocks; slot() maps a position through the table."""
    alloc = _new(cls, 8, 4)
    _expect_free(alloc, 8, "a new BlockAllocator(8, 4)", "every block is free at the start")
    table = _invoke(alloc, "allocate", 10)
    _expect_table(table, 3, 8, "allocate(10) with block_size 4", 4, 10)
    _expect_free(alloc, 5, "after allocate(10) took 3 of 8 blocks")
    one = _invoke(alloc, "allocate", 4)
    _expect_table(one, 1, 8, "allocate(4) with block_size 4", 4, 4)
    shared = set(one) & set(table)
    if shared:
        raise CheckFailed(f"allocate(4) returned block {shared.pop()}, which the first table {table} still holds: "
                          "a block in use must leave the free list until it is freed")
    cases = [(0, table[0] * 4), (3, table[0] * 4 + 3), (5, table[1] * 4 + 1), (9, table[2] * 4 + 1)]
    for position, expected in cases:
        got = _invoke(alloc, "slot", table, position)
        if got != expected:
            hint = ""
            if got == table[0] * 4 + position:
                hint = (" — you offset from the first block as if the table were one contiguous run; position p "
                        "lives in block table[p // block_size], at offset p % block_size")
            elif got == table[position // 4] + position % 4:
                hint = " — a block holds block_size slots: multiply the block id by block_size"
            raise CheckFailed(f"slot({table}, {position}) with block_size 4 returned {got!r}, expected "
                              f"table[{position // 4}] * 4 + {position % 4} = {expected}{hint}")
    _expect_raises(IndexError, lambda: alloc.slot(table, 12), f"slot({table}, 12)",
                   "3 blocks of 4 hold positions 0..11; position 12 needs a fourth block (append first)")
    _expect_raises(IndexError, lambda: alloc.slot(table, -1), f"slot({table}, -1)",
                   "positions count from 0; a negative position is outside every table (Python's table[-1] is not)")
    free_before = _free_count(alloc, "before allocate(17)")
    _expect_raises(MemoryError, lambda: alloc.allocate(17), f"allocate(17) with {free_before} free blocks of 4",
                   "17 tokens need 5 blocks")
    _expect_free(alloc, free_before, "after allocate(17) failed", "a failed allocate must change nothing "
                 "(check the count before taking any block)")
    rest = _invoke(alloc, "allocate", 16)
    _expect_table(rest, 4, 8, "allocate(16) with exactly 4 blocks free", 4, 16)
    _expect_free(alloc, 0, "after the pool was used up")
    if set(rest) & (set(table) | set(one)):
        raise CheckFailed(f"allocate(16) returned {rest}, sharing a block with the live tables {table} and {one}")
    empty = _invoke(alloc, "allocate", 0)
    if empty != []:
        raise CheckFailed(f"allocate(0) returned {empty!r}; no tokens need no blocks: expected []")
    _expect_free(alloc, 0, "after allocate(0)")
    passed("allocate and slot", 12)


def check_append(cls) -> None:
    """append() grows a table in place by fresh blocks, only when the new length needs them."""
    alloc = _new(cls, 6, 4)
    table = _invoke(alloc, "allocate", 3)
    first = list(table)
    for num_tokens, blocks, why in ((4, 1, "4 tokens still fit the first block"),
                                    (5, 2, "position 4 needs a second block"),
                                    (2, 2, "a table never shrinks"),
                                    (13, 4, "13 tokens need 4 blocks")):
        returned = _invoke(alloc, "append", table, num_tokens)
        if returned is not None and returned is not table:
            raise CheckFailed(f"append(table, {num_tokens}) returned a new list {returned!r}; grow `table` in place "
                              "(table.extend or table.append) and return it — the engine keeps the same list per "
                              "sequence")
        if len(table) != blocks:
            raise CheckFailed(f"after append(table, {num_tokens}) with block_size 4 the table has {len(table)} blocks "
                              f"{table}, expected {blocks} ({why})")
        if table[:1] != first:
            raise CheckFailed(f"append changed the table's first block from {first[0]} to {table[0]}: the tokens "
                              "already written live there; only add blocks at the end")
        _expect_free(alloc, 6 - blocks, f"after append(table, {num_tokens})")
    if len(set(table)) != len(table):
        raise CheckFailed(f"the grown table {table} holds a block twice: append must take blocks from the free list")
    _expect_raises(MemoryError, lambda: alloc.append(table, 30), "append(table, 30) with 2 free blocks",
                   "30 tokens need 8 blocks, the table has 4")
    if len(table) != 4:
        raise CheckFailed(f"a failed append left the table with {len(table)} blocks {table}; it must change nothing")
    _expect_free(alloc, 2, "after a failed append", "check the free count before taking any block")
    other = _invoke(alloc, "allocate", 8)
    if set(other) & set(table):
        raise CheckFailed(f"allocate(8) returned {other}, sharing a block with the grown table {table}")
    passed("append", 7)


def check_free(cls) -> None:
    """free() returns blocks to the pool; a double free raises ValueError and changes nothing."""
    alloc = _new(cls, 4, 4)
    table = _invoke(alloc, "allocate", 8)
    _invoke(alloc, "free", table)
    _expect_free(alloc, 4, "after free(table) of a 2-block table", "every block of the table goes back to the pool")
    _expect_raises(ValueError, lambda: alloc.free(table), "a second free(table)",
                   "double free: its blocks' reference counts are already 0")
    _expect_free(alloc, 4, "after a double free was refused", "a refused free must not count blocks twice")
    whole = _invoke(alloc, "allocate", 16)
    _expect_table(whole, 4, 4, "allocate(16) after everything was freed", 4, 16)
    _invoke(alloc, "free", whole)
    a, b = _invoke(alloc, "allocate", 4), _invoke(alloc, "allocate", 4)
    _invoke(alloc, "free", a)
    _expect_raises(ValueError, lambda: alloc.free(b + a), f"free({b + a}) where block {a[0]} is already free",
                   "one of its blocks is free")
    _expect_free(alloc, 3, f"after free({b + a}) was refused",
                 f"block {b[0]} must stay owned: check every block of the table before changing any")
    _invoke(alloc, "free", b)
    _expect_free(alloc, 4, "after the last table was freed")
    _invoke(alloc, "free", [])
    _expect_free(alloc, 4, "after free([])", "an empty table owns nothing: freeing it changes nothing")
    passed("free", 6)


def check_fork(cls) -> None:
    """fork() adds an owner to every block; a block returns to the pool when its last owner frees it."""
    alloc = _new(cls, 4, 4)
    parent = _invoke(alloc, "allocate", 8)
    child = _invoke(alloc, "fork", parent)
    if not isinstance(child, list) or child != parent:
        raise CheckFailed(f"fork({parent}) returned {child!r}; expected a list of the same blocks")
    if child is parent:
        raise CheckFailed("fork(table) returned the same list object; return a copy (the two owners grow separately)")
    _expect_free(alloc, 2, "after fork", "a fork shares blocks, it takes no new ones")
    _invoke(alloc, "free", parent)
    _expect_free(alloc, 2, "after the parent freed a forked table",
                 "the child still owns those blocks: count owners per block and return a block only at count 0")
    _invoke(alloc, "append", child, 9)
    _expect_free(alloc, 1, "after the child grew to 9 tokens (3 blocks)")
    grandchild = _invoke(alloc, "fork", child)
    _invoke(alloc, "free", child)
    _expect_free(alloc, 1, "after free(child) while a grandchild shares its 3 blocks")
    _invoke(alloc, "free", grandchild)
    _expect_free(alloc, 4, "after the last owner freed")
    _expect_raises(ValueError, lambda: alloc.fork(parent), "fork of a table whose blocks are all free",
                   "a free block has no owner to share it with")
    _expect_free(alloc, 4, "after a refused fork")
    passed("fork (reference counts)", 7)


def check_against_engine(cls, seed: int = 0, num_ops: int = 400, num_blocks: int = 24, block_size: int = 4) -> None:
    """Random allocate / append / fork / free / slot sequences, with the engine's BlockManager
    (paged) as the oracle for the free count and for which calls must fail."""
    rng = random.Random(seed)
    alloc = _new(cls, num_blocks, block_size)
    oracle = BlockManager(num_blocks, block_size, contiguous=False)
    live: list[tuple[list[int], list[int], int]] = []   # (learner table, oracle table, tokens)
    dead: list[list[int]] = []
    log: list[str] = []

    def fail(message: str):
        recent = "\n  ".join(log[-8:])
        raise CheckFailed(f"random operations (seed {seed}), after:\n  {recent}\n{message}")

    def owned() -> set[int]:
        return {b for table, _, _ in live for b in table}

    def call(method: str, *args, expect: tuple = ()):
        try:
            return _invoke(alloc, method, *args, expect=expect)
        except CheckFailed as exc:
            fail(str(exc))

    for _ in range(num_ops):
        op = rng.choice(["allocate", "allocate", "append", "append", "fork", "free", "free", "slot", "double_free"])
        if op == "allocate" or not live and op != "double_free":
            n = rng.randint(1, 3 * block_size + 2)
            log.append(f"allocate({n})")
            before = owned()
            expected_ok = oracle.can_allocate(n)
            try:
                table = call("allocate", n, expect=(MemoryError,))
            except MemoryError:
                if expected_ok:
                    fail(f"allocate({n}) raised MemoryError with {oracle.num_free_blocks} blocks free; it needs "
                         f"{oracle.blocks_for(n)}")
                continue
            if not expected_ok:
                fail(f"allocate({n}) returned {table} although only {oracle.num_free_blocks} blocks were free "
                     f"and it needs {oracle.blocks_for(n)}: raise MemoryError")
            _expect_table(table, oracle.blocks_for(n), num_blocks, f"allocate({n})", block_size, n)
            if set(table) & before:
                fail(f"allocate({n}) returned {table}, reusing block {(set(table) & before).pop()} that a live table owns")
            live.append((table, oracle.allocate(n), n))
        elif op == "append":
            i = rng.randrange(len(live))
            table, otable, n = live[i]
            new_n = n + rng.randint(0, 2 * block_size)
            log.append(f"append(table of {n} tokens {table}, {new_n})")
            before = owned() - set(table)
            old = list(table)
            expected_ok = oracle.can_grow(otable, new_n)
            try:
                call("append", table, new_n, expect=(MemoryError,))
            except MemoryError:
                if expected_ok:
                    fail(f"append raised MemoryError but {oracle.num_free_blocks} blocks were free and it needs "
                         f"{oracle.blocks_for(new_n) - len(otable)}")
                if table != old:
                    fail(f"a failed append changed the table from {old} to {table}")
                continue
            if not expected_ok:
                fail(f"append(table, {new_n}) succeeded with only {oracle.num_free_blocks} free blocks for "
                     f"{oracle.blocks_for(new_n) - len(otable)} needed: raise MemoryError")
            oracle.grow(otable, new_n)
            if table[: len(old)] != old or len(table) != len(otable):
                fail(f"append(table, {new_n}) left the table {table}; expected {old} plus "
                     f"{len(otable) - len(old)} new block(s)")
            if set(table[len(old):]) & (before | set(old)):
                fail(f"append(..., {new_n}) added a block that a live table owns: {table[len(old):]}")
            live[i] = (table, otable, max(n, new_n))
        elif op == "fork":
            table, otable, n = live[rng.randrange(len(live))]
            log.append(f"fork({table})")
            child = call("fork", table)
            if child != table or child is table:
                fail(f"fork({table}) returned {child!r}; expected a new list with the same blocks")
            live.append((child, oracle.share(otable), n))
        elif op == "free":
            table, otable, n = live.pop(rng.randrange(len(live)))
            log.append(f"free({table})")
            call("free", table)
            oracle.free(otable)
            dead.append(table)
        elif op == "slot":
            table, otable, n = live[rng.randrange(len(live))]
            position = rng.randrange(len(table) * block_size)
            got = call("slot", table, position)
            want = table[position // block_size] * block_size + position % block_size
            if got != want:
                fail(f"slot({table}, {position}) returned {got!r}, expected {want}")
        elif op == "double_free" and dead:
            table = rng.choice(dead)
            if set(table) & owned():
                continue  # its blocks were handed out again: freeing would be legal for the pool
            log.append(f"free({table}) again")
            try:
                call("free", table, expect=(ValueError,))
            except ValueError:
                pass
            else:
                fail(f"free({table}) of an already freed table did not raise ValueError")
        expected_free = oracle.num_free_blocks
        got_free = _free_count(alloc, log[-1] if log else "start")
        if got_free != expected_free:
            fail(f"num_free_blocks is {got_free}; the engine's BlockManager has {expected_free} free after the same "
                 f"operations ({len(owned())} distinct blocks are owned by live tables)")
        if got_free != num_blocks - len(owned()):
            fail(f"num_free_blocks is {got_free} but live tables own {len(owned())} of {num_blocks} blocks")
    passed(f"{num_ops} random operations vs the engine's BlockManager (seed {seed})", num_ops)


# ------------------------------------------------------------------ the engine on your allocator
class AllocatorBlockManager(PoolSizes):
    """The engine's BlockAllocator protocol (minillm/seams.py; paged) over a learner's BlockAllocator
    (allocate / append / free / fork / slot), counting the calls and the peak of blocks in use."""

    contiguous = False

    def __init__(self, allocator, num_blocks: int, block_size: int):
        self.allocator = allocator
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.peak_used_blocks = 0
        self.num_calls = 0

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def _track(self) -> None:
        self.num_calls += 1
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_free_blocks

    def allocate(self, num_tokens: int) -> list[int]:
        table = self.allocator.allocate(num_tokens)
        self._track()
        return table

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(table) <= self.num_free_blocks

    def grow(self, table: list[int], num_tokens: int) -> None:
        self.allocator.append(table, num_tokens)
        self._track()

    def share(self, table: list[int]) -> list[int]:
        return self.allocator.fork(table)

    def free(self, table: list[int]) -> None:
        self.allocator.free(table)
        self._track()

    def slot(self, table: list[int], position: int) -> int:
        return self.allocator.slot(table, position)

    def check(self) -> None:
        pass


def print_allocator_run(result: dict) -> None:
    verdict = "✓ the same tokens as the engine's BlockManager" if result["equal"] else "✗ tokens differ"
    print(f"{verdict}: {len(result['tokens'])} requests x {len(result['tokens'][0])} tokens")
    print(f"  your allocator: {result['allocator_calls']} calls, peak {result['peak_used_blocks']} of "
          f"{result['pool_blocks']} blocks, {result['free_after']} free at the end, "
          f"{result['preemptions']} preemptions (engine's own: {result['engine_preemptions']})")
    if result["free_after"] != result["pool_blocks"]:
        print("  ✗ blocks leaked: every finished request frees its table, so the pool should be empty again")


# =================================================================== B. waste: reserved vs real
def workload_prompts(llm, num_requests: int) -> list[dict]:
    """num_requests chat-template prompts from data/prompts.txt (the bench's chat workload)."""
    from ..bench.workloads import chat_workload

    return [r.prompt for r in chat_workload(num_requests, 1, llm.tokenizer)]


def _modes(results: dict) -> dict:
    return {k: v for k, v in results.items() if not k.startswith("_")}


def print_waste(results: dict) -> None:
    """What each run recorded, without the two numbers the learner computes (kv_utilization, peak_at_once)."""
    meta = results["_meta"]
    print(f"{meta['num_requests']} chat requests, {meta['max_tokens']} output tokens each, max_model_len="
          f"{meta['max_model_len']}, KV pool {meta['budget_tokens']} tokens "
          f"({meta['budget_tokens'] * meta['bytes_per_token'] / MiB:.0f} MiB) — {meta['device']}")
    print(f"{'mode':<26}{'peak real':>12}{'peak reserved':>15}{'steps':>7}{'preempted':>11}{'wall':>9}")
    for label, r in _modes(results).items():
        s = r["stats"]
        print(f"{label:<26}{s.peak_kv_bytes / MiB:>8.1f} MiB{s.peak_kv_reserved_bytes / MiB:>11.1f} MiB"
              f"{len(s.steps):>7}{s.num_preemptions:>11}{format_seconds(r['wall_s']):>9}")
    tokens = [r["tokens"] for r in _modes(results).values()]
    print("same tokens in both modes:", "✓" if tokens[0] == tokens[1] else "✗ (they should agree)")


# ------------------------------------------------------------------ the learner's measurement
def reference_kv_utilization(steps) -> float:
    """Mean over the steps that reserved any KV of kv_bytes_used / kv_bytes_reserved (each step counts once);
    nan when no step reserved anything. The same as RunStats.kv_utilization."""
    reserved = [s for s in steps if s.kv_bytes_reserved > 0]
    if not reserved:
        return float("nan")
    return sum(s.kv_bytes_used / s.kv_bytes_reserved for s in reserved) / len(reserved)


def reference_peak_at_once(steps) -> int:
    """The most sequences holding KV (num_running) after any step; 0 for no steps."""
    return max((s.num_running for s in steps), default=0)


def _steps(rows) -> list:
    """StepStats from (kv_bytes_used, kv_bytes_reserved, num_running, num_seqs) rows."""
    from ..engine.metrics import StepStats

    return [StepStats(i, "decode", seqs, seqs, 0.0, used, reserved, running)
            for i, (used, reserved, running, seqs) in enumerate(rows)]


MEASURE_CASES = (  # (rows (used, reserved, running, seqs), what it shows)
    ([(10, 100, 1, 1), (30, 40, 3, 2)], "two steps, unequal reservations: each step counts once"),
    ([(0, 0, 0, 0), (5, 20, 2, 2), (15, 20, 1, 1)], "a step that reserved nothing (nothing admitted yet) is skipped"),
    ([(6, 16, 2, 1), (12, 16, 2, 2), (0, 0, 0, 0)], "the run ends with nothing reserved"),
    ([], "no steps at all: utilization nan, nobody at once"),
)


def _utilization_hint(got: float, rows) -> str:
    if not rows:
        return " — no step reserved anything: return float('nan') (there is no ratio to average)"
    used = sum(r[0] for r in rows)
    reserved = sum(r[1] for r in rows)
    ratios = [r[0] / r[1] for r in rows if r[1]]
    if got > 1:
        return " — utilization is at most 1: real bytes (kv_bytes_used) / reserved bytes (kv_bytes_reserved)"
    if reserved and abs(got - used / reserved) < 1e-9:
        return (" — that is total used / total reserved, which weights the big steps more; the engine averages the "
                "per-step ratios, each step counting once")
    if abs(got - sum(ratios) / len(rows)) < 1e-9:
        return " — skip the steps that reserved nothing (kv_bytes_reserved == 0) instead of counting them as 0"
    if ratios and abs(got - max(ratios)) < 1e-9:
        return " — that is the best step, not the average over the steps"
    if ratios and abs(got - ratios[-1]) < 1e-9:
        return " — that is the last step's ratio, not the average over the steps"
    return ""


def _peak_hint(got, rows) -> str:
    if rows and got == rows[-1][2]:
        return " — that is how many hold KV after the last step; the peak is the most after any step"
    if rows and got == max(r[3] for r in rows):
        return (" — num_seqs counts the sequences stepped; num_running counts those holding KV (stepped or "
                "waiting for their turn)")
    if rows and got == sum(r[2] for r in rows) / len(rows):
        return " — that is the mean over the steps, not the most at once"
    return ""


def check_kv_measurement(kv_utilization: Callable, peak_at_once: Callable, waste: dict | None = None) -> None:
    """Your kv_utilization(steps) and peak_at_once(steps), on hand-made steps with known answers, then on the
    steps of your own run (section 3's `waste`), recomputed here from the same records."""
    import math

    runs = [(rows, why, _steps(rows)) for rows, why in MEASURE_CASES]
    for label, r in _modes(waste or {}).items():
        steps = r["stats"].steps
        rows = [(s.kv_bytes_used, s.kv_bytes_reserved, s.num_running, s.num_seqs) for s in steps]
        runs.append((rows, f"your run {label}", steps))
    for rows, why, steps in runs:
        shown = f"steps of {why}" if why.startswith("your run") else f"steps {rows} (kv_bytes_used, kv_bytes_reserved, "                                                                      f"num_running, num_seqs) — {why}"
        got = call_learner(kv_utilization, (list(steps),), f"kv_utilization({shown})")
        want = reference_kv_utilization(steps)
        number = isinstance(got, (int, float)) and not isinstance(got, bool)
        if not number or not (math.isnan(want) and math.isnan(got) or abs(got - want) <= 1e-9 * max(1.0, abs(want))):
            hint = _utilization_hint(got, rows) if number and not math.isnan(got) else (
                " — a float: the mean of used / reserved over the steps that reserved something" if not number else "")
            raise CheckFailed(f"kv_utilization({shown}) returned {got!r}, expected {want:.6g}{hint}")
        got = call_learner(peak_at_once, (list(steps),), f"peak_at_once({shown})")
        want = reference_peak_at_once(steps)
        if isinstance(got, bool) or not isinstance(got, int) or got != want:
            raise CheckFailed(f"peak_at_once({shown}) returned {got!r}, expected {want} (the most num_running after "
                              f"any step){_peak_hint(got, rows)}")
    passed("kv_utilization and peak_at_once", 2 * len(runs))


def check_answer_utilization_8192(answer, lengths: Sequence[int], max_model_len: int | None = None) -> None:
    """The contiguous utilization at the requests' final lengths if each reserved 8192 slots (the model's context)."""
    want = sum(lengths) / (len(lengths) * 8192)
    name = f"answer_utilization_8192 = {answer!r}"
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        raise CheckFailed(f"{name}: expected a number, the fraction of reserved slots holding tokens (e.g. 0.05)")
    if abs(answer / want - 1) <= 0.05:
        passed("answer_utilization_8192", 1)
        return
    why = ""
    if abs(answer / (100 * want) - 1) <= 0.05:
        why = " — that is a percentage; give the fraction (divide by 100)"
    elif answer > 1 and abs(answer * want - 1) <= 0.05:
        why = " — upside down: real tokens / reserved slots, which is at most 1"
    elif max_model_len and abs(answer / (sum(lengths) / (len(lengths) * max_model_len)) - 1) <= 0.05:
        why = f" — that is for max_model_len={max_model_len} (this lab's run); the question reserves 8192 slots"
    elif abs(answer / (sum(lengths) / 8192) - 1) <= 0.05:
        why = " — every request reserves its own 8192 slots: divide by len(lengths) * 8192"
    raise CheckFailed(f"{name}: expected {want:.4g} = sum(lengths) / (len(lengths) * 8192) = {sum(lengths)} / "
                      f"({len(lengths)} * 8192): {len(lengths)} requests averaging {sum(lengths) / len(lengths):.0f} "
                      f"tokens in reservations of 8192{why}")


def waste_figure(results: dict):
    """KV memory reserved vs holding real tokens after every step, per mode."""
    meta = results["_meta"]
    fig = new_figure("KV cache: reserved vs real tokens", "engine step", "KV memory (MiB)", device=meta["device"])
    colors = {"contiguous (paged=False)": "#d62728", "paged (paged=True)": "#1f77b4"}
    for label, r in _modes(results).items():
        steps = r["stats"].steps
        x = [s.index for s in steps]
        fig.add_scatter(x=x, y=[s.kv_bytes_reserved / MiB for s in steps], name=f"{label}: reserved",
                        line=dict(color=colors[label], dash="dash"))
        fig.add_scatter(x=x, y=[s.kv_bytes_used / MiB for s in steps], name=f"{label}: real tokens",
                        line=dict(color=colors[label]), fill="tozeroy")
    fig.add_hline(y=meta["budget_tokens"] * meta["bytes_per_token"] / MiB, line_dash="dot",
                  annotation_text="pool size")
    return fig


# =================================================================== C. concurrency in a fixed budget
def reference_max_concurrent(budget_tokens: int, lengths: Sequence[int], max_model_len: int, block_size: int,
                             paged: bool) -> int:
    """How many of the requests (admitted in order) hold their KV at once, each to its final length."""
    budget_blocks = budget_tokens // block_size
    if not paged:
        return min(len(lengths), budget_blocks // -(-max_model_len // block_size))
    count = used = 0
    for n in lengths:
        used += -(-n // block_size)
        if used > budget_blocks:
            break
        count += 1
    return count


CONCURRENCY_CASES = (  # (budget_tokens, lengths, max_model_len, block_size, what it shows)
    (4096, [100] * 8, 1024, 16, "the pool holds 4 reservations of 1024"),
    (4000, [100] * 8, 1024, 16, "3 whole reservations of 64 blocks fit in 250 blocks, not 3.9"),
    (4096, [100] * 50, 1024, 16, "paged: 7 blocks per request of 100 tokens, 256 blocks"),
    (1000, [17, 16, 33], 512, 16, "contiguous: not even one reservation fits"),
    (100, [17, 16, 33], 512, 16, "paged: 2 + 1 blocks fit in 6, the third needs 3 more"),
    (1 << 20, [5, 6, 7], 64, 16, "everything fits: at most len(lengths)"),
    (64, [20, 50, 1], 64, 32, "in order: request 1 needs 2 blocks, 1 is left, so it and everyone behind it wait"),
    (140, [10] * 4, 70, 32, "a reservation of 70 tokens takes 3 whole blocks of 32: 4 blocks hold one, not two"),
)


def check_max_concurrent(max_concurrent: Callable, cases=CONCURRENCY_CASES) -> None:
    for budget, lengths, max_len, block, why in cases:
        for paged in (False, True):
            call = f"max_concurrent({budget}, {lengths if len(lengths) < 6 else f'[{lengths[0]}] * {len(lengths)}'}, " \
                   f"{max_len}, {block}, paged={paged})"
            got = call_learner(max_concurrent, (budget, list(lengths), max_len, block, paged), call)
            want = reference_max_concurrent(budget, lengths, max_len, block, paged)
            if isinstance(got, bool) or not isinstance(got, int) or got != want:
                hint = ""
                if not paged and isinstance(got, (int, float)) and got == min(len(lengths), budget // max_len) != want:
                    hint = " — reservations are whole blocks: ceil(max_model_len / block_size) blocks each"
                elif not paged and isinstance(got, (int, float)) and got == budget // -(-max_len // block) // block:
                    hint = " — never more than len(lengths) requests"
                elif paged and isinstance(got, (int, float)) and got == min(len(lengths), budget // max(1, min(lengths))):
                    hint = " — a paged request holds ceil(length / block_size) whole blocks"
                elif paged and isinstance(got, (int, float)) and got > want:
                    hint = " — admit requests in order and stop at the first that does not fit (first come, first served)"
                raise CheckFailed(f"{call} returned {got!r}, expected {want} ({why}){hint}")
    passed("max_concurrent", 2 * len(cases))


class ConcurrencyExplorer:
    """A slider for the KV budget: requests at once, paged vs contiguous, from your max_concurrent,
    with the engine's measured peak_running from section 3 as markers."""

    def __init__(self, max_concurrent: Callable, lengths: Sequence[int], max_model_len: int, block_size: int,
                 bytes_per_token: int, measured: dict | None = None, device: str | None = None):
        import ipywidgets as widgets

        self.fn, self.lengths = max_concurrent, list(lengths)
        self.max_model_len, self.block_size, self.bytes_per_token = max_model_len, block_size, bytes_per_token
        top = max(2 * sum(-(-n // block_size) * block_size for n in self.lengths), 4 * max_model_len)
        step = block_size * max(1, top // block_size // 200)
        self.budgets = list(range(step, top + 1, step))
        fig = new_figure(f"Requests at once in a KV budget ({len(self.lengths)} requests, max_model_len={max_model_len})",
                         "KV budget (tokens)", "requests holding KV at once",
                         device=f"model: your max_concurrent; markers measured on {device}" if device else None)
        for paged, name, color in ((True, "paged", "#1f77b4"), (False, "contiguous", "#d62728")):
            fig.add_scatter(x=self.budgets, y=[self.fn(b, self.lengths, max_model_len, block_size, paged)
                                               for b in self.budgets], name=f"{name} (predicted)",
                            line=dict(color=color, shape="hv"))
        if measured:
            meta = measured["_meta"]
            for label, r in _modes(measured).items():
                fig.add_scatter(x=[meta["budget_tokens"]], y=[r["stats"].peak_running], mode="markers",
                                name=f"{label.split(' ')[0]} measured (peak_running)",
                                marker=dict(size=12, symbol="x", color="#1f77b4" if r["paged"] else "#d62728"))
        fig.add_scatter(x=[self.budgets[0]] * 2, y=[0, len(self.lengths)], mode="lines", name="your budget",
                        line=dict(color="gray", dash="dot"))
        self.slider = widgets.IntSlider(value=min(4 * max_model_len, top), min=self.budgets[0], max=self.budgets[-1],
                                        step=step, description="KV tokens", continuous_update=False,
                                        layout=widgets.Layout(width="520px"))
        control_panel(self, [self.slider], fig)

    def update(self) -> None:
        budget = self.slider.value
        paged = self.fn(budget, self.lengths, self.max_model_len, self.block_size, True)
        contiguous = self.fn(budget, self.lengths, self.max_model_len, self.block_size, False)
        self.current = {"budget_tokens": budget, "paged": paged, "contiguous": contiguous}
        self.figure.data[-1].x = [budget, budget]
        ratio = f"{paged / contiguous:.1f}x" if contiguous else "∞ (contiguous fits none)"
        self.label.value = (f"<b>{budget} tokens</b> ({budget * self.bytes_per_token / MiB:.0f} MiB): paged runs "
                            f"<b>{paged}</b> at once, contiguous <b>{contiguous}</b> — {ratio}")

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


# =================================================================== D. the paged decode kernel
def make_paged_inputs(seq_lens: Sequence[int], num_kv_heads: int, group: int, head_dim: int, block_size: int,
                      seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu", spare_blocks: int = 3):
    """Random q and a pool where each sequence's blocks are scattered at random; every slot that holds
    no token of a sequence (free blocks, the tail of each last block, the table's padding) is NaN,
    so a kernel that reads one returns NaN instead of a near miss."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    poison = order[-1]                      # a spare block: the padding of every table points here
    k_cache = torch.full((num_kv_heads, num_blocks * block_size, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    width = max(blocks_per_seq)
    block_tables = torch.full((len(seq_lens), width), poison, dtype=torch.int32)
    next_block = 0
    for s, n in enumerate(seq_lens):
        for b in range(blocks_per_seq[s]):
            block = order[next_block]
            next_block += 1
            block_tables[s, b] = block
            filled = min(block_size, n - b * block_size)
            start = block * block_size
            k_cache[:, start:start + filled] = torch.randn(num_kv_heads, filled, head_dim, generator=gen)
            v_cache[:, start:start + filled] = torch.randn(num_kv_heads, filled, head_dim, generator=gen)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen)
    seq_lens_t = torch.tensor(list(seq_lens), dtype=torch.int32)
    return [t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
            for t in (q, k_cache, v_cache, block_tables, seq_lens_t)]


def paged_decode_reference(q, k_cache, v_cache, block_tables, seq_lens, scale, block_size, kv_head_of=None):
    """Gather each sequence's keys through its block table, then softmax attention (fp32).
    `kv_head_of(head, num_kv_heads, group)` picks the KV head (default head // group)."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[0]
    group = num_heads // num_kv_heads
    kv_heads = torch.tensor([kv_head_of(h, num_kv_heads, group) if kv_head_of else h // group
                             for h in range(num_heads)])
    out = torch.empty(q.shape, dtype=torch.float32)
    for s, n in enumerate(seq_lens.tolist()):
        positions = torch.arange(n)
        slots = block_tables[s].cpu().long()[positions // block_size] * block_size + positions % block_size
        keys = k_cache[:, slots.to(k_cache.device)].float().cpu()[kv_heads]      # [num_heads, n, head_dim]
        values = v_cache[:, slots.to(v_cache.device)].float().cpu()[kv_heads]
        scores = torch.einsum("hd,hnd->hn", q[s].float().cpu(), keys) * scale
        out[s] = torch.einsum("hn,hnd->hd", scores.softmax(-1), values)
    return out


KERNEL_CASES = (  # (seq_lens, num_kv_heads, group, head_dim, block_size, what it shows)
    ([1], 1, 1, 64, 16, "one sequence, one key (the first decode step of a 1-token prompt)"),
    ([5, 16, 17, 40], 1, 1, 64, 16, "a partial block, a full block, a full block plus one key, 3 blocks whose max "
                                    "grows (the running sum must be rescaled)"),
    ([1, 5, 17, 100], 3, 3, 64, 16, "SmolLM2's GQA: 9 query heads share 3 KV heads"),
)
HIDDEN_KERNEL_CASES = (
    ([33, 2, 64], 2, 4, 64, 32, "block_size 32, 4 query heads per KV head"),
    ([300, 7], 3, 3, 64, 16, "a long sequence: 19 blocks, the online softmax must rescale"),
    ([9, 1, 16, 40], 1, 2, 32, 8, "head_dim 32, block_size 8"),
)


def _diagnose_kernel(out, q, k_cache, v_cache, block_tables, seq_lens, scale, block_size, want, tol) -> str:
    got = out.float().cpu()
    bad = ~torch.isclose(got, want, atol=tol, rtol=tol) | got.isnan()
    s, h, d = (int(i) for i in (got.isnan() if got.isnan().any() else bad).nonzero()[0])   # a NaN first
    n = int(seq_lens[s])
    where = (f"out[{s}, {h}, {d}] (sequence {s} of {n} keys, query head {h}) is {got[s, h, d].item():.5g}, "
             f"expected {want[s, h, d].item():.5g}")
    num_kv_heads = k_cache.shape[0]
    group = q.shape[1] // num_kv_heads
    if got.isnan().any():
        return (where + " — NaN: your kernel read a slot that holds no token of this sequence (every such slot is "
                "NaN here), or never stored this output (the launcher fills out with NaN). Mask positions >= seq_len in the last block (load with mask=..., other=0.0, and set "
                "their scores to -inf), and look up each block in block_tables[seq, b], never block b of the pool")

    def agrees(alt) -> bool:
        return torch.allclose(got, alt, atol=tol, rtol=tol)

    args = (q, k_cache, v_cache, block_tables, seq_lens)
    if group > 1 and agrees(paged_decode_reference(*args, scale, block_size, kv_head_of=lambda h, kv, g: h % kv)):
        return where + f" — query head h reads KV head h // {group} (consecutive query heads share a KV head), not h % {num_kv_heads}"
    if num_kv_heads > 1 and agrees(paged_decode_reference(*args, scale, block_size, kv_head_of=lambda h, kv, g: 0)):
        return (where + " — every query head read KV head 0: add this KV head's offset (kv_base, kv_head * num_slots "
                "* HEAD_DIM) to the addresses of its keys and values")
    if agrees(paged_decode_reference(*args, 1.0, block_size)):
        return where + " — the scores were not multiplied by `scale` (1 / sqrt(head_dim))"
    single = [i for i, length in enumerate(seq_lens.tolist()) if length <= block_size]
    long = [i for i, length in enumerate(seq_lens.tolist()) if length > block_size]
    if single and long and not bad[single].any():
        return (where + " — sequences that fit in one block are right, longer ones are wrong: check the online "
                "softmax across blocks (rescale the running sum and accumulator by exp(old_max - new_max)) and the "
                "block-table index (row stride = block_tables.shape[1])")
    return where + " — compare your loop, step by step, with the torch spec above"


def check_paged_decode(paged_decode: Callable, cases=KERNEL_CASES, seed: int = 0, device: str | None = None) -> None:
    """Your kernel vs the reference on scattered, NaN-poisoned pools (fp32)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tol = 1e-4
    for i, (seq_lens, num_kv_heads, group, head_dim, block_size, why) in enumerate(cases):
        q, k_cache, v_cache, block_tables, lens = make_paged_inputs(seq_lens, num_kv_heads, group, head_dim,
                                                                    block_size, seed=seed + i, device=device)
        scale = head_dim ** -0.5
        call = (f"paged_decode(seq_lens={list(seq_lens)}, {num_kv_heads * group} query heads / {num_kv_heads} KV heads, "
                f"head_dim {head_dim}, block_size {block_size})")
        out = call_learner(paged_decode, (q, k_cache, v_cache, block_tables, lens, scale, block_size), call)
        if not isinstance(out, torch.Tensor) or out.shape != q.shape:
            raise CheckFailed(f"{call} returned {getattr(out, 'shape', type(out).__name__)}; expected a tensor shaped "
                              f"like q {tuple(q.shape)} ([num_seqs, num_heads, head_dim])")
        want = paged_decode_reference(q, k_cache, v_cache, block_tables, lens, scale, block_size)
        if out.isnan().any() or not torch.allclose(out.float().cpu(), want, atol=tol, rtol=tol):
            raise CheckFailed(f"{call} ({why}): " + _diagnose_kernel(out, q, k_cache, v_cache, block_tables, lens,
                                                                     scale, block_size, want, tol))
    passed("paged_decode", len(cases))


# ------------------------------------------------------------------ the kernel inside the engine
class KernelDecodeBackend:
    """An attention backend of layout "block_tables" (minillm/seams.py): K/V stored with torch, decode
    steps through your kernel, prefill (several queries per sequence) through torch's
    scaled_dot_product_attention over each sequence's blocks."""

    layout = "block_tables"

    def __init__(self, paged_decode: Callable):
        from ..layers.attention import TorchAttentionBackend

        self.paged_decode = paged_decode
        self.torch = TorchAttentionBackend()
        self.num_kernel_calls = 0
        self.kernel_s = 0.0

    def store_kv(self, k_cache, v_cache, k, v, slot_mapping):
        self.torch.store_kv(k_cache, v_cache, k, v, slot_mapping)

    def decode(self, q, k_cache, v_cache, meta, scale):
        with Stopwatch() as sw:
            out = self.paged_decode(q.contiguous(), k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                    meta.block_size)
        self.num_kernel_calls += 1
        self.kernel_s += sw.seconds
        return out

    def extend(self, q, k_cache, v_cache, meta, scale):
        outs = []
        starts = meta.query_start_loc.tolist()
        for i, seq_len in enumerate(meta.seq_lens.tolist()):
            positions = torch.arange(seq_len, device=q.device)
            slots = meta.block_tables[i].long()[positions // meta.block_size] * meta.block_size + positions % meta.block_size
            num_q = starts[i + 1] - starts[i]
            outs.append(self.torch.attend(q[starts[i]:starts[i + 1]], k_cache[:, slots], v_cache[:, slots], scale,
                                          seq_len - num_q))
        return torch.cat(outs)


def print_kernel_run(result: dict) -> None:
    """Your kernel's tokens against the torch backend's (they must be equal)."""
    common.print_kernel_run(result, [("the torch backend's", result["expected"], "")], result["kernel_calls"],
                            "your kernel, one launch per layer per decode step")


def time_kernels(paged_decode: Callable, seq_len: int = 2048, num_seqs: int = 32, num_kv_heads: int = 3,
                 group: int = 3, head_dim: int = 64, block_size: int = 16, dtype=torch.float16) -> dict:
    """On a GPU: your kernel vs the engine's split-KV kernel vs the time to read K and V once."""
    from ..hardware import measure_memory_bandwidth

    if not torch.cuda.is_available():
        return {"device": "cpu"}
    from ..kernels.paged_decode import paged_decode_attention

    q, k_cache, v_cache, tables, lens = make_paged_inputs([seq_len] * num_seqs, num_kv_heads, group, head_dim,
                                                          block_size, dtype=dtype, device="cuda", spare_blocks=1)
    k_cache.nan_to_num_(0.0)
    v_cache.nan_to_num_(0.0)
    scale = head_dim ** -0.5
    kv_bytes = 2 * num_seqs * seq_len * num_kv_heads * head_dim * k_cache.element_size()
    bandwidth = measure_memory_bandwidth("cuda")
    yours_s = common.gpu_seconds(lambda: paged_decode(q, k_cache, v_cache, tables, lens, scale, block_size))
    engine_s = common.gpu_seconds(lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, block_size))
    return {"device": torch.cuda.get_device_name(), "kv_bytes": kv_bytes, "bandwidth": bandwidth,
            "bound_s": kv_bytes / bandwidth, "yours_s": yours_s, "engine_s": engine_s,
            "shape": f"{num_seqs} seqs x {seq_len} keys, {num_kv_heads * group}/{num_kv_heads} heads, d={head_dim}, {dtype}"}


def print_kernel_timing(result: dict) -> None:
    """Your kernel against the engine's split-KV kernel: both read every sequence's K and V once."""
    common.print_kernel_timing(result, (("yours", "kv_bytes"), ("engine", "kv_bytes")),
                               no_gpu="against the engine's and the bandwidth bound")


def print_block_size_tradeoff(rows: list[dict]) -> None:
    print(f"{'block_size':>10}{'blocks (table entries)':>24}{'slots wasted':>14}{'utilization':>13}")
    for r in rows:
        print(f"{r['block_size']:>10}{r['blocks']:>24}{r['wasted_slots']:>14}{r['utilization']:>13.1%}")



# =================================================================== 6. the learner's throughput harness
# The reference run: the notebook's measurement cell in full mode (time_batch on the lab's NUM_REQUESTS = 16 chat
# requests, TIMING_TOKENS = 32 output tokens each, in a pool of BUDGET_TOKENS = 4096 slots with MAX_MODEL_LEN = 1024;
# warmup 1, repeats 3) on the course's reference machine.
REFERENCE_HARDWARE = "2-core AMD EPYC (AVX2)"
# The machine was shared with other jobs at the time: the absolute tokens/s are low, the ratio is what to compare.
REFERENCE_TOKENS_PER_S = {"contiguous": 8.13, "paged": 18.7}   # medians of 3 batches of 16 x 32 tokens: 2.3x


class FakeCompletion:
    """What a fake engine's output holds, reachable from the sandbox by its attributes (not a dataclass: the
    learner reads `out.outputs[0].token_ids` through the grader's handle)."""

    __sandbox_methods__ = ()
    __sandbox_attributes__ = ("token_ids", "text")

    def __init__(self, num_tokens: int):
        self.token_ids, self.text = list(range(num_tokens)), ""


class FakeRequestOutput:
    __sandbox_methods__ = ()
    __sandbox_attributes__ = ("outputs",)

    def __init__(self, num_tokens: int):
        self.outputs = [FakeCompletion(num_tokens)]


class FakeBatchEngine:
    """A stand-in for an engine in the harness check: each generate() call moves the shared FakeClock by the next
    scripted cost and returns `tokens` output tokens per prompt."""

    __sandbox_methods__ = ("generate",)
    __sandbox_attributes__ = ()

    def __init__(self, clock, costs, tokens: int):
        self.clock, self.costs, self.tokens, self.calls, self.batches = clock, list(costs), tokens, 0, []

    def generate(self, prompts, params=None, use_tqdm=True):
        if self.calls >= len(self.costs):
            raise RuntimeError(f"generate() called {self.calls + 1} times; warmup + repeats is {len(self.costs)}")
        self.clock.advance(self.costs[self.calls])
        self.calls += 1
        batch = prompts if isinstance(prompts, list) else [prompts]
        self.batches.append(len(batch))
        return [FakeRequestOutput(self.tokens) for _ in range(len(batch))]


def check_time_batch(time_batch: Callable, warmup: int = 2, repeats: int = 5, seed: int = 0) -> None:
    """Your harness with a FakeClock and fake engines whose calls cost scripted seconds: warm-up dropped, the
    median (min, max) seconds per call of the whole batch, tokens per second, and paged's speed-up over contiguous."""
    import statistics

    from .common import FakeClock, is_close, scripted_costs, timing_mistake

    clock = FakeClock()
    costs = {"contiguous": scripted_costs(2.0, warmup, repeats, seed), "paged": scripted_costs(0.9, warmup, repeats, seed + 1)}
    engines = {name: FakeBatchEngine(clock, costs[name], tokens=8) for name in costs}
    prompts = [{"prompt_token_ids": [1, 2, i]} for i in range(4)]
    call = f"time_batch(engines, 4 prompts, params, warmup={warmup}, repeats={repeats}, clock=FakeClock)"
    params = {"max_tokens": 8, "ignore_eos": True}   # the fake engines ignore it; plain data crosses to the sandbox
    got = call_learner(lambda: time_batch(engines, prompts, params, warmup=warmup, repeats=repeats, clock=clock), (),
                       call)
    if clock.reads == 0:
        raise CheckFailed(f"{call}: the clock it was given was never read: time each call with clock(), not "
                          "time.perf_counter() (the injected clock is what the check and your plot see)")
    for name, engine in engines.items():
        if engine.calls != warmup + repeats or any(b != len(prompts) for b in engine.batches):
            raise CheckFailed(f"{call}: engine {name!r} got {engine.calls} generate() calls of {engine.batches} prompts; "
                              f"expected warmup + repeats = {warmup + repeats} calls, each with the whole batch")
    if not isinstance(got, dict) or not all(isinstance(got.get(n), dict) for n in costs) or "speedup" not in got:
        raise CheckFailed(f"{call} returned {type(got).__name__}; expected a dict with 'contiguous', 'paged' (dicts) "
                          "and 'speedup'")
    tokens = 8 * len(prompts)
    for name in costs:
        timed = costs[name][warmup:]
        want = {"median_s": statistics.median(timed), "min_s": min(timed), "max_s": max(timed), "tokens": tokens,
                "tokens_per_s": tokens / statistics.median(timed)}
        for key, value in want.items():
            have = got[name].get(key)
            if not isinstance(have, (int, float)) or not is_close(float(have), value, rel=1e-6):
                why = timing_mistake(float(have), costs[name], warmup) if key == "median_s" and isinstance(
                    have, (int, float)) else ""
                if key == "tokens" and have == 8:
                    why = "the tokens of one request: sum the output tokens over the whole batch"
                raise CheckFailed(f"{call}: [{name!r}][{key!r}] is {have!r}, expected {value:.6g}"
                                  + (f": {why}" if why else ""))
    want = statistics.median(costs["contiguous"][warmup:]) / statistics.median(costs["paged"][warmup:])
    have = got["speedup"]
    if not isinstance(have, (int, float)) or not is_close(float(have), want, rel=1e-6):
        why = ": inverted — the speed-up is paged tokens/s over contiguous tokens/s" if (
            isinstance(have, (int, float)) and have and is_close(1 / float(have), want, rel=1e-6)) else ""
        raise CheckFailed(f"{call}: speedup is {have!r}, expected {want:.6g}{why}")
    passed("time_batch", 1)


def throughput_figure(timing: dict, device: str):
    """Tokens per second of the batch, contiguous vs paged in the same KV budget, with the spread and the reference."""
    names = ["contiguous", "paged"]
    fig = new_figure("Throughput in one KV budget (your harness)", "", "output tokens / s", device=device)
    med = [timing[n]["tokens_per_s"] for n in names]
    fig.add_bar(x=names, y=med, name="yours (median, min-max)",
                error_y={"type": "data", "symmetric": False,
                         "array": [timing[n]["tokens"] / timing[n]["min_s"] - m for n, m in zip(names, med)],
                         "arrayminus": [m - timing[n]["tokens"] / timing[n]["max_s"] for n, m in zip(names, med)]})
    fig.add_bar(x=names, y=[REFERENCE_TOKENS_PER_S[n] for n in names], name=f"reference ({REFERENCE_HARDWARE})")
    fig.update_layout(barmode="group")
    return fig


def print_throughput(timing: dict) -> None:
    for name in ("contiguous", "paged"):
        t = timing[name]
        print(f"{name:>10}: {t['tokens_per_s']:6.1f} tokens/s (median {t['median_s']:.2f} s per batch of {t['tokens']} "
              f"tokens, spread {t['min_s']:.2f} - {t['max_s']:.2f} s)")
    common.print_beside_reference("paged over contiguous, tokens/s", timing["speedup"],
                                  REFERENCE_TOKENS_PER_S["paged"] / REFERENCE_TOKENS_PER_S["contiguous"],
                                  REFERENCE_HARDWARE, unit="x")


def print_explain_questions(utilization: dict | None, at_once: dict | None, timing: dict | None) -> None:
    """Section 6's questions, quoting the learner's measurements."""
    u, a, t = utilization or {}, at_once or {}, timing or {}
    fmt = lambda v, spec: format(float(v), spec) if isinstance(v, (int, float)) else "(not measured)"  # noqa: E731
    print(f"1. Your paged utilization was {fmt(u.get('paged'), '.0%')}, not 100 % either. Where exactly are the "
          "reserved slots that hold no token, and how many can there be at most per request?")
    print("2. Paged waste is under one block per request. Why not use block_size=1?")
    print("3. Where did the learner kernel (one program per query head) read the same bytes more than once, and how "
          "does the engine's kernel avoid it?")
    print(f"4. In one KV budget your paged engine ran {a.get('paged', '?')} requests at once against contiguous's "
          f"{a.get('contiguous', '?')}, and your harness measured {fmt(t.get('speedup'), '.2f')}x the tokens/s. Why is "
          "the speed-up smaller than the ratio of requests at once? And a paged engine that admitted more requests "
          "than fit to completion had to preempt: is that worse than making them wait?")


class TimedEngine:
    """A real engine handed to the learner's harness from the grader's kernel (the engine's own parts are references
    the sandbox does not have): generate() runs it with the SamplingParams it was made with (the harness's `params`
    argument, None here, is ignored) and returns outputs whose `outputs[0].token_ids` the harness counts."""

    __sandbox_methods__ = ("generate",)
    __sandbox_attributes__ = ()

    def __init__(self, engine, params):
        self.engine, self.params = engine, params

    def generate(self, prompts, params=None, use_tqdm=True):
        outs = self.engine.generate(prompts, self.params, use_tqdm=False)
        return [FakeRequestOutput(len(o.outputs[0].token_ids)) for o in outs]
