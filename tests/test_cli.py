"""The `jaxinfer` command end to end on a tiny checkpoint (subprocesses), plus --help and errors in-process."""
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from jaxinfer import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--dtype", "float32", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len", "128",
         "--block-size", "4", "--num-kvcache-blocks", "128", "--no-warmup"]


def jaxinfer(*args, stdin=None, timeout=240):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "jaxinfer", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


@pytest.mark.parametrize("cmd", ["generate", "chat", "serve"])
def test_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--max-num-seqs" in out and "--attn-backend" in out


def test_generate(tiny_dir):
    r = jaxinfer("generate", tiny_dir, "-p", "Hello world", "-p", "-", "--max-tokens", "4", *SMALL, stdin="你好\nabc\n")
    assert r.returncode == 0, r.stderr
    assert "Prompt: 'Hello world'" in r.stdout and "Prompt: '你好'" in r.stdout and "Prompt: 'abc'" in r.stdout
    assert r.stdout.count("Output: ") == 3 and "tokens/s" in r.stdout      # (-p -: a prompt per line of stdin)


def test_chat_streams_and_keeps_history(tiny_dir):
    # a message that cannot fit max_model_len is an error for that message; the session goes on
    r = jaxinfer("chat", tiny_dir, "--max-tokens", "3", "--temperature", "0", "--no-thinking", *SMALL,
                 stdin="Hello\n\nHow are you?\n/reset\nHi\n" + "word " * 400 + "\nHi again\n/exit\n")
    assert r.returncode == 0 and "max_model_len" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.startswith("> ") and r.stdout.count("> ") >= 8   # a prompt per line read, /exit included
    assert r.stdout.count("\n") >= 4                                  # four replies, each ended by a newline
    r = jaxinfer("serve", tiny_dir, "--port", "70000")
    assert r.returncode == 2 and "not a port" in r.stderr and "Traceback" not in r.stderr


def test_chat_ends_quietly_when_stdin_is_closed(monkeypatch, capsys):
    """`jaxinfer chat <&-`: input() raises RuntimeError("lost sys.stdin"), which ends the session as EOF does."""
    import builtins

    from jaxinfer.chat import chat_loop

    def closed(prompt=""):
        raise RuntimeError("input(): lost sys.stdin")
    monkeypatch.setattr(builtins, "input", closed)
    assert chat_loop(llm=None, sp=None) == 0


def test_a_refused_chat_message_keeps_the_history(monkeypatch, capsys):
    """A message too long for max_model_len is refused; the turns before it stay (dropping them to make it fit
    happens only for a message that is taken)."""
    import builtins

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.chat import chat_loop
    llm = LLM("qwen3-pydoc", max_model_len=64)
    lines, seen, stream = iter(["My name is Ann", "word " * 100, "What is my name?", "/exit"]), [], llm.stream
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    monkeypatch.setattr(llm, "stream", lambda prompt, sp: seen.append(prompt) or stream(prompt, sp))
    assert chat_loop(llm, SamplingParams(temperature=0, max_tokens=4)) == 0
    assert "max_model_len" in capsys.readouterr().err and len(seen) == 3
    assert "My name is Ann" in seen[-1]["prompt"] and "What is my name?" in seen[-1]["prompt"]


def test_serve(tiny_dir):
    """`jaxinfer serve` with vLLM's flag forms: --model, --port 0 (the log says where it listens), several
    --served-model-name, --chat-template given inline, flags with no meaning here; a bad vLLM value is refused."""
    import re
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}|"
    proc = subprocess.Popen([sys.executable, "-m", "jaxinfer", "serve", "--model", tiny_dir, "--port", "0",
                             "--served-model-name", "tiny", "other", "--uvicorn-log-level", "warning",
                             "--chat-template", template, "--trust-remote-code", "--enable-chunked-prefill", "true",
                             *SMALL], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while not (m := re.search(r"API server on (http://127\.0\.0\.1:\d+)", lines[-1] if lines else "")):
            lines.append(proc.stdout.readline())
            assert lines[-1], "".join(lines)               # EOF: the server exited
        url, end = m.group(1), time.time() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < end, "server did not come up"
            time.sleep(0.2)
        assert [d["id"] for d in httpx.get(url + "/v1/models").json()["data"]] == ["tiny", "other"]
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "other", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["model"] == "tiny", r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        want = httpx.post(url + "/tokenize", json={"prompt": "Hi|"}).json()["count"]
        assert r.json()["usage"]["prompt_tokens"] == want          # the template given on the command line
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert cli.main(["serve", tiny_dir, "-pp", "2"]) == 2          # before anything loads


def test_bad_input_is_a_clear_error(tmp_path, tiny_dir, capsys):
    r = jaxinfer("generate", str(tmp_path / "missing-dir"), *SMALL, timeout=120)
    assert r.returncode == 2 and "error:" in r.stderr and "missing-dir" in r.stderr
    import shutil                     # no tokenizer files: before the load, naming --tokenizer; an unreadable weight
    shutil.copytree(tiny_dir, tmp_path / "bad")       # file (an OSError): one line, no traceback
    for f in os.listdir(tmp_path / "bad"):
        if f.startswith("tokenizer") or f == "vocab.json":
            os.remove(tmp_path / "bad" / f)
    assert cli.main(["generate", str(tmp_path / "bad"), *SMALL]) == 2
    shutil.copytree(tiny_dir, tmp_path / "bad2")
    os.remove(tmp_path / "bad2" / "model.safetensors")
    os.mkdir(tmp_path / "bad2" / "model.safetensors")
    r = jaxinfer("generate", str(tmp_path / "bad2"), *SMALL, timeout=120)
    assert r.returncode == 2 and "error:" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert cli.main(["generate", "--temperature", "-1"]) == 2       # fails before loading any model
    r = jaxinfer("serve", tiny_dir, "--num-scheduler-steps", "0", "--port", "0", timeout=120)   # the core refuses it
    assert r.returncode == 2 and "num_scheduler_steps=0" in r.stderr and "code -9" not in r.stderr, r.stderr
    assert cli.build_parser().parse_args(["serve", "--dtype", "half"]).dtype == "half"     # vLLM's dtype names
    from jaxinfer.server.__main__ import main as server_main
    for bad, word in (("[1]", "JSON object"), ("{bad", "not JSON")):
        with pytest.raises(SystemExit) as e:
            server_main(["m", "--engine", bad])
        assert e.value.code == 2 and word in capsys.readouterr().err


def test_errors_known_from_the_command_line_come_before_loading(tmp_path, tiny_dir, capsys, monkeypatch):
    """Bad engine values, a folder without config.json, empty standard input and a chat without a chat template
    end in one line naming the flag or file, with no "loading ..." line before it (generate, chat and serve)."""
    import io
    import shutil
    os.mkdir(tmp_path / "empty")
    cases = [(["generate", tiny_dir, "--max-model-len", "0"], "(--max-model-len)"),
             (["chat", tiny_dir, "--block-size=3"], "block_size=3 must be a power of two (--block-size)"),
             (["serve", tiny_dir, "-tp", "0", "--port", "0"], "(--tensor-parallel-size)"),
             (["serve", tiny_dir, "--gpu-memory-utilization", "1.5"], "(--gpu-memory-utilization)"),
             (["generate", str(tmp_path / "empty")], "config.json' is missing"),
             (["serve", str(tmp_path / "empty"), "--port", "0"], "config.json' is missing"),
             (["generate", tiny_dir, "-p", "-"], "standard input (-p -) had no lines")]
    shutil.copytree(tiny_dir, tmp_path / "plain")
    with open(tmp_path / "plain" / "tokenizer_config.json") as f:
        tok = json.load(f)
    tok.pop("chat_template", None)
    with open(tmp_path / "plain" / "tokenizer_config.json", "w") as f:
        json.dump(tok, f)
    for name in os.listdir(tmp_path / "plain"):
        if name.startswith("chat_template"):
            os.remove(tmp_path / "plain" / name)
    cases += [(["chat", str(tmp_path / "plain")], "has no chat template"),
              (["generate", str(tmp_path / "plain"), "--chat"], "without --chat")]
    os.mkdir(tmp_path / "broken")                       # config.json that is not JSON; no tokenizer files (serve)
    with open(tmp_path / "broken" / "config.json", "w") as f:
        f.write("{not json")
    shutil.copytree(tiny_dir, tmp_path / "untokenized", ignore=shutil.ignore_patterns("tokenizer*", "vocab.json"))
    cases += [([cmd, str(tmp_path / "broken"), "--port", "0"][:2 + 2 * (cmd == "serve")], "is not valid JSON")
              for cmd in ("generate", "chat", "serve")]
    cases += [(["serve", str(tmp_path / "untokenized"), "--port", "0"], "no tokenizer files"),
              (["generate", str(tmp_path / "no-such-dir")], "is not a directory")]
    for argv, words in cases:
        monkeypatch.setattr(sys, "stdin", io.StringIO(""))
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert words in err and "loading" not in err and len(err.strip().splitlines()) == 1, (argv, err)


def test_vllm_flag_forms(capsys):
    """Parse-only: --version, the bare boolean --enable-chunked-prefill (vLLM's; the next word stays the model),
    human-readable integers (1k = 1000, 1K = 1024) and --max-model-len auto / -1 (the default)."""
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip()[:1].isdigit()
    parse = lambda *a: cli.build_parser().parse_args(cli.bare_flags(list(a), cli.CHUNKED))     # noqa: E731
    a = parse("serve", "--enable-chunked-prefill", "m", "--max-model-len", "1k", "--max-num-batched-tokens", "2K")
    assert (a.model, a.vllm_enable_chunked_prefill, a.max_model_len, a.max_num_batched_tokens) == ("m", True, 1000, 2048)
    assert parse("generate", "m", "--enable-chunked-prefill", "false").vllm_enable_chunked_prefill is False
    assert parse("generate", "m", "--enable-chunked-prefill").vllm_enable_chunked_prefill is True
    assert parse("generate", "--max-model-len", "25.6k").max_model_len == 25600
    assert parse("generate", "--max-model-len", "auto").max_model_len is None
    assert parse("generate", "--max-model-len", "-1").max_model_len is None
    assert cli.main(["generate", "m", "--no-enable-chunked-prefill"]) == 2        # refused by name, nothing loaded
    for bad in ("1.5K", "lots"):
        with pytest.raises(SystemExit) as e:
            parse("generate", "--max-model-len", bad)
        assert e.value.code == 2
    assert bad in capsys.readouterr().err
    # vLLM's flags that mean nothing here, in both boolean forms and with values; pipeline parallelism only as 1
    a = parse("serve", "m", "--no-enforce-eager", "--trust-remote-code", "--no-trust-remote-code", "--swap-space", "4",
              "--max-seq-len-to-capture", "8192", "-pp", "1")
    assert (a.model, a.vllm_enforce_eager, a.vllm_swap_space, a.vllm_pipeline_parallel_size) == ("m", False, 4.0, 1)
    assert cli.main(["generate", "m", "--pipeline-parallel-size", "2"]) == 2
    assert "pipeline_parallel_size=2" in capsys.readouterr().err
    # underscores in flag names (vLLM's parser takes them; its k8s docs use them), and LLM()'s no-op options
    a = cli.build_parser().parse_args(cli.bare_flags(cli.dashed(
        ["serve", "m", "--max_model_len", "512", "--gpu_memory_utilization=0.7", "--disable_uvicorn_access_log",
         "--max-loras", "8", "--max-lora-rank", "32", "--disable-custom-all-reduce", "-O3", "--cpu-offload-gb", "0"]),
        cli.CHUNKED))
    assert (a.model, a.max_model_len, a.gpu_memory_utilization, a.disable_uvicorn_access_log) == ("m", 512, 0.7, True)
    assert parse(*cli.dashed(["serve", "m", "--num_gpu_blocks_override", "64"])).num_kvcache_blocks == 64
    cli.check_vllm_flags(a)
    assert cli.main(["generate", "m", "--enable-lora"]) == 2 and "enable_lora=True" in capsys.readouterr().err
    # vLLM's executor backend (every device is driven from this process) and scheduling policy
    a = parse("serve", "m", "--distributed-executor-backend", "mp", "--scheduling-policy", "fcfs", "-tp", "1")
    assert (a.vllm_distributed_executor_backend, a.vllm_scheduling_policy) == ("mp", "fcfs")
    cli.check_vllm_flags(a)
    assert cli.main(["generate", "m", "--distributed-executor-backend", "ray"]) == 2
    assert "distributed_executor_backend='ray'" in capsys.readouterr().err


def test_bench_delegates_or_explains(monkeypatch, tmp_path, capsys):
    script = tmp_path / "bench.py"
    script.write_text("def main(argv):\n    print('BENCH', argv)\n    return 0\n")
    monkeypatch.setattr(cli, "bench_script", lambda: str(script))
    assert cli.main(["bench", "--num-seqs", "2"]) == 0
    assert "BENCH ['--num-seqs', '2']" in capsys.readouterr().out
    assert cli.main(["bench", "throughput", "-tp", "2"]) == cli.main(["bench", "latency", "-tp", "2"]) == 0  # (vLLM's)
    assert "BENCH ['-tp', '2']\nBENCH ['--latency', '-tp', '2']" in capsys.readouterr().out
    monkeypatch.setattr(cli, "bench_script", lambda: str(tmp_path / "nope.py"))
    assert cli.main(["bench", "--help"]) == 2
    assert "missing" in capsys.readouterr().err


# -- model ids (jaxinfer.hub) -------------------------------------------------------------------------------
def test_model_ids_dir_preset_and_cached_hub_id(tiny_dir, tmp_path, monkeypatch):
    import shutil

    from jaxinfer.config import ModelConfig
    from jaxinfer.hub import resolve_model
    assert resolve_model(tiny_dir) == tiny_dir
    assert resolve_model("qwen3-0.6b") == "qwen3-0.6b"
    # A hub id already in the local Hugging Face cache resolves offline to its snapshot directory.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "hub" / "models--someone--tiny-qwen3"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123456789abcdef0123456789abcdef01234567")
    snap = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_dir, snap)
    path = resolve_model("someone/tiny-qwen3", cache_dir=str(tmp_path / "hub"))
    assert os.path.samefile(path, snap)
    assert ModelConfig.from_pretrained(path).vocab_size == 512


def test_uncached_hub_id_offline_says_how_to_get_it(tmp_path, monkeypatch):
    from jaxinfer.hub import resolve_model
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="huggingface-cli download Qwen/Qwen3-0.6B") as e:
        resolve_model("Qwen/Qwen3-0.6B", cache_dir=str(tmp_path))
    assert "qwen3-0.6b" in str(e.value)                     # the preset is offered as an alternative
    with pytest.raises(FileNotFoundError, match="not a directory, the demo model .'qwen3-pydoc'., an embedded preset"):
        resolve_model(str(tmp_path / "no" / "such" / "dir"))


def test_the_demo_model_by_name(tmp_path, monkeypatch):
    """`LLM("qwen3-pydoc")` (the name the README and the CLI use) is the shipped checkpoint; a local folder of
    that name still wins."""
    from jaxinfer.assets import demo_model_path
    from jaxinfer.hub import resolve_model
    assert resolve_model("qwen3-pydoc") == demo_model_path()
    (tmp_path / "qwen3-pydoc").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model("qwen3-pydoc") == "qwen3-pydoc"


def test_generate_defaults_to_the_demo_model():
    """The main job with no model named: the shipped trained model, readable text (no token placeholders)."""
    r = jaxinfer("generate", "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    outs = [line for line in r.stdout.splitlines() if line.startswith("Output: ")]
    assert len(outs) == 4 and not any("<" in o and ">" in o for o in outs), r.stdout
    words = sum(len([w for w in o[8:].split() if w.strip("'\".,:;()").isalpha()]) for o in outs)
    assert words >= 8, r.stdout
    assert "qwen3-pydoc" in r.stderr


def test_sampling_flags_default_to_the_generation_config():
    """generate / chat take the sampling flags not given from the model's generation_config.json (vLLM's default
    sampling params), else their own defaults (generate: greedy; chat: temperature 0.6)."""
    qwen3 = dict(temperature=0.6, top_k=20, top_p=0.95, max_tokens=99)     # as LLM.default_sampling_params
    p = cli.build_parser()
    gen = cli.sampling(p.parse_args(["generate"]), qwen3)
    assert (gen.temperature, gen.top_k, gen.top_p, gen.max_tokens) == (0.6, 20, 0.95, 99)   # max_new_tokens too
    mine = cli.sampling(p.parse_args(["generate", "--top-k", "5", "--temperature", "0.5", "--max-tokens", "7"]), qwen3)
    assert (mine.temperature, mine.top_k, mine.top_p, mine.max_tokens) == (0.5, 5, 0.95, 7)
    plain = cli.sampling(p.parse_args(["generate"]), {})
    assert (plain.temperature, plain.top_k, plain.top_p, plain.max_tokens) == (0.0, 0, 1.0, 32)
    chat = cli.sampling(p.parse_args(["chat"]), {})
    assert (chat.temperature, chat.top_k, chat.max_tokens) == (0.6, 0, 256)
    # a file's temperature 1.0 is a recommendation too, though it is SamplingParams' own default
    one = cli.sampling(p.parse_args(["generate"]), dict(temperature=1.0, top_p=0.9))
    assert (one.temperature, one.top_p) == (1.0, 0.9)


def test_vllms_config_file(tmp_path, capsys):
    """`serve --config FILE` (vLLM's): YAML or JSON keys are flags (dashes or underscores; `model` the model); they
    become defaults, so the command line wins, a MODEL given stays the model (a list-valued key must not swallow
    it), false turns a flag off; lists and mappings as vLLM passes them; a bad file or key is exit 2."""
    ap = cli.build_parser()

    def parse(*argv):
        return ap.parse_args(cli.bare_flags(cli.dashed(cli.config_file_args(list(argv), ap)), cli.CHUNKED))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: m\nport: 8123\nmax_model_len: 512\nenable-prefix-caching: false\nserved-model-name: [a, b]\n"
                   "enable-auto-tool-choice: true\ntool-call-parser: hermes\nhf-overrides: {rope_theta: 5}\n"
                   "api-key: secret\n")
    a = parse("serve", "--config", str(cfg), "--port", "9000")
    assert (cli.model_arg(a), a.port, a.max_model_len, a.enable_prefix_caching, a.served_model_name, a.api_key) == \
        ("m", 9000, 512, False, ["a", "b"], ["secret"])
    assert a.enable_auto_tool_choice is True and a.tool_call_parser == "hermes" and a.hf_overrides == {"rope_theta": 5}
    for argv in (("serve", "tiny", "--config", str(cfg)), ("serve", "--config", str(cfg), "tiny"),
                 ("serve", "--model", "tiny", "--config", str(cfg))):
        a = parse(*argv)
        assert cli.model_arg(a) == "tiny" and a.api_key == ["secret"], argv      # (the command line's model wins)
    js = tmp_path / "c.json"
    js.write_text('{"api-key": ["k", "k2"], "disable_uvicorn_access_log": true, "allowed-origins": ["http://a"]}')
    a = parse("serve", "m2", f"--config={js}", "--api-key", "cli")
    got = (a.model, a.api_key, a.disable_uvicorn_access_log, a.allowed_origins)
    assert got == ("m2", ["cli"], True, '["http://a"]')
    for body, name, words in (("- 1", "l.yaml", "mapping"), ("{}", "c.toml", "YAML"),
                              ("a: [", "b.yaml", "cannot be read"), ("no-such-flag: 1", "u.yaml", "names no flag"),
                              ("log-level: loud", "v.yaml", "not one of"), ("port: http", "w.yaml", "port")):
        (tmp_path / name).write_text(body)
        with pytest.raises(SystemExit) as e:
            parse("serve", "--config", str(tmp_path / name))
        assert e.value.code == 2 and words in capsys.readouterr().err
