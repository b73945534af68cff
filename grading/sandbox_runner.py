"""The submission's side of grading: runs inside the sandbox, executes cells, answers calls with data.

The grader's kernel (grading.remote) starts this program in the sandbox (grading.sandbox) with a copy
of grading/wire.py beside it and two pipe descriptors, and then asks, one message at a time:

    {"op": "run", "source": ..., "name": ...}      run a cell in an IPython shell -> its outputs, its error
    {"op": "get", "names": [...]}                  the values of names -> data, or handles to the
                                                   learner's functions, classes and objects
    {"op": "call", "target": id, "args", "kwargs"} call a handle -> the result as data, the arguments it
                                                   changed in place, or the exception it raised
    {"op": "getattr", "target": id, "name": ...}   an attribute of a handle

While it runs a call, the learner's code may call a callable the grader passed in (a fake engine, a
clock); that goes back as {"op": "callback"} and the grader answers it. Whatever this process does to
itself, what leaves it is data: the verdict is the grader's.

This file imports nothing of the grading package or of minillm at start (the sandbox has no
repository); torch is imported when a value needs it or the lab bans one of its operators.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
import traceback
import types
import warnings

import wire  # the copy beside this file

MAX_TEXT = 200_000          # characters of a cell's output sent back
MAX_ERROR_TEXT = 20_000
MAX_REFERENCES = 200        # distinct references a reply names (a loop over every check helper names each)

SPECIAL_METHODS = ("__len__", "__iter__", "__getitem__", "__contains__", "__call__")
OUTPUT_MIMES = ("text/plain", "text/html", "image/png", "text/markdown", "text/latex")


class Runner:
    def __init__(self, fd_in: int, fd_out: int):
        self.fd_in, self.fd_out = fd_in, fd_out
        self.objects: dict[int, object] = {}
        self.ids: dict[int, int] = {}  # id(obj) -> handle, so one object keeps one handle
        self.next_id = 1
        self.strict = False  # True while a call's result is encoded
        self.encoder = wire.Encoder(handle=self._handle)
        self.decoder = wire.Decoder(handle=self._callback)
        from IPython.core.interactiveshell import InteractiveShell

        self.shell = InteractiveShell.instance(colors="NoColor")
        self.shell.history_manager.enabled = False
        self.namespace = self.shell.user_ns

    # ---- handles of the learner's objects ----
    def _handle(self, value):
        """What is not plain data goes out as a handle (a function, a class, an object of a class the
        learner wrote), or is refused with the reason."""
        if isinstance(value, type):
            kind = "class"
        elif isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                                types.BuiltinMethodType)) or type(value).__name__ == "partial":
            kind = "function"
        elif isinstance(value, types.ModuleType):
            return self._refuse(f"a module ({getattr(value, '__name__', '?')}) is not plain data")
        elif isinstance(value, types.GeneratorType):
            return self._refuse("a generator is not plain data: return a list")
        elif getattr(type(value), "__module__", None) == "__main__":
            kind = "object"
        else:
            return self._refuse(f"a {type(value).__module__}.{type(value).__qualname__} object is not plain data")
        key = id(value)
        handle = self.ids.get(key)
        if handle is None or self.objects.get(handle) is not value:
            handle = self.next_id
            self.next_id += 1
            self.objects[handle] = value
            self.ids[key] = handle
        return {"$remote": handle, "kind": kind, **_describe(value, kind)}

    def _refuse(self, reason: str):
        """A name's value that is not data stays a refusal to report when used; a call's result is refused now."""
        if self.strict:
            raise wire.NotData(reason)
        return {"$refused": reason}

    def _callback(self, data):
        if "$callback" in data:
            return Callback(self, int(data["$callback"]), str(data.get("name", "callback")), list(data.get("methods", [])),
                            list(data.get("attributes", [])), bool(data.get("callable", True)))
        if "$remote" in data:  # a handle this side gave out, coming back
            handle = int(data["$remote"])
            if handle not in self.objects:
                raise wire.NotData(f"no object #{handle} in the sandbox")
            return self.objects[handle]
        raise wire.NotData(f"malformed value {str(data)[:80]!r}")

    # ---- the loop ----
    def send(self, header: dict, value=None, mutated=None, has_value: bool = False):
        """Write one reply; ``has_value``: encode ``value`` as its "value" (refused with NotData when it is not data)."""
        blobs: list[bytes] = []
        if has_value:
            try:
                encoded, blobs = self.encoder.encode(value)
            except wire.NotData as error:
                wire.write_frame(self.fd_out, {"op": "raise", "ename": "NotData", "evalue": str(error), "traceback": "",
                                               "references": header.get("references", [])})
                return
            header = {**header, "value": encoded}
        if mutated:
            changes = []
            for path, item in mutated:
                try:
                    encoded_item, item_blobs = self.encoder.encode(item)
                except wire.NotData:
                    continue
                changes.append({"path": path, "value": wire.shift_blobs(encoded_item, len(blobs))})
                blobs += item_blobs
            header["mutated"] = changes
        wire.write_frame(self.fd_out, header, blobs)

    def serve(self, until_return: bool = False):
        """Answer requests; with ``until_return``, stop at the grader's answer to a callback and return it."""
        while True:
            header, blobs = wire.read_frame(self.fd_in)
            op = header.get("op")
            if op in ("return", "raise") and until_return:
                return header, blobs
            try:
                if op == "run":
                    self.send(self.run_cell(str(header.get("source", ""))))
                elif op == "get":
                    names = [str(n) for n in header.get("names", [])]
                    values = {}
                    for name in names:
                        if name in self.namespace:
                            values[name] = self.namespace[name]
                    self.send({"op": "values"}, values, has_value=True)
                elif op == "set":  # data the grader measured, for the learner's cells after
                    values = self.decoder.decode(header.get("values", {"$dict": []}), blobs)
                    for name, value in values.items():
                        self.namespace[str(name)] = value
                    wire.write_frame(self.fd_out, {"op": "done"})
                elif op == "call":
                    self.call(header, blobs)
                elif op == "getattr":
                    target = self.objects[int(header["target"])]
                    self.send({"op": "return"}, getattr(target, str(header["name"])), has_value=True)
                elif op == "release":
                    for handle in header.get("targets", []):
                        obj = self.objects.pop(int(handle), None)
                        if obj is not None:
                            self.ids.pop(id(obj), None)
                elif op == "exit":
                    return None
                else:
                    self.send({"op": "raise", "ename": "ProtocolError", "evalue": f"unknown request {op!r}", "traceback": ""})
            except wire.ChannelClosed:
                raise
            except BaseException as error:  # noqa: BLE001 - every failure is an answer
                self.send(_raise(error))

    def run_cell(self, source: str) -> dict:
        from IPython.utils.capture import capture_output

        start = time.perf_counter()
        with capture_output(display=True) as captured:
            result = self.shell.run_cell(source, store_history=False)
        outputs = []
        if captured.stdout:
            outputs.append({"output_type": "stream", "name": "stdout", "text": captured.stdout[-MAX_TEXT:]})
        if captured.stderr:
            outputs.append({"output_type": "stream", "name": "stderr", "text": captured.stderr[-MAX_TEXT:]})
        budget = MAX_TEXT
        for rich in captured.outputs:
            data = {mime: value for mime, value in (rich.data or {}).items() if mime in OUTPUT_MIMES and isinstance(value, str)}
            size = sum(len(v) for v in data.values())
            if data and size <= budget:
                budget -= size
                outputs.append({"output_type": "display_data", "data": data})
        error = result.error_before_exec or result.error_in_exec
        reply = {"op": "ran", "outputs": outputs, "seconds": time.perf_counter() - start, "error": None,
                 "references": _references_used()}
        if error is not None:
            reply["error"] = _raise(error)
        return reply

    def call(self, header: dict, blobs: list[bytes]):
        target = self.objects.get(int(header.get("target", -1)))
        if target is None:
            raise wire.NotData(f"no object #{header.get('target')} in the sandbox")
        args = self.decoder.decode(header.get("args", []), blobs)
        kwargs = self.decoder.decode(header.get("kwargs", {"$dict": []}), blobs)
        watched = _watch(args, kwargs)
        method = header.get("method")
        stdout, stderr = sys.stdout, sys.stderr
        capture = io.StringIO()
        sys.stdout, sys.stderr = capture, capture
        try:
            if method == "__iter__":
                result = list(iter(target))
            else:
                function = getattr(target, method) if method else target
                result = function(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001
            sys.stdout, sys.stderr = stdout, stderr
            reply = _raise(error)
            reply["stdout"] = capture.getvalue()[-MAX_TEXT:]
            wire.write_frame(self.fd_out, {**reply, "references": _references_used()})
            return
        sys.stdout, sys.stderr = stdout, stderr
        header = {"op": "return", "stdout": capture.getvalue()[-MAX_TEXT:], "references": _references_used()}
        self.strict = True
        try:
            self._reply_to_call(header, result, watched)
        finally:
            self.strict = False

    def _reply_to_call(self, header: dict, result, watched) -> None:
        same = next((path for path, value, kind, _ in watched if value is result and kind in ("tensor", "container")), None)
        if same is not None and not isinstance(result, (int, float, str, bool, type(None))):
            # the call returned one of its arguments (grown in place): the grader hands back its own object
            header["returns_argument"] = same
            self.send(header, None, _changed(watched), has_value=True)
            return
        self.send(header, result, _changed(watched), has_value=True)


class Callback:
    """An object of the grader's, passed into the learner's code (a clock, a fake engine, a tokenizer): a
    method call or an attribute read asks the grader, which runs it on its side and answers with data.
    Only the methods and attributes the grader lists are there."""

    def __init__(self, runner: Runner, target: int, name: str, methods: list[str], attributes=(), is_callable=True):
        object.__setattr__(self, "_runner", runner)
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_attributes", frozenset(attributes))
        object.__setattr__(self, "_callable", is_callable)
        for method in methods:
            object.__setattr__(self, method, _BoundCallback(runner, target, name, method))

    def __call__(self, *args, **kwargs):
        if not self._callable:
            raise TypeError(f"the grader's {self._name} is not callable")
        return _ask(self._runner, self._target, None, args, kwargs)

    def __getattr__(self, name):
        if name in object.__getattribute__(self, "_attributes"):
            return _ask(self._runner, self._target, None, (), {}, attribute=name)
        raise AttributeError(f"the grader's {object.__getattribute__(self, '_name')} has no attribute {name!r} here")

    def __len__(self):
        method = self.__dict__.get("__len__")
        if method is None:
            raise TypeError(f"the grader's {self._name} has no len()")
        return method()

    def __repr__(self):
        return f"<the grader's {self._name}>"


class _BoundCallback:
    def __init__(self, runner, target, name, method):
        self._runner, self._target, self._name, self._method = runner, target, name, method

    def __call__(self, *args, **kwargs):
        return _ask(self._runner, self._target, self._method, args, kwargs)

    def __repr__(self):
        return f"<the grader's {self._name}.{self._method}>"


def _ask(runner: Runner, target: int, method, args, kwargs, attribute=None):
    args_json, blobs = runner.encoder.encode(list(args))
    kwargs_json, more = runner.encoder.encode(dict(kwargs))
    wire.write_frame(runner.fd_out, {"op": "callback", "target": target, "method": method, "attribute": attribute,
                                     "args": args_json, "kwargs": wire.shift_blobs(kwargs_json, len(blobs))}, blobs + more)
    header, reply_blobs = runner.serve(until_return=True)
    if header["op"] == "raise":
        error = {"AttributeError": AttributeError, "TypeError": TypeError, "ValueError": ValueError,
                 "KeyError": KeyError, "IndexError": IndexError}.get(header.get("ename"), RuntimeError)
        raise error(f"the grader's {'callback' if method is None else method} raised {header.get('ename')}: "
                    f"{header.get('evalue')}")
    return runner.decoder.decode(header.get("value"), reply_blobs)


# ---- helpers ----
def _describe(value, kind: str) -> dict:
    """Name, docstring, signature and members (methods found on the class, without running the
    learner's properties) of a handle's object."""
    import inspect

    info = {"name": str(getattr(value, "__name__", None) or type(value).__name__)[:200],
            "doc": str(getattr(value, "__doc__", "") or "")[:2000]}
    if kind in ("function", "class"):
        try:
            signature = inspect.signature(value)
            info["parameters"] = [[p.name, p.kind.name, p.default is not inspect.Parameter.empty,
                                   repr(p.default)[:80] if p.default is not inspect.Parameter.empty else ""]
                                  for p in signature.parameters.values()]
        except (TypeError, ValueError):
            pass
    members = {}
    if kind in ("class", "object"):
        cls = value if kind == "class" else type(value)
        for name in dir(cls):
            if name.startswith("__") and name not in SPECIAL_METHODS:
                continue
            try:
                member = inspect.getattr_static(cls, name)
            except AttributeError:
                continue
            is_method = isinstance(member, (types.FunctionType, staticmethod, classmethod)) or (
                callable(member) and not isinstance(member, type))
            members[name] = "method" if is_method else "value"
        if kind == "object":
            for name in getattr(value, "__dict__", {}) or {}:
                members.setdefault(str(name), "value")
    info["members"] = members
    return info


def _watch(args, kwargs) -> list:
    """What a call may change in place: every tensor (by its version counter), every generator (by its
    state) and every list or dict of plain values (by its encoding) among the arguments."""
    watched = []
    torch = sys.modules.get("torch")

    def walk(value, path, depth):
        if depth > 8:
            return
        if torch is not None and isinstance(value, torch.Tensor):
            watched.append((path, value, "tensor", value._version))
        elif torch is not None and isinstance(value, torch.Generator):
            watched.append((path, value, "generator", bytes(value.get_state().numpy().tobytes())))
        elif isinstance(value, (list, dict)):
            items = enumerate(value) if isinstance(value, list) else value.items()
            has_tensor = False
            for key, item in list(items):
                if torch is not None and isinstance(item, (torch.Tensor, torch.Generator)):
                    has_tensor = True
                if isinstance(key, (int, str)):
                    walk(item, path + [key], depth + 1)
            if not has_tensor:
                try:
                    watched.append((path, value, "container", json.dumps(wire.Encoder().encode(value)[0])))
                except (wire.NotData, TypeError, ValueError):
                    pass
        elif isinstance(value, tuple):
            for index, item in enumerate(value):
                walk(item, path + [index], depth + 1)

    for index, arg in enumerate(args):
        walk(arg, [index], 0)
    for key, arg in kwargs.items():
        walk(arg, [str(key)], 0)
    return watched


def _changed(watched) -> list:
    changed = []
    for path, value, kind, before in watched:
        if kind == "tensor":
            if value._version != before:
                changed.append((path, value))
        elif kind == "generator":
            if bytes(value.get_state().numpy().tobytes()) != before:
                changed.append((path, value))
        else:
            try:
                now = json.dumps(wire.Encoder().encode(value)[0])
            except (wire.NotData, TypeError, ValueError):
                continue
            if now != before:
                changed.append((path, value))
    return changed


def _raise(error: BaseException) -> dict:
    kind = type(error)
    text = "".join(traceback.format_exception(kind, error, error.__traceback__))
    try:
        message = str(error)
    except Exception:  # noqa: BLE001 - a __str__ that raises
        message = f"<{kind.__name__}>"
    return {"op": "raise", "ename": str(getattr(kind, "__name__", "Error"))[:200],
            "builtin": kind.__module__ == "builtins", "evalue": message[:MAX_ERROR_TEXT],
            "traceback": text[-MAX_ERROR_TEXT:]}


def _references_used() -> list[str]:
    module = sys.modules.get("_minillm_reference")
    if module is None:
        return []
    used, module.USED[:] = list(dict.fromkeys(module.USED)), []
    return used[:MAX_REFERENCES]


def _ban_operators(bans: dict[str, str]) -> None:
    """Make each banned torch operator raise, at the dispatcher, so every route to it does (the Python
    function, torch._C, torch.ops). The registration's handle is kept where no Python code can reach it."""
    if not bans:
        return
    import ctypes

    import torch

    import _minillm_reference

    handles = {}
    for op, message in bans.items():
        name, _, key = op.partition("@")
        namespace, _, opname = name.partition("::")
        key = key or "CompositeImplicitAutograd"
        handle = handles.get((namespace, key))
        if handle is None:
            handle = handles[(namespace, key)] = torch._C._dispatch_library("IMPL", namespace, "", "<minillm grading>", 0)

        def refuse(*args, _message=message, _op=op, **kwargs):
            _minillm_reference.USED.append(_op)
            raise _minillm_reference.ReferenceUnavailable(_message)

        with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
            warnings.simplefilter("ignore")
            handle.impl(opname, key, refuse, False)
    for handle in handles.values():
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(handle))  # never freed, never referenced from Python
    handles.clear()


def main() -> int:
    spec = json.loads(os.environ.pop("MINILLM_SANDBOX_SPEC", "{}"))
    fd_in, fd_out = int(spec["fd_in"]), int(spec["fd_out"])
    os.set_inheritable(fd_in, False)
    os.set_inheritable(fd_out, False)
    _ban_operators(spec.get("bans", {}))
    runner = Runner(fd_in, fd_out)
    wire.write_frame(fd_out, {"op": "ready", "pid": os.getpid()})
    try:
        runner.serve()
    except wire.ChannelClosed:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
