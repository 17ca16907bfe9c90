"""bench.py stays honest: the benchmark code path runs on a tiny model, counts every output token and
compiles nothing after warm-up. (Speed itself is only measured on the GPU machine.)"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import bench  # noqa: E402


def test_bench_runs_and_counts(tiny_dir, tmp_path, capsys):
    args = ["--model", tiny_dir, "--dtype", "float32", "--attn-backend", "xla", "--num-seqs", "5",
            "--max-input-len", "120", "--max-output-len", "110", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "512", "--prefill-buckets", "512", "--decode-buckets", "4",
            "--max-model-len", "256", "--block-size", "64", "--json", str(tmp_path / "r.json")]
    r = bench.main(args)
    _, params = bench.workload(5, 120, 110, vocab=512)
    assert r["output_tokens"] == sum(p.max_tokens for p in params)
    assert r["compilations_after_warmup"] == 0 and r["num_seqs"] == 5
    assert r["decode_steps"] >= max(p.max_tokens for p in params) - 1
    assert 0 < r["pct_of_floor"] and r["floor_s"] > 0
    out = capsys.readouterr().out
    assert "tok/s" in out and "% of the floor" in out
    assert os.path.isfile(tmp_path / "r.json")


def test_workload_is_nano_vllms():
    prompts, params = bench.workload(256, 1024, 1024)
    assert sum(len(p) for p in prompts) == 142827          # the published totals of nano-vllm's bench.py
    assert sum(p.max_tokens for p in params) == 133966
