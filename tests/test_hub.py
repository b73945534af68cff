"""The instructor's loop on a real JupyterHub (grading/README.md, "A class on JupyterHub"): a hub on 127.0.0.1 with
an instructor and two students as Unix users (PAM logins, each server run as its own user by LocalProcessSpawner),
nbgrader's exchange, and lab 02:

- the instructor releases the lab (a kernel in their own server runs `nbgrader generate_assignment` and
  `release_assignment` in their course directory, a copy of this repository in their home);
- both students fetch it through the Assignments tab's REST handlers in their servers; one saves the solution cells
  of solutions/02_kv_cache.ipynb into their copy through the contents API (as JupyterLab saves), the other leaves it;
  both submit through the same handlers;
- the second student then tries twice to cheat from a kernel in their server: `nbgrader submit --student <the
  other>` (their untouched notebook under the solver's name, the newest submission), and a submission folder of
  their own made by hand whose notebook is a symbolic link to the instructor's master;
- the instructor collects (grading/course.py refuses both, naming the claimed student and the real owner),
  autogrades in the sandbox as themselves (`python autograde.py submitted ...`), releases feedback, and each
  student fetches their own page;
- the formgrader's page loads in headless Chromium for the instructor, logged in through the hub.

Slow (4 to 7 minutes on 2 shared cores, most of it grading the two notebooks) and root only: it creates Unix users (removed at the end,
failure or not) and installs what it needs with scripts/install_hub.sh and scripts/install_sandbox.sh.
"""

from __future__ import annotations

import csv
import html
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import nbformat
import pytest

from grading.hub import classroom
from grading.hub.classroom import Classroom

REPO_ROOT = Path(__file__).resolve().parents[1]
LAB = "02_kv_cache"
COURSE_ID = classroom.COURSE_ID
CHROMIUM = Path("/usr/bin/chromium")
STEP_TIMEOUT_S = 300
GRADING_TIMEOUT_S = 1200  # two notebooks of lab 02, one after the other: about 4 minutes on 2 busy cores

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _why_not_here() -> str | None:
    """The reason to skip, after trying to install what is missing; None when the class can run here."""
    if os.geteuid() != 0:
        return "needs root: the class creates Unix users, the exchange and the hub (run as root, or `make class`)"
    env = {**os.environ, "PYTHON": sys.executable}
    for script in ("install_hub.sh", "install_sandbox.sh"):
        subprocess.run(["bash", str(REPO_ROOT / "scripts" / script)], env=env, capture_output=True, timeout=900)
    missing = classroom.missing_tools()
    if missing:
        return (f"missing {', '.join(missing)}: `bash scripts/install_hub.sh` and `bash scripts/install_sandbox.sh` "
                "could not install them here")
    return None


class HubClient:
    """The hub's REST API and each account's server behind it, with a service token that may use every server."""

    def __init__(self, url: str, token: str):
        import requests

        self.url, self.token = url, token
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"token {token}"

    def hub(self, method: str, path: str, **kwargs):
        return self.session.request(method, f"{self.url}/hub/api{path}", timeout=60, **kwargs)

    def start_server(self, user: str, timeout_s: float = 300) -> None:
        response = self.hub("POST", f"/users/{user}/server")
        assert response.status_code in (201, 202), f"starting {user}'s server: {response.status_code} {response.text}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            server = self.hub("GET", f"/users/{user}").json().get("servers", {}).get("")
            if server and server.get("ready"):
                return
            time.sleep(1)
        raise TimeoutError(f"{user}'s server did not start in {timeout_s:.0f} s")

    def server(self, user: str, method: str, path: str, timeout: float = STEP_TIMEOUT_S, **kwargs):
        """A request to ``user``'s own Jupyter server, through the hub's proxy."""
        return self.session.request(method, f"{self.url}/user/{user}{path}", timeout=timeout, **kwargs)

    def assignments(self, user: str, action: str) -> dict:
        """What the Assignments tab of JupyterLab does: POST /assignments/<fetch|submit|fetch_feedback>."""
        body = {"course_id": COURSE_ID, "assignment_id": LAB}
        response = self.server(user, "POST", f"/assignments/{action}", json=body)
        assert response.status_code == 200, f"{user}: {action} answered {response.status_code}: {response.text[:2000]}"
        answer = response.json()
        assert answer["success"], f"{user}: {action} failed: {answer.get('value')}"
        return answer

    def run_python(self, user: str, code: str, timeout_s: float = STEP_TIMEOUT_S) -> str:
        """Run ``code`` in a new kernel of ``user``'s server (as a notebook would); return what it printed."""
        import websocket

        response = self.server(user, "POST", "/api/kernels", json={"name": "python3"})
        assert response.status_code == 201, f"{user}: no kernel: {response.status_code} {response.text}"
        kernel_id = response.json()["id"]
        url = self.url.replace("http://", "ws://") + f"/user/{user}/api/kernels/{kernel_id}/channels"
        socket_ = websocket.create_connection(url, header=[f"Authorization: token {self.token}"], timeout=timeout_s)
        msg_id = uuid.uuid4().hex
        socket_.send(json.dumps({
            "header": {"msg_id": msg_id, "username": user, "session": uuid.uuid4().hex, "msg_type": "execute_request",
                       "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True},
        }))
        printed, error = [], None
        try:
            while True:
                message = json.loads(socket_.recv())
                if message.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                if message["msg_type"] == "stream":
                    printed.append(message["content"]["text"])
                elif message["msg_type"] == "error":
                    error = "\n".join(message["content"]["traceback"])
                elif message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
                    break
        finally:
            socket_.close()
            self.server(user, "DELETE", f"/api/kernels/{kernel_id}")
        assert error is None, f"{user}'s kernel raised:\n{error}"
        return "".join(printed)

    def shell(self, user: str, argv: list[str], cwd: str, timeout_s: float = STEP_TIMEOUT_S) -> tuple[int, str]:
        """Run a command from a kernel of ``user``'s server, as they would from its terminal: (exit status, output)."""
        code = (f"import json, subprocess\nr = subprocess.run({argv!r}, cwd={cwd!r}, capture_output=True, text=True)\n"
                "print(json.dumps([r.returncode, r.stdout + r.stderr]))")
        status, output = json.loads(self.run_python(user, code, timeout_s).strip().splitlines()[-1])
        return status, output

    def notebook(self, user: str, path: str) -> dict:
        response = self.server(user, "GET", f"/api/contents/{path}", params={"content": "1"})
        assert response.status_code == 200, f"{user}: no {path}: {response.status_code}"
        return response.json()["content"]


class RunningClass:
    def __init__(self, room: Classroom, passwords: dict[str, str], client: HubClient, log_path: Path):
        self.room, self.passwords, self.client, self.log_path = room, passwords, client, log_path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.is_file() else ""


@pytest.fixture(scope="module")
def hub_class():
    """A class on JupyterHub: its accounts (random names), exchange and hub; every account's server started.
    Everything is removed after, failure or not: the hub and its servers, the users and their homes, the folders."""
    reason = _why_not_here()
    if reason:
        pytest.skip(reason)
    base = Path(tempfile.mkdtemp(prefix="minillm-class-", dir="/tmp"))
    base.chmod(0o755)
    tag = secrets.token_hex(3)
    room = Classroom(instructor=f"mlins{tag}", students=(f"mlstu{tag}a", f"mlstu{tag}b"), state=base / "hub",
                     exchange=base / "srv" / "nbgrader" / "exchange", port=_free_port(), hub_port=_free_port(),
                     proxy_api_port=_free_port())
    passwords = {user: secrets.token_urlsafe(12) for user in room.accounts}
    token = secrets.token_hex(32)
    log_path = base / "jupyterhub.log"
    opened, hub = [], None
    try:
        classroom.setup(room, passwords, refresh_course=True, models_for=[room.instructor])
        opened = classroom.open_for_accounts(classroom.interpreter_blockers())
        classroom.check_interpreter(room.students[0])
        hub = classroom.start_hub(room, log_path, api_token=token)
        classroom.wait_for_hub(room, hub)
        client = HubClient(room.url, token)
        for user in room.accounts:
            client.start_server(user)
        yield RunningClass(room, passwords, client, log_path)
    finally:
        if hub is not None:
            classroom.stop_hub(hub)
        if log_path.is_file():
            print("--- the hub's log, last lines ---\n" + log_path.read_text(errors="replace")[-6000:])
        classroom.remove(room)
        classroom.restore_modes(opened)
        shutil.rmtree(base, ignore_errors=True)


def _text(page: str) -> str:
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", "", page)))


def _sources(nb: dict) -> list[str]:
    return ["".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"] for cell in nb["cells"]]


def _solution_cells(nb) -> dict[str, str]:
    return {cell.metadata["nbgrader"]["grade_id"]: cell.source for cell in nb.cells
            if cell.metadata.get("nbgrader", {}).get("solution")}


def test_the_instructors_loop_on_jupyterhub(hub_class):
    room, client = hub_class.room, hub_class.client
    instructor, (solver, idler) = room.instructor, room.students
    course = str(room.course_dir)
    exchange_course = room.exchange / COURSE_ID

    # --- each server runs as its own Unix user; the formgrader is the instructor's alone; their home is closed
    for user in room.accounts:
        assert client.run_python(user, "import getpass; print(getpass.getuser())").strip() == user
        expected = 200 if user == instructor else 404
        assert client.server(user, "GET", "/formgrader/api/assignments").status_code == expected, user
    assert (room.home(instructor).stat().st_mode & 0o777) == 0o700
    assert room.course_dir.stat().st_uid == room.home(instructor).stat().st_uid
    status, output = client.shell(instructor, ["python", "autograde.py", "--check-sandbox"], course)
    assert status == 0 and output.startswith("sandbox: bubblewrap"), f"no sandbox for {instructor}: {output}"
    print(f"the instructor's sandbox: {output.strip()}")

    # --- release, from the instructor's course directory
    for step in (["nbgrader", "generate_assignment", LAB], ["nbgrader", "release_assignment", LAB]):
        status, output = client.shell(instructor, step, course)
        assert status == 0, f"{' '.join(step)} failed:\n{output}"
    assert (exchange_course / "outbound" / LAB / f"{LAB}.ipynb").is_file()

    # --- both students fetch: the release is the committed student copy (no model answers, no hidden tests)
    notebook_path = f"{LAB}/{LAB}.ipynb"
    student_copy = nbformat.read(REPO_ROOT / "labs" / f"{LAB}.ipynb", as_version=4)
    fetched = {}
    for student in room.students:
        listed = client.assignments(student, "fetch")["value"]
        assert any(a["assignment_id"] == LAB and a["status"] == "fetched" for a in listed), listed
        fetched[student] = client.notebook(student, notebook_path)
        assert _sources(fetched[student]) == [cell.source for cell in student_copy.cells], (
            f"{student} fetched another notebook than labs/{LAB}.ipynb")

    # --- one solves (the solution cells of solutions/, saved as JupyterLab saves), the other does not; both submit
    solutions = _solution_cells(nbformat.read(REPO_ROOT / "solutions" / f"{LAB}.ipynb", as_version=4))
    solved = fetched[solver]
    replaced = 0
    for cell in solved["cells"]:
        grade_id = cell["metadata"].get("nbgrader", {}).get("grade_id")
        if cell["metadata"].get("nbgrader", {}).get("solution") and grade_id in solutions:
            cell["source"], replaced = solutions[grade_id], replaced + 1
    assert replaced == len(solutions) > 0
    saved = client.server(solver, "PUT", f"/api/contents/{notebook_path}",
                          json={"type": "notebook", "format": "json", "content": solved})
    assert saved.status_code == 200, saved.text
    for student in room.students:
        client.assignments(student, "submit")

    # --- the idle student cheats twice, from a kernel of their own server
    status, output = client.shell(idler, ["nbgrader", "submit", LAB, "--course", COURSE_ID, "--student", solver],
                                  str(room.home(idler)))
    assert status == 0, f"nbgrader submit --student {solver} failed (the refusal is collect's):\n{output}"
    master = room.course_dir / "source" / LAB / f"{LAB}.ipynb"
    planted = client.run_python(idler, f"""
import datetime, os
stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f UTC")
folder = os.path.join({str(exchange_course / "inbound")!r}, "{idler}+{LAB}+" + stamp + "+planted")
os.mkdir(folder)
os.symlink({str(master)!r}, os.path.join(folder, "{LAB}.ipynb"))
with open(os.path.join(folder, "timestamp.txt"), "w") as handle:
    handle.write(stamp)
print(os.path.basename(folder))
""").strip()

    # --- collect: both refused, naming who they claim to be and what they are; each student's own is taken
    status, output = client.shell(instructor, ["nbgrader", "collect", LAB], course)
    assert status == 0, output
    assert re.search(rf"Refused submission {solver}\+{LAB}\+.*?: it claims to be submitted by {solver} but was made "
                     rf"by {idler}", output), f"collect did not refuse {idler}'s submission as {solver}:\n{output}"
    assert f"Refused submission {planted}: it claims to be submitted by {idler} but holds a symbolic link" in output, (
        f"collect did not refuse the planted symbolic link:\n{output}")
    submitted = room.course_dir / "submitted"
    assert sorted(p.name for p in submitted.iterdir()) == sorted(room.students)
    collected = {student: nbformat.read(submitted / student / LAB / f"{LAB}.ipynb", as_version=4)
                 for student in room.students}
    assert [c.source for c in collected[solver].cells] == _sources(solved), f"{solver}'s own submission was not taken"
    assert [c.source for c in collected[idler].cells] == _sources(fetched[idler]), (
        f"{idler}'s collected notebook is not their own untouched copy (the master, through the link?)")

    # --- autograde in the sandbox, as the instructor
    status, output = client.shell(instructor, ["python", "autograde.py", "submitted", "--labs", LAB, "--feedback",
                                               "feedback", "--out", "grades.csv"], course, timeout_s=GRADING_TIMEOUT_S)
    assert status == 0, f"autograde.py failed (exit {status}):\n{output[-6000:]}"
    with open(room.course_dir / "grades.csv", newline="") as handle:
        rows = {row["student"]: row for row in csv.DictReader(handle)}
    assert sorted(rows) == sorted(room.students), rows
    assert all(row["status"] == "graded" for row in rows.values()), rows
    max_score = float(rows[solver]["max_score"])
    assert max_score > 0 and float(rows[solver]["score"]) == max_score, rows[solver]
    assert float(rows[idler]["score"]) == 0, rows[idler]
    print("grades: " + ", ".join(f"{s} {rows[s]['score']}/{rows[s]['max_score']} in {rows[s]['seconds']} s"
                                 for s in room.students))

    # --- feedback: released by the instructor, each student fetches their own page
    status, output = client.shell(instructor, ["nbgrader", "release_feedback", LAB], course)
    assert status == 0, output
    pages = {student: (room.course_dir / "feedback" / student / LAB / f"{LAB}.html").read_text(encoding="utf-8")
             for student in room.students}
    assert pages[solver] != pages[idler]
    for student in room.students:
        client.assignments(student, "fetch_feedback")
        listing = client.server(student, "GET", f"/api/contents/{LAB}/feedback").json()["content"]
        assert len(listing) == 1, f"{student}'s feedback folder: {[entry['path'] for entry in listing]}"
        files = client.server(student, "GET", f"/api/contents/{listing[0]['path']}").json()["content"]
        assert [entry["name"] for entry in files] == [f"{LAB}.html"], files
        page = client.server(student, "GET", f"/api/contents/{files[0]['path']}",
                             params={"content": "1", "format": "text"}).json()["content"]
        assert page == pages[student], f"{student} fetched a page that is not their own"
        score = float(rows[student]["score"])
        assert re.search(rf"(?<![\d.]){score:g}(?:\.0+)?\s*/\s*{max_score:g}(?:\.0+)?(?![\d.])", _text(page)), (
            f"{student}'s page does not show {score:g} / {max_score:g}")


def test_collect_copies_no_link_a_student_swaps_in_after_the_check(tmp_path):
    """grading/course.py copies a submission through a snapshot that keeps links as links: a link or a FIFO that
    appears after :func:`refusal` looked (the student owns the folder) is refused, never followed or read."""
    from nbgrader.coursedir import CourseDirectory

    from grading.course import OwnerCheckedCollect, refusal

    submission = tmp_path / f"ada+{LAB}+2030-01-01 00:00:00.000000 UTC+x"
    submission.mkdir()
    (submission / f"{LAB}.ipynb").write_text("{}")
    (submission / "timestamp.txt").write_text("2030-01-01 00:00:00.000000 UTC")
    assert refusal(str(submission), "ada") is None  # made by this account, which collects
    collect = OwnerCheckedCollect(coursedir=CourseDirectory())
    (submission / f"{LAB}.ipynb").unlink()
    os.symlink("/etc/passwd", submission / f"{LAB}.ipynb")
    assert "holds a symbolic link" in refusal(str(submission), "ada")
    collect.do_copy(str(submission), str(tmp_path / "linked"))
    assert not (tmp_path / "linked").exists()
    (submission / f"{LAB}.ipynb").unlink()
    os.mkfifo(submission / f"{LAB}.ipynb")
    collect.do_copy(str(submission), str(tmp_path / "fifo"))
    assert not (tmp_path / "fifo").exists()
    (submission / f"{LAB}.ipynb").unlink()
    (submission / f"{LAB}.ipynb").write_text("{}")
    collect.do_copy(str(submission), str(tmp_path / "plain"))
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == sorted([f"{LAB}.ipynb", "timestamp.txt"])


@pytest.mark.skipif(not CHROMIUM.is_file(), reason=f"{CHROMIUM} missing: `bash scripts/install_browser.sh` as root")
def test_the_formgrader_page_loads_in_chromium(hub_class):
    """The instructor logs in to the hub with their Unix password, and the formgrader lists the lab."""
    from playwright.sync_api import sync_playwright

    room = hub_class.room
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM),
                                             args=["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"])
        try:
            page = browser.new_page()
            page.goto(f"{room.url}/hub/login")
            page.fill("input[name=username]", room.instructor)
            page.fill("input[name=password]", hub_class.passwords[room.instructor])
            page.click("[type=submit]")
            page.wait_for_url(f"**/user/{room.instructor}/**", timeout=120_000)
            page.goto(f"{room.url}/user/{room.instructor}/formgrader")
            page.wait_for_selector(f"tr:has-text('{LAB}')", timeout=120_000)
            assert "formgrade" in page.title(), page.title()
            row = page.locator("tr", has_text=LAB).first.inner_text()
            assert row.split()[0] == LAB, row
        finally:
            browser.close()
