"""Sends N streamed chat requests of TOKENS tokens, one after another on one connection,
and counts the answers that came whole. Used by run.sh (see there)."""
import http.client
import json
import sys

port, n, tokens = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
body = json.dumps({
    "model": "m",
    "messages": [{"role": "user", "content": "hello there"}],
    "stream": True,
    "max_tokens": tokens,
})
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
ok = 0
for i in range(n):
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    r = conn.getresponse()
    d = r.read()
    if r.status == 200 and d.count(b"data: ") >= tokens + 1:
        ok += 1
    elif i == 0:
        print("unexpected answer:", r.status, d[:300], file=sys.stderr)
print(ok)
