"""The sandbox a submission runs in: bubblewrap namespaces, resource limits, one process tree that dies whole.

A graded notebook's student code runs in a process tree that

- sees the system's /usr, the Python installation and its installed packages, read-only, and the model
  cache, read-only: no course folder, gradebook, masters, solutions or repository (an editable install's
  package is bound alone, as the copy grading.references prepared for the lab);
- writes only to its own disk: one tmpfs of ``Limits.disk_bytes`` (its working directory and HOME, with a
  copy of the files of its scratch folder, the submission's notebook; ``/tmp`` is a folder of it) and a
  tmpfs of a quarter of that at ``/dev/shm``. Nothing else is writable (``/`` and ``/dev`` are remounted
  read-only), so a file without end stops at ENOSPC (or EFBIG, ``RLIMIT_FSIZE``) in the submission, never
  on the host; the tmpfs vanish with the sandbox's mount namespace, a restarted sandbox starts from its
  notebook again;
- has no network (its own network namespace: only its own loopback), its own PID, IPC, UTS and
  user namespaces, and no capabilities;
- is limited in memory, processes and CPU: a cgroup (v2 delegated to this user, or v1 as root) where one
  can be made, holding the tree's memory (``memory_bytes``, plus its tmpfs, whose pages it is charged),
  its processes (``processes``) and its share of the cores (``cpus``: a CFS quota and a weight, so that
  ``--jobs`` neighbours keep their pace whatever it spins); and by ``setrlimit`` for each process: CPU
  time, file size, address space (``RLIMIT_AS``, not where a GPU is bound: CUDA maps its devices into
  every process), and, without a cgroup, ``RLIMIT_NPROC``;
- writes its own output (stdout and stderr of everything in it) to the grader's log through a pump in
  its cgroup that keeps the log under ``log_bytes`` (its first half, a line that says output was
  dropped, its last part);
- dies whole: its first process is the PID namespace's init, which bubblewrap kills when the grader
  does (``--die-with-parent``), and the kernel then kills every process of the namespace, detached
  or not; the cgroup is emptied and removed after.

The tool is bubblewrap (``bwrap``, Debian/Ubuntu package ``bubblewrap``; ``--size``, which caps a tmpfs,
needs 0.8). :func:`status` says whether it works here and what it enforces (and what not);
:func:`require` raises :class:`SandboxUnavailable` with the reason and the install step.
``autograde --unsafe-no-sandbox`` runs the same program without any of this. :func:`read_tail` reads
the end of a log that may be large, without reading the rest.
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
DISK_DIR = SANDBOX_ROOT + "/disk"      # the sandbox's one writable tmpfs (Limits.disk_bytes) ...
WORK_DIR = DISK_DIR + "/work"          # ... its working directory and HOME (the scratch folder's files copied in)
TMP_DIR = DISK_DIR + "/tmp"            # ... and /tmp (a symlink to this)
CACHE_DIR = SANDBOX_ROOT + "/cache"    # MINILLM_CACHE inside
RUNNER_DIR = SANDBOX_ROOT + "/runner"  # sandbox_runner.py and wire.py
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "alternatives", "passwd", "group",
             "nsswitch.conf", "hosts", "host.conf", "gai.conf", "mime.types", "ssl")
CACHE_SKIP = {"cpu_kernels"}           # the C kernels stay off in the sandbox (they hold lever implementations)


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be made on this machine (the message says why and what to install)."""


@dataclasses.dataclass
class Limits:
    """What one sandbox may use. Every field crosses to the graded kernel as JSON (grader -> remote)."""

    cpu_s: int = 7200                 # CPU seconds per process (RLIMIT_CPU)
    memory_bytes: int = 16 << 30      # the tree's memory (cgroup: this plus its tmpfs); without a cgroup, address space only
    file_bytes: int = 4 << 30         # largest file a process may write (RLIMIT_FSIZE)
    processes: int = 256              # processes and threads of the tree (cgroup pids.max), else RLIMIT_NPROC above the user's own
    disk_bytes: int = 2 << 30         # the work dir, HOME and /tmp together (one tmpfs); /dev/shm gets a quarter of it more
    cpus: float | None = None         # cores the tree may use at once (cgroup CPU quota and weight); None: this machine's cores
    address_bytes: int | None = None  # each process's address space (RLIMIT_AS); None: 4x memory_bytes; 0: none. Never where a GPU is bound
    log_bytes: int = 16 << 20         # the sandbox's own output kept in its log (its first half and its last part)

    def shm_bytes(self) -> int:
        """The size of /dev/shm (a tmpfs of its own)."""
        return max(1 << 20, self.disk_bytes // 4)

    def charged_bytes(self) -> int:
        """The cgroup's memory limit: the tree's memory and its tmpfs pages, which the kernel charges to it."""
        return self.memory_bytes + self.disk_bytes + self.shm_bytes()

    def address_limit(self) -> int:
        """RLIMIT_AS for each process, 0 for none (a GPU bound in: CUDA reserves far more address space than memory)."""
        if _gpu_devices():
            return 0
        return self.memory_bytes * 4 if self.address_bytes is None else max(0, int(self.address_bytes))

    def cores(self) -> float:
        """The cores the tree may use at once."""
        return float(self.cpus) if self.cpus else float(_cores())


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _gpu_devices() -> list[Path]:
    return sorted(Path("/dev").glob("nvidia*"))


def default_limits(jobs: int = 1) -> Limits:
    """The limits of a sandbox when ``jobs`` notebooks are graded at once: 60% of the machine's memory over
    the jobs (4-16 GiB), a 2 GiB disk, and the job's share of the cores (as many as its OMP threads)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 16 << 30
    jobs = max(1, int(jobs))
    memory = max(4 << 30, min(16 << 30, int(total * 0.6 / jobs)))
    return Limits(memory_bytes=memory, cpus=float(max(1, _cores() // jobs)))


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


# --------------------------------------------------------------------------- cgroups
class Cgroup:
    """One cgroup per sandbox (v2 under this process's own cgroup when it is delegated to us; v1 pids +
    memory, and cpu where that controller is there, as root): memory, process and CPU limits for the whole
    tree, what of them it reached, and a kill of all of it."""

    CPU_PERIOD_US = 100_000

    def __init__(self, paths: list[Path], version: int, controllers: dict[str, Path] | None = None,
                 limits: Limits | None = None):
        self.paths, self.version = paths, version
        self.controllers = controllers or {}   # "pids" / "memory" / "cpu" -> the folder that holds its files
        self.limits = limits

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

    @staticmethod
    def _cpu_values(limits: Limits) -> tuple[int, int]:
        """(quota in microseconds per CPU_PERIOD_US, weight relative to 1 core's 1024) for ``limits.cpus``."""
        cores = limits.cores()
        return max(1000, int(cores * Cgroup.CPU_PERIOD_US)), max(2, int(1024 * cores))

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
        try:
            (path / "pids.max").write_text(str(limits.processes))
            (path / "memory.max").write_text(str(limits.charged_bytes()))
            if (path / "memory.swap.max").exists():
                (path / "memory.swap.max").write_text("0")
            controllers = {"pids": path, "memory": path}
            if "cpu" in enabled and (path / "cpu.max").exists():
                quota, weight = cls._cpu_values(limits)
                (path / "cpu.max").write_text(f"{quota} {cls.CPU_PERIOD_US}")
                (path / "cpu.weight").write_text(str(max(1, min(10000, weight * 100 // 1024))))
                controllers["cpu"] = path
        except OSError:
            path.rmdir()
            raise
        return cls([path], 2, controllers, limits)

    @classmethod
    def _v1(cls, name: str, limits: Limits) -> "Cgroup | None":
        pids, memory, cpu = Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup/cpu")
        if not (pids / "cgroup.procs").is_file() or not (memory / "cgroup.procs").is_file():
            return None
        if not os.access(pids, os.W_OK) or not os.access(memory, os.W_OK):
            return None
        roots = [pids, memory]
        if (cpu / "cpu.cfs_quota_us").is_file() and os.access(cpu, os.W_OK):
            roots.append(cpu)
        made = []
        try:
            for root in roots:
                (root / name).mkdir()
                made.append(root / name)
            (pids / name / "pids.max").write_text(str(limits.processes))
            (memory / name / "memory.limit_in_bytes").write_text(str(limits.charged_bytes()))
            try:  # memory and swap together: no swapping past the limit (where swap is accounted)
                (memory / name / "memory.memsw.limit_in_bytes").write_text(str(limits.charged_bytes()))
            except OSError:
                pass
            controllers = {"pids": pids / name, "memory": memory / name}
            if cpu in roots:
                quota, shares = cls._cpu_values(limits)
                (cpu / name / "cpu.cfs_period_us").write_text(str(cls.CPU_PERIOD_US))
                (cpu / name / "cpu.cfs_quota_us").write_text(str(quota))
                (cpu / name / "cpu.shares").write_text(str(shares))
                controllers["cpu"] = cpu / name
        except OSError:
            for path in made:
                path.rmdir()
            raise
        return cls(made, 1, controllers, limits)

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

    def _counter(self, controller: str, filename: str, key: str) -> int:
        path = self.controllers.get(controller)
        try:
            for line in (path / filename).read_text().splitlines() if path is not None else ():
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def limits_hit(self) -> list[str]:
        """What of its limits the tree ran into, in words ("" when none): the kernel's counters."""
        hit = []
        limits = self.limits or Limits()
        oom = self._counter("memory", "memory.events" if self.version == 2 else "memory.oom_control", "oom_kill")
        if oom:
            hit.append(f"it ran out of memory: over its limit of {_gib(limits.charged_bytes())} (its memory and its disk), "
                       f"the kernel killed {oom} of its processes")
        refused = self._counter("pids", "pids.events", "max")
        if refused:
            hit.append(f"it reached its limit of {limits.processes} processes ({refused} forks refused)")
        return hit

    def cpu_settings(self) -> dict[str, str]:
        """The CPU cap as written in the group's files (empty where the cpu controller is not there)."""
        path = self.controllers.get("cpu")
        if path is None:
            return {}
        names = ("cpu.max", "cpu.weight") if self.version == 2 else ("cpu.cfs_period_us", "cpu.cfs_quota_us", "cpu.shares")
        return {name: (path / name).read_text().strip() for name in names}

    def kill(self, grace_s: float = 0.0) -> None:
        """SIGKILL every process of the group until none is left, then remove the group. ``grace_s``: first
        wait that long for the group to empty by itself (the log's pump ends when the sandbox is gone)."""
        deadline = time.monotonic() + grace_s
        while grace_s and self.pids() and time.monotonic() < deadline:
            time.sleep(0.01)
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
        limits = self.limits or Limits()
        parts = [f"memory {_gib(limits.charged_bytes())} ({_gib(limits.memory_bytes)} and its disk)",
                 f"{limits.processes} processes"]
        if "cpu" in self.controllers:
            parts.append(f"CPU {limits.cores():g} cores (a CFS quota of {self._cpu_values(limits)[0]} us per "
                         f"{self.CPU_PERIOD_US} us, and a weight)")
        return f"cgroup v{self.version} ({', '.join(parts)})"


# --------------------------------------------------------------------------- the command
@dataclasses.dataclass
class Spec:
    """What one sandbox needs: the folders it sees and the program it runs."""

    scratch: Path                           # its files are copied into the sandbox's disk (the unsafe mode's cwd)
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


@functools.lru_cache(maxsize=4)
def tmpfs_size_supported(bwrap: str | None = None) -> bool:
    """Whether this bwrap caps a tmpfs (``--size``, bubblewrap 0.8)."""
    bwrap = bwrap or shutil.which("bwrap")
    if bwrap is None:
        return False
    try:
        done = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--size" in done.stdout + done.stderr


def scratch_files(scratch: Path) -> list[Path]:
    """The files of the scratch folder that are copied into the sandbox's disk (regular files at its top)."""
    try:
        entries = sorted(Path(scratch).iterdir())
    except OSError:
        return []
    return [entry for entry in entries if entry.is_file() and not entry.is_symlink()]


def command(spec: Spec, argv: list[str], files: list[tuple[int, str]] = ()) -> list[str]:
    """The bwrap command line that runs ``argv`` in the sandbox ``spec`` describes; ``files``: (descriptor,
    name) of each file to copy into its working directory (the descriptors must reach bwrap)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap (`bwrap`) is not on PATH: " + INSTALL_HINT)
    limits = spec.limits
    sized = tmpfs_size_supported(bwrap)
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
    args += ["--ro-bind-try", "/sys", "/sys", "--proc", "/proc", "--dev", "/dev"]
    # The only writable places: /dev/shm, and one disk for the work dir, HOME and /tmp; both tmpfs, capped
    # (--size), their pages charged to the sandbox's memory cgroup, gone with its mount namespace.
    args += [*(["--size", str(limits.shm_bytes())] if sized else []), "--tmpfs", "/dev/shm"]
    args += [*(["--size", str(limits.disk_bytes)] if sized else []), "--tmpfs", DISK_DIR,
             "--dir", WORK_DIR, "--dir", TMP_DIR]
    inside = [*_python_dirs(), *(str(dest) for _, dest in spec.package_binds)]
    if any(path == "/tmp" or path.startswith("/tmp/") for path in inside):
        # The Python installation (a clone or venv under /tmp) is bound below /tmp: /tmp is then a capped tmpfs of
        # its own (a quarter of the disk, as /dev/shm), the bound folders mounted in it read-only.
        args += [*(["--size", str(limits.shm_bytes())] if sized else []), "--tmpfs", "/tmp"]
    else:
        args += ["--symlink", TMP_DIR, "/tmp"]
    for device in _gpu_devices():  # a GPU, when the machine has one
        args += ["--dev-bind", str(device), str(device)]
    for path in _python_dirs():
        args += ["--ro-bind", path, path]
    for host, inside in spec.package_binds:  # after the Python dirs: these cover parts of them
        args += ["--ro-bind", str(host), str(inside)]
    args += ["--ro-bind", str(spec.runner_dir), RUNNER_DIR, "--dir", CACHE_DIR]
    if spec.cache_root is not None and Path(spec.cache_root).is_dir():
        for entry in sorted(Path(spec.cache_root).iterdir()):
            if entry.is_dir() and entry.name not in CACHE_SKIP:
                args += ["--ro-bind", str(entry), f"{CACHE_DIR}/{entry.name}"]
    for fd, name in files:
        args += ["--file", str(fd), f"{WORK_DIR}/{name}"]
    args += ["--remount-ro", "/dev", "--remount-ro", "/"]  # bwrap's own tmpfs (the root, /dev): not a disk
    env = {"HOME": WORK_DIR, "TMPDIR": TMP_DIR, "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
           "MINILLM_CACHE": CACHE_DIR, "MINILLM_CPU_KERNELS": "0", "PYTHONPATH": RUNNER_DIR,
           "PYTHONDONTWRITEBYTECODE": "1", "IPYTHONDIR": WORK_DIR + "/.ipython", "MPLCONFIGDIR": WORK_DIR + "/.matplotlib",
           "TRITON_CACHE_DIR": WORK_DIR + "/.triton", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONNOUSERSITE": "", **spec.env}
    for key, value in env.items():
        if value != "":
            args += ["--setenv", key, value]
    args += ["--chdir", WORK_DIR, "--", *argv]
    return args


# The sandbox's first process: join the cgroup, start the log's pump, set the limits, become bwrap (a
# separate program, not a preexec_fn: the graded kernel has threads, and forking a threaded process is not
# safe). The pump is this process's child, in the cgroup (the CPU it spends copying is the sandbox's), outside
# the namespaces: it copies what the sandbox writes to stdout and stderr into the log, keeping the log under
# log_bytes: its first half, then a line that says output was dropped, then the latest part. It ends when
# every process of the sandbox has gone (the end of the pipe).
_SHIM = """
import json, os, resource, sys
config = json.loads(sys.argv[1])
for procs in config["cgroup"]:
    with open(procs, "w") as handle:
        handle.write(str(os.getpid()))
limits = config["limits"]


def pump(cap):
    head, keep = cap // 2, cap // 4
    mark = b"\\n[minillm grading: the sandbox wrote more than this log keeps; what follows is its latest output]\\n"
    size = os.lseek(1, 0, os.SEEK_END)
    while True:
        try:
            data = os.read(0, 1 << 16)
        except InterruptedError:
            continue
        if not data:
            return
        if size + len(data) <= cap or size < head:
            os.pwrite(1, data, size)
            size += len(data)
            continue
        start = max(head, size - keep)
        tail = (os.pread(1, size - start, start) + data)[-keep:]
        os.ftruncate(1, head)
        os.pwrite(1, mark + tail, head)
        size = head + len(mark) + len(tail)


if config["log"]:
    read, write = os.pipe()
    if os.fork() == 0:
        try:
            os.setpgid(0, 0)  # not in the sandbox's process group: it ends at the end of the pipe, not before
            os.dup2(read, 0)
            log = os.open(config["log"], os.O_RDWR | os.O_CREAT, 0o644)  # no O_APPEND: pwrite at an offset
            os.dup2(log, 1)
            os.closerange(2, 1 << 16)
            pump(max(1 << 20, int(config["log_bytes"])))
        finally:
            os._exit(0)
    os.dup2(write, 1)
    os.dup2(write, 2)
    os.close(read)
    os.close(write)
resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 60))
resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"], limits["file_bytes"]))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if config["address_bytes"]:  # each process's address space: several times the resident memory
    resource.setrlimit(resource.RLIMIT_AS, (config["address_bytes"], config["address_bytes"]))
if not config["cgroup"]:
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
            self.cgroup.kill(grace_s=0.5)  # the pump writes the last of the log and ends by itself
            self.cgroup = None

    def leftover_pids(self) -> list[int]:
        return self.cgroup.pids() if self.cgroup is not None else []

    def limits_hit(self) -> list[str]:
        """What of its limits the sandbox ran into, in words (its cgroup's counters; none without one)."""
        return self.cgroup.limits_hit() if self.cgroup is not None else []


_COUNTER = [0]


def start(spec: Spec, argv: list[str], pass_fds: tuple[int, ...], log_path: Path, unsafe: bool = False) -> Process:
    """Start ``argv`` in the sandbox (or, ``unsafe``, as a plain process in ``spec.scratch``)."""
    _COUNTER[0] += 1
    log = open(log_path, "ab")
    opened: list[int] = []
    try:
        if unsafe:
            env = {**os.environ, **spec.env, "PYTHONPATH": str(spec.runner_dir), "MINILLM_CPU_KERNELS": "0"}
            popen = subprocess.Popen(argv, cwd=spec.scratch, env=env, pass_fds=pass_fds, stdin=subprocess.DEVNULL,
                                     stdout=log, stderr=log, start_new_session=True)
            return Process(popen, None, True)
        files = []
        for path in scratch_files(spec.scratch):  # the notebook: copied into the sandbox's own disk
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            opened.append(fd)
            files.append((fd, path.name))
        run = os.environ.get("MINILLM_GRADING_RUN", "solo")  # the grader sweeps its run's groups at the end
        cgroup = Cgroup.create(f"minillm-grading-{run}-{os.getpid()}-{_COUNTER[0]}", spec.limits)
        config = {"cgroup": [str(path / "cgroup.procs") for path in cgroup.paths] if cgroup else [],
                  "limits": dataclasses.asdict(spec.limits), "nproc_base": _user_processes() if cgroup is None else 0,
                  "address_bytes": spec.limits.address_limit(),
                  "log": str(log_path) if spec.limits.log_bytes else "", "log_bytes": spec.limits.log_bytes}
        shim = [sys.executable, "-S", "-c", _SHIM, json.dumps(config)]
        try:
            popen = subprocess.Popen(shim + command(spec, argv, files), pass_fds=(*pass_fds, *opened),
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, env={})
        except BaseException:
            if cgroup is not None:
                cgroup.kill()
            raise
        return Process(popen, cgroup, False)
    finally:
        log.close()
        for fd in opened:
            os.close(fd)


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
    """Try the sandbox once: bwrap runs, the network is gone, a capped disk fills up, the limits hold. Its
    ``isolation`` says what is enforced, with the values of :func:`default_limits` (one job at a time), and
    what is not."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return Status(False, "bubblewrap (`bwrap`) is not installed: " + INSTALL_HINT, "")
    sized = tmpfs_size_supported(bwrap)
    probe = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr",
             *sum((["--symlink", os.readlink(f"/{t}"), f"/{t}"] if Path(f"/{t}").is_symlink()
                   else ["--ro-bind", f"/{t}", f"/{t}"] for t in ("bin", "lib", "lib64") if Path(f"/{t}").exists()), []),
             "--proc", "/proc", "--dev", "/dev", *(["--size", str(1 << 20)] if sized else []), "--tmpfs", "/tmp",
             "--remount-ro", "/", "--", "/bin/sh", "-c",
             "test ! -e /etc/hostname && test \"$(cat /proc/net/dev | wc -l)\" -le 3 && ! touch /written 2>/dev/null "
             "&& { head -c 2097152 /dev/zero > /tmp/fill; test \"$(wc -c < /tmp/fill)\" -le 1048576 && echo capped; "
             "echo ok; }"]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return Status(False, f"bubblewrap could not start: {error}; " + INSTALL_HINT, "")
    lines = done.stdout.split()
    if done.returncode != 0 or "ok" not in lines:
        why = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}")[-300:]
        return Status(False, f"bubblewrap cannot make a sandbox here ({why}); " + INSTALL_HINT, "")
    limits = default_limits(1)
    version = _bwrap_version(bwrap)
    missing = []
    if "capped" in lines:
        disk = (f"disk: a tmpfs of {_gib(limits.disk_bytes)} (work dir, HOME, /tmp) and {_gib(limits.shm_bytes())} "
                "(/dev/shm), nothing else writable")
    else:
        disk = "disk: tmpfs (work dir, HOME, /tmp, /dev/shm), nothing else writable"
        missing.append(f"disk size: bubblewrap {version} has no --size (0.8 has), so its tmpfs are bounded by the "
                       "memory limit only")
    group = Cgroup.create(f"minillm-grading-probe-{os.getpid()}", limits)
    if group is not None:
        enforced = group.describe()
        if "cpu" not in group.controllers:
            missing.append("CPU share: the cgroup has no cpu controller here, a sandbox may use every core")
        group.kill()
    elif os.getuid() == 0:
        return Status(False, "running as root without a writable cgroup: RLIMIT_NPROC does not bind root, so the "
                             "sandbox could not limit its processes; grade as an ordinary user, or give this process "
                             "a cgroup (systemd-run --scope, or a writable /sys/fs/cgroup)", "")
    else:
        enforced = f"setrlimit (processes: {limits.processes} above this user's own)"
        missing.append("memory of the whole tree (no cgroup: each process's address space only)")
        missing.append("CPU share (no cgroup: a sandbox may use every core)")
    address = limits.address_limit()
    rlimits = (f"setrlimit per process (CPU time {limits.cpu_s} s, file size {_gib(limits.file_bytes)}"
               + (f", address space {_gib(address)})" if address else ")"))
    if not address:
        missing.append("address space: a GPU is bound in, and CUDA maps far more than memory")
    isolation = (f"bubblewrap {version}: user, PID, network, IPC and mount namespaces, no capabilities; {enforced}; "
                 f"{rlimits}; {disk}; its output kept to {_gib(limits.log_bytes)} of log")
    if missing:
        isolation += "; not enforced: " + "; ".join(missing)
    return Status(True, "", isolation)


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


def read_tail(path: Path | str, max_bytes: int) -> str:
    """The last ``max_bytes`` of the file at ``path`` as text (UTF-8, bad bytes replaced; a character cut at
    the start dropped), read from there: a log of any size costs ``max_bytes`` of memory. "" when there is
    no such file."""
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            start = max(0, size - max(0, int(max_bytes)))
            handle.seek(start)
            data = handle.read(size - start)
    except (FileNotFoundError, IsADirectoryError):
        return ""
    if start:
        skip = 0
        while skip < min(3, len(data)) and data[skip] & 0xC0 == 0x80:  # continuation bytes of a cut character
            skip += 1
        data = data[skip:]
    return data.decode("utf-8", errors="replace")
