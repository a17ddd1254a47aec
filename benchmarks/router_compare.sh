#!/usr/bin/env bash
# The router on the shared-prefix workload, on one machine, same cores and same total KV cache for all:
#   single       one engine replica, all threads, 2*BLOCKS KV blocks, no router
#   prefix-hash  two replicas (THREADS/2 threads, BLOCKS KV blocks each) behind `pagedserve router`
#   round-robin  the same two replicas behind the router with --strategy round-robin
# Every setup gets fresh engines (cold prefix caches). Results: $OUT/<setup>.json, charts in $OUT/plots.
#
# Usage: benchmarks/router_compare.sh   (env: BLOCKS NUM_GROUPS PREFIX_LEN INPUT_LEN OUTPUT_LEN NUM_PROMPTS
#                                        CONCURRENCY THREADS OUT BIN)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONSAFEPATH=1  # ./operator must not shadow the stdlib module

BIN=${BIN:-.venv/bin}
OUT=${OUT:-benchmarks/results/router}
BLOCKS=${BLOCKS:-100}          # KV blocks (16 tokens) per replica of the pair; the single replica gets twice
NUM_GROUPS=${NUM_GROUPS:-8}    # system prompts
PREFIX_LEN=${PREFIX_LEN:-256}  # tokens per system prompt
INPUT_LEN=${INPUT_LEN:-32}     # each request's own question
OUTPUT_LEN=${OUTPUT_LEN:-32}
NUM_PROMPTS=${NUM_PROMPTS:-64}
CONCURRENCY=${CONCURRENCY:-8}
THREADS=${THREADS:-$(nproc)}
HALF=$(( THREADS > 1 ? THREADS / 2 : 1 ))
PORT_A=18301 PORT_B=18302 PORT_ROUTER=18300
mkdir -p "$OUT"
MODEL=$("$BIN/python" -c "import pagedserve; print(pagedserve.default_model())")

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; PIDS=(); }
trap cleanup EXIT

wait_for() {  # url
    for _ in $(seq 300); do curl -sf "$1" >/dev/null && return 0; sleep 1; done
    echo "timed out waiting for $1" >&2; return 1
}

engine() {  # port threads blocks
    OMP_NUM_THREADS=$2 "$BIN/pagedserve" serve --host 127.0.0.1 --port "$1" --num-gpu-blocks-override "$3" \
        >"$OUT/engine-$1.log" 2>&1 &
    PIDS+=($!)
}

router() {  # strategy
    OMP_NUM_THREADS=1 "$BIN/pagedserve" router --host 127.0.0.1 --port $PORT_ROUTER --strategy "$1" \
        --backend "http://127.0.0.1:$PORT_A" --backend "http://127.0.0.1:$PORT_B" --tokenizer "$MODEL" \
        >"$OUT/router-$1.log" 2>&1 &
    PIDS+=($!)
}

bench() {  # port label
    "$BIN/pagedserve" bench serve --base-url "http://127.0.0.1:$1" --dataset shared-prefix \
        --shared-prefix-groups "$NUM_GROUPS" --shared-prefix-len "$PREFIX_LEN" --input-len "$INPUT_LEN" \
        --output-len "$OUTPUT_LEN" --num-prompts "$NUM_PROMPTS" --max-concurrency "$CONCURRENCY" \
        --tokenizer "$MODEL" --label "$2" --result-json "$OUT/$2.json" --disable-tqdm | tee "$OUT/$2.txt"
}

engine_stats() {  # port...: per-replica requests and preemptions, prefix-cache hit rate, from /metrics
    "$BIN/python" - "$@" <<'PY'
import sys

import httpx

total = {"q": 0.0, "h": 0.0}
split = []
for port in sys.argv[1:]:
    m = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0,
         "vllm:request_success_total": 0.0, "vllm:num_preemptions_total": 0.0}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in m:
            m[name] += float(line.split()[-1])
    total["q"] += m["vllm:prefix_cache_queries_total"]
    total["h"] += m["vllm:prefix_cache_hits_total"]
    split.append(f"{m['vllm:request_success_total']:.0f} requests/{m['vllm:num_preemptions_total']:.0f} preemptions")
q, h = total["q"], total["h"]
print(f"prefix cache hit rate: {100 * h / q:.1f}% ({h:.0f} of {q:.0f} prompt tokens); per replica: "
      + ", ".join(split) if q else "no metrics")
PY
}

echo "== single replica ($THREADS threads, $(( 2 * BLOCKS )) blocks)"
engine $PORT_A "$THREADS" $(( 2 * BLOCKS ))
wait_for "http://127.0.0.1:$PORT_A/health"
bench $PORT_A single
engine_stats $PORT_A | tee -a "$OUT/single.txt"
cleanup

for strategy in prefix-hash round-robin; do
    echo "== two replicas ($HALF threads, $BLOCKS blocks each) behind the router, $strategy"
    engine $PORT_A "$HALF" "$BLOCKS"
    engine $PORT_B "$HALF" "$BLOCKS"
    wait_for "http://127.0.0.1:$PORT_A/health"
    wait_for "http://127.0.0.1:$PORT_B/health"
    router "$strategy"
    wait_for "http://127.0.0.1:$PORT_ROUTER/ready"
    bench $PORT_ROUTER "$strategy"
    engine_stats $PORT_A $PORT_B | tee -a "$OUT/$strategy.txt"
    cleanup
done

"$BIN/pagedserve" bench plot "$OUT/single.json" "$OUT/prefix-hash.json" "$OUT/round-robin.json" \
    --out "$OUT/plots" --title "shared prefix"
