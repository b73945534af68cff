"""Fleet: the driver's handle on a running fleet: replica counts, start-up times, the timeline, kill, shutdown.

start_fleet (ray_fleet.py) returns it. A monitor thread records the running-replica count and Serve's scaling
status with timestamps; timeline() merges them with what the replicas and the ingress reported to the FleetLog
actor (replicas.py): start-ups, retries, mid-stream losses.
"""

from __future__ import annotations

import shutil
import threading
import time

from .autoscaling import AutoscalingConfig
from .replicas import APP_NAME, ENGINE_DEPLOYMENT

MONITOR_INTERVAL_S = 0.2         # how often the driver's monitor thread reads the replica count


class Fleet:
    """A running fleet (start_fleet returns it): base_url, num_replicas(), startup_times(), timeline(),
    kill_replica(), shutdown(); also a context manager."""

    def __init__(self, *, base_url: str, log, log_name: str, started_ray: bool, temp_dir: str | None,
                 started_at: float, autoscaling: AutoscalingConfig | None, fixed_replicas: int | None):
        self.base_url = base_url
        self.autoscaling = autoscaling
        self.fixed_replicas = fixed_replicas
        self._log = log
        self._log_name = log_name
        self._started_ray = started_ray
        self._temp_dir = temp_dir
        self.started_at = started_at
        self._monitor_events: list[tuple[float, int, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self._monitor = threading.Thread(target=self._watch, name="minillm-fleet-monitor", daemon=True)

    # -------------------------------------------------------------- reading the fleet
    def _deployment_status(self):
        from ray import serve

        app = serve.status().applications.get(APP_NAME)
        return None if app is None else app.deployments.get(ENGINE_DEPLOYMENT)

    def num_replicas(self) -> int:
        """Engine replicas running now (Serve's RUNNING state: loaded and taking requests)."""
        status = self._deployment_status()
        return 0 if status is None else int(status.replica_states.get("RUNNING", 0))

    def startup_times(self) -> list[dict]:
        """Per replica, in the order they became ready: {"replica", "node", "pid", "process_start_s",
        "weight_load_s", "total_s"}; process_start_s runs from the worker process's creation to the replica's
        constructor (Python + Ray + torch imports), weight_load_s is building the LLM."""
        import ray

        startups, _ = ray.get(self._log.read.remote())
        keys = ("replica", "node", "pid", "process_start_s", "weight_load_s", "total_s")
        return [{k: s[k] for k in keys} for s in sorted(startups, key=lambda s: s["ready_at"])]

    def timeline(self) -> list[tuple[float, int, str]]:
        """[(seconds since start_fleet, running replicas, event)]: the monitor's replica counts and Serve's
        scaling decisions, merged with what the replicas and the ingress reported (start-ups, retries, losses)."""
        import ray

        _, events = ray.get(self._log.read.remote())
        with self._lock:
            own = list(self._monitor_events)
        merged = own + [(at - self.started_at, self._count_at(own, at - self.started_at), text)
                        for at, text in events]
        return sorted(merged, key=lambda e: e[0])

    @staticmethod
    def _count_at(events: list, t: float) -> int:
        count = 0
        for at, n, _ in events:
            if at > t:
                break
            count = n
        return count

    def _watch(self) -> None:
        last = None
        while not self._stop.wait(MONITOR_INTERVAL_S):
            try:
                status = self._deployment_status()
            except Exception:  # noqa: BLE001 - Ray going down under us at shutdown
                continue
            if status is None:
                continue
            states = dict(status.replica_states)
            running = int(states.get("RUNNING", 0))
            scaling = getattr(status.status, "value", str(status.status))
            key = (running, tuple(sorted(states.items())), scaling)
            if key == last:
                continue
            t = time.time() - self.started_at
            parts = [f"{running} running"] + [f"{n} {s.lower()}" for s, n in sorted(states.items())
                                              if s != "RUNNING" and n]
            text = f"replicas: {', '.join(parts)} (Serve: {scaling})"
            if last is not None and scaling != last[2] and scaling in ("UPSCALING", "DOWNSCALING"):
                text = f"autoscaler decided: {scaling.lower()} -> " + text
            with self._lock:
                self._monitor_events.append((t, running, text))
            last = key

    # -------------------------------------------------------------- acting on it
    def replica_actor_names(self) -> list[str]:
        """The Ray actor names of the engine replicas, oldest first (by when they reported ready)."""
        import ray

        prefix = f"SERVE_REPLICA::{APP_NAME}#{ENGINE_DEPLOYMENT}#"
        alive = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith(prefix)}
        startups, _ = ray.get(self._log.read.remote())
        ordered = [s["actor"] for s in sorted(startups, key=lambda s: s["ready_at"]) if s["actor"] in alive]
        return ordered + sorted(alive - set(ordered))

    def kill_replica(self, index: int = 0) -> str:
        """ray.kill one engine replica (index into replica_actor_names(), oldest first); returns its actor name.
        Serve starts a replacement; requests it held are retried or end with an error (see the module's doc)."""
        import ray

        names = self.replica_actor_names()
        if not isinstance(index, int) or not -len(names) <= index < len(names):
            raise ValueError(f"index={index!r} must be in [0, {len(names) - 1}] ({len(names)} replicas alive)")
        name = names[index]
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        ray.get(self._log.event.remote(time.time(), f"replica actor {name.rsplit('#', 1)[-1]} killed (ray.kill)"))
        return name

    def wait_for_replicas(self, count: int, timeout_s: float = 120.0) -> float:
        """Block until `count` replicas run; returns the seconds waited. TimeoutError naming the count seen."""
        t0 = time.monotonic()
        while True:
            running = self.num_replicas()
            if running == count:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"{running} replicas running after {timeout_s:.0f} s, waiting for {count}")
            time.sleep(MONITOR_INTERVAL_S)

    def shutdown(self) -> None:
        """serve.shutdown(), then ray.shutdown() if start_fleet started Ray; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._monitor.is_alive():
            self._monitor.join(5.0)
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            if self._started_ray:
                ray.shutdown()
                if self._temp_dir:
                    shutil.rmtree(self._temp_dir, ignore_errors=True)
            else:
                try:
                    ray.kill(self._log)
                except Exception:  # noqa: BLE001 - already gone with the cluster
                    pass

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"Fleet({self.base_url}, {'closed' if self._closed else 'running'})"
