"""Instructions per request and per streamed token from run.sh's callgrind files.

    count.py DIR TAG            totals: per request (256 and 4 tokens), per token
    count.py DIR TAG BASE_TAG   the same for both, and the differences by function: per
                                token, per 4-token stream, per non-streamed request

Per request = (total of 120 requests - total of 20) / 100, so start-up and shut-down cancel
out; per token = (per request at 256 tokens - at 4) / 252. quanta's clock calibration (a
start-up loop bounded by time, whose length varies from run to run) is left out, with the
clock reads it makes."""
import glob
import re
import subprocess
import sys


def load(path):
    out = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", path],
                         capture_output=True, text=True).stdout
    lines = out.splitlines()
    start = next((i for i, l in enumerate(lines) if "file:function" in l), 0)
    end = next((i for i, l in enumerate(lines) if "Auto-annotated source" in l), len(lines))
    per_fn, total = {}, 0
    for l in lines[:start] + lines[start:end]:
        m = re.match(r"\s*([\d,]+) \([^)]*\)\s+(\S.*)", l)
        if not m:
            continue
        v = int(m.group(1).replace(",", ""))
        if "PROGRAM TOTALS" in l:
            total = v
            continue
        k = re.sub(r"\s*\[.*\]$", "", m.group(2))
        k = re.sub(r"^.*?:(?=[<a-zA-Z_])", "", k, count=1)
        if "calibrate" in k:
            total -= v
            continue
        per_fn[k] = per_fn.get(k, 0) + v
    # quanta's calibration: a loop bounded by time, not count, so its length (and the clock
    # reads it makes) varies with the run's speed. Its own cost left the total above; the
    # clock reads it made leave the total and the clock's row here.
    tree = subprocess.run(["callgrind_annotate", "--tree=caller", "--inclusive=yes",
                           "--threshold=100", path], stdout=subprocess.PIPE, text=True,
                          stderr=subprocess.DEVNULL).stdout
    clock_from_calib, callers = 0, []
    for l in tree.splitlines():
        m = re.match(r"\s*([\d,]+) \([^)]*\)\s+([<*])\s+(.*)", l)
        if not m:
            callers = []
            continue
        v, kind, what = int(m.group(1).replace(",", "")), m.group(2), m.group(3)
        if kind == "<":
            callers.append((v, what))
            continue
        if "clock_gettime" in what:
            clock_from_calib += sum(c for c, w in callers if "quanta::Calibration::calibrate" in w)
        callers = []
    total -= clock_from_calib
    for k in list(per_fn):
        if "clock_gettime" in k:
            per_fn[k] -= clock_from_calib
    return per_fn, total


def run(d, tag):
    f = lambda t: load(glob.glob(f"{d}/cg-{t}.*.out")[0])
    (l20, tl20), (l120, tl120) = f(tag + "-256-20"), f(tag + "-256-120")
    (s20, ts20), (s120, ts120) = f(tag + "-4-20"), f(tag + "-4-120")
    long_req, short_req = (tl120 - tl20) / 100, (ts120 - ts20) / 100
    fns, short_fns, gen_fns = {}, {}, {}
    for k in set(l120) | set(s120):
        lr = (l120.get(k, 0) - l20.get(k, 0)) / 100
        sr = (s120.get(k, 0) - s20.get(k, 0)) / 100
        fns[k] = (lr - sr) / 252
        short_fns[k] = sr
    gen_req = None
    if glob.glob(f"{d}/cg-{tag}-generate-20.*.out"):
        (g20, tg20), (g120, tg120) = f(tag + "-generate-20"), f(tag + "-generate-120")
        gen_req = (tg120 - tg20) / 100
        gen_fns = {k: (g120.get(k, 0) - g20.get(k, 0)) / 100 for k in set(g20) | set(g120)}
    return long_req, short_req, (long_req - short_req) / 252, fns, gen_req, short_fns, gen_fns


d = sys.argv[1]
tags = sys.argv[2:]
results = {t: run(d, t) for t in tags}
print("| binary | stream, 256 tokens | stream, 4 tokens | per token | `/generate`, not streamed |")
print("|---|---|---|---|---|")
for t, (l, s, p, _, g, _, _) in results.items():
    gen = "-" if g is None else f"{g / 1000:.1f} k"
    print(f"| {t} | {l / 1000:.1f} k | {s / 1000:.1f} k | {p:.0f} | {gen} |")


def diff(title, i, top=20, tail=12):
    a, b = results[tags[0]][i], results[tags[1]][i]
    if not a or not b:
        return
    rows = sorted(((a.get(k, 0) - b.get(k, 0), k) for k in set(a) | set(b)), reverse=True)
    print(f"\n{title}, {tags[0]} - {tags[1]}, by function (self cost; inlining moves costs between rows):")
    for v, k in rows[:top] + [(0, "...")] + rows[-tail:]:
        print(f"{v:8.1f}  {k[:140]}")


if len(tags) == 2:
    diff("per token", 3)
    diff("per 4-token stream", 5)
    diff("per non-streamed /generate", 6)
