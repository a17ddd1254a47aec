#!/usr/bin/env bash
# GPU tests and benchmarks, for a session that has a GPU machine. Results land in $OUT (JSON, JUnit XML,
# one log); default benchmarks/results/gpu.
#
#   bash benchmarks/gpu/run_all.sh [STAGE...]      # no stage: all of them, in this order
#
# Stages (each fits one 10-minute device call on an H100; run them as separate calls there):
#   kernel-tests  tests/gpu/test_kernels_gpu.py: bf16/fp16/fp32 kernels at real shapes, decode in a CUDA graph;
#                 tests/gpu/test_cuda_graphs_gpu.py: decode graphs of the model vs eager, the profiling forward
#   engine-tests  tests/gpu/test_engine_gpu.py: greedy parity Triton vs torch reference vs HF, graphs vs eager
#   a             decode attention bandwidth vs device-to-device copy (batch 64, context 2048, Llama-3-8B heads)
#   bd            (b) batch-1 decode step vs roofline and (d) GPU busy share at batch 64, Llama-3-8B shape
#   c             offline throughput vs HF Transformers, 256 prompts, Llama-3.2-1B shape
#   decode-tests  issue 18's GPU paths: the w8a16 and GGUF-block matmuls, the FP8 KV cache, speculative
#                 decoding (n-gram and draft model) against the fp32 oracle
#   quant         quantized linear layers vs bf16 cuBLAS at Llama-3-8B shapes; the batch-1 decode step of
#                 the Llama-3-8B shape in bf16, int8 weights and an FP8 KV cache, each vs its roofline
# Every call first installs the checkout (pip install --no-deps -e .): a fresh machine has everything
# else (torch, triton, transformers, tokenizers, safetensors, pytest). Random-weight models are built
# under $PAGEDSERVE_RANDOM_MODELS (default /tmp/pagedserve-models) and reused while the machine lives.
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

log "setup"
if [ -z "${SKIP_INSTALL:-}" ]; then  # SKIP_INSTALL=1 where the checkout is already installed
  $PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3 | tee -a "$LOG"
fi
run $PY - <<'PYEOF'
import torch, triton, transformers
print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
PYEOF

stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(kernel-tests engine-tests decode-tests a bd c quant)
for stage in "${stages[@]}"; do
  log "stage $stage"
  case "$stage" in
    kernel-tests)
      run $PY -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py tests/gpu/test_cuda_graphs_gpu.py \
        --junitxml "$OUT/kernel_tests.xml" ;;
    engine-tests)
      run $PY -m pytest -q -s -p no:cacheprovider tests/gpu/test_engine_gpu.py --junitxml "$OUT/engine_tests.xml" ;;
    a)
      run $PY -m pagedserve.benchmarks.gpu.decode_attention_bandwidth --sweep --out "$OUT" ;;
    bd)
      run $PY -m pagedserve.benchmarks.gpu.random_model --shape llama3-8b --out "$MODELS/llama3-8b"
      run $PY -m pagedserve.benchmarks.gpu.engine_decode --model "$MODELS/llama3-8b" --out "$OUT" ;;
    decode-tests)
      run $PY -m pytest -q -s -p no:cacheprovider tests/gpu/test_w8a16_gpu.py tests/gpu/test_gguf_gpu.py \
        tests/gpu/test_fp8_kv_gpu.py tests/gpu/test_spec_decode_gpu.py --junitxml "$OUT/decode_tests.xml" ;;
    quant)
      run $PY -m pagedserve.benchmarks.gpu.quantized_linear --out "$OUT"
      run $PY -m pagedserve.benchmarks.gpu.random_model --shape llama3-8b --out "$MODELS/llama3-8b"
      for mode in "" "--quantization int8" "--kv-cache-dtype fp8"; do
        # shellcheck disable=SC2086  # $mode is zero or two words
        run $PY -m pagedserve.benchmarks.gpu.engine_decode --model "$MODELS/llama3-8b" --skip-busy-share \
          $mode --out "$OUT"
      done ;;
    c)
      run $PY -m pagedserve.benchmarks.gpu.random_model --shape llama3.2-1b --out "$MODELS/llama3.2-1b"
      run $PY -m pagedserve.cli bench throughput --model "$MODELS/llama3.2-1b" --num-prompts 256 \
        --compare hf --hf-batch-size 32 --device cuda --dtype bfloat16 \
        --result-json "$OUT/c_throughput_vs_hf.json" ;;
    *)
      log "unknown stage $stage"; status=2 ;;
  esac
done
log "done (status $status)"
exit $status
