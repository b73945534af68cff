"""Tensor parallelism's runners: rank 0 schedules and samples, the other ranks replay its model calls.

    LLM(tensor_parallel_size=N)       rank 0 is this process; it starts ranks 1..N-1 on this machine as
                                      fresh interpreters (tp_workers.WorkerProcess): gloo on the CPU, NCCL on CUDA
    torchrun ... minillm serve        every rank is a torchrun process (RANK, WORLD_SIZE, MASTER_ADDR,
      --tensor-parallel-size N        MASTER_PORT in the environment); rank 0 serves HTTP, the others
                                      run `worker_loop` (minillm/serve/cli.py)

How the processes start, meet, carry the calls and stop is engine/tp_workers.py's; this module is what
each rank runs: rank 0's TensorParallel, TPModelRunner and TPKVCache, the workers' shard and replay loop.

Every rank holds its shard of the weights (models/shard.py) and a KV pool of its heads with as many
blocks as rank 0's, so one block table addresses the same slots on every rank. Rank 0 owns the
scheduler and the block manager. Before each call that runs a collective it broadcasts the call
(nano-vllm's `call(method, *args)`), and the workers replay it:

    "forward"      the step's prepared tensors (input ids, positions, attention metadata), so every rank
                   runs ModelRunner.forward on the same batch: two all-reduces per layer, one for the embedding
    "head"         the hidden rows rank 0 asks logits for (the head's all-gather); sampling is rank 0's alone
    "copy_blocks"  copy-on-write of forked blocks (n > 1), in every rank's pool
    "exit"         shut down

A worker that dies is found by its exit code, before a step or when a collective fails (gloo raises
when a peer's connection closes): the others are terminated and joined, and the engine raises
"tensor-parallel worker rank 2 died (exit code -9)" for the running requests and every later call.
Workers exit when rank 0 does (their next broadcast fails; a local worker also watches its parent).
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist

from ..layers.parallel import TPGroup
from ..models.loader import load_model, load_model_config, resolve_model_path
from ..models.shard import check_tensor_parallel, shard_config, shard_model
from .kv_cache import KVCache
from .model_runner import ModelRunner
from .tp_workers import (STARTUP_TIMEOUT_S, CallChannel, WorkerProcess, env_store, make_backends, stop_processes,
                         torchrun_env, watch_parent)


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker died or a collective failed; the engine cannot run any more steps."""


# ------------------------------------------------------------------ one rank's model
def load_shard(config, model_path: str, group: TPGroup, device: torch.device, dtype: torch.dtype, max_model_len: int,
               sharding=None):
    """This rank's shard: the float checkpoint, split (by `sharding`, a TensorSharding, or the engine's own cut),
    then quantized shard by shard (weight_dtype)."""
    model = load_model(model_path, dtype, device, max_model_len)
    wd = config.weight_dtype if config.weight_dtype != "auto" else None
    shard = shard_model(model, group, wd, config.weight_group_size, config.weight_head_dtype, sharding)
    del model
    return shard


def pack_sharding(sharding) -> bytes | None:
    """A TensorSharding for the worker processes: by value (cloudpickle), so a class defined in a notebook or
    a script's __main__ reaches them; plain pickle (an importable class) where cloudpickle is not installed."""
    if sharding is None:
        return None
    try:
        import cloudpickle as pickler
    except ImportError:
        pickler = pickle
    try:
        return pickler.dumps(sharding)
    except Exception as exc:
        raise ValueError(f"sharding={type(sharding).__name__} object cannot be sent to the worker processes "
                         f"({type(exc).__name__}: {exc}); keep it a plain class of functions (pip install cloudpickle "
                         "for one defined in a notebook)") from exc


def check_config(config, model_config, device: torch.device | None = None, sharding=None) -> None:
    """What tensor_parallel_size > 1 cannot do (yet), refused with the reason before anything starts."""
    n = config.tensor_parallel_size
    check_tensor_parallel(model_config, n, config.weight_dtype, config.weight_group_size)
    if sharding is not None:
        if config.weight_dtype not in (None, "auto"):
            raise ValueError(f"sharding= with weight_dtype={config.weight_dtype!r}: a sharding part cuts float "
                             "weights; leave weight_dtype unset")
        if torchrun_env() is not None:
            raise ValueError("sharding= under torchrun: the other ranks are separate `minillm serve` processes that "
                             "cut their own shards; a sharding part runs with LLM(tensor_parallel_size=N)'s local "
                             "workers only")
    if device is not None and device.type == "cuda" and torchrun_env() is None:
        gpus = torch.cuda.device_count()
        if n > gpus:
            raise ValueError(f"tensor_parallel_size={n} on device='cuda': this machine has {gpus} GPU"
                             f"{'' if gpus == 1 else 's'} and each rank takes one (rank r on cuda:r); use "
                             f"tensor_parallel_size <= {gpus}, or device='cpu' (one process per rank on gloo)")
    if not isinstance(config.attention_backend, str):
        raise ValueError(f"tensor_parallel_size={n} takes attention_backend='torch' or 'triton' (every rank builds "
                         f"its own backend by name), not an object ({type(config.attention_backend).__name__})")


def worker_runner(config, model_path: str, group: TPGroup, device: torch.device, dtype: torch.dtype,
                  max_model_len: int, num_blocks: int, sharding=None) -> ModelRunner:
    """A worker's ModelRunner: its shard and a KV pool of its heads with rank 0's number of blocks (0: no cache)."""
    model_config = load_model_config(model_path)
    model = load_shard(config, model_path, group, device, dtype, max_model_len, sharding)
    kv_cache = None
    if num_blocks:
        kv_cache = KVCache(shard_config(model_config, group.world_size), num_blocks, config.block_size, dtype, device,
                           config.kv_dtype)
    return ModelRunner(model, device, None, kv_cache, config.attention_backend)


@torch.inference_mode()
def worker_loop(runner: ModelRunner, channel: CallChannel, device: torch.device) -> None:
    """Replay rank 0's calls until "exit"."""
    while True:
        method, args = channel.receive(device)
        if method == "forward":
            runner.forward(*args)
        elif method == "head":
            runner.compute_logits(*args)
        elif method == "copy_blocks":
            runner.kv_cache.copy_blocks(*args)
        elif method == "exit":
            return
        else:
            raise RuntimeError(f"tensor-parallel worker rank {channel.rank}: unknown call {method!r}")


def worker_entry() -> None:
    """A local worker's main (WorkerProcess): the arguments come pickled on stdin."""
    _worker_main(*pickle.loads(sys.stdin.buffer.read()))


def _worker_main(rank: int, world_size: int, port: int, config, model_path: str, dtype: torch.dtype,
                 max_model_len: int, num_blocks: int, parent_pid: int, device_type: str,
                 sharding: bytes | None = None) -> None:
    """A local worker process (spawned by TensorParallel.launch): load the shard, meet the group, replay."""
    torch.set_num_threads(1)   # one thread per rank: N ranks share the machine's cores
    threading.Thread(target=watch_parent, args=(parent_pid,), daemon=True).start()
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
    group = TPGroup(rank, world_size, None, device)
    part = pickle.loads(sharding) if sharding is not None else None
    runner = worker_runner(config, model_path, group, device, dtype, max_model_len, num_blocks, part)
    store.set(f"ready/{rank}", "1")
    group.backend, control = make_backends(store, rank, world_size, device, loopback=True)
    try:
        worker_loop(runner, CallChannel(control, rank), device)
    except RuntimeError as exc:   # a peer (rank 0 or another worker) is gone: rank 0 reports it, exit quietly
        print(f"minillm tensor-parallel worker rank {rank}: stopping, a collective failed: "
              f"{str(exc).splitlines()[0][:200]}", file=sys.stderr, flush=True)
        sys.exit(1)


def run_torchrun_worker(config) -> int:
    """A torchrun rank > 0 of `minillm serve --tensor-parallel-size N`: meet the group, take the model path and
    pool size from rank 0's "setup" call, build this rank's shard, replay rank 0's calls until it exits."""
    from ..hardware import resolve_device, resolve_dtype

    rank, world_size, local_rank = torchrun_env()
    if world_size != config.tensor_parallel_size:
        raise ValueError(f"torchrun started WORLD_SIZE={world_size} processes, but --tensor-parallel-size="
                         f"{config.tensor_parallel_size}; give torchrun --nproc-per-node x --nnodes = N")
    device = resolve_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dtype = resolve_dtype(config.dtype, device)
    group = TPGroup(rank, world_size, None, device)
    group.backend, control = make_backends(env_store(rank, world_size), rank, world_size, device, loopback=False)
    channel = CallChannel(control, rank)
    method, (max_model_len, num_blocks) = channel.receive(torch.device("cpu"))
    if method != "setup":
        raise RuntimeError(f"tensor-parallel worker rank {rank}: expected rank 0's 'setup' call, got {method!r}")
    # this machine's copy of the model: the same directory, hub id or default model as rank 0's
    runner = worker_runner(config, resolve_model_path(config.model), group, device, dtype, max_model_len, num_blocks)
    try:
        worker_loop(runner, channel, device)
    except RuntimeError as exc:   # rank 0 is gone
        print(f"minillm tensor-parallel rank {rank}: stopping, a collective failed: {str(exc).splitlines()[0][:200]}",
              file=sys.stderr, flush=True)
        return 1
    return 0


# ------------------------------------------------------------------ rank 0
class TensorParallel:
    """Rank 0's side: the group, the call channel, the worker processes (local mode) and the failure."""

    def __init__(self, world_size: int, device: torch.device):
        self.group = TPGroup(0, world_size, None, device)
        self.channel = CallChannel(None, 0)
        self.device = device
        self.processes: list = []      # local mode: rank i is processes[i - 1]
        self.store = None
        self.error: TensorParallelError | None = None
        self.closed = False
        self.group.on_error = self.fail
        # interpreter exit or garbage collection: stop the workers
        self._finalizer = weakref.finalize(self, stop_processes, self.processes)

    @property
    def world_size(self) -> int:
        return self.group.world_size

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def shard_config(self, model_config):
        """One rank's shapes (its heads: what its KV pool stores)."""
        return shard_config(model_config, self.world_size)

    # ---------------------------------------------------------- start
    def launch(self, config, model_path: str, dtype: torch.dtype, max_model_len: int, num_blocks: int,
               sharding=None) -> None:
        """Local mode: start ranks 1..N-1 (they load their shards while rank 0 loads its own)."""
        n = self.world_size
        packed = pack_sharding(sharding)
        self.store = dist.TCPStore("127.0.0.1", 0, n, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
        for rank in range(1, n):
            self.processes.append(WorkerProcess(rank, (rank, n, self.store.port, config, model_path, dtype,
                                                       max_model_len, num_blocks, os.getpid(), self.device.type,
                                                       packed)))

    def connect(self) -> None:
        """Local mode: wait for every worker's shard (a worker that dies while loading is reported), then
        form the group."""
        keys = [f"ready/{rank}" for rank in range(1, self.world_size)]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.store.check(keys):
            if self.dead_ranks():
                self.fail()
            if time.monotonic() > deadline:
                self.fail(TimeoutError(f"the workers did not load their shards within {STARTUP_TIMEOUT_S:.0f} s"))
            time.sleep(0.02)
        try:
            self.group.backend, self.channel.backend = make_backends(self.store, 0, self.world_size, self.device,
                                                                     loopback=True)
        except Exception as exc:
            self.fail(exc)

    def join_torchrun(self, max_model_len: int, num_blocks: int) -> None:
        """torchrun mode (this process is RANK 0): form the group with the other ranks and tell them what to load."""
        rank, world_size, _ = torchrun_env()
        if rank != 0 or world_size != self.world_size:
            raise ValueError(f"under torchrun (RANK={rank}, WORLD_SIZE={world_size}) rank 0 builds the engine with "
                             f"tensor_parallel_size=WORLD_SIZE (got {self.world_size}); the other ranks run "
                             "minillm.engine.parallel.run_torchrun_worker (minillm serve does)")
        self.group.backend, self.channel.backend = make_backends(env_store(0, world_size), 0, world_size, self.device,
                                                                 loopback=False)
        self.call("setup", max_model_len, num_blocks)

    # ---------------------------------------------------------- failure
    def dead_ranks(self) -> list[tuple[int, int]]:
        return [(i + 1, p.exitcode) for i, p in enumerate(self.processes) if p.exitcode is not None]

    def fail(self, exc: BaseException | None = None) -> None:
        """A collective failed or a worker is gone: name the dead rank(s), stop the rest, raise from now on."""
        if self.error is None:
            deadline = time.monotonic() + 3.0   # a killed peer's exit code can lag its closed socket
            while self.processes and not self.dead_ranks() and time.monotonic() < deadline:
                time.sleep(0.05)
            dead = self.dead_ranks()
            if dead:
                what = "; ".join(f"tensor-parallel worker rank {r} died (exit code {code})" for r, code in dead)
            else:
                what = f"tensor-parallel collective failed ({type(exc).__name__}: {exc})"
            self.error = TensorParallelError(f"{what}; the engine stopped its other ranks and cannot run more steps")
            self.closed = True
            stop_processes(self.processes)
        raise self.error from exc

    def check(self) -> None:
        if self.error is not None:
            raise self.error
        if self.closed:
            raise TensorParallelError("this tensor-parallel engine was shut down")
        if self.dead_ranks():
            self.fail()

    # ---------------------------------------------------------- calls
    def call(self, method: str, *args) -> None:
        """Broadcast one call to the workers (they run it while rank 0 runs its own part)."""
        self.check()
        try:
            self.channel.send(method, *args)
        except TensorParallelError:
            raise
        except Exception as exc:
            self.fail(exc)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Tell the workers to exit, then join them (terminating any that do not)."""
        if not self.closed:
            self.closed = True
            try:
                if self.channel.backend is not None:
                    self.channel.send("exit")
            except Exception:
                pass
        deadline = time.monotonic() + timeout_s
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        stop_processes(self.processes)


class TPKVCache(KVCache):
    """Rank 0's pool (its heads only): copy-on-write is replayed on every rank."""

    def __init__(self, tensor_parallel: TensorParallel, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tensor_parallel = tensor_parallel

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self.tensor_parallel.call("copy_blocks", pairs)
        super().copy_blocks(pairs)


class TPModelRunner(ModelRunner):
    """Rank 0's runner: each forward is broadcast to the workers first; the head's rows too (ShardedLlama)."""

    tensor_parallel: TensorParallel | None = None   # None while the base class picks the backend the workers built

    def __init__(self, tensor_parallel: TensorParallel, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tensor_parallel = tensor_parallel

    def set_attention_backend(self, backend) -> None:
        if self.tensor_parallel is not None:   # the workers built theirs by name at start-up
            raise ValueError(f"set_attention_backend({backend!r}) on a tensor-parallel engine would change rank 0's "
                             "backend only; build a new LLM(..., attention_backend=...) instead")
        super().set_attention_backend(backend)

    def forward(self, input_ids, positions, meta, lora=None, num_layers=None):
        self.tensor_parallel.call("forward", input_ids, positions, meta, None, num_layers)
        return super().forward(input_ids, positions, meta, lora, num_layers)


def tensor_parallel_weights(tp: TensorParallel, config, model_path: str, device: torch.device, dtype: torch.dtype,
                            max_model_len: int, num_blocks: int, sharding=None):
    """Rank 0's shard, with the other ranks started (local mode) or joined (torchrun) and holding theirs.
    The shard's head tells the workers which rows to compute before its all-gather. `sharding`: a
    TensorSharding every rank cuts its shard with (local mode only)."""
    try:
        if torchrun_env() is not None:
            tp.join_torchrun(max_model_len, num_blocks)
            model = load_shard(config, model_path, tp.group, device, dtype, max_model_len)
        else:
            tp.launch(config, model_path, dtype, max_model_len, num_blocks, sharding)
            model = load_shard(config, model_path, tp.group, device, dtype, max_model_len, sharding)
            tp.connect()
    except BaseException:
        tp.shutdown(timeout_s=2.0)
        raise
    model.before_head = lambda hidden: tp.call("head", hidden)
    return model
