"""Tensor parallelism's processes: forming the group, rank 0's call channel, starting and stopping local workers.

    LLM(tensor_parallel_size=N)       rank 0 starts ranks 1..N-1 on this machine as fresh interpreters
                                      (WorkerProcess); they meet at rank 0's TCPStore on 127.0.0.1
    torchrun ... minillm serve        every rank is a torchrun process (torchrun_env); they meet at
      --tensor-parallel-size N        MASTER_ADDR:MASTER_PORT (env_store)

Each rank has two process groups (make_backends): the model's collectives (gloo on the CPU, NCCL on
CUDA) and a gloo group that carries rank 0's pickled calls (CallChannel). What the ranks do with them
is engine/parallel.py's: rank 0's TensorParallel and the workers' replay loop.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import time
from dataclasses import fields, is_dataclass

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)   # one all-reduce / all-gather / a step's broadcast
IDLE_TIMEOUT = datetime.timedelta(days=7)              # a worker waiting for rank 0's next step
STARTUP_TIMEOUT_S = 300.0                              # workers load the model before the group forms


# ------------------------------------------------------------------ groups
def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) when this process was started by torchrun (RANK and WORLD_SIZE set)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))


def _gloo(store, rank: int, world_size: int, loopback: bool):
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = COLLECTIVE_TIMEOUT
    # Loopback for local workers; across machines the interface GLOO_SOCKET_IFNAME names (else the hostname's).
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if loopback
                     else dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def make_backends(store, rank: int, world_size: int, device: torch.device, loopback: bool) -> tuple[object, object]:
    """(the backend the model's collectives run on, the gloo backend that carries rank 0's calls).
    CPU: one gloo group for both. CUDA: NCCL for the model, gloo for the pickled calls."""
    control = _gloo(dist.PrefixStore("control", store), rank, world_size, loopback)
    compute = control
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()   # as torch.distributed.new_group builds it
        opts.is_high_priority_stream = False
        opts._timeout = COLLECTIVE_TIMEOUT
        opts.global_ranks_in_group = list(range(world_size))
        opts.group_name = "minillm_tp"
        compute = dist.ProcessGroupNCCL(dist.PrefixStore("compute", store), rank, world_size, opts)
    return compute, control


def env_store(rank: int, world_size: int):
    """torchrun's store (MASTER_ADDR:MASTER_PORT): its agent hosts it; without an agent rank 0 does."""
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(addr, port, world_size, is_master=rank == 0 and not agent,
                          timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S), wait_for_workers=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"/minillm_tp/attempt_{attempt}", store)


# ------------------------------------------------------------------ calls
def _to(obj, device: torch.device):
    """Tensors inside lists / tuples / dataclasses moved to `device` (a new object; slices and ints as they are)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(x, device) for x in obj)
    if is_dataclass(obj) and not isinstance(obj, type):
        return type(obj)(**{f.name: _to(vars(obj)[f.name], device) for f in fields(obj)})
    return obj


class CallChannel:
    """Rank 0 broadcasts (method, args) to the other ranks; they receive them in the same order.
    A pickled call travels as two gloo broadcasts: its length, then its bytes."""

    def __init__(self, backend, rank: int):
        self.backend, self.rank = backend, rank
        self.bytes_sent = 0

    def send(self, method: str, *args) -> None:
        data = pickle.dumps((method, _to(args, torch.device("cpu"))), protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(data)], dtype=torch.int64)
        self.backend.broadcast(size, 0, COLLECTIVE_TIMEOUT).wait()
        self.backend.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, COLLECTIVE_TIMEOUT).wait()
        self.bytes_sent += 8 + len(data)

    def receive(self, device: torch.device):
        size = torch.zeros(1, dtype=torch.int64)
        self.backend.broadcast(size, 0, IDLE_TIMEOUT).wait()
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.backend.broadcast(data, 0, COLLECTIVE_TIMEOUT).wait()
        method, args = pickle.loads(data.numpy().tobytes())
        return method, _to(args, device)


# ------------------------------------------------------------------ local worker processes
class WorkerProcess:
    """A local worker: a fresh interpreter (`python -c`, like multiprocessing's "spawn", but it never re-runs
    the caller's script, so LLM(tensor_parallel_size=N) works from a plain script, a notebook or pytest) that
    reads its arguments from stdin and runs engine/parallel.py's worker_entry. exitcode: None while it runs,
    -9 after SIGKILL."""

    def __init__(self, rank: int, args: tuple):
        import subprocess

        self.rank = rank
        self.popen = subprocess.Popen(
            [sys.executable, "-c", "from minillm.engine.parallel import worker_entry; worker_entry()"],
            stdin=subprocess.PIPE, env={**os.environ, "MINILLM_TP_RANK": str(rank)})
        self.popen.stdin.write(pickle.dumps(args))
        self.popen.stdin.close()

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def terminate(self) -> None:
        self.popen.terminate()

    def kill(self) -> None:
        self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        import subprocess

        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


def watch_parent(parent_pid: int) -> None:
    """A local worker exits when the process that started it is gone (its orphans would hold memory)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


def stop_processes(processes: list, timeout_s: float = 5.0) -> None:
    """Terminate and join worker processes (SIGKILL those that do not stop)."""
    for p in processes:
        if p.exitcode is None:
            p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join(timeout_s)
