#!/usr/bin/env bash
# GPU tests and benchmarks, for a session that has a GPU machine. Results land in $OUT (JSON, JUnit XML,
# one log); default benchmarks/results/gpu.
#
#   bash benchmarks/gpu/run_all.sh [STAGE...]      # no stage: all of them, in this order
#
# Stages:
#   tests   every test that runs on the GPU, in one parallel pytest (xdist, PYTEST_WORKERS, default 12):
#           tests/gpu, the Triton kernel tests that compile for CUDA when it is there, the sampler's CUDA
#           path, and every model family on the Triton backend against HF. Each test has a time limit
#           (PYTEST_TIMEOUT, default 300 s) so a hang is named, not waited out, and the run a deadline
#           (PYTEST_DEADLINE, default 540 s) within one 10-minute device call. Its JUnit XML, and a summary
#           with each failure's name and first error lines, land in $OUT whatever happens.
#   tune    the w8a16 split-K decode launch per Llama-3-8B projection shape on this GPU, written to
#           kernels/configs/w8a16_decode.json (which the later stages then run; commit it from $OUT)
#   kernels each Triton kernel's max error against its fp32 reference at real shapes; prefill attention
#           FLOP/s, the engine's (FlashAttention where it takes the batch) and the Triton kernel's beside
#           torch's SDPA (with a sweep of the kernel's tiles); the quantized linear layers against bf16
#           cuBLAS at Llama-3-8B's shapes, 1 to 1024 rows (QUANT_ROWS)
#   steps   the batch-1 decode step of the Llama-3-8B shape in bf16, int8 weights, FP8 weights and with an
#           FP8 KV cache (STEP_MODES="bf16 int8 fp8 kv-fp8"), each against its roofline
#   a       decode attention bandwidth vs device-to-device copy (batch 64, context 2048, Llama-3-8B heads)
#   bd      (b) batch-1 decode step vs roofline and (d) GPU busy share at batch 64, Llama-3-8B shape
#   c       offline throughput vs HF Transformers, 256 prompts, Llama-3.2-1B shape
#   report  benchmarks/results/gpu.json and benchmarks/gpu/README.md's table from the JSON in $OUT (also
#           runs without a GPU, on results fetched from one: python -m pagedserve.benchmarks.gpu.report DIR)
# RUN_ALL_SECONDS=N: the whole run within N seconds (a device call's limit): each stage is cut off when the
# budget is spent, keeping what it wrote, and the stages after it are skipped.
# Every call first installs the checkout (pip install --no-deps -e .): a fresh machine has torch, triton,
# transformers, tokenizers, safetensors and pytest-xdist; the server's other packages travel as wheels.
# Random-weight models are built under $PAGEDSERVE_RANDOM_MODELS (default /tmp/pagedserve-models) and
# reused while the machine lives.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONSAFEPATH=1  # `python -m` from here: ./operator must not shadow the stdlib module
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
export OUT
LOG="$OUT/run_all.log"
MODELS=${PAGEDSERVE_RANDOM_MODELS:-/tmp/pagedserve-models}
export PAGEDSERVE_RANDOM_MODELS=$MODELS
status=0

log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }
run() {  # run a command, its output to the terminal and the log; remember a failure
  "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { log "FAILED ($rc): $*"; status=1; }
}
# Every test that runs on a GPU. The model-family modules also hold the CPU backends' cases, which
# `make test` runs: -k keeps only their Triton ones. The *_under_the_interpreter tests are CPU tests
# (Triton's interpreter in a child pytest, which the CPU suites run): triton 3.6's interpreter on the GPU
# image fails there under numpy 2.5 ("only 0-dimensional arrays can be converted to Python scalars",
# triton/runtime/interpreter.py's __index__), which the CPU machines' triton 3.9 does not.
GPU_TESTS=(tests/gpu tests/kernels/test_fp8_kv_triton.py tests/kernels/test_fused_moe_triton.py
  tests/kernels/test_gguf_triton.py tests/kernels/test_w8a16_triton.py tests/kernels/test_lora_kernels.py
  tests/engine/test_sampler.py tests/models/test_families.py tests/models/test_moe_models.py)
GPU_TESTS_FILTER="(triton or not (test_families or test_moe_models)) and not under_the_interpreter"
pytest_stage() {  # NAME PYTEST-ARGS...: one pytest run with its JUnit XML and failures summarised
  local name=$1; shift
  # SIGINT at the deadline: pytest stops as on Ctrl-C and still writes its JUnit XML of what ran.
  run timeout -s INT -k 30 "${PYTEST_DEADLINE:-540}" $PY -m pytest -q -rfE --tb=short -p no:cacheprovider \
    --durations=25 --timeout "${PYTEST_TIMEOUT:-300}" --junitxml "$OUT/$name.xml" "$@"
  if [ -f "$OUT/$name.xml" ]; then
    $PY -m pagedserve.benchmarks.gpu.junit_summary "$name" "$OUT/$name.xml" | tee -a "$LOG" "$OUT/summary.txt"
  else
    log "stage $name wrote no JUnit XML" | tee -a "$OUT/summary.txt"
  fi
}

if [ -z "${RUN_ALL_CHILD:-}" ]; then
  log "setup"
  if [ -z "${SKIP_INSTALL:-}" ]; then  # SKIP_INSTALL=1 where the checkout is already installed
    $PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3 | tee -a "$LOG"
  fi
  run $PY -m pagedserve.benchmarks.gpu.common  # $OUT/environment.json: GPU, torch, triton
fi

stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(tests tune kernels steps a bd c report)
if [ -n "${RUN_ALL_SECONDS:-}" ]; then
  # A device call's budget: each stage runs in a child cut off (SIGINT, so benchmarks keep what they
  # wrote) when the budget is spent; a stage with under 15 s left is skipped. What ran is in $OUT.
  start=$(date +%s)
  for stage in "${stages[@]}"; do
    left=$(( RUN_ALL_SECONDS - ($(date +%s) - start) ))
    if [ "$left" -lt 15 ]; then log "stage $stage skipped: the budget is spent"; status=1; continue; fi
    RUN_ALL_CHILD=1 RUN_ALL_SECONDS= timeout -s INT -k 10 "$left" bash "$0" "$stage"
    rc=$?
    [ "$rc" -eq 0 ] || { log "stage $stage ended with $rc"; status=1; }
  done
  log "done (status $status)"
  exit $status
fi
for stage in "${stages[@]}"; do
  log "stage $stage"
  case "$stage" in
    tests)
      pytest_stage tests -n "${PYTEST_WORKERS:-12}" --dist worksteal "${GPU_TESTS[@]}" -k "$GPU_TESTS_FILTER" ;;
    tune)
      run $PY -m pagedserve.benchmarks.gpu.tune_w8a16 --out "$OUT"
      cp kernels/configs/w8a16_decode.json "$OUT/" ;;
    kernels)
      run $PY -m pagedserve.benchmarks.gpu.prefill_attention --sweep --out "$OUT"
      # shellcheck disable=SC2086  # QUANT_ROWS is a list of numbers
      run $PY -m pagedserve.benchmarks.gpu.quantized_linear --rows ${QUANT_ROWS:-1 16 64 256 1024} --out "$OUT"
      run $PY -m pagedserve.benchmarks.gpu.kernel_errors --out "$OUT" ;;
    steps)
      run $PY -m pagedserve.benchmarks.gpu.random_model --shape llama3-8b --out "$MODELS/llama3-8b"
      for mode in ${STEP_MODES:-bf16 int8 fp8 kv-fp8}; do
        case "$mode" in
          bf16) args=() ;;
          int8 | fp8) args=(--quantization "$mode") ;;
          kv-fp8) args=(--kv-cache-dtype fp8) ;;
          *) log "unknown step mode $mode"; status=2; continue ;;
        esac
        run $PY -m pagedserve.benchmarks.gpu.engine_decode --model "$MODELS/llama3-8b" --skip-busy-share \
          --new-tokens "${STEP_TOKENS:-64}" "${args[@]}" --out "$OUT"
      done ;;
    a)
      run $PY -m pagedserve.benchmarks.gpu.decode_attention_bandwidth --sweep --out "$OUT" ;;
    bd)
      run $PY -m pagedserve.benchmarks.gpu.random_model --shape llama3-8b --out "$MODELS/llama3-8b"
      run $PY -m pagedserve.benchmarks.gpu.engine_decode --model "$MODELS/llama3-8b" --out "$OUT" ;;
    c)
      run $PY -m pagedserve.benchmarks.gpu.random_model --shape llama3.2-1b --out "$MODELS/llama3.2-1b"
      run $PY -m pagedserve.cli bench throughput --model "$MODELS/llama3.2-1b" --num-prompts 256 \
        --compare hf --hf-batch-size 32 --device cuda --dtype bfloat16 \
        --result-json "$OUT/c_throughput_vs_hf.json" ;;
    report)
      run $PY -m pagedserve.benchmarks.gpu.report "$OUT" ;;
    *)
      log "unknown stage $stage"; status=2 ;;
  esac
done
log "done (status $status)"
exit $status
