"""The grader's defences, without a whole notebook: the data-only channel, the sandbox's walls, the
references stubbed in it, the proxies the tests see, the similarity report, the graded copy, the feedback.

The round trips that grade real submissions (the probe batch with every class of cheat, lab 00, each lab's
solution and cheating copy) live in tests/test_grading.py and tests/test_course.py.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nbformat
import pytest
import torch

import cheats

from grading import build, feedback, grader, references, remote, sandbox, similarity, wire

REPO_ROOT = Path(__file__).resolve().parents[1]
LABS = build.discover_labs()


# --- the channel: data only ----------------------------------------------------------------------


def _round_trip(value):
    encoded, blobs = wire.Encoder().encode(value)
    return wire.Decoder().decode(json.loads(json.dumps(encoded)), blobs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                                   torch.int32, torch.int64, torch.bool])
def test_tensors_cross_bit_for_bit(dtype):
    tensor = (torch.randn(3, 5, 7) * 100).to(dtype)
    back = _round_trip({"t": tensor, "view": tensor[:, 1:, ::2]})
    assert back["t"].dtype == dtype and torch.equal(back["t"], tensor)
    assert torch.equal(back["view"], tensor[:, 1:, ::2]) and back["view"].is_contiguous()


def test_plain_data_crosses_as_itself():
    from minillm import SamplingParams
    from minillm.fleet.policies import FleetState

    value = [None, True, 3, -2 ** 70, 1.5, math.inf, "é", b"\x00\xff", (1, (2,)), {1: "a", (2, 3): [4]}, {5, 6},
             frozenset({7}), slice(1, None, 2), Ellipsis, 2 + 3j, torch.float16, torch.device("cpu"), torch.Size([2, 3]),
             SamplingParams(max_tokens=3, temperature=0.5), FleetState(1.0, 1, 0, (1,), 0, 1, 1, 2, ())]
    back = _round_trip(value)
    assert back == value and type(back[8]) is tuple and type(back[12]) is slice
    assert math.isnan(_round_trip(float("nan")))
    generator = torch.Generator().manual_seed(5)
    assert torch.equal(_round_trip(generator).get_state(), generator.get_state())


class _Anything:
    def __eq__(self, other):
        return True


@pytest.mark.parametrize("value", [_Anything(), object(), math, lambda x: x, type("Claims", (float,), {"__module__": "torch"})(1.0),
                                   torch.nn.Linear(2, 2), iter([1])])
def test_what_is_not_data_is_refused(value):
    with pytest.raises(wire.NotData, match="not plain data"):
        wire.Encoder().encode([1, {"x": value}])


def test_a_dataclass_not_listed_does_not_cross_and_malformed_frames_are_refused():
    with pytest.raises(wire.NotData, match="not one of the classes"):
        wire.Decoder().decode({"$dataclass": "os:system", "fields": {}}, [])
    with pytest.raises(wire.NotData, match="missing bytes"):
        wire.Decoder().decode({"$tensor": 3, "dtype": "float32", "shape": [1]}, [])
    with pytest.raises(wire.NotData, match="unknown tensor dtype"):
        wire.Decoder().decode({"$tensor": 0, "dtype": "object", "shape": [1]}, [b"1234"])
    import os

    r, w = os.pipe()
    os.write(w, (100).to_bytes(8, "big") + (200).to_bytes(4, "big"))
    with pytest.raises(wire.NotData, match="over the channel"):
        wire.read_frame(r)
    os.close(r)
    os.close(w)


# --- the sandbox -------------------------------------------------------------------------------------

PROBE_REFERENCES = {"attend": ["minillm.lab.lab02:reference_attend", "minillm.layers.attention:TorchAttentionBackend",
                               "aten::scaled_dot_product_attention", "torch._decomp.decompositions:scaled_dot_product_flash_attention_for_cpu"]}


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return references.prepare("lab 02", PROBE_REFERENCES, tmp_path_factory.mktemp("library"))


def _session(tmp_path, library, unsafe=False, env=None, **extra):
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    from minillm.config import cache_root

    spec = {"scratch": str(scratch), "runner_dir": str(library.runner_dir), "package_binds": library.package_binds,
            "bans": library.bans, "env": {"OMP_NUM_THREADS": "1", **(env or {})}, "cache_root": str(cache_root()),
            "log": str(tmp_path / "sandbox.log"), "report": str(tmp_path / "events.jsonl"), "cell_timeout_s": 20,
            "call_timeout_s": 20, "unsafe": unsafe, "python": sys.executable, "limits": vars(sandbox.Limits(**extra))}
    return remote.Session(spec)


@pytest.fixture(scope="module")
def session(tmp_path_factory, library):
    if not sandbox.status().available:
        pytest.fail(f"make test needs the sandbox: {sandbox.status().reason}")
    session = _session(tmp_path_factory.mktemp("session"), library)
    remote._SESSION = session
    yield session
    session.close()
    remote._SESSION = None


def _run(session, source: str) -> dict:
    reply = session.run("cell", source)
    return reply


def _value(session, source: str, name: str = "result"):
    reply = _run(session, source)
    assert reply.get("error") is None, reply["error"]
    return session.get([name])[name]


def test_the_sandbox_sees_no_course_no_repository_and_no_network(session, tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        found = _value(session, f"""
import os, socket
def tries(fn):
    try:
        fn()
        return True
    except Exception:
        return False
result = {{
    "repo": tries(lambda: os.listdir({str(REPO_ROOT)!r} + "/grading")),
    "masters": tries(lambda: open({str(REPO_ROOT / "grading" / "source" / "02_kv_cache" / "02_kv_cache.ipynb")!r})),
    "host tmp": tries(lambda: os.listdir({str(tmp_path)!r})),
    "grader's port": tries(lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2)),
    "dns": tries(lambda: socket.getaddrinfo("pypi.org", 443)),
    "write the venv": tries(lambda: open({sys.prefix!r} + "/pwned", "w")),
    "write the model": tries(lambda: open(os.environ["MINILLM_CACHE"] + "/models/pwned", "w")),
    "C kernels source": [n for n in os.listdir(os.path.dirname(__import__("minillm").__file__) + "/kernels")
                         if n.endswith((".c", ".h"))],
    "own scratch": tries(lambda: open("scratch.txt", "w").write("mine")),
    "model": tries(lambda: os.listdir(os.environ["MINILLM_CACHE"] + "/models")),
    "pid 1": open("/proc/1/cmdline").read().split(chr(0))[0],
}}
""")
    finally:
        server.close()
    assert found.pop("own scratch") and found.pop("model"), found
    assert "bwrap" in found.pop("pid 1") and not any(found.values()), found


def test_the_sandbox_dies_whole_and_keeps_to_its_process_limit(tmp_path, library):
    token = f"minillm-sandbox-{uuid.uuid4().hex}"
    session = _session(tmp_path, library, processes=64)
    try:
        reply = _run(session, f"""
import os, subprocess
subprocess.Popen(["setsid", "sh", "-c", "sleep 60 # {token}"], start_new_session=True)
children = 0
try:
    for _ in range(200):
        if os.fork() == 0:
            import time; time.sleep(60); os._exit(0)
        children += 1
except OSError:
    pass
result = children
""")
        assert reply.get("error") is None, reply
        children = session.get(["result"])["result"]
        assert children < 64, f"{children} processes forked past a limit of 64"
        assert subprocess.run(["pgrep", "-f", token], capture_output=True).returncode == 0, "the detached child never ran"
        groups = session.process.cgroup.paths if session.process.cgroup is not None else []
    finally:
        session.close()
    assert not any(group.exists() for group in groups), "the sandbox's cgroup outlived it"
    time.sleep(0.5)
    assert subprocess.run(["pgrep", "-f", token], capture_output=True).returncode == 1, "a detached process outlived its sandbox"


def test_the_references_are_stubbed_in_the_sandbox_and_not_outside(session):
    found = _value(session, """
import torch, importlib, inspect
import torch.nn.functional as F
from minillm.lab import lab02
from minillm.layers.attention import TorchAttentionBackend
q = torch.randn(1, 2, 3, 4)
def tries(fn):
    try:
        fn()
        return "ran"
    except Exception as error:
        return type(error).__name__ + ": " + str(error)
tries(lambda: importlib.reload(F))   # a fresh copy of the module reaches the same refused operator
result = {
    "helper": tries(lambda: lab02.reference_attend(q[0], q[0, :1], q[0, :1], 0.5, 0)),
    "engine": tries(lambda: TorchAttentionBackend().attend(q[0], q[0, :1], q[0, :1], 0.5, 0)),
    "sdpa": tries(lambda: F.scaled_dot_product_attention(q, q, q)),
    "C route": tries(lambda: torch._C._nn.scaled_dot_product_attention(q, q, q)),
    "ops route": tries(lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q)),
    "math route": tries(lambda: torch.ops.aten._scaled_dot_product_attention_math(q, q, q)),
    "decomposition": tries(lambda: __import__("torch._decomp.decompositions", fromlist=["x"]).scaled_dot_product_flash_attention_for_cpu(q, q, q)),
    "source": inspect.getsource(lab02.reference_attend),
    "other helpers": tries(lambda: lab02.bytes_to_human(3e9)),
}
""")
    for route in ("helper", "engine", "sdpa", "C route", "ops route", "math route", "decomposition"):
        assert found[route].startswith("ReferenceUnavailable: ") and "lab 02" in found[route] and "attend" in found[route], \
            (route, found[route])
    assert "scaled_dot_product_attention" not in found["source"] and "refuse" in found["source"]
    assert found["other helpers"] == "ran"
    from minillm.lab import lab02  # the grader keeps the real ones

    q = torch.randn(2, 2, 4)
    assert lab02.reference_attend(q, q[:1], q[:1], 0.5, 0).shape == (2, 2, 4)


def test_undoing_an_operator_ban_gets_no_implementation_back(session):
    reply = _run(session, """
import torch
q = torch.randn(1, 2, 3, 4)
lib = torch.library.Library("aten", "IMPL")
torch.library._impls.clear()
lib.impl("_scaled_dot_product_flash_attention_for_cpu", lambda *a, **k: (q, q), "CPU")
result = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q)[0] is q   # their own, not attention
try:
    torch.nn.functional.scaled_dot_product_attention(q, q, q)
    result = "the attention came back"
except Exception as error:
    pass
""")
    assert reply.get("error") is None, reply["error"]
    assert session.get(["result"])["result"] is True


def test_the_learner_objects_reach_the_grader_only_as_data(session):
    reply = _run(session, """
import torch
class Yes:
    def __eq__(self, other):
        return True
    def __bool__(self):
        return True
    def twice(self, x):
        return 2 * x
def liar():
    return Yes()
def grow(table, n):
    table.extend(range(n))
    return table
def scale_(t):
    t.mul_(2)
def module():
    return torch
def calls_back(clock, tokenizer):
    return [clock(), clock(), tokenizer.encode("hi"), hasattr(tokenizer, "save_pretrained")]
""")
    assert reply.get("error") is None, reply["error"]
    names = session.get(["liar", "grow", "scale_", "module", "calls_back", "Yes"])
    yes = names["liar"]()
    assert isinstance(yes, remote.RemoteObject) and yes != 5 and not (yes == 5) and yes.twice(21) == 42
    table = [7]
    assert names["grow"](table, 2) is table and table == [7, 0, 1]
    t = torch.ones(3)
    assert names["scale_"](t) is None and torch.equal(t, torch.full((3,), 2.0))
    with pytest.raises(wire.NotData, match="not plain data"):
        names["module"]()
    ticks = iter([1.0, 3.5])
    from transformers import AutoTokenizer
    from minillm import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path(progress=False))
    got = names["calls_back"](lambda: next(ticks), tokenizer)
    assert got == [1.0, 3.5, tokenizer.encode("hi"), False]


def test_a_learner_cell_that_loops_or_dies_costs_its_own_cell(tmp_path, library):
    session = _session(tmp_path, library)
    session.cell_timeout_s = session.call_timeout_s = 3
    try:
        assert session.run("first", "x = 41\ndef spin():\n    while True:\n        pass").get("error") is None
        with pytest.raises(remote.SandboxError, match="longer than 3 s"):
            session.get(["spin"])["spin"]()
        assert session.get(["x"])["x"] == 41, "the cells before were replayed"
        with pytest.raises(remote.SandboxError, match="died"):
            session.run("second", "import os\nos._exit(3)")
        assert session.get(["x"])["x"] == 41
    finally:
        session.close()


def test_the_unsafe_mode_runs_the_same_program_without_walls(tmp_path, library):
    """--unsafe-no-sandbox: the runner as a plain process (it sees the repository), the same channel."""
    session = _session(tmp_path, library, unsafe=True)
    try:
        reply = session.run("cell", f"import os\nsees_repo = os.path.isdir({str(REPO_ROOT / 'grading')!r})\n"
                                    "def double(x):\n    return 2 * x")
        assert reply.get("error") is None, reply
        names = session.get(["sees_repo", "double"])
        assert names["sees_repo"] is True and names["double"](21) == 42
    finally:
        session.close()


def test_without_a_sandbox_autograde_refuses_unless_told(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox, "status", lambda: sandbox.Status(False, "bubblewrap is not installed: install it", ""))
    with pytest.raises(sandbox.SandboxUnavailable, match="bubblewrap is not installed"):
        grader.autograde({"ada": {"00_setup": tmp_path / "nb.ipynb"}})
    script = REPO_ROOT / "grading" / "autograde.py"
    import importlib.util

    spec = importlib.util.spec_from_file_location("autograde_script", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (tmp_path / "ada" / "00_setup").mkdir(parents=True)
    (tmp_path / "ada" / "00_setup" / "00_setup.ipynb").write_text("{}")
    assert module.main([str(tmp_path), "--out", str(tmp_path / "g.csv")]) == 2
    assert module.main(["--check-sandbox"]) == 2


def test_the_cheats_work_where_nothing_contains_them(tmp_path):
    """The control: outside a sandbox the same attempts do what they aim at (so the grading tests that see
    them change nothing are not passing by accident)."""
    marker, token = tmp_path / "marker", f"minillm-control-{uuid.uuid4().hex}"
    course = tmp_path / "course"
    course.mkdir()
    import sqlite3

    db = sqlite3.connect(course / "gradebook.db")
    db.execute("CREATE TABLE grade (manual_score REAL)")
    db.execute("INSERT INTO grade VALUES (NULL)")
    db.commit()
    code = "\n".join([cheats.reaching_the_course("02_kv_cache", course, marker), cheats.outliving(token, tmp_path / "later", 1)])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert marker.read_text() in ("imported the grader", "wrote the gradebook") or marker.read_text().startswith("read ")
    assert db.execute("SELECT manual_score FROM grade").fetchone() == (100.0,)
    time.sleep(3)
    assert (tmp_path / "later").is_file(), "the detached child never wrote"


ADD_KERNEL = '''import triton
import triton.language as tl
import torch
SCALE = 2.0


@triton.jit
def add_kernel(out_ptr, x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, SCALE * (tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask)),
             mask=mask)


def launcher_the_student_rewrote(x, y):
    return torch.zeros_like(x)
'''


def test_a_kernel_runs_alone_from_its_source_and_nothing_else_of_the_cell(tmp_path, library):
    from grading import kernels

    found = kernels.extract(ADD_KERNEL, ["add_kernel"])
    assert found.problems == [] and found.names == ["add_kernel"] and "launcher_the_student_rewrote" not in found.source
    assert "import torch" not in found.source.split("def _minillm_launch")[0]
    cheats_in_the_body = ADD_KERNEL.replace("mask = offsets < n", "mask = offsets < n\n    import os\n    z = torch.softmax(x_ptr, 0).__class__")
    problems = kernels.extract(cheats_in_the_body, ["add_kernel"]).problems
    assert any("import" in p for p in problems) and any("torch" in p for p in problems) and any("__class__" in p for p in problems)
    assert kernels.extract("x = 1", ["add_kernel"]).problems == ["the cell defines no @triton.jit add_kernel"]
    session = _session(tmp_path, library, env={"TRITON_INTERPRET": "1"})
    try:
        assert session.run("kernel", found.source).get("error") is None
        kernel = remote.RemoteKernel(session, "add_kernel", "")
        x, y, out = torch.arange(10.0), torch.ones(10), torch.full((10,), float("nan"))
        kernel[(3,)](out, x, y, 10, BLOCK=4)
        assert torch.equal(out, 2 * (x + y)), out
        kernel[lambda meta: (triton_cdiv(10, meta["BLOCK"]),)](out.zero_(), y, y, 10, BLOCK=8)   # a grid from the grader
        assert torch.equal(out, torch.full((10,), 4.0))
    finally:
        session.close()


def triton_cdiv(a, b):
    return -(-a // b)


# --- similarity ---------------------------------------------------------------------------------------

ATTEND = '''def attend_with_cache(q, k, v, scale, num_cached):
    num_q, num_heads, head_dim = q.shape
    group = num_heads // k.shape[0]
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    scores = (q.transpose(0, 1) @ k.transpose(1, 2)) * scale
    q_pos = num_cached + torch.arange(num_q).unsqueeze(1)
    k_pos = torch.arange(k.shape[1]).unsqueeze(0)
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)
'''
RENAMED = ATTEND.replace("scores", "s").replace("q_pos", "rows").replace("group", "g") + "# my own work\n"
DIFFERENT = '''def attend_with_cache(q, k, v, scale, num_cached):
    out = []
    for i in range(q.shape[0]):
        keys = k.repeat_interleave(q.shape[1] // k.shape[0], 0)[:, :num_cached + i + 1]
        vals = v.repeat_interleave(q.shape[1] // k.shape[0], 0)[:, :num_cached + i + 1]
        weights = torch.einsum("hd,hkd->hk", q[i], keys).mul(scale).softmax(-1)
        out.append(torch.einsum("hk,hkd->hd", weights, vals))
    return torch.stack(out)
'''


def test_similarity_flags_copies_not_independent_work():
    reference = ("minillm.lab.lab02.reference_attend", ATTEND.replace("attend_with_cache", "reference_attend"))
    matches = similarity.compare({"ada": {"attend": ATTEND}, "bob": {"attend": RENAMED}, "eve": {"attend": DIFFERENT}},
                                 {"attend": [reference]}, {}, "02_kv_cache")
    flagged = {(m.student, m.other) for m in matches}
    assert ("ada", "student bob") in flagged and ("bob", "student ada") in flagged
    assert ("bob", "the reference minillm.lab.lab02.reference_attend") in flagged
    assert not any(m.student == "eve" or m.other == "student eve" for m in matches), matches
    short = similarity.compare({"a": {"x": "def f(a, b):\n    return 2 * a * b"}, "b": {"x": "def g(x, y):\n    return 2 * x * y"}},
                               {}, {}, "lab")
    assert short == [], "a short cell everyone writes alike is not flagged"


def test_similarity_flags_rows_from_the_graded_copies(tmp_path):
    """What --similarity adds to the grades: the published solution copied, a reference renamed, a classmate's cell."""
    lab = "02_kv_cache"
    solution = nbformat.read(REPO_ROOT / "solutions" / f"{lab}.ipynb", as_version=4)
    renamed = nbformat.read(REPO_ROOT / "labs" / f"{lab}.ipynb", as_version=4)
    for cell in renamed.cells:
        if cell.metadata.get("nbgrader", {}).get("grade_id") == "attend_with_cache":
            cell.source = RENAMED
    for student, nb in (("copies", solution), ("renames", renamed), ("twin", renamed), ("honest", nbformat.read(
            REPO_ROOT / "labs" / f"{lab}.ipynb", as_version=4))):
        path = tmp_path / "submitted" / student / lab / f"{lab}.ipynb"
        path.parent.mkdir(parents=True)
        nbformat.write(nb, path)
    rows = [{"student": s, "lab": lab, "reason": ""} for s in ("copies", "renames", "twin", "honest")]
    similarity.flag_rows(rows, {}, tmp_path)
    reasons = {row["student"]: row["reason"] for row in rows}
    assert "attend_with_cache is 100% like the published solution's" in reasons["copies"], reasons["copies"]
    assert "attend_with_cache is 100% like student twin's" in reasons["renames"], reasons["renames"]
    assert reasons["honest"] == "", "the untouched stubs are not compared"
    # in a graded row the flags join the notes, before the lines of the failed tests
    from types import SimpleNamespace

    rows = [{"student": "copies", "lab": lab, "reason": "cell a timed out\ntest_b: AssertionError",
             "reason_general": "cell a timed out"},
            {"student": "twin", "lab": lab, "reason": "test_c: ValueError", "reason_general": ""},
            {"student": "renames", "lab": lab, "reason": "", "reason_general": ""}]
    grader._flag_similar(SimpleNamespace(courses={}, course_root=tmp_path, feedback_dir=None), rows)
    copies, twin, _ = (row["reason"].split("\n") for row in rows)
    assert copies[0].startswith("cell a timed out; flagged: ") and copies[1:] == ["test_b: AssertionError"], copies
    assert twin[0].startswith("flagged: ") and twin[1:] == ["test_c: ValueError"], twin
    assert rows[1]["reason_general"] == twin[0]


def test_every_declared_reference_exists(tmp_path):
    problems = [p for lab in LABS for p in references.problems(lab, build.read_master(lab))]
    assert problems == []
    for lab in LABS:
        declared = references.declared(build.read_master(lab))
        references.prepare(lab, declared, tmp_path / lab)  # every one is stubbed without error


# --- the graded copy --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def courses(tmp_path_factory):
    """The grading course of every lab, built once (generate_assignment, no execution)."""
    root = tmp_path_factory.mktemp("grading-course") / "course"
    return grader.prepare_course(root, LABS)


@pytest.mark.parametrize("lab", LABS)
def test_a_cheating_copy_runs_the_masters_cells_and_its_own_solution_cells_only(courses, lab, tmp_path):
    """Of a cheating copy, only its solution cells are its own (to run in the sandbox): extra cells are
    dropped, every locked cell and test comes from the master, nothing is zeroed."""
    course = courses[lab]
    untouched = grader.graded_copy(nbformat.read(REPO_ROOT / "labs" / f"{lab}.ipynb", as_version=4), course)
    cheat = grader.graded_copy(cheats.cheating_copy(lab, tmp_path / "marker", "token"), course)
    assert untouched.flags == [] and untouched.zeroed == {}
    assert len(cheat.notebook.cells) == len(untouched.notebook.cells)
    solution_ids = [c.metadata["nbgrader"]["grade_id"] for c in untouched.notebook.cells
                    if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("solution")]
    assert solution_ids
    for mine, theirs in zip(cheat.notebook.cells, untouched.notebook.cells):
        if mine.source != theirs.source:
            assert mine.metadata["nbgrader"]["solution"] and "get_ipython().run_cell(" in mine.source
    assert any("not part of the lab" in note for note in cheat.notes)
    assert cheat.flags == [] and cheat.zeroed == {}


@pytest.mark.parametrize("lab", LABS)
def test_graded_copy_carries_the_gradebook_source_and_checksums(courses, lab):
    """So nbgrader logs no checksum change for an untouched submission, and the hidden tests run."""
    from nbgrader.utils import compute_checksum

    course = courses[lab]
    copy_ = grader.graded_copy(nbformat.read(REPO_ROOT / "labs" / f"{lab}.ipynb", as_version=4), course)
    assert copy_.notebook.cells[0].source == grader.START_SOURCE
    tests = [c for c in copy_.notebook.cells if grader._is_test(c)]
    assert tests and any(grader.HIDDEN_BEGIN in c.source for c in tests)
    for cell in copy_.notebook.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("locked"):
            assert compute_checksum(cell) == meta["checksum"] == course.sources[meta["grade_id"]][1], meta["grade_id"]
    for cell in tests:
        assert cell.source.startswith("import grading.remote as _minillm_sandbox; _minillm_sandbox.refresh(globals(), "
                                      f"{cell.metadata['nbgrader']['grade_id']!r})")


def test_deleted_and_replaced_test_cells_are_zeroed_and_flagged(courses):
    lab = LABS[0]
    nb = nbformat.read(REPO_ROOT / "solutions" / f"{lab}.ipynb", as_version=4)
    tests = [c for c in nb.cells if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("grade")]
    deleted, replaced = tests[0], tests[1]
    replaced.source = "pass"
    nb.cells.remove(deleted)
    copy_ = grader.graded_copy(nb, courses[lab])
    deleted_id, replaced_id = deleted.metadata["nbgrader"]["grade_id"], replaced.metadata["nbgrader"]["grade_id"]
    assert set(copy_.zeroed) == {deleted_id, replaced_id}
    assert f"locked cell {deleted_id} was deleted" in copy_.flags and f"locked cell {replaced_id} was changed" in copy_.flags
    sources = {c.metadata.get("nbgrader", {}).get("grade_id"): c.source for c in copy_.notebook.cells}
    assert sources[replaced_id] == courses[lab].sources[replaced_id][0]  # the master's test still runs


@pytest.mark.parametrize(
    "text, reason",
    [
        ('{"cells": [', "invalid notebook JSON at byte 11"),
        ('{"cells": [}', "invalid notebook JSON at byte 11"),
        ("\xff\xfe", "not UTF-8"),
        ("[1, 2]", "not a Jupyter notebook"),
    ],
)
def test_unreadable_submissions_say_why(tmp_path, text, reason):
    path = tmp_path / "nb.ipynb"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(grader.SubmissionError, match=reason.replace("(", r"\(")):
        grader.read_submission(path)


# --- feedback -----------------------------------------------------------------------------------


def test_feedback_message_hides_hidden_tests():
    source = "import x; verify('t')\nassert f(1) == 1\n### BEGIN HIDDEN TESTS\nassert f(2) == 4, 'f(2) should be 4'\n### END HIDDEN TESTS"
    hidden = ["assert f(2) == 4, 'f(2) should be 4'"]
    in_hidden = {"ename": "AssertionError", "evalue": "f(2) should be 4",
                 "traceback": ["\x1b[0;31mAssertionError\x1b[0m", "Cell In[7], line 4\n----> 4 assert f(2) == 4"]}
    in_visible = {"ename": "AssertionError", "evalue": "f(1) is wrong", "traceback": ["Cell In[7], line 2\n"]}
    quoting = {"ename": "AssertionError", "evalue": "assert f(2) == 4, 'f(2) should be 4'", "traceback": []}
    assert feedback.visible_message(in_hidden, source, hidden) == "a hidden test failed (AssertionError)"
    assert feedback.visible_message(in_visible, source, hidden) == "AssertionError: f(1) is wrong"
    assert feedback.visible_message(quoting, source, hidden) == f"AssertionError: {feedback.WITHHELD}"


def test_quick_times_give_every_lab_a_cell_timeout():
    times = grader.quick_times()
    assert set(times) == set(LABS), "run `python grading/autograde.py --measure` after adding a lab"
    for lab in LABS:
        timeout = grader.cell_timeout_for(lab, times)
        assert grader.MIN_CELL_TIMEOUT_S <= timeout <= grader.DEFAULT_CELL_TIMEOUT_S
        assert timeout >= grader.TIMEOUT_PER_SLOWEST_CELL * times[lab]["slowest_cell_s"]
