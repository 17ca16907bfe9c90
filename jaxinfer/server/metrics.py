"""/metrics in Prometheus' text format (prometheus_client), names as vLLM's with a `jaxinfer:` prefix, and the same
numbers again under vLLM's own `vllm:` names (VLLM_NAMES), so that dashboards made for vLLM read this server.

Where each number comes from:
- engine gauges and counters (running / waiting requests, KV cache usage, prompt and generation tokens,
  preemptions, prefix-cache queries and hits) and the histograms of finished requests' phases, token gaps and
  lengths (RequestTimes, kept by the core) are the engine core's `stats()`, fetched at scrape time: one core, so
  every API process reports the same values;
- latency histograms (time to first token, time per output token, end-to-end latency) and the request
  counters (finished by reason, rejected 503s) are measured in the API process, as the client sees them.
  With several API processes (--api-server-count) these go through prometheus_client's multiprocess mode:
  each API process writes its values to files in one directory (PROMETHEUS_MULTIPROC_DIR, set by `serve`
  before the API processes start) and any of them sums them all for a scrape, so one scrape of the shared
  port sees the whole server.
Without prometheus_client installed the server runs and /metrics answers 501.
"""
from __future__ import annotations

import itertools
import os

# bucket bounds (seconds), as vLLM's
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0)
# the engine core's request histograms (RequestTimes): vLLM's phases of a request, its inter-token latency (finer
# buckets below 10 ms added), its prompt and output lengths
LATENCY_BUCKETS = E2E_BUCKETS + (7680.0,)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
CORE_HISTOGRAMS = {"request_queue_time_seconds": "Waiting before the request's first step (engine core)",
                   "request_prefill_time_seconds": "First step to first token (engine core)",
                   "request_decode_time_seconds": "First token to last token (engine core)",
                   "request_inference_time_seconds": "First step to last token (engine core)",
                   "inter_token_latency_seconds": "Time between a request's consecutive tokens (engine core)",
                   "request_prompt_tokens": "Prompt tokens of each finished request",
                   "request_generation_tokens": "Output tokens of each finished request"}
P = "jaxinfer:"
# jaxinfer's name -> vLLM's (its current releases): the metrics given twice
VLLM_NAMES = {"time_to_first_token_seconds": "time_to_first_token_seconds",
              "time_per_output_token_seconds": "request_time_per_output_token_seconds",
              "e2e_request_latency_seconds": "e2e_request_latency_seconds", "request_success": "request_success",
              "num_requests_running": "num_requests_running", "num_requests_waiting": "num_requests_waiting",
              "kv_cache_usage_perc": "kv_cache_usage_perc", "prompt_tokens": "prompt_tokens",
              "generation_tokens": "generation_tokens", "num_preemptions": "num_preemptions",
              "prefix_cache_hit_tokens": "prefix_cache_hits", "prefix_cache_query_tokens": "prefix_cache_queries",
              **{name: name for name in (*CORE_HISTOGRAMS, "request_params_n", "request_params_max_tokens",
                                         "request_max_num_generation_tokens", "cache_config_info")}}
N_BUCKETS = (1, 2, 5, 10, 20)


# vLLM 0.8-0.10's names of the same numbers (renamed in 0.10.2 / 0.11; those releases' dashboards read them)
VLLM_OLD_NAMES = {"kv_cache_usage_perc": "gpu_cache_usage_perc", "prefix_cache_hit_tokens": "gpu_prefix_cache_hits",
                  "prefix_cache_query_tokens": "gpu_prefix_cache_queries",
                  "inter_token_latency_seconds": "time_per_output_token_seconds"}


def _names(name: str) -> list[str]:
    return [P + name] + [f"vllm:{t[name]}" for t in (VLLM_NAMES, VLLM_OLD_NAMES) if name in t]


def available() -> bool:
    try:
        import prometheus_client  # noqa: F401
        return True
    except ImportError:
        return False


class ServerMetrics:
    """One API process's metrics. `observe_*` are cheap (a lock and an add); `render(stats)` builds the
    text of a scrape, with the engine core's `stats` dict. `kv_cache_dtype`: the option as given ("auto", "fp8",
    ...), cache_config_info's label as in vLLM (stats() names the stored dtype)."""

    def __init__(self, model_name: str, max_model_len: int = 1 << 20, kv_cache_dtype: str | None = None):
        self.enabled = available()
        self.model_name, self.kv_cache_dtype = model_name, kv_cache_dtype
        if not self.enabled:
            return
        from prometheus_client import CollectorRegistry, Counter, Histogram
        self.registry = CollectorRegistry(auto_describe=True)
        lb = ["model_name"]

        def both(cls, name, doc, labels, **kw):       # (jaxinfer's name and vLLM's)
            return [cls(n, doc, labels, registry=self.registry, **kw) for n in _names(name)]
        self.ttft = both(Histogram, "time_to_first_token_seconds", "Time to first token (API process: request "
                         "received to first token out)", lb, buckets=TTFT_BUCKETS)
        self.tpot = both(Histogram, "time_per_output_token_seconds", "Mean time per output token after the first, "
                         "per request", lb, buckets=TPOT_BUCKETS)
        self.e2e = both(Histogram, "e2e_request_latency_seconds", "Request received to last token out", lb,
                        buckets=E2E_BUCKETS)
        self.success = both(Counter, "request_success", "Finished engine requests (one per prompt and n)",
                            lb + ["finished_reason"])
        tokens = token_buckets(max_model_len)
        self.params_n = both(Histogram, "request_params_n", "The n of each finished request", lb, buckets=N_BUCKETS)
        self.params_max_tokens = both(Histogram, "request_params_max_tokens", "The max_tokens of each finished "
                                      "request", lb, buckets=tokens)
        self.most_tokens = both(Histogram, "request_max_num_generation_tokens", "The most output tokens of any of "
                                "a finished request's n choices", lb, buckets=tokens)
        self.rejected = Counter(P + "requests_rejected", "Requests refused with 503 (queue bound, draining, "
                                "engine gone)", lb + ["reason"], registry=self.registry)
        self._stats: dict = {}
        for m in (*self.ttft, *self.tpot, *self.e2e, *self.params_n, *self.params_max_tokens, *self.most_tokens):
            m.labels(model_name)                  # (every series there from the start, at 0, as vLLM's)
        for m, reason in itertools.product(self.success, ("stop", "length", "abort")):
            m.labels(model_name, reason)

    def observe_request(self, t_start: float, t_first: float | None, t_end: float, n_tokens: int,
                        reason: str | None) -> None:
        """One engine request (one choice) finished: its latencies; reason is its finish_reason."""
        if not self.enabled:
            return
        name = self.model_name
        for i in range(len(self.e2e)):
            if t_first is not None:
                self.ttft[i].labels(name).observe(t_first - t_start)
                if n_tokens > 1:
                    self.tpot[i].labels(name).observe((t_end - t_first) / (n_tokens - 1))
            self.e2e[i].labels(name).observe(t_end - t_start)
            self.success[i].labels(name, reason or "abort").inc()

    def observe_group(self, n: int, max_tokens: int, most_tokens: int) -> None:
        """All n choices of one prompt finished (vLLM's request: its n, max_tokens, longest output)."""
        if self.enabled:
            for i in range(len(self.params_n)):
                self.params_n[i].labels(self.model_name).observe(n)
                self.params_max_tokens[i].labels(self.model_name).observe(max_tokens)
                self.most_tokens[i].labels(self.model_name).observe(most_tokens)

    def observe_rejected(self, reason: str) -> None:
        if self.enabled:
            self.rejected.labels(self.model_name, reason).inc()

    def render(self, stats: dict) -> tuple[bytes, str]:
        """(body, content type) of a scrape; `stats`: the engine core's stats() now."""
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
        registry = self.registry
        mp_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if mp_dir:                   # every API process's histograms and counters, summed
            from prometheus_client.multiprocess import MultiProcessCollector
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=mp_dir)
        return generate_latest(registry) + engine_text(stats, self.model_name, self.kv_cache_dtype), CONTENT_TYPE_LATEST


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


class RequestTimes:
    """The engine core's histograms of finished requests (CORE_HISTOGRAMS), as bucket counts: `add(seq)` when a request
    finishes (a few numpy calls), `snapshot()` for the core's stats reply, which /metrics renders (engine_text)."""

    def __init__(self, max_model_len: int):
        import numpy as np
        self.np, tokens = np, token_buckets(max_model_len)
        self.bounds = {name: (ITL_BUCKETS if name.startswith("inter") else tokens if name.endswith("tokens")
                              else LATENCY_BUCKETS) for name in CORE_HISTOGRAMS}
        self.counts = {name: np.zeros(len(b) + 1, np.int64) for name, b in self.bounds.items()}
        self.sums = dict.fromkeys(CORE_HISTOGRAMS, 0.0)

    def add(self, seq, num_output: int | None = None) -> None:
        """`num_output`: the tokens kept when a stop string ended the request (the core ran past it)."""
        n = seq.num_output_tokens if num_output is None else num_output
        times, sched, first = seq.token_times[:max(n, 1)], seq.first_scheduled_time, seq.first_token_time
        if not times or sched is None or first is None or seq.arrival_time is None:
            return
        self._observe("request_queue_time_seconds", [sched - seq.arrival_time])
        self._observe("request_prefill_time_seconds", [first - sched])
        self._observe("request_decode_time_seconds", [times[-1] - first])
        self._observe("request_inference_time_seconds", [times[-1] - sched])
        self._observe("inter_token_latency_seconds", self.np.diff(times))
        self._observe("request_prompt_tokens", [seq.num_prompt_tokens])
        self._observe("request_generation_tokens", [n])

    def _observe(self, name: str, values) -> None:
        values = self.np.asarray(values, self.np.float64)
        if values.size:       # (bucket i: bounds[i - 1] < v <= bounds[i]; the last one: past every bound)
            idx = self.np.searchsorted(self.bounds[name], values, side="left")
            self.counts[name] += self.np.bincount(idx, minlength=len(self.counts[name]))
            self.sums[name] += float(values.sum())

    def snapshot(self) -> dict:
        return {name: [self.bounds[name], self.counts[name].tolist(), self.sums[name]] for name in CORE_HISTOGRAMS}


def engine_text(st: dict, model_name: str, kv_cache_dtype: str | None = None) -> bytes:
    """The engine core's gauges and counters in the exposition format."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    total = st.get("kv_blocks_total") or 0
    usage = 1.0 - st.get("kv_blocks_free", total) / total if total else 0.0
    families = [
        (GaugeMetricFamily, "num_requests_running", "Requests in the engine's running batch", st.get("running", 0)),
        (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled", st.get("waiting", 0)),
        (GaugeMetricFamily, "kv_cache_usage_perc", "KV cache usage (1 = all blocks in use)", usage),
        (CounterMetricFamily, "prompt_tokens", "Prompt tokens processed (prefill)", st.get("prompt_tokens", 0)),
        (CounterMetricFamily, "generation_tokens", "Tokens generated", st.get("generated_tokens", 0)),
        (CounterMetricFamily, "num_preemptions", "Preemptions (a running sequence's blocks were taken back)",
         st.get("preemptions", 0)),
        (CounterMetricFamily, "prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
         st.get("prefix_cache_hit_tokens", 0)),
        (CounterMetricFamily, "prefix_cache_query_tokens", "Tokens looked up in the prefix cache",
         st.get("prefix_cache_query_tokens", 0)),
    ]

    class Engine:
        def collect(self):
            for cls, name, doc, value in families:
                for full in _names(name):
                    m = cls(full, doc, labels=["model_name"])
                    m.add_metric([model_name], float(value))
                    yield m
            labels = dict(block_size=st.get("block_size"), cache_dtype=kv_cache_dtype or st.get("kv_cache_dtype"),
                          num_gpu_blocks=st.get("kv_blocks_total"))
            for full in _names("cache_config_info"):      # (vLLM's info gauge: the values are its labels)
                m = GaugeMetricFamily(full, "The KV cache's configuration", labels=list(labels))
                m.add_metric([str(v) for v in labels.values()], 1.0)
                yield m
            for name, (bounds, counts, total) in st.get("request_times", {}).items():
                cum = list(itertools.accumulate(counts))
                buckets = [(str(float(b)), c) for b, c in zip(bounds, cum)] + [("+Inf", cum[-1])]
                for full in _names(name):
                    m = HistogramMetricFamily(full, CORE_HISTOGRAMS.get(name, name), labels=["model_name"])
                    m.add_metric([model_name], buckets, sum_value=total)
                    yield m
    reg = CollectorRegistry(auto_describe=False)
    reg.register(Engine())
    return generate_latest(reg)
