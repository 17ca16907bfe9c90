"""scripts/bench_serve.py cannot rot: its --quick mode runs the whole path on CPU (server process, client
processes, concurrency and request-rate levels, the offline comparison) and every token is accounted for."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import bench_serve  # noqa: E402
from test_server import BASE, jax_cache_env  # noqa: E402


def test_bench_serve_quick(tiny_dir, tmp_path, tmp_path_factory, capsys, monkeypatch):
    for k, v in jax_cache_env(tmp_path_factory).items():     # the steps test_server*.py compiled
        monkeypatch.setenv(k, v)
    assert bench_serve.QUICK_ENGINE == BASE, "the same engine options: the same compiled steps"
    out = tmp_path / "serve.json"
    r = bench_serve.main([tiny_dir, "--quick", "--json", str(out), "--max-waiting-requests", "4", "--overload", "16"])
    assert r["server_exit_code"] == 0
    names = [lv["name"] for lv in r["levels"]]
    assert names == ["concurrency 1", "concurrency 4", "rate 20/s"]
    for lv, off in zip(r["levels"], r["offline"]):
        assert lv["errors"] == 0 and lv["lost_tokens"] == 0, lv
        assert lv["kv_blocks_free_after"] == lv["kv_blocks_total"], "KV blocks must all come back"
        assert lv["output_tokens"] == off["output_tokens"] > 0        # the same requests, offline
        assert lv["ttft_ms"]["p50"] > 0 and lv["tpot_ms"]["p50"] > 0 and lv["itl_ms"]["p99"] >= lv["itl_ms"]["p50"]
        assert lv["server_over_offline"] > 0
    assert r["levels"][0]["tpot_over_offline_batch1"] > 0
    ov = r["overload"]                    # 16 streams against 8 running + 4 waiting: some refused, none lost
    assert ov["ok"] and ov["completed"] > 0 and ov["rejected_503"] > 0, ov
    assert ov["kv_blocks_free_after"] == ov["kv_blocks_total"]
    assert ov["probe"]["requests"] > 0 and ov["probe"]["errors"] == 0, ov["probe"]   # the idle client's requests
    assert json.loads(out.read_text())["levels"][0]["name"] == "concurrency 1"
    assert "offline batch-1" in capsys.readouterr().out


def test_requests_fit_the_model(tiny_dir):
    """Without --vocab-size the prompt ids are taken modulo the model's own vocabulary (every request to a small
    model was a 400 before), and lengths below W's 100 are honoured instead of an empty random range."""
    from argparse import Namespace
    from serve_load import min_lens, vocab_size, workload
    a = Namespace(vocab_size=None, model=tiny_dir, quick=False, max_input_len=16, max_output_len=4)
    assert vocab_size(a) == 512 and vocab_size(Namespace(vocab_size=None, model="served-name")) == 151936
    reqs = workload(20, a.max_input_len, a.max_output_len, *min_lens(a), vocab_size(a))
    assert all(len(p) == 16 and m == 4 and max(p) < 512 for p, m in reqs)
