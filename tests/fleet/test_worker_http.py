"""A simulated worker over real HTTP: OpenAI shapes, router probes, errors, kill/restart."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest
import requests
import zmq

from fleet import tokenizer
from fleet.clock import VirtualClock
from fleet.engine import WorkerSpec
from fleet.workers import FleetOptions, WorkerFleet


@pytest.fixture(scope="module")
def fleet():
    clock = VirtualClock()
    with WorkerFleet([WorkerSpec("w0", block_size=16), WorkerSpec("w1", block_size=16)], clock=clock,
                     options=FleetOptions()) as f:
        f.clock_ref = clock
        yield f


def post(url, path, body):
    return requests.post(url + path, json=body, timeout=10)


def finish(fleet):
    fleet.clock_ref.advance(60)
    for w in fleet:
        w.engine.tick()


def test_completions_usage_and_worker_header(fleet):
    url = fleet["w0"].url
    prompt = "You are a helpful assistant. " * 4  # 116 bytes = 7 full blocks
    r = post(url, "/v1/completions", {"model": "sim-model", "prompt": prompt, "max_tokens": 5, "ignore_eos": False})
    assert r.status_code == 200 and r.headers["x-prefixscope-worker"] == "w0"
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "sim-model"
    assert len(body["choices"][0]["text"]) == 5 and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 116, "total_tokens": 121, "completion_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    finish(fleet)
    r = post(url, "/v1/completions", {"prompt": prompt + "and more", "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 112


def test_chat_follow_up_turn_reuses_the_previous_turn(fleet):
    url = fleet["w1"].url
    msgs = [{"role": "system", "content": "Be brief. " * 10}, {"role": "user", "content": "hello"}]
    r1 = post(url, "/v1/chat/completions", {"model": "sim-model", "messages": msgs, "max_tokens": 20}).json()
    assert r1["object"] == "chat.completion"
    answer = r1["choices"][0]["message"]["content"]
    finish(fleet)
    follow = [*msgs, {"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
    r2 = post(url, "/v1/chat/completions", {"messages": follow, "max_tokens": 3}).json()
    first_len = r1["usage"]["prompt_tokens"]
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == (first_len // 16) * 16


def test_streaming_chat_sse_ends_with_done(fleet):
    r = requests.post(fleet["w0"].url + "/v1/chat/completions", timeout=10, stream=True, json={
        "messages": [{"role": "user", "content": "stream please"}], "max_tokens": 6, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    lines = [ln for ln in r.iter_lines(decode_unicode=True) if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert len(text) == 6
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert any(c["choices"] and c["choices"][0]["finish_reason"] == "length" for c in chunks)


def test_generate_and_router_probes(fleet):
    url = fleet["w0"].url
    g = post(url, "/generate", {"text": "abc" * 20, "sampling_params": {"max_new_tokens": 4}, "model": None,
                                "log_metrics": True}).json()
    assert g["meta_info"]["prompt_tokens"] == 60 and g["meta_info"]["completion_tokens"] == 4
    assert requests.get(url + "/health", timeout=5).status_code == 200
    info = requests.get(url + "/server_info", timeout=5).json()
    assert info["served_model_name"] == "sim-model"
    assert "model_path" not in info and "tokenizer_path" not in info
    model_info = requests.get(url + "/model_info", timeout=5).json()
    assert model_info == {"is_generation": True, "served_model_name": "sim-model"}
    assert requests.get(url + "/v1/models", timeout=5).json()["data"][0]["id"] == "sim-model"
    load = requests.get(url + "/get_load", timeout=5).json()
    assert isinstance(load, list) and {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"} <= load[0].keys()
    text = "Tell me about caches."
    tok = post(url, "/tokenize", {"prompt": text}).json()
    assert tok["tokens"] == tokenizer.encode(text) and tok["count"] == len(text)
    rc = post(url, "/v1/completions/render", {"prompt": text, "max_tokens": 8}).json()
    assert isinstance(rc, list) and rc[0]["token_ids"] == tok["tokens"]
    assert rc[0]["sampling_params"] == {"max_tokens": 8}
    msgs = [{"role": "user", "content": text}]
    rchat = post(url, "/v1/chat/completions/render", {"messages": msgs}).json()
    assert rchat["token_ids"] == tokenizer.encode_chat(msgs)
    metrics = requests.get(url + "/metrics", timeout=5)
    assert metrics.headers["content-type"].startswith("text/plain") and "vllm:prefix_cache_queries_total" in metrics.text


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", b'{"max_tokens": 3}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": 5}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": ""}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": "ten"}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 100000000}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": "hi", "stream": "yes"}', 400, "stream"),
        ("/v1/completions", b'{"prompt": "hi", "model": "other"}', 404, "model"),
        ("/v1/chat/completions", b'{"prompt": "hi"}', 400, "messages"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
        ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', 400, "messages"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 3}]}', 400, "messages"),
        ("/generate", b'{"sampling_params": {}}', 400, "text"),
        ("/generate", b'{"text": "x", "sampling_params": {"max_new_tokens": -1}}', 400, "max_new_tokens"),
        ("/tokenize", b'{"prompt": [1, -2]}', 400, "prompt"),
        ("/nope", b"{}", 404, None),
    ],
)
def test_malformed_requests_get_openai_style_4xx(fleet, path, body, status, param):
    before = fleet["w0"].engine.counters.prefix_queries
    r = requests.post(fleet["w0"].url + path, data=body, headers={"Content-Type": "application/json"}, timeout=5)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
    assert err["param"] == param
    assert fleet["w0"].engine.counters.prefix_queries == before  # nothing was run
    assert requests.get(fleet["w0"].url + "/health", timeout=5).status_code == 200


def test_oversized_body_and_garbage_bytes_do_not_hurt_the_server(fleet):
    host, port = fleet["w0"].url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Length", str(64 * 1024 * 1024))
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == 413
    conn.close()
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"\x00\xff garbage\r\n\r\n")
        s.recv(1024)
    assert requests.get(fleet["w0"].url + "/health", timeout=5).status_code == 200


def test_unhealthy_knob_and_kill_restart_resets_cache_and_sequence():
    clock = VirtualClock()
    with WorkerFleet([WorkerSpec("w0")], clock=clock) as f:
        w = f["w0"]
        prompt = "x" * 64
        post(w.url, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        clock.advance(10)
        w.engine.tick()
        assert w.publisher.flush() and w.publisher.next_seq == 1
        w.engine.knobs.healthy = False
        assert requests.get(w.url + "/health", timeout=5).status_code == 503
        assert post(w.url, "/v1/completions", {"prompt": prompt}).status_code == 503
        old_url, old_kv = w.url, w.kv_endpoint
        f.kill("w0")
        with pytest.raises(requests.ConnectionError):
            requests.get(old_url + "/health", timeout=2)
        w2 = f.restart("w0")
        assert (w2.url, w2.kv_endpoint) == (old_url, old_kv)
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sub.connect(w2.kv_endpoint)
        try:
            # the subscription goes out once the handshake is done; then give the PUB side a moment
            assert monitor.poll(10_000), "no ZMQ handshake with the restarted worker"
            time.sleep(0.3)
            r = post(w2.url, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).json()
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # a fresh cache
            clock.advance(10)
            w2.engine.tick()
            assert sub.poll(3000)
            topic, seq, _ = sub.recv_multipart()
            assert topic == b"kv@w0@sim-model" and int.from_bytes(seq, "big") == 0
        finally:
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)


def test_on_the_real_clock_a_request_waits_for_a_free_slot_then_for_its_own_times():
    import threading

    from fleet.clock import RealClock
    from fleet.engine import SimEngine
    from fleet.worker_http import WorkerServer

    # one slot; a 2000-token cold prompt takes 2 s of prefill (room for the second request to
    # arrive while it runs, even on a loaded machine), a 200-token one 0.2 s
    spec = WorkerSpec("solo", block_size=16, max_running=1, prefill_tps=1000.0, prefill_overhead_s=0.0,
                      attention_knee_tokens=1e12)
    seen = {}
    server = WorkerServer(SimEngine(spec, RealClock()),
                          on_request=lambda r, h, p: seen.setdefault(r.prompt_tokens, r)).start()
    try:
        first = threading.Thread(target=lambda: post(server.url, "/v1/completions",
                                                     {"prompt": list(range(1, 2001)), "max_tokens": 1}))
        first.start()
        deadline = time.monotonic() + 5
        while server.engine.load()[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)  # until the first request holds the slot
        t0 = time.monotonic()
        r = post(server.url, "/v1/completions", {"prompt": list(range(5000, 5200)), "max_tokens": 1})
        answered_s = time.monotonic() - t0
        first.join(10)
        assert r.status_code == 200
        a, b = seen[2000], seen[200]
        assert b.queue_s > 0
        assert b.arrival + b.queue_s == pytest.approx(a.finished_at, abs=1e-6)  # admitted as a's slot freed
        assert b.prefill_s == pytest.approx(0.2)
        assert answered_s >= b.e2e_s - 0.01  # the answer waited for the queue and its prefill
        assert server.engine.load() == (0, 0)
    finally:
        server.stop()


def test_the_fleet_tracks_where_each_admitted_request_found_its_longest_prefix():
    clock = VirtualClock()
    specs = [WorkerSpec(f"w{i}", block_size=16) for i in range(3)]
    with WorkerFleet(specs, clock=clock, track_placement=True) as f:
        prompt = "You are a helpful assistant. " * 4  # 116 bytes = 7 full blocks

        def ask(worker: str, text: str, rid: str) -> None:
            r = post(f[worker].url, "/v1/completions", {"prompt": text, "max_tokens": 1, "request_id": rid})
            assert r.status_code == 200, r.text
            clock.advance(60)
            for w in f:
                w.engine.tick()

        ask("w0", prompt, "a")
        ask("w1", prompt + "and more", "b")  # w0 holds the 7 blocks; w1 computes them again and more
        ask("w1", prompt + "and more", "c")  # w1 now holds its whole prompt: nothing to store
        f.kill("w1")
        ask("w2", prompt, "d")  # w1 is dead: its cache is nobody's prefix
        got = {rid: (p.worker, p.blocks, p.depths, p.holders, p.stores) for rid, p in f.placements.items()}
        ids = {p.worker: rid for rid, p in f.placements.items()}
        assert len(got) == 4 and set(ids) == {"w0", "w1", "w2"}
        by_worker = sorted(got.values(), key=lambda g: (g[0], g[2].get(g[0], 0)))
        assert by_worker[0] == ("w0", 7, {"w0": 0, "w1": 0, "w2": 0}, frozenset(), True)
        assert by_worker[1] == ("w1", 7, {"w0": 7, "w1": 0, "w2": 0}, frozenset({"w0"}), True)
        assert by_worker[2] == ("w1", 7, {"w0": 7, "w1": 7, "w2": 0}, frozenset({"w0", "w1"}), False)
        assert by_worker[3] == ("w2", 7, {"w0": 7, "w2": 0}, frozenset({"w0"}), True)
