#!/bin/bash
# Cache affinity per DP rank on a multi-turn chat trace (issue 35; BENCHMARKS.md, "Cache
# affinity per DP rank").
#
#   benches/multiturn/run.sh PDGATE_BIN [OUT_DIR]
#
# Each run starts fresh simulated engines (`PDGATE_BIN sim`: 2 prefills of DP 4, 2 decodes
# of DP 2, one LRU prefix cache per DP rank) and, but for the ideal, pdgate in front of
# them, then drive.py plays the same seeded trace (100 conversations, 494 streamed chat
# requests; see drive.py) and reads the engines' /sim/stats. Runs: cache_aware,
# round_robin, cache_aware on 3 replicas, cache_aware with the pinned contract on engines
# that do not follow the room, the hot key, two ideal placements where drive.py is the
# router, and (a diagnostic) cache_aware with a looser load bound. Prints the Markdown
# tables (drive.py report); OUT_DIR keeps every run's JSON and logs (default: a new
# temporary directory). ONLY=name,name reruns only those runs, keeping the others' JSON.
set -euo pipefail
bin=$1
out=${2:-$(mktemp -d /tmp/multiturn.XXXXXX)}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
[ -n "${ONLY:-}" ] || rm -f "$out"/*.json
# Fixed engine ports: cache_aware's ring is a function of the engines' URLs, so every run
# places the trace's keys on the same ranks (BASE_PORT..BASE_PORT+5 must be free).
BASE_PORT=${BASE_PORT:-31700}
SIM_FLAGS=(--prefill 2 --decode 2 --prefill-dp 4 --decode-dp 2
    --prefix-cache-page-size 16
    --prefill-prefix-cache-tokens 6000 --decode-prefix-cache-tokens 12000
    --prefill-per-token-ms 0.8 --decode-per-missing-token-ms 0.2
    --enable-cache-report)

simpid="" routers=()
cleanup() {
    for r in "${routers[@]}"; do kill -INT "$r" 2>/dev/null || true; done
    for r in "${routers[@]}"; do wait "$r" 2>/dev/null || true; done
    routers=()
    if [ -n "$simpid" ]; then kill "$simpid" 2>/dev/null || true; wait "$simpid" 2>/dev/null || true; fi
    simpid=""
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# start_sim NAME [EXTRA SIM FLAGS...]: sets ENGINES (drive.py's engine arguments) and
# SERVE (pdgate serve's --prefill/--decode arguments).
start_sim() {
    local name=$1; shift
    local log="$out/sim-$name.log"
    : > "$log"
    "$bin" sim "${SIM_FLAGS[@]}" --base-port "$BASE_PORT" "$@" >> "$log" 2>&1 &
    simpid=$!
    for _ in $(seq 1 100); do
        [ "$(grep -c '^READY decode' "$log")" = 2 ] && break
        sleep 0.1
    done
    [ "$(grep -c '^READY decode' "$log")" = 2 ] || { echo "$name: the simulator did not start" >&2; cat "$log" >&2; exit 1; }
    ENGINES=() SERVE=()
    while read -r _ role url rest; do
        local dp=${rest##*dp=}
        if [ "$role" = prefill ]; then
            local bp=${rest#bootstrap_port=}; bp=${bp%% *}
            ENGINES+=(--prefill "$url" "$bp" "$dp"); SERVE+=(--prefill "$url" "$bp")
        else
            ENGINES+=(--decode "$url" "$dp"); SERVE+=(--decode "$url")
        fi
    done < <(grep '^READY' "$log")
}

# start_routers NAME COUNT [EXTRA SERVE FLAGS...]: sets PORTS (comma separated).
start_routers() {
    local name=$1 count=$2; shift 2
    local ports=()
    for i in $(seq 1 "$count"); do
        local port; port=$(free_port)
        "$bin" serve --host 127.0.0.1 --port "$port" --admin-port 0 --public-metrics --log-level warn \
            "${SERVE[@]}" "$@" > "$out/router-$name-$i.log" 2>&1 &
        routers+=($!)
        ports+=("$port")
    done
    for p in "${ports[@]}"; do python3 "$here/drive.py" ready "$p" 8 4; done
    PORTS=$(IFS=,; echo "${ports[*]}")
}

# one NAME ROUTERS "SERVE FLAGS" "SIM FLAGS" [DRIVE FLAGS...]
one() {
    local name=$1 count=$2 serve=$3 sim=$4; shift 4
    if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$name,"* ]]; then return; fi
    # shellcheck disable=SC2086 # the flag strings are word lists
    start_sim "$name" $sim
    if [ "$count" -gt 0 ]; then
        # shellcheck disable=SC2086
        start_routers "$name" "$count" $serve
        python3 "$here/drive.py" run "$name" "$out/$name.json" "${ENGINES[@]}" --routers "$PORTS" "$@"
    else
        python3 "$here/drive.py" run "$name" "$out/$name.json" "${ENGINES[@]}" "$@"
    fi
    cleanup
}

one cache_aware 1 "--policy cache_aware" ""
one round_robin 1 "--policy round_robin" ""
one cache_aware_3 3 "--policy cache_aware" ""
one ideal_sysprompt 0 "" "" --ideal sysprompt
one ideal_conversation 0 "" "" --ideal conversation
one hot 1 "--policy cache_aware" "" --hot
one cache_aware_pinned 1 "--policy cache_aware --contract-mode pinned" "--load-balance-method round_robin"
# Not a target: how much of cache_aware's gap is the load bound (c = 2 instead of 1.25).
one cache_aware_c2 1 "--policy cache_aware --prefix-hash-load-factor 2" ""

echo "results: $out" >&2
python3 "$here/drive.py" report "$out"
