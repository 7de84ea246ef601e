#!/usr/bin/env bash
# The paged KV cache on one GPU, in steps that fit one call of the GPU machine (10 minutes):
#   kernel  benchmarks/decode_attention.py (--tune): the decode kernel per layer against sdpa
#           over a dense cache and the bytes bound, and a sweep of its tuning
#   tests   the CUDA tests of the paged cache, the graph paths and the hybrid layers
#           (tests/gpu/test_paged_decode.py, test_graphs.py, test_hybrid.py)
#   bench   python -m model_utils.bench.long_context on the Qwen2.5-7B shape (random weights):
#           the prompt-length sweep, 1 and 8 streams, 7 short beside 1 long, the next turns;
#           CAPACITY="32,2,32000": 32 short chats and two 32k prompts at once
#   peer    transformers' static cache + compile at the same lengths, in a process of its own
#           (in the engine's process after it unloads, the peer's compile failed)
#   hybrid  the same bench on the Qwen3.5-9B shape (hybrid linear attention), 128 and 4k
#           tokens, 1 and 8 streams (HYBRID_LENGTHS, HYBRID_STREAMS, HYBRID_CONTEXT), no peer
#           (fla-core's wheel in .whl gives its kernels); HYBRID_ARGS adds flags (e.g.
#           "--compiled-rows 32")
#   profile benchmarks/step_profile.py on 4 layers of the Qwen3.5-9B shape (3 linear, 1 full):
#           the captured step at PROFILE_ROWS rows, per PROFILE_COMPILED (--compiled-rows)
# Run from the repository root on the GPU machine, the wheels the image lacks in .whl/:
#   STEPS="kernel tests" OUT=$OUT benchmarks/gpu_long_context.sh
# Each step has its own time limit (KERNEL_S, TESTS_S, BENCH_S, PEER_S, HYBRID_S) and writes into $OUT as it goes.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-long-context}
PY=${PYTHON:-python3}
STEPS=${STEPS:-"kernel tests bench peer"}
mkdir -p "$OUT"
LOG="$OUT/run.log"
START=$(date +%s)
say() { echo "[$(( $(date +%s) - START )) s] $*" | tee -a "$LOG"; }
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
say "start: $($PY -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))' 2>&1 | tail -1)"

for step in $STEPS; do
  case $step in
    kernel)
      say "kernel: decode attention per layer"
      timeout "${KERNEL_S:-170}" $PY benchmarks/decode_attention.py --tune \
          --out "$OUT/decode-attention.json" >>"$LOG" 2>&1
      say "kernel: exit $?";;
    tests)
      say "tests: paged decode and graph paths"
      timeout "${TESTS_S:-240}" $PY -m pytest -m gpu ${TEST_FILES:-tests/gpu/test_paged_decode.py \
          tests/gpu/test_graphs.py tests/gpu/test_hybrid.py} -q -p no:cacheprovider \
          --junitxml="$OUT/gpu-tests.xml" \
          >"$OUT/gpu-tests.log" 2>&1
      say "tests: exit $? ($(tail -1 "$OUT/gpu-tests.log"))";;
    bench)
      say "bench: long context, Qwen2.5-7B shape"
      timeout "${BENCH_S:-400}" $PY -m model_utils.bench.long_context \
          --random-from-config benchmarks/configs/qwen2.5-7b-instruct.config.json \
          --context-tokens 32768 --lengths "${LENGTHS:-128,4096,16384,30000}" \
          --streams "${STREAMS:-1,8}" --new-tokens "${NEW_TOKENS:-256}" --no-peer \
          ${CAPACITY:+--capacity "$CAPACITY"} \
          --out "$OUT/long-context.json" >"$OUT/long-context.log" 2>&1
      say "bench: exit $?";;
    peer)
      say "peer: static cache + compile, Qwen2.5-7B shape"
      timeout "${PEER_S:-300}" $PY -m model_utils.bench.long_context --peer-only \
          --random-from-config benchmarks/configs/qwen2.5-7b-instruct.config.json \
          --context-tokens 32768 --lengths "${PEER_LENGTHS:-128,4096,16384,30000}" \
          --new-tokens "${NEW_TOKENS:-256}" --out "$OUT/peer.json" >"$OUT/peer.log" 2>&1
      say "peer: exit $?";;
    hybrid)
      say "hybrid: Qwen3.5-9B shape"
      timeout "${HYBRID_S:-300}" $PY -m model_utils.bench.long_context \
          --random-from-config benchmarks/configs/qwen3.5-9b-style.config.json \
          --context-tokens "${HYBRID_CONTEXT:-8192}" --lengths "${HYBRID_LENGTHS:-128,4096}" \
          --streams "${HYBRID_STREAMS:-1,8}" --new-tokens 128 \
          --mixed-long 0 --no-peer ${HYBRID_ARGS:-} --out "$OUT/hybrid.json" \
          >"$OUT/hybrid.log" 2>&1
      say "hybrid: exit $?";;
    profile)
      say "profile: the decode step of 4 Qwen3.5-9B-shape layers"
      timeout "${PROFILE_S:-240}" $PY benchmarks/step_profile.py \
          --config benchmarks/configs/qwen3.5-9b-style.config.json --layers 4 \
          --keep-layer-types --context 8192 --length 128 --rows "${PROFILE_ROWS:-1,8,32}" \
          --compiled-rows "${PROFILE_COMPILED:-32,1}" --out "$OUT/step-profile.json" \
          >"$OUT/step-profile.log" 2>&1
      say "profile: exit $?";;
  esac
done
say "done"
