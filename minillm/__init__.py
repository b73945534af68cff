"""minillm: a small, real LLM inference engine, and the course built on it."""

from .config import EngineConfig
from .llm import LLM
from .models.default import default_model_path
from .outputs import CompletionOutput, RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput", "default_model_path"]
__version__ = "0.1.0"
