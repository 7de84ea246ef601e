#!/usr/bin/env bash
# Many users through the HTTP APIs (BENCHMARKS.md): the app serving a model of a published
# shape with random weights, tools/load_test.py at 1, 8 and 32 clients through gradio's /chat
# and through /v1/chat/completions, then one plain
# model.generate stream on the same host, so that the ratio compares like with like.
#
#   benchmarks/http_load.sh CONFIG_JSON OUT_DIR [extra app.py flags...]
#   benchmarks/http_load.sh qwen2.5-7b-instruct.config.json results/ --compile-mode default
#
# On a CUDA machine the model is built and served on cuda:0 in bf16, else on the CPU in fp32.
# Writes OUT_DIR/load-{gradio,openai}-N-clients.json, OUT_DIR/server.log, prints each report.
# LOAD_TIMEOUT (seconds, default 600) bounds each load test.
set -eu
config=${1:?usage: benchmarks/http_load.sh CONFIG_JSON OUT_DIR [app flags]}
out=${2:?usage: benchmarks/http_load.sh CONFIG_JSON OUT_DIR [app flags]}
shift 2
python=${PYTHON:-.venv/bin/python}
port=${PORT:-7860}
mkdir -p "$out"
model=$(mktemp -d)
trap 'kill $app 2>/dev/null || true; rm -rf "$model"' EXIT

read -r device mode placement < <("$python" -c "import torch; print(*(('cuda', 'bf16', 'cuda:0') \
    if torch.cuda.is_available() else ('cpu', 'fp32', 'cpu')))")
"$python" -c "from pathlib import Path; from model_utils.bench.run import build_random_model; \
build_random_model(Path('$config'), Path('$model'), '$device')"

# Steady serving is measured: the decode step compiled before the first request (the app's
# default compiles it while idle, after the page answers, and the first requests would wait).
"$python" app.py --model "$model" --mode "$mode" --placement "$placement" --port "$port" \
    --max-batch 32 --max-queue 64 --no-compile-while-idle --log-file "$out/server.log" "$@" \
    > "$out/console.txt" 2>&1 &
app=$!
for _ in $(seq 600); do  # loading includes compiling the decode step (about a minute on a GPU)
    curl -s -o /dev/null "http://127.0.0.1:$port/" && break
    kill -0 $app 2>/dev/null || { tail -20 "$out/console.txt"; exit 1; }
    sleep 1
done

for api in gradio openai; do  # gradio_client on /chat, then /v1/chat/completions
    for clients in 1 8 32; do
        "$python" tools/load_test.py --url "http://127.0.0.1:$port" --api "$api" \
            --clients "$clients" --requests 2 --max-new-tokens 256 --prompt-words 35 \
            --timeout "${LOAD_TIMEOUT:-600}" --json "$out/load-$api-$clients-clients.json" || true
    done
done
kill $app
wait $app 2>/dev/null || true

"$python" - "$model" <<'EOF'
import sys

import torch
from transformers import AutoModelForCausalLM

from model_utils.bench.run import peer_generate, random_prompts

cuda = torch.cuda.is_available()
model = AutoModelForCausalLM.from_pretrained(
    sys.argv[1], dtype=torch.bfloat16 if cuda else torch.float32,
    device_map={"": 0 if cuda else "cpu"})
prompt = random_prompts(1, 128, model.config.vocab_size)[0]
_, ttft_ms, tok_s = peer_generate(model, [prompt], 128)
print(f"plain model.generate, one stream: {tok_s:.1f} tok/s, time to first token {ttft_ms:.1f} ms")
EOF
