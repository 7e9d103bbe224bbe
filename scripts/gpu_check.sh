#!/usr/bin/env bash
# The GPU check, as run on the lent H200 through the device tool (results in benchmarks/RESULTS.md).
# Needs FlashAttention-4 (and nbval for part 2) carried as in ../shared/GPU.md:
#   part 1, carry [.gpuA, .gpuB]:  source .gpuB/device-env.sh && bash scripts/gpu_check.sh 1 $OUT
#   part 2, carry [.gpuB, .gpuC] on the same warm machine:  source .gpuB/device-env.sh && bash scripts/gpu_check.sh 2 $OUT
#   part 3 (the whole unit suite on the GPU, FA4 present):  source .gpuB/device-env.sh && bash scripts/gpu_check.sh 3 $OUT
set -uo pipefail
part=$1; out=${2:-gpu_out}; mkdir -p "$out"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
quiet() { grep -v "UserWarning\|warnings.warn\|warn(\|exe_args\|_warn_once\|Writing model shards"; }
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$out/versions_$part.txt"
if [ "$part" = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | quiet | tee "$out/pytest_gpu.log" | tail -n 6
  python3 scripts/gpu_smoke.py 2>&1 | quiet | tee "$out/smoke.log" | tail -n 14
  python3 bench.py --out "$out/throughput_gpu.json" 2>&1 | quiet | tee "$out/bench.log" | tail -n 14
  python3 benchmarks/bench_kernels.py --out "$out/kernels_gpu.json" 2>&1 | quiet | tee "$out/kernels.log" | tail -n 6
elif [ "$part" = 2 ]; then
  python3 -m pytest -q -p no:cacheprovider --nbval --nbval-current-env notebooks 2>&1 | quiet | tee "$out/nbval.log" | tail -n 25
else
  python3 -m pytest -q -p no:cacheprovider tests 2>&1 | quiet | tee "$out/pytest_all.log" | tail -n 25
fi
