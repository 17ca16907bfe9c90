"""The `jaxinfer` command: generate, chat, serve, bench.

    jaxinfer generate                                   # embedded qwen3-0.6b preset, random weights, no download
    jaxinfer generate Qwen/Qwen3-0.6B -p "Hello" --max-tokens 64
    jaxinfer chat /path/to/Qwen3-0.6B --no-thinking     # interactive, streaming
    jaxinfer serve Qwen/Qwen3-0.6B --port 8000          # OpenAI-compatible HTTP API
    jaxinfer bench ...                                  # scripts/bench.py

MODEL is a checkpoint directory, an embedded preset (qwen3-0.6b ... qwen3-32b: random weights) or a
Hugging Face hub id. Engine options left unset get defaults for the platform: on CPU small ones
(float32, 4 sequences, 512-token context, steps compiled lazily); on GPU the engine's own.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

DEFAULT_MODEL = "qwen3-0.6b"
DEFAULT_PROMPTS = ["Hello, my name is", "The capital of France is", "JAX compiles Python to",
                   "The future of AI is"]
# Small enough that `jaxinfer generate` on a 2-core CPU finishes in a few minutes.
CPU_DEFAULTS = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512, warmup=False)
ENGINE_OPTIONS = ("dtype", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "kvcache_block_size",
                  "num_kvcache_blocks", "gpu_memory_utilization", "attn_backend", "enable_prefix_caching",
                  "seed", "warmup")


def add_engine_args(p: argparse.ArgumentParser, model_required: bool = False) -> None:
    if model_required:
        p.add_argument("model", help="checkpoint directory, preset name or Hugging Face hub id")
    else:
        p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                       help=f"checkpoint directory, preset name or Hugging Face hub id (default: {DEFAULT_MODEL})")
    g = p.add_argument_group("engine options (unset: platform defaults)")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--max-num-seqs", type=int, help="most sequences in one step")
    g.add_argument("--max-num-batched-tokens", type=int, help="most tokens in one prefill step")
    g.add_argument("--max-model-len", type=int, help="longest prompt + output, in tokens")
    g.add_argument("--kvcache-block-size", type=int, help="tokens per KV cache block (power of two)")
    g.add_argument("--num-kvcache-blocks", type=int, help="KV cache blocks (default: sized from memory)")
    g.add_argument("--gpu-memory-utilization", type=float, help="fraction of GPU memory to use")
    g.add_argument("--attn-backend", choices=["xla", "pallas"], help="attention implementation")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--seed", type=int, help="engine seed (requests without their own seed)")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="compile every step bucket before serving (default: on GPU yes, on CPU no)")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int, temperature: float) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help=f"new tokens per prompt (default {max_tokens})")
    g.add_argument("--temperature", type=float, default=temperature, help=f"0 = greedy (default {temperature})")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")


def engine_kwargs(a: argparse.Namespace) -> dict:
    import jax
    defaults = CPU_DEFAULTS if jax.default_backend() == "cpu" else {}
    return {**defaults, **{k: getattr(a, k) for k in ENGINE_OPTIONS if getattr(a, k) is not None}}


def build_llm(a: argparse.Namespace):
    from jaxinfer import LLM
    kw = engine_kwargs(a)
    print(f"loading {a.model} ({', '.join(f'{k}={v}' for k, v in kw.items())})", file=sys.stderr, flush=True)
    return LLM(a.model, **kw)


def sampling(a: argparse.Namespace):
    from jaxinfer import SamplingParams
    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                          ignore_eos=a.ignore_eos)


# -- commands -----------------------------------------------------------------------------------------------
def cmd_generate(a: argparse.Namespace) -> int:
    import jax
    sp = sampling(a)                      # bad values fail before the model loads
    llm = build_llm(a)
    prompts = a.prompt or DEFAULT_PROMPTS
    inputs = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts] if a.chat else prompts
    t0 = time.perf_counter()
    outs = llm.generate(inputs, sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    for p, o in zip(prompts, outs):
        print(f"Prompt: {p!r}\nOutput: {o.text!r}  [{len(o.token_ids)} tokens, {o.finish_reason}]\n")
    n = sum(len(o.token_ids) for o in outs)
    firsts = [o.metrics.get("ttft_s", 0.0) for o in outs]
    decode_s = max(elapsed - max(firsts), 1e-9)   # after every request's first token
    print(f"{len(outs)} prompts, {n} new tokens in {elapsed:.2f} s: {n / elapsed:.1f} tokens/s overall, "
          f"{(n - len(outs)) / decode_s:.1f} tokens/s decoding (after the first token; on {jax.devices()[0].device_kind}, "
          f"{'includes compiling the steps it used' if not engine_kwargs(a).get('warmup', True) else 'steps precompiled'})")
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    sp = sampling(a)
    llm = build_llm(a)
    kwargs = {"enable_thinking": False} if a.no_thinking else None
    history = [{"role": "system", "content": a.system}] if a.system else []
    print("chat: type a message; /reset clears the conversation, /exit (or Ctrl-D) quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if a.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        reply = []
        for d in llm.stream(llm.apply_chat_template(history, kwargs), sp):
            print(d.text, end="", flush=True)
            reply.append(d.text)
        print()
        history.append({"role": "assistant", "content": "".join(reply)})


def cmd_serve(a: argparse.Namespace) -> int:
    from jaxinfer.server import serve
    llm = build_llm(a)
    serve(llm, a.served_model_name or a.model, host=a.host, port=a.port, log_level=a.log_level)
    return 0


def bench_script() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench.py")


def cmd_bench(argv: list[str]) -> int:
    """`jaxinfer bench ARGS` is `python scripts/bench.py ARGS` (all arguments, --help included, go to it)."""
    path = bench_script()
    if not os.path.isfile(path):
        if "-h" in argv or "--help" in argv:
            print("usage: jaxinfer bench [ARGS...]\n\nRuns the throughput benchmark scripts/bench.py with ARGS.")
        print(f"jaxinfer bench: the benchmark script {path} is missing (it ships with the source checkout: run "
              f"from a git clone installed with `pip install -e .`)", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("jaxinfer_bench_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "main"):
        print(f"jaxinfer bench: {path} has no main(argv)", file=sys.stderr)
        return 2
    sys.argv[0] = "jaxinfer bench"         # the script's argparse names itself after argv[0]
    rc = module.main(list(argv))
    return rc if isinstance(rc, int) else 0


# -- parser -------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="jaxinfer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", metavar="{generate,chat,serve,bench}")
    sub.required = True

    g = sub.add_parser("generate", help="generate from prompts and print text and tokens/s",
                       description="Generate from a few prompts; print the outputs and the throughput.")
    add_engine_args(g)
    g.add_argument("-p", "--prompt", action="append", help="a prompt (repeatable; default: 4 sample prompts)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    add_sampling_args(g, max_tokens=32, temperature=0.0)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat, streaming the replies",
                       description="Chat with the model in the terminal; replies stream as they are generated.")
    add_engine_args(c)
    c.add_argument("--system", help="system prompt")
    c.add_argument("--no-thinking", action="store_true", help="Qwen3: disable thinking (enable_thinking=False)")
    add_sampling_args(c, max_tokens=256, temperature=0.6)
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                       description="Serve /v1/models, /v1/completions, /v1/chat/completions, /health, /stats.")
    add_engine_args(s, model_required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", help="the model id clients send (default: MODEL as given)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="throughput benchmark (scripts/bench.py; its own --help)", add_help=False,
                       description="Run scripts/bench.py with the remaining arguments.")
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments for scripts/bench.py")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:             # everything after `bench` belongs to the benchmark script
        return cmd_bench(argv[1:])
    a = build_parser().parse_args(argv)
    try:
        return a.func(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"jaxinfer {a.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
