"""Many replicas, one admission (issue 36): the burst, the engine sampler and the report.
Python 3 standard library only (threads and http.client); run.sh starts the engines and
routers.

    drive.py run NAME OUT.json --router KIND --settings TEXT --routers PORT[,PORT...] ENGINES...
    drive.py ready PORT PREFILL_RANKS DECODE_RANKS   (waits for a pdgate's /readiness)
    drive.py ready-smg PORT                          (waits for an smg's /readiness)
    drive.py report OUT_DIR                          (prints the Markdown tables)

ENGINES are `--prefill URL BOOTSTRAP_PORT DP` and `--decode URL DP CAP` (repeated; CAP the
decode's --max-running-requests per DP rank), from the simulator's READY lines.

The burst: BURST streamed `/v1/chat/completions` (no `max_tokens`: the engine's default
length), each on its own connection from its own thread; every thread connects first, then
all send at once (a barrier), request i to router i mod R (round robin over the replicas).
Every request has a timeout (REQUEST_TIMEOUT from its send to its last byte: a watchdog
closes its connection, which an SSE keep-alive would otherwise keep open) and the run a
deadline, so a run is bounded.

Figures per run:
- ok / errors: a request is ok when its status is 200 and the stream ends with `[DONE]`
  and no error event; errors are grouped by status and error type (the error body's
  `type`/`code`/`message`, digits elided).
- wall: from the first send to the last byte of the last request.
- the engines, sampled every SAMPLE_EVERY s from before the first send until every request
  ended: each decode's `/v1/loads` per DP rank (`num_waiting_reqs`, which is the
  pre-allocation queue plus the transfer queue, whose requests already hold a slot;
  `disaggregation.decode_prealloc_queue_reqs`, the requests waiting for a slot;
  `num_running_reqs`). "Queued at the engine" is the peak over samples of the waiting
  requests summed over all decode ranks (and of the pre-allocation queues); "peak waiting
  per rank" is each rank's peak over samples (the table shows the largest). Per run also:
  the mean running requests over the burst (how much of the capacity was kept busy) and
  when each router's last request ended. Sampling can miss a short peak; `/sim/stats` after the run gives the exact
  `peak_held` per decode engine (queued + running, all its ranks: above its capacity means
  requests queued there) and `failed` per engine (a prefill's `failed` counts the rooms
  whose KV was not claimed within its bootstrap timeout).
"""
import http.client
import json
import os
import re
import socket
import statistics
import sys
import threading
import time
import urllib.request

BURST = 128
REQUEST_TIMEOUT = 120.0  # s, per request: from its send to its last byte
RUN_DEADLINE = REQUEST_TIMEOUT + 30.0  # s: the burst's threads are not waited for longer
SAMPLE_EVERY = 0.05  # s between load samples of the decodes
PROMPT = "Tell me a story about routers and queues, in one paragraph please."


# ---------------------------------------------------------------- HTTP


def get_json(url, path, timeout=5.0):
    with urllib.request.urlopen(url.rstrip("/") + path, timeout=timeout) as r:
        return json.loads(r.read())


def error_kind(status, body):
    """A short, groupable name for an error answer: status plus the body's error type or
    code or message (digits and ids elided)."""
    text = body if isinstance(body, str) else body.decode("utf-8", "replace")
    kind = text.strip()
    try:
        v = json.loads(text)
        e = v.get("error", v) if isinstance(v, dict) else v
        if isinstance(e, dict):
            parts = [str(e[k]) for k in ("type", "code") if e.get(k) not in (None, "")]
            msg = str(e.get("message") or "")
            kind = " ".join(parts) + (": " if parts and msg else "") + msg
        elif isinstance(e, str):
            kind = e
    except (ValueError, AttributeError):
        pass
    # SGLang's KV failures name the request and room: keep the failure and its reason.
    m = re.search(r"(Decode \w+ failed) for request .*?KVTransferError\(.*?\): (.*)", kind)
    if m:
        kind = f"{kind[:m.start()]}{m.group(1)}: {m.group(2)}"
    kind = re.sub(r"[0-9a-f]{8,}|\d+(\.\d+)?", "N", kind)
    kind = kind[:110]
    return f"{status} {kind}" if status is not None else kind


def one_request(i, port, barrier, rec):
    """One streamed chat completion to 127.0.0.1:port; fills rec."""
    body = json.dumps({
        "model": "sim-model",
        "messages": [{"role": "user", "content": f"{PROMPT} ({i})"}],
        "stream": True,
    })
    headers = {"content-type": "application/json"}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT)
    rec.update({"i": i, "port": port, "status": None, "error": None, "chunks": 0,
                "t_send": None, "t_first": None, "t_end": None, "done": False})
    try:
        conn.connect()
    except Exception as e:  # noqa: BLE001 - any failure is one error of the run
        rec["error"] = f"connect: {type(e).__name__}"
    try:
        barrier.wait(30)
    except threading.BrokenBarrierError:
        pass
    if rec["error"] is not None:
        rec["t_send"] = rec["t_end"] = time.monotonic()
        return
    expired = threading.Event()

    def expire():
        expired.set()
        try:
            if conn.sock is not None:
                conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    watchdog = threading.Timer(REQUEST_TIMEOUT, expire)
    watchdog.daemon = True
    try:
        rec["t_send"] = time.monotonic()
        watchdog.start()
        conn.request("POST", "/v1/chat/completions", body, headers)
        r = conn.getresponse()
        rec["status"] = r.status
        if r.status != 200:
            b = r.read()
            rec["t_first"] = rec["t_end"] = time.monotonic()
            rec["error"] = error_kind(r.status, b)
            rec["body"] = b[:300].decode("utf-8", "replace")
            return
        for _ in range(100000):  # bounded: a 100-token answer is ~100 events
            line = r.readline()
            if not line:
                break
            if rec["t_first"] is None:
                rec["t_first"] = time.monotonic()
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                rec["done"] = True
                break
            try:
                ev = json.loads(data)
            except ValueError:
                rec["error"] = "stream: bad JSON event"
                break
            if isinstance(ev, dict) and ev.get("error"):
                rec["error"] = "stream " + error_kind(None, json.dumps(ev))
                rec["body"] = data[:300].decode("utf-8", "replace")
                break
            if isinstance(ev, dict) and ev.get("choices"):
                rec["chunks"] += 1
        rec["t_end"] = time.monotonic()
        if not rec["done"] and rec["error"] is None:
            rec["error"] = "stream ended without [DONE]"
    except Exception as e:  # noqa: BLE001 - any failure is one error of the run
        rec["t_end"] = time.monotonic()
        rec["error"] = f"{type(e).__name__}"
        rec["body"] = str(e)[:300]
    finally:
        watchdog.cancel()
        conn.close()
    if expired.is_set() and not rec["done"]:
        rec["error"] = f"client timeout ({REQUEST_TIMEOUT:.0f} s)"


def sample_loads(decodes, stop, samples):
    """Every SAMPLE_EVERY s: each decode's per-rank (waiting, prealloc, running). Bounded by
    the stop event and the run deadline."""
    end = time.monotonic() + RUN_DEADLINE + REQUEST_TIMEOUT + 60
    while not stop.is_set() and time.monotonic() < end:
        row = {"t": time.monotonic(), "decodes": []}
        for d in decodes:
            try:
                v = get_json(d["url"], "/v1/loads", timeout=2.0)
                ranks = []
                for ld in sorted(v["loads"], key=lambda x: x["dp_rank"]):
                    dis = ld.get("disaggregation") or {}
                    ranks.append([ld.get("num_waiting_reqs", 0),
                                  dis.get("decode_prealloc_queue_reqs", 0),
                                  ld.get("num_running_reqs", 0)])
                row["decodes"].append(ranks)
            except Exception:  # noqa: BLE001 - a missed sample is only a missed sample
                row["decodes"].append(None)
        samples.append(row)
        stop.wait(SAMPLE_EVERY)


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
            decodes.append({"url": args[i + 1], "dp": int(args[i + 2]), "cap": int(args[i + 3])})
            i += 4
        else:
            rest.append(a)
            i += 1
    return prefills, decodes, rest


def opt(rest, name, default=None):
    if name in rest:
        return rest[rest.index(name) + 1]
    return default


def run(name, out_path, args):
    prefills, decodes, rest = parse_engines(args)
    ports = [int(p) for p in opt(rest, "--routers").split(",")]
    kind = opt(rest, "--router", "pdgate")
    settings = opt(rest, "--settings", "")
    readiness = []
    if kind == "pdgate":
        for p in ports:
            try:
                readiness.append(get_json(f"http://127.0.0.1:{p}", "/readiness"))
            except Exception as e:  # noqa: BLE001 - only recorded
                readiness.append(str(e))
    recs = [{} for _ in range(BURST)]
    barrier = threading.Barrier(BURST + 1)
    threads = [threading.Thread(target=one_request, args=(i, ports[i % len(ports)], barrier, recs[i]),
                                daemon=True) for i in range(BURST)]
    for t in threads:
        t.start()
    stop = threading.Event()
    samples = []
    sampler = threading.Thread(target=sample_loads, args=(decodes, stop, samples), daemon=True)
    sampler.start()
    try:
        barrier.wait(60)
    except threading.BrokenBarrierError:
        print(f"{name}: not every client connected in time", file=sys.stderr)
    start = time.monotonic()
    for t in threads:
        t.join(max(0.1, RUN_DEADLINE - (time.monotonic() - start)))
    stop.set()
    sampler.join(10)
    for r in recs:
        if not r.get("t_end") and r.get("error") is None:
            r["error"] = "run deadline"
    # Quiet engines before reading the counters (bounded).
    engines = prefills + decodes
    for _ in range(150):
        try:
            if all(get_json(e["url"], "/sim/stats")["held_now"] == 0 for e in engines):
                break
        except Exception:  # noqa: BLE001
            pass
        time.sleep(0.1)
    stats = {"prefill": [get_json(e["url"], "/sim/stats") for e in prefills],
             "decode": [get_json(e["url"], "/sim/stats") for e in decodes]}
    doc = {"name": name, "router": kind, "replicas": len(ports), "settings": settings,
           "burst": BURST, "results": recs, "samples": samples, "stats": stats,
           "prefills": prefills, "decodes": decodes, "readiness": readiness,
           "t0": start}
    with open(out_path, "w") as f:
        json.dump(doc, f)
    s = summarise(doc)
    print(f"{name}: {s['ok']}/{BURST} ok, errors {s['errors']}, wall {s['wall']:.2f} s, "
          f"queued at engine {s['queued']}, peak waiting per rank {s['peak_rank']} "
          f"(prealloc {s['peak_prealloc_rank']}), decode peak_held {s['peak_held']}, "
          f"failed p/d {s['failed_p']}/{s['failed_d']}", file=sys.stderr)


# ---------------------------------------------------------------- the report


def summarise(doc):
    recs = doc["results"]
    ok = [r for r in recs if r.get("error") is None]
    errors = {}
    for r in recs:
        if r.get("error") is not None:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    sends = [r["t_send"] for r in recs if r.get("t_send")]
    ends = [r["t_end"] for r in recs if r.get("t_end")]
    wall = (max(ends) - min(sends)) if sends and ends else float("nan")
    ranks = sum(d["dp"] for d in doc["decodes"])
    peak_wait = [0] * ranks
    peak_pre = [0] * ranks
    queued, queued_pre = 0, 0
    for row in doc["samples"]:
        k, tot, tot_pre = 0, 0, 0
        for d, ranks_of in zip(doc["decodes"], row["decodes"]):
            if ranks_of is None:
                k += d["dp"]
                continue
            for w, p, _run in ranks_of:
                peak_wait[k] = max(peak_wait[k], w)
                peak_pre[k] = max(peak_pre[k], p)
                tot += w
                tot_pre += p
                k += 1
        queued = max(queued, tot)
        queued_pre = max(queued_pre, tot_pre)
    # Mean running requests over the decode ranks while the burst lasted (first send to
    # last byte): how much of the capacity the router kept busy.
    t0 = min(sends) if sends else 0.0
    busy = [sum(r[2] for dec in row["decodes"] if dec for r in dec)
            for row in doc["samples"] if sends and ends and t0 <= row["t"] <= max(ends)]
    last = {}
    for r in recs:
        if r.get("t_end") and sends:
            last[r["port"]] = max(last.get(r["port"], 0.0), r["t_end"] - t0)
    order = []
    for r in sorted(recs, key=lambda r: r.get("i", 0)):
        if r.get("port") not in order:
            order.append(r.get("port"))
    st = doc["stats"]
    return {
        "last_per_router": [last.get(p, float("nan")) for p in order],
        "busy": sum(busy) / len(busy) if busy else float("nan"),
        "slots": [d["dp"] * d["cap"] for d in doc["decodes"]],
        "ok": len(ok), "errors": errors, "wall": wall, "queued": queued,
        "queued_prealloc": queued_pre,
        "peak_wait": peak_wait, "peak_rank": max(peak_wait) if peak_wait else 0,
        "peak_prealloc": peak_pre, "peak_prealloc_rank": max(peak_pre) if peak_pre else 0,
        "peak_held": [s.get("peak_held") for s in st["decode"]],
        "cap": [d["dp"] * d["cap"] for d in doc["decodes"]],
        "peak_running_per_rank": [s.get("peak_running_per_rank") for s in st["decode"]],
        "failed_p": sum(s["failed"] for s in st["prefill"]),
        "failed_d": sum(s["failed"] for s in st["decode"]),
        "samples": len(doc["samples"]),
    }


def fmt_range(xs, unit="", digits=1):
    xs = sorted(xs)
    med = statistics.median(xs)
    if len(xs) == 1:
        return f"{med:.{digits}f}{unit}"
    return f"{med:.{digits}f}{unit} ({xs[0]:.{digits}f}–{xs[-1]:.{digits}f})"


def fmt_int_range(xs):
    xs = sorted(xs)
    med = statistics.median(xs)
    med_s = f"{med:g}"
    if len(xs) == 1 or xs[0] == xs[-1]:
        return med_s
    return f"{med_s} ({xs[0]}–{xs[-1]})"


def fmt_errors(sums):
    """Errors of the runs of one row: median count (range), then the kinds summed."""
    counts = [sum(s["errors"].values()) for s in sums]
    kinds = {}
    for s in sums:
        for k, n in s["errors"].items():
            kinds[k] = kinds.get(k, 0) + n
    head = fmt_int_range(counts)
    if not kinds:
        return head
    detail = "; ".join(f"{k.replace('|', '/')} ×{n}" for k, n in
                       sorted(kinds.items(), key=lambda kv: -kv[1]))
    runs = f" in {len(sums)} runs" if len(sums) > 1 else ""
    return f"{head}: {detail}{runs}"


def report(out_dir):
    docs = []
    for fn in sorted(os.listdir(out_dir)):
        if fn.endswith(".json"):
            with open(os.path.join(out_dir, fn)) as f:
                docs.append(json.load(f))
    rows = {}
    order = []
    for d in docs:
        key = d["name"].rsplit("-run", 1)[0]
        if key not in rows:
            rows[key] = []
            order.append(key)
        rows[key].append(d)
    order.sort(key=lambda k: (k.startswith("diag"), rows[k][0]["router"] != "pdgate",
                              "count" in k, rows[k][0]["replicas"]))
    base = None
    if "default_1" in rows:
        base = statistics.median(summarise(d)["wall"] for d in rows["default_1"])
    print(f"Burst of {docs[0]['burst'] if docs else BURST} streamed requests; median "
          "of the runs (range) where a row has several; errors = requests not answered "
          "in full (kinds summed over the row's runs).\n")
    print("| router | replicas | settings | runs | errors | queued at the engine (peak of the "
          "sum over decode ranks): waiting / of which pre-alloc | peak waiting per decode rank "
          "(largest rank): waiting / of which pre-alloc | decode peak held per engine / "
          "capacity (exact) | wall time | wall ÷ R=1 default |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for k in order:
        ds = rows[k]
        sums = [summarise(d) for d in ds]
        walls = [s["wall"] for s in sums]
        cap = sums[0]["cap"][0] if sums[0]["cap"] else 0
        held = fmt_int_range([max(s["peak_held"]) for s in sums])
        ratio = (fmt_range([w / base for w in walls], "×", 2) if base else "—")
        print(f"| {ds[0]['router']} | {ds[0]['replicas']} | {ds[0]['settings']} | {len(ds)} | "
              f"{fmt_errors(sums)} | {fmt_int_range([s['queued'] for s in sums])} / "
              f"{fmt_int_range([s['queued_prealloc'] for s in sums])} | "
              f"{fmt_int_range([s['peak_rank'] for s in sums])} / "
              f"{fmt_int_range([s['peak_prealloc_rank'] for s in sums])} | "
              f"{held} / {cap} | {fmt_range(walls, ' s')} | {ratio} |")
    print()
    print("| run | ok | errors | wall | last byte per replica (s, in router order) | decode "
          "slots running, mean over the burst | queued (sampled) | peak waiting per rank | peak "
          "pre-alloc per rank | decode peak held | decode peak running per rank | failed at "
          "prefills / decodes | samples |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for k in order:
        for d in rows[k]:
            s = summarise(d)
            print(f"| {d['name']} | {s['ok']} | {sum(s['errors'].values())} | {s['wall']:.2f} s "
                  f"| {' '.join(f'{x:.1f}' for x in s['last_per_router'])} "
                  f"| {s['busy']:.1f} of {sum(s['slots'])} | {s['queued']} | {' '.join(map(str, s['peak_wait']))} | "
                  f"{' '.join(map(str, s['peak_prealloc']))} | "
                  f"{' '.join(map(str, s['peak_held']))} | "
                  f"{' / '.join(' '.join(map(str, p or [])) for p in s['peak_running_per_rank'])} | "
                  f"{s['failed_p']} / {s['failed_d']} | {s['samples']} |")


# ---------------------------------------------------------------- readiness


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


def wait_ready_smg(port, timeout=90.0):
    """smg: `/readiness` answers 200 once it has healthy workers (bounded)."""
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readiness", timeout=2.0) as r:
                if r.status == 200:
                    return 0
                last = r.status
        except Exception as e:  # noqa: BLE001
            last = str(e)
        time.sleep(0.3)
    print(f"smg on {port} not ready: {last}", file=sys.stderr)
    return 1


def main(argv):
    cmd = argv[1] if len(argv) > 1 else ""
    if cmd == "ready":
        return wait_ready(int(argv[2]), int(argv[3]), int(argv[4]))
    if cmd == "ready-smg":
        return wait_ready_smg(int(argv[2]))
    if cmd == "run":
        run(argv[2], argv[3], argv[4:])
        return 0
    if cmd == "report":
        report(argv[2])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
