"""The load test's clients: one streamed request through gradio_client's /chat, or through
/v1/chat/completions as server-sent events, each filling in its Result. Used by load_test.py."""

from __future__ import annotations

import json
import threading
import time

from load_report import Result

from model_utils.runtime.generation_settings import BY_NAME

# Polled every POLL_S rather than iterated (one_request says why).
POLL_S = 0.005


def openai_settings(settings: dict) -> dict:
    """The settings by the names an OpenAI-compatible server knows (max_tokens ...)."""
    return {BY_NAME[name].openai_name: value for name, value in settings.items()}


def one_request(client, result: Result, message: str, settings: dict, deadline: float,
                jobs: list, lock: threading.Lock) -> None:
    start = time.perf_counter()
    job = client.submit(message, [], settings, "", False, api_name="/chat")
    with lock:
        jobs.append(job)
    final, longest, seen = None, 0, 0
    # Polled every POLL_S rather than iterated: gradio_client's iterator checks for a new
    # update every millisecond, and 32 of them spend cores that the server on the same machine
    # needs (measured: 2/3 of a core for 8 clients). TTFT is then known to within POLL_S.
    while True:
        finished = job.done()
        outputs = job.outputs()
        now = time.perf_counter()
        for update in outputs[seen:]:
            if result.ttft_s is None:
                result.ttft_s = now - start
            result.updates += 1
            longest = max(longest, len(update.get("answer") or ""))
            if update.get("done"):
                final = update
        seen = len(outputs)
        if finished:
            break
        if now > deadline:
            job.cancel()
            raise TimeoutError("the run's --timeout passed before the reply ended")
        time.sleep(POLL_S)
    if final is None:
        job.result()  # raises the server's error, if that is why the stream ended
    result.total_s = time.perf_counter() - start
    if final is None or not final.get("stats"):
        result.lost = True
        return
    stats = final["stats"]
    result.new_tokens = int(stats.get("new_tokens") or 0)
    result.prompt_tokens = int(stats.get("prompt_tokens") or 0)
    result.tok_s = stats.get("tok_s")
    result.server_total_s = stats.get("total_s")
    result.finish_reason = stats.get("finish_reason") or ""
    result.server_ttft_ms = stats.get("ttft_ms")
    judge(result, settings["max_new_tokens"])
    if not result.truncated and len(final.get("answer") or "") < longest:
        result.truncated = "the final answer is shorter than a streamed one"
    result.ok = not result.truncated


def judge(result: Result, wanted: int) -> None:
    """Mark a reply that ended for another reason than EOS or its full max_new_tokens."""
    if result.finish_reason not in ("eos", "length"):
        result.truncated = f"finished by {result.finish_reason or 'nothing'}"
    elif result.finish_reason == "length" and result.new_tokens != wanted:
        result.truncated = f"{result.new_tokens} of {wanted} tokens at the length limit"
    result.ok = not result.truncated


def one_openai_request(client, result: Result, message: str, settings: dict,
                       deadline: float) -> None:
    """The same request through /v1/chat/completions, streamed as server-sent events. The
    server's own timings are not in that format: TTFT and decode speed are the client's."""
    body = {"messages": [{"role": "user", "content": message}], "stream": True,
            **openai_settings(settings), "enable_thinking": False,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first_at = last_at = None
    finish, usage, ended = None, None, False
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            now = time.perf_counter()
            if now > deadline:
                raise TimeoutError("the run's --timeout passed before the reply ended")
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                ended = True
                break
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(event["error"].get("message"))
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("content") or delta.get("reasoning_content"):
                    first_at = first_at or now
                    last_at = now
                    result.updates += 1
                finish = choice.get("finish_reason") or finish
    result.total_s = time.perf_counter() - start
    if not ended or usage is None:
        result.lost = True
        return
    result.ttft_s = first_at - start if first_at else None
    result.new_tokens = int(usage.get("completion_tokens") or 0)
    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    if first_at and last_at > first_at:
        result.tok_s = (result.new_tokens - 1) / (last_at - first_at)
    result.finish_reason = {"stop": "eos"}.get(finish, finish or "")
    judge(result, settings["max_new_tokens"])


def connect(args):
    """One client: a gradio_client session, or an HTTP client that has listed the models."""
    if args.api == "gradio":
        from gradio_client import Client

        return Client(args.url, verbose=False, auth=args.auth, download_files=False)
    import httpx

    headers = {"Authorization": f"Bearer {args.auth[0]}:{args.auth[1]}"} if args.auth else {}
    client = httpx.Client(base_url=args.url, headers=headers, timeout=args.timeout)
    client.get("/v1/models").raise_for_status()
    return client
