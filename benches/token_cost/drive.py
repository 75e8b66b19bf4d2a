"""Sends N requests of TOKENS tokens, one after another on one connection, and counts the
answers that came whole: streamed chat (MODE `chat`, the default) or non-streamed
`/generate` (MODE `generate`). Used by run.sh (see there).

    drive.py PORT N TOKENS [MODE]"""
import http.client
import json
import sys

port, n, tokens = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
mode = sys.argv[4] if len(sys.argv) > 4 else "chat"
if mode == "generate":
    path = "/generate"
    body = json.dumps({"text": "hello there", "sampling_params": {"max_new_tokens": tokens}})
    whole = lambda d: b'"text"' in d and b'"meta_info"' in d
else:
    path = "/v1/chat/completions"
    body = json.dumps({
        "model": "m",
        "messages": [{"role": "user", "content": "hello there"}],
        "stream": True,
        "max_tokens": tokens,
    })
    whole = lambda d: d.count(b"data: ") >= tokens + 1
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
ok = 0
for i in range(n):
    conn.request("POST", path, body, {"content-type": "application/json"})
    r = conn.getresponse()
    d = r.read()
    if r.status == 200 and whole(d):
        ok += 1
    elif i == 0:
        print("unexpected answer:", r.status, d[:300], file=sys.stderr)
print(ok)
