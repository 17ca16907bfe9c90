"""Server options (not the engine's): the API key, the waiting-queue bound, the drain timeout, the body size
limit. One frozen dataclass; `jaxinfer serve` and `python -m jaxinfer.server` derive their flags from its fields
(`add_server_args`), as the engine flags come from EngineConfig.

What guards memory, per request and in all:
- `max_request_body_bytes`: a larger body gets 413 before it is read to the end (JSON is parsed whole);
- the prompt: at most max_model_len - 1 tokens (400), and it must fit the KV pool with its max_tokens (400);
- `n`: at most 128 (OpenAI's bound), and prompts x n engine requests must fit the admission bound below;
- `max_waiting_requests`: engine requests in flight are bounded by max_num_seqs + max_waiting_requests (split
  evenly over the API processes); past it a request gets 503 with Retry-After at once, before anything is
  queued. Unset: no bound (requests wait in the scheduler's queue, which only holds token ids).
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import MISSING, dataclass, field, fields, replace

from jaxinfer.cli_types import json_object
from jaxinfer.generation_config import check as check_generation_config, sampling_defaults
from jaxinfer.server.reasoning import PARSERS

TOOL_PARSERS = ("hermes",)            # (tools.py: Qwen3's <tool_call> blocks)
API_KEY_ENV = "JAXINFER_API_KEY"
API_KEY_ENVS = (API_KEY_ENV, "VLLM_API_KEY")      # (vLLM's variable too: a server a vLLM user thinks guarded is)


def _opt(default, help: str, **meta):
    return field(default=default, metadata={"help": help, **meta})


@dataclass(frozen=True)
class ServerOptions:
    api_key: str | None = _opt(None, f"clients must send 'Authorization: Bearer KEY' on /v1/* (401 otherwise); "
                                     f"default: ${API_KEY_ENV}, else $VLLM_API_KEY, if set")
    max_waiting_requests: int | None = _opt(None, "bound the waiting queue: past max_num_seqs + this many engine "
                                                  "requests in flight, answer 503 with Retry-After (default: no bound)")
    shutdown_timeout: float = _opt(30.0, "on SIGTERM: seconds in-flight requests may take to finish before they "
                                         "end with finish_reason 'abort' (new requests get 503 meanwhile)")
    max_request_body_bytes: int = _opt(32 << 20, "larger request bodies get 413")
    retry_after_s: int = _opt(1, "the Retry-After header of a 503 (seconds)")
    allowed_origins: str = _opt("*", "CORS: the origins browsers may call the API from, comma-separated or a "
                                     "JSON list, as vLLM's --allowed-origins; '' turns CORS off")
    chat_template: str | None = _opt(None, "the chat template for /v1/chat/completions: a file, or the Jinja "
                                           "template itself (default: the tokenizer's)")
    generation_config: str = _opt("auto", "sampling defaults for fields a request leaves out: 'auto' (the model's "
                                          "generation_config.json, as vLLM), 'vllm' (none) or a folder")
    override_generation_config: dict | None = _opt(None, "a JSON object merged over those defaults (vLLM's), e.g. "
                                                         "'{\"temperature\": 0.5}'")
    default_chat_template_kwargs: dict | None = _opt(None, "chat_template_kwargs a chat request starts from (its "
                                                           "own win; vLLM's), e.g. '{\"enable_thinking\": false}'")
    enable_force_include_usage: bool = _opt(False, "streams carry the usage whatever the request's stream_options "
                                                   "say (a last chunk, and each chunk's so far; vLLM's flag)")
    return_tokens_as_token_ids: bool = _opt(False, "logprobs name tokens 'token_id:N' unless a request says "
                                                   "otherwise (its return_tokens_as_token_ids; vLLM's flag)")
    disable_uvicorn_access_log: bool = _opt(False, "no access log line per HTTP request (vLLM's flag)")
    enable_prompt_tokens_details: bool = _opt(False, "usage carries prompt_tokens_details.cached_tokens (the prompt "
                                                     "tokens found in the prefix cache) when there are any (vLLM's)")
    reasoning_parser: str | None = _opt(None, "qwen3 or deepseek_r1: a chat answer's thinking (<think>...</think>) "
                                              "goes to the message's `reasoning`, the rest to `content` (vLLM's)")
    response_role: str = _opt("assistant", "the role of a chat answer that opens the assistant's turn "
                                           "(add_generation_prompt; vLLM's flag)")
    root_path: str | None = _opt(None, "the path prefix a proxy serves the API under (FastAPI's root_path; vLLM's)")
    allowed_methods: str = _opt("*", "CORS: the methods browsers may use, comma-separated or a JSON list (vLLM's)")
    allowed_headers: str = _opt("*", "CORS: the headers browsers may send, comma-separated or a JSON list (vLLM's)")
    allow_credentials: bool = _opt(False, "CORS: browsers may send credentials (vLLM's flag)")
    disable_fastapi_docs: bool = _opt(False, "no /docs, /redoc or /openapi.json (vLLM's flag)")
    enable_request_id_headers: bool = _opt(False, "answers carry an X-Request-Id header: the request's own, else a "
                                                  "new id (vLLM's flag)")
    ssl_keyfile: str | None = _opt(None, "HTTPS: the private key file (PEM; vLLM's flag)")
    ssl_certfile: str | None = _opt(None, "HTTPS: the certificate file (PEM), which turns HTTPS on (vLLM's flag)")
    ssl_ca_certs: str | None = _opt(None, "HTTPS: the CA certificates for client certificates (vLLM's flag)")
    ssl_cert_reqs: int = _opt(0, "HTTPS: client certificates 0 not asked, 1 optional, 2 required (Python's "
                                 "ssl.CERT_*; vLLM's flag)")
    enable_auto_tool_choice: bool = _opt(False, "parse chat answers for tool calls (tool_choice 'auto', the default "
                                                "with tools); needs --tool-call-parser (vLLM's flag)")
    tool_call_parser: str | None = _opt(None, "hermes: Qwen3's <tool_call> blocks become the message's tool_calls "
                                              "(vLLM's)")
    exclude_tools_when_tool_choice_none: bool = _opt(False, "tool_choice 'none': the tools do not reach the chat "
                                                            "template either (vLLM's flag)")

    def __post_init__(self):
        k = [self.api_key] if isinstance(self.api_key, str) or self.api_key is None else self.api_key
        if self.api_key is not None and (not isinstance(k, (list, tuple)) or not k or not all(
                isinstance(x, str) and x for x in k)):
            raise ValueError(f"api_key={self.api_key!r} must be a non-empty string, or several (vLLM's: any of them)")
        if isinstance(self.api_key, list):
            object.__setattr__(self, "api_key", self.api_key[0] if len(k) == 1 else tuple(k))
        for name, least in (("max_waiting_requests", 0), ("max_request_body_bytes", 1), ("retry_after_s", 0)):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < least):
                raise ValueError(f"{name}={v!r} must be an integer >= {least}")
        check_generation_config(self.generation_config)
        g = self.generation_config                       # (checks the values: a folder's file, the override)
        sampling_defaults(None, "vllm" if g == "auto" else g, self.override_generation_config)
        if self.chat_template is not None and (not isinstance(self.chat_template, str) or not self.chat_template
                                               or ("{" not in self.chat_template and not
                                                   os.path.isfile(self.chat_template))):
            raise ValueError(f"chat_template={self.chat_template!r:.80} must be a template file or a Jinja template")
        if self.chat_template is not None:                  # a broken template fails at start-up, not per request
            check_jinja(self.template_text())
        d = self.default_chat_template_kwargs
        if d is not None and (not isinstance(d, dict) or {"chat_template", "tools"} & set(d)):
            raise ValueError(f"default_chat_template_kwargs={d!r:.80} must be a JSON object without chat_template "
                             f"and tools")
        if self.reasoning_parser is not None and self.reasoning_parser not in PARSERS:
            raise ValueError(f"reasoning_parser={self.reasoning_parser!r} is not one of {PARSERS}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser={self.tool_call_parser!r} is not one of {TOOL_PARSERS}")
        if self.enable_auto_tool_choice is True and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice (--enable-auto-tool-choice) requires tool_call_parser "
                             "(--tool-call-parser)")
        if not isinstance(self.response_role, str) or not self.response_role:
            raise ValueError(f"response_role={self.response_role!r} must be a non-empty string")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            if getattr(self, name) is not None and not os.path.isfile(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r} is not a file")
        if (self.ssl_keyfile or self.ssl_ca_certs or self.ssl_cert_reqs) and not self.ssl_certfile:
            raise ValueError("ssl_keyfile, ssl_ca_certs and ssl_cert_reqs need ssl_certfile (--ssl-certfile)")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"ssl_cert_reqs={self.ssl_cert_reqs!r} must be 0, 1 or 2")
        if self.ssl_certfile:                      # a certificate and key that do not load fail here, not after loading
            import ssl
            try:
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
            except (ssl.SSLError, OSError) as e:
                raise ValueError(f"ssl_certfile={self.ssl_certfile!r} / ssl_keyfile={self.ssl_keyfile!r} do not load "
                                 f"as a PEM certificate and its private key: {e}") from None
        if self.root_path is not None and not isinstance(self.root_path, str):
            raise ValueError(f"root_path={self.root_path!r} must be a string")
        self.cors()
        for name in ("enable_force_include_usage", "return_tokens_as_token_ids", "disable_uvicorn_access_log",
                     "enable_auto_tool_choice", "exclude_tools_when_tool_choice_none", "allow_credentials",
                     "disable_fastapi_docs", "enable_request_id_headers", "enable_prompt_tokens_details"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")
        if not isinstance(self.shutdown_timeout, (int, float)) or not 0 <= self.shutdown_timeout < float("inf"):
            raise ValueError(f"shutdown_timeout={self.shutdown_timeout!r} must be a finite number >= 0")

    @classmethod
    def create(cls, env: dict | None = None, **kw) -> "ServerOptions":
        """Options from keyword arguments (None = default), the API key from the environment if not given."""
        env = os.environ if env is None else env
        kw = {k: v for k, v in kw.items() if v is not None}
        unknown = set(kw) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown server option(s) {sorted(unknown)}; known: {[f.name for f in fields(cls)]}")
        key = next((env[e] for e in API_KEY_ENVS if env.get(e)), None)
        if "api_key" not in kw and key:
            kw["api_key"] = key
        return cls(**kw)

    def template_text(self) -> str | None:
        """chat_template's text: the file's content if it names a file, else the string itself."""
        t = self.chat_template
        if t and os.path.isfile(t):
            with open(t, encoding="utf-8") as f:
                return f.read()
        return t

    def origins(self, name: str = "allowed_origins") -> list[str]:
        """allowed_origins (or allowed_methods, allowed_headers) as a list (a JSON list, or comma-separated)."""
        v = (getattr(self, name) or "").strip()
        if v.startswith("["):
            try:
                out = json.loads(v)
            except ValueError:
                out = None
            if not isinstance(out, list) or not all(isinstance(o, str) for o in out):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a JSON list of strings or comma-separated "
                                 f"values")
            return out
        return [o.strip() for o in v.split(",") if o.strip()]

    def cors(self) -> dict:
        """CORSMiddleware's arguments."""
        return {"allow_origins": self.origins(), "allow_methods": self.origins("allowed_methods"),
                "allow_headers": self.origins("allowed_headers"), "allow_credentials": self.allow_credentials}

    def uvicorn_kwargs(self) -> dict:
        """uvicorn.Config's arguments from these options: HTTPS's with a certificate. (root_path is FastAPI's, as
        vLLM's: uvicorn's would put it in front of every path, so /PREFIX/v1/... became /PREFIX/PREFIX/v1/...)"""
        return {"ssl_keyfile": self.ssl_keyfile, "ssl_certfile": self.ssl_certfile, "ssl_ca_certs": self.ssl_ca_certs,
                "ssl_cert_reqs": self.ssl_cert_reqs} if self.ssl_certfile else {}

    def replace(self, **kw) -> "ServerOptions":
        return replace(self, **kw)

    def apply(self, req):
        """The request with these options' defaults: default_chat_template_kwargs under its own, with
        enable_force_include_usage a stream's stream_options set to carry the usage, and
        return_tokens_as_token_ids where the request leaves it out. Returns it."""
        if self.return_tokens_as_token_ids and getattr(req, "return_tokens_as_token_ids", False) is None:
            req.return_tokens_as_token_ids = True
        if self.default_chat_template_kwargs and "chat_template_kwargs" in type(req).model_fields:
            req.chat_template_kwargs = {**self.default_chat_template_kwargs, **(req.chat_template_kwargs or {})}
        if self.enable_prompt_tokens_details:
            req._prompt_tokens_details = True
        if self.enable_force_include_usage and getattr(req, "stream", False):
            from jaxinfer.server.protocol import StreamOptions
            req.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=True)
        return req


def add_server_args(p: argparse.ArgumentParser) -> None:
    """One flag per ServerOptions field (`--api-key`, `--max-waiting-requests`, ...); unset = the default."""
    g = p.add_argument_group("server options (jaxinfer.server.options.ServerOptions)")
    for f in fields(ServerOptions):
        t = str(f.type)
        typ = int if t.startswith("int") else float if t.startswith("float") else \
            json_object if t.startswith("dict") else str
        h = f.metadata["help"]
        if t.startswith("bool"):                         # (--X / --no-X, as vLLM's bool flags)
            g.add_argument("--" + f.name.replace("_", "-"), dest=f.name, action=argparse.BooleanOptionalAction,
                           default=None, help=h)
            continue
        if f.default is not MISSING and f.default is not None:
            h += f" (default: {f.default})"
        g.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=typ, default=None, help=h,
                       nargs="+" if f.name == "api_key" else None)      # (vLLM's: several keys, any of them)


def server_options(a: argparse.Namespace) -> ServerOptions:
    return ServerOptions.create(**{f.name: getattr(a, f.name, None) for f in fields(ServerOptions)})


def check_jinja(text: str) -> None:
    """ValueError naming the error when `text` is not a Jinja template transformers could render (its loop
    controls and its `{% generation %}` tag allowed)."""
    import jinja2
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        if "generation" not in str(e):
            raise ValueError(f"chat_template is not a valid Jinja template: {e} (line {e.lineno})") from None
