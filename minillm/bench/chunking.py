"""How long a prompt takes to prefill whole and in chunks: the data behind the server's max_num_batched_tokens.

    python -m minillm.bench.chunking 4096      # one 4096-token prompt, whole and in chunks of 256 .. 2048

Each chunk re-reads the weights and attends to the cached chunks before it, so small chunks cost prefill
throughput; minillm/serve/chunking.py picks the smallest chunk that keeps it near whole-prompt prefill.
"""

from __future__ import annotations


def measure(num_tokens: int = 4096, chunks: tuple[int, ...] = (256, 512, 1024, 2048)) -> None:
    """Prefill time of one `num_tokens` prompt on the default model, whole and in chunks (best of 2)."""
    import time

    from ..llm import LLM
    from ..sampling import SamplingParams

    base = LLM()
    ids = [(i * 7919) % 40000 + 100 for i in range(num_tokens)]

    def seconds(llm) -> float:
        runs = []
        for _ in range(2):
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1))
            runs.append(time.perf_counter() - start)
        return min(runs)

    seconds(base)   # warm-up
    whole = seconds(base)
    print(f"{'whole':>6}: {whole:6.2f} s  {num_tokens / whole:6.0f} tok/s")
    for chunk in chunks:
        t = seconds(base.with_levers(chunked_prefill=True, max_num_batched_tokens=chunk))
        print(f"{chunk:>6}: {t:6.2f} s  {num_tokens / t:6.0f} tok/s  {whole / t:5.2f}x whole-prompt throughput")


if __name__ == "__main__":
    import sys

    measure(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)
