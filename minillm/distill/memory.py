"""The memory budget: weights + KV cache at a context, against devices' RAM, and the tokens/s memory bandwidth allows.

    models = [model_memory(LLM(path, weight_dtype=d), f"student int8") for ...]
    rows = memory_table(models, devices(), context=2048)
    print(format_memory_table(rows, context=2048))

A decoding step reads every weight once and, for attention, the whole KV cache written so far, so at
batch 1 the step cannot take less than (weight bytes + KV bytes at the context) / bandwidth: the
bandwidth bound on tokens/s is bandwidth / bytes read per token. The bound counts all the weights
(the tied embedding table is read whole as the head), so it slightly overstates the bytes of a model
with an untied embedding, of which one row is read. A model fits a device when its resident bytes
(weights + KV at the context) are at most the device's RAM; the operating system and the app need
some of it too, so a model right at the limit does not fit in practice.

The reference devices' RAM and bandwidth are typical figures (peak bandwidth from the memory's
data sheet), labelled as such; this machine's RAM is read from /proc/meminfo (psutil elsewhere) and its
bandwidth measured by minillm.hardware.measure_memory_bandwidth.
"""

from __future__ import annotations

import dataclasses

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    ram_bytes: int
    bandwidth: float                    # bytes/s
    source: str                         # where the two figures come from


# Typical devices of each RAM size, with their memory's peak bandwidth (not measured here).
REFERENCE_DEVICES = (
    Device("phone 4 GB", 4 * GIB, 17.0e9, "typical: LPDDR4X-4266, 32-bit bus, peak 17 GB/s"),
    Device("laptop 8 GB", 8 * GIB, 51.2e9, "typical: DDR4-3200, two 64-bit channels, peak 51.2 GB/s"),
    Device("laptop 16 GB", 16 * GIB, 100.0e9, "typical: Apple M2 class, LPDDR5-6400, 128-bit, peak 100 GB/s"),
)


@dataclasses.dataclass(frozen=True)
class ModelMemory:
    name: str
    weight_bytes: int                   # as stored (quantized matrices with their scales)
    kv_bytes_per_token: int             # K and V of every layer for one token

    def kv_bytes(self, context: int) -> int:
        return self.kv_bytes_per_token * context

    def resident_bytes(self, context: int) -> int:
        """Weights + the KV cache of one sequence at `context` tokens."""
        return self.weight_bytes + self.kv_bytes(context)

    def bytes_per_token(self, context: int) -> int:
        """What one decode step reads at `context` tokens: every weight and the whole KV cache."""
        return self.weight_bytes + self.kv_bytes(context)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_value: float) -> int:
    """2 (K and V) x layers x KV heads x head dim x bytes per value."""
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    if not bytes_per_value > 0:
        raise ValueError(f"bytes_per_value={bytes_per_value!r} must be > 0")
    return int(2 * num_layers * num_kv_heads * head_dim * bytes_per_value)


def model_memory(llm, name: str) -> ModelMemory:
    """A loaded minillm engine's weight bytes as stored and its KV bytes per token."""
    return ModelMemory(name, int(llm.weight_bytes), int(llm.kv_bytes_per_token))


def machine_ram_bytes() -> int:
    """This machine's RAM: MemTotal of /proc/meminfo, else psutil's total; 0 when neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        return 0


def this_machine(bandwidth: float | None = None) -> Device:
    """This machine as a Device: RAM from the system, bandwidth measured (a sum over 256 MB) unless given."""
    from ..hardware import cpu_name, measure_memory_bandwidth

    measured = bandwidth is None
    bandwidth = measure_memory_bandwidth("cpu") if measured else bandwidth
    source = ("measured: RAM from the system, read bandwidth by minillm.hardware" if measured
              else "RAM from the system, bandwidth given")
    return Device("this machine", machine_ram_bytes(), float(bandwidth), f"{cpu_name()}; {source}")


def devices(bandwidth: float | None = None) -> list[Device]:
    """The reference devices (4, 8, 16 GB) and this machine."""
    return [*REFERENCE_DEVICES, this_machine(bandwidth)]


def memory_table(models: list[ModelMemory], device_list: list[Device], context: int = 2048) -> list[dict]:
    """One row per model: its bytes at `context` and, per device, whether it fits and the bandwidth-bound tok/s."""
    if not (isinstance(context, int) and context >= 1):
        raise ValueError(f"context={context!r} must be an integer >= 1 (tokens in the KV cache)")
    if not models or not device_list:
        raise ValueError("memory_table needs at least one model and one device")
    rows = []
    for model in models:
        resident, per_token = model.resident_bytes(context), model.bytes_per_token(context)
        cells = {}
        for device in device_list:
            fits = resident <= device.ram_bytes
            cells[device.name] = {"fits": fits, "bound_tok_s": device.bandwidth / per_token if fits else None}
        rows.append({"model": model.name, "weight_bytes": model.weight_bytes, "kv_bytes": model.kv_bytes(context),
                     "resident_bytes": resident, "bytes_per_token": per_token, "devices": cells})
    return rows


def format_memory_table(rows: list[dict], device_list: list[Device], context: int) -> str:
    """The table: MB of weights, KV and both, then per device the bound tok/s ('-' where the model does not fit)."""
    head = f"{'model':<22}{'weights MB':>11}{'KV MB':>8}{'total MB':>10}"
    head += "".join(f"{d.name[:18]:>20}" for d in device_list)
    lines = [f"memory at a context of {context} tokens (one sequence); per device: the bandwidth bound on "
             "decode tok/s (bandwidth / bytes read per token), '-' where weights + KV exceed its RAM", head]
    for row in rows:
        line = (f"{row['model']:<22}{row['weight_bytes'] / 1e6:>11.1f}{row['kv_bytes'] / 1e6:>8.1f}"
                f"{row['resident_bytes'] / 1e6:>10.1f}")
        for device in device_list:
            bound = row["devices"][device.name]["bound_tok_s"]
            line += f"{'-' if bound is None else f'{bound:,.0f}':>20}"
        lines.append(line)
    lines.append("devices:")
    lines += [f"  {d.name}: {d.ram_bytes / GIB:.1f} GiB RAM, {d.bandwidth / 1e9:.1f} GB/s ({d.source})"
              for d in device_list]
    return "\n".join(lines)
