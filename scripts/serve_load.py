"""The load generator of bench_serve.py: the W-shaped requests, client processes streaming /v1/completions, and
the metrics.

Each client process runs an asyncio loop with one httpx client and streams its share of the requests,
either with at most `concurrency` in flight, or each request sent at its arrival time (a request-rate run).
Every request records when it was sent, when each server-sent event arrived, and the token count the
server's final usage chunk reports (an event may carry several tokens when the client falls behind).
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import numpy as np

# one request: (prompt token ids, max_tokens, arrival offset in s or None)
Request = tuple[list[int], int, float | None]


def workload(n: int, max_input: int, max_output: int, min_input: int = 100, min_output: int = 100,
             vocab: int = 151936, seed: int = 0) -> list[tuple[list[int], int]]:
    """W's lengths (nano-vllm's random calls); token ids modulo the vocabulary so tiny models can run it."""
    random.seed(seed)
    prompts = [[random.randint(0, 10000) % vocab for _ in range(random.randint(min_input, max_input))]
               for _ in range(n)]
    return [(p, random.randint(min_output, max_output)) for p in prompts]


def vocab_size(a) -> int:
    """--vocab-size, else the model's (config.json or preset; 151,936, Qwen3's, for a --url server's name)."""
    if a.vocab_size:
        return a.vocab_size
    try:
        from jaxinfer.hub import model_config_for
        return model_config_for(a.model)[1].vocab_size
    except (OSError, ValueError):
        return 151936


def min_lens(a) -> tuple[int, int]:
    """W's shortest prompt and output (100, 100), capped by --max-input-len / --max-output-len."""
    lo_in, lo_out = (10, 5) if a.quick else (100, 100)
    return min(lo_in, a.max_input_len), min(lo_out, a.max_output_len)


def run_client(url: str, model: str, requests: list[Request], concurrency: int, t0: float,
               extra: dict | None = None) -> list[dict]:
    """Entry point of one client process: returns one record per request. `extra`: more request body fields
    (e.g. {"logprobs": 5} or {"frequency_penalty": 0.5})."""
    return asyncio.run(_run(url, model, requests, concurrency, t0, extra or {}))


async def _run(url, model, requests, concurrency, t0, extra) -> list[dict]:
    import httpx
    limits = httpx.Limits(max_connections=max(concurrency, 1), max_keepalive_connections=max(concurrency, 1))
    sem = asyncio.Semaphore(max(concurrency, 1))
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits) as client:
        await asyncio.sleep(max(0.0, t0 - time.monotonic()))   # all client processes start together

        async def one(req: Request) -> dict:
            ids, max_tokens, arrival = req
            if arrival is not None:
                await asyncio.sleep(max(0.0, t0 + arrival - time.monotonic()))
            async with sem:
                return await _stream(client, model, ids, max_tokens, extra)
        return await asyncio.gather(*(one(r) for r in requests))


async def _stream(client, model: str, ids: list[int], max_tokens: int, extra: dict) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.6, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    rec = dict(prompt_tokens=len(ids), max_tokens=max_tokens, start=time.monotonic(), events=[], output_tokens=0,
               error=None, rejected=False)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code == 503 and "retry-after" in r.headers:     # the queue bound: refused, not failed
                rec["rejected"] = True
                await r.aread()
            elif r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            async for line in (r.aiter_lines() if r.status_code == 200 else _nothing()):
                if not line.startswith("data: {"):
                    continue
                now = time.monotonic()
                if '"usage"' in line and '"choices": []' in line:
                    rec["output_tokens"] = json.loads(line[6:])["usage"]["completion_tokens"]
                elif '"error"' in line[:20]:
                    rec["error"] = json.loads(line[6:])["error"]["message"]
                else:
                    rec["events"].append(now)
    except Exception as e:                  # connection refused / reset: counted, not fatal to the run
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["end"] = time.monotonic()
    return rec


async def _nothing():
    return
    yield


def split(requests: list[Request], procs: int) -> list[list[Request]]:
    return [requests[i::procs] for i in range(procs)]


def run_level(pool, url: str, model: str, requests: list[Request], concurrency: int | None, procs: int,
              extra: dict | None = None) -> list[dict]:
    """Run the requests from `procs` client processes (of `pool`); concurrency None = unlimited (rate runs)."""
    procs = max(1, min(procs, len(requests), concurrency or procs))
    per = [max(1, (concurrency or 10**6) // procs + (i < (concurrency or 0) % procs)) for i in range(procs)]
    t0 = time.monotonic() + 0.3
    parts = pool.starmap(run_client, [(url, model, part, per[i], t0, extra)
                                      for i, part in enumerate(split(requests, procs))])
    return [r for part in parts for r in part]


def percentiles(xs, scale: float = 1e3) -> dict:
    if not len(xs):
        return {}
    xs = np.asarray(xs) * scale
    return {"mean": float(xs.mean()), "p50": float(np.percentile(xs, 50)), "p90": float(np.percentile(xs, 90)),
            "p99": float(np.percentile(xs, 99))}


def summarize(records: list[dict]) -> dict:
    """Output tok/s over the level's wall time; TTFT, TPOT, ITL and end-to-end latency percentiles (ms)."""
    rejected = [r for r in records if r.get("rejected")]
    ok = [r for r in records if r["error"] is None and not r.get("rejected")]
    errors = [r["error"] for r in records if r["error"] is not None]
    lost = sum(r["max_tokens"] - r["output_tokens"] for r in ok)       # ignore_eos: every token is owed
    wall = max(r["end"] for r in records) - min(r["start"] for r in records)
    out = sum(r["output_tokens"] for r in ok)
    ttft = [r["events"][0] - r["start"] for r in ok if r["events"]]
    tpot = [(r["end"] - r["events"][0]) / (r["output_tokens"] - 1) for r in ok if r["events"] and r["output_tokens"] > 1]
    itl = [b - a for r in ok for a, b in zip(r["events"], r["events"][1:])]
    return dict(requests=len(records), completed=len(ok), rejected_503=len(rejected),
                rejected_ms=percentiles([r["end"] - r["start"] for r in rejected]) |
                ({"max": 1e3 * max(r["end"] - r["start"] for r in rejected)} if rejected else {}),
                errors=len(errors), first_errors=errors[:3], lost_tokens=lost,
                output_tokens=out, prompt_tokens=sum(r["prompt_tokens"] for r in records), wall_s=wall,
                output_tok_s=out / wall if wall > 0 else 0.0, request_s=len(ok) / wall if wall > 0 else 0.0,
                ttft_ms=percentiles(ttft), tpot_ms=percentiles(tpot), itl_ms=percentiles(itl),
                latency_ms=percentiles([r["end"] - r["start"] for r in ok]),
                events_per_token=sum(len(r["events"]) for r in ok) / max(out, 1))


def probe_refusals(url: str, model: str, stop, out: list, every_s: float = 0.1) -> None:
    """From a thread of this (otherwise idle) process: one 1-token request every `every_s` until `stop`,
    recording (HTTP status, ms) of each: what an overloaded server answers a client that is not itself busy."""
    import httpx
    with httpx.Client(base_url=url, timeout=30) as client:
        while not stop.wait(every_s):
            t = time.perf_counter()
            try:
                status = client.post("/v1/completions", json={"model": model, "prompt": [1, 2, 3],
                                                              "max_tokens": 1}).status_code
            except httpx.HTTPError:
                status = -1
            out.append((status, (time.perf_counter() - t) * 1e3))
