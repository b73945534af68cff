"""The grader's side of a sandboxed submission: run its cells there, reach its functions as data.

This module runs in the graded kernel, which runs only the master's code: the locked cells and the
tests with their hidden parts. The student's solution cells run in the sandbox (grading.sandbox,
grading.sandbox_runner), one cell at a time, in step with the notebook. After a solution cell, each
name the master's version of it binds is bound here too:

- plain data (numbers, strings, tensors, lists and dicts of them) as a copy made here;
- the learner's functions and classes as :class:`RemoteFunction` / :class:`RemoteClass`, their
  objects as :class:`RemoteObject`: calling one sends the arguments as data, the sandbox runs the
  learner's code, and the result comes back as data (arguments it changed in place are copied back);
- anything else as :class:`Refused`, which fails every use with the reason.

Tests then compare values made here, with references computed here, where no student code has run:
nothing the submission does to its own interpreter can change a verdict. Only those names (the learner's
answers) are fetched again before each later cell. What a locked cell bound is the grader's own from then
on: a cell that runs only in the sandbox (the learner's own run) has its names taken once, as data, when it
ends; a cell that runs only here keeps its names here (the sandbox gets a copy) and never reads them back.
A cell that runs too long or kills the sandbox costs that cell; a fresh sandbox replays the cells before it
and grading goes on.

The graded copy's first cell calls :func:`start`; grading.execute turns each other cell into a call of
:func:`learner_cell`, :func:`sandbox_cell` or :func:`refresh` (tests), so this module is all the
graded kernel needs of the pipeline.
"""

from __future__ import annotations

import ast
import builtins
import fcntl
import inspect
import json
import os
import select
import sys
import time
from pathlib import Path

from grading import sandbox as sandbox_mod
from grading import wire

SPEC_ENV = "MINILLM_SANDBOX_SPEC_PATH"
# What the grader keeps of the sandbox's text, whatever it sends (its runner cuts its own to the same sizes).
MAX_TEXT = 200_000        # characters of one cell's output, all streams and displays together
MAX_OUTPUTS = 100         # outputs of one cell
MAX_ERROR_TEXT = 20_000   # characters of an error's message, and of its traceback
MAX_REFERENCES = 200      # references one reply may name (as many as the runner sends: a loop over every check helper)
MAX_DEATHS = 2     # a sandbox that dies (a crash, os._exit) this often more is given up: the rest is not run
MAX_TIMEOUTS = 10  # one stopped for running too long is restarted more often (the notebook's wall limit still holds)

# Exceptions of the learner's code that come back as the same builtin type (a check that expects a
# ValueError for bad input sees one); any other comes back as LearnerError.
BUILTIN_ERRORS = {name: getattr(builtins, name) for name in (
    "ArithmeticError", "AssertionError", "AttributeError", "EOFError", "IndexError", "KeyError", "LookupError",
    "MemoryError", "NameError", "NotImplementedError", "OverflowError", "RecursionError", "RuntimeError",
    "StopIteration", "TypeError", "UnboundLocalError", "ValueError", "ZeroDivisionError", "FileNotFoundError",
    "OSError", "ImportError", "ModuleNotFoundError", "IndentationError", "SyntaxError", "UnicodeError")}


# The grader's objects a check may hand to the learner's code (a tokenizer, the engine), and what of them the
# learner's code may use there: these methods (called here, with data) and these attributes (read here, sent
# as data). Nothing else of the object is reachable: no other method, no attribute of an attribute's object.
EXPOSED = {
    "transformers:PreTrainedTokenizerBase": (
        ("encode", "decode", "batch_decode", "convert_ids_to_tokens", "convert_tokens_to_ids", "tokenize",
         "apply_chat_template", "__call__", "__len__"),
        ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id", "vocab_size", "all_special_ids",
         "eos_token", "bos_token", "pad_token", "chat_template")),
    "minillm.llm:LLM": (
        ("generate", "chat", "apply_chat_template", "chat_token_ids", "kv_bytes_per_token", "weight_bytes",
         "with_levers", "reset_prefix_cache"),
        ("stats", "config", "tokenizer", "model_config", "device", "dtype")),
}


def exposed(value) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(methods, attributes) the learner's code may use of a grader's object, or None."""
    declared = getattr(type(value), "__sandbox_methods__", None)
    if declared is not None:
        return tuple(declared), tuple(getattr(type(value), "__sandbox_attributes__", ()))
    for cls in type(value).__mro__:
        for key, allowed in EXPOSED.items():
            package, _, name = key.partition(":")
            module = cls.__module__ or ""
            if cls.__qualname__ == name and (module == package or module.startswith(package + ".")):
                return allowed
    return None


class LearnerError(RuntimeError):
    """The learner's code raised an exception that is not a builtin one (its name and message)."""


class LearnerCellError(RuntimeError):
    """A solution cell raised when it ran in the sandbox."""


class SandboxError(RuntimeError):
    """The sandbox timed out, died or broke the protocol while running the learner's code."""


class StaleHandle(SandboxError):
    """A handle from before the sandbox restarted."""


def _log_event(event: dict) -> None:
    if _SESSION is not None and _SESSION.report_path:
        with open(_SESSION.report_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({**event, "cell": _SESSION.current_cell}) + "\n")


# --------------------------------------------------------------------------- proxies
class Refused:
    """A name whose value in the submission is not plain data: every use fails, naming why."""

    def __init__(self, name: str, reason: str):
        object.__setattr__(self, "_reason", f"{name}: {reason}")

    def _fail(self, *args, **kwargs):
        reason = object.__getattribute__(self, "_reason")
        _log_event({"event": "refused", "what": reason[:300]})
        raise wire.NotData(f"{reason} (the grader takes numbers, strings, tensors, lists, tuples and dicts of them, "
                           "and the learner's functions and objects)")

    __call__ = __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __float__ = __int__ = __index__ = _fail
    __len__ = __iter__ = __getitem__ = __contains__ = __add__ = __radd__ = __sub__ = __mul__ = __truediv__ = _fail
    __hash__ = None

    def __getattr__(self, name):
        self._fail()

    def __repr__(self):
        return f"<refused: {object.__getattribute__(self, '_reason')}>"


class _Remote:
    """A handle to an object in the sandbox, valid for one sandbox generation."""

    def __init__(self, session: "Session", handle: int, info: dict):
        object.__setattr__(self, "_session", session)
        object.__setattr__(self, "_handle", handle)
        object.__setattr__(self, "_generation", session.generation)
        object.__setattr__(self, "_info", info)

    def _check(self):
        if self._generation != self._session.generation:
            raise StaleHandle(f"{self._info.get('name', 'this object')} belongs to a sandbox that was restarted "
                              "(an earlier call timed out or died)")


class RemoteFunction(_Remote):
    """The learner's function, called in the sandbox with data."""

    def __init__(self, session, handle, info):
        super().__init__(session, handle, info)
        name = str(info.get("name", "function"))
        object.__setattr__(self, "__name__", name)
        object.__setattr__(self, "__qualname__", name)
        object.__setattr__(self, "__doc__", str(info.get("doc", "")))
        object.__setattr__(self, "__signature__", _signature(info.get("parameters")))

    def __call__(self, *args, **kwargs):
        self._check()
        return self._session.call(self._handle, None, args, kwargs, self.__name__)

    def __repr__(self):
        return f"<the learner's {self.__name__}{self.__signature__ or '(...)'}, run in the sandbox>"

    def __setattr__(self, name, value):
        raise AttributeError(f"cannot set {name!r} on the learner's {self.__name__} (it lives in the sandbox)")


class RemoteClass(RemoteFunction):
    """The learner's class: calling it builds an object in the sandbox (a RemoteObject here)."""

    def __getattr__(self, name):
        members = self._info.get("members", {})
        if name in members and members[name] == "method":
            return _RemoteMethod(self, name)
        if name in members:
            self._check()
            return self._session.getattr(self._handle, name)
        raise AttributeError(f"the learner's class {self.__name__} has no attribute {name!r}")

    def __repr__(self):
        return f"<the learner's class {self.__name__}, in the sandbox>"


class RemoteObject(_Remote):
    """An object of a learner's class; methods run in the sandbox, attributes come back as data.
    Comparisons and truth are this handle's own (identity): the learner's __eq__ never decides here."""

    def __getattr__(self, name):
        members = self._info.get("members", {})
        if members.get(name) == "method":
            return _RemoteMethod(self, name)
        if name.startswith("__") or (name.startswith("_") and name not in members):
            raise AttributeError(name)
        self._check()
        return self._session.getattr(self._handle, name)

    def __setattr__(self, name, value):
        raise AttributeError(f"cannot set {name!r} on the learner's object here (it lives in the sandbox)")

    def _dunder(self, name, *args):
        self._check()
        if self._info.get("members", {}).get(name) != "method":
            raise TypeError(f"the learner's {self._info.get('name', 'object')} has no {name}")
        return self._session.call(self._handle, name, args, {}, f"{self._info.get('name')}.{name}")

    def __len__(self):
        return self._dunder("__len__")

    def __iter__(self):
        return iter(self._dunder("__iter__"))

    def __getitem__(self, key):
        return self._dunder("__getitem__", key)

    def __contains__(self, item):
        return self._dunder("__contains__", item)

    def __call__(self, *args, **kwargs):
        self._check()
        return self._session.call(self._handle, "__call__", args, kwargs, str(self._info.get("name")))

    def __repr__(self):
        return f"<the learner's {self._info.get('name', 'object')} object, in the sandbox>"


class _RemoteMethod:
    def __init__(self, owner: _Remote, name: str):
        self._owner, self.__name__ = owner, name

    def __call__(self, *args, **kwargs):
        owner = self._owner
        owner._check()
        return owner._session.call(owner._handle, self.__name__, args, kwargs,
                                   f"{owner._info.get('name', 'object')}.{self.__name__}")

    def __repr__(self):
        return f"<the learner's method {self.__name__}, in the sandbox>"


class RemoteKernel:
    """The learner's ``@triton.jit`` kernel, run alone in the kernel sandbox (grading.kernels): the
    launcher here calls ``kernel[grid](*args)`` as with a real one; every tensor argument comes back,
    written as the kernel wrote it. ``src`` is the kernel's source (``require_kernel`` reads it)."""

    def __init__(self, session: "Session", name: str, src: str):
        self._session, self.__name__, self.src = session, name, src

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            return self._session.launch(self.__name__, grid, args, kwargs)

        return launch

    def __repr__(self):
        return f"<the learner's kernel {self.__name__}, run alone in the kernel sandbox>"


def _signature(parameters):
    if not isinstance(parameters, list):
        return None
    try:
        return inspect.Signature([
            inspect.Parameter(str(name), getattr(inspect.Parameter, str(kind)),
                              **({"default": _Default(str(text))} if has_default else {}))
            for name, kind, has_default, text in parameters])
    except (ValueError, TypeError, AttributeError):
        return None


class _Default:
    """A default value as the sandbox printed it (never evaluated here)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self):
        return self.text


# --------------------------------------------------------------------------- the session
class Session:
    """The sandbox of one graded notebook: its process, its channel, what to replay after a restart."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.report_path = spec.get("report")
        self.call_timeout_s = float(spec.get("call_timeout_s", 600))
        self.cell_timeout_s = float(spec.get("cell_timeout_s", 600))
        self.generation = 0
        self.restarts = 0                     # deaths (and interruptions) so far
        self.timeouts = 0
        self.gone: str | None = None          # after too many restarts: why nothing runs any more
        # what to replay after a restart, in order: (cell name, request, its blobs): cells run, data pushed
        self.history: list[tuple[str, dict, list[bytes]]] = []
        self.pending: tuple[str, str, float] | None = None  # a locked cell the sandbox runs while the kernel does
        self.pushes: list[tuple[dict, str, list[str]]] = []  # cells run here whose data the sandbox gets next
        self.bound: dict[str, str] = {}       # the learner's names -> the solution cell that binds them (refreshed
                                              # before each cell); no name a locked cell bound after that cell
        self.held: dict[str, str] = {}        # names a locked cell bound -> that cell: the grader's own, never refreshed
        self.proxies: dict[int, _Remote] = {}
        self.callbacks: dict[int, object] = {}
        self._callback_ids: dict[int, int] = {}
        self.current_cell = "start"
        self.process = None
        self.encoder = wire.Encoder(handle=self._encode_other)
        self.decoder = wire.Decoder(handle=self._decode_handle)
        self._start()

    # ---- process ----
    def _start(self) -> None:
        spec = self.spec
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        for fd in (to_child_w, from_child_w):
            try:
                fcntl.fcntl(fd, 1031, 1 << 20)  # F_SETPIPE_SZ: 1 MiB, fewer system calls per tensor
            except OSError:
                pass
        sandbox_spec = sandbox_mod.Spec(
            scratch=Path(spec["scratch"]), runner_dir=Path(spec["runner_dir"]),
            package_binds=[tuple(pair) for pair in spec.get("package_binds", [])],
            env={**spec.get("env", {}), "MINILLM_SANDBOX_SPEC": json.dumps(
                {"fd_in": to_child_r, "fd_out": from_child_w, "bans": spec.get("bans", {})})},
            limits=sandbox_mod.Limits(**spec.get("limits", {})),
            cache_root=Path(spec["cache_root"]) if spec.get("cache_root") else None)
        python = spec.get("python", sys.executable)
        runner = (str(Path(spec["runner_dir"]) / "sandbox_runner.py") if spec.get("unsafe")
                  else f"{sandbox_mod.RUNNER_DIR}/sandbox_runner.py")
        try:
            self.process = sandbox_mod.start(sandbox_spec, [python, runner], (to_child_r, from_child_w),
                                             Path(spec["log"]), unsafe=bool(spec.get("unsafe")))
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self.fd_out, self.fd_in = to_child_w, from_child_r
        self.generation += 1
        self.proxies.clear()
        self.callbacks.clear()
        self._callback_ids.clear()
        header, _ = self._read(deadline=time.monotonic() + float(spec.get("start_timeout_s", 120)))
        if header.get("op") != "ready":
            raise SandboxError(f"the sandbox did not start: {_cut(repr(header), 300)}")

    def close(self) -> None:
        self.pending = None
        if self.process is not None:
            for fd in (self.fd_out, self.fd_in):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self.process.kill()
            self.process = None

    def _restart(self, why: str, failed_cell: str | None, timed_out: bool = False) -> None:
        """A fresh sandbox with the state of the cells before this one (the failing cell is not replayed)."""
        self.close()
        if timed_out:
            self.timeouts += 1
        else:
            self.restarts += 1
        _log_event({"event": "restart", "why": why})
        if self.restarts > MAX_DEATHS or self.timeouts > MAX_TIMEOUTS:
            self.gone = f"the sandbox failed {self.restarts + self.timeouts} times, last: {why}"
            return
        if failed_cell is not None:
            self.history = [entry for entry in self.history if entry[0] != failed_cell]
        try:
            self._start()
        except Exception as error:  # noqa: BLE001 - the grader's machinery failed: the row says so (an error, not a 0)
            _log_event({"event": "start_failed", "why": f"{type(error).__name__}: {str(error)[:200]}"})
            self.gone = f"the sandbox could not be started again ({type(error).__name__})"
            return
        for name, request, blobs in list(self.history):
            try:
                reply, _ = self._request(request, blobs, self.cell_timeout_s, replay=True)
            except SandboxError as error:
                self.gone = f"replaying cell {name} after a restart failed: {error}"
                return

    # ---- the channel ----
    def _read(self, deadline: float):
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([self.fd_in], [], [], min(left, 1.0))
            if ready:
                return wire.read_frame(self.fd_in, deadline)
            if self.process is not None and not self.process.alive():
                # let a last frame through, then report the death
                ready, _, _ = select.select([self.fd_in], [], [], 0.1)
                if ready:
                    return wire.read_frame(self.fd_in, deadline)
                raise wire.ChannelClosed(f"the sandbox exited (status {self.process.popen.returncode})")

    def _request(self, header: dict, blobs: list[bytes], timeout_s: float, replay: bool = False):
        """Send one request; answer the callbacks it makes; return its reply. A timeout, a death or a
        malformed message restarts the sandbox (unless replaying) and raises SandboxError."""
        if not replay:
            self._drain()
            self._flush_pushes()
        if self.gone:
            raise SandboxError(self.gone)
        failed = self.current_cell if header.get("op") == "run" else None
        return self._exchange(header, blobs, time.monotonic() + timeout_s, timeout_s, replay, failed)

    def _exchange(self, header, blobs, deadline: float, timeout_s: float, replay: bool, failed: str | None):
        try:
            if header is not None:
                wire.write_frame(self.fd_out, header, blobs)
            while True:
                reply, reply_blobs = self._read(deadline)
                if reply.get("op") == "callback":
                    self._answer_callback(reply, reply_blobs)
                    continue
                if header is not None:  # the learner's code ran (a locked cell's run in the background does not count)
                    used = reply.get("references", []) or []
                    for name in used[:MAX_REFERENCES] if isinstance(used, list) else []:
                        _log_event({"event": "reference", "what": str(name)[:300]})
                return reply, reply_blobs
        except TimeoutError:
            why = f"took longer than {timeout_s:.0f} s"
        except (wire.ChannelClosed, BrokenPipeError, OSError) as error:
            why = f"the sandbox died ({error})"
        except wire.NotData as error:
            why = f"the sandbox sent a malformed message ({error})"
        except BaseException:  # interrupted (the cell's own timeout): the channel is out of step, start afresh
            if not replay:
                self._restart("the grader interrupted the call", failed)
            raise
        timed_out = why.startswith("took")
        hit = self.process.limits_hit() if self.process is not None else []  # its cgroup's counters, before it goes
        if hit:
            why += f" ({'; '.join(hit)})"
        if replay:
            raise SandboxError(why)
        _log_event({"event": "timeout" if timed_out else "died", "why": why, "limits": hit})
        self._restart(why, failed, timed_out)
        raise SandboxError(f"{why}; the sandbox was restarted and the cells before this one replayed")

    def _flush_pushes(self) -> None:
        """Send the data of the grader's cells that have finished: a call of the learner's code made while such
        a cell still runs must not send its half-made values."""
        while self.pushes and self.pushes[0][1] != self.current_cell:
            namespace, cell, names = self.pushes.pop(0)
            values = {name: namespace[name] for name in names if name in namespace}
            if values and not self.gone:
                previous, self.current_cell = self.current_cell, cell
                try:
                    self.push(values)
                except SandboxError:
                    pass
                finally:
                    self.current_cell = previous

    def start_run(self, name: str, source: str) -> None:
        """Send a locked cell to the sandbox and return at once: the kernel runs its own copy meanwhile;
        the reply is collected before the next request (:meth:`_drain`)."""
        self._drain()
        self._flush_pushes()
        if self.gone:
            return
        self.current_cell = name
        try:
            wire.write_frame(self.fd_out, {"op": "run", "source": source}, [])
        except OSError as error:
            _log_event({"event": "died", "why": f"the sandbox died ({error})"})
            self._restart(f"the sandbox died ({error})", name)
            return
        self.pending = (name, source, time.monotonic() + self.cell_timeout_s)

    def _drain(self) -> None:
        if self.pending is None:
            return
        name, source, deadline = self.pending
        self.pending = None
        previous, self.current_cell = self.current_cell, name
        try:
            reply, _ = self._exchange(None, [], deadline, self.cell_timeout_s, False, name)
        except SandboxError:
            return
        finally:
            self.current_cell = previous
        self.history.append((name, {"op": "run", "source": source}, []))
        error = reply.get("error")
        if error:
            _log_event({"event": "sandbox_error", "what": _error_text(error).split("\n")[0][:300]})

    def _answer_callback(self, header: dict, blobs: list[bytes]) -> None:
        target = self.callbacks.get(int(header.get("target", -1)))
        method, attribute = header.get("method"), header.get("attribute")
        try:
            if target is None:
                raise LookupError("no such callback")
            methods, attributes = exposed(target) or ((), ())
            if attribute is not None:
                if attribute not in attributes:
                    raise AttributeError(f"{attribute!r} is not one of {tuple(attributes)}")
                result = getattr(target, attribute)
                encoded, out_blobs = self.encoder.encode(result)
                wire.write_frame(self.fd_out, {"op": "return", "value": encoded}, out_blobs)
                return
            if method is not None:
                if method not in methods:
                    raise AttributeError(f"{method!r} is not one of {tuple(methods)}")
                function = getattr(target, method)
            elif exposed(target) is not None and "__call__" not in methods:
                raise TypeError(f"the grader's {type(target).__name__} is not callable here")
            else:
                function = target
            args = self.decoder.decode(header.get("args", []), blobs)
            kwargs = self.decoder.decode(header.get("kwargs", {"$dict": []}), blobs)
            result = function(*args, **dict(kwargs))
            encoded, out_blobs = self.encoder.encode(result)
            wire.write_frame(self.fd_out, {"op": "return", "value": encoded}, out_blobs)
        except Exception as error:  # noqa: BLE001 - the learner's code sees that the callback raised
            wire.write_frame(self.fd_out, {"op": "raise", "ename": type(error).__name__, "evalue": _cut(str(error), 2000)})

    # ---- encoding ----
    def _encode_other(self, value):
        if isinstance(value, _Remote):
            value._check()
            return {"$remote": value._handle}
        if isinstance(value, Refused):
            value._fail()
        allowed = exposed(value)
        if allowed is not None:
            methods, attributes = allowed
            handle = self._callback_handle(value)
            return {"$callback": handle, "name": type(value).__name__, "methods": [m for m in methods if m != "__call__"],
                    "attributes": list(attributes), "callable": "__call__" in methods}
        from collections.abc import Mapping

        if isinstance(value, Mapping):  # a dict of the grader's own kind (a tokenizer's BatchEncoding): as a dict
            return wire.Replace(dict(value.items()))
        if callable(value):
            handle = self._callback_handle(value)
            return {"$callback": handle, "name": getattr(value, "__name__", type(value).__name__), "methods": [],
                    "attributes": [], "callable": True}
        raise wire.NotData(f"a {type(value).__module__}.{type(value).__qualname__} cannot be passed to the learner's "
                           "code (the grader passes plain data, or a callable of its own)")

    def _callback_handle(self, value) -> int:
        handle = self._callback_ids.get(id(value))
        if handle is None or self.callbacks.get(handle) is not value:
            handle = len(self.callbacks) + 1
            self.callbacks[handle] = value
            self._callback_ids[id(value)] = handle
        return handle

    def _decode_handle(self, data: dict):
        if "$refused" in data:
            return Refused("the value", str(data["$refused"]))
        if "$remote" in data:
            handle = int(data["$remote"])
            proxy = self.proxies.get(handle)
            if proxy is None:
                kind = data.get("kind")
                cls = {"function": RemoteFunction, "class": RemoteClass}.get(kind, RemoteObject)
                proxy = self.proxies[handle] = cls(self, handle, data)
            return proxy
        raise wire.NotData(f"malformed value {str(data)[:80]!r}")

    # ---- requests ----
    def run(self, name: str, source: str) -> dict:
        self.current_cell = name
        reply, _ = self._request({"op": "run", "source": source}, [], self.cell_timeout_s)
        self.history.append((name, {"op": "run", "source": source}, []))
        return reply

    def get(self, names: list[str]) -> dict:
        reply, blobs = self._request({"op": "get", "names": names}, [], self.call_timeout_s)
        if reply.get("op") != "values":
            raise SandboxError(f"the sandbox answered {_cut(repr(reply.get('op')), 80)} to a request for values: "
                               f"{_cut(str(reply.get('ename')), 200)}: {_cut(str(reply.get('evalue')), MAX_ERROR_TEXT)}")
        values = self.decoder.decode(reply.get("value"), blobs)
        if not isinstance(values, dict):
            raise SandboxError("the sandbox answered a request for values with something else")
        return values

    def push(self, values: dict) -> None:
        """Bind these names in the sandbox to a copy of the grader's data (what a cell measured here)."""
        data = {}
        for name, value in values.items():
            try:
                wire.Encoder().encode(value)  # plain data only: no handles, no callbacks
            except wire.NotData:
                continue  # an object of the grader's (an engine, a figure): the sandbox keeps its own
            data[name] = value
        if data:
            encoded, blobs = wire.Encoder().encode(data)
            request = {"op": "set", "values": encoded}
            self._request(request, blobs, self.call_timeout_s, replay=True)
            self.history.append((f"{self.current_cell} (its data)", request, blobs))
        for name in values:  # the grader's own values: the sandbox's copy is for the learner's code, never read back
            self.hold(name, self.current_cell)

    def hold(self, name: str, cell: str) -> None:
        """``name`` is bound by the locked cell ``cell``: its value in the grader's kernel is the grader's own
        from now on (until a later solution cell binds it), never fetched from the sandbox again."""
        self.bound.pop(name, None)
        self.held[name] = cell

    def launch(self, name: str, grid, args, kwargs) -> None:
        """kernel[grid](*args, **kwargs) in this (kernel) sandbox; tensor arguments are written back."""
        launcher = self.get(["_minillm_launch"]).get("_minillm_launch")
        if not isinstance(launcher, RemoteFunction):
            raise SandboxError("the kernel sandbox lost its launcher")
        returned = launcher(name, grid, list(args), dict(kwargs))
        import torch

        for original, written in zip(args, returned or []):
            if isinstance(original, torch.Tensor) and isinstance(written, torch.Tensor) and written.shape == original.shape:
                original.copy_(written.to(original.dtype))

    def getattr(self, handle: int, name: str):
        reply, blobs = self._request({"op": "getattr", "target": handle, "name": name}, [], self.call_timeout_s)
        return self._result(reply, blobs, name)

    def call(self, handle: int, method, args, kwargs, name: str):
        args_json, blobs = self.encoder.encode(list(args))
        kwargs_json, more = self.encoder.encode(dict(kwargs))
        header = {"op": "call", "target": handle, "method": method, "args": args_json,
                  "kwargs": wire.shift_blobs(kwargs_json, len(blobs))}
        reply, reply_blobs = self._request(header, blobs + more, self.call_timeout_s)
        stdout = reply.get("stdout")
        if stdout:
            sys.stdout.write(_cut(str(stdout), MAX_TEXT, keep="end"))
        result = self._result(reply, reply_blobs, name)
        for change in reply.get("mutated", []) or []:
            _copy_back(args, kwargs, change.get("path", []), self.decoder.decode(change.get("value"), reply_blobs), name)
        if reply.get("op") == "return" and isinstance(reply.get("returns_argument"), list):
            return _argument(args, kwargs, reply["returns_argument"])
        return result

    def _result(self, reply: dict, blobs, name: str):
        op = reply.get("op")
        if op == "return":
            return self.decoder.decode(reply.get("value"), blobs)
        if op == "raise":
            ename, evalue = _cut(str(reply.get("ename", "Error")), 200), _cut(str(reply.get("evalue", "")), MAX_ERROR_TEXT)
            if ename == "NotData":
                _log_event({"event": "refused", "what": f"{name}: {evalue}"})
                raise wire.NotData(f"{name} returned something that is not plain data: {evalue}")
            if ename == "AttributeError":
                raise AttributeError(evalue)
            kind = BUILTIN_ERRORS.get(ename) if reply.get("builtin") else None
            if kind is not None:
                raise kind(evalue)
            raise LearnerError(f"{ename}: {evalue}")
        raise SandboxError(f"the sandbox answered {_cut(repr(op), 80)} to a call of {name}")


def _argument(args, kwargs, path: list):
    """The grader's own argument at ``path`` (the learner's code returned what it was given)."""
    head, *rest = path
    target = args[head] if isinstance(head, int) and 0 <= head < len(args) else kwargs.get(head)
    for step in rest:
        target = target[step]
    return target


def _copy_back(args, kwargs, path: list, value, name: str) -> None:
    """Put a value the learner's code changed in place back into the grader's own argument."""
    if not path:
        return
    head, *rest = path
    container = args[head] if isinstance(head, int) and head < len(args) else kwargs.get(head) if isinstance(head, str) else None
    if container is None:
        return
    target = container
    for step in rest:
        try:
            target = target[step]
        except (KeyError, IndexError, TypeError):
            return
    import torch

    if isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor):
        if target.shape != value.shape:
            raise wire.NotData(f"{name} changed the shape of an argument in place ({tuple(target.shape)} -> "
                               f"{tuple(value.shape)})")
        target.copy_(value.to(target.dtype))
    elif isinstance(target, torch.Generator) and isinstance(value, torch.Generator):
        target.set_state(value.get_state())
    elif isinstance(target, list) and isinstance(value, list):
        target[:] = value
    elif isinstance(target, dict) and isinstance(value, dict):
        target.clear()
        target.update(value)


# --------------------------------------------------------------------------- what the graded cells call
_SESSION: Session | None = None


def start() -> None:
    """The graded copy's first cell: the sandbox of this notebook, from the spec the grader wrote."""
    global _SESSION
    path = os.environ.get(SPEC_ENV)
    if not path:
        raise RuntimeError(f"{SPEC_ENV} is not set: this notebook must be graded by grading/autograde.py")
    spec = json.loads(Path(path).read_text(encoding="utf-8"))
    if _SESSION is not None:
        _SESSION.close()
    _SESSION = Session(spec)
    import atexit

    atexit.register(_SESSION.close)


def _session() -> Session:
    if _SESSION is None:
        raise RuntimeError("the sandbox was not started (the graded copy's first cell starts it)")
    return _SESSION


def _cut(text: str, limit: int, keep: str = "start") -> str:
    """``text`` cut to ``limit`` characters, saying so (``keep``: "start" or "end", the part kept)."""
    if len(text) <= limit:
        return text
    note = f"[... {len(text) - limit:,} characters cut by the grader ...]"
    return (text[:limit] + note) if keep == "start" else (note + text[-limit:])


def _error_text(error) -> str:
    """A learner cell's error as the cell shows it, cut to the grader's limits."""
    if not isinstance(error, dict):
        return "Error: malformed error"
    return (f"{_cut(str(error.get('ename')), 200)}: {_cut(str(error.get('evalue')), MAX_ERROR_TEXT)}\n\n"
            f"{_cut(str(error.get('traceback', '')), MAX_ERROR_TEXT, keep='end')}")


def _show(outputs: list[dict]) -> None:
    """A cell's outputs from the sandbox, shown here: at most MAX_OUTPUTS of them and MAX_TEXT characters in all,
    whatever the sandbox sent."""
    from IPython.display import display

    budget = MAX_TEXT
    for output in (outputs[:MAX_OUTPUTS] if isinstance(outputs, list) else []):
        if not isinstance(output, dict) or budget <= 0:
            continue
        if output.get("output_type") == "stream":
            stream = sys.stderr if output.get("name") == "stderr" else sys.stdout
            text = _cut(str(output.get("text", "")), budget, keep="end")
            budget -= len(text)
            stream.write(text)
            stream.flush()
        elif output.get("output_type") == "display_data":
            items = output.get("data") if isinstance(output.get("data"), dict) else {}
            data = {str(k)[:100]: str(v) for k, v in list(items.items())[:10]}
            size = sum(len(v) for v in data.values())
            if data and size <= budget:
                budget -= size
                display(data, raw=True)


def _bind(namespace: dict, names: list[str], cell: str) -> None:
    """The learner's names of a solution cell: fetched now and before every later cell (their answers)."""
    session = _session()
    for name in names:
        session.bound[name] = cell
        session.held.pop(name, None)
    refresh(namespace)


def _take(namespace: dict, names: list[str], cell: str) -> None:
    """The names a locked cell bound in the sandbox (the learner's own run), taken once as it ends: data only
    (a function or object there would still run the sandbox's code, which the learner's later cells can
    change), held by the grader from now on and never fetched again."""
    session = _session()
    for name in names:
        session.hold(name, cell)
    refresh(namespace)  # the learner's names first: a name of theirs this cell rebinds is the cell's now
    if not names:
        return
    try:
        values = session.get(list(names))
    except SandboxError as error:
        for name in names:
            namespace[name] = Refused(name, f"the sandbox could not be asked for it ({error})")
        return
    for name in names:
        if name not in values:
            namespace.pop(name, None)
            continue
        value = values[name]
        if isinstance(value, Refused):
            value = Refused(name, object.__getattribute__(value, "_reason").split(": ", 1)[-1])
        elif _has_handle(value):
            value = Refused(name, f"bound by the locked cell {cell} in the sandbox to something that runs there; the "
                                  "grader takes a locked cell's names as data only")
        namespace[name] = value


def _has_handle(value, depth: int = 0) -> bool:
    """Whether a value from the sandbox holds a handle to an object there (at any depth of its containers)."""
    import dataclasses

    if isinstance(value, _Remote):
        return True
    if depth > 20 or isinstance(value, Refused):
        return False
    if isinstance(value, dict):
        return any(_has_handle(k, depth + 1) or _has_handle(v, depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_has_handle(item, depth + 1) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(_has_handle(getattr(value, f.name, None), depth + 1) for f in dataclasses.fields(value))
    return False


_KERNEL_SESSION: Session | None = None


def _kernel_session() -> Session:
    """A second sandbox for kernels alone (started at the first kernel cell, reseeded at each)."""
    global _KERNEL_SESSION
    if _KERNEL_SESSION is None:
        spec = dict(_session().spec)
        scratch = Path(spec["scratch"]) / "kernels"
        scratch.mkdir(exist_ok=True)
        interpret = os.environ.get("TRITON_INTERPRET", "")
        spec.update(scratch=str(scratch), log=spec["log"] + ".kernels",
                    env={**spec.get("env", {}), **({"TRITON_INTERPRET": interpret} if interpret else {})})
        _KERNEL_SESSION = Session(spec)
        import atexit

        atexit.register(_KERNEL_SESSION.close)
    return _KERNEL_SESSION


def _bind_kernels(namespace: dict, grade_id: str, source: str, kernel_names: list[str]) -> None:
    """The kernel cell's ``@triton.jit`` functions, checked as the student wrote them and run alone in the
    kernel sandbox; each name here is then a RemoteKernel (or a refusal that says what is wrong)."""
    from grading import kernels

    found = kernels.extract(source, kernel_names)
    if found.problems:
        why = "; ".join(found.problems[:5])
        _log_event({"event": "refused", "what": f"the kernel cell {grade_id}: {why}"[:300]})
        for name in kernel_names:
            namespace[name] = Refused(name, f"not a Triton kernel the grader can run: {why}")
        return
    session = _kernel_session()
    session.current_cell = grade_id
    session.history.clear()
    reply = session.run(grade_id, found.source)
    if reply.get("error"):
        error = reply["error"]
        for name in kernel_names:
            namespace[name] = Refused(name, f"the kernel cell does not run: {_error_text(error).split(chr(10))[0]}")
        return
    tree = ast.parse(source)
    for name in kernel_names:
        node = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
        namespace[name] = RemoteKernel(session, name, ast.get_source_segment(source, node) or "")


def learner_cell(namespace: dict, grade_id: str, source: str, names: list[str], kernel_names: list[str] = ()) -> None:
    """A solution cell: run the learner's source in the sandbox, show its output, bind ``names``; a kernel
    cell's kernels (``kernel_names``) run alone in the kernel sandbox."""
    session = _session()
    session.current_cell = grade_id
    try:
        reply = session.run(grade_id, source)
    except SandboxError as error:
        raise SandboxError(f"solution cell {grade_id}: {error}") from None
    _show(reply.get("outputs", []))
    _bind(namespace, [n for n in names if n not in kernel_names], grade_id)
    if kernel_names:
        _bind_kernels(namespace, grade_id, source, list(kernel_names))
    error = reply.get("error")
    if error:
        raise LearnerCellError(_error_text(error))


def sandbox_cell(namespace: dict, name: str, source: str, names: list[str], show: bool) -> None:
    """A locked cell the sandbox runs too (the learner's code may need its state). ``show``: it runs
    only there, its output is the cell's and its ``names`` are bound here as data."""
    session = _session()
    if not show:
        session.start_run(name, source)
        return
    session.current_cell = name
    try:
        if session.gone:
            raise SandboxError(session.gone)
        reply = session.run(name, source)
    except SandboxError as error:
        for bound in names:  # the cell's names are the grader's now, and this run made none of them
            session.hold(bound, name)
            namespace[bound] = Refused(bound, f"the locked cell {name} did not run in the sandbox ({error})")
        raise SandboxError(f"cell {name}: {error}") from None
    error = reply.get("error")
    _show(reply.get("outputs", []))
    _take(namespace, names, name)
    if error:
        raise LearnerCellError(_error_text(error))


def push_after(namespace: dict, cell: str, names: list[str]) -> None:
    """A cell that runs only here (runs_in "grader"): once it has run, its names, where they are data, go to
    the sandbox too (before the next request), so the learner's later cells compute from the grader's own
    measurement. Here they stay the grader's own values: never fetched back from the sandbox."""
    session = _session()
    for name in names:
        session.hold(name, cell)
    session.pushes.append((namespace, cell, list(names)))


def refresh(namespace: dict, cell: str | None = None) -> None:
    """Before a cell of the grader's: every name of the learner's (bound by a solution cell, not by a locked cell
    since) gets the sandbox's current value (data or a handle); a name the sandbox no longer has is removed."""
    session = _session()
    if cell is not None:
        session.current_cell = cell
    if not session.bound:
        return
    names = sorted(session.bound)
    try:
        values = session.get(names)
    except SandboxError as error:
        for name in names:
            namespace[name] = Refused(name, f"the sandbox could not be asked for it ({error})")
        return
    for name in names:
        if name in values:
            value = values[name]
            if isinstance(value, Refused):
                value = Refused(name, object.__getattribute__(value, "_reason").split(": ", 1)[-1])
            namespace[name] = value
        else:
            namespace.pop(name, None)


def close() -> None:
    global _SESSION, _KERNEL_SESSION
    for session in (_SESSION, _KERNEL_SESSION):
        if session is not None:
            session.close()
    _SESSION = _KERNEL_SESSION = None
