#!/usr/bin/env bash
# The modes on one GPU, in steps that fit one call of the GPU machine (10 minutes):
#   kernels  tests/gpu/test_weight_kernels.py: int4 (tinygemm and gemlite), int8-wo and fp8
#            against their dequantized weights at 1-1024 rows, eager and compiled
#   tests    the CUDA tests of every mode and the packed attention (needs bitsandbytes:
#            tests/gpu/test_batches_and_modes.py, test_packed_attention.py)
#   memory   the switching memory over 20 cycles (tests/gpu/test_switch_memory.py; it prints
#            each switch's seconds and counters as it goes; QWEN_SWITCH_CYCLES runs fewer,
#            QWEN_SWITCH_MODES other modes than bf16,int8-wo)
#   quant    benchmarks/quant_candidates.py on the Qwen2.5-7B shape: by default bf16, the app's
#            int8-wo (gemlite's kernels for decode rows when gemlite is installed), the same with
#            lm_head in int8 too, and fp8; any other mode or variant by QUANT_CANDIDATES; one
#            stream, 8 and 32 streams, TTFT (128 and 1024 tokens), KL against fp32 (QUANT_CONFIG:
#            another shape, e.g. benchmarks/configs/qwen3-14b.config.json;
#            QUANT_ARGS: more of its flags, e.g. --compiled-rows 32)
#   switch   benchmarks/switch_times.py on the Qwen2.5-7B shape (SWITCH_MODES, SWITCH_CYCLES;
#            SWITCH_PARK_GB: the engine's --park-gb; SWITCH_ARGS: more of its flags)
#   quality  every mode's KL and top-1 agreement against fp32 on a real-width Qwen3-architecture
#            model (hidden 2048, 8 layers) trained here for 75 s on the project's documents
#            (model_utils/bench/peaked_model.py; QUALITY_TRAIN: other training flags,
#            QUALITY_MODES: other modes; the bitsandbytes modes need it installed;
#            QUALITY_ARGS: more of the bench's flags, e.g. --int4-group 64); plain
#            forwards of 128-token windows, so each mode's prompt path (fp8: _scaled_mm)
#   search   benchmarks/gemlite_search.py on the Qwen2.5-7B shape (SEARCH_CONFIG: another):
#            gemlite's split-K configs for decode batches searched wider than its own list,
#            against bf16 (SEARCH_ROWS, default 32; SEARCH_WEIGHTS int8, fp8 or int4;
#            SEARCH_ARGS=--held-only: gemlite's own tuning only, the configs to ship for a
#            shape; SEARCH_LAYERS: some of qkv,o,gate_up,down); writes
#            $OUT/search/gemlite-configs.json
#   int4kernels  benchmarks/int4_kernels.py on the Qwen2.5-7B shape: the kernels that can
#            multiply int4-wo's numbers (gemlite's; MSLK's where mslk-cuda loads) against bf16's
#            per linear shape and row count (INT4_ROWS, default 1,2,4,8,16,32,64,128,1024;
#            INT4_ARGS=--gemv-search: mslk_gemv's launches searched first, the fastest written
#            into model_utils/layers/mslk_gemv_configs.json, which later steps use, and $OUT;
#            INT4_ARGS="--layers down": some shapes only; INT4_ARGS=--rows-search: the same
#            search for mslk_rows' tensor-core kernel from 2 rows, and its crossover)
#   profile  benchmarks/kernel_profile.py under Nsight Compute where the machine has ncu: one
#            kernel's product (PROFILE_KERNEL: mslk_rows, mslk_gemv, mslk, int8_rows or bf16;
#            PROFILE_SHAPE N x K, default gate_up's 37888x3584; PROFILE_ROWS, default 8;
#            PROFILE_ARGS, e.g. "--launch 64,64,1,4,3"): occupancy, memory throughput and
#            what the warps stalled on, into $OUT/profile.log
# Run from the repository root on the GPU machine, the wheels the image lacks in folders named
# .whl* (e.g. .whl/: transformers, tokenizers; .whl-gemlite/: gemlite; .whl-bnb/:
# bitsandbytes; one version of each package across them):
#   STEPS="kernels quant" OUT=$OUT benchmarks/gpu_modes.sh
# Each step has its own time limit (KERNELS_S, TESTS_S, QUANT_S, SWITCH_S, QUALITY_S,
# SEARCH_S, MEMORY_S, INT4_KERNELS_S, PROFILE_S) and writes into
# $OUT as it goes.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-modes}
PY=${PYTHON:-python3}
STEPS=${STEPS:-"kernels quant"}
CONFIG=benchmarks/configs/qwen2.5-7b-instruct.config.json
mkdir -p "$OUT"
LOG="$OUT/run.log"
START=$(date +%s)
say() { echo "[$(( $(date +%s) - START )) s] $*" | tee -a "$LOG"; }
export PYTHONUNBUFFERED=1
wheels=$(ls .whl*/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site $wheels && export PYTHONPATH=/tmp/site:$PWD
fi
rm -rf /tmp/bench-model-* 2>/dev/null  # random checkpoints of earlier runs fill the disk
say "start: $($PY -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name(0))' 2>&1 | tail -1)"

for step in $STEPS; do
  case $step in
    kernels)
      say "kernels: the quantized layers against their dequantized weights"
      timeout "${KERNELS_S:-300}" $PY -m pytest -m gpu tests/gpu/test_weight_kernels.py -q \
          -p no:cacheprovider >"$OUT/gpu-tests-kernels.log" 2>&1
      say "kernels: exit $? ($(tail -1 "$OUT/gpu-tests-kernels.log"))";;
    tests)
      say "tests: every mode, the packed attention"
      timeout "${TESTS_S:-400}" $PY -m pytest -m gpu tests/gpu/test_batches_and_modes.py \
          tests/gpu/test_packed_attention.py -q \
          -p no:cacheprovider --junitxml="$OUT/gpu-tests-modes.xml" \
          >"$OUT/gpu-tests-modes.log" 2>&1
      say "tests: exit $? ($(tail -1 "$OUT/gpu-tests-modes.log"))";;
    memory)
      say "memory: switching cycles, memory after every unload"
      timeout "${MEMORY_S:-540}" $PY -m pytest -m gpu tests/gpu/test_switch_memory.py -q -s \
          -p no:cacheprovider >"$OUT/gpu-tests-switch-memory.log" 2>&1
      say "memory: exit $? ($(tail -1 "$OUT/gpu-tests-switch-memory.log"))";;
    quant)
      say "quant: the candidates side by side, Qwen2.5-7B shape"
      timeout "${QUANT_S:-540}" $PY benchmarks/quant_candidates.py --config "${QUANT_CONFIG:-$CONFIG}" \
          --candidates "${QUANT_CANDIDATES:-bf16,int8-wo,int8-wo-head8,int8-wo-gemlite-prompts,fp8}" \
          --budget-s "$(( ${QUANT_S:-540} - 40 ))" --out "$OUT" ${QUANT_ARGS:-} >"$OUT/quant.log" 2>&1
      say "quant: exit $?";;
    switch)
      say "switch: click to first token, cold and warm, Qwen2.5-7B shape"
      timeout "${SWITCH_S:-540}" $PY benchmarks/switch_times.py --random-from-config "$CONFIG" \
          --modes "${SWITCH_MODES:-bf16,nf4,int4-wo}" --cycles "${SWITCH_CYCLES:-3}" \
          --park-gb "${SWITCH_PARK_GB:-0}" ${SWITCH_ARGS:-} \
          --out "$OUT/switch" >"$OUT/switch.log" 2>&1
      say "switch: exit $?";;
    quality)
      say "quality: a real-width model trained here, every mode against fp32"
      rm -rf /tmp/peaked-real-width  # never an earlier run's model
      timeout 150 $PY -m model_utils.bench.peaked_model --out /tmp/peaked-real-width \
          ${QUALITY_TRAIN:---hidden 2048 --layers 8 --seconds 75 --max-steps 3000 --batch 16} \
          >"$OUT/quality-training.log" 2>&1
      say "quality: training exit $? ($(tail -1 "$OUT/quality-training.log"))"
      timeout "${QUALITY_S:-360}" $PY -m model_utils.bench --model /tmp/peaked-real-width \
          --modes "${QUALITY_MODES:-fp32,bf16,fp16,int4-wo,int8-wo,fp8,int8,nf4,nf4-dq,fp4,fp4-dq}" \
          --batch 1 --prompt-tokens 32 --new-tokens 8 --match-prompts 1 --no-logprobs \
          --no-compile --quality-positions 384 --out "$OUT/quality-per-mode.json" \
          ${QUALITY_ARGS:-} >"$OUT/quality.log" 2>&1
      say "quality: exit $?";;
    int4kernels)
      say "int4kernels: the int4 kernels against bf16, per shape and row count"
      timeout "${INT4_KERNELS_S:-240}" $PY benchmarks/int4_kernels.py --config "$CONFIG" \
          --rows "${INT4_ROWS:-1,2,4,8,16,32,64,128,1024}" --out "$OUT/int4-kernels.json" \
          ${INT4_ARGS:-} >"$OUT/int4-kernels.log" 2>&1
      say "int4kernels: exit $?"
      cp model_utils/layers/mslk_gemv_configs.json "$OUT/" 2>/dev/null;;
    profile)
      say "profile: one kernel's product under Nsight Compute"
      NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
      args="--kernel ${PROFILE_KERNEL:-mslk_rows} --shape ${PROFILE_SHAPE:-37888x3584} \
            --rows ${PROFILE_ROWS:-8} ${PROFILE_ARGS:-}"
      if [ -z "$NCU" ]; then
        say "profile: no ncu on this machine; the product's time only"
        timeout "${PROFILE_S:-300}" $PY benchmarks/kernel_profile.py $args \
            >"$OUT/profile.log" 2>&1
      else
        timeout "${PROFILE_S:-300}" "$NCU" --nvtx --nvtx-include "profiled/" \
            --section SpeedOfLight --section Occupancy --section LaunchStats \
            --section MemoryWorkloadAnalysis --section SchedulerStats \
            --section WarpStateStats --section SourceCounters \
            $PY benchmarks/kernel_profile.py $args >"$OUT/profile.log" 2>&1
      fi
      say "profile: exit $? ($(grep '"us"' "$OUT/profile.log" | tail -1))";;
    search)
      say "search: gemlite's split-K configs, wider, Qwen2.5-7B shape"
      timeout "${SEARCH_S:-540}" $PY benchmarks/gemlite_search.py \
          --config "${SEARCH_CONFIG:-$CONFIG}" ${SEARCH_ARGS:-} \
          --rows "${SEARCH_ROWS:-32}" --weights "${SEARCH_WEIGHTS:-int8}" \
          --layers "${SEARCH_LAYERS:-qkv,o,gate_up,down}" \
          --budget-s "$(( ${SEARCH_S:-540} - 180 ))" --out "$OUT/search" >"$OUT/search.log" 2>&1
      say "search: exit $?";;
  esac
done
say "done"
