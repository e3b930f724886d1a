#!/usr/bin/env bash
# A multi-node `sat train` inside one SLURM allocation, through Ray (docs/gpus.md): Ray's head on
# the allocation's first node, a Ray worker on every other node (srun, one task per node, the
# node's GPUs), then `sat train launcher=ray launcher.address=HEAD:PORT ARGS...` here (the first
# node), then `ray stop` on every node. sat places its trainer nodes and SGLang servers on the
# Ray cluster as the device plan says (`sat plan ... launcher=ray` prints the bundles).
#
#   sbatch --nodes=2 --gpus-per-node=8 --cpus-per-task=64 --wrap \
#     "scripts/ray_in_slurm.sh experiment=paper_qwen3_30b_a3b trainer.nnodes=2 engine.num_servers=2"
#
# Environment: RAY_PORT (6379), RAY_START_TIMEOUT_S (120: every node joined), SAT (sat), RAY (ray).
set -euo pipefail
PORT="${RAY_PORT:-6379}"
DEADLINE_S="${RAY_START_TIMEOUT_S:-120}"
SAT="${SAT:-sat}"
RAY="${RAY:-ray}"
if ! [[ "$PORT" =~ ^[0-9]+$ && "$PORT" -ge 1 && "$PORT" -le 65535 && "$DEADLINE_S" =~ ^[0-9]+$ ]]; then
  echo "ray_in_slurm.sh: RAY_PORT=$PORT must be a port (1-65535) and RAY_START_TIMEOUT_S=$DEADLINE_S whole seconds" >&2
  exit 2
fi
if [[ -z "${SLURM_JOB_NODELIST:-}" ]]; then
  echo "ray_in_slurm.sh: not inside a SLURM allocation (no SLURM_JOB_NODELIST): run it with sbatch or salloc" >&2
  exit 2
fi
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD="${NODES[0]}"
HEAD_IP="$(srun --nodes=1 --ntasks=1 -w "$HEAD" hostname --ip-address | awk '{print $1}')"
GPUS="${SLURM_GPUS_ON_NODE:-0}"
echo "ray_in_slurm.sh: ${#NODES[@]} node(s) ${NODES[*]}; head $HEAD ($HEAD_IP:$PORT), $GPUS GPU(s) per node"
PIDS=()
cleanup() {
  for node in "${NODES[@]}"; do
    srun --nodes=1 --ntasks=1 -w "$node" "$RAY" stop >/dev/null 2>&1 || true
  done
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
srun --nodes=1 --ntasks=1 -w "$HEAD" "$RAY" start --head --node-ip-address="$HEAD_IP" \
  --port="$PORT" --num-gpus="$GPUS" --block &
PIDS+=($!)
for node in "${NODES[@]:1}"; do
  srun --nodes=1 --ntasks=1 -w "$node" "$RAY" start --address="$HEAD_IP:$PORT" \
    --num-gpus="$GPUS" --block &
  PIDS+=($!)
done
# wait (bounded) until every node has joined
start=$SECONDS
until [[ "$("$RAY" status --address="$HEAD_IP:$PORT" 2>/dev/null | grep -c ' node_')" -ge "${#NODES[@]}" ]]; do
  if (( SECONDS - start > DEADLINE_S )); then
    echo "ray_in_slurm.sh: not every node joined the Ray cluster within ${DEADLINE_S} s" >&2
    exit 1
  fi
  sleep 2
done
"$SAT" train launcher=ray "launcher.address=$HEAD_IP:$PORT" "$@"
