"""tensor_parallel_size=N: the sharded engine equals the unsharded one, token for token.

Each tensor-parallel engine starts its worker processes once per module (gloo on the CPU, one torch
thread per worker): the default model at N = 3 (its 9 query and 3 KV heads split three ways), the
random "tiny-llama-tp" preset at N = 2 (Triton attention in the interpreter, int8 weights) and N = 4
(a vocabulary of 510 that 4 does not divide). Paging, continuous batching, chunked prefill and prefix
caching are on throughout. The last tests kill a worker and shut engines down: no process is left.
"""

from __future__ import annotations

import os
import signal
import threading
import time

os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports triton (workers inherit it)

import psutil
import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.engine.parallel import TensorParallelError
from minillm.layers.parallel import TPGroup
from minillm.models.presets import preset_config, random_model
from minillm.models.quantize import head_dtype_for, quantize_model
from minillm.models.shard import shard_model

PREFIX = "You are a careful assistant. Answer in one short sentence, then stop.\n\n"
QUESTIONS = ["What is the capital of France?", "Name a prime number larger than ten.",
             "Why is the sky blue?", "What do bees make?"]
LEVERS = dict(max_model_len=512, chunked_prefill=True, max_num_batched_tokens=24, max_num_seqs=3, block_size=8,
              prefix_caching=True)
TINY = "random:tiny-llama-tp"
TINY_LEVERS = dict(max_model_len=256, chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=2, block_size=4,
                   prefix_caching=True)
TINY_PROMPTS = [{"prompt_token_ids": [1, 5, 9, 33, 100, 200, 7]},
                {"prompt_token_ids": list(range(3, 40))},
                {"prompt_token_ids": list(range(3, 30)) + [4, 4]}]


def tokens(outputs) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


def alive(pid: int) -> bool:
    if not psutil.pid_exists(pid):
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ------------------------------------------------------------------ the default model, N = 3
@pytest.fixture(scope="module")
def default_pair(default_model_dir):
    one = LLM(**LEVERS)
    three = LLM(tensor_parallel_size=3, **LEVERS)
    yield one, three
    three.shutdown()


def test_default_model_n3_greedy_equals_n1(default_pair):
    one, three = default_pair
    prompts = [PREFIX + q for q in QUESTIONS]
    params = SamplingParams(max_tokens=24)
    want = tokens(one.generate(prompts, params))
    got = tokens(three.generate(prompts, params))
    assert got == want
    steps = three.stats.steps
    assert sum(s.kind != "decode" for s in steps) > 1 and max(s.num_tokens for s in steps) == 24, \
        "the prompts should be prefilled in chunks of max_num_batched_tokens=24"
    assert three.stats.prefix_cache_hits > 0, "the shared prefix should be served from the prefix cache"
    assert max(s.num_running for s in steps) == 3, "continuous batching should run max_num_seqs=3 at once"


def test_default_model_n3_shards_heads_and_counts_all_reduces(default_pair):
    _, three = default_pair
    engine = three.engine
    layer = engine.model.layers[0]
    assert tuple(engine.kv_cache.k[0].shape[::2]) == (1, 64), "rank 0's KV pool holds 1 of the 3 KV heads"
    assert layer.qkv_proj.weight.shape == ((3 + 1 + 1) * 64, 576)   # 3 query heads, 1 K head, 1 V head
    assert layer.o_proj.inner.weight.shape == (576, 192) and layer.down_proj.inner.weight.shape == (576, 512)
    group = engine.tensor_parallel.group
    group.reset_stats()
    out = three.generate([PREFIX + QUESTIONS[0]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    fed = sum(s.num_tokens for s in three.stats.steps)
    # o_proj and down_proj in 30 layers plus the embedding: 61 all-reduces of [tokens, 576] fp32 per step
    assert group.stats.allreduce_calls == 61 * len(three.stats.steps)
    assert group.stats.allreduce_bytes == 61 * fed * 576 * 4
    # the head: one all-gather of this rank's 49152 / 3 logits per sampled token
    assert group.stats.allgather_calls == 3 and group.stats.allgather_bytes == 3 * 49152 // 3 * 4


def test_default_model_n3_seeded_sampling_repeats_and_equals_n1(default_pair):
    one, three = default_pair
    prompts = [PREFIX + q for q in QUESTIONS[:2]]
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=11, n=2)   # n=2: copy-on-write forks
    first = tokens(three.generate(prompts, params))
    assert tokens(three.generate(prompts, params)) == first
    assert first == tokens(one.generate(prompts, params))


# ------------------------------------------------------------------ tiny random models, N = 2 and N = 4
@pytest.fixture(scope="module")
def tiny2():
    levers = dict(TINY_LEVERS, attention_backend="triton", weight_dtype="int8")
    one = LLM(TINY, **levers)
    two = LLM(TINY, tensor_parallel_size=2, **levers)
    yield one, two
    two.shutdown()


@pytest.fixture(scope="module")
def tiny4():
    one = LLM(TINY, **TINY_LEVERS)
    four = LLM(TINY, tensor_parallel_size=4, **TINY_LEVERS)
    yield one, four
    four.shutdown()


def test_tiny_n2_triton_int8_greedy_equals_n1(tiny2):
    one, two = tiny2
    params = SamplingParams(max_tokens=6)
    assert tokens(two.generate(TINY_PROMPTS[:2], params)) == tokens(one.generate(TINY_PROMPTS[:2], params))
    assert two.engine.model.layers[0].o_proj.inner.weight_dtype == "int8"


def test_tiny_n4_greedy_sampling_and_prompt_logprobs_equal_n1(tiny4):
    one, four = tiny4
    greedy = SamplingParams(max_tokens=12)
    assert tokens(four.generate(TINY_PROMPTS, greedy)) == tokens(one.generate(TINY_PROMPTS, greedy))
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=2, prompt_logprobs=2)
    got, want = four.generate(TINY_PROMPTS[:1], sampled), one.generate(TINY_PROMPTS[:1], sampled)
    assert tokens(got) == tokens(want)
    for mine, theirs in zip(got[0].prompt_logprobs[1:], want[0].prompt_logprobs[1:]):
        assert mine.keys() == theirs.keys()
        assert all(abs(mine[t].logprob - theirs[t].logprob) < 1e-4 for t in mine)
    assert four.engine.model.vocab_end - four.engine.model.vocab_start == 128   # ceil(510 / 4)


@pytest.mark.parametrize("weight_dtype", [None, "int8", "int4", "fp8"])
def test_quantized_shards_hold_the_unsharded_values(weight_dtype):
    """Shard, then quantize each shard: every rank's dequantized matrices are exactly its slices of the whole
    model quantized at once (int8 / fp8 row-parallel shards keep the whole row's scale; int4 groups align)."""
    n = 4
    cfg = preset_config(TINY)
    full = random_model(cfg, torch.float32, torch.device("cpu"), 64, seed=5)
    whole = quantize_model(full, weight_dtype, 32, in_place=False, head_dtype=head_dtype_for(weight_dtype)) \
        if weight_dtype else full

    def matrix(layer):
        layer = getattr(layer, "inner", layer)
        return layer.dequantized_weight() if weight_dtype else layer.weight

    hd, inter = cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    sq, skv, si, sv = q // n, kv // n, inter // n, -(-cfg.vocab_size // n)
    for r in range(n):
        shard = shard_model(full, TPGroup(r, n), weight_dtype, 32)
        for mine, theirs in zip(shard.layers, whole.layers):
            qkv = matrix(theirs.qkv_proj)
            rows = torch.cat([qkv[r * sq:(r + 1) * sq], qkv[q + r * skv:q + (r + 1) * skv],
                              qkv[q + kv + r * skv:q + kv + (r + 1) * skv]])
            assert torch.equal(matrix(mine.qkv_proj), rows)
            gate_up = matrix(theirs.gate_up_proj)
            assert torch.equal(matrix(mine.gate_up_proj),
                               torch.cat([gate_up[r * si:(r + 1) * si], gate_up[inter + r * si:inter + (r + 1) * si]]))
            assert torch.equal(matrix(mine.o_proj), matrix(theirs.o_proj)[:, r * sq:(r + 1) * sq])
            assert torch.equal(matrix(mine.down_proj), matrix(theirs.down_proj)[:, r * si:(r + 1) * si])
        head = shard.quantized_head.dequantized_weight() if weight_dtype else shard.lm_head.weight
        full_head = whole.quantized_head.dequantized_weight() if weight_dtype else whole.lm_head.weight
        real = min(sv, cfg.vocab_size - r * sv)
        assert torch.equal(head[:real], full_head[r * sv:r * sv + real])



def test_tiny_n2_int4_logprobs_within_bf16_rounding_of_n1():
    """int4 shards hold the unsharded values exactly (above), but the CPU int4 kernel multiplies in bf16 and returns
    bf16: each rank's partial o_proj / down_proj product is rounded before the fp32 all-reduce (N = 1 rounds the whole
    sum once). So N = 2's prompt logprobs sit within bf16 rounding of N = 1's, far inside int4's own error (N = 1
    int4 vs float), and greedy tokens can part at a near-tie (one of four prompts of the default model at N = 3)."""
    prompt = [{"prompt_token_ids": list(range(3, 40, 2))}]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    kw = dict(max_model_len=64, weight_dtype="int4", weight_group_size=32)

    def logprobs(llm):
        return torch.tensor([next(iter(d.values())).logprob for d in llm.generate(prompt, params)[0].prompt_logprobs[1:]])

    one = LLM(TINY, **kw)
    two = LLM(TINY, tensor_parallel_size=2, **kw)
    try:
        n1, n2 = logprobs(one), logprobs(two)
    finally:
        two.shutdown()
    float_n1 = logprobs(LLM(TINY, max_model_len=64))
    parallel_error = (n2 - n1).abs().max().item()
    assert parallel_error < 0.02
    assert parallel_error < 0.25 * (n1 - float_n1).abs().max().item()

# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("levers, words", [
    (dict(tensor_parallel_size=2), ["tensor_parallel_size=2", "9 query heads", "3 KV heads", "allowed: [1, 3]"]),
    (dict(tensor_parallel_size=3, weight_dtype="int4"),
     ["weight_group_size=128", "o_proj (192)", "weight_group_size in [32, 64]"]),
    (dict(tensor_parallel_size=3, speculative="ngram"), ["tensor_parallel_size=3 with speculative='ngram'"]),
    (dict(tensor_parallel_size=3, enable_lora=True), ["tensor_parallel_size=3 with enable_lora=True"]),
    (dict(tensor_parallel_size=3, weight_dtype="int8", weight_calibration="awq"), ["weight_calibration='awq'"]),
    (dict(tensor_parallel_size=0), ["tensor_parallel_size=0 must be an integer in [1, 64]"]),
])
def test_refusals_name_the_reason(default_model_dir, levers, words):
    with pytest.raises(ValueError) as info:
        LLM(**levers)
    for word in words:
        assert word in str(info.value)


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    """Each rank takes one GPU (cuda:rank): a size above the GPU count is refused before any process starts."""
    from minillm.engine.parallel import check_config
    from minillm.config import EngineConfig
    from minillm.models.presets import preset_config

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = preset_config("random:tiny-llama-tp")
    check_config(EngineConfig(model="random:tiny-llama-tp", tensor_parallel_size=2), cfg, torch.device("cuda"))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 on device='cuda': this machine has 2 GPUs .*"
                                         r"tensor_parallel_size <= 2, or device='cpu'"):
        check_config(EngineConfig(model="random:tiny-llama-tp", tensor_parallel_size=4), cfg, torch.device("cuda"))
    check_config(EngineConfig(model="random:tiny-llama-tp", tensor_parallel_size=4), cfg, torch.device("cpu"))


def test_mixture_of_experts_is_refused():
    with pytest.raises(ValueError, match="mixture-of-experts models .mixtral. are not sharded"):
        LLM("random:tiny-mixtral", tensor_parallel_size=2)


# ------------------------------------------------------------------ the benchmark
def test_benchmark_quick_counts_bytes_and_matches(capsys):
    from minillm.bench.tensor_parallel import main

    assert main(["--quick"]) == 0
    out = capsys.readouterr().out
    decode = [line.split() for line in out.splitlines() if line.split()[:2] == ["2", "decode"]]
    assert decode, out
    steps, step_ms, allreduce_ms, share, allreduces, allreduce_kib = decode[0][2:8]
    assert float(allreduces) == 5 and float(allreduce_kib) == 5 * 2 * 64 * 4 / 1024   # 2 layers x 2 + 1, 2 tokens
    assert 0 < float(allreduce_ms) < float(step_ms)
    assert "equal N=1's: True" in out



def test_minillm_bench_tensor_parallel_flag(capsys):
    from minillm.cli import main

    assert main(["bench", "--tensor-parallel", "4", "--model", TINY, "--num-requests", "3", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    rows = {tuple(line.split()[:2]): line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["4"])}
    assert set(rows) >= {("1", "prefill"), ("1", "decode"), ("4", "prefill"), ("4", "decode")}, out
    assert float(rows[("1", "decode")][6]) == 0 and float(rows[("4", "decode")][6]) == 5   # all-reduces per step
    # printed to 0.1 KiB: 3 tokens of 64 fp32 values, 5 times; the all-gather, 3 rows of ceil(510 / 4) logits
    assert float(rows[("4", "decode")][7]) == pytest.approx(5 * 3 * 64 * 4 / 1024, abs=0.05)
    assert float(rows[("4", "decode")][9]) == pytest.approx(3 * 128 * 4 / 1024, abs=0.05)

# ------------------------------------------------------------------ failure and shutdown
def test_killed_worker_is_named_and_nothing_is_left(tiny4):
    _, four = tiny4
    pids = four.engine.tensor_parallel.worker_pids
    assert len(pids) == 3 and all(alive(p) for p in pids)
    victim = pids[1]   # rank 2
    killer = threading.Timer(1.0, os.kill, (victim, signal.SIGKILL))
    killer.start()
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    with pytest.raises(TensorParallelError, match=r"tensor-parallel worker rank 2 died \(exit code -9\)"):
        four.generate([{"prompt_token_ids": [1, 2, 3]}] * 2, long)
    killer.join()
    assert not any(alive(p) for p in pids), "every worker is stopped and reaped"
    assert not four.engine.has_unfinished()
    with pytest.raises(TensorParallelError, match="rank 2 died"):
        four.generate(TINY_PROMPTS[:1], SamplingParams(max_tokens=2))


def test_set_attention_backend_is_refused_on_rank_0_alone(tiny2):
    _, two = tiny2
    with pytest.raises(ValueError, match="rank 0's backend only"):
        two.set_attention_backend("torch")
    assert two.config.attention_backend == "triton"
    with pytest.raises(ValueError, match="quantized_matmul= with tensor_parallel_size=2: the worker processes keep"):
        two.with_levers(weight_dtype="int8", quantized_matmul=lambda x, layer: x)


def test_shutdown_stops_the_workers(tiny2):
    _, two = tiny2
    pids = two.engine.tensor_parallel.worker_pids
    assert all(alive(p) for p in pids)
    two.shutdown()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)
    with pytest.raises(TensorParallelError, match="shut down"):
        two.generate(TINY_PROMPTS[:1], SamplingParams(max_tokens=2))


# ------------------------------------------------------------------ slow: int8 on the default model, torchrun
@pytest.mark.slow
def test_default_model_n3_int8_greedy_equals_n1_int8(default_pair):
    """int8 shards hold exactly the unsharded int8 values (test_quantized_shards_hold_the_unsharded_values); the
    CPU int8 kernel rounds each rank's partial product to bf16 before the all-reduce, so logits differ from N = 1's
    by bf16 rounding (~1e-3), far below this model's greedy margins on these prompts."""
    one, _ = default_pair
    one8 = one.with_levers(weight_dtype="int8")
    three8 = LLM(tensor_parallel_size=3, weight_dtype="int8", **LEVERS)
    try:
        prompts = [PREFIX + q for q in QUESTIONS]
        params = SamplingParams(max_tokens=24)
        assert tokens(three8.generate(prompts, params)) == tokens(one8.generate(prompts, params))
    finally:
        three8.shutdown()


@pytest.mark.slow
def test_torchrun_serve_n3_equals_n1(default_pair, tmp_path):
    """`torchrun --nproc-per-node 3 -m minillm serve --tensor-parallel-size 3` on loopback: rank 0 serves HTTP,
    ranks 1 and 2 replay its steps; the greedy completion equals N = 1's; stopping torchrun leaves no process."""
    import socket
    import subprocess
    import sys

    import httpx

    one, _ = default_pair
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    log = open(tmp_path / "torchrun.log", "w")
    proc = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", "3", "-m", "minillm", "serve",
                             "--tensor-parallel-size", "3", "--port", str(port), "--max-model-len", "512"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "torchrun.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "torchrun.log").read_text()[-3000:]
            time.sleep(1)
        children = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert len(children) >= 3   # three ranks
        prompt = PREFIX + QUESTIONS[0]
        body = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                          json={"model": one.engine.model_path, "prompt": prompt, "max_tokens": 16,
                                "return_token_ids": True}).json()
        served = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]
        if "error" in body:   # the served name is the model's directory name
            body = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                              json={"model": served, "prompt": prompt, "max_tokens": 16,
                                    "return_token_ids": True}).json()
        want = one.generate([prompt], SamplingParams(max_tokens=16))[0].outputs[0].token_ids
        assert body["choices"][0]["token_ids"] == list(want)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        log.close()
    deadline = time.monotonic() + 30
    while any(alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in children)
