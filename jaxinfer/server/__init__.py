"""OpenAI-compatible HTTP server: `build_app(llm, name)` (FastAPI app) and `serve(llm, name, host, port)`."""
from jaxinfer.server.app import build_app, serve

__all__ = ["build_app", "serve"]
