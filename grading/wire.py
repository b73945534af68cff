"""The data-only channel between the grader and a sandboxed submission: frames of JSON and raw bytes.

Both sides of grading.remote (the grader's kernel) and grading.sandbox_runner (the submission, in
the sandbox) speak it; the runner gets a copy of this file, since the sandbox sees no repository.
Nothing is pickled and nothing received is executed: a value is rebuilt from JSON and from the bytes
of tensors, so an object the submission made can never reach the grader, only its data.

Plain data is ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``, lists, tuples,
sets, dicts of them (any plain keys), ``torch.Tensor`` (CPU bytes; the device is kept), numpy arrays,
``torch.dtype`` / ``torch.device`` / ``torch.Size``, ``slice``, ``Ellipsis``, a ``torch.Generator``'s
state, and the dataclasses listed in ``DATA_CLASSES`` (rebuilt from their fields). Anything else is
handed to the side's ``handle`` hook (the grader makes callbacks of its own callables, the runner makes
handles of the learner's functions, classes and objects) or refused with :class:`NotData`.

A frame: 8 bytes of total length, 4 of header length, the header (UTF-8 JSON with ``"blobs"``, the
byte length of each tensor), then the tensors' bytes in order. A frame is bounded on both sides, before
anything of it is parsed: ``MAX_FRAME_BYTES`` in all, ``MAX_HEADER_BYTES`` of JSON, ``MAX_VALUES`` JSON
values (counted by their brackets and separators outside strings), so that what one side sends costs the
other at most a small, fixed amount of memory; the bytes of a tensor become the tensor without a copy.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import re
import select
import struct
import sys
import time

# One message; a larger one is refused. The largest tensors the labs pass are far smaller (the default model's
# embedding table in fp32 is 113 MB; a test engine's KV pool a few MB).
MAX_FRAME_BYTES = 1 << 30
MAX_HEADER_BYTES = 64 << 20    # the JSON part of one message (a cell's outputs are cut to 200,000 characters each)
MAX_VALUES = 1_000_000         # JSON values one message may decode into (each costs the reader 30-100 bytes)
MAX_DEPTH = 64                 # nesting of lists / dicts

# Dataclasses rebuilt by field on the receiving side: pure data whose constructors only validate.
DATA_CLASSES = {
    "minillm.sampling:SamplingParams",
    "minillm.structured:StructuredOutputs",
    "minillm.layers.attention:AttentionMetadata",
    "minillm.outputs:RequestOutput",
    "minillm.outputs:CompletionOutput",
    "minillm.outputs:Logprob",
    "minillm.engine.metrics:RequestMetrics",
    "minillm.engine.metrics:RunStats",
    "minillm.engine.metrics:StepStats",
    "minillm.engine.metrics:SpecStats",
    "minillm.models.config:ModelConfig",
    "minillm.config:EngineConfig",
    "minillm.fleet.policies:FleetState",
    "minillm.bench.cost:CostRow",
    "minillm.bench.cost:CostStage",
}


class NotData(TypeError):
    """A value that is not plain data crossed (or tried to cross) the channel."""


class Replace:
    """Returned by an encoder's ``handle`` hook: encode ``value`` in place of what was not data."""

    def __init__(self, value):
        self.value = value


class ChannelClosed(EOFError):
    """The other side closed the channel (it exited or died)."""


def _type_name(value) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else kind.__qualname__


def _torch():
    return sys.modules.get("torch")


# ----------------------------------------------------------------------------- encode
class Encoder:
    """``encode(value) -> (json_value, blobs)``; ``handle(value)`` is called for what is not data."""

    def __init__(self, handle=None):
        self.handle = handle

    def encode(self, value) -> tuple[object, list[bytes]]:
        blobs: list[bytes] = []
        return self._enc(value, blobs, 0), blobs

    def _enc(self, value, blobs, depth):
        if depth > MAX_DEPTH:
            raise NotData(f"nested deeper than {MAX_DEPTH} levels")
        kind = type(value)
        if value is None or kind is bool or kind is str:
            return value
        if kind is int:
            return value if -(2 ** 53) < value < 2 ** 53 else {"$int": str(value)}
        if kind is float:
            return value if math.isfinite(value) else {"$float": repr(value)}
        if kind is complex:
            return {"$complex": [self._enc(value.real, blobs, depth), self._enc(value.imag, blobs, depth)]}
        if kind is list:
            return [self._enc(item, blobs, depth + 1) for item in value]
        if kind is tuple:
            return {"$tuple": [self._enc(item, blobs, depth + 1) for item in value]}
        if isinstance(value, tuple) and hasattr(kind, "_fields") and f"{kind.__module__}:{kind.__qualname__}" in DATA_CLASSES:
            return {"$namedtuple": f"{kind.__module__}:{kind.__qualname__}",
                    "fields": [self._enc(item, blobs, depth + 1) for item in tuple.__iter__(value)]}
        if kind in (set, frozenset):
            return {"$set": [self._enc(item, blobs, depth + 1) for item in value], "frozen": kind is frozenset}
        if kind is dict:
            return {"$dict": [[self._enc(k, blobs, depth + 1), self._enc(v, blobs, depth + 1)] for k, v in value.items()]}
        if kind is bytes or kind is bytearray:
            blobs.append(bytes(value))
            return {"$bytes": len(blobs) - 1}
        if kind is slice:
            return {"$slice": [self._enc(value.start, blobs, depth), self._enc(value.stop, blobs, depth),
                               self._enc(value.step, blobs, depth)]}
        if value is Ellipsis:
            return {"$ellipsis": True}
        torch = _torch()
        if torch is not None:
            if kind is torch.Tensor or kind is torch.nn.Parameter:
                return self._tensor(value, blobs)
            if kind is torch.dtype:
                return {"$dtype": str(value).removeprefix("torch.")}
            if kind is torch.device:
                return {"$device": str(value)}
            if kind is torch.Size:
                return {"$tuple": [int(n) for n in value]}
            if kind is torch.Generator:
                blobs.append(value.get_state().numpy().tobytes())
                return {"$generator": len(blobs) - 1, "device": str(value.device)}
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            if kind is numpy.ndarray:
                array = numpy.ascontiguousarray(value)
                if array.dtype.hasobject:
                    raise NotData("a numpy array of Python objects is not plain data")
                blobs.append(array.tobytes())
                return {"$ndarray": len(blobs) - 1, "dtype": array.dtype.str, "shape": list(array.shape)}
            if isinstance(value, numpy.generic) and kind.__module__ == "numpy":
                return self._enc(value.item(), blobs, depth)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            name = f"{kind.__module__}:{kind.__qualname__}"
            if name in DATA_CLASSES:
                fields = {f.name: self._enc(getattr(value, f.name), blobs, depth + 1)
                          for f in dataclasses.fields(value) if f.init}
                return {"$dataclass": name, "fields": fields}
        if self.handle is not None:
            handled = self.handle(value)
            return self._enc(handled.value, blobs, depth + 1) if isinstance(handled, Replace) else handled
        raise NotData(f"a {_type_name(value)} is not plain data")

    def _tensor(self, tensor, blobs):
        torch = _torch()
        device = str(tensor.device)
        flat = tensor.detach().to("cpu").contiguous()
        if flat.dtype in (torch.bfloat16, torch.float16) or str(flat.dtype).startswith("torch.float8"):
            raw = flat.view(torch.uint8) if flat.dim() else flat.reshape(1).view(torch.uint8)
        else:
            raw = flat
        blobs.append(raw.numpy().tobytes() if raw.numel() else b"")
        return {"$tensor": len(blobs) - 1, "dtype": str(flat.dtype).removeprefix("torch."),
                "shape": list(flat.shape), "device": device}


# ----------------------------------------------------------------------------- decode
class Decoder:
    """``decode(json_value, blobs) -> value``; ``handle(json_dict)`` rebuilds the side's handles."""

    def __init__(self, handle=None, devices: bool = True):
        self.handle = handle
        self.devices = devices  # move tensors back to their device (both sides on one machine)

    def decode(self, data, blobs: list[bytes]):
        """The value ``data`` (decoded JSON) stands for. A tensor or array takes its bytes from ``blobs`` without a
        copy where they are a bytearray (as :func:`read_frame` gives them): such bytes serve one value only."""
        try:
            return self._dec(data, blobs, 0)
        except RecursionError:
            raise NotData(f"nested deeper than {MAX_DEPTH} levels") from None

    def _dec(self, data, blobs, depth):
        if depth > MAX_DEPTH:
            raise NotData(f"nested deeper than {MAX_DEPTH} levels")
        if data is None or isinstance(data, (bool, str, int, float)):
            return data
        if isinstance(data, list):
            return [self._dec(item, blobs, depth + 1) for item in data]
        if not isinstance(data, dict) or len(data) == 0:
            raise NotData(f"malformed value {str(data)[:80]!r}")
        if "$int" in data:
            return int(data["$int"])
        if "$float" in data:
            text = data["$float"]
            if text not in ("nan", "inf", "-inf"):
                raise NotData(f"malformed float {text!r}")
            return float(text)
        if "$complex" in data:
            real, imag = (self._dec(part, blobs, depth) for part in data["$complex"])
            return complex(real, imag)
        if "$tuple" in data:
            return tuple(self._dec(item, blobs, depth + 1) for item in data["$tuple"])
        if "$set" in data:
            items = [self._dec(item, blobs, depth + 1) for item in data["$set"]]
            return frozenset(items) if data.get("frozen") else set(items)
        if "$dict" in data:
            return {self._dec(k, blobs, depth + 1): self._dec(v, blobs, depth + 1) for k, v in data["$dict"]}
        if "$bytes" in data:
            return bytes(_blob(blobs, data["$bytes"]))
        if "$slice" in data:
            return slice(*(self._dec(part, blobs, depth) for part in data["$slice"]))
        if "$ellipsis" in data:
            return Ellipsis
        if "$tensor" in data:
            return self._tensor(data, blobs)
        if "$dtype" in data:
            return _dtype(data["$dtype"])
        if "$device" in data:
            import torch

            return torch.device(str(data["$device"]))
        if "$generator" in data:
            import torch

            generator = torch.Generator(device=str(data.get("device", "cpu")))
            generator.set_state(torch.frombuffer(bytearray(_blob(blobs, data["$generator"])), dtype=torch.uint8))
            return generator
        if "$ndarray" in data:
            import numpy

            dtype = numpy.dtype(str(data["dtype"]))
            if dtype.hasobject:
                raise NotData("a numpy array of Python objects is not plain data")
            shape = _shape(data["shape"], dtype.itemsize, blobs, data["$ndarray"])
            return numpy.frombuffer(_take(blobs, data["$ndarray"]), dtype=dtype).reshape(shape)
        if "$namedtuple" in data:
            cls = _data_class(str(data["$namedtuple"]))
            return cls(*(self._dec(item, blobs, depth + 1) for item in data["fields"]))
        if "$dataclass" in data:
            cls = _data_class(str(data["$dataclass"]))
            fields = {str(k): self._dec(v, blobs, depth + 1) for k, v in data["fields"].items()}
            return cls(**fields)
        if self.handle is not None:
            return self.handle(data)
        raise NotData(f"malformed value {str(data)[:80]!r}")

    def _tensor(self, data, blobs):
        import torch

        dtype = _dtype(data["dtype"])
        shape = _shape(data["shape"], torch.empty((), dtype=dtype).element_size(), blobs, data["$tensor"])
        raw = _take(blobs, data["$tensor"])
        if not raw:
            tensor = torch.empty(shape, dtype=dtype)
        elif dtype in (torch.bfloat16, torch.float16) or str(dtype).startswith("torch.float8"):
            tensor = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
        else:
            tensor = torch.frombuffer(raw, dtype=dtype).reshape(shape)
        device = str(data.get("device", "cpu"))
        if self.devices and device != "cpu":
            tensor = tensor.to(device)
        return tensor


def _data_class(name: str):
    if name not in DATA_CLASSES:
        raise NotData(f"{name} is not one of the classes that cross as data")
    module, _, qualname = name.partition(":")
    return getattr(importlib.import_module(module), qualname)


_DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "bool",
           "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")


def _dtype(name: str):
    import torch

    if name not in _DTYPES or not hasattr(torch, name):
        raise NotData(f"unknown tensor dtype {name!r}")
    return getattr(torch, name)


_TAKEN = object()  # a blob a tensor or array now owns


def _blob(blobs: list[bytes], index) -> bytes:
    if type(index) is not int or not 0 <= index < len(blobs):
        raise NotData(f"a value refers to missing bytes #{index}")
    if blobs[index] is _TAKEN:
        raise NotData(f"two values refer to the same bytes #{index}")
    return blobs[index]


def _take(blobs: list, index) -> bytearray:
    """The blob as a writable buffer for one tensor or array: a bytearray the message brought is taken (no copy),
    other bytes are copied."""
    raw = _blob(blobs, index)
    if type(raw) is bytearray and isinstance(blobs, list):
        blobs[index] = _TAKEN
        return raw
    return bytearray(raw)


def _shape(shape, itemsize: int, blobs: list, index) -> list[int]:
    """A tensor's shape, checked against its bytes: a shape never makes the reader allocate more than it received."""
    if not isinstance(shape, list) or len(shape) > MAX_DEPTH or not all(type(n) is int and n >= 0 for n in shape):
        raise NotData(f"malformed tensor shape {str(shape)[:80]}")
    numel = math.prod(shape)
    size = len(_blob(blobs, index))
    if numel * itemsize != size:
        raise NotData(f"a tensor of shape {shape} takes {numel * itemsize:,} bytes, its message brought {size:,}")
    return shape


# ----------------------------------------------------------------------------- frames
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


_SEPARATORS = (b"[", b"{", b",", b":")


def count_values(head: bytes, stop: int | None = None) -> int:
    """How many JSON values a header may decode into, at most: one, and one more per bracket, brace, comma
    and colon outside its strings. Nothing is parsed or copied; ``stop``: return as soon as the count is
    past it."""
    count = 1 + sum(head.count(char) for char in _SEPARATORS)
    if b'"' not in head or (stop is not None and count <= stop):
        return count  # no string can hold one of them, or even counting those inside strings it is not past
    count, at = 1, 0
    for string in _STRING.finditer(head):
        count += sum(head.count(char, at, string.start()) for char in _SEPARATORS)
        at = string.end()
        if stop is not None and count > stop:
            return count
    return count + sum(head.count(char, at) for char in _SEPARATORS)


def _check_header(head: bytes) -> None:
    if len(head) > MAX_HEADER_BYTES:
        raise NotData(f"a message header of {len(head):,} bytes is over the channel's limit of {MAX_HEADER_BYTES:,}")
    if len(head) > MAX_VALUES:  # shorter, it cannot hold more values than bytes
        values = count_values(head, stop=MAX_VALUES)
        if values > MAX_VALUES:
            raise NotData(f"a message of {values:,} or more JSON values is over the channel's limit of "
                          f"{MAX_VALUES:,} values")


def write_frame(fd: int, header: dict, blobs: list[bytes] = ()) -> None:
    """One message: ``header`` (JSON-able; its "blobs" key is set here) and the raw ``blobs``. NotData, and
    nothing written, when the other side would refuse it (over a limit)."""
    header = {**header, "blobs": [len(b) for b in blobs]}
    head = json.dumps(header, separators=(",", ":"), allow_nan=False).encode("utf-8")
    total = 4 + len(head) + sum(len(b) for b in blobs)
    if total > MAX_FRAME_BYTES:
        raise NotData(f"a message of {total:,} bytes is over the channel's limit of {MAX_FRAME_BYTES:,}")
    _check_header(head)
    _write_all(fd, struct.pack(">QI", total, len(head)) + head)
    for blob in blobs:
        _write_all(fd, blob)


def read_frame(fd: int, deadline: float | None = None) -> tuple[dict, list[bytearray]]:
    """The next message as (header, blobs); ChannelClosed at end of file, NotData when malformed or over a
    limit (checked before it is read or parsed), TimeoutError when ``deadline`` (time.monotonic()) passes
    before all of it came."""
    total, head_len = struct.unpack(">QI", _read_exact(fd, 12, deadline))
    if total > MAX_FRAME_BYTES or head_len > total - 4:
        raise NotData(f"a message of {total:,} bytes (header {head_len:,}) is over the channel's limit of "
                      f"{MAX_FRAME_BYTES:,} bytes")
    if head_len > MAX_HEADER_BYTES:
        raise NotData(f"a message header of {head_len:,} bytes is over the channel's limit of {MAX_HEADER_BYTES:,}")
    head = _read_exact(fd, head_len, deadline)
    _check_header(head)
    try:
        header = json.loads(head.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise NotData(f"a message header is not JSON: {str(error)[:200]}") from None
    except RecursionError:
        raise NotData(f"a message header is nested too deep (the limit is {MAX_DEPTH} levels)") from None
    del head
    sizes = header.get("blobs", []) if isinstance(header, dict) else None
    if not isinstance(sizes, list) or not all(type(n) is int and n >= 0 for n in sizes) \
            or sum(sizes) != total - 4 - head_len:
        raise NotData("a message's byte counts do not add up")
    return header, [_read_exact(fd, n, deadline) for n in sizes]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _read_exact(fd: int, size: int, deadline: float | None = None) -> bytearray:
    """``size`` bytes from ``fd``; memory grows with what arrives, not with what a length field claims."""
    data = bytearray()
    while len(data) < size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(size - len(data), 1 << 24))
        if not chunk:
            raise ChannelClosed("the other side closed the channel")
        data += chunk
    return data


def shift_blobs(data, offset: int):
    """``data`` (an encoded value) with its byte references moved by ``offset``: two encoded values sent
    in one message share one list of blobs."""
    if offset == 0:
        return data
    if isinstance(data, list):
        return [shift_blobs(item, offset) for item in data]
    if isinstance(data, dict):
        return {key: (item + offset if key in ("$tensor", "$bytes", "$ndarray", "$generator") and isinstance(item, int)
                      else shift_blobs(item, offset)) for key, item in data.items()}
    return data
