"""An engine's HTTP face as SGLang serves it, for pdgate's leg client to meet the HTTP
server that engines really run (uvicorn, with either of its HTTP/1.1 parsers).

Why: pdgate's lean leg client (src/upstream/leg.rs) was only tested against hyper (the
simulator) and hand-written sockets. SGLang's `http_server.py` is a FastAPI (Starlette) app
served by uvicorn with `timeout_keep_alive=5`; this app answers the way it does, with made-up
tokens shaped and paced by the request, and records what it saw so that tests can assert on
it (each rid is counted; cancelled streams are recorded).

Answers, as SGLang gives them:
- `POST /generate`, `POST /v1/chat/completions`: non-streamed answers as `ORJSONResponse`
  (Content-Length); streamed ones as `StreamingResponse` SSE (`text/event-stream`, chunked):
  one `data: {...}\\n\\n` event per token, then `data: [DONE]\\n\\n`. `/generate` chunks are
  cumulative (SGLang's default) unless `sim.incremental`.
- Errors: `{"object": "error", "message": ..., "type": "BadRequestError", "param": null,
  "code": 400}` with the status.
- Aborts: a `/generate` chunk whose `meta_info.finish_reason` is `{"type": "abort", ...}`;
  a chat stream's `{"error": {...}}` chunk; a non-streamed abort is a 500 error JSON.
- `POST /abort_request {"rid"}` aborts running requests whose rid starts with it (200,
  empty body); `GET /health` is 200.

Request fields: `rid`; `stream`; the token count from `sampling_params.max_new_tokens`
(`/generate`) or `max_tokens` (chat), default 4; and a `sim` object: `delay_ms` (before each
token), `token_bytes` (bytes per token, for large answers), `abort_after` (abort chunk after
that many tokens), `error` (answer this 4xx after reading the body), `incremental`. Token
`i` is the letter `"abcdefghijklmnopqrstuvwxyz"[i % 26]` repeated `token_bytes` times.
Headers: `x-sim-early-status: N` answers N before reading the body at all, with
`connection: close` when `x-sim-early-close` is given (uvicorn then closes with the body
unread).

Test hooks: `GET /sim/requests` (rid, client port and path of every request read, in order),
`GET /sim/wait_cancelled?rid=R&timeout=S` (`{"cancelled": bool}` once the stream of R was
cut by its client, or after S seconds).

Run: `python app.py --port 0 --http h11|httptools [--timeout-keep-alive 5]
[--max-seconds 120]`; prints `READY <port>` on stdout once it listens on 127.0.0.1.
"""

import argparse
import asyncio
import time
import uuid

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route


class ORJSONResponse(Response):
    """FastAPI's ORJSONResponse, which SGLang's http_server uses."""

    media_type = "application/json"

    def render(self, content) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)


class State:
    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.aborted: list[str] = []
        self.cancelled: dict[str, asyncio.Event] = {}

    def cancelled_event(self, rid: str) -> asyncio.Event:
        return self.cancelled.setdefault(rid, asyncio.Event())

    def is_aborted(self, rid: str) -> bool:
        return any(rid.startswith(p) for p in self.aborted)


STATE = State()


def error_response(status: int, message: str, headers=None) -> ORJSONResponse:
    kind = "BadRequestError" if status < 500 else str(status)
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return ORJSONResponse(body, status_code=status, headers=headers)


def token(i: int, size: int) -> str:
    return "abcdefghijklmnopqrstuvwxyz"[i % 26] * size


class Job:
    """One request's plan, from its JSON body."""

    def __init__(self, obj: dict, chat: bool, port: int, path: str) -> None:
        self.rid = str(obj.get("rid") or uuid.uuid4().hex)
        self.chat = chat
        self.stream = bool(obj.get("stream", False))
        if chat:
            self.tokens = int(obj.get("max_tokens") or 4)
        else:
            self.tokens = int((obj.get("sampling_params") or {}).get("max_new_tokens") or 4)
        sim = obj.get("sim") or {}
        self.delay = float(sim.get("delay_ms", 0)) / 1000.0
        self.token_bytes = int(sim.get("token_bytes", 1))
        self.abort_after = sim.get("abort_after")
        self.error = sim.get("error")
        self.incremental = bool(sim.get("incremental", False))
        STATE.requests.append({"rid": self.rid, "port": port, "path": path})

    def aborted_at(self, i: int) -> str | None:
        """Why the job stops before token `i`, if it does."""
        if self.abort_after is not None and i >= int(self.abort_after):
            return "Abort requested by the test (sim.abort_after)"
        if STATE.is_aborted(self.rid):
            return "Abort requested by /abort_request"
        return None

    def meta(self, done: int, finish) -> dict:
        return {
            "id": self.rid,
            "finish_reason": finish,
            "prompt_tokens": 3,
            "completion_tokens": done,
            "cached_tokens": 0,
        }

    def abort_reason(self, message: str) -> dict:
        return {"type": "abort", "message": message, "status_code": 500, "err_type": None}

    def length_reason(self) -> dict:
        return {"type": "length", "length": self.tokens}

    def gen_chunk(self, text: str, done: int, finish) -> dict:
        return {"text": text, "output_ids": list(range(done)), "meta_info": self.meta(done, finish)}

    def chat_chunk(self, delta: str, finish) -> dict:
        return {
            "id": self.rid,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": "sim",
            "choices": [
                {"index": 0, "delta": {"content": delta}, "finish_reason": finish}
            ],
        }

    async def whole(self) -> Response:
        text = []
        for i in range(self.tokens):
            why = self.aborted_at(i)
            if why is not None:
                return error_response(500, why)
            if self.delay:
                await asyncio.sleep(self.delay)
            text.append(token(i, self.token_bytes))
        text = "".join(text)
        if self.chat:
            return ORJSONResponse(
                {
                    "id": self.rid,
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": "sim",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "length",
                        }
                    ],
                    "usage": {"prompt_tokens": 3, "completion_tokens": self.tokens},
                }
            )
        return ORJSONResponse(self.gen_chunk(text, self.tokens, self.length_reason()))

    async def events(self):
        finished = False
        try:
            text = ""
            for i in range(self.tokens):
                why = self.aborted_at(i)
                if why is not None:
                    if self.chat:
                        err = {"object": "error", "message": why,
                               "type": "INTERNAL_SERVER_ERROR", "param": None, "code": 500}
                        yield sse({"error": err})
                    else:
                        yield sse(self.gen_chunk(text, i, self.abort_reason(why)))
                    break
                if self.delay:
                    await asyncio.sleep(self.delay)
                tok = token(i, self.token_bytes)
                last = i + 1 == self.tokens
                if self.chat:
                    yield sse(self.chat_chunk(tok, "length" if last else None))
                else:
                    text = tok if self.incremental else text + tok
                    finish = self.length_reason() if last else None
                    yield sse(self.gen_chunk(text, i + 1, finish))
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            # Starlette cancels the stream when uvicorn reports the client gone.
            if not finished:
                STATE.cancelled_event(self.rid).set()


def sse(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def answer(request: Request, chat: bool) -> Response:
    early = request.headers.get("x-sim-early-status")
    if early is not None:
        close = {"connection": "close"} if "x-sim-early-close" in request.headers else None
        return error_response(int(early), "rejected before reading the body", close)
    try:
        obj = orjson.loads(await request.body())
    except orjson.JSONDecodeError as e:
        return error_response(400, f"invalid JSON body: {e}")
    client = request.client
    job = Job(obj, chat, client.port if client else 0, request.url.path)
    if job.error is not None:
        return error_response(int(job.error), "rejected by the test (sim.error)")
    if job.stream:
        return StreamingResponse(job.events(), media_type="text/event-stream")
    return await job.whole()


async def generate(request: Request) -> Response:
    return await answer(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await answer(request, chat=True)


async def abort_request(request: Request) -> Response:
    obj = orjson.loads(await request.body())
    STATE.aborted.append(str(obj.get("rid", "")))
    return Response(status_code=200)


async def health(_: Request) -> Response:
    return Response(status_code=200)


async def requests_seen(_: Request) -> Response:
    return ORJSONResponse(STATE.requests)


async def wait_cancelled(request: Request) -> Response:
    rid = request.query_params["rid"]
    timeout = float(request.query_params.get("timeout", "5"))
    try:
        await asyncio.wait_for(STATE.cancelled_event(rid).wait(), timeout)
        cancelled = True
    except asyncio.TimeoutError:
        cancelled = False
    return ORJSONResponse({"cancelled": cancelled})


app = Starlette(
    routes=[
        Route("/generate", generate, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/sim/requests", requests_seen, methods=["GET"]),
        Route("/sim/wait_cancelled", wait_cancelled, methods=["GET"]),
    ]
)


class Server(uvicorn.Server):
    """Says which port it got once it listens."""

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        port = self.servers[0].sockets[0].getsockname()[1]
        print(f"READY {port}", flush=True)

    async def main_loop(self) -> None:
        max_seconds = self.config.max_seconds
        if max_seconds:
            asyncio.get_running_loop().call_later(max_seconds, self.stop)
        await super().main_loop()

    def stop(self) -> None:
        self.should_exit = True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--http", choices=["h11", "httptools"], default="h11")
    p.add_argument("--timeout-keep-alive", type=int, default=5)
    p.add_argument("--max-seconds", type=float, default=120.0,
                   help="exit by itself after this long (should a test die without killing it)")
    args = p.parse_args()
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        http=args.http,
        timeout_keep_alive=args.timeout_keep_alive,
        log_level="warning",
        lifespan="off",
    )
    config.max_seconds = args.max_seconds
    Server(config).run()


if __name__ == "__main__":
    main()
