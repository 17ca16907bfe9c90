"""The OpenAI-compatible HTTP server, with the engine in its own process.

    jaxinfer serve Qwen/Qwen3-0.6B --port 8000          # or, from Python (under `if __name__ == "__main__":`,
    from jaxinfer.server import serve                   # as the engine core is a spawned process)
    serve("Qwen/Qwen3-0.6B", {"max_model_len": 4096}, port=8000)

Process layout (as vLLM V1):

    HTTP clients ──> API process(es): uvicorn + FastAPI, tokenizer, OpenAI protocol, detokenization,
                     stop strings, logprobs' OpenAI shapes (app.py: routes; gate.py: API key, drain, body
                     limit, early 503; admission.py: the queue bound; protocol.py / responses.py: pydantic
                     models; choices.py / streams.py: one
                     engine request per prompt and n; client.py: the ZMQ side; metrics.py: /metrics)
                        │  ZMQ PUSH: msgpack [add / abort / stats], batched per event-loop turn
                        ▼
                     engine core process (core.py): LLMEngine = scheduler + compiled steps; its own
                     XLA_FLAGS (fast command-buffer mode); started with multiprocessing 'spawn'
                        │  ZMQ PUSH: one msgpack message per step: [(request id, new token ids, finish reason)]
                        ▼
                     back to the API process that owns the request id

- Start-up: `serve` spawns the core, which loads the model and reports readiness (or the load error)
  before anything listens; then uvicorn starts (api_server_count > 1: that many API processes share one
  listening socket, and this process supervises them).
- Per token, the core does nothing beyond the step; the API process detokenizes only streaming requests
  and those with stop strings (HF tokenizers' DecodeStream). A stop string match aborts the request in
  the core; so does a client disconnect. Every request finishes or fails explicitly; all KV blocks return.
- Faults: if the core dies, in-flight requests get an error (an SSE error event, or a 500 JSON body), new
  ones a 503, /health answers 503, and the server exits with code 1 about a second later (no restart).
  SIGTERM drains: new requests get 503, in-flight ones finish (or end with finish_reason "abort" after
  ServerOptions.shutdown_timeout), then the core is shut down; exit 0. Operating options: options.py;
  the whole API surface: docs/serving.md.
"""
from jaxinfer.server.app import build_app
from jaxinfer.server.client import CoreClient, EngineDeadError
from jaxinfer.server.process import CoreInfo, CoreProcess
from jaxinfer.server.launch import run_api, serve
from jaxinfer.server.options import ServerOptions

__all__ = ["serve", "build_app", "run_api", "ServerOptions", "CoreProcess", "CoreInfo", "CoreClient",
           "EngineDeadError"]
