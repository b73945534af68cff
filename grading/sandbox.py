"""The sandbox a submission runs in: bubblewrap namespaces, resource limits, one process tree that dies whole.

A graded notebook's student code runs in a process tree that

- sees only its scratch folder (a copy of its notebook; its working directory and HOME), the system's
  /usr, the Python installation and its installed packages, read-only, and the model cache,
  read-only: no course folder, gradebook, masters, solutions or repository (an editable install's
  package is bound alone, as the copy grading.references prepared for the lab);
- has no network (its own network namespace: only its own loopback), its own PID, IPC, UTS and
  user namespaces, and no capabilities;
- is limited in CPU time, memory, file size and number of processes: a cgroup (v2 delegated to
  this user, or v1 as root) where one can be made, else ``setrlimit`` (RLIMIT_AS for memory,
  RLIMIT_NPROC for processes);
- dies whole: its first process is the PID namespace's init, which bubblewrap kills when the grader
  does (``--die-with-parent``), and the kernel then kills every process of the namespace, detached
  or not; the cgroup is emptied and removed after.

The tool is bubblewrap (``bwrap``, Debian/Ubuntu package ``bubblewrap``). :func:`status` says whether
it works here and what it enforces; :func:`require` raises :class:`SandboxUnavailable` with the reason
and the install step. ``autograde --unsafe-no-sandbox`` runs the same program without any of this.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: `sudo apt-get install bubblewrap`; Fedora: `sudo dnf install "
                "bubblewrap`), and allow unprivileged user namespaces (Ubuntu 24.04: `sudo sysctl "
                "kernel.apparmor_restrict_unprivileged_userns=0`); or grade with --unsafe-no-sandbox, "
                "which runs submissions without isolation")
SANDBOX_ROOT = "/sandbox"
WORK_DIR = SANDBOX_ROOT + "/work"      # the scratch folder: cwd and HOME
CACHE_DIR = SANDBOX_ROOT + "/cache"    # MINILLM_CACHE inside
RUNNER_DIR = SANDBOX_ROOT + "/runner"  # sandbox_runner.py and wire.py
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "alternatives", "passwd", "group",
             "nsswitch.conf", "hosts", "host.conf", "gai.conf", "mime.types", "ssl")
CACHE_SKIP = {"cpu_kernels"}           # the C kernels stay off in the sandbox (they hold lever implementations)


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be made on this machine (the message says why and what to install)."""


@dataclasses.dataclass
class Limits:
    cpu_s: int = 7200                 # CPU seconds per process
    memory_bytes: int = 16 << 30      # the tree's memory (cgroup), else each process's address space x 4
    file_bytes: int = 4 << 30         # largest file a process may write
    processes: int = 256              # processes and threads of the tree (cgroup pids.max), else RLIMIT_NPROC above the user's own


def default_limits(jobs: int = 1) -> Limits:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 16 << 30
    memory = max(4 << 30, min(16 << 30, int(total * 0.6 / max(1, jobs))))
    return Limits(memory_bytes=memory)


# --------------------------------------------------------------------------- cgroups
class Cgroup:
    """One cgroup per sandbox (v2 under this process's own cgroup when it is delegated to us; v1
    pids + memory as root): memory and process limits for the whole tree, and a kill of all of it."""

    def __init__(self, paths: list[Path], version: int):
        self.paths, self.version = paths, version

    @classmethod
    def create(cls, name: str, limits: Limits) -> "Cgroup | None":
        for make in (cls._v2, cls._v1):
            try:
                group = make(name, limits)
            except OSError:
                group = None
            if group is not None:
                return group
        return None

    @classmethod
    def _v2(cls, name: str, limits: Limits) -> "Cgroup | None":
        root = Path("/sys/fs/cgroup")
        if not (root / "cgroup.controllers").is_file():
            return None
        own = next((line.split("::", 1)[1] for line in Path("/proc/self/cgroup").read_text().splitlines()
                    if line.startswith("0::")), None)
        if own is None:
            return None
        parent = root / own.lstrip("/")
        enabled = (parent / "cgroup.subtree_control").read_text().split()
        if "pids" not in enabled or "memory" not in enabled or not os.access(parent, os.W_OK):
            return None
        path = parent / name
        path.mkdir()
        (path / "pids.max").write_text(str(limits.processes))
        (path / "memory.max").write_text(str(limits.memory_bytes))
        (path / "memory.swap.max").write_text("0") if (path / "memory.swap.max").exists() else None
        return cls([path], 2)

    @classmethod
    def _v1(cls, name: str, limits: Limits) -> "Cgroup | None":
        pids, memory = Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/memory")
        if not (pids / "cgroup.procs").is_file() or not (memory / "cgroup.procs").is_file():
            return None
        if not os.access(pids, os.W_OK) or not os.access(memory, os.W_OK):
            return None
        made = []
        try:
            for root in (pids, memory):
                (root / name).mkdir()
                made.append(root / name)
            (pids / name / "pids.max").write_text(str(limits.processes))
            (memory / name / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
        except OSError:
            for path in made:
                path.rmdir()
            raise
        return cls(made, 1)

    def join(self) -> None:
        """Put the calling process in the group (the sandbox's first process, before it execs)."""
        for path in self.paths:
            (path / "cgroup.procs").write_text(str(os.getpid()))

    def pids(self) -> list[int]:
        found = set()
        for path in self.paths:
            try:
                found |= {int(p) for p in (path / "cgroup.procs").read_text().split()}
            except OSError:
                pass
        return sorted(found)

    def kill(self) -> None:
        """SIGKILL every process of the group until none is left, then remove the group."""
        if self.version == 2 and (self.paths[0] / "cgroup.kill").exists():
            try:
                (self.paths[0] / "cgroup.kill").write_text("1")
            except OSError:
                pass
        for _ in range(200):
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        for path in self.paths:
            for _ in range(100):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)

    def describe(self) -> str:
        return f"cgroup v{self.version}"


# --------------------------------------------------------------------------- the command
@dataclasses.dataclass
class Spec:
    """What one sandbox needs: the folders it sees and the program it runs."""

    scratch: Path                           # read-write: cwd and HOME
    runner_dir: Path                        # sandbox_runner.py + wire.py (+ _minillm_reference.py), read-only
    package_binds: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (host path, path inside), read-only
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    limits: Limits = dataclasses.field(default_factory=Limits)
    cache_root: Path | None = None          # the host's MINILLM_CACHE (its folders bound read-only)


def _python_dirs() -> list[str]:
    dirs = {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix), os.path.realpath(sys.exec_prefix)}
    executable = os.path.realpath(sys.executable)
    dirs.add(os.path.dirname(os.path.dirname(executable)))
    import site

    for user_site in [site.getusersitepackages()] if site.ENABLE_USER_SITE else []:
        if os.path.isdir(user_site):
            dirs.add(user_site)
    # keep the outermost ones
    ordered = sorted(dirs, key=len)
    kept = []
    for path in ordered:
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept) and not path.startswith("/usr/"):
            kept.append(path)
    return kept


def command(spec: Spec, argv: list[str]) -> list[str]:
    """The bwrap command line that runs ``argv`` in the sandbox ``spec`` describes."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap (`bwrap`) is not on PATH: " + INSTALL_HINT)
    args = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--hostname", "sandbox", "--clearenv"]
    args += ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/") / top
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    for name in ETC_FILES:
        if os.path.exists(f"/etc/{name}"):
            args += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    args += ["--ro-bind-try", "/sys", "/sys", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
             "--tmpfs", "/dev/shm"]
    for device in sorted(Path("/dev").glob("nvidia*")):  # a GPU, when the machine has one
        args += ["--dev-bind", str(device), str(device)]
    for path in _python_dirs():
        args += ["--ro-bind", path, path]
    for host, inside in spec.package_binds:  # after the Python dirs: these cover parts of them
        args += ["--ro-bind", str(host), str(inside)]
    args += ["--bind", str(spec.scratch), WORK_DIR, "--ro-bind", str(spec.runner_dir), RUNNER_DIR,
             "--dir", CACHE_DIR]
    if spec.cache_root is not None and Path(spec.cache_root).is_dir():
        for entry in sorted(Path(spec.cache_root).iterdir()):
            if entry.is_dir() and entry.name not in CACHE_SKIP:
                args += ["--ro-bind", str(entry), f"{CACHE_DIR}/{entry.name}"]
    env = {"HOME": WORK_DIR, "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "MINILLM_CACHE": CACHE_DIR,
           "MINILLM_CPU_KERNELS": "0", "PYTHONPATH": RUNNER_DIR, "PYTHONDONTWRITEBYTECODE": "1",
           "IPYTHONDIR": WORK_DIR + "/.ipython", "MPLCONFIGDIR": WORK_DIR + "/.matplotlib",
           "TRITON_CACHE_DIR": WORK_DIR + "/.triton", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONNOUSERSITE": "", **spec.env}
    for key, value in env.items():
        if value != "":
            args += ["--setenv", key, value]
    args += ["--chdir", WORK_DIR, "--", *argv]
    return args


# The sandbox's first process: join the cgroup, set the limits, become bwrap (a separate program,
# not a preexec_fn: the graded kernel has threads, and forking a threaded process is not safe).
_SHIM = """
import json, os, resource, sys
config = json.loads(sys.argv[1])
for procs in config["cgroup"]:
    with open(procs, "w") as handle:
        handle.write(str(os.getpid()))
limits = config["limits"]
resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 60))
resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"], limits["file_bytes"]))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if not config["cgroup"]:
    address = limits["memory_bytes"] * 4  # the address space is several times the resident memory
    resource.setrlimit(resource.RLIMIT_AS, (address, address))
    cap = config["nproc_base"] + limits["processes"]
    resource.setrlimit(resource.RLIMIT_NPROC, (cap, cap))
os.execv(sys.argv[2], sys.argv[2:])
"""


class Process:
    """A running sandbox: ``popen`` (bwrap), its cgroup; :meth:`kill` ends the whole tree."""

    def __init__(self, popen: subprocess.Popen, cgroup: Cgroup | None, unsafe: bool):
        self.popen, self.cgroup, self.unsafe = popen, cgroup, unsafe

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)  # unsafe mode: the runner's own session
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.popen.kill()
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self.cgroup is not None:
            self.cgroup.kill()
            self.cgroup = None

    def leftover_pids(self) -> list[int]:
        return self.cgroup.pids() if self.cgroup is not None else []


_COUNTER = [0]


def start(spec: Spec, argv: list[str], pass_fds: tuple[int, ...], log_path: Path, unsafe: bool = False) -> Process:
    """Start ``argv`` in the sandbox (or, ``unsafe``, as a plain process in ``spec.scratch``)."""
    _COUNTER[0] += 1
    log = open(log_path, "ab")
    try:
        if unsafe:
            env = {**os.environ, **spec.env, "PYTHONPATH": str(spec.runner_dir), "MINILLM_CPU_KERNELS": "0"}
            popen = subprocess.Popen(argv, cwd=spec.scratch, env=env, pass_fds=pass_fds, stdin=subprocess.DEVNULL,
                                     stdout=log, stderr=log, start_new_session=True)
            return Process(popen, None, True)
        run = os.environ.get("MINILLM_GRADING_RUN", "solo")  # the grader sweeps its run's groups at the end
        cgroup = Cgroup.create(f"minillm-grading-{run}-{os.getpid()}-{_COUNTER[0]}", spec.limits)
        config = {"cgroup": [str(path / "cgroup.procs") for path in cgroup.paths] if cgroup else [],
                  "limits": dataclasses.asdict(spec.limits), "nproc_base": _user_processes() if cgroup is None else 0}
        shim = [sys.executable, "-S", "-c", _SHIM, json.dumps(config)]
        popen = subprocess.Popen(shim + command(spec, argv), pass_fds=pass_fds, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=log, start_new_session=True, env={})
        return Process(popen, cgroup, False)
    finally:
        log.close()


def _user_processes() -> int:
    """Processes and threads of this user now (RLIMIT_NPROC counts them all, not only the sandbox's)."""
    uid, count = os.getuid(), 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry}/task"))
            except OSError:
                continue
    return count


# --------------------------------------------------------------------------- can we?
@dataclasses.dataclass
class Status:
    available: bool
    reason: str              # why not, when not available
    isolation: str           # what is enforced, in words


@functools.lru_cache(maxsize=1)
def status() -> Status:
    """Try the sandbox once: bwrap runs, the network is gone, the limits hold."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return Status(False, "bubblewrap (`bwrap`) is not installed: " + INSTALL_HINT, "")
    probe = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr",
             *sum((["--symlink", os.readlink(f"/{t}"), f"/{t}"] if Path(f"/{t}").is_symlink()
                   else ["--ro-bind", f"/{t}", f"/{t}"] for t in ("bin", "lib", "lib64") if Path(f"/{t}").exists()), []),
             "--proc", "/proc", "--dev", "/dev", "--", "/bin/sh", "-c",
             "test ! -e /etc/hostname && test \"$(cat /proc/net/dev | wc -l)\" -le 3 && echo ok"]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return Status(False, f"bubblewrap could not start: {error}; " + INSTALL_HINT, "")
    if done.returncode != 0 or done.stdout.strip() != "ok":
        why = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}")[-300:]
        return Status(False, f"bubblewrap cannot make a sandbox here ({why}); " + INSTALL_HINT, "")
    group = Cgroup.create(f"minillm-grading-probe-{os.getpid()}", Limits())
    if group is not None:
        limits = f"{group.describe()} (memory, processes), setrlimit (CPU time, file size)"
        group.kill()
    elif os.getuid() == 0:
        return Status(False, "running as root without a writable cgroup: RLIMIT_NPROC does not bind root, so the "
                             "sandbox could not limit its processes; grade as an ordinary user, or give this process "
                             "a cgroup (systemd-run --scope, or a writable /sys/fs/cgroup)", "")
    else:
        limits = "setrlimit (address space, processes, CPU time, file size)"
    return Status(True, "", f"bubblewrap {_bwrap_version(bwrap)}: user, PID, network, IPC and mount namespaces, "
                            f"no capabilities; {limits}")


def _bwrap_version(bwrap: str) -> str:
    try:
        return subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10).stdout.split()[-1]
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return "?"


def require() -> Status:
    found = status()
    if not found.available:
        raise SandboxUnavailable(f"autograde needs a sandbox for the submissions and none can be made: {found.reason}")
    return found
