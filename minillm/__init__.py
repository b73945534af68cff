"""minillm: a small, real LLM inference engine, and the course built on it.

The engine's names load on first use (``from minillm import LLM`` imports torch then), so a
module that needs none of them, such as the grading guard in a student's kernel, starts fast.
"""

import importlib

_EXPORTS = {
    "EngineConfig": ".config",
    "LLM": ".llm",
    "LoRARequest": ".lora",
    "default_model_path": ".models.default",
    "CompletionOutput": ".outputs",
    "RequestOutput": ".outputs",
    "SamplingParams": ".sampling",
    "StructuredOutputs": ".structured",
}

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "EngineConfig", "RequestOutput", "CompletionOutput",
           "LoRARequest", "default_model_path"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'minillm' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
