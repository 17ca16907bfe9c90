"""Server faults, each against a real server process (`python -m jaxinfer.server`) with its engine core:
the core killed mid-stream (error event, 503s, exit code 1), SIGTERM mid-stream (the stream completes, both
processes exit 0), a load error (raised before anything listens), two API processes sharing one port drained by
Ctrl-C, and two whose server is killed (nothing stays behind)."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from test_server import BASE as ENGINE, jax_cache_env

from jaxinfer.server import CoreProcess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "tiny"


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    return jax_cache_env(tmp_path_factory)


def start_server(model_dir, cache_env, *extra, new_session=False, engine=None):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **cache_env, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, "-m", "jaxinfer.server", model_dir,
                             "--engine", json.dumps(engine or ENGINE), "--port", str(port), "--served-model-name", MODEL, "--log-level", "warning", *extra],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=new_session)
    url, end = f"http://127.0.0.1:{port}", time.time() + 180
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.time() < end, "server did not come up"
        time.sleep(0.2)


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def chunks(url, body, on_second_chunk):
    """The parsed events of a streamed completion, calling on_second_chunk() when the second one arrives."""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as s:
        for n, line in enumerate(line for line in s.iter_lines() if line.startswith("data: {")):
            if n == 1:
                on_second_chunk()
            yield json.loads(line.removeprefix("data: "))


def stream_usage(url, max_tokens, on_second_chunk):
    """Stream a completion of max_tokens, calling on_second_chunk() when its second chunk arrives; the usage."""
    usage = None
    for chunk in chunks(url, stream_body(max_tokens), on_second_chunk):
        usage = chunk.get("usage") or usage
    return usage


def finish_reasons(url, word, on_second_chunk) -> dict:
    """Stream 200 prompts of 110 tokens, calling on_second_chunk() when the second chunk arrives: each prompt's
    finish reason."""
    body = {**stream_body(110), "prompt": [f"{word} {i}" for i in range(200)]}
    return {c["index"]: c["finish_reason"] for chunk in chunks(url, body, on_second_chunk)
            for c in chunk["choices"] if c["finish_reason"]}


def stream_body(max_tokens):
    return {"model": MODEL, "prompt": "Hello there", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


def unread_post(url, body: dict) -> socket.socket:
    """POST a completion on a raw socket with a small receive buffer, whose answer the caller never reads."""
    data = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


@pytest.fixture
def server(tiny_dir, jax_cache):
    proc, url = start_server(tiny_dir, jax_cache)
    yield proc, url
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def test_core_killed_mid_stream(server):
    proc, url = server
    core_pid = httpx.get(url + "/stats").json()["engine_core_pid"]
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=stream_body(110), timeout=60) as s:
        for line in s.iter_lines():
            if not line:
                continue
            events.append(line)
            if len(events) == 3:
                os.kill(core_pid, signal.SIGKILL)
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2].removeprefix("data: "))
    assert err["error"]["type"] == "server_error" and "engine core" in err["error"]["message"]
    assert not any('"finish_reason": "length"' in e for e in events), "the request cannot have finished"
    # until the server exits (about a second later) it answers, and says it is unhealthy
    assert httpx.get(url + "/health", timeout=5).status_code == 503
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=5)
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    assert proc.wait(timeout=30) == 1


def test_sigterm_drains_both_processes(server):
    proc, url = server
    core_pid = httpx.get(url + "/stats").json()["engine_core_pid"]
    usage = stream_usage(url, 60, lambda: proc.send_signal(signal.SIGTERM))
    assert usage["completion_tokens"] == 60, "the in-flight stream must complete"
    assert proc.wait(timeout=60) == 0
    end = time.time() + 10
    while pid_exists(core_pid):
        assert time.time() < end, "the engine core outlived the server"
        time.sleep(0.1)


def test_sigterm_drain_timeout_aborts_and_refuses_new_requests(tiny_dir, jax_cache):
    """--shutdown-timeout 0.5: during the drain a new request gets 503 (with Retry-After); the stream in flight
    (200 prompts, 8 at a time: at least 2,750 steps, seconds even at 1 ms a step) ends with finish_reason
    "abort" for the prompts still running after the timeout, every prompt gets a finish reason; both processes
    exit 0."""
    proc, url = start_server(tiny_dir, jax_cache, "--shutdown-timeout", "0.5")
    try:
        refused = []

        def drain():
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.1)
            refused.append(httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=5))
        reasons, refused = finish_reasons(url, "Drain", drain), refused[0]
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "shutting_down"
        assert sorted(reasons) == list(range(200)), "every prompt must end"
        assert "abort" in reasons.values(), "the drain's timeout must end the prompts still running"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_a_second_signal_ends_the_drain_at_once(tiny_dir, jax_cache):
    """SIGINT drains; a second SIGINT ends the requests in flight now (finish_reason "abort", the stream closed
    with its last event), and the server exits 0 at once, with no traceback in its log (it used to send on a
    closed socket and print uvicorn's cancelled-task trace after 5 s)."""
    proc, url = start_server(tiny_dir, jax_cache)           # (--shutdown-timeout: 30 s)
    # and a client that stops reading its stream
    stalled = unread_post(url, {**stream_body(110), "prompt": [f"Big {i}" for i in range(100)], "logprobs": 5})
    try:
        stalled.recv(1024)
        time.sleep(3)                                      # (its socket's buffers fill)
        t0 = []

        def twice():
            proc.send_signal(signal.SIGINT)
            time.sleep(0.5)
            t0.append(time.monotonic())
            proc.send_signal(signal.SIGINT)
        reasons, t0 = finish_reasons(url, "Stop", twice), t0[0]
        assert sorted(reasons) == list(range(200)) and "abort" in reasons.values()
        # (well under the drain's 30 s: a loaded 2-core CI machine once took 6 s to exit)
        assert proc.wait(timeout=60) == 0 and time.monotonic() - t0 < 15, "a second signal stops at once"
        log = proc.stdout.read()
        assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
    finally:
        stalled.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_a_second_signal_drops_a_response_left_unread(tiny_dir, jax_cache):
    """A whole response handed to uvicorn but never read by its client (more than the kernel's socket buffers take,
    so the rest waits in the transport's) does not hold a second signal's exit for uvicorn's 5 s graceful timeout
    and its ERROR line: it is dropped after 1 s."""
    proc, url = start_server(tiny_dir, jax_cache)
    unread = unread_post(url, {**stream_body(110), "stream": False, "stream_options": None, "logprobs": 5,
                               "prompt": [f"Big {i}" for i in range(300)]})
    try:
        end = time.time() + 120
        while (st := httpx.get(url + "/stats", timeout=30).json())["api_inflight"] or st["api_requests"] == 0:
            assert time.time() < end, "the request did not finish"
            time.sleep(0.2)
        time.sleep(1.0)                                    # (its response is written)
        t0 = []

        def twice():                                       # while another stream runs
            proc.send_signal(signal.SIGINT)
            time.sleep(0.5)
            t0.append(time.monotonic())
            proc.send_signal(signal.SIGINT)
        assert sorted(finish_reasons(url, "Stop", twice)) == list(range(200))
        assert proc.wait(timeout=60) == 0
        log = proc.stdout.read()
        assert time.monotonic() - t0[0] < 4.5 and "ERROR" not in log, log[-3000:]
    finally:
        unread.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_port_in_use_fails_before_loading(tiny_dir):
    from jaxinfer.server import serve
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        t = time.time()
        with pytest.raises(ValueError, match=f"127.0.0.1:{port}"):
            serve(tiny_dir, ENGINE, port=port)
        assert time.time() - t < 5, "the port must be checked before the model loads"


def test_serve_from_python_tells_the_port_it_took(tiny_dir, jax_cache):
    """serve(port=0) from a script without logging set up: the address line still reaches stderr."""
    code = f"from jaxinfer.server import serve; serve({tiny_dir!r}, {ENGINE!r}, port=0)"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **jax_cache, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT})
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "API server on http://127.0.0.1:" in line:
                break
        assert lines and " on http" in lines[-1], lines
        url = lines[-1].split(" on ")[1].split()[0]
        assert httpx.get(url + "/health", timeout=10).status_code == 200, lines
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_load_error_is_raised_before_serving(tiny_dir):
    with pytest.raises(ValueError, match="max_num_seqs"):
        CoreProcess(tiny_dir, {**ENGINE, "max_num_seqs": -1}).wait_ready()
    with pytest.raises(FileNotFoundError):
        CoreProcess(os.path.join(tiny_dir, "missing"), ENGINE)


def test_ctrl_c_drains_two_api_processes(tiny_dir, jax_cache):
    """Ctrl-C reaches the whole process group: each API process must drain once (new requests get 503 while
    the stream in flight completes), not take its parent's forwarded SIGTERM as a second signal and stop."""
    long = {**ENGINE, "max_model_len": 1024, "num_kvcache_blocks": 600}
    proc, url = start_server(tiny_dir, jax_cache, "--api-server-count", "2", new_session=True, engine=long)
    refused = []

    def ctrl_c():
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.2)
        with httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as c:
            for _ in range(2):                                    # whichever process answers; a connection the
                for attempt in range(3):                          # idle one took as it exits is reset (retried)
                    try:
                        refused.append(c.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"}))
                        break
                    except httpx.TransportError:
                        time.sleep(0.1)
    try:
        usage = stream_usage(url, 1000, ctrl_c)
        assert [r.status_code for r in refused] == [503, 503], [r.text for r in refused]
        assert usage["completion_tokens"] == 1000, "the in-flight stream must complete"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def test_two_api_processes_and_a_killed_server(tiny_dir, jax_cache):
    """Two API processes share the port; SIGKILL of the server (their supervisor) leaves nothing running:
    the orphaned core exits by itself, and then the API processes, which see it gone."""
    proc, url = start_server(tiny_dir, jax_cache, "--api-server-count", "2")
    try:
        core_pid = httpx.get(url + "/stats").json()["engine_core_pid"]
        apis = [int(p) for p in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
                if int(p) != core_pid]
        bodies = [{"model": MODEL, "prompt": f"Request {i}", "max_tokens": 6, "temperature": 0} for i in range(3)]
        with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as c:
            first = [c.post(url + "/v1/completions", json=b).json() for b in bodies]
            again = [c.post(url + "/v1/completions", json=b).json() for b in bodies]
        assert [r["choices"][0]["text"] for r in first] == [r["choices"][0]["text"] for r in again]
        assert all(r["usage"]["completion_tokens"] == 6 for r in first)
        # /metrics sums both API processes' histograms (prometheus_client's multiprocess mode): 6 requests
        with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as c:
            for _ in range(4):            # whichever process answers
                m = c.get(url + "/metrics").text
                assert 'jaxinfer:e2e_request_latency_seconds_count{model_name="tiny"} 6.0' in m, m[-2000:]
                assert 'vllm:e2e_request_latency_seconds_count{model_name="tiny"} 6.0' in m      # (vLLM's name)
        with httpx.stream("POST", url + "/v1/completions", json=stream_body(110), timeout=60) as s:
            next(s.iter_lines())
            proc.kill()                   # no drain, no shutdown message
        proc.wait(timeout=30)
        end = time.time() + 30
        while any(pid_exists(p) for p in [core_pid, *apis]):
            assert time.time() < end, "processes of a killed server kept running"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.parametrize("apis", [1, 2])
def test_sigterm_right_after_the_ready_line_stops_the_server(tiny_dir, jax_cache, apis):
    """A supervisor that stops the server as soon as it says it listens: the SIGTERM comes before uvicorn's handler
    is in (in this process, or in the API processes being started); it is kept and drains then (exit 0), not lost,
    and a request sent before it (queued on the socket while the API processes start) is answered, not reset."""
    env = {**os.environ, **jax_cache, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, "-m", "jaxinfer.server", tiny_dir, "--engine", json.dumps(ENGINE),
                             "--port", "0", "--log-level", "info", "--api-server-count", str(apis)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        answers = []
        for line in proc.stdout:
            if "API server on" in line:
                url = line.split("API server on ")[1].split()[0]
                asked = threading.Thread(target=lambda: answers.append(httpx.post(
                    url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60).status_code))
                asked.start()
                time.sleep(0.3)                               # (connected: queued while the API processes start)
                proc.send_signal(signal.SIGTERM)
                break
        asked.join(timeout=60)
        assert answers == [200] and proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
