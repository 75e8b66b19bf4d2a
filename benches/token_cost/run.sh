#!/bin/bash
# Instructions per streamed token, counted by callgrind (BENCHMARKS.md §8).
#
#   benches/token_cost/run.sh OUT_DIR TAG PDGATE_BIN [SIM_BIN]
#
# Runs `pdgate serve` (PDGATE_BIN) under callgrind (children traced: `serve` re-executes
# itself to set its allocator) in front of `pdgate sim` (SIM_BIN, default PDGATE_BIN; one
# prefill, one decode, no delays) six times: 20 and 120 streamed chat requests, of 256
# and of 4 tokens, and 20 and 120 non-streamed `/generate` requests of 4 tokens. `count.py OUT_DIR TAG [OTHER_TAG]` then prints
# instructions per request and per token. ITL=N gives the simulator N ms between tokens:
# with 0 (the default) a read holds many events; with 4, about one (each is its own read
# and write, as at low load). ROUTER_ARGS are added to `serve` (default:
# `--health-check-interval-secs 60`: background work accrues with the run's wall time, not
# with its requests, so at the default 0.5 s it leaks into the per-request figures and
# differs between binaries and runs).
set -euo pipefail
out=$1 tag=$2 bin=$3 sim=${4:-$3}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
one() { # tokens requests [mode]
    local t=$1 n=$2 mode=${3:-chat} name="$tag-$1-$2"
    [ "$mode" = chat ] || name="$tag-$mode-$2"
    rm -f "$out"/cg-"$name".*.out
    "$sim" sim --prefill 1 --decode 1 --host 127.0.0.1 --prefill-ms 0 --ttft-ms 0 \
        --itl-ms "${ITL:-0}" --tokens "$t" > "$out/sim-$name.log" 2>&1 &
    local simpid=$!
    for _ in $(seq 1 50); do grep -q "READY decode" "$out/sim-$name.log" && break; sleep 0.1; done
    local p bp d
    p=$(grep "READY prefill" "$out/sim-$name.log" | awk '{print $3}')
    bp=$(grep "READY prefill" "$out/sim-$name.log" | sed 's/.*bootstrap_port=\([0-9]*\).*/\1/')
    d=$(grep "READY decode" "$out/sim-$name.log" | awk '{print $3}')
    local port=$((20000 + RANDOM % 20000))
    valgrind --tool=callgrind --trace-children=yes --callgrind-out-file="$out/cg-$name.%p.out" \
        "$bin" serve --host 127.0.0.1 --port "$port" --admin-port 0 \
        --prefill "$p" "$bp" --decode "$d" ${ROUTER_ARGS---health-check-interval-secs 60} \
        > "$out/router-$name.log" 2>&1 &
    local router=$!
    for _ in $(seq 1 120); do
        curl -s -o /dev/null -w "%{http_code}" "127.0.0.1:$port/health" 2>/dev/null | grep -q 200 && break
        sleep 0.5
    done
    local ok
    ok=$(python3 "$here/drive.py" "$port" "$n" "$t" "$mode")
    kill -INT "$router"; wait "$router" || true
    kill "$simpid"; wait "$simpid" 2>/dev/null || true
    [ "$ok" = "$n" ] || { echo "$name: only $ok of $n answers whole" >&2; exit 1; }
}
for t in 256 4; do for n in 20 120; do one "$t" "$n"; done; done
for n in 20 120; do one 4 "$n" generate; done
echo "counted: $out (tag $tag)"
