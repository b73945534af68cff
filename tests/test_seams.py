"""The plug-in seams (minillm/seams.py): each replaceable part swapped for a minimal implementation
of its protocol, written here from the protocol alone (no minillm base class), gives the engine's
own tokens; a part that misses a method is refused when the engine is built, with the missing name
and the protocol's signature."""

import re
from pathlib import Path

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.engine.block_manager import BlockUsage
from minillm.seams import PartError

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13] * 7, list(range(30, 47))]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LEVERS = dict(max_model_len=128, max_num_seqs=4, block_size=4)


def _attend(q, k, v, scale, num_cached):
    """q [Q, H, D], k/v [Hkv, K, D]: query i sees keys 0 .. num_cached + i."""
    group = q.shape[1] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = torch.einsum("qhd,hkd->hqk", q.float(), k.float()) * scale
    allowed = torch.arange(k.shape[1])[None, :] <= torch.arange(q.shape[0])[:, None] + num_cached
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,hkd->qhd", weights, v.float()).to(q.dtype)


def _store(k_cache, v_cache, k, v, slot_mapping):
    k_cache[:, slot_mapping] = k.transpose(0, 1)
    v_cache[:, slot_mapping] = v.transpose(0, 1)


class SequenceBackend:
    layout = "sequence"

    def __init__(self):
        self.calls = 0

    def store_kv(self, k_cache, v_cache, k, v, slot_mapping):
        _store(k_cache, v_cache, k, v, slot_mapping)

    def attend(self, q, k, v, scale, num_cached):
        self.calls += 1
        return _attend(q, k, v, scale, num_cached)


class BlockTableBackend:
    layout = "block_tables"

    def __init__(self):
        self.decodes = self.extends = 0

    def store_kv(self, k_cache, v_cache, k, v, slot_mapping):
        _store(k_cache, v_cache, k, v, slot_mapping)

    def _each(self, q, k_cache, v_cache, meta, scale, starts):
        outs = []
        for i, seq_len in enumerate(meta.seq_lens.tolist()):
            pos = torch.arange(seq_len)
            slots = meta.block_tables[i].long()[pos // meta.block_size] * meta.block_size + pos % meta.block_size
            num_q = starts[i + 1] - starts[i]
            outs.append(_attend(q[starts[i]:starts[i + 1]], k_cache[:, slots], v_cache[:, slots], scale,
                                seq_len - num_q))
        return torch.cat(outs)

    def decode(self, q, k_cache, v_cache, meta, scale):
        self.decodes += 1
        return self._each(q, k_cache, v_cache, meta, scale, list(range(q.shape[0] + 1)))

    def extend(self, q, k_cache, v_cache, meta, scale):
        self.extends += 1
        return self._each(q, k_cache, v_cache, meta, scale, meta.query_start_loc.tolist())


class FreeListAllocator:
    """Paged blocks from a free list (BlockAllocator + Truncation)."""

    contiguous = False

    def __init__(self, num_blocks, block_size, contiguous):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_list = list(range(num_blocks))
        self.calls = 0

    def blocks_for(self, num_tokens):
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens):
        return self.blocks_for(num_tokens) <= len(self.free_list)

    def allocate(self, num_tokens):
        self.calls += 1
        table = []
        self.grow(table, num_tokens)
        return table

    def can_grow(self, table, num_tokens):
        return self.blocks_for(num_tokens) - len(table) <= len(self.free_list)

    def grow(self, table, num_tokens):
        while len(table) < self.blocks_for(num_tokens):
            table.append(self.free_list.pop())

    def truncate(self, table, num_tokens):
        while len(table) > self.blocks_for(num_tokens):
            self.free_list.append(table.pop())

    def free(self, table):
        self.free_list.extend(table)

    def usage(self, real_tokens):
        return BlockUsage(self.num_blocks, self.num_blocks - len(self.free_list), self.block_size, real_tokens)


class OldestFirstPolicy:
    def __init__(self):
        self.asked = 0

    def may_admit(self, running):
        self.asked += 1
        return True

    def preemption_victim(self, running, keep):
        return next(s for s in reversed(running) if s not in keep)


class ArgmaxSampler:
    def __init__(self):
        self.rows = 0

    def sample(self, logits, batch):
        self.rows += logits.shape[0]
        return logits.argmax(-1).tolist()


class RepeatLastProposer:
    """Proposes the sequence's last token again (often wrong: verification must reject it)."""

    def __init__(self):
        self.proposed = 0

    def propose(self, seqs, budgets):
        proposals = [[seq.token_ids[-1]] * b for seq, b in zip(seqs, budgets)]
        self.proposed += sum(map(len, proposals))
        return proposals, [None] * len(seqs)

    def accepted(self, seq, num_before, num_kept):
        pass

    def release(self, seq):
        pass


class PrefixVerifier:
    def greedy(self, proposal, target_argmax):
        kept = 0
        while kept < len(proposal) and proposal[kept] == target_argmax[kept]:
            kept += 1
        return list(proposal[:kept]) + [target_argmax[kept]]

    def sample(self, proposal, draft_probs, target_probs, generator):
        raise AssertionError("greedy requests only")


@pytest.fixture(scope="module")
def plain():
    return LLM("random:tiny-llama", **LEVERS)


@pytest.fixture(scope="module")
def want(plain):
    return [list(o.outputs[0].token_ids) for o in plain.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


def _tokens(llm):
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


@pytest.mark.parametrize("backend_cls", [SequenceBackend, BlockTableBackend])
def test_attention_backends_of_each_layout_give_the_engines_tokens(plain, want, backend_cls):
    backend = backend_cls()
    assert _tokens(plain.with_levers(attention_backend=backend)) == want
    calls = backend.calls if backend_cls is SequenceBackend else (backend.decodes, backend.extends)
    assert calls and all(c > 0 for c in (calls if isinstance(calls, tuple) else [calls]))


def test_every_other_part_swapped_at_once_gives_the_engines_tokens(plain, want):
    built = []

    def allocator(num_blocks, block_size, contiguous):
        built.append(FreeListAllocator(num_blocks, block_size, contiguous))
        return built[-1]

    policy, sampler = OldestFirstPolicy(), ArgmaxSampler()
    llm = plain.with_levers(block_manager=allocator, scheduling_policy=policy, sampler=sampler)
    assert _tokens(llm) == want
    assert len(built) == 1 and built[0].calls == len(PROMPTS) and policy.asked > 0 and sampler.rows > 0
    assert sorted(built[0].free_list) == list(range(built[0].num_blocks))   # every block came back


def test_a_proposer_and_verifier_give_the_engines_tokens(plain, want):
    proposer = RepeatLastProposer()
    llm = plain.with_levers(speculative="ngram", num_speculative_tokens=3, proposer=proposer,
                            verifier=PrefixVerifier(),
                            block_manager=lambda n, size, contiguous: FreeListAllocator(n, size, contiguous))
    assert _tokens(llm) == want
    assert proposer.proposed > 0 and llm.stats.spec.num_passes > 0


def test_with_levers_carries_parts_over_and_drops_the_unused_ones(plain):
    proposer = RepeatLastProposer()
    spec = plain.with_levers(speculative="ngram", proposer=proposer)
    assert spec.with_levers(max_num_seqs=2).engine.parts.proposer is proposer
    assert spec.with_levers(speculative=None).engine.parts.proposer is None


def _without(cls, name):
    return type(f"{cls.__name__}Without_{name}", (), {k: v for k, v in vars(cls).items() if k != name})


@pytest.mark.parametrize("argument,part,missing,signature", [
    ("attention_backend", _without(SequenceBackend, "attend")(), "attend()",
     "def attend(self, q, k, v, scale, num_cached)"),
    ("attention_backend", _without(BlockTableBackend, "extend")(), "extend()",
     "def extend(self, q, k_cache, v_cache, meta, scale)"),
    ("scheduling_policy", _without(OldestFirstPolicy, "preemption_victim")(), "preemption_victim()",
     "def preemption_victim(self, running: Sequence, keep: Sequence)"),
    ("sampler", _without(ArgmaxSampler, "sample")(), "sample()",
     "def sample(self, logits, batch) -> list[int]"),
    ("proposer", _without(RepeatLastProposer, "release")(), "release()", "def release(self, seq) -> None"),
    ("verifier", _without(PrefixVerifier, "greedy")(), "greedy()",
     "def greedy(self, proposal: list[int], target_argmax: list[int]) -> list[int]"),
])
def test_a_part_missing_a_method_is_refused_with_its_name_and_signature(argument, part, missing, signature):
    levers = dict(speculative="ngram") if argument in ("proposer", "verifier") else {}
    with pytest.raises(PartError, match=re.escape(missing)) as err:
        LLM("random:tiny-llama", **LEVERS, **levers, **{argument: part})
    assert signature in str(err.value)


def test_an_allocator_missing_a_method_is_refused_when_the_pool_is_built():
    bare = _without(FreeListAllocator, "truncate")
    LLM("random:tiny-llama", **LEVERS, block_manager=bare)     # fine without speculation
    with pytest.raises(PartError, match=r"truncate\(\).*\n.*class Truncation") as err:
        LLM("random:tiny-llama", **LEVERS, speculative="ngram", block_manager=bare)
    assert "def truncate(self, table: list[int], num_tokens: int) -> None" in str(err.value)
    with pytest.raises(PartError, match=r"hash_block\(\), match\(\)"):
        LLM("random:tiny-llama", **LEVERS, prefix_caching=True, block_manager=FreeListAllocator)
    with pytest.raises(ValueError, match=r"proposer=RepeatLastProposer needs speculative="):
        LLM("random:tiny-llama", **LEVERS, proposer=RepeatLastProposer())


def test_a_backend_without_a_layout_names_the_layouts():
    with pytest.raises(PartError, match=r"layout=None.*'sequence', 'padded_decode', 'block_tables'"):
        LLM("random:tiny-llama", **LEVERS, attention_backend=_without(SequenceBackend, "layout")())


def test_engine_and_layers_never_probe_a_part():
    """DESIGN.md: nothing probes a part with hasattr / getattr; the engine calls what the protocols name."""
    root = Path(__file__).resolve().parent.parent / "minillm"
    found = [f"{path.relative_to(root)}:{i}: {line.strip()}"
             for part in ("engine", "layers") for path in sorted((root / part).rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"\b(hasattr|getattr)\(", line)]
    assert not found, "\n".join(found)
