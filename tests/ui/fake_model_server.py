"""A small OpenAI-compatible server for the fault tests: a threaded http.server on loopback
whose /v1/chat/completions misbehaves as the test asks (server.mode).

Modes: "ok" (reasoning_content, then content, usage, [DONE]), "die" (two chunks, then the
connection is cut), "slow_start" (silent longer than any read timeout the tests set),
"trickle" (a chunk every 0.05 s for a long time; notes when the client hangs up),
"silent" (the role chunk, then nothing for 5 s, as a server with the reply queued),
"401", "429", "503", "500", "malformed" (an event that is not JSON), "no_done" (ends without
a finish), "not_sse" (a 200 with a JSON body), "think_in_content" (<think> left in the text),
"refuse_top_k" (400 naming top_k while the body has it, else "ok").

Hostile modes (a request picks one for itself with a last message "fake-mode: NAME", so that
innocent replies can stream beside it): "byte_trickle" (one byte every 0.2 s, never a
newline; "token_then_byte_trickle" after a first token), "long_line" (64 MB without a
newline), "huge_event" (one 1.5 MB event), "reasoning_flood" (reasoning without end,
max_tokens ignored), "surrogate" (a lone "\\ud800" escape in the text), "400_key" and
"error_event_key" (the server's message quotes this app's key and Authorization header),
"header_trickle" (the status line, then a header one byte every 0.2 s: the headers never end).
`model_id`: the id /v1/models lists; `model_info`: SGLang's /get_model_info answer (None:
404). `models_mode`: "ok", "500_key" (likewise), "huge_error" (a 64 MB error body), or
"trickle" (/v1/models and /get_model_info answer one byte a second, never finishing). `sent`
counts the bytes hostile modes wrote, `hangups` the clients that closed on them,
`open_streams` the replies being written now, `models_asked` the GET /v1/models requests.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "fake/Qwen3-0B"
TRICKLED_GETS = ("/v1/models", "/get_model_info")  # models_mode "trickle" answers them so


class FakeModelServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int = 0, key: str | None = None):
        super().__init__(("127.0.0.1", port), _Handler)
        self.key = key
        self.mode = "ok"
        self.bodies: list[dict] = []
        self.hung_up = threading.Event()  # a "trickle" reply's client closed the connection
        self.streaming = threading.Event()  # a "trickle" reply has started
        self.models_mode = "ok"
        self.model_id = MODEL  # the id /v1/models lists (a test may make it a path)
        self.model_info: dict | None = None  # GET /get_model_info's answer (SGLang's); 404
        self.sent = 0
        self.hangups = 0
        self.open_streams = 0
        self.models_asked = 0  # GET /v1/models requests, the health checks among them
        self.counts = threading.Lock()
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def handle_error(self, request, client_address) -> None:
        pass  # a client that hung up mid-request is what some tests do on purpose

    def start(self) -> FakeModelServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _Chunked:
    """HTTP/1.1 chunked transfer encoding: a cut connection is then a broken reply, not an end."""

    def __init__(self, raw):
        self.raw = raw

    def write(self, data: bytes) -> None:
        self.raw.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def flush(self) -> None:
        self.raw.flush()


def chunk(delta: dict, finish: str | None = None) -> bytes:
    data = {"id": "x", "object": "chat.completion.chunk", "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(data)}\n\n".encode()


class _Handler(BaseHTTPRequestHandler):
    server: FakeModelServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _authorized(self) -> bool:
        if self.server.key and self.headers.get("Authorization") != f"Bearer {self.server.key}":
            self._json(401, {"error": {"message": "Invalid API key"}})
            return False
        return True

    def _json(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _leaked(self) -> str:
        return (f"invalid header Authorization: {self.headers.get('Authorization')} "
                f"(key {self.server.key})")

    def _big(self, status: int, size: int, piece: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(size))
        self.end_headers()
        try:
            self._write_counted(self.wfile.write, size, piece)
        except (BrokenPipeError, ConnectionResetError):
            self._hung_up()

    def _write_counted(self, write, size: int, piece: bytes) -> None:
        for _ in range(size // len(piece)):
            write(piece)
            with self.server.counts:
                self.server.sent += len(piece)

    def _hung_up(self) -> None:
        with self.server.counts:
            self.server.hangups += 1
        self.server.hung_up.set()

    def do_GET(self) -> None:
        if not self._authorized():
            return
        if self.path == "/v1/models":
            with self.server.counts:
                self.server.models_asked += 1
        if self.path in TRICKLED_GETS and self.server.models_mode == "trickle":
            self._slow_answer()
        elif self.path == "/v1/models" and self.server.models_mode == "500_key":
            self._json(500, {"error": {"message": self._leaked()}})
        elif self.path == "/v1/models" and self.server.models_mode == "huge_error":
            self._big(500, 64 << 20, b"x" * 65536, "text/plain")
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [
                {"id": self.server.model_id, "object": "model", "max_model_len": 4096}]})
        elif self.path == "/get_model_info" and self.server.model_info is not None:
            self._json(200, self.server.model_info)
        else:
            self._json(404, {"error": {"message": "no such path"}})

    def _slow_answer(self) -> None:
        """A 200 whose body comes one byte a second for a minute: every read brings a byte,
        so no read timeout fires."""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "100000")
        self.end_headers()
        try:
            self.wfile.write(b'{"object": "list", "data": [')
            self.wfile.flush()
            for _ in range(60):
                time.sleep(1)
                self.wfile.write(b" ")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self._hung_up()
        self.close_connection = True

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        self.server.bodies.append(body)
        if not self._authorized():
            return
        mode = _directed(body) or self.server.mode
        if mode == "400_key":
            self._json(400, {"error": {"message": self._leaked()}})
            return
        if mode == "refuse_top_k":
            if "top_k" in body:
                self._json(400, {"object": "error", "message": "Unrecognized request argument "
                                 "supplied: top_k", "type": "BadRequestError"})
                return
            mode = "ok"
        if mode in ("401", "429", "503", "500"):
            headers = {"Retry-After": "7"} if mode in ("429", "503") else {}
            self._json(int(mode), {"error": {"message": f"fake {mode}"}}, headers)
            return
        if mode == "not_sse":
            self._json(200, {"object": "chat.completion", "choices": []})
            return
        if mode == "slow_start":
            time.sleep(3)
        if mode == "header_trickle":
            self._header_trickle()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")  # as uvicorn streams
        self.send_header("Connection", "close")  # one reply per connection, said so
        self.end_headers()
        with self.server.counts:
            self.server.open_streams += 1
        try:
            if mode in HOSTILE:
                HOSTILE[mode](self, _Chunked(self.wfile))
            else:
                self._stream(mode)
            if mode != "die":
                self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            self._hung_up()
        finally:
            with self.server.counts:
                self.server.open_streams -= 1
        self.close_connection = True

    def _header_trickle(self) -> None:
        """The status line, then one byte of a header every 0.2 s for 60 s: the headers never
        end, and every read brings a byte."""
        with self.server.counts:
            self.server.open_streams += 1
        try:
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Slow: ")
            self.wfile.flush()
            self.server.streaming.set()
            for _ in range(300):
                time.sleep(0.2)
                self.wfile.write(b"x")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self._hung_up()
        finally:
            with self.server.counts:
                self.server.open_streams -= 1
        self.close_connection = True

    def _stream(self, mode: str) -> None:
        out = _Chunked(self.wfile)
        out.write(chunk({"role": "assistant", "content": ""}))
        if mode == "malformed":
            out.write(b"data: {this is not json\n\n")
            return
        if mode == "silent":  # headers and the role chunk, then nothing for a long while
            out.flush()
            self.server.streaming.set()
            time.sleep(5)
            out.write(chunk({"content": "late"}))
            out.flush()
            return
        if mode == "trickle":
            self.server.streaming.set()
            for i in range(2000):
                out.write(chunk({"content": f"w{i} "}))
                out.flush()
                time.sleep(0.05)
            return
        if mode == "think_in_content":  # a server that does not parse Qwen3's thinking
            for piece in ("<think>\nHm", "m.\n</think>\n\n", "Hi."):
                out.write(chunk({"content": piece}))
            out.write(chunk({}, "stop"))
            out.write(b"data: [DONE]\n\n")
            return
        out.write(chunk({"reasoning_content": "Thinking about it."}))
        out.write(chunk({"content": "Hello"}))
        out.flush()
        if mode == "die":
            time.sleep(0.2)
            self.connection.shutdown(socket.SHUT_RDWR)  # the server process "dies"
            return
        out.write(chunk({"content": " there."}))
        if mode == "no_done":
            return
        out.write(chunk({}, "stop"))
        usage = {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15,
                 "prompt_tokens_details": {"cached_tokens": 8}}
        out.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        out.write(b"data: [DONE]\n\n")


def _directed(body: dict) -> str | None:
    """The mode a request asks for itself: its last message "fake-mode: NAME"."""
    messages = body.get("messages") or [{}]
    content = messages[-1].get("content")
    if isinstance(content, str) and content.startswith("fake-mode: "):
        return content.removeprefix("fake-mode: ").strip()
    return None


def _byte_trickle(handler: _Handler, out: _Chunked) -> None:
    out.write(chunk({"role": "assistant", "content": ""}))
    out.write(b'data: {"choices": [{"index": 0, "delta": {"content": "')
    out.flush()
    handler.server.streaming.set()
    for _ in range(300):  # 60 s of one byte every 0.2 s, never a newline
        time.sleep(0.2)
        out.write(b"x")
        out.flush()


def _token_then_byte_trickle(handler: _Handler, out: _Chunked) -> None:
    out.write(chunk({"role": "assistant", "content": ""}))
    out.write(chunk({"content": "Hi"}))
    out.flush()
    _byte_trickle(handler, out)


def _long_line(handler: _Handler, out: _Chunked) -> None:
    out.write(b"data: ")
    handler._write_counted(out.write, 64 << 20, b"x" * 65536)


def _huge_event(handler: _Handler, out: _Chunked) -> None:
    out.write(chunk({"role": "assistant", "content": ""}))
    out.write(chunk({"content": "x" * (3 << 19)}))
    out.write(chunk({}, "stop"))
    out.write(b"data: [DONE]\n\n")


def _reasoning_flood(handler: _Handler, out: _Chunked) -> None:
    out.write(chunk({"role": "assistant", "content": ""}))
    piece = chunk({"reasoning_content": "hmm "})
    for i in range(200_000):
        out.write(piece)
        with handler.server.counts:
            handler.server.sent += len(piece)
        if i % 50 == 0:
            out.flush()


def _surrogate(handler: _Handler, out: _Chunked) -> None:
    out.write(chunk({"role": "assistant", "content": ""}))
    out.write(b'data: {"choices": [{"index": 0, "delta": {"content": "a\\ud800b"}, '
              b'"finish_reason": null}]}\n\n')
    out.write(chunk({}, "stop"))
    out.write(b"data: [DONE]\n\n")


def _error_event_key(handler: _Handler, out: _Chunked) -> None:
    out.write(chunk({"role": "assistant", "content": ""}))
    out.write(chunk({"content": "Hello"}))
    out.write(f"data: {json.dumps({'error': {'message': handler._leaked()}})}\n\n".encode())


HOSTILE = {"byte_trickle": _byte_trickle, "token_then_byte_trickle": _token_then_byte_trickle,
           "long_line": _long_line, "huge_event": _huge_event,
           "reasoning_flood": _reasoning_flood, "surrogate": _surrogate,
           "error_event_key": _error_event_key}
