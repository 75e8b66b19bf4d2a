#!/usr/bin/env python3
"""Writes the seed corpus (fuzz/corpus/<target>/seed-*): small, real examples of what each
parser reads, in the input layout of its target (see src/fuzzing/). Run again after
changing a target's layout; files fuzzing added (other names) are left alone."""
import os

HERE = os.path.dirname(os.path.abspath(__file__))
G, CHAT, CMPL = 0, 1, 2

def b(s):
    return s.encode() if isinstance(s, str) else s

requests = {
    "generate-text": (G, '{"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16, "temperature": 0}, "stream": true}'),
    "generate-ids-batch": (G, '{"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": [{"n": 2}, {"n": 2}], "return_logprob": [true, false]}'),
    "generate-pd-fields": (G, '{"text": ["a", "b"], "bootstrap_host": "x", "bootstrap_room": [1, 2], "rid": "r", "routed_dp_rank": 1, "stream": false}'),
    "generate-escaped-key": (G, '{"\\u0074ext": "hi", "k\\"ey": {"nested": [1, {"a": null}]}, "logprob_start_len": -1}'),
    "chat": (CHAT, '{"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 20}'),
    "chat-n": (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}], "n": 3, "max_completion_tokens": 5}'),
    "completions": (CMPL, '{"model": "m", "prompt": ["one", "two"], "max_tokens": 7, "echo": false}'),
    "completions-ids": (CMPL, '{"prompt": [[1, 2], [3]], "n": 1, "stream": true}'),
}

def http(head, body):
    """An answer head with a correct Content-Length for `body`."""
    return head.replace("{n}", str(len(body.encode()))) + "\r\n\r\n" + body

def chunked(*parts):
    return "".join("%x\r\n%s\r\n" % (len(p.encode()), p) for p in parts) + "0\r\n\r\n"

answers = {
    "length-json": (0, http("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {n}", '{"text":"hi","meta_info":{}}')),
    "chunked-sse": (7, "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + chunked('data: {"text":"a"}\n\n', "data: [DONE]\n\n")),
    "chunked-ext-trailers": (1, "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\nContent-Length: 3\r\n\r\n3;ext=1\r\nabc\r\n0\r\nx-trailer: 1\r\n\r\n"),
    "continue-then-200": (0, "HTTP/1.1 100 Continue\r\n\r\n" + http("HTTP/1.1 200 OK\r\ncontent-length: {n}", "{}")),
    "eof-framed-1.0": (3, "HTTP/1.0 200 OK\r\nconnection: keep-alive\r\n\r\n{\"text\":\"until close\"}"),
    "error-503": (0, http("HTTP/1.1 503 Service Unavailable\r\ncontent-length: {n}\r\nconnection: close", '{"object":"error","message":"overloaded","code":503}')),
    "conflicting-lengths": (0, "HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}"),
    "short-body": (0, "HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"partial\""),
    "no-content": (0, "HTTP/1.1 204 No Content\r\n\r\n"),
}

sse_streams = {
    "generate-cumulative": (0, 'data: {"text":"Par","output_ids":[1],"meta_info":{"id":"a1","prompt_tokens":5,"completion_tokens":1,"finish_reason":null}}\n\ndata: {"text":"Paris","output_ids":[1,2],"meta_info":{"id":"a1","prompt_tokens":5,"completion_tokens":2,"finish_reason":{"type":"stop"}}}\n\ndata: [DONE]\n\n'),
    "chat-chunks-crlf": (6, 'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\r\n\r\ndata: {"id":"c1","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\r\n\r\ndata: [DONE]\r\n\r\n'),
    "abort-event": (2, 'data: {"text":"a"}\n\ndata: {"text":"a","meta_info":{"finish_reason":{"type":"abort","message":"kv lost","status_code":500}}}\n\ndata: [DONE]\n\n'),
    "error-event": (9, ': keep-alive\n\nevent: message\ndata: {"error":{"object":"error","message":"boom","type":"INTERNAL_SERVER_ERROR","code":500}}\n\n'),
    "logprobs-merge": (1, 'data: {"text":"a","meta_info":{"input_token_logprobs":[],"output_token_logprobs":[[-0.1,7,null]]}}\n\ndata: {"index":1,"meta_info":{"input_token_logprobs":null}}\n\ndata: [DONE]\n\n'),
    "mixed-endings-tail": (4, 'data: a\n\r\ndata: b\r\n\n\ndata: {"unfinished'),
}

splices = {
    "generate-text": (G, '{"text":"Once upon","sampling_params":{"max_new_tokens":8},"stream":true}', sse_streams["generate-cumulative"][1]),
    "generate-ids-incremental": (G | 4, '{"input_ids":[1,2,3],"stream":true}', 'data: {"text":"x","output_ids":[9],"meta_info":{"completion_tokens":1}}\n\ndata: {"text":"y","output_ids":[10],"meta_info":{"completion_tokens":2}}\n\n'),
    "chat": (CHAT | 8, '{"messages":[{"role":"user","content":"hi"}],"max_tokens":30,"stream":true,"stream_options":{"include_usage":true}}', 'data: {"id":"c1","choices":[{"index":0,"delta":{"role":"assistant","content":"He"},"finish_reason":null}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\n\ndata: {"id":"c1","choices":[{"index":0,"delta":{"content":"llo"},"finish_reason":null}],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'),
    "completions": (CMPL | 16, '{"prompt":"1, 2, 3,","max_tokens":10,"stream":true}', 'data: {"id":"k1","choices":[{"index":0,"text":" 4,","finish_reason":null}],"usage":{"prompt_tokens":4,"completion_tokens":2,"total_tokens":6}}\n\n'),
    "chat-tool-call": (CHAT, '{"messages":[{"role":"user","content":"weather?"}],"stream":true}', 'data: {"id":"c2","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"name":"get"}}]}}]}\n\n'),
}

v3 = '{"attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 4, "pp_size": 1, "page_size": 1, "kv_cache_dtype": "auto", "follow_bootstrap_room": true, "prefill_http_port": 30000, "target_tp_rank": null}'
bootstrap = {
    "sentinel-v3": (0, 0, v3),
    "sentinel-v3-only": (1, 0, '{"attn_tp_size": 2, "dp_size": 2, "page_size": 64, "kv_cache_dtype": "bfloat16"}'),
    "sentinel-v2": (2, 0, '{"prefill_dp_size": 2, "prefill_attn_tp_size": 1, "prefill_pp_size": 1}'),
    "sentinel-v1": (3, 0, '{"prefill_dp_size": 8, "prefill_tp_size": 8}'),
    "sentinel-not-ready": (0, 1, 'Not all instances are ready'),
    "sentinel-huge-dp": (1, 0, '{"dp_size": 4294967295}'),
    "route-v3": (4 | (3 << 3), 0, '{"rank_ip": "127.0.0.1", "rank_port": 17003}'),
    "route-v3-missing": (4, 2, '{"detail": "rank not found"}'),
    "route-v1-keyerror": (6, 3, 'Internal Server Error'),
    "health-and-info": (7, 0, '{"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 8998, "dp_size": 2, "page_size": 64, "version": "0.5.23"}'),
}

engine = {
    "loads-v1": (0 | (7 << 2), '{"loads": [{"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 1, "num_total_tokens": 900, "max_total_num_tokens": 100000, "max_running_requests": 64}, {"dp_rank": 1, "num_running_reqs": 0}]}'),
    "get-load-list": (0 | (1 << 2), '[{"dp_rank": 0, "num_reqs": 2, "num_tokens": 30}, {"dp_rank": 5, "num_reqs": 1.6}]'),
    "get-load-old": (0, '{"load": 12}'),
    "server-info": (1, '{"disaggregation_mode": "decode", "dp_size": 8, "page_size": 64, "kv_cache_dtype": "auto", "version": "0.5.23", "disaggregation_transfer_backend": "mooncake", "load_balance_method": "follow_bootstrap_room", "incremental_streaming_output": false}'),
    "server-info-huge-dp": (1, '{"dp_size": 1000000}'),
    "prefill-logprobs": (2, '{"text":"","meta_info":{"input_token_logprobs":[[-1.0,5,null]],"output_token_logprobs":[]}}'),
    "prefill-logprobs-batch": (2, '[{"meta_info":{"input_token_logprobs":[[null,1,null]]}},{"index":1,"meta_info":{"input_top_logprobs":[null]}}]'),
    "error-body": (3, '{"object":"error","message":"The context is too long","type":"BadRequestError","param":null,"code":400}'),
    "detail-body": (3, '{"detail":[{"loc":["body"],"msg":"field required"}]}'),
    "kv-failure": (3, '{"text":"","meta_info":{"finish_reason":{"type":"abort","message":"KV transfer failed for request","status_code":500}}}'),
}

selectors = {
    "eq": "app=sglang,role=decode",
    "set": "environment in (production, qa),tier notin (frontend)",
    "exists": "app.kubernetes.io/name,!canary",
    "gt-lt": "gpu>1,gpu<9",
    "double-eq-ne": "a==b , c!=d",
    "empty-value": "role=,x in ()",
    "blank": "   ",
}

keys = {
    "file": "# client keys\n\nsk-raw-key-1\nsha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\nteam-a: sk-raw-key-2   # rotated in March\nteam-b: sha256:2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae\n",
    "crlf-tabs": "team-a:\tkey-one\r\nteam-a: key-two\r\n",
    "bad-name": "te am: key\n",
    "duplicate": "k\nname: k\n",
}

def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)

for n, (sel, body) in requests.items():
    write("request", n, bytes([sel]) + b(body))
for n, (sel, ans) in answers.items():
    write("leg_answer", n, bytes([sel]) + b(ans))
for n, (sel, s) in sse_streams.items():
    write("sse", n, bytes([sel]) + b(s))
for n, (sel, req, s) in splices.items():
    write("splice", n, bytes([sel]) + b(req) + b"\0" + b(s))
for n, (call, status, body) in bootstrap.items():
    write("bootstrap", n, bytes([call, status]) + b(body))
for n, (sel, body) in engine.items():
    write("engine_json", n, bytes([sel]) + b(body))
for n, s in selectors.items():
    write("selector", n, b(s))
for n, s in keys.items():
    write("keys_file", n, b(s))
