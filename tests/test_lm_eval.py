"""`lm_eval --model local-completions --batch_size 4` against the server: lists of prompts, scored and generated.

Two tasks on a local JSONL file (nothing from a hub): multiple choice (loglikelihood: lists of four
tokenized prompts with echo and logprobs) and generate_until (lists of four text prompts, a stop string).
Slow: lm-eval's start-up alone takes tens of seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from minillm.serve import serve_in_thread

pytestmark = pytest.mark.slow

ROWS = [("The capital of France is", [" Paris", " London", " Rome"]),
        ("Two plus two equals", [" four", " seven", " twelve"]),
        ("The color of the sky on a clear day is", [" blue", " green", " red"]),
        ("Water freezes at zero degrees", [" Celsius", " Kelvin", " Newton"]),
        ("The opposite of hot is", [" cold", " tall", " loud"])]
TASKS = {
    "minillm_mc": "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
                  "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n",
    "minillm_gen": "output_type: generate_until\ndoc_to_text: \"Q: {{question}}\\nA:\"\ndoc_to_target: \"{{target}}\"\n"
                   "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n"
                   "metric_list:\n  - metric: exact_match\n",
}


def test_lm_eval_local_completions_with_batch_size_4(default_llm, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval is a dev dependency (pip install -e '.[dev]')")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": 0, "target": c[0].strip()}) + "\n"
                            for q, c in ROWS))
    for name, body in TASKS.items():
        (tmp_path / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                               f"    test: {data}\ntest_split: test\n{body}")
    lm_eval = Path(sys.executable).parent / "lm_eval"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with serve_in_thread(default_llm, model_name="smollm2") as server:
        args = [str(lm_eval), "--model", "local-completions", "--tasks", ",".join(TASKS), "--include_path",
                str(tmp_path), "--batch_size", "4", "--output_path", str(tmp_path / "out"), "--model_args",
                f"model=smollm2,base_url={server.base_url}/completions,tokenizer={default_llm.engine.model_path},"
                "num_concurrent=1,max_retries=1"]
        run = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
        metrics = httpx.get(server.url + "/metrics").text
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    # greedy scoring is deterministic: 4 of 5 questions pick the right continuation on this model
    assert results["minillm_mc"]["acc,none"] == pytest.approx(0.8)
    assert results["minillm_gen"]["exact_match,none"] == 0.0   # the answers come with a leading space
    finished = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("minillm_request_success_total{"))
    assert finished == 15 + 5   # 5 x 3 choices scored, 5 generated: every prompt of every list one engine request
