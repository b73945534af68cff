"""A minillm class on this machine: Unix accounts, nbgrader's exchange, the instructor's course, and JupyterHub.

``make class`` runs ``python -m grading.hub.classroom`` as root: it creates (or keeps) an instructor and two
students as Unix users with fresh passwords, the exchange (a sticky folder every account writes, whose course
folder belongs to the instructor), the class-wide Jupyter config every server reads (nbgrader's exchange and
course id; the formgrader off), the instructor's course (a copy of this repository in their home, which stays
unreadable to others, with the formgrader on in their own ~/.jupyter), the default model in each account's
cache, and then runs JupyterHub (grading/hub/jupyterhub_config.py) on 127.0.0.1 until Ctrl-C.
``--remove`` deletes the accounts, their homes, the course's exchange folder and the hub's state instead.

tests/test_hub.py runs the instructor's loop through the same functions on accounts of its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pwd
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
HUB_CONFIG = Path(__file__).with_name("jupyterhub_config.py")
COURSE_ID = "minillm"             # as in grading/nbgrader_config.py
COURSE_FOLDER = "minillm"         # ~instructor/minillm: the instructor's copy of the repository
FORMGRADER = "nbgrader.server_extensions.formgrader"
INSTRUCTOR_LAB_PLUGINS = ("@jupyter/nbgrader:formgrader", "@jupyter/nbgrader:create-assignment")
DEFAULT_INSTRUCTOR = "mlinstructor"
DEFAULT_STUDENTS = ("mlstudent1", "mlstudent2")


@dataclasses.dataclass
class Classroom:
    """One class: its accounts, where the hub keeps its state, the exchange, and the ports on 127.0.0.1."""

    instructor: str = DEFAULT_INSTRUCTOR
    students: tuple[str, ...] = DEFAULT_STUDENTS
    state: Path = Path("/srv/minillm/hub")         # hub database, cookie secret, class.json, the class-wide config
    exchange: Path = Path("/srv/nbgrader/exchange")
    port: int = 8000
    hub_port: int = 8081
    proxy_api_port: int = 8001

    @property
    def accounts(self) -> list[str]:
        return [self.instructor, *self.students]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def class_file(self) -> Path:
        return self.state / "class.json"

    @property
    def private_dir(self) -> Path:
        """root's alone (0700): the hub's database, cookie secret, proxy pid file and log."""
        return self.state / "hub"

    @property
    def jupyter_config_dir(self) -> Path:
        """The class-wide Jupyter config (the role of /etc/jupyter): every account's server reads it."""
        return self.state / "jupyter"

    @staticmethod
    def home(user: str) -> Path:
        return Path(pwd.getpwnam(user).pw_dir)

    @property
    def course_dir(self) -> Path:
        return self.home(self.instructor) / COURSE_FOLDER / "grading"


# --------------------------------------------------------------------------- accounts
def _run(command: list[str], input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(command, input=input, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed (exit {done.returncode}): {done.stdout}{done.stderr}")
    return done


def account_exists(user: str) -> bool:
    try:
        pwd.getpwnam(user)
    except KeyError:
        return False
    return True


def create_account(user: str, password: str) -> Path:
    """A Unix user with a home only they can read, and this password (PAM logs them in to the hub)."""
    if not account_exists(user):
        _run(["useradd", "--create-home", "--shell", "/bin/bash", "--comment", "minillm class", user])
    home = Classroom.home(user)
    home.chmod(0o700)
    _run(["chpasswd"], input=f"{user}:{password}\n")
    return home


def processes_of(uid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    found.append(int(entry))
            except OSError:
                pass
    return found


def end_processes_of(user: str, timeout_s: float = 10) -> None:
    """SIGTERM, then SIGKILL, each process that runs as ``user`` (their server, kernels, grading sandboxes)."""
    uid = pwd.getpwnam(user).pw_uid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in processes_of(uid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        while processes_of(uid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not processes_of(uid):
            return


def remove_account(user: str) -> None:
    """End the user's processes, then delete the user and their home."""
    if not account_exists(user):
        return
    home = Classroom.home(user)
    end_processes_of(user)
    _run(["userdel", "--remove", user], check=False)  # also its mail spool; warns when there is none
    if home.is_dir() and home != Path("/"):
        shutil.rmtree(home, ignore_errors=True)


# --------------------------------------------------------------------------- the interpreter every account runs
def _interpreter_paths() -> list[Path]:
    paths = [Path(os.path.realpath(sys.executable)), Path(os.path.realpath(sys.prefix))]
    spec = importlib.util.find_spec("minillm")
    if spec is not None and spec.origin:
        paths.append(Path(os.path.realpath(spec.origin)).parent)
    return paths


def interpreter_blockers() -> list[Path]:
    """Folders above the course's venv, its base interpreter or the minillm package that other accounts
    cannot enter (a venv made from an interpreter under root's home, mode 700, runs for root alone)."""
    blocked: list[Path] = []
    for path in _interpreter_paths():
        for folder in reversed(path.parents):
            if folder.is_dir() and not folder.stat().st_mode & stat.S_IXOTH and folder not in blocked:
                blocked.append(folder)
    return blocked


def open_for_accounts(folders: list[Path]) -> list[tuple[Path, int]]:
    """Let every account enter (not list) each folder: chmod o+x. Returns the old modes for :func:`restore_modes`."""
    changed = []
    for folder in folders:
        mode = stat.S_IMODE(folder.stat().st_mode)
        folder.chmod(mode | stat.S_IXOTH)
        changed.append((folder, mode))
    return changed


def restore_modes(changed: list[tuple[Path, int]]) -> None:
    for folder, mode in reversed(changed):
        try:
            folder.chmod(mode)
        except OSError:
            pass


def check_interpreter(user: str) -> None:
    """Raise unless ``user`` can run the course's Python with JupyterHub, nbgrader and minillm."""
    done = subprocess.run(["runuser", "-u", user, "--", sys.executable, "-c", "import jupyterhub, nbgrader, minillm"],
                          capture_output=True, text=True, cwd="/")
    if done.returncode != 0:
        raise RuntimeError(f"{user} cannot run {sys.executable} with jupyterhub, nbgrader and minillm: "
                           f"{(done.stdout + done.stderr).strip()[-600:]}")


# --------------------------------------------------------------------------- the exchange and the class config
def make_exchange(room: Classroom) -> Path:
    """nbgrader's exchange: a sticky folder every account writes (``install -d -m 1777``), and the course's own
    folder in it made now for the instructor (0755), so that no other account can take its name first."""
    room.exchange.parent.mkdir(parents=True, exist_ok=True)
    room.exchange.mkdir(exist_ok=True)
    os.chown(room.exchange, 0, 0)
    room.exchange.chmod(0o1777)
    course = room.exchange / COURSE_ID
    instructor = pwd.getpwnam(room.instructor)
    if not course.exists():
        course.mkdir()
        os.chown(course, instructor.pw_uid, instructor.pw_gid)
        course.chmod(0o755)
    elif course.is_symlink() or course.stat().st_uid != instructor.pw_uid:
        raise RuntimeError(f"{course} exists and is not {room.instructor}'s: remove it (another account made it)")
    return course


def write_class_config(room: Classroom) -> None:
    """class.json for jupyterhub_config.py, and the class-wide Jupyter config every server reads."""
    room.state.mkdir(parents=True, exist_ok=True)
    room.state.chmod(0o755)
    room.class_file.write_text(json.dumps({
        "state": str(room.state), "instructor": room.instructor, "students": list(room.students),
        "port": room.port, "hub_port": room.hub_port, "proxy_api_port": room.proxy_api_port,
    }, indent=2) + "\n")
    config = room.jupyter_config_dir
    files = {
        config / "nbgrader_config.py": (
            "c = get_config()  # noqa: F821\n"
            f"c.Exchange.root = {str(room.exchange)!r}\n"
            f"c.CourseDirectory.course_id = {COURSE_ID!r}\n"),
        config / "jupyter_server_config.d" / "minillm-class.json": json.dumps(
            {"ServerApp": {"jpserver_extensions": {FORMGRADER: False}}}, indent=2) + "\n",
        config / "labconfig" / "page_config.json": json.dumps(
            {"disabledExtensions": {plugin: True for plugin in INSTRUCTOR_LAB_PLUGINS}}, indent=2) + "\n",
    }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder, dirs, names in os.walk(config):
        Path(folder).chmod(0o755)
        for name in names:
            Path(folder, name).chmod(0o644)
    room.private_dir.mkdir(exist_ok=True)
    room.private_dir.chmod(0o700)


# --------------------------------------------------------------------------- the instructor's course
def repository_files(repo: Path) -> list[Path]:
    """The repository's files (tracked, and new ones git does not ignore): what a clone would hold."""
    if (repo / ".git").exists() and shutil.which("git"):
        command = ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
        listed = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        return sorted({Path(name) for name in listed.split("\0") if name and (repo / name).is_file()})
    skip = {".git", ".venv", "__pycache__", "artifacts", ".cache"}
    return sorted(path.relative_to(repo) for path in repo.rglob("*")
                  if path.is_file() and not skip & set(path.relative_to(repo).parts))


def _chown_tree(path: Path, user: str) -> None:
    entry = pwd.getpwnam(user)
    os.chown(path, entry.pw_uid, entry.pw_gid)
    for folder, dirs, names in os.walk(path):
        for name in dirs + names:
            os.chown(os.path.join(folder, name), entry.pw_uid, entry.pw_gid, follow_symlinks=False)


def install_course(room: Classroom, repo: Path = REPO_ROOT, refresh: bool = False) -> Path:
    """The instructor's copy of the repository in their home (the course directory is its grading/), and their
    ~/.jupyter: the course's nbgrader config for every nbgrader command and the formgrader, which is on for
    them alone. An existing copy (its gradebook, its submissions) is kept unless ``refresh``."""
    home = room.home(room.instructor)
    clone = home / COURSE_FOLDER
    if refresh and clone.exists():
        shutil.rmtree(clone)
    if not clone.exists():
        for relative in repository_files(repo):
            target = clone / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo / relative, target)
    jupyter = home / ".jupyter"
    course_config = clone / "grading" / "nbgrader_config.py"
    files = {
        jupyter / "nbgrader_config.py": (
            "c = get_config()  # noqa: F821\n"
            "# the course: its folder and gradebook, the release without model answers, the owner check at collect\n"
            f"load_subconfig({str(course_config)!r})  # noqa: F821\n"),
        jupyter / "jupyter_server_config.d" / "minillm-instructor.json": json.dumps(
            {"ServerApp": {"jpserver_extensions": {FORMGRADER: True}}}, indent=2) + "\n",
        jupyter / "labconfig" / "page_config.json": json.dumps(
            {"disabledExtensions": {plugin: False for plugin in INSTRUCTOR_LAB_PLUGINS}}, indent=2) + "\n",
    }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    _chown_tree(clone, room.instructor)
    _chown_tree(jupyter, room.instructor)
    home.chmod(0o700)  # the masters hold the solutions and the hidden tests
    return clone / "grading"


def seed_models(users: list[str]) -> list[str]:
    """Copy the default model this account converted (``make model``) into each user's cache, where it is
    missing; without it an account converts it once, on first use. Returns the model folders copied."""
    from minillm.config import cache_root

    source = cache_root() / "models"
    copied = []
    if not source.is_dir():
        return copied
    for user in users:
        models = Classroom.home(user) / ".cache" / "minillm" / "models"
        for model in sorted(p for p in source.iterdir() if p.is_dir()):
            if not (models / model.name).exists():
                models.mkdir(parents=True, exist_ok=True)
                shutil.copytree(model, models / model.name)
                copied.append(f"{user}: {model.name}")
        _chown_tree(Classroom.home(user) / ".cache", user)
    return copied


def setup(room: Classroom, passwords: dict[str, str], repo: Path = REPO_ROOT, refresh_course: bool = False,
          models_for: list[str] | None = None) -> None:
    """Everything but the hub itself: accounts, the exchange, the class-wide config, the instructor's course."""
    if os.geteuid() != 0:
        raise PermissionError("a class needs root: it creates Unix users and the exchange")
    for user in room.accounts:
        create_account(user, passwords[user])
    make_exchange(room)
    write_class_config(room)
    install_course(room, repo, refresh=refresh_course)
    seed_models(room.accounts if models_for is None else models_for)


# --------------------------------------------------------------------------- the hub
def missing_tools() -> list[str]:
    missing = []
    if importlib.util.find_spec("jupyterhub") is None:
        missing.append("jupyterhub (pip)")
    if shutil.which("configurable-http-proxy") is None:
        missing.append("configurable-http-proxy (npm)")
    if shutil.which("bwrap") is None:
        missing.append("bubblewrap (apt; grading's sandbox)")
    return missing


def start_hub(room: Classroom, log_path: Path, api_token: str | None = None) -> subprocess.Popen:
    """``jupyterhub -f grading/hub/jupyterhub_config.py`` as root (it starts each account's server as that user)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("JUPYTER", "MINILLM_"))}
    env.update(MINILLM_CLASS=str(room.class_file),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "/usr/bin:/bin")]))
    if api_token:
        env["MINILLM_HUB_API_TOKEN"] = api_token
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", str(HUB_CONFIG)], cwd=room.private_dir,
                                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def wait_for_hub(room: Classroom, hub: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if hub.poll() is not None:
            raise RuntimeError(f"JupyterHub exited with {hub.returncode} before answering")
        try:
            with urllib.request.urlopen(f"{room.url}/hub/api/", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise TimeoutError(f"JupyterHub did not answer on {room.url} in {timeout_s:.0f} s")


def stop_hub(hub: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM: the hub stops every account's server and its proxy, then exits; SIGKILL after ``timeout_s``."""
    if hub.poll() is None:
        hub.send_signal(signal.SIGTERM)
        try:
            hub.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            hub.kill()
            hub.wait()


def remove(room: Classroom) -> None:
    """Delete the accounts (their processes and homes), the course's exchange folder and the hub's state."""
    for user in room.accounts:
        remove_account(user)
    shutil.rmtree(room.exchange / COURSE_ID, ignore_errors=True)
    shutil.rmtree(room.state, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grading.hub.classroom", description=__doc__.split("\n")[0])
    parser.add_argument("--instructor", default=DEFAULT_INSTRUCTOR)
    parser.add_argument("--students", nargs="+", default=list(DEFAULT_STUDENTS))
    parser.add_argument("--port", type=int, default=8000, help="the hub's port on 127.0.0.1")
    parser.add_argument("--state", type=Path, default=Classroom.state)
    parser.add_argument("--exchange", type=Path, default=Classroom.exchange)
    parser.add_argument("--remove", action="store_true", help="delete the class's accounts, exchange folder and state")
    args = parser.parse_args(argv)
    room = Classroom(args.instructor, tuple(args.students), args.state, args.exchange, args.port,
                     hub_port=args.port + 81, proxy_api_port=args.port + 1)
    if os.geteuid() != 0:
        print("make class: run as root (it creates Unix users, the exchange and the hub's state).")
        return 1
    if args.remove:
        remove(room)
        print(f"make class: removed {', '.join(room.accounts)}, {room.exchange / COURSE_ID} and {room.state}")
        return 0
    missing = missing_tools()
    if missing:
        print(f"make class: missing {', '.join(missing)}: run `bash scripts/install_hub.sh` and "
              "`bash scripts/install_sandbox.sh` as root.")
        return 1
    def stop(signum, frame):  # Ctrl-C, or a supervisor's SIGTERM: stop the hub and undo the o+x below
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    passwords = {user: secrets.token_urlsafe(9) for user in room.accounts}
    setup(room, passwords)
    opened = open_for_accounts(interpreter_blockers())
    if opened:
        print("make class: every account may now enter " + ", ".join(str(path) for path, _ in opened)
              + f" (o+x), to run {sys.executable}; undone when the hub stops.")
    try:
        check_interpreter(room.students[0])
        hub = start_hub(room, room.private_dir / "jupyterhub.log")
        try:
            wait_for_hub(room, hub)
            print(f"\nminillm class on {room.url}  (hub log: {room.private_dir / 'jupyterhub.log'})\n")
            print(f"  {'account':<16} {'password':<16} role")
            for user in room.accounts:
                role = "instructor: formgrader at /user/%s/formgrader" % user if user == room.instructor else "student"
                print(f"  {user:<16} {passwords[user]:<16} {role}")
            print(f"\n  course directory: {room.course_dir}   exchange: {room.exchange}")
            print("  Ctrl-C stops the hub; the accounts and their work stay "
                  "(`python -m grading.hub.classroom --remove` deletes them).\n", flush=True)
            hub.wait()
        except KeyboardInterrupt:
            pass
        finally:
            stop_hub(hub)
    finally:
        restore_modes(opened)
    return 0


if __name__ == "__main__":
    sys.exit(main())
