"""What a determined student tries, for the grading tests: each class of cheat as code a solution cell runs.

Every cheat here runs where the student's code runs when graded (the sandbox) and must change nothing:
a notebook with cheats scores what the same notebook without them scores. ``cheat_preamble`` puts every
lab-agnostic class into one cell (each attempt in its own try, so one that fails does not stop the next);
``REFERENCE_CHEATS`` are, per lab, exercises that call an implementation already installed (the lab
helper's reference, the engine's own part, a torch operator a check bans) instead of doing the work;
``cheating_copy(lab)`` is the untouched student copy with all of them.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import nbformat

REPO_ROOT = Path(__file__).resolve().parents[1]

# The cheats the old in-process screen refused, by name (tests/test_grading_integrity.py kept them): each
# runs in the sandbox now, through IPython (magics and shell escapes included); destructive ones aim at
# the repository, which the sandbox does not see.
SCREENED_CHEATS = {
    "input transformer": "ip = get_ipython()\nip.input_transformers_post.append(lambda lines: ['try:\\n'] + lines)",
    "ast transformer": "get_ipython().ast_transformers.append(object())",
    "patched helper": "from minillm.lab import common\ncommon.CheckFailed = Warning",
    "patched helper via setattr": "from minillm.lab import common\nsetattr(common, 'call_learner', print)",
    "patched check function": "import torch\ntorch.allclose = lambda *a, **k: True",
    "patched math": "import math\nmath.isclose = lambda *a, **k: True",
    "tracer": "import sys\nsys.settrace(lambda *a: None)",
    "patched builtin": "import builtins\nbuiltins.isinstance = lambda *a: True",
    "rebound exception": "AssertionError = Exception",
    "dunder route": "().__class__.__base__.__subclasses__()",
    "globals route": "globals()['double'] = lambda x: 2 * x if False else 0",
    "exec route": "exec('import sys')",
    "import route": "__import__('sys').settrace(None)",
    "importlib": "import importlib\nimportlib.import_module('sys')",
    "environment": "import os\nos.environ['MINILLM_QUICK'] = '0'",
    "object equal to anything": "class Yes:\n    def __eq__(self, other):\n        return True\nanswer = Yes()",
    "float that lies": "class Liar(float):\n    def __float__(self):\n        return 1.0",
    "magic": "%time 1",
    "shell escape": f"!touch {REPO_ROOT}/SANDBOX_ESCAPED",
    "custom exception handler": "get_ipython().set_custom_exc((Exception,), lambda *a, **k: None)",
    "torch function mode": "import torch.overrides\nclass M(torch.overrides.TorchFunctionMode):\n    pass\nM().__enter__()",
    "open a file": f"open('{REPO_ROOT}/grades.csv', 'w')",
    "metaclass": "class A(metaclass=type):\n    pass",
    "the grader's package": "import grading.remote",
    "the grader's package by its path": f"import sys\nsys.path.insert(0, '{REPO_ROOT}')\nimport grading.remote as g\ng.refresh = None",
}


def evasions(module: str) -> str:
    """The screen's blind spots the issue names, in the sandbox: getattr without the word, C-level twins
    of modules, os and sys reached through other modules, file access through another module's open,
    module writes through an alias, comparison methods added without def."""
    return "\n".join([
        "import string, _io, posix, operator, torch",
        f"from minillm.lab import {module}",
        f"_field = string.Formatter().get_field('0.__class__', [{module}], {{}})[0]",
        "_os = torch.os if hasattr(torch, 'os') else posix",
        "_sys = torch.sys if hasattr(torch, 'sys') else None",
        f"_io.open('{REPO_ROOT}/SANDBOX_ESCAPED', 'w')",
        f"_alias = {module}\nfor _name in dir(_alias):\n    if _name.startswith('check'):\n        setattr(_alias, _name, lambda *a, **k: None)",
        "Always = type('Always', (), {'__eq__': lambda s, o: True, '__bool__': lambda s: True, '__float__': lambda s: 1.0})",
        "operator.attrgetter('__dict__')(torch)['allclose'] = lambda *a, **k: True",
    ])


IPYTHON_HOOKS = "\n".join([
    "_ip = get_ipython()",
    "_ip.events.register('post_run_cell', lambda result: setattr(result, 'error_in_exec', None))",
    "_ip.showtraceback = lambda *a, **k: None",
    "_ip.input_transformer_manager.cleanup_transforms.append(lambda lines: ['pass\\n'])",
    "_ip.input_transformer_manager.line_transforms.append(lambda lines: lines)",
])

SPOOFED_PROVENANCE = "\n".join([
    "class Tensorish:",
    "    __module__ = 'torch'",
    "    def __eq__(self, other):",
    "        return True",
    "    def __float__(self):",
    "        return 2.0",
    "Tensorish.__qualname__ = 'Tensor'",
    "class Helperish(float):",
    "    __module__ = 'minillm.lab.common'",
])


def reaching_the_course(lab: str, course_dir: Path | None, marker: Path) -> str:
    """Read the master, the solution, the gradebook; write a manual score into it; import the repository."""
    paths = [REPO_ROOT / "grading" / "source" / lab / f"{lab}.ipynb", REPO_ROOT / "solutions" / f"{lab}.ipynb",
             Path("../../../source") / lab / f"{lab}.ipynb", Path("../../../gradebook.db")]
    if course_dir is not None:
        paths += [Path(course_dir) / "gradebook.db", Path(course_dir) / "source" / lab / f"{lab}.ipynb"]
    lines = [f"for _path in {[str(p) for p in paths]!r}:",
             "    try:",
             "        _text = open(_path, 'rb').read()",
             f"        open({str(marker)!r}, 'w').write('read ' + _path)",
             "    except Exception:",
             "        pass"]
    if course_dir is not None:
        lines += ["import sqlite3",
                  "try:",
                  f"    _db = sqlite3.connect('file:{course_dir}/gradebook.db?mode=rw', uri=True)",
                  "    _db.execute('UPDATE grade SET manual_score = 100')",
                  "    _db.commit()",
                  f"    open({str(marker)!r}, 'w').write('wrote the gradebook')",
                  "except Exception:",
                  "    pass"]
    lines += ["import sys",
              f"sys.path.insert(0, {str(REPO_ROOT)!r})",
              "try:",
              "    import grading.build",
              f"    open({str(marker)!r}, 'w').write('imported the grader')",
              "except Exception:",
              "    pass"]
    return "\n".join(lines)


def outliving(token: str, marker: Path, delay_s: int = 6) -> str:
    """A detached process (its own session, double-forked) that writes after grading is over."""
    return "\n".join([
        "import subprocess, os",
        f"subprocess.Popen(['setsid', 'sh', '-c', 'sleep {delay_s}; echo {token} > {marker}'], start_new_session=True,",
        "                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)",
        "if os.fork() == 0:",
        "    os.setsid()",
        "    if os.fork() == 0:",
        "        import time",
        f"        time.sleep({delay_s + 1})",
        f"        open({str(marker)!r}, 'w').write({token!r})",
        "    os._exit(0)",
    ])


DETECTING = "\n".join([
    "import os",
    "GRADED = (os.environ.get('MINILLM_QUICK') == '1' or os.path.isdir('/sandbox') or 'submitted' in os.getcwd()"
    " or not os.path.exists(os.path.expanduser('~/.cache/minillm/models')))",
])


def _guarded(code: str) -> str:
    """``code`` run through IPython, its failure swallowed, so the next attempt still runs."""
    return f"get_ipython().run_cell({code!r}, store_history=False)"


def cheat_preamble(lab: str, marker: Path, token: str, course_dir: Path | None = None) -> str:
    """Every lab-agnostic cheat, each attempted on its own, as the first lines of a solution cell."""
    module = f"lab{lab[:2]}" if lab[:2].isdigit() and lab != "99_probe" else "common"
    attempts = [evasions(module), IPYTHON_HOOKS, SPOOFED_PROVENANCE, reaching_the_course(lab, course_dir, marker),
                outliving(token, marker), DETECTING, *SCREENED_CHEATS.values()]
    return "\n".join(_guarded(code) for code in attempts) + "\n"


# Per lab: solution cells that call what is already installed. Each would earn the exercise's points if
# the reference were reachable; graded, each must earn nothing (the references are stubbed in the sandbox).
def _fn(signature: str, body: str) -> str:
    return f"def {signature}:\n" + "\n".join("    " + line for line in body.split("\n"))


REFERENCE_CHEATS: dict[str, dict[str, str]] = {
    "00_setup": {
        "answer_decode_90": "answer_decode_90_tokens = lab00.decode_90_tokens(metrics.ttft_s, metrics.tpot_s)",
    },
    "01_prefill_decode": {
        "ttft_tpot_s": _fn("ttft_tpot_s(arrival_s, token_times_s)", "return lab01.reference_ttft_tpot_s(arrival_s, token_times_s)"),
        "decode_bandwidth_bound": _fn("decode_bandwidth_bound_tokens_per_s(num_params, bytes_per_param, bandwidth_bytes_per_s)",
                                      "return lab01.reference_decode_bandwidth_bound_tokens_per_s(num_params, bytes_per_param, "
                                      "bandwidth_bytes_per_s)"),
        "arithmetic_intensity": _fn("arithmetic_intensity(num_tokens, num_params, bytes_per_param)",
                                    "return lab01.reference_arithmetic_intensity(num_tokens, num_params, bytes_per_param)"),
        "roofline_time": _fn("roofline_time_s(flops, bytes_moved, peak_flops_per_s, bandwidth_bytes_per_s)",
                             "return lab01.reference_roofline_time_s(flops, bytes_moved, peak_flops_per_s, bandwidth_bytes_per_s)"),
        "answer_ridge_batch_h100": "answer_ridge_batch_h100 = lab01.ridge_batch(989e12, 3.35e12, 6.74e9, 2)",
        "measure_ttft_timing": "import time\n" + _fn(
            "time_ttft(prefill, prompt_lengths, clock=time.perf_counter, warmup=1, repeats=3)",
            "from minillm.lab.common import timing_summary\n"
            "rows = []\nfor n in prompt_lengths:\n    samples = []\n    for i in range(warmup + repeats):\n"
            "        t = clock()\n        prefill(n)\n        samples.append(clock() - t)\n"
            "    rows.append({'prompt_tokens': n, **timing_summary(samples[warmup:])})\n"
            "by = {r['prompt_tokens']: r['median'] for r in rows}\n"
            "return {'rows': rows, 'ratio': by[max(by)] / by[min(by)]}"),
    },
    "02_kv_cache": {
        "append_kv": "from minillm.layers.attention import TorchAttentionBackend\n" + _fn(
            "append_kv(k_cache, v_cache, k_new, v_new, slots)",
            "TorchAttentionBackend().store_kv(k_cache, v_cache, k_new, v_new, slots)"),
        # the ban on SDPA undone three ways, then the engine's own attention
        "attend_with_cache": "import torch, importlib\nimport torch.nn.functional as F\n" + _fn(
            "attend_with_cache(q, k, v, scale, num_cached)",
            "try:\n    return lab02.reference_attend(q, k, v, scale, num_cached).to(q.dtype)\nexcept Exception:\n    pass\n"
            "g = q.shape[1] // k.shape[0]\n"
            "mask = torch.arange(k.shape[1])[None] <= (num_cached + torch.arange(q.shape[0]))[:, None]\n"
            "for sdpa in (torch._C._nn.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention):\n"
            "    try:\n"
            "        return sdpa(q.transpose(0, 1), k.repeat_interleave(g, 0), v.repeat_interleave(g, 0), attn_mask=mask,"
            " scale=scale).transpose(0, 1)\n"
            "    except Exception:\n"
            "        pass\n"
            "from minillm.kernels.extend_attention import extend_attention_reference\n"
            "return extend_attention_reference(q, k, v, torch.tensor([[0]]), torch.tensor([k.shape[1]]),"
            " torch.tensor([0, q.shape[0]]), scale, k.shape[1])"),
        # a kernel that does nothing, and the engine's store behind the launcher's name
        "store_kv_kernel": "import triton\nimport triton.language as tl\n@triton.jit\ndef store_kv_kernel(k_cache_ptr):\n"
                           "    tl.store(k_cache_ptr, tl.load(k_cache_ptr))\n"
                           "from minillm.kernels.store_kv import store_kv_reference\n"
                           "def store_kv(k_cache, v_cache, k_new, v_new, slots):\n"
                           "    store_kv_reference(k_cache, v_cache, k_new, v_new, slots)",
        "measure_kv_step_ratio": "import time\n" + _fn(
            "kv_step_ratio(step_with_cache, step_without_cache, clock=time.perf_counter, warmup=2, repeats=10)",
            "from minillm.lab.common import timing_summary\n"
            "def run(step):\n    samples = []\n    for i in range(warmup + repeats):\n        t = clock()\n        step()\n"
            "        samples.append(clock() - t)\n    return timing_summary(samples[warmup:])\n"
            "a, b = run(step_with_cache), run(step_without_cache)\n"
            "return {'with cache': a, 'without cache': b, 'ratio': b['median'] / a['median']}"),
        "kv_cache_bytes_per_token": _fn("kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim, bytes_per_value)",
                                        "return lab02._bytes_per_token(num_layers, num_kv_heads, head_dim, bytes_per_value)"),
        "answer_users_on_80gb": "answer_users_on_80gb = lab02.users_that_fit('Llama-2-7B (MHA, 32 KV heads)', 4000, 2, 80e9)",
    },
    "03_batching": {
        "num_steps": _fn("num_steps(schedule)", "return lab03._num_steps(schedule)"),
        "utilisation": _fn("utilisation(schedule)", "return lab03._utilisation(schedule)"),
        "simulate_batching": _fn("simulate_batching(output_lengths, num_slots, policy)",
                                 "return lab03.reference_schedule(output_lengths, num_slots, policy)"),
        "answer_most_saving_slots": "answer_most_saving_slots = lab03.most_saving_slots()[0]",
        "largest_batch_meeting_floor": "from minillm.lab import lab08\n" + _fn(
            "largest_batch_meeting_floor(batch_sizes, per_user_tps, floor)",
            "rows = [{'batch': b, 'per_user_tps': t, 'usd_per_mtok': -b} for b, t in zip(batch_sizes, per_user_tps)]\n"
            "return lab08.reference_choose_batch_size(rows, floor)"),
        "measure_batching_speedup": "import time\n" + _fn(
            "batching_speedup(run_one_at_a_time, run_batched, clock=time.perf_counter, warmup=1, repeats=3)",
            "def timed(run):\n    samples = []\n    for i in range(warmup + repeats):\n        t = clock()\n"
            "        tokens = run()\n        samples.append(clock() - t)\n"
            "    return lab03.reference_run_timing([0.0] * warmup + samples[warmup:], warmup, tokens)\n"
            "one, batched = timed(run_one_at_a_time), timed(run_batched)\n"
            "return {'one at a time': one, 'batched': batched, 'ratio': batched['tokens_per_s'] / one['tokens_per_s']}"),
    },
    "04_paged_attention": {
        "BlockAllocator": "from minillm.engine.block_manager import BlockManager\nclass BlockAllocator(BlockManager):\n"
                          "    def append(self, table, num_tokens):\n        self.grow(table, num_tokens)\n        return table\n"
                          "    def fork(self, table):\n        return self.share(table)",
        "measure_kv_utilization": _fn("kv_utilization(steps)", "return lab04.reference_kv_utilization(steps)") + "\n"
                                  + _fn("peak_at_once(steps)", "return lab04.reference_peak_at_once(steps)"),
        "max_concurrent": _fn("max_concurrent(budget_tokens, lengths, max_model_len, block_size, paged)",
                              "return lab04.reference_max_concurrent(budget_tokens, lengths, max_model_len, block_size, paged)"),
        # a kernel that does nothing, and the engine's kernel behind the launcher's name
        "paged_decode_kernel": "import triton\nimport triton.language as tl\n@triton.jit\ndef paged_decode_kernel(q_ptr):\n"
                               "    tl.store(q_ptr, tl.load(q_ptr))\n"
                               "from minillm.kernels.paged_decode import paged_decode_attention\n"
                               "def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, block_size):\n"
                               "    return lab04.paged_decode_reference(q, k_cache, v_cache, block_tables, seq_lens, scale, block_size)",
        "measure_time_batch": "import time\nfrom minillm.lab.common import timing_summary\n" + _fn(
            "time_batch(engines, prompts, params, warmup=1, repeats=3, clock=time.perf_counter)",
            "result = {}\nfor name in ('contiguous', 'paged'):\n    for _ in range(warmup):\n"
            "        engines[name].generate(prompts, params, use_tqdm=False)\n    samples = []\n"
            "    for _ in range(repeats):\n        start = clock()\n"
            "        outs = engines[name].generate(prompts, params, use_tqdm=False)\n        samples.append(clock() - start)\n"
            "    summary = timing_summary(samples)\n    tokens = sum(len(o.outputs[0].token_ids) for o in outs)\n"
            "    result[name] = {'median_s': summary['median'], 'min_s': summary['min'], 'max_s': summary['max'],\n"
            "                    'tokens': tokens, 'tokens_per_s': tokens / summary['median']}\n"
            "result['speedup'] = result['paged']['tokens_per_s'] / result['contiguous']['tokens_per_s']\nreturn result"),
    },
    "05_quantization": {
        "quantize_int8": "from minillm.quant.int8 import quantize_int8, dequantize_int8",
        "quantize_int4": "from minillm.quant.int4 import quantize_int4, dequantize_int4",
        "pack_int4": "from minillm.quant.int4 import pack_int4, unpack_int4",
        "salient_channels": _fn("salient_channels(x, fraction)", "return lab05.salient_reference(x, fraction)"),
        "kv_bytes_per_token": _fn("kv_bytes_per_token(num_layers, num_kv_heads, head_dim, bytes_per_value)",
                                  "return lab05.kv_reference(num_layers, num_kv_heads, head_dim, bytes_per_value)") + "\n"
                              + "from minillm.bench.memory import sequences_that_fit as _fit\n"
                              + _fn("sequences_that_fit(budget_bytes, seq_len, bytes_per_token)",
                                    "return _fit(budget_bytes, 0, bytes_per_token, seq_len)"),
        "answer_llama_fit": "answer_llama_fit = lab05.llama_fit_reference()",
        "measure_time_decode": "import time\nfrom minillm.lab.common import timing_summary\n" + _fn(
            "time_decode(engines, prompt, params, warmup=1, repeats=5, clock=time.perf_counter)",
            "result = {}\nfor name, engine in engines.items():\n    for _ in range(warmup):\n"
            "        engine.generate(prompt, params, use_tqdm=False)\n    samples = []\n"
            "    for _ in range(repeats):\n        start = clock()\n"
            "        outs = engine.generate(prompt, params, use_tqdm=False)\n        samples.append(clock() - start)\n"
            "    summary = timing_summary(samples)\n    tokens = sum(len(o.outputs[0].token_ids) for o in outs)\n"
            "    result[name] = {'median_s': summary['median'], 'min_s': summary['min'], 'max_s': summary['max'],\n"
            "                    'tokens': tokens, 'tokens_per_s': tokens / summary['median']}\n"
            "for name in result:\n    result[name]['speedup'] = result[name]['tokens_per_s'] / result['fp32']['tokens_per_s']\n"
            "return result"),
        "int4_matmul_kernel": "import triton\nimport triton.language as tl\n@triton.jit\ndef int4_matmul_kernel(y_ptr):\n"
                              "    tl.store(y_ptr, tl.load(y_ptr))\n"
                              "def int4_matmul(x, packed, scale, zero, group_size):\n"
                              "    return lab05.int4_matmul_reference_launcher(x, packed, scale, zero, group_size)",
    },
    "06_prefix_caching": {
        "block_hashes": _fn("block_hashes(token_ids, block_size, salt=None)",
                            "return lab06.reference_block_hashes(token_ids, block_size, salt)"),
        "lookup": _fn("lookup(cache, keys)", "return lab06.reference_lookup(cache, keys)"),
        "hash_link": "from minillm.engine.block_manager import block_hash\n" + _fn(
            "hash_link(parent_key, block_token_ids, salt)", "return block_hash(parent_key, block_token_ids, salt)"),
        "measure_time_ttft": "import time\nfrom minillm.lab.common import timing_summary\n" + _fn(
            "time_ttft(engines, prompts, params, warmup=1, clock=time.perf_counter)",
            "result = {}\nfor name in ('off', 'on'):\n    samples = []\n    for i, prompt in enumerate(prompts):\n"
            "        start = clock()\n        engines[name].generate(prompt, params, use_tqdm=False)\n"
            "        if i >= warmup:\n            samples.append(clock() - start)\n"
            "    summary = timing_summary(samples)\n"
            "    result[name] = {'median_s': summary['median'], 'min_s': summary['min'], 'max_s': summary['max'],\n"
            "                    'n': summary['n']}\n"
            "result['speedup'] = result['off']['median_s'] / result['on']['median_s']\nreturn result"),
        "cached_cost": _fn("cached_cost(prefix_tokens, suffix_tokens, n_requests, write=1.25, read=0.1)",
                           "return lab06.reference_cached_cost(prefix_tokens, suffix_tokens, n_requests, write, read)"),
        "answer_break_even": "answer_break_even = lab06.break_even_requests()",
    },
    "07_speculative_decoding": {
        "greedy_verify": "from minillm.speculative.verify import greedy_verify",
        "ngram_propose": "from minillm.speculative.ngram import ngram_propose",
        "rejection_sample": "from minillm.speculative.verify import rejection_sample as _rs\n" + _fn(
            "rejection_sample(proposal, draft_probs, target_probs, generator=None)",
            "return _rs(proposal, draft_probs, target_probs, generator)"),
        "measure_chi_square": _fn("chi_square_test(counts, probs)", "return lab07._ref_chi_square(counts, probs)"),
        "measure_spec_rates": _fn("spec_rates(run, base)", "return lab07._ref_spec_rates(run, base)"),
        "accept_length_kernel": "import triton\nimport triton.language as tl\n@triton.jit\ndef accept_length_kernel(out_ptr):\n"
                                "    tl.store(out_ptr, tl.load(out_ptr))\n"
                                "def accept_lengths(proposals, target_argmax, num_proposed):\n"
                                "    return lab07.accept_lengths_reference(proposals, target_argmax, num_proposed)",
        "measure_time_speculation": "import time\nfrom minillm.lab.common import timing_summary\n" + _fn(
            "time_speculation(engines, prompts, params, warmup=1, repeats=5, clock=time.perf_counter)",
            "result = {}\nfor name in ('off', 'on'):\n    for _ in range(warmup):\n"
            "        engines[name].generate(prompts, params, use_tqdm=False)\n    samples = []\n"
            "    for _ in range(repeats):\n        start = clock()\n"
            "        outs = engines[name].generate(prompts, params, use_tqdm=False)\n        samples.append(clock() - start)\n"
            "    summary = timing_summary(samples)\n    tokens = sum(len(o.outputs[0].token_ids) for o in outs)\n"
            "    result[name] = {'median_s': summary['median'], 'min_s': summary['min'], 'max_s': summary['max'],\n"
            "                    'tokens': tokens, 'tokens_per_s': tokens / summary['median']}\n"
            "result['speedup'] = result['on']['tokens_per_s'] / result['off']['tokens_per_s']\nreturn result"),
    },
    "08_serving_cost": {
        "parse_sse": _fn("parse_sse(lines)", "return lab08.reference_parse_sse(lines)"),
        "stream_metrics": _fn("stream_metrics(timed_lines, sent_s)", "return lab08.reference_stream_metrics(timed_lines, sent_s)"),
        "goodput": _fn("goodput(records, slo, duration_s)", "return lab08.reference_goodput(records, slo, duration_s)"),
        "cost_per_million": "from minillm.bench.cost import cost_per_million",
        "choose_batch_size": _fn("choose_batch_size(measurements, per_user_floor_tps)",
                                 "return lab08.reference_choose_batch_size(measurements, per_user_floor_tps)"),
        "measure_batch_sweep": "for row in sweep:\n    row['aggregate_tps'], row['per_user_tps'] = lab08.reference_sweep_speeds(row)",
    },
    "09_decoding_settings": {
        "process_logits": _fn("process_logits(logits, history, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, "
                              "repetition_penalty=1.0)",
                              "return lab09.reference_probs(logits, history, temperature, top_k, top_p, min_p, repetition_penalty)"),
        "measure_diversity": _fn("diversity_stats(run)", "return lab09.reference_diversity_stats(run)"),
        "valid_person": _fn("valid_person(text)", "return lab09.reference_valid_person(text)"),
        # a kernel that does nothing, and the lab's torch reference behind the launcher's name
        "fused_mask_kernel": "import triton\nimport triton.language as tl\n@triton.jit\ndef fused_mask_kernel(out_ptr):\n"
                             "    tl.store(out_ptr, tl.load(out_ptr))\n"
                             "def fused_mask(logits, top_k, top_p, min_p):\n"
                             "    return lab09.mask_reference(logits, top_k, top_p, min_p)",
        "measure_sampling": "from minillm.lab.common import timing_summary\n" + _fn(
            "measure_sampling(runs, clock=None, warmup=1, repeats=5)",
            "return {'greedy': timing_summary([1.0] * repeats), 'filtered': timing_summary([1.0] * repeats), 'ratio': 1.0}"),
    },
    "10_many_models": {
        "lora_delta_gather": "from minillm.kernels.lora import lora_delta_reference\n" + _fn(
            "lora_delta_gather(x, a, b, token_slots)", "return lora_delta_reference(x, a, b, token_slots)"),
        "lora_delta_segments": "from minillm.kernels.lora import lora_delta_reference, token_slots_from_segments\n" + _fn(
            "lora_delta_segments(x, a, b, seg_starts, seg_lens, seg_slots)",
            "return lora_delta_reference(x, a, b, token_slots_from_segments(x.shape[0], seg_starts, seg_lens, seg_slots))"),
        "measure_memory": _fn("memory_for(rows, model_bytes, num_adapters=100)",
                              "return lab10.reference_memory(rows, model_bytes, num_adapters)"),
        "route_topk": "from minillm.models.moe import route\n" + _fn(
            "route_topk(router_logits, top_k)", "return route(router_logits, top_k, True, False)"),
        "moe_dispatch": _fn("moe_dispatch(x, weights, ids, w13, w2)", "return lab10.reference_dispatch(x, weights, ids, w13, w2)"),
        "answer_active_params_b": "answer_active_params_b = lab10.active_params_b()",
        # kernels that do nothing, and the engine's kernels or the spec behind the launchers' names
        "sgmv_kernels": "import triton\nimport triton.language as tl\n@triton.jit\ndef sgmv_shrink_kernel(x_ptr):\n"
                        "    tl.store(x_ptr, tl.load(x_ptr))\n@triton.jit\ndef sgmv_expand_kernel(mid_ptr):\n"
                        "    tl.store(mid_ptr, tl.load(mid_ptr))\n"
                        "from minillm.kernels.lora import sgmv_shrink as _engine_shrink\n"
                        "def sgmv_shrink(x, a, seg_starts, seg_lens, seg_slots):\n"
                        "    return lab10.sgmv_reference(x, a, a, seg_starts, seg_lens, seg_slots, shrink_only=True)\n"
                        "def sgmv_delta(x, a, b, seg_starts, seg_lens, seg_slots):\n"
                        "    return lab10.sgmv_reference(x, a, b, seg_starts, seg_lens, seg_slots)",
        "measure_throughput": "import time\n" + _fn(
            "measure_lora_throughput(run_batched, run_swapped, tokens, clock=time.perf_counter, warmup=1, repeats=3)",
            "return lab10.reference_throughput(run_batched, run_swapped, tokens, clock, warmup, repeats)"),
    },
    "11_scale_out": {
        "column_parallel": _fn("column_parallel(x, weight, num_shards)", "return lab11.reference_column(x, weight, num_shards)"),
        "row_parallel": _fn("row_parallel(x, weight, num_shards)", "return lab11.reference_row(x, weight, num_shards)"),
        "parallel_mlp": _fn("parallel_mlp(x, w_gate_up, w_down, num_shards)",
                            "return lab11.reference_mlp_partials(x, w_gate_up, w_down, num_shards)"),
        "tp_sharding": "from minillm.models.shard import MegatronSharding\nMySharding = MegatronSharding",
        "measure_tp_step_time": "import time\n" + _fn(
            "tp_step_time(steps, clock=time.perf_counter, warmup=2, repeats=5)",
            "times = {}\nfor n, step in steps.items():\n    costs = []\n    for _ in range(warmup + repeats):\n"
            "        start = clock()\n        step()\n        costs.append(clock() - start)\n"
            "    times[n] = lab11.reference_step_timing(costs, warmup)\n"
            "return {'times': times, 'speedup': times[1]['median'] / times[max(times)]['median']}"),
        "answer_tp8_step_ms": "answer_tp8_step_ms = lab11.answer_tp8_ms()",
        "vllm_serve_args": _fn("vllm_serve_args(config)", "return lab11.reference_vllm_args(config)"),
        # a kernel that does nothing, and the torch reference behind the launcher's name
        "row_shard_matmul_kernel": "import triton\nimport triton.language as tl\n@triton.jit\n"
                                   "def row_shard_matmul_kernel(y_ptr):\n    tl.store(y_ptr, tl.load(y_ptr))\n"
                                   "def row_shard_matmul(x_shard, w_shard):\n"
                                   "    return lab11.reference_row_shard_matmul(x_shard, w_shard)",
        "autoscaler_policy": _fn("autoscaler_policy(state, target_ongoing=2.0, upscale_window_s=5.0, downscale_window_s=30.0)",
                                 "return lab11.reference_policy(state, target_ongoing, upscale_window_s, downscale_window_s)"),
    },
    "12_distillation": {
        "distillation_loss": "from minillm.distill.loss import distillation_loss",
        "select_layers": "from minillm.distill.student import select_layers",
        "measure_speed": "from minillm.lab.common import timing_summary\n" + _fn(
            "measure_speed(generate, num_tokens, clock=time.perf_counter, warmup=1, repeats=5)",
            "first, total = [], []\nfor size, samples in ((1, first), (num_tokens, total)):\n"
            "    for i in range(warmup + repeats):\n        start = clock()\n        tokens = generate(size)\n"
            "        if i >= warmup:\n            samples.append(clock() - start)\n"
            "ttft, stats = timing_summary(first), timing_summary(total)\n"
            "return {'ttft_s': ttft['median'], 'median_s': stats['median'], 'min_s': stats['min'], "
            "'max_s': stats['max'], 'tokens_per_s': tokens / stats['median']}"),
        "pick_model": _fn("pick_model(rows, teacher_score, margin, cost='weight_bytes')",
                          "return lab12.reference_pick(rows, teacher_score, margin, cost)"),
        "answer_smallest_ratio": "answer_smallest_ratio = lab12.smallest_ratio(sweep)",
        "answer_q4_bits": "answer_q4_bits = lab12.bits_per_weight('Q4_0')",
    },
}


def cheating_copy(lab: str, marker: Path, token: str, course_dir: Path | None = None) -> nbformat.NotebookNode:
    """The untouched student copy with every cheat: extra cells of their own (not run), the lab's reference
    cheats in place of its exercises (when grading is detected), and every lab-agnostic class after them."""
    nb = nbformat.read(REPO_ROOT / "labs" / f"{lab}.ipynb", as_version=4)
    module = f"lab{lab[:2]}"
    extra = [
        "ip = get_ipython()\ndef wrap(lines):\n    return ['try:\\n'] + ['    ' + l for l in lines] + "
        "['\\nexcept BaseException:\\n    pass\\n']\nip.input_transformers_post.append(wrap)",
        f"for name in dir({module}):\n    if name.startswith('check'):\n        setattr({module}, name, lambda *a, **k: None)",
        "import sys\nsys.settrace(lambda frame, event, arg: None)",
    ]
    first_solution = next(i for i, c in enumerate(nb.cells) if c.metadata.get("nbgrader", {}).get("solution"))
    for offset, source in enumerate(extra):  # after the lab's imports, where they would work if run
        nb.cells.insert(first_solution + offset, nbformat.v4.new_code_cell(source))
    preamble = cheat_preamble(lab, marker, token, course_dir)
    references = REFERENCE_CHEATS.get(lab, {})
    solutions = [c for c in nb.cells if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("solution")]
    for index, cell in enumerate(solutions):
        stub = cell.source
        cheat = references.get(cell.metadata["nbgrader"]["grade_id"])
        # detecting grading: the reference cheat only when graded, the untouched stub otherwise
        body = stub if cheat is None else (f"if GRADED:\n{textwrap.indent(cheat, '    ')}\n"
                                           f"else:\n{textwrap.indent(stub, '    ')}")
        cell.source = f"{_guarded(DETECTING)}\nimport builtins\nbuiltins.AssertionError = Warning\n{body}"
        if index == len(solutions) - 1:
            # the classes that change how later cells run (transformers, hooks, a tracer) come last, after
            # every reference cheat has run: here they could only hide the learner's own errors
            cell.source += "\n" + preamble
    return nb
