#!/usr/bin/env bash
# Rollouts on a Ray cluster, the way a run spans machines, on this one machine:
#   1. a head node started with `ray start` (4 logical CPUs),
#   2. one learner that places --workers 2 rollout actors on it through --ray-address,
#   3. torchrun with 2 learner ranks (DDP), each driving 1 rollout actor on the same cluster.
# Each run checks every batch's policy version against its learner's pushes (an error otherwise) and
# prints its summary line. On several machines: run `ray start --address HEAD:PORT` on every other
# node, and torchrun with --nnodes / --rdzv-endpoint (docs/distributed.md, "Across machines").
#
#   bash benchmarks/ray_cluster_check.sh            # about 40 s on 2 cores
#
# Needs `pip install -e ".[ray]"`. The `ray stop` at the end stops every Ray process on
# this machine, including clusters this script did not start.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-6390}
OUT=${OUT:-/tmp/ray_cluster_check}
ADDR=127.0.0.1:$PORT
ITS=${ITS:-5}
SMALL=(--iterations "$ITS" --preset pico --warmup-steps 5 --no-progress --no-plot)
rm -rf "$OUT"
ray start --head --node-ip-address 127.0.0.1 --port "$PORT" --num-cpus 4 --include-dashboard=false \
    --disable-usage-stats > /dev/null
trap 'ray stop > /dev/null 2>&1' EXIT
export RAY_AUTH_MODE=token  # ray start turns token authentication on; its token is in ~/.ray/auth_token
echo "== one learner, 2 rollout actors on the cluster at $ADDR"
python -m ppo_objectives.train --collector-backend ray --workers 2 --ray-address "$ADDR" --num-envs 16 \
    --out "$OUT/one_learner" --overwrite "${SMALL[@]}" 2>&1 | grep -E "^reward|Error|error" || true
echo "== torchrun: 2 learner ranks, 1 rollout actor each, on the same cluster"
torchrun --nproc_per_node 2 -m ppo_objectives.train --collector-backend ray --workers 1 --ray-address "$ADDR" \
    --no-shared-trunk --num-envs 8 --out "$OUT/torchrun" --overwrite "${SMALL[@]}" 2>&1 \
    | grep -E "^reward|identical|Error|error" || true
for run in one_learner torchrun; do
    test -f "$OUT/$run/metrics.csv" || { echo "FAILED: $run wrote no metrics.csv"; exit 1; }
    echo "$run: $(($(wc -l < "$OUT/$run/metrics.csv") - 1)) iterations in $OUT/$run/metrics.csv"
done
