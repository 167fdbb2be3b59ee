"""A simulated worker's HTTP face: vLLM's OpenAI-compatible API plus the SGLang endpoints routers
probe, over a threaded stdlib server on 127.0.0.1.

Routers call several endpoints per request (vllm-router renders the prompt on every worker), so
the server is threaded and keeps the handlers thin: parse, validate, hand the prompt tokens to
the engine, wait for the modelled time (scaled by ``delay_scale``) when running on the real
clock, answer. Unknown body fields are ignored (routers add SGLang defaults). Malformed requests
get an OpenAI-style 4xx error body; nothing a client sends can take the server down.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from fleet import tokenizer
from fleet.clock import RealClock
from fleet.engine import EngineRequest, EngineResult, Pending, RequestError, SimEngine
from fleet.metrics_text import CONTENT_TYPE, render_metrics

log = logging.getLogger("prefixscope.fleet.http")

WORKER_HEADER = "x-prefixscope-worker"
MAX_BODY = 8 * 1024 * 1024
DEFAULT_MAX_TOKENS = 16
ADMISSION_POLL_S = 0.005  # how often a waiting request checks the clock for a free slot
_WORDS = ("the", "cache", "prefix", "block", "token", "router", "worker", "hit", "warm", "sim")

RequestCallback = Callable[[EngineResult, dict[str, str], str], None]


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {400: "BadRequestError", 404: "NotFoundError", 413: "BadRequestError",
                             503: "ServiceUnavailableError"}.get(status, "InternalServerError")


def error_body(e: ApiError) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}}


def fake_text(n: int) -> str:
    """Deterministic output text of exactly ``n`` tokens (bytes) for the byte-level tokenizer."""
    words = []
    size = 0
    i = 0
    while size < n:
        w = (" " if words else "") + _WORDS[i % len(_WORDS)]
        words.append(w)
        size += len(w)
        i += 1
    return "".join(words)[:n]


def _int_field(body: dict, name: str, default: int, minimum: int = 1) -> int:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"'{name}' must be an integer", name)
    if v < minimum:
        raise ApiError(400, f"'{name}' must be at least {minimum}", name)
    return v


def _bool_field(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(400, f"'{name}' must be a boolean", name)
    return v


def prompt_tokens(body: dict) -> list[int]:
    """Token ids of a completions prompt: a string, a list of token ids, or a one-element list."""
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required", "prompt")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        toks = tokenizer.encode(p)
    elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
        toks = list(p)
    else:
        raise ApiError(400, "'prompt' must be a string or a list of non-negative token ids", "prompt")
    if not toks:
        raise ApiError(400, "'prompt' must not be empty", "prompt")
    return toks


def chat_tokens(body: dict) -> list[int]:
    if "messages" not in body:
        raise ApiError(400, "'messages' is required", "messages")
    try:
        return tokenizer.encode_chat(body["messages"], add_generation_prompt=body.get("add_generation_prompt", True)
                                     is not False)
    except tokenizer.ChatFormatError as e:
        raise ApiError(400, str(e), "messages") from e


def generate_tokens(body: dict) -> list[int]:
    if isinstance(body.get("input_ids"), list):
        return prompt_tokens({"prompt": body["input_ids"]})
    if "text" in body:
        return prompt_tokens({"prompt": body["text"]})
    raise ApiError(400, "'text' or 'input_ids' is required", "text")


class _Server(ThreadingHTTPServer):
    """Remembers its open connections so that stopping drops them, as a dying process would;
    otherwise keep-alive clients (routers, scrapers) keep being answered by a "dead" worker."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def drop_connections(self) -> None:
        with self._open_lock:
            conns = list(self._open)
        for conn in conns:
            with contextlib.suppress(OSError):  # already closed by its client
                conn.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("connection from %s ended with an error", client_address, exc_info=True)


class WorkerServer:
    """Serves one engine on 127.0.0.1 (port 0 = ephemeral)."""

    def __init__(
        self,
        engine: SimEngine,
        flavour: str = "vllm",
        host: str = "127.0.0.1",
        port: int = 0,
        delay_scale: float = 1.0,
        on_request: RequestCallback | None = None,
        max_body: int = MAX_BODY,
    ) -> None:
        self.engine = engine
        self.flavour = flavour
        self.delay_scale = delay_scale
        self.on_request = on_request
        self.max_body = max_body
        self.realtime = isinstance(engine.clock, RealClock)
        self.httpd = _Server((host, port), _Handler)
        self.httpd.worker = self  # type: ignore[attr-defined]
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> WorkerServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"http-{self.engine.spec.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.httpd.drop_connections()
        if self._thread is not None:
            self._thread.join(5)

    @property
    def paced(self) -> bool:
        """Responses wait for modelled time (a real clock and a non-zero delay scale)."""
        return self.realtime and self.delay_scale > 0

    def run(self, req: EngineRequest) -> EngineResult:
        """Submit to the engine; a request that finds every slot busy waits for its admission."""
        if not self.paced:
            return self.engine.execute(req)  # no time passes: run the engine's schedule ahead
        res = self.engine.submit(req)
        if not isinstance(res, Pending):
            return res
        while True:
            result = res.wait(ADMISSION_POLL_S)
            if result is not None:
                return result
            self.engine.tick()  # a slot frees on the clock; nobody else may be ticking this engine

    def wait_until(self, t: float) -> None:
        """Let the clock reach ``t`` (an absolute first-token or finish time; real clock only)."""
        if self.paced:
            remaining = t - self.engine.clock.now()
            if remaining > 0:
                time.sleep(remaining * self.delay_scale)
        self.engine.tick()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "prefixscope-sim"

    @property
    def worker(self) -> WorkerServer:
        return self.server.worker  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:  # silence per-request stderr lines
        pass

    # -- plumbing ---------------------------------------------------------------------------
    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header(WORKER_HEADER, self.worker.engine.spec.name)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj).encode())

    def _error(self, e: ApiError) -> None:
        self._json(e.status, error_body(e))

    def _body(self) -> dict:
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            raise ApiError(400, "chunked request bodies are not supported; send Content-Length")
        try:
            n = int(length) if length is not None else 0
        except ValueError:
            self.close_connection = True
            raise ApiError(400, "invalid Content-Length") from None
        if n > self.worker.max_body:
            self.close_connection = True  # the unread body would poison the connection
            raise ApiError(413, f"request body of {n} bytes exceeds the limit of {self.worker.max_body}")
        raw = self.rfile.read(n) if n > 0 else b""
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ApiError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except ApiError as e:
            self._error(e)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # never let a request kill the worker
            log.exception("unexpected error serving %s %s", self.command, self.path)
            try:
                self._error(ApiError(500, f"internal error: {type(e).__name__}"))
            except OSError:
                self.close_connection = True

    # -- routes -----------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._guard(self._get)

    do_HEAD = do_GET

    def do_POST(self) -> None:
        self._guard(self._post)

    def _get(self) -> None:
        path = self.path.split("?", 1)[0]
        w = self.worker
        spec = w.engine.spec
        if path == "/health":
            if w.engine.knobs.healthy:
                self._send(200, b"")
            else:
                self._error(ApiError(503, "engine is unhealthy"))
        elif path == "/metrics":
            self._send(200, render_metrics(w.engine, w.flavour), CONTENT_TYPE)
        elif path == "/v1/models":
            self._json(200, {"object": "list", "data": [{
                "id": spec.model, "object": "model", "created": int(w.engine.counters.created),
                "owned_by": "vllm", "root": spec.model, "parent": None, "max_model_len": spec.max_model_len}]})
        elif path in ("/server_info", "/get_server_info"):
            # served_model_name only: a model_path/tokenizer_path would make sglang-router fetch a tokenizer
            self._json(200, {"served_model_name": spec.model, "host": "127.0.0.1", "port": w.port,
                             "tp_size": spec.gpus, "dp_size": 1, "version": "prefixscope-sim",
                             "max_total_num_tokens": spec.num_gpu_blocks * spec.block_size,
                             "page_size": spec.block_size, "max_running_requests": spec.max_running,
                             "internal_states": [{"last_gen_throughput": 0.0}]})
        elif path in ("/model_info", "/get_model_info"):
            self._json(200, {"is_generation": True, "served_model_name": spec.model})
        elif path == "/get_load":
            running, waiting = w.engine.load()
            used = round(w.engine.kv_usage * spec.num_gpu_blocks * spec.block_size)
            self._json(200, [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
                              "num_tokens": used}])
        else:
            raise ApiError(404, f"no route for GET {path}")

    def _post(self) -> None:
        path = self.path.split("?", 1)[0]
        routes = {
            "/v1/completions": self._completions,
            "/v1/chat/completions": self._chat,
            "/generate": self._generate,
            "/tokenize": self._tokenize,
            "/detokenize": self._detokenize,
            "/v1/completions/render": self._render_completions,
            "/v1/chat/completions/render": self._render_chat,
        }
        handler = routes.get(path)
        if handler is None:
            raise ApiError(404, f"no route for POST {path}")
        handler(self._body())

    # -- tokenizer endpoints ----------------------------------------------------------------
    def _tokenize(self, body: dict) -> None:
        toks = chat_tokens(body) if "messages" in body else prompt_tokens(body)
        self._json(200, {"count": len(toks), "max_model_len": self.worker.engine.spec.max_model_len,
                         "tokens": toks, "token_strs": None})

    def _detokenize(self, body: dict) -> None:
        """vLLM's ``POST /detokenize``: ``{"model", "tokens": [...]}`` → ``{"prompt": "..."}``."""
        self._check_model(body)
        toks = body.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise ApiError(400, "'tokens' must be a list of integers", "tokens")
        self._json(200, {"prompt": tokenizer.decode(toks)})

    def _render(self, body: dict, toks: list[int]) -> dict:
        return {"request_id": f"render-{uuid.uuid4().hex}", "token_ids": toks,
                "sampling_params": {"max_tokens": _int_field(body, "max_tokens", DEFAULT_MAX_TOKENS)},
                "model": self.worker.engine.spec.model}

    def _render_completions(self, body: dict) -> None:
        self._json(200, [self._render(body, prompt_tokens(body))])

    def _render_chat(self, body: dict) -> None:
        self._json(200, self._render(body, chat_tokens(body)))

    # -- inference --------------------------------------------------------------------------
    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(400, "'model' must be a string", "model")
        if model and model != self.worker.engine.spec.model:
            raise ApiError(404, f"The model `{model}` does not exist.", "model", "NotFoundError")

    def _run(self, rid: str, toks: list[int], max_tokens: int, body: dict) -> EngineResult:
        eng = self.worker.engine
        if not eng.knobs.healthy:
            raise ApiError(503, "engine is unhealthy")
        sig = body.get("expert_signature") if isinstance(body.get("expert_signature"), str) else None
        try:
            result = self.worker.run(EngineRequest(rid, token_ids=toks, max_tokens=max_tokens, expert_signature=sig))
        except RequestError as e:
            raise ApiError(400, str(e), e.param) from None
        cb = self.worker.on_request
        if cb is not None:
            try:
                cb(result, {k.lower(): v for k, v in self.headers.items()}, self.path)
            except Exception:
                log.exception("request callback failed")
        return result

    @staticmethod
    def _usage(r: EngineResult) -> dict:
        return {"prompt_tokens": r.prompt_tokens, "total_tokens": r.prompt_tokens + r.output_tokens,
                "completion_tokens": r.output_tokens, "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}

    def _completions(self, body: dict) -> None:
        self._inference(body, chat=False)

    def _chat(self, body: dict) -> None:
        self._inference(body, chat=True)

    def _inference(self, body: dict, chat: bool) -> None:
        self._check_model(body)
        toks = chat_tokens(body) if chat else prompt_tokens(body)
        max_tokens = _int_field(body, "max_completion_tokens" if chat and "max_completion_tokens" in body
                                else "max_tokens", DEFAULT_MAX_TOKENS)
        stream = _bool_field(body, "stream")
        opts = body.get("stream_options")
        include_usage = isinstance(opts, dict) and opts.get("include_usage") is True
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        r = self._run(rid, toks, max_tokens, body)
        w = self.worker
        model = w.engine.spec.model
        created = int(time.time())
        text = fake_text(r.output_tokens)
        obj = "chat.completion" if chat else "text_completion"
        if not stream:
            w.wait_until(r.finished_at)
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                          "finish_reason": r.finished_reason}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": r.finished_reason,
                          "stop_reason": None}
            self._json(200, {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
                             "usage": self._usage(r)})
            return
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def piece(content: str | None, finish: str | None, role: bool = False) -> dict:
            if chat:
                delta: dict = {"role": "assistant", "content": ""} if role else {}
                if content is not None:
                    delta["content"] = content
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": content or "", "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": chunk_obj, "created": created, "model": model, "choices": [choice]}

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.send_header(WORKER_HEADER, w.engine.spec.name)
        self.end_headers()
        self.close_connection = True

        def emit(obj_: dict | str) -> None:
            data = obj_ if isinstance(obj_, str) else json.dumps(obj_)
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

        if chat:
            emit(piece(None, None, role=True))
        w.wait_until(r.first_token_at)
        emit(piece(text[:1], None))
        w.wait_until(r.finished_at)
        if len(text) > 1:
            emit(piece(text[1:], None))
        emit(piece(None if chat else "", r.finished_reason))
        if include_usage:
            emit({"id": rid, "object": chunk_obj, "created": created, "model": model, "choices": [],
                  "usage": self._usage(r)})
        emit("[DONE]")

    def _generate(self, body: dict) -> None:
        toks = generate_tokens(body)
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise ApiError(400, "'sampling_params' must be an object", "sampling_params")
        max_new = _int_field(params, "max_new_tokens", 128)
        if _bool_field(body, "stream"):
            raise ApiError(400, "streaming /generate is not supported by the simulator", "stream")
        rid = "gnt-" + uuid.uuid4().hex
        r = self._run(rid, toks, max_new, body)
        self.worker.wait_until(r.finished_at)
        finish = {"type": r.finished_reason, "length": r.output_tokens} if r.finished_reason == "length" else {
            "type": "stop", "matched": None}
        self._json(200, {"text": fake_text(r.output_tokens), "meta_info": {
            "id": rid, "prompt_tokens": r.prompt_tokens, "completion_tokens": r.output_tokens,
            "cached_tokens": r.cached_tokens, "finish_reason": finish, "e2e_latency": r.e2e_s}})
