"""Multi-turn cache-affinity bench (issue 35): the trace, the client, the ideal router,
and the report. Python 3 standard library only; run.sh starts the engines and routers.

    drive.py run NAME OUT.json --routers PORT[,PORT...] [--hot] ENGINES...
    drive.py run NAME OUT.json --ideal sysprompt|conversation ENGINES...
    drive.py ready PORT PREFILL_RANKS DECODE_RANKS   (waits for a router's /readiness)
    drive.py report OUT_DIR                          (prints the Markdown tables)

ENGINES are `--prefill URL BOOTSTRAP_PORT DP` and `--decode URL DP` (repeated), from the
simulator's READY lines, in its order. The trace (seeded: the same in every run):
100 conversations of 4-6 turns, each on one of 4 system prompts of 560-640 words (25
conversations each), user turns of 30-150 words, a think time of 0.2-1.0 s before each
turn after the first; `max_tokens` 16, streamed chat completions. Each turn sends the whole
conversation so far, the assistant's earlier answers included (as received). CONCURRENCY
conversations run at once (a pool of client threads taking the conversations in order);
every request has a timeout and the run a deadline.

Numbers: prefill and decode cache hit from the engines' own counters (`/sim/stats`:
cached over looked-up prompt tokens, summed over ranks); the client's view
(`usage.prompt_tokens_details.cached_tokens`, which reports the prefill's cache) is kept
as a cross-check. TTFT is measured by the client: from sending the request (both legs, for
the ideal) to the first chunk carrying content.
"""
import http.client
import json
import math
import os
import queue
import random
import sys
import threading
import time
import urllib.request

SEED = 35
CONVERSATIONS = 100
SYSTEM_PROMPTS = 4
CONCURRENCY = 32
MAX_TOKENS = 16
REQUEST_TIMEOUT = 60.0  # s, per request (socket timeout)
RUN_DEADLINE = 600.0  # s: no turn starts after this
SAMPLE_EVERY = 0.05  # s between load samples of the engines
BALANCE_FACTOR = 1.25  # cache_aware_balance_factor's default (src/config/mod.rs)
SLACK = 1  # cache_aware_slack's default (src/config/mod.rs)
HOT_HEADER = "x-smg-routing-key"


# ---------------------------------------------------------------- the trace


def make_trace(seed=SEED):
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = sorted({"".join(rng.choice(letters) for _ in range(rng.randint(3, 9)))
                    for _ in range(6000)})

    def words(n):
        return " ".join(rng.choice(vocab) for _ in range(n))

    systems = [words(rng.randint(560, 640)) for _ in range(SYSTEM_PROMPTS)]
    sys_of = [i % SYSTEM_PROMPTS for i in range(CONVERSATIONS)]
    rng.shuffle(sys_of)
    convs = []
    for i in range(CONVERSATIONS):
        turns = rng.randint(4, 6)
        convs.append({
            "id": i,
            "system": sys_of[i],
            "users": [words(rng.randint(30, 150)) for _ in range(turns)],
            "think": [0.0] + [round(rng.uniform(0.2, 1.0), 3) for _ in range(turns - 1)],
            "hot": i % 2 == 0,
        })
    return systems, convs


# ---------------------------------------------------------------- HTTP


def split_url(url):
    hp = url.split("://", 1)[-1].rstrip("/")
    host, port = hp.rsplit(":", 1)
    return host, int(port)


def get_json(url, path, timeout=5.0):
    with urllib.request.urlopen(url.rstrip("/") + path, timeout=timeout) as r:
        return json.loads(r.read())


def post_plain(host, port, body, headers):
    """A non-streamed POST; (status, body bytes)."""
    conn = http.client.HTTPConnection(host, port, timeout=REQUEST_TIMEOUT)
    try:
        conn.request("POST", "/v1/chat/completions", body, headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def post_stream(host, port, body, headers, t0):
    """A streamed chat completion. Returns a dict: status, ttft (s, to the first content
    chunk), text (the answer), usage (the last usage seen), done ([DONE] seen), error."""
    out = {"status": None, "ttft": None, "text": "", "usage": None, "done": False, "error": None}
    conn = http.client.HTTPConnection(host, port, timeout=REQUEST_TIMEOUT)
    try:
        conn.request("POST", "/v1/chat/completions", body, headers)
        r = conn.getresponse()
        out["status"] = r.status
        if r.status != 200:
            out["error"] = f"status {r.status}: {r.read()[:200]!r}"
            return out
        parts = []
        for _ in range(100000):  # bounded: a 16-token answer is ~20 events
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                out["done"] = True
                break
            ev = json.loads(data)
            if ev.get("error"):
                out["error"] = f"stream error: {str(ev['error'])[:200]}"
                break
            if ev.get("usage"):
                out["usage"] = ev["usage"]
            for ch in ev.get("choices") or []:
                c = (ch.get("delta") or {}).get("content")
                if c:
                    if out["ttft"] is None:
                        out["ttft"] = time.monotonic() - t0
                    parts.append(c)
        out["text"] = "".join(parts)
        if not out["done"] and out["error"] is None:
            out["error"] = "stream ended without [DONE]"
    except Exception as e:  # noqa: BLE001 - any failure is one error of the run
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return out


# ---------------------------------------------------------------- targets


class Routers:
    """pdgate replicas; requests spread round-robin over them, per request."""

    def __init__(self, ports, hot):
        self.ports = ports
        self.hot = hot
        self.n = 0
        self.lock = threading.Lock()

    def send(self, conv, messages):
        with self.lock:
            port = self.ports[self.n % len(self.ports)]
            self.n += 1
        body = json.dumps({
            "model": "sim-model", "messages": messages, "max_tokens": MAX_TOKENS,
            "stream": True, "stream_options": {"include_usage": True},
        })
        headers = {"content-type": "application/json"}
        if self.hot and conv["hot"]:
            headers[HOT_HEADER] = "hot"
        t0 = time.monotonic()
        return post_stream("127.0.0.1", port, body, headers, t0)


class Ideal:
    """The driver as the router: each conversation fixed to one prefill rank and one decode
    rank, both legs sent at once with the same bootstrap fields, room ≡ prefill rank (mod
    the prefill's DP) as the default `follow_bootstrap_room` contract asks, the decode rank
    in `routed_dp_rank` on the decode leg only.

    `sysprompt`: the conversations of system prompt s go to prefill ranks 2s and 2s+1
    (global rank = worker × DP + rank), alternating, and to decode rank s: every rank holds
    one system prompt and 12-13 (prefill) or 25 (decode) conversations.
    `conversation`: conversation i on prefill rank i mod 8 and decode rank i mod 4 (the
    best a router keyed by conversation can do: balanced, no system prompt grouping)."""

    def __init__(self, how, prefills, decodes, convs):
        self.prefills, self.decodes = prefills, decodes
        p_ranks = [(w, k) for w in range(len(prefills)) for k in range(prefills[w]["dp"])]
        d_ranks = [(w, k) for w in range(len(decodes)) for k in range(decodes[w]["dp"])]
        self.place = {}
        seen = {}
        for c in convs:
            if how == "sysprompt":
                s = c["system"]
                j = seen.get(s, 0)
                seen[s] = j + 1
                per = len(p_ranks) // SYSTEM_PROMPTS
                p = p_ranks[(s * per + j % per) % len(p_ranks)]
                d = d_ranks[s % len(d_ranks)]
            else:
                p = p_ranks[c["id"] % len(p_ranks)]
                d = d_ranks[c["id"] % len(d_ranks)]
            self.place[c["id"]] = (p, d)
        self.rng = random.SystemRandom()
        self.n = 0
        self.lock = threading.Lock()

    def send(self, conv, messages):
        (pw, pk), (dw, dk) = self.place[conv["id"]]
        pre, dec = self.prefills[pw], self.decodes[dw]
        dp = pre["dp"]
        room = pk + dp * self.rng.randrange(1, (1 << 63) // dp - 1)
        with self.lock:
            self.n += 1
            rid = f"ideal-{self.n}"
        base = {"model": "sim-model", "messages": messages, "max_tokens": MAX_TOKENS,
                "bootstrap_host": "127.0.0.1", "bootstrap_port": pre["bootstrap_port"],
                "bootstrap_room": room}
        pbody = dict(base, stream=False, rid=rid + "-p")
        dbody = dict(base, stream=True, stream_options={"include_usage": True}, rid=rid + "-d")
        if dec["dp"] > 1:
            dbody["routed_dp_rank"] = dk
        headers = {"content-type": "application/json"}
        res = {}

        def prefill_leg():
            try:
                res["p"] = post_plain(*split_url(pre["url"]), json.dumps(pbody), headers)
            except Exception as e:  # noqa: BLE001
                res["p"] = (None, f"{type(e).__name__}: {e}".encode())

        t0 = time.monotonic()
        th = threading.Thread(target=prefill_leg, daemon=True)
        th.start()
        out = post_stream(*split_url(dec["url"]), json.dumps(dbody), headers, t0)
        th.join(REQUEST_TIMEOUT + 5)
        st, pb = res.get("p", (None, b"prefill leg did not end"))
        if st != 200 and out["error"] is None:
            out["error"] = f"prefill leg: {st} {pb[:200]!r}"
        return out


# ---------------------------------------------------------------- the run


def parse_engines(args):
    prefills, decodes, rest = [], [], []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--prefill":
            prefills.append({"url": args[i + 1], "bootstrap_port": int(args[i + 2]),
                             "dp": int(args[i + 3])})
            i += 4
        elif a == "--decode":
            decodes.append({"url": args[i + 1], "dp": int(args[i + 2])})
            i += 3
        else:
            rest.append(a)
            i += 1
    return prefills, decodes, rest


def sample_loads(engines, stop, samples):
    """Every SAMPLE_EVERY s: each engine's per-rank requests present (running + waiting,
    from `/v1/loads`). Bounded by the stop event and the run deadline."""
    end = time.monotonic() + RUN_DEADLINE + 60
    while not stop.is_set() and time.monotonic() < end:
        row = []
        for e in engines:
            try:
                v = get_json(e["url"], "/v1/loads", timeout=2.0)
                row.append([l["num_running_reqs"] + l["num_waiting_reqs"]
                            for l in sorted(v["loads"], key=lambda l: l["dp_rank"])])
            except Exception:  # noqa: BLE001 - a missed sample is only a missed sample
                row.append(None)
        samples.append(row)
        stop.wait(SAMPLE_EVERY)


def run(name, out_path, target, prefills, decodes, extra):
    systems, convs = make_trace()
    todo = queue.Queue()
    for c in convs:
        todo.put(c)
    results = []
    lock = threading.Lock()
    start = time.monotonic()

    def worker():
        for _ in range(CONVERSATIONS):  # bounded: at most every conversation
            try:
                c = todo.get_nowait()
            except queue.Empty:
                return
            messages = [{"role": "system", "content": systems[c["system"]]}]
            for t, user in enumerate(c["users"]):
                if time.monotonic() - start > RUN_DEADLINE:
                    with lock:
                        results.append({"conv": c["id"], "turn": t, "error": "run deadline"})
                    break
                time.sleep(c["think"][t])
                messages.append({"role": "user", "content": user})
                r = target.send(c, messages)
                rec = {"conv": c["id"], "turn": t, "ttft": r["ttft"], "error": r["error"],
                       "usage": r["usage"], "hot": c["hot"]}
                if r["error"] is None and r["ttft"] is None:
                    rec["error"] = "no content"
                with lock:
                    results.append(rec)
                if rec["error"] is not None:
                    break  # the conversation cannot go on without the answer
                messages.append({"role": "assistant", "content": r["text"]})

    engines = prefills + decodes
    stop = threading.Event()
    samples = []
    sampler = threading.Thread(target=sample_loads, args=(engines, stop, samples), daemon=True)
    sampler.start()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(CONCURRENCY)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, RUN_DEADLINE + REQUEST_TIMEOUT * 7 - (time.monotonic() - start)))
    elapsed = time.monotonic() - start
    stop.set()
    sampler.join(10)
    # Quiet engines before reading the counters (bounded).
    for _ in range(100):
        if all(get_json(e["url"], "/sim/stats")["held_now"] == 0 for e in engines):
            break
        time.sleep(0.1)
    stats = {"prefill": [get_json(e["url"], "/sim/stats") for e in prefills],
             "decode": [get_json(e["url"], "/sim/stats") for e in decodes]}
    spills = {"prefill": 0, "decode": 0}
    for port in getattr(target, "ports", []):
        for role, n in scrape_spills(port).items():
            spills[role] = spills.get(role, 0) + n
    expected = sum(len(c["users"]) for c in convs)
    doc = {"spills": spills if isinstance(target, Routers) else None, "name": name, "extra": extra, "elapsed_s": round(elapsed, 2),
           "requests_expected": expected, "results": results, "stats": stats,
           "samples": samples, "prefill_dp": [p["dp"] for p in prefills],
           "decode_dp": [d["dp"] for d in decodes], "concurrency": CONCURRENCY}
    with open(out_path, "w") as f:
        json.dump(doc, f)
    s = summarise(doc)
    print(f"{name}: {s['ok']}/{expected} ok, errors {s['errors']}, prefill hit "
          f"{pct(s['prefill_hit'])}, decode hit {pct(s['decode_hit'])}, TTFT p50 "
          f"{s['p50']:.0f} ms p99 {s['p99']:.0f} ms, violations {s['violations']}, "
          f"{elapsed:.1f} s", file=sys.stderr)


def scrape_spills(port):
    """The router's `pdgate_affinity_spills_total`, summed by role (its front-door
    /metrics, served with --public-metrics); {} when it has none."""
    out = {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except Exception:  # noqa: BLE001 - an older binary without the metric
        return out
    for line in text.splitlines():
        if line.startswith("pdgate_affinity_spills_total{"):
            labels, value = line.rsplit(" ", 1)
            role = labels.split('role="', 1)[1].split('"', 1)[0]
            out[role] = out.get(role, 0) + int(float(value))
    return out


# ---------------------------------------------------------------- the report


def pct(x):
    return "—" if x is None else f"{100 * x:.1f}%"


def quantile(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


def ratio(stats, req, hit):
    r = sum(sum(s.get(req) or []) for s in stats)
    h = sum(sum(s.get(hit) or []) for s in stats)
    return h / r if r else None


def bound(total, n, c=BALANCE_FACTOR, slack=SLACK):
    """cache_aware's load bound: ceil(c × (total + 1) / n) + slack (src/policy/cache_aware.rs).
    A member takes a request while its load is at most this, so it can hold one more."""
    return math.ceil(c * (total + 1) / n) + slack


def summarise(doc):
    res = doc["results"]
    ok = [r for r in res if r["error"] is None]
    ttfts = [1000 * r["ttft"] for r in ok]
    stats = doc["stats"]
    every = stats["prefill"] + stats["decode"]
    usage_prompt = sum((r["usage"] or {}).get("prompt_tokens", 0) for r in ok)
    usage_cached = sum(((r["usage"] or {}).get("prompt_tokens_details") or {})
                       .get("cached_tokens", 0) for r in ok)
    # Errors: requests that failed, plus turns never sent because of one (or the deadline).
    sent_or_failed = len(res)
    errors = len(res) - len(ok) + (doc["requests_expected"] - sent_or_failed)
    # Follow-up turns whose prefill held less than the previous turn's prompt (less one
    # page): the conversation's prefix was not where the turn ran (moved, or evicted).
    prev, lost, follow = {}, 0, 0
    for r in sorted(ok, key=lambda r: (r["conv"], r["turn"])):
        u = r["usage"] or {}
        if r["turn"] > 0 and r["conv"] in prev:
            follow += 1
            cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            if cached < prev[r["conv"]] - 16:
                lost += 1
        prev[r["conv"]] = u.get("prompt_tokens", 0)
    sp = doc.get("spills")
    s = {
        "spills": "—" if not sp else f"{sp.get('prefill', 0)} / {sp.get('decode', 0)}",
        "lost_turns": lost,
        "follow_turns": follow,
        "ok": len(ok),
        "errors": errors,
        "error_examples": sorted({r["error"] for r in res if r["error"]})[:3],
        "prefill_hit": ratio(stats["prefill"], "prefill_prefix_requested_tokens",
                             "prefill_prefix_cached_tokens"),
        "decode_hit": ratio(stats["decode"], "decode_prefix_requested_tokens",
                            "decode_prefix_cached_tokens"),
        "client_hit": usage_cached / usage_prompt if usage_prompt else None,
        "p50": quantile(ttfts, 0.5),
        "p99": quantile(ttfts, 0.99),
        "violations": sum(e["contract_violations"] for e in every),
        "engine_failed": sum(e["failed"] + e["aborted"] for e in every),
        "prefill_requests": [e["requests_per_rank"] for e in stats["prefill"]],
        "decode_requests": [e["requests_per_rank"] for e in stats["decode"]],
        "decode_peak_running": [e["peak_running_per_rank"] for e in stats["decode"]],
    }
    # Sampled per-rank load (running + waiting on the engine), per pool.
    np_ = len(stats["prefill"])
    for pool, sl in (("prefill", slice(0, np_)), ("decode", slice(np_, None))):
        peak_rank, peak_total, worst = None, 0, 0.0
        for row in doc["samples"]:
            ranks = row[sl]
            if any(r is None for r in ranks):
                continue
            flat = [x for r in ranks for x in r]
            if peak_rank is None:
                peak_rank = [0] * len(flat)
            peak_rank = [max(a, b) for a, b in zip(peak_rank, flat)]
            peak_total = max(peak_total, sum(flat))
        s[pool + "_sampled_peak"] = peak_rank
        s[pool + "_sampled_peak_total"] = peak_total
        n = len(peak_rank or [])
        s[pool + "_bound_at_peak"] = bound(peak_total, n) if n else None
    return s


def report(out_dir):
    docs = {}
    for f in sorted(os.listdir(out_dir)):
        if f.endswith(".json"):
            with open(os.path.join(out_dir, f)) as fh:
                d = json.load(fh)
            docs[d["name"]] = d
    rows = [
        ("cache_aware", "pdgate `--policy cache_aware`"),
        ("round_robin", "pdgate `--policy round_robin`"),
        ("cache_aware_3", "pdgate `cache_aware`, 3 replicas sharing nothing (requests round-robin over them)"),
        ("cache_aware_pinned", "pdgate `cache_aware --contract-mode pinned`, engines that query the prefill rank"),
        ("cache_aware_c2", "pdgate `cache_aware`, balance factor 2 (not the default 1.25)"),
        ("ideal_conversation", "ideal, per conversation (conversation i on prefill rank i mod 8, decode rank i mod 4)"),
        ("ideal_sysprompt", "**ideal rank-affine placement** (per system prompt: 2 prefill ranks and 1 decode rank each)"),
    ]
    print("| router | prefill cache hit | decode cache hit | TTFT p50 / p99 | errors | violations |")
    print("|---|---|---|---|---|---|")
    sums = {}
    for key, label in rows:
        if key not in docs:
            continue
        s = summarise(docs[key])
        sums[key] = s
        print(f"| {label} | {pct(s['prefill_hit'])} | {pct(s['decode_hit'])} | "
              f"{s['p50']:.0f} / {s['p99']:.0f} ms | {s['errors']} | {s['violations']} |")
    # The ideal: each conversation on one prefill rank and one decode rank
    # (per conversation); the per-system-prompt placement is the stronger reference.
    for ideal_key, what in (("ideal_conversation", "the ideal per conversation (the issue's: each conversation on one prefill rank and one decode rank)"),
                            ("ideal_sysprompt", "the ideal per system prompt (stronger: it also groups conversations that share a system prompt)")):
        ideal = sums.get(ideal_key)
        if not ideal:
            continue
        print()
        print(f"Against {what} (target: hit within 2 points, TTFT p50 within 1.15×):")
        print()
        print("| router | prefill hit − ideal | decode hit − ideal | TTFT p50 ÷ ideal |")
        print("|---|---|---|---|")
        for key, label in rows:
            s = sums.get(key)
            if not s or key.startswith("ideal") or key == "hot":
                continue
            dp = 100 * (s["prefill_hit"] - ideal["prefill_hit"])
            dd = 100 * (s["decode_hit"] - ideal["decode_hit"])
            print(f"| {key} | {dp:+.1f} pt | {dd:+.1f} pt | {s['p50'] / ideal['p50']:.2f}× |")
    print()
    print("Per rank (global rank = worker × DP + rank): requests; the client's view of the "
          "prefill hit (`usage.prompt_tokens_details.cached_tokens`); follow-up turns whose "
          "prefill held less than the previous turn's prompt (less one page), i.e. ran where "
          "their conversation's prefix was not (moved, or evicted):")
    print()
    print("| run | prefill requests per rank | decode requests per rank | client-reported hit | follow-up turns that missed their prefix on the prefill | spills (pdgate's count, prefill / decode) | engine failed+aborted |")
    print("|---|---|---|---|---|---|---|")
    for key, _ in rows:
        s = sums.get(key)
        if not s:
            continue
        pr = " ".join(str(x) for r in s["prefill_requests"] for x in r)
        dr = " ".join(str(x) for r in s["decode_requests"] for x in r)
        print(f"| {key} | {pr} | {dr} | {pct(s['client_hit'])} | {s['lost_turns']} of {s['follow_turns']} | {s['spills']} | {s['engine_failed']} |")
    if "hot" in docs:
        s = summarise(docs["hot"])
        d = docs["hot"]
        hot = [r for r in d["results"] if r.get("hot") and r["error"] is None]
        cold = [r for r in d["results"] if not r.get("hot") and r["error"] is None]
        print()
        print(f"Hot key: `cache_aware`, conversations 0, 2, 4, … (50 of 100) send "
              f"`{HOT_HEADER}: hot`, the rest no key. Prefill hit {pct(s['prefill_hit'])}, "
              f"decode hit {pct(s['decode_hit'])}, TTFT p50 / p99 {s['p50']:.0f} / "
              f"{s['p99']:.0f} ms (hot {quantile([1000 * r['ttft'] for r in hot], 0.5):.0f} ms, "
              f"others {quantile([1000 * r['ttft'] for r in cold], 0.5):.0f} ms), errors "
              f"{s['errors']}, violations {s['violations']}, spills (prefill / decode) "
              f"{s['spills']}.")
        print()
        print("| pool | requests per rank | peak present per rank (sampled every 50 ms) | peak total present | bound at that total, ceil(1.25 × (total + 1) / n) + 1 (a rank holds at most one more) | decode peak running per rank (engine) |")
        print("|---|---|---|---|---|---|")
        for pool in ("prefill", "decode"):
            req = " ".join(str(x) for r in s[pool + "_requests"] for x in r)
            peak = " ".join(str(x) for x in (s[pool + "_sampled_peak"] or []))
            pr = ("—" if pool == "prefill" else
                  " ".join(str(x) for r in s["decode_peak_running"] for x in r))
            n = len(s[pool + "_sampled_peak"] or [])
            print(f"| {pool} ({n} ranks) | {req} | {peak} | {s[pool + '_sampled_peak_total']} | "
                  f"{s[pool + '_bound_at_peak']} | {pr} |")


def wait_ready(port, want_p, want_d, timeout=60.0):
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        try:
            v = get_json(f"http://127.0.0.1:{port}", "/readiness", timeout=2.0)
            last = v
            if (v.get("ready") and v.get("routable_prefill_ranks") == want_p
                    and v.get("routable_decode_ranks") == want_d):
                return 0
        except Exception as e:  # noqa: BLE001
            last = str(e)
        time.sleep(0.2)
    print(f"router on {port} not ready: {last}", file=sys.stderr)
    return 1


def main(argv):
    cmd = argv[1]
    if cmd == "ready":
        return wait_ready(int(argv[2]), int(argv[3]), int(argv[4]))
    if cmd == "report":
        report(argv[2])
        return 0
    if cmd == "trace":
        systems, convs = make_trace()
        print(json.dumps({"systems": systems, "conversations": convs}))
        return 0
    if cmd == "run":
        name, out = argv[2], argv[3]
        prefills, decodes, rest = parse_engines(argv[4:])
        if "--ideal" in rest:
            how = rest[rest.index("--ideal") + 1]
            target = Ideal(how, prefills, decodes, make_trace()[1])
            extra = {"ideal": how}
        else:
            ports = [int(p) for p in rest[rest.index("--routers") + 1].split(",")]
            target = Routers(ports, "--hot" in rest)
            extra = {"routers": len(ports), "hot": "--hot" in rest}
        run(name, out, target, prefills, decodes, extra)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
