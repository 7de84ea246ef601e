"""A small OpenAI-compatible server for the fault tests: a threaded http.server on loopback
whose /v1/chat/completions misbehaves as the test asks (server.mode).

Modes: "ok" (reasoning_content, then content, usage, [DONE]), "die" (two chunks, then the
connection is cut), "slow_start" (silent longer than any read timeout the tests set),
"trickle" (a chunk every 0.05 s for a long time; notes when the client hangs up),
"silent" (the role chunk, then nothing for 5 s, as a server with the reply queued),
"401", "429", "503", "500", "malformed" (an event that is not JSON), "no_done" (ends without
a finish), "not_sse" (a 200 with a JSON body), "think_in_content" (<think> left in the text),
"refuse_top_k" (400 naming top_k while the body has it, else "ok").
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "fake/Qwen3-0B"


class FakeModelServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int = 0, key: str | None = None):
        super().__init__(("127.0.0.1", port), _Handler)
        self.key = key
        self.mode = "ok"
        self.bodies: list[dict] = []
        self.hung_up = threading.Event()  # a "trickle" reply's client closed the connection
        self.streaming = threading.Event()  # a "trickle" reply has started
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

    def do_GET(self) -> None:
        if not self._authorized():
            return
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [
                {"id": MODEL, "object": "model", "max_model_len": 4096}]})
        else:
            self._json(404, {"error": {"message": "no such path"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        self.server.bodies.append(body)
        if not self._authorized():
            return
        mode = self.server.mode
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
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")  # as uvicorn streams
        self.send_header("Connection", "close")  # one reply per connection, said so
        self.end_headers()
        try:
            self._stream(mode)
            if mode != "die":
                self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            self.server.hung_up.set()
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
