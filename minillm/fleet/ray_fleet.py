"""A fleet of minillm replicas on Ray Serve: Ray's router spreads requests, its autoscaler adds and removes replicas.

    from minillm.fleet.autoscaling import AutoscalingConfig
    from minillm.fleet.ray_fleet import start_fleet
    with start_fleet(num_replicas=2) as fleet:                 # a local Ray cluster on loopback
        print(fleet.base_url, fleet.num_replicas(), fleet.startup_times())
        # OpenAI routes under fleet.base_url + "/v1": minillm.bench.serve.run_benchmark(fleet.base_url, ...)
    fleet = start_fleet(autoscaling=AutoscalingConfig(min_replicas=1, max_replicas=2, target_ongoing_requests=4))

This file starts the fleet (start_fleet) and is its command line; the pieces are beside it. Two deployments
(replicas.py). `FleetIngress` (one replica, no CPU of its own) receives every HTTP request from Ray's proxy and
passes it, as method + path + headers + body, to an `EngineReplica` through a DeploymentHandle with
`.options(stream=True)`; Ray's router picks the replica (power of two choices on queue length) and counts the
ongoing requests the autoscaler reads. Each `EngineReplica` owns an LLM, its AsyncEngine thread and the very app
`minillm serve` runs (minillm/serve/app.py's build_app), driven in-process as an ASGI app: the fleet answers every
route exactly as one server does (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics; SSE
streaming; the same 400s), and the response comes back chunk by chunk.

A replica that dies (killed, out of memory, its machine gone): the ingress sees Ray's actor-died error. Before the
first body byte reached the client it sends the request again to another replica (at most MAX_ATTEMPTS times), so
nothing is lost; once bytes went out it ends the stream with an SSE error event that says which replica died, then
`data: [DONE]` (a non-streaming request's body is one chunk, so it is always retried).

Every replica measures its own start-up (`process_start_s`: from its worker process's creation to the constructor;
`weight_load_s`: building the LLM) and reports it to a small `FleetLog` actor, with the ingress's retries and
mid-stream errors; a monitor thread in the driver records the replica count and Serve's scaling status with
timestamps (`fleet.timeline()`; the `Fleet` handle is handle.py, its settings autoscaling.py).

`minillm fleet` (main() below) is the command line: a fleet in the foreground, or `--demo-autoscale`
(autoscale_demo.py), a load ramp up then down that prints the 1 -> 2 -> 1 timeline. Multi-machine: `ray start
--head` on one machine, `ray start --address=HEAD:6379` on the others (minillm installed on each), then the same
command with `--address HEAD:6379`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import tempfile
import threading
import time
import uuid
import warnings

from .autoscale_demo import autoscale_demo, print_new_events
from .autoscaling import AutoscalingConfig
from .handle import Fleet
from .replicas import APP_NAME, ENGINE_DEPLOYMENT, LOG_NAMESPACE, build_deployments

STARTUP_TIMEOUT_S = 600.0        # serve.run waits this long for every replica to load its weights


def _check_fleet_args(num_replicas, autoscaling, port, threads_per_replica, max_ongoing_requests) -> None:
    if (num_replicas is None) == (autoscaling is None):
        raise ValueError(f"give num_replicas (a fixed fleet) or autoscaling (an AutoscalingConfig), exactly one "
                         f"(got num_replicas={num_replicas!r}, autoscaling={autoscaling!r})")
    if num_replicas is not None and (not isinstance(num_replicas, int) or isinstance(num_replicas, bool)
                                     or num_replicas < 1):
        raise ValueError(f"num_replicas={num_replicas!r} must be an integer >= 1")
    if autoscaling is not None and not isinstance(autoscaling, AutoscalingConfig):
        raise ValueError(f"autoscaling={autoscaling!r} must be an AutoscalingConfig")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"port={port!r} must be an integer in [0, 65535] (0: a free port)")
    if not isinstance(threads_per_replica, int) or threads_per_replica < 1:
        raise ValueError(f"threads_per_replica={threads_per_replica!r} must be an integer >= 1")
    if not isinstance(max_ongoing_requests, int) or max_ongoing_requests < 1:
        raise ValueError(f"max_ongoing_requests={max_ongoing_requests!r} must be an integer >= 1")



# ---------------------------------------------------------------------------- starting it
def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]



def start_fleet(levers: dict | None = None, *, num_replicas: int | None = 2,
                autoscaling: AutoscalingConfig | None = None, port: int = 0, threads_per_replica: int = 1,
                max_ongoing_requests: int = 16, address: str | None = None, host: str = "127.0.0.1",
                model_name: str | None = None, progress: bool = True) -> Fleet:
    """Start engine replicas behind Ray Serve and return the Fleet once every initial replica is ready.

    levers: LLM(**levers) in each replica (model=..., any EngineConfig field). num_replicas: a fixed fleet; or
    autoscaling=AutoscalingConfig(...) (then num_replicas is ignored). port: the HTTP port (0: a free one).
    threads_per_replica: torch threads (and Ray CPUs) per replica. max_ongoing_requests: what Ray's router sends
    one replica at most (the rest wait in the ingress's queue). address: an existing Ray cluster ("HOST:6379" or
    "auto"); None starts a local one on loopback (and shutdown() stops it). host: where the HTTP proxy listens.
    model_name: the name clients pass as `model` (default: as `minillm serve` names it). progress: a tqdm bar of
    replicas loaded (start-up takes 30-45 s on 2 cores)."""
    if autoscaling is not None:
        num_replicas = None
    _check_fleet_args(num_replicas, autoscaling, port, threads_per_replica, max_ongoing_requests)
    levers = dict(levers or {})
    if address is None:   # a bad lever fails here, in words, not after Ray retried every replica's constructor
        from ..config import EngineConfig
        from ..engine.builder import EngineParts

        EngineConfig.from_kwargs(**{k: v for k, v in levers.items() if k not in EngineParts.names()})
    import ray
    from ray import serve

    started_at = time.time()
    started_ray, temp_dir = False, None
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")   # nothing leaves this machine unasked
    # Each replica's own worker processes get these (an actor-level runtime_env: also on a cluster we only joined).
    env = {"OMP_NUM_THREADS": str(threads_per_replica), "MKL_NUM_THREADS": str(threads_per_replica),
           "TOKENIZERS_PARALLELISM": "false"}
    if not ray.is_initialized():
        if address is None:
            temp_dir = tempfile.mkdtemp(prefix="minillm-ray-")
            most = autoscaling.max_replicas if autoscaling is not None else num_replicas
            ray.init(num_cpus=max(os.cpu_count() or 1, most * threads_per_replica), include_dashboard=False,
                     logging_level="ERROR", log_to_driver=False, _temp_dir=temp_dir,
                     object_store_memory=256 * 1024 ** 2, runtime_env={"env_vars": env})
        else:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False, runtime_env={"env_vars": env})
        started_ray = True
    for name in ("ray.serve", "ray"):   # Serve's INFO lines ("Started Serve ...") would interleave with ours
        logging.getLogger(name).setLevel(logging.WARNING)
    deployments = build_deployments()
    log_name = f"fleet-log-{uuid.uuid4().hex[:8]}"
    log = deployments["FleetLog"].options(name=log_name, namespace=LOG_NAMESPACE).remote()
    http_port = port or _free_port(host)
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    # The monitor runs from here on: the timeline shows the replicas starting, not only the fleet once up.
    fleet = Fleet(base_url=f"http://{shown}:{http_port}", log=log, log_name=log_name, started_ray=started_ray,
                  temp_dir=temp_dir, started_at=started_at, autoscaling=autoscaling, fixed_replicas=num_replicas)
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": http_port},
                    logging_config={"log_level": "ERROR"})
        fleet._monitor.start()
        options = {"max_ongoing_requests": max_ongoing_requests,
                   "ray_actor_options": {"num_cpus": threads_per_replica, "runtime_env": {"env_vars": env}},
                   "health_check_period_s": 2.0, "health_check_timeout_s": 30.0,
                   "graceful_shutdown_timeout_s": 5.0}
        if autoscaling is not None:
            options["autoscaling_config"] = autoscaling.to_ray()
        else:
            options["num_replicas"] = num_replicas
        with warnings.catch_warnings():   # Ray 2.60 deprecates metrics_interval_s (for an env variable) but obeys it
            warnings.filterwarnings("ignore", message=".*metrics_interval_s.*", category=DeprecationWarning)
            engine = deployments["EngineReplica"].options(**options).bind(levers, threads_per_replica, log_name,
                                                                         model_name)
        app = deployments["FleetIngress"].bind(engine, log_name)
        deploy_error: list[BaseException] = []

        def deploy() -> None:   # serve.run returns once every replica is up: the bar below counts them meanwhile
            try:
                serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
            except BaseException as exc:  # noqa: BLE001 - re-raised in this thread by _wait_running
                deploy_error.append(exc)

        deployer = threading.Thread(target=deploy, name="minillm-fleet-deploy", daemon=True)
        deployer.start()
        initial = num_replicas if autoscaling is None else (autoscaling.initial_replicas or autoscaling.min_replicas)
        _wait_running(STARTUP_TIMEOUT_S, initial, progress, deployer, deploy_error)
    except BaseException:
        fleet.shutdown()
        raise
    return fleet


def _wait_running(timeout_s: float, replicas: int, progress: bool, deployer: threading.Thread,
                  deploy_error: list) -> None:
    """Wait for serve.run (in `deployer`) and the application to be RUNNING, with a progress bar of replicas."""
    from ray import serve
    from tqdm.auto import tqdm

    deadline = time.monotonic() + timeout_s
    with tqdm(total=replicas, desc="fleet: replicas loaded", unit="replica", disable=not progress) as bar:
        while True:
            app = serve.status().applications.get(APP_NAME)
            state = getattr(app.status, "value", str(app.status)) if app is not None else "MISSING"
            engine = app.deployments.get(ENGINE_DEPLOYMENT) if app is not None else None
            running = int(engine.replica_states.get("RUNNING", 0)) if engine is not None else 0
            if min(running, replicas) > bar.n:
                bar.update(min(running, replicas) - bar.n)
            if deploy_error:
                raise deploy_error[0]
            if state == "RUNNING" and not deployer.is_alive():
                return
            if state in ("DEPLOY_FAILED", "UNHEALTHY"):
                raise RuntimeError(f"the fleet did not start ({state}): {app.message}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the fleet is still {state} after {timeout_s:.0f} s")
            time.sleep(0.2)


# ---------------------------------------------------------------------------- minillm fleet
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minillm fleet", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="multi-machine: `ray start --head` on one machine, `ray start "
                                       "--address=HEAD:6379` on the others, then this command with --address HEAD:6379")
    p.add_argument("--model", default=None, help="HF directory, hub id or random:PRESET (default: SmolLM2-135M)")
    p.add_argument("--num-replicas", type=int, default=None, help="a fixed fleet of N replicas (default 2)")
    p.add_argument("--min-replicas", type=int, default=None, help="autoscale: fewest replicas (default 1)")
    p.add_argument("--max-replicas", type=int, default=None, help="autoscale: most replicas (default 2)")
    p.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="autoscale: requests running or queued per replica that Serve aims at (default 4; demo 2)")
    p.add_argument("--upscale-delay-s", type=float, default=None, help="autoscale: default 5 (demo 1)")
    p.add_argument("--downscale-delay-s", type=float, default=None, help="autoscale: default 30 (demo 3)")
    p.add_argument("--max-ongoing-requests", type=int, default=16, help="most requests one replica is sent at once")
    p.add_argument("--threads-per-replica", type=int, default=1, help="torch threads (and Ray CPUs) per replica")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: a free one)")
    p.add_argument("--host", default="127.0.0.1", help="where Ray's HTTP proxy listens (0.0.0.0: every interface)")
    p.add_argument("--address", default=None, help="an existing Ray cluster (HOST:6379 or auto); default: a local one")
    p.add_argument("--set", nargs="*", metavar="LEVER=VALUE", help="engine levers, e.g. max_num_seqs=8")
    p.add_argument("--demo-autoscale", action="store_true",
                   help="autoscale 1..2 replicas, run a load ramp up then down, print the 1 -> 2 -> 1 timeline, exit")
    p.add_argument("--run-s", type=float, default=None, help="serve this many seconds, then stop (default: Ctrl-C)")
    return p


AUTOSCALE_FLAGS = ("min_replicas", "max_replicas", "target_ongoing_requests", "upscale_delay_s", "downscale_delay_s")


def fleet_kwargs(args: argparse.Namespace) -> dict:
    """start_fleet's keyword arguments from the parsed flags; ValueError naming a bad value or a conflict."""
    from ..levers import parse_levers

    levers = parse_levers(args.set or [])
    if args.model is not None:
        levers["model"] = args.model
    given = {name: getattr(args, name) for name in AUTOSCALE_FLAGS if getattr(args, name) is not None}
    if given and args.num_replicas is not None:
        flag = "--" + next(iter(given)).replace("_", "-")
        raise ValueError(f"--num-replicas={args.num_replicas} is a fixed fleet; {flag} is for an autoscaling one: "
                         "give one or the other")
    kwargs = dict(levers=levers, port=args.port, host=args.host, address=args.address,
                  threads_per_replica=args.threads_per_replica, max_ongoing_requests=args.max_ongoing_requests)
    if given or args.demo_autoscale:
        defaults = dict(target_ongoing_requests=2.0, upscale_delay_s=1.0, downscale_delay_s=3.0,
                        metrics_interval_s=0.5, look_back_period_s=2.0) if args.demo_autoscale else {}
        kwargs["autoscaling"] = AutoscalingConfig(**{**defaults, **given})
        kwargs["num_replicas"] = None
    else:
        kwargs["num_replicas"] = args.num_replicas if args.num_replicas is not None else 2
    return kwargs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        kwargs = fleet_kwargs(args)
        _check_fleet_args(kwargs["num_replicas"], kwargs.get("autoscaling"), kwargs["port"],
                          kwargs["threads_per_replica"], kwargs["max_ongoing_requests"])
    except ValueError as exc:
        print(f"minillm fleet: {exc}", file=sys.stderr)
        return 2
    what = (f"{kwargs['num_replicas']} replicas" if kwargs["num_replicas"] is not None else
            "autoscaling " + json.dumps(kwargs["autoscaling"].to_ray()))
    print(f"starting a fleet ({what}) on {'Ray at ' + args.address if args.address else 'a local Ray cluster'}...",
          flush=True)
    t0 = time.monotonic()
    try:
        fleet = start_fleet(**kwargs)
    except (ValueError, TypeError) as exc:   # a bad lever (--set, --model): refused before any replica starts
        print(f"minillm fleet: {exc}", file=sys.stderr)
        return 2
    with fleet:
        print(f"ready in {time.monotonic() - t0:.1f} s at {fleet.base_url} (OpenAI routes under /v1)")
        print("replica start-up (process start + weight load):")
        for s in fleet.startup_times():
            print(f"  {s['replica']} on node {s['node']} (pid {s['pid']}): {s['process_start_s']:.1f} s + "
                  f"{s['weight_load_s']:.1f} s = {s['total_s']:.1f} s")
        if args.demo_autoscale:
            path = autoscale_demo(fleet)
            low, high = fleet.autoscaling.min_replicas, fleet.autoscaling.max_replicas
            return 0 if path[:1] == [low] and high in path and path[-1] == low else 1
        print("timeline (Ctrl-C stops the fleet):")
        printed = 0
        deadline = None if args.run_s is None else time.monotonic() + args.run_s
        try:
            while deadline is None or time.monotonic() < deadline:
                printed = print_new_events(fleet, printed, sys.stdout)
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        print("stopping the fleet")
    return 0


if __name__ == "__main__":
    sys.exit(main())
