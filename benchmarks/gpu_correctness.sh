#!/usr/bin/env bash
# Is the fast path the same model on a GPU? One run, under 9 minutes on one H200:
#   1. the CUDA tests:  python3 -m pytest -m gpu tests/gpu
#   2. a real-width Qwen3-architecture model (hidden 2048, 8 layers) trained ~75 s on the
#      project's documents (peaked distributions; model_utils/bench/peaked_model.py)
#   3. on it, bf16 greedy output of the engine against plain generate, 3 prompts x 128 tokens:
#      equal, or where they part with the margin between the top two logprobs there
#   4. the benchmark with logprobs (logprobs_close, logit_error_ratio) on the Qwen2.5-7B shape
#      (random weights), bf16 and nf4, batch 1 and 8
# Steps 1 and 2-3 run side by side (the tests time nothing); the benchmark runs alone after
# them. Results (8 files at most) go to $OUT: run.log, gpu-tests.xml, training.json,
# greedy-bf16.json/.md, bench-bf16.json, bench-nf4.json, summary.md.
#
# Without CUDA it runs the same steps at tiny sizes (the demo model for the benchmark), which
# is how the script itself is checked:  OUT=/tmp/gc benchmarks/gpu_correctness.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-correctness}
PY=${PYTHON:-python3}
WORK=${WORK:-$(mktemp -d /tmp/gpu-correctness.XXXX)}
mkdir -p "$OUT"
LOG="$OUT/run.log"
START=$(date +%s)
BUDGET=${BUDGET:-540}  # seconds for the whole run
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
say() { echo "[$(( $(date +%s) - START )) s] $*" | tee -a "$LOG"; }

if $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  GPU=1
  TRAIN="--hidden 2048 --layers 8 --seconds 75 --max-steps 3000 --batch 16"
  GREEDY="--prompts 3 --new-tokens 128"
  BENCH_MODEL="$WORK/qwen2.5-7b-random"
  BENCH="--batch 1,8 --prompt-tokens 128 --new-tokens 64 --match-prompts 1"
else
  GPU=0
  TRAIN="--hidden 64 --layers 2 --max-steps 60 --batch 8"
  GREEDY="--prompts 3 --new-tokens 16"
  BENCH_MODEL="demo"
  BENCH="--batch 1,2 --prompt-tokens 16 --new-tokens 8 --match-prompts 1"
fi
say "start: gpu=$GPU, $($PY -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' 2>&1 | tail -1)"
if [ "$GPU" = 1 ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$LOG" 2>&1; fi

# 1. the CUDA tests, in the background
( timeout 330 $PY -m pytest -m gpu tests/gpu -q -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" \
    >"$WORK/pytest.log" 2>&1; echo $? >"$WORK/pytest.rc" ) &
TESTS=$!

# 2-3. train, then compare greedy output (and build the 7B shape meanwhile on the GPU)
if [ "$GPU" = 1 ]; then
  ( timeout 120 $PY -c "
from pathlib import Path
from model_utils.bench.inputs import build_random_model
build_random_model(Path('benchmarks/configs/qwen2.5-7b-instruct.config.json'), Path('$BENCH_MODEL'), 'cuda')
" >"$WORK/build.log" 2>&1; echo $? >"$WORK/build.rc" ) &
  BUILD=$!
fi
say "training: $TRAIN"
timeout 150 $PY -m model_utils.bench.peaked_model --out "$WORK/peaked" $TRAIN >>"$LOG" 2>&1
say "training exit $?"
cp "$WORK/peaked/training.json" "$OUT/training.json" 2>/dev/null
timeout 150 $PY -m model_utils.bench.greedy_compare --model "$WORK/peaked" --mode bf16 $GREEDY \
  --out "$OUT/greedy-bf16.json" >>"$LOG" 2>&1
say "greedy comparison exit $?"
wait $TESTS
say "gpu tests exit $(cat "$WORK/pytest.rc"): $(tail -1 "$WORK/pytest.log")"
tail -40 "$WORK/pytest.log" >>"$LOG"
if [ "$GPU" = 1 ]; then wait $BUILD; say "7B shape built: exit $(cat "$WORK/build.rc")"; fi

# 4. the benchmark, alone on the GPU now, one process per mode
for mode in bf16 nf4; do
  budget=$(( $(left) - 10 ))
  if [ "$budget" -lt 30 ]; then say "no time left for the $mode benchmark"; continue; fi
  say "bench $mode (at most $budget s)"
  timeout "$budget" $PY -m model_utils.bench --model "$BENCH_MODEL" --modes "$mode" $BENCH \
    --out "$OUT/bench-$mode.json" --chart "$WORK/bench-$mode.png" >"$WORK/bench-$mode.log" 2>&1
  say "bench $mode exit $?"
  grep -v '^\[{' "$WORK/bench-$mode.log" | tail -25 >>"$LOG"
done

# summary
$PY - "$OUT" >"$OUT/summary.md" 2>>"$LOG" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("# GPU correctness run\n")
rc = (out / "gpu-tests.xml").exists()
if rc:
    import xml.etree.ElementTree as ET
    suite = ET.parse(out / "gpu-tests.xml").getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    print(f"GPU tests: {suite.get('tests')} run, {suite.get('failures')} failed, "
          f"{suite.get('errors')} errors, {suite.get('skipped')} skipped, {float(suite.get('time')):.0f} s\n")
    for case in suite.iter("testcase"):
        bad = case.find("failure") or case.find("error")
        if bad is not None:
            print(f"- FAILED {case.get('name')}: {(bad.get('message') or '')[:300]}")
if (out / "training.json").exists():
    print("\nTrained model:", (out / "training.json").read_text().replace("\n", " "))
if (out / "greedy-bf16.md").exists():
    print("\n" + (out / "greedy-bf16.md").read_text())
for mode in ("bf16", "nf4"):
    path = out / f"bench-{mode}.json"
    if not path.exists():
        print(f"\nbench {mode}: no result (see run.log)")
        continue
    from model_utils.bench.report import BenchRow, summary_table
    data = json.loads(path.read_text())
    rows = [BenchRow(**r) for r in data["rows"]]
    print(f"\nbench {mode} ({data['meta']}):\n\n" + summary_table(rows))
    for r in rows:
        lp = r.logprobs
        print(f"- batch {r.batch}: first mismatch {lp.get('first_mismatch')}, "
              f"teacher-forced {json.dumps(lp.get('teacher_forced'))[:400]}")
PY
say "done: $(ls "$OUT" | tr '\n' ' ')"
cat "$OUT/summary.md"
