#!/bin/bash
# Many replicas, one admission (issue 36; BENCHMARKS.md, "Issue 36: many replicas, one
# admission").
#
#   benches/replicas/run.sh PDGATE_BIN [OUT_DIR]
#
# Each run starts fresh simulated engines (`PDGATE_BIN sim`: 2 prefills of DP 1 with a
# bootstrap timeout of 4 s, 2 decodes of DP 2 running at most 4 generations per DP rank,
# 16 slots in all, the rest queued in the engine's pre-allocation queue; generations of
# 100 tokens 20 ms apart, 2.0 s) and R routers in front of them (separate processes on
# their own ports, every one listing the same engines), then drive.py sends a burst of 128
# streamed chat completions (8x the slots) at once, round robin over the R routers, and
# samples the decodes' /v1/loads every 50 ms. Runs, in this order:
#   1. pdgate, R = 1, 3, 5, default settings (only the engine list, host and ports);
#   2. pdgate, R = 3 and 5 with the count given (--replicas R --replica-index i);
#   3. smg 1.13 (SMG, default `smg` on the PATH), R = 1 and 3, default settings,
#      skipped with a note when SMG is not executable;
#   4. diagnostics (DIAG=0 skips them): one pdgate with --replicas 1, one with
#      `[capacity] proportional_share = false`.
# pdgate runs REPS times (default 3), smg SMG_REPS times (default 2). Prints the Markdown
# tables (drive.py report); OUT_DIR keeps every run's JSON and logs (default: a new
# temporary directory). ONLY=name,name reruns only those runs (names as in the JSON files,
# without -runK), keeping the others' JSON.
set -euo pipefail
bin=$1
out=${2:-$(mktemp -d /tmp/replicas.XXXXXX)}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
[ -n "${ONLY:-}" ] || rm -f "$out"/*.json
REPS=${REPS:-3}
SMG_REPS=${SMG_REPS:-2}
SMG=${SMG:-$(command -v smg || echo smg)}
# Fixed engine ports (BASE_PORT..BASE_PORT+7 must be free).
BASE_PORT=${BASE_PORT:-31840}
CAP=4 # --max-running-requests: generations per decode DP rank
SIM_FLAGS=(--prefill 2 --decode 2 --prefill-dp 1 --decode-dp 2
    --max-running-requests "$CAP" --bootstrap-timeout-secs 4
    --tokens 100 --itl-ms 20)
# A router that just started has not polled the engines' loads yet; a burst meets routers
# that have been up a while, so the burst starts this long after every router is ready.
SETTLE=${SETTLE:-2}

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

# start_sim NAME: sets ENGINES (drive.py's engine arguments) and SERVE (the routers'
# --prefill/--decode arguments).
start_sim() {
    local name=$1
    local log="$out/sim-$name.log"
    : > "$log"
    "$bin" sim "${SIM_FLAGS[@]}" --base-port "$BASE_PORT" >> "$log" 2>&1 &
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
            ENGINES+=(--decode "$url" "$dp" "$CAP"); SERVE+=(--decode "$url")
        fi
    done < <(grep '^READY' "$log")
}

# start_pdgate NAME COUNT COUNT_GIVEN(0|1) [EXTRA SERVE FLAGS...]: sets PORTS (comma
# separated).
start_pdgate() {
    local name=$1 count=$2 given=$3; shift 3
    local ports=()
    for i in $(seq 1 "$count"); do
        local port extra=()
        port=$(free_port)
        [ "$given" = 1 ] && extra=(--replicas "$count" --replica-index $((i - 1)))
        "$bin" serve --host 127.0.0.1 --port "$port" --admin-port 0 --log-level warn \
            "${SERVE[@]}" "${extra[@]}" "$@" > "$out/router-$name-$i.log" 2>&1 &
        routers+=($!)
        ports+=("$port")
    done
    for p in "${ports[@]}"; do python3 "$here/drive.py" ready "$p" 2 4; done
    PORTS=$(IFS=,; echo "${ports[*]}")
}

# start_smg NAME COUNT: sets PORTS.
start_smg() {
    local name=$1 count=$2
    local ports=()
    for i in $(seq 1 "$count"); do
        local port mport
        port=$(free_port); mport=$(free_port)
        "$SMG" launch --pd-disaggregation "${SERVE[@]}" --host 127.0.0.1 --port "$port" \
            --prometheus-port "$mport" --prometheus-host 127.0.0.1 \
            > "$out/router-$name-$i.log" 2>&1 &
        routers+=($!)
        ports+=("$port")
    done
    for p in "${ports[@]}"; do python3 "$here/drive.py" ready-smg "$p"; done
    PORTS=$(IFS=,; echo "${ports[*]}")
}

# one NAME KIND(pdgate|smg) COUNT COUNT_GIVEN SETTINGS_TEXT REPS [EXTRA SERVE FLAGS...]
one() {
    local name=$1 kind=$2 count=$3 given=$4 settings=$5 reps=$6; shift 6
    if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$name,"* ]]; then return; fi
    rm -f "$out/$name"-run*.json
    for k in $(seq 1 "$reps"); do
        local run="$name-run$k"
        start_sim "$run"
        if [ "$kind" = pdgate ]; then start_pdgate "$run" "$count" "$given" "$@"; else start_smg "$run" "$count"; fi
        sleep "$SETTLE"
        python3 "$here/drive.py" run "$run" "$out/$run.json" "${ENGINES[@]}" --routers "$PORTS" \
            --router "$kind" --settings "$settings"
        cleanup
    done
}

one default_1 pdgate 1 0 "defaults" "$REPS"
one default_3 pdgate 3 0 "defaults" "$REPS"
one default_5 pdgate 5 0 "defaults" "$REPS"
one count_3 pdgate 3 1 "\`--replicas 3 --replica-index i\`" "$REPS"
one count_5 pdgate 5 1 "\`--replicas 5 --replica-index i\`" "$REPS"
if [ -x "$SMG" ]; then
    "$SMG" --version > "$out/smg-version.txt" 2>&1 || true
    one smg_1 smg 1 0 "defaults (\`smg launch --pd-disaggregation\`)" "$SMG_REPS"
    one smg_3 smg 3 0 "defaults (\`smg launch --pd-disaggregation\`)" "$SMG_REPS"
else
    echo "smg: $SMG is not executable; smg runs skipped" >&2
fi
# Diagnostics (not the issue's runs; DIAG=0 skips them): why one replica with defaults
# leaves slots unused. One replica told it is alone (its share is the whole capacity, the
# proportional rule does not apply), and one with the proportional rule off.
if [ "${DIAG:-1}" = 1 ]; then
    one diag_count_1 pdgate 1 1 "diagnostic: \`--replicas 1 --replica-index 0\`" 1
    noprop="$out/no-proportional.toml"
    printf '[capacity]\nproportional_share = false\n' > "$noprop"
    one diag_noprop_1 pdgate 1 0 "diagnostic: \`[capacity] proportional_share = false\`" 1 --config "$noprop"
fi

echo "results: $out" >&2
python3 "$here/drive.py" report "$out"
