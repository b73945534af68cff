"""minillm.serve: an OpenAI-compatible HTTP server on the engine (`minillm serve`, or serve_in_thread(llm))."""

from .app import build_app
from .async_engine import AsyncEngine, EngineStoppedError
from .server import ServerHandle, default_model_name, serve_in_thread
from .stream import RequestStream, StreamEvent

__all__ = ["AsyncEngine", "EngineStoppedError", "RequestStream", "ServerHandle", "StreamEvent", "build_app",
           "default_model_name", "serve_in_thread"]
