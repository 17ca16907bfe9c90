"""The `jaxinfer` command: generate, chat, serve, bench.

    jaxinfer generate                                   # the small trained demo model that ships inside, no download
    jaxinfer generate Qwen/Qwen3-0.6B -p "Hello" --max-tokens 64
    jaxinfer chat /path/to/Qwen3-0.6B --no-thinking     # interactive, streaming
    jaxinfer serve Qwen/Qwen3-0.6B --port 8000          # OpenAI-compatible HTTP API
    jaxinfer bench ...                                  # scripts/bench.py

MODEL is a checkpoint directory, an embedded preset (qwen3-0.6b ... qwen3-32b: random weights) or a Hugging Face hub
id. Engine flags are the fields of jaxinfer.config.EngineConfig; left unset they take the engine's platform defaults
(config.PLATFORM_DEFAULTS: the benchmarked configuration on a GPU, small ones on a CPU). The commands own their
process, so they also turn on XLA's fast command-buffer mode where it applies (jaxinfer/xla_options.py).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import time

from jaxinfer.cli_checks import check_engine_flags, check_model_folder, check_vllm_flags
from jaxinfer.cli_types import bare_flags, bool_arg, config_file_args, dashed, flag_type, json_object, model_len, port

VLLM_MODEL_OPTIONS = ("hf_overrides", "revision", "download_dir", "tokenizer", "hf_token")   # LLM() options, not config
DEFAULT_MODEL = "qwen3-pydoc"     # the small trained model that ships in jaxinfer/assets/ (no download)
CHUNKED = ("--enable-chunked-prefill",)     # vLLM's boolean flag: alone, or with true / false
DEFAULT_PROMPTS = ["The json module", "Return the number of", "A dictionary is", "Raise ValueError if"]


def add_engine_args(p: argparse.ArgumentParser, with_model: bool = True, llm_names: bool = False) -> None:
    """One flag per EngineConfig field (`--max-num-seqs`, `--block-size`, ...), derived from the dataclass, so
    LLM kwargs, the CLI and scripts/bench.py can never drift apart. Unset flags take the engine's defaults.
    llm_names (vLLM's EngineArgs.add_cli_args; `p` may be a group): each value is stored under its LLM() keyword,
    so `LLM(**vars(args))` runs; the model is --model (default: the demo model); no server-only flags."""
    from dataclasses import MISSING, fields

    from jaxinfer.compat import FIXED, IGNORED
    from jaxinfer.config import EngineConfig
    from jaxinfer.structured import REASONING_PARSERS
    if llm_names:                          # (LLM()'s own arguments too: the server has them as its options)
        p.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory, preset or hub id")
        p.add_argument("--generation-config", default="auto", help="auto, vllm or a folder (vLLM's)")
        p.add_argument("--override-generation-config", type=json_object, metavar="JSON")
        p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, help="structured outputs after </think>")
    elif with_model:
        p.add_argument("model", nargs="?", default=None,
                       help=f"checkpoint directory, preset name (random weights) or Hugging Face hub id (default: "
                            f"{DEFAULT_MODEL}, the small trained demo model that ships with jaxinfer)")
        p.add_argument("--model", dest="model_flag", metavar="MODEL", help="the same as the positional MODEL (vLLM)")
    v = p if llm_names else p.add_argument_group("vLLM options accepted for compatibility (jaxinfer/compat.py)")
    pre, skip = ("", lambda name: name not in IGNORED and name not in FIXED) if llm_names else \
        ("vllm_", lambda name: False)
    for name in ("trust_remote_code", "enforce_eager", "disable_log_stats", "disable_log_requests",
                 "enable_log_requests", "disable_custom_all_reduce", "enable_lora"):   # no meaning here (also --no-X)
        if not skip(name):
            v.add_argument("--" + name.replace("_", "-"), dest=pre + name, action=argparse.BooleanOptionalAction,
                           help=argparse.SUPPRESS)
    for name, typ in (("quantization", str), ("task", str), ("runner", str), ("convert", str),
                      ("load_format", str), ("distributed_executor_backend", str), ("scheduling_policy", str),
                      ("tokenizer_mode", str), ("max_log_len", int), ("swap_space", float),
                      ("max_seq_len_to_capture", int), ("pipeline_parallel_size", int), ("max_loras", int),
                      ("max_lora_rank", int), ("cpu_offload_gb", float), ("compilation_config", json.loads)):
        flags = ["--" + name.replace("_", "-")] + {"pipeline_parallel_size": ["-pp"], "compilation_config": ["-O"]}.get(
            name, [])
        if not skip(name):
            v.add_argument(*flags, dest=pre + name, type=typ, help=argparse.SUPPRESS)
    v.add_argument(*CHUNKED, dest=pre + "enable_chunked_prefill", type=bool_arg, nargs="?", const=True,
                   help=argparse.SUPPRESS)                  # (always on; main() reads a bare flag as true)
    v.add_argument("--no-enable-chunked-prefill", dest=pre + "enable_chunked_prefill", action="store_const",
                   const=False, help=argparse.SUPPRESS)
    v.add_argument("--revision", dest="revision", help="the hub model's branch, tag or commit (vLLM's)")
    v.add_argument("--download-dir", dest="download_dir", help="the Hugging Face cache to use for hub models (vLLM's)")
    v.add_argument("--tokenizer", dest="tokenizer", help="a folder to load the tokenizer from (vLLM's)")
    v.add_argument("--hf-token", dest="hf_token", nargs="?", const=True, metavar="TOKEN",
                   help="the Hugging Face token for hub downloads; alone: the one `hf auth login` saved (vLLM's)")
    v.add_argument("--hf-overrides", dest="hf_overrides", type=json_object, metavar="JSON",
                   help='config.json fields to replace (vLLM\'s), e.g. \'{"rope_scaling": {"rope_type": "yarn", '
                        '"factor": 4.0, "original_max_position_embeddings": 32768}}\'')
    g = p if llm_names else p.add_argument_group(
        "engine options (jaxinfer.config.EngineConfig; unset: the platform's defaults)")
    for f in fields(EngineConfig):
        help_text = f.metadata.get("help", "")
        if f.default is not MISSING and f.default is not None and "default" not in help_text:
            help_text += f" (default: {f.default})"
        kw = flag_type(str(f.type)) if f.name != "max_model_len" else dict(type=model_len, metavar="N")
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        names = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ()),
                 *(["--num-gpu-blocks-override"] if f.name == "num_kvcache_blocks" else [])]     # (vLLM's name)
        g.add_argument(*names, dest=f.name, default=None, help=help_text, **kw)


def model_arg(a: argparse.Namespace) -> str:
    """The model the user named (positional or --model), else the shipped demo model's directory."""
    if getattr(a, "model", None) and getattr(a, "model_flag", None) and a.model != a.model_flag:
        raise ValueError(f"two models given: {a.model!r} and --model {a.model_flag!r}")
    a.model = getattr(a, "model", None) or getattr(a, "model_flag", None) or getattr(a, "config_model", None)
    if a.model:
        return a.model
    from jaxinfer.assets import demo_model_path
    return demo_model_path()


def engine_kwargs(a: argparse.Namespace) -> dict:
    """The engine options given on the command line (the rest are the engine's defaults)."""
    from dataclasses import fields

    from jaxinfer.config import EngineConfig
    kw = {f.name: getattr(a, f.name) for f in fields(EngineConfig) if getattr(a, f.name, None) is not None}
    return {**kw, **{k: getattr(a, k) for k in VLLM_MODEL_OPTIONS if getattr(a, k, None)}}


def build_llm(a: argparse.Namespace):
    """LLM(MODEL, flags), once the flags, the folder and (given a.chat_hint) its chat template checked out."""
    from jaxinfer import LLM
    kw = engine_kwargs(a)
    a.model = model_arg(a)
    check_engine_flags({k: v for k, v in kw.items() if k not in VLLM_MODEL_OPTIONS})     # (cli_checks.py)
    check_model_folder(a.model, kw.get("tokenizer"), chat=getattr(a, "chat_hint", None))
    shown = ", ".join(f"{k}={'***' if k == 'hf_token' else v}" for k, v in kw.items())
    print(f"loading {a.model} ({shown or 'engine defaults'})", file=sys.stderr, flush=True)
    llm = LLM(a.model, **kw)
    c, st = llm.config, llm.stats()
    par = "".join(f"{k}={getattr(c, k)}, " for k in ("tensor_parallel_size", "data_parallel_size") if getattr(c, k) > 1)
    print(f"engine: {c.attn_backend} attention, {c.dtype}, {par}max_num_seqs={c.max_num_seqs}, max_model_len="
          f"{c.max_model_len}, {st['kv_blocks_total']} KV blocks of {c.block_size} tokens ({st['kv_cache_dtype']})"
          + ("" if c.warmup else "; steps compile when first used"), file=sys.stderr, flush=True)
    return llm


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int, temperature: float) -> None:
    """Sampling flags. Those not given take the model's generation_config.json recommendations (as vLLM's default
    sampling params), else these defaults."""
    g = p.add_argument_group("sampling (defaults: the model's generation_config.json, else those shown)")
    g.add_argument("--max-tokens", type=int, help=f"new tokens per prompt (default: {max_tokens})")
    g.add_argument("--temperature", type=float, help=f"0 = greedy (default: {temperature})")
    g.add_argument("--top-p", type=float, help="nucleus sampling mass (default: 1.0, off)")
    g.add_argument("--top-k", type=int, help="sample from the k most likely tokens (default: 0, off)")
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.set_defaults(fallback_temperature=temperature, fallback_max_tokens=max_tokens)


def sampling(a: argparse.Namespace, defaults=None):
    """The flags as SamplingParams; those not given from `defaults` (LLM.default_sampling_params: the fields the
    model's generation config set, even to a SamplingParams default such as temperature 1.0), else the flags'
    own defaults."""
    from jaxinfer import SamplingParams
    base = {k: v for k, v in (defaults or {}).items()          # (LLM.default_sampling_params: what the file set)
            if k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")}
    given = {k: getattr(a, k) for k in ("temperature", "top_p", "top_k", "max_tokens") if getattr(a, k) is not None}
    return SamplingParams(**{"temperature": a.fallback_temperature, "max_tokens": a.fallback_max_tokens, **base,
                             **given}, ignore_eos=a.ignore_eos)


# -- commands -----------------------------------------------------------------------------------------------
def cmd_generate(a: argparse.Namespace) -> int:
    import jax
    sampling(a)                           # bad values fail before the model loads
    prompts = [q for p in a.prompt or DEFAULT_PROMPTS for q in (sys.stdin.read().splitlines() if p == "-" else [p])]
    if not prompts:
        raise ValueError("no prompts: standard input (-p -) had no lines")
    a.chat_hint = "run `jaxinfer generate` without --chat" if a.chat else None
    llm = build_llm(a)
    sp = sampling(a, llm.default_sampling_params)
    inputs = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts] if a.chat else prompts
    t0 = time.perf_counter()
    outs = llm.generate(inputs, sp, use_tqdm=False, tokenization_kwargs={"add_special_tokens": not a.chat})
    elapsed = time.perf_counter() - t0
    for p, o in zip(prompts, outs):
        print(f"Prompt: {p!r}\nOutput: {o.text!r}  [{len(o.token_ids)} tokens, {o.finish_reason}]\n")
    n = sum(len(o.token_ids) for o in outs)
    firsts = [o.metrics.get("ttft_s", 0.0) for o in outs]
    decode_s = max(elapsed - max(firsts), 1e-9)   # after every request's first token
    print(f"{len(outs)} prompts, {n} new tokens in {elapsed:.2f} s: {n / elapsed:.1f} tokens/s overall, "
          f"{(n - len(outs)) / decode_s:.1f} tokens/s decoding (after the first token; on {jax.devices()[0].device_kind}, "
          f"{'steps precompiled' if llm.config.warmup else 'includes compiling the steps it used'})")
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    from jaxinfer.chat import chat_loop
    sampling(a)                           # bad values fail before the model loads
    llm = build_llm(a)
    return chat_loop(llm, sampling(a, llm.default_sampling_params), system=a.system, thinking=not a.no_thinking)


def cmd_serve(a: argparse.Namespace) -> int:
    from jaxinfer.server import serve
    # The engine core loads the model in its own process; this one serves HTTP. Exit 1: the core died.
    model, kw = model_arg(a), engine_kwargs(a)
    check_engine_flags({k: v for k, v in kw.items() if k not in VLLM_MODEL_OPTIONS})     # (here: one line, at once)
    check_model_folder(model, kw.get("tokenizer"))       # (the API processes detokenize: a tokenizer)
    name = a.served_model_name or a.model or DEFAULT_MODEL
    from jaxinfer.server.options import server_options
    return serve(model, kw, host=a.host, port=a.port, served_model_name=name,
                 log_level=a.log_level, api_server_count=a.api_server_count, options=server_options(a))


def bench_script() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench.py")


def cmd_bench(argv: list[str]) -> int:
    """`jaxinfer bench ARGS` is `python scripts/bench.py ARGS` (all arguments, --help included, go to it); vLLM's
    `bench throughput ARGS` and `bench latency ARGS` are `bench ARGS` and `bench --latency ARGS`."""
    if argv[:1] in (["throughput"], ["latency"]):
        argv = ["--latency"] * (argv[0] == "latency") + argv[1:]
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
    sys.argv[0] = "jaxinfer bench"         # the script's argparse names itself after argv[0]
    rc = module.main(list(argv))
    return rc if isinstance(rc, int) else 0


# -- parser -------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="jaxinfer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    from importlib.metadata import version
    ap.add_argument("-v", "--version", action="version", version=version("jaxinfer"))
    sub = ap.add_subparsers(dest="command", metavar="{generate,chat,serve,bench}")
    sub.required = True

    g = sub.add_parser("generate", help="generate from prompts and print text and tokens/s",
                       description="Generate from a few prompts; print the outputs and the throughput.")
    add_engine_args(g)
    g.add_argument("-p", "--prompt", action="append", help="a prompt (repeatable; -: stdin's lines; default: 4)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    add_sampling_args(g, max_tokens=32, temperature=0.0)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat, streaming the replies",
                       description="Chat with the model in the terminal; replies stream as they are generated.")
    add_engine_args(c)
    c.add_argument("--system", "--system-prompt", help="system prompt")
    c.add_argument("--no-thinking", action="store_true", help="Qwen3: disable thinking (enable_thinking=False)")
    add_sampling_args(c, max_tokens=256, temperature=0.6)
    c.set_defaults(func=cmd_chat, chat_hint="`jaxinfer chat` needs one; `jaxinfer generate` runs plain prompts")

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                       description="Serve /v1/models, /v1/completions, /v1/chat/completions, /health, /stats.")
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    s.add_argument("--port", type=port, default=8000, help="port to listen on (default: 8000)")
    s.add_argument("--served-model-name", nargs="+", help="the model ids clients may send; answers carry the "
                                                          "first (default: MODEL as given)")
    s.add_argument("--api-server-count", type=int, default=1,
                   help="API processes sharing the port (HTTP, tokenization, detokenization); the engine core is "
                        "one process (default: 1)")
    s.add_argument("--log-level", "--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="server log level (default: info)")
    s.add_argument("--config", metavar="FILE", help="flags from a YAML or JSON file, the command line's win (vLLM's)")
    from jaxinfer.server.options import add_server_args
    add_server_args(s)                    # --api-key, --max-waiting-requests, --shutdown-timeout, ...
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="throughput benchmark (scripts/bench.py; its own --help)", add_help=False,
                       description="Run scripts/bench.py with the remaining arguments.")
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments for scripts/bench.py")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    from jaxinfer.xla_options import set_process_flags
    if argv[:1] == ["bench"]:             # everything after `bench` belongs to the benchmark script, which sets
        command, run = "bench", lambda: cmd_bench(argv[1:])     # the process flags itself (unless --no-process-flags)
    else:
        set_process_flags()               # this process is ours: before JAX starts its GPU client
        ap = build_parser()
        a = ap.parse_args(bare_flags(dashed(config_file_args(argv, ap)), CHUNKED))
        if getattr(a, "attn_backend", None) == "triton":
            from jaxinfer.xla_options import use_triton_ptxas
            use_triton_ptxas()            # jaxlib runs ptxas to load jax-triton kernels (the serving core inherits it)
        logging.basicConfig(format="%(message)s")
        logging.getLogger("jaxinfer").setLevel(logging.INFO)   # e.g. "compiling decode step ..." on a CPU
        command, run = a.command, lambda: check_vllm_flags(a) or a.func(a)
    try:
        return run()
    except (ValueError, OSError, RuntimeError) as e:    # (bad input, unreadable files, a core that could not load)
        print(f"jaxinfer {command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
