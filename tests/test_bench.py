"""bench.py stays honest: the benchmark code path runs on a tiny model, counts every output token and
compiles nothing after warm-up. (Speed itself is only measured on the GPU machine.)"""
import argparse
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import bench  # noqa: E402


def test_bench_runs_and_counts(tiny_dir, tmp_path, capsys):
    args = ["--model", tiny_dir, "--dtype", "float32", "--attn-backend", "xla", "--num-seqs", "5",
            "--max-input-len", "120", "--max-output-len", "110", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "512", "--prefill-buckets", "512", "--decode-buckets", "4",
            "--max-model-len", "256", "--block-size", "64", "--json", str(tmp_path / "r.json"),
            "--step-log", str(tmp_path / "log.json"), "--repeats", "2",
            "--num-scheduler-steps", "1"]     # one step per call: the step log has one entry per step
    r = bench.main(args)
    _, params = bench.workload(5, 120, 110, vocab=512)
    assert r["output_tokens"] == sum(p.max_tokens for p in params)
    assert r["compilations_after_warmup"] == 0 and r["num_seqs"] == 5
    with open(tmp_path / "r.json") as f:                               # the engine the run measured, every field
        on_disk = json.load(f)["engine"]
    assert on_disk["num_scheduler_steps"] == 1 and on_disk["block_size"] == 64 and on_disk["warmup"] is True
    assert r["decode_steps"] >= max(p.max_tokens for p in params) - 1
    assert 0 < r["pct_of_floor"] and r["floor_s"] > 0
    assert r["floor_s_at_reference"] > 0 and r["pct_of_reference_floor"] > 0
    host = r["host_ms_per_step"]
    assert set(host) == {"schedule", "dispatch", "wait", "apply"} and all(v >= 0 for v in host.values())
    assert host["schedule"] > 0 and host["dispatch"] > 0
    out = capsys.readouterr().out
    assert "tok/s" in out and "% of the floor" in out and "host ms per step" in out
    w = r["warmup_breakdown"]         # where LLM()'s warm-up went: bench.py warms up on a CPU too, so compile time > 0
    assert w["compile_s"] > 0 and 0 < len(w["slowest"]) <= min(5, w["programs"])
    assert sum(n for n, _ in w["compile_by_kind"].values()) == w["programs"] and "decode" in w["compile_by_kind"]
    assert abs(sum(v for k, v in w.items() if k.endswith("_s") and k != "compile_sum_s") - r["warmup_s"]) < 1e-6
    assert os.path.isfile(tmp_path / "r.json")
    assert len(r["walls_s"]) == 2 and min(r["walls_s"]) <= r["wall_s"] <= max(r["walls_s"])
    assert r["prefix_cache_hit_tokens"] == 0, "each repeat computes its prompts (prefix cache reset)"
    log = json.load(open(tmp_path / "log.json"))["steps"]
    assert len(log) == r["prefill_steps"] + r["decode_steps"]
    by_bucket = r["host_ms_by_bucket"]
    assert by_bucket["decode 4"]["steps"] == r["decode_steps"] and by_bucket["prefill 512"]["steps"] == r["prefill_steps"]
    assert sum(row[1] for row in log if row[0] == "decode") == r["output_tokens"] - r["num_seqs"]
    cols = json.load(open(tmp_path / "log.json"))["columns"]
    assert cols[-2:] == ["table_width", "context_tokens"] and all(len(row) == len(cols) for row in log)
    # a decode step's context: its rows' tokens (at least one each), within its B x W pages
    assert all(row[1] <= row[-1] <= row[2] * row[-2] * 64 for row in log if row[0] == "decode")   # block size 64


def test_workload_is_nano_vllms():
    prompts, params = bench.workload(256, 1024, 1024)
    assert sum(len(p) for p in prompts) == 142827          # the published totals of nano-vllm's bench.py
    assert sum(p.max_tokens for p in params) == 133966


def test_vllms_fixed_lengths(tiny_dir):
    """vLLM's `bench throughput --num-prompts N --input-len I --output-len O`: every prompt I tokens, every output O;
    with --latency they are its request's lengths."""
    prompts, params = bench.workload(6, 30, 9, vocab=512, fixed_input=True, fixed_output=True)
    assert {len(p) for p in prompts} == {30} and {p.max_tokens for p in params} == {9}
    base = ["--model", tiny_dir, "--dtype", "float32", "--attn-backend", "xla", "--max-model-len", "128",
            "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--block-size", "16"]
    r = bench.main(base + ["--num-prompts", "3", "--input-len", "20", "--output-len", "7"])
    assert r["num_seqs"] == 3 and r["output_tokens"] == 21
    r = bench.main(base + ["--latency", "--input-len", "40", "--output-len", "5", "--logprobs", "2"])
    assert r["prompt_tokens"] == 40 and r["output_tokens"] == 5, r
    assert r["sampling"]["logprobs"] == 2 and r["compilations_after_warmup"] == 0, r     # (its requests ask too)
    with pytest.raises(ValueError, match="drop --latency"):
        bench.main(base + ["--latency", "--input-len", "40", "--output-len", "5", "--peer", "hf"])


def test_peer_hf_runs_same_subset(tiny_dir, tmp_path):
    args = ["--model", tiny_dir, "--dtype", "float32", "--attn-backend", "xla", "--num-seqs", "3",
            "--max-input-len", "40", "--max-output-len", "20", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "128", "--prefill-buckets", "128", "--decode-buckets", "4",
            "--max-model-len", "128", "--block-size", "16", "--peer", "hf", "--peer-num-seqs", "2",
            "--peer-max-tokens", "6"]
    peer = bench.main(args)["peer"]
    assert peer["peer_output_tokens"] == peer["ours_output_tokens"] == 2 * 6
    assert peer["speedup"] > 0


def test_preset_export_runs_in_transformers(tmp_path):
    """A preset's random weights exported for the peer give transformers the same logits as ours."""
    import jax.numpy as jnp
    import numpy as np
    from helpers import hf_logits, hf_model

    from jaxinfer.config import ModelConfig
    from jaxinfer.model.loader import load_params, save_checkpoint
    from jaxinfer.model.qwen3 import dense_logits, init_params
    cfg = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    params = init_params(cfg, jnp.float32, seed=1)
    path = save_checkpoint(params, cfg, str(tmp_path / "p"), dtype="float32")
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    ours = np.asarray(dense_logits(cfg, params, jnp.array([ids])))[0]
    np.testing.assert_allclose(ours, hf_logits(hf_model(path), ids), atol=1e-4, rtol=1e-4)
    back = load_params(path, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(back["layers"]["qkv_proj"]), np.asarray(params["layers"]["qkv_proj"]))
    save_checkpoint(params, cfg, str(tmp_path / "b"), dtype="bfloat16")    # bf16 export also loads
    assert load_params(str(tmp_path / "b"), dtype=jnp.bfloat16)["norm"].dtype == jnp.bfloat16


def test_bench_step_anatomy_runs(tiny_dir, tmp_path):
    import bench_step
    r = bench_step.main(["--model", tiny_dir, "--dtype", "float32", "--batch", "2", "--context", "40",
                         "--attn-backend", "xla", "--iters", "2", "--json", str(tmp_path / "s.json"),
                         "--profile", str(tmp_path / "trace")])
    assert set(r["times_ms"]) == {"step", "pipelined", "dispatch", "engine", "engine_dispatch", "layers",
                                  "attention", "head"}
    prof = r["profile"]                   # on CPU the summary reads the host's XLA threads
    assert prof["kernels"] > 0 and 0 < prof["busy_ms"] <= prof["span_ms"] + 1e-6 and prof["top"]
    assert all(t > 0 for t in r["times_ms"].values()) and r["floors_ms"]["attention"] > 0
    assert os.path.isfile(tmp_path / "s.json")


def test_skip_temp_mode_follows_jaxlib(monkeypatch):
    """bench.py and the jaxinfer commands add the SKIP_TEMP command-buffer mode on jaxlib 0.11 only, never twice;
    importing jaxinfer adds nothing."""
    from jaxinfer import xla_options
    for version, want in (((0, 10), False), ((0, 11), True), ((0, 12), False)):
        monkeypatch.setattr(xla_options, "jaxlib_minor", lambda v=version: v)
        assert xla_options.wants_skip_temp({}) is want
        assert (xla_options.SKIP_TEMP in xla_options.command_buffer_flags({"XLA_FLAGS": "--a=1"})) is want
    mode = "--xla_gpu_command_buffer_update_mode=NONE"
    assert xla_options.command_buffer_flags({"XLA_FLAGS": mode}) == mode       # the user's choice stands


def test_step_options():
    from jaxinfer.xla_options import step_compiler_options
    assert step_compiler_options("cpu", 1) == {}
    off = {"xla_gpu_enable_triton_gemm": False, "xla_disable_hlo_passes": "rematerialization"}
    assert step_compiler_options("gpu", 1) == off
    assert step_compiler_options("gpu", 2) == {**off, "xla_gpu_graph_min_graph_size": 1}


def test_bench_takes_the_engine_flags_and_defaults():
    for flag, value in (("--repeats", "0"), ("--latency-batch", "0"), ("--latency-prompt", "0"),
                        ("--latency-output", "0"), ("--top-p", "1.5"), ("--top-p", "nan"), ("--reference-bw", "0"),
                        ("--reference-bw", "-1"), ("--json", "/"), ("--json", "/no/such/folder/x.json")):
        with pytest.raises(SystemExit):
            bench.parse([flag, value])
    a = bench.parse(["qwen3-8b", "--max-num-seqs", "4", "--json", "x.json"])      # (checked before the run)
    assert bench.parse(["--num-prompts", "7"]).num_seqs == 7                         # vLLM's name
    from jaxinfer.cli import engine_kwargs
    assert a.model == "qwen3-8b" and engine_kwargs(a) == {"max_num_seqs": 4}   # the rest: the engine's defaults


def test_bench_step_compiler_option_values():
    import bench_step
    assert bench_step._option_value("true") is True and bench_step._option_value("False") is False
    assert bench_step._option_value("12") == 12 and bench_step._option_value("abc") == "abc"


def test_bench_kernels_smoke_writes_json(tmp_path):
    import json
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "k.json"
    # --impls keeps those columns only (here without the fp8 and fused-qkv ones); an unknown one is refused by name;
    # on a CPU the script runs --smoke without being told (the GPU's shapes interpreted would take hours)
    ran = subprocess.run([sys.executable, os.path.join(root, "scripts", "bench_kernels.py"), "--impls",
                          "xla,pallas", "--json", str(out)], check=True, text=True,
                         env={**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"}, capture_output=True)
    assert "no GPU: running --smoke" in ran.stdout
    r = json.loads(out.read_text())
    assert r["decode"][0]["pallas_s"] > 0 and r["prefill"][0]["pallas_s"] > 0 and r["decode"][0]["xla_s"] > 0
    assert "pallas_qkv_s" not in r["decode"][0] and "fp8_s" not in r["decode"][0]
    bad = subprocess.run([sys.executable, os.path.join(root, "scripts", "bench_kernels.py"), "--smoke", "--impls",
                          "pallas,nope"], env={**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "nope" in bad.stderr


def test_latency_refuses_requests_that_would_stop_early(tiny_dir):
    """--latency's TPOT is over --latency-output tokens: a prompt + output past max_model_len is refused, not timed."""
    with pytest.raises(ValueError, match="max_model_len=64"):
        bench.run_latency(bench.parse([tiny_dir, "--dtype", "float32", "--latency", "--latency-prompt", "60",
                                       "--latency-output", "10", "--max-model-len", "64", "--block-size", "4"]))


def test_lengths_past_max_model_len_are_refused_before_the_warm_up(tiny_dir, monkeypatch):
    """The longest prompt + output (or --latency's prompt + output) past an explicit --max-model-len: refused before
    any compile (as vLLM's throughput benchmark: a request cut short would make the numbers another workload's)."""
    monkeypatch.setattr(bench, "build", lambda args: pytest.fail("built the engine"))
    base = [tiny_dir, "--max-model-len", "64"]
    with pytest.raises(ValueError, match="need 110 tokens .*max_model_len=64"):
        bench.main(base + ["--input-len", "100", "--output-len", "10"])
    with pytest.raises(ValueError, match="need 70 tokens .*max_model_len=64"):
        bench.main(base + ["--latency", "--input-len", "60", "--output-len", "10"])
    with pytest.raises(ValueError, match="need 65 tokens"):
        bench.main(base + ["--max-input-len", "60", "--max-output-len", "5"])
    with pytest.raises(ValueError, match="need 1084 tokens"):          # (the default outputs: up to 1,024 tokens)
        bench.main(base + ["--max-input-len", "60"])


def test_bench_script_reports_bad_engine_values_without_a_traceback():
    """python scripts/bench.py with a value the engine refuses: its message and exit status 2, as `jaxinfer bench`."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bad = subprocess.run([sys.executable, os.path.join(root, "scripts", "bench.py"), "-tp", "0"], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "tensor_parallel_size=0" in bad.stderr and "Traceback" not in bad.stderr


def test_trace_summary_needs_a_trace(tmp_path):
    import pytest
    import trace_summary
    with pytest.raises(FileNotFoundError, match="xplane"):
        trace_summary.summarize(str(tmp_path))
    assert trace_summary._group("loop_add_fusion.12") == "loop_add_fusion"
    assert trace_summary._group("paged_attention_decode") == "paged_attention_decode"


def test_trace_summary_splits_each_device_by_category():
    """Per device: busy is the union of its kernels' intervals, idle the rest of its span, and each kernel's
    time goes to collective / gemm / attention / other by its name."""
    import trace_summary
    ms = 1_000_000
    planes = {"/device:GPU:0": [("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 0, 2 * ms),
                                ("sm90_xmma_gemm_bf16bf16_bf16f32", 1 * ms, 4 * ms),
                                ("paged_attention_decode", 6 * ms, 7 * ms), ("loop_add_fusion", 7 * ms, 8 * ms)],
              "/device:GPU:1": [("nvjet_hsh_128x256", 0, 1 * ms), ("input_reduce_fusion", 3 * ms, 4 * ms)]}
    d0, d1 = trace_summary.per_device(planes, steps=2)
    assert d0["device"] == "/device:GPU:0" and d0["span_ms"] == 4.0 and d0["busy_ms"] == 3.0
    assert d0["idle_ms"] == 1.0
    assert (d0["collective_ms"], d0["gemm_ms"], d0["attention_ms"], d0["other_ms"]) == (1.0, 1.5, 0.5, 0.5)
    assert (d1["busy_ms"], d1["idle_ms"], d1["gemm_ms"], d1["other_ms"]) == (1.0, 1.0, 0.5, 0.5)
    assert trace_summary.category("cutlass_80_wmma_tensorop") == "gemm"
    assert trace_summary.category("fusion") == "other"


def test_bench_host_measures_and_compares(tmp_path):
    """scripts/bench_host.py: host ms per step over a stubbed device, and the in-process A/B (here against this
    very checkout, so both sides run the same functions)."""
    import bench_host
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = bench_host.main(["--rows", "8", "--steps", "20", "--json", str(tmp_path / "h.json")])["host"][0]
    assert r["rows"] == 8 and 0 < r["schedule_ms"] < r["wall_ms_per_step"] and r["generate_ms_per_step"] > 0
    ab = bench_host.main(["--rows", "8", "--against", root])["host"][0]
    assert ab["this"] > 0 and ab["other"] > 0 and len(ab["runs_ms"]["other"]) == 6
    assert (tmp_path / "h.json").exists()


def test_bench_sampling_times_both_draws(tmp_path):
    """scripts/bench_sampling.py: the plain draw, the sorted ones (by threshold, with ids on uint32 and on float
    keys), and Qwen3's settings sorted and not, in ms, written to JSON."""
    import json

    import bench_sampling
    r = bench_sampling.main(["--rows", "2", "--vocab", "300", "--candidates", "16", "--json", str(tmp_path / "s.json")])
    assert set(r["ms"]["2"]) == {"plain", "qwen3_top_k_16"} | {f"{f}{d}" for f in ("sort", "top_p", "qwen3_sort")
                                                                for d in ("", "_threshold", "_ids", "_ids_float")}
    assert r["cub"]["2"]["sort"] is False          # a CPU has no CUB
    assert all(v > 0 for v in r["ms"]["2"].values())
    assert json.load(open(tmp_path / "s.json"))["vocab"] == 300


def test_use_triton_ptxas(tmp_path, monkeypatch):
    """The `jaxinfer` commands and bench.py with attn_backend="triton" put triton's own ptxas on PATH when none is
    there (jaxlib runs it to load jax-triton kernels); an existing one, or no triton, leaves PATH alone."""
    import importlib.util
    import types

    from jaxinfer import xla_options
    pkg = tmp_path / "site" / "triton"
    bin_dir = pkg / "backends" / "nvidia" / "bin"
    bin_dir.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    tool = bin_dir / "ptxas"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    spec = types.SimpleNamespace(origin=str(pkg / "__init__.py"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "triton" else None)
    env = {"PATH": str(tmp_path / "empty")}
    assert xla_options.use_triton_ptxas(env) == str(bin_dir)
    assert env["PATH"] == f"{bin_dir}{os.pathsep}{tmp_path / 'empty'}"
    assert xla_options.use_triton_ptxas(env) is None                    # found now: nothing more to add
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    env = {"PATH": ""}
    assert xla_options.use_triton_ptxas(env) is None and env["PATH"] == ""


def test_bench_kernels_heads_flag_names_a_bad_value():
    from jaxinfer.cli_types import head_counts
    assert head_counts("32,8") == (32, 8)
    for bad in ("3", "a,b", "16,3", "0,1"):
        with pytest.raises(argparse.ArgumentTypeError, match=bad):
            head_counts(bad)


@pytest.mark.parametrize("flags, match", [(["--top-k", "-7"], "top_k=-7"), (["--logprobs", "50"], "logprobs=50"),
                                          (["--presence-penalty", "9"], "presence_penalty=9")])
def test_bench_refuses_bad_request_flags_before_loading(tmp_path, flags, match):
    """The per-request flags are checked before the model loads (a missing checkpoint would fail later)."""
    env = dict(os.environ)
    with pytest.raises(ValueError, match=match):
        bench.main([str(tmp_path / "no-such-model"), *flags])
    assert os.environ == env            # refused before the process flags were set


def test_bench_flags_checked_before_the_run_and_strict_json(tiny_dir, tmp_path, capsys):
    """--step-log in a missing folder, --latency-output 1 (no TPOT), two models and requests longer than
    max_model_len (given, or capped by the pool: after loading) are refused, the others before loading;
    the JSON is strict: a TPOT of one-token outputs (NaN) is written as null."""
    import json
    for flags in (["--step-log", str(tmp_path / "nope" / "s.json")], ["--latency", "--latency-output", "1"]):
        with pytest.raises(SystemExit) as e:
            bench.main([tiny_dir, *flags])
        assert e.value.code == 2
    assert "less than 2" in capsys.readouterr().err
    with pytest.raises(ValueError, match="two models given"):          # (the script's handler: one line, exit 2)
        bench.main([tiny_dir, "--model", str(tmp_path / "other")])
    with pytest.raises(ValueError, match=r"need 20 tokens of context \(prompt \+ output\): .* max_model_len=18"):
        bench.main([tiny_dir, "--max-input-len", "16", "--max-output-len", "4", "--max-model-len", "18"])
    with pytest.raises(ValueError, match="need 20 tokens .* max_model_len=16"):    # (a pool that caps the length)
        bench.main([tiny_dir, "--dtype", "float32", "--max-input-len", "16", "--max-output-len", "4", "--block-size",
                    "16", "--num-kvcache-blocks", "1", "--max-num-seqs", "2"])
    out = tmp_path / "r.json"
    r = bench.main([tiny_dir, "--dtype", "float32", "--num-seqs", "2", "--max-input-len", "8", "--max-output-len", "1",
                    "--max-num-seqs", "2", "--max-model-len", "64", "--json", str(out)])
    assert r["output_tokens"] == 2 and r["tpot_ms_p50"] != r["tpot_ms_p50"]          # NaN in the dict
    strict = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert strict["tpot_ms_p50"] is None and strict["output_tokens"] == 2


def test_bench_flags_as_the_cli_and_refused_early(tmp_path, monkeypatch):
    """bench.py takes vLLM's underscore spellings as the CLI does; an unwritable --json and a latency run of one
    output token are refused before the model loads; `jaxinfer bench --no-process-flags` leaves XLA_FLAGS alone
    (bench.py sets the process flags itself, unless told not to)."""
    a = bench.parse(["--max_model_len", "64", "--num_prompts", "3", "--model", "m"])
    assert (a.max_model_len, a.num_seqs, a.model_flag) == (64, 3, "m")
    with pytest.raises(SystemExit):
        bench.parse(["--json", "/proc/no-such-file.json"])
    with pytest.raises(ValueError, match="TPOT needs 2"):
        bench.main([str(tmp_path / "no-such-model"), "--latency", "--output-len", "1", "--no-process-flags"])
    from jaxinfer import cli, xla_options
    monkeypatch.setattr(xla_options, "jaxlib_minor", lambda: (0, 11))     # where the SKIP_TEMP mode applies
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=nowhere")
    seen = []
    monkeypatch.setattr(cli, "cmd_bench", lambda argv: seen.append((argv, os.environ["XLA_FLAGS"])) or 0)
    assert cli.main(["bench", "--no-process-flags"]) == 0
    assert seen == [(["--no-process-flags"], "--xla_dump_to=nowhere")]
