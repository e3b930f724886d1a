#!/usr/bin/env bash
# A multi-node `sat train` inside one SLURM allocation, through Ray (docs/gpus.md): Ray's head on
# the allocation's first node, a Ray worker on every other node (srun, one task per node, the
# node's GPUs), then `sat train launcher=ray launcher.address=HEAD:PORT ARGS...` here (the first
# node), then this job's Ray processes stopped on every node. sat places its trainer nodes and
# SGLang servers on the Ray cluster as the device plan says (`sat plan ... launcher=ray` prints
# the bundles).
#
# Ray runs under a temp dir of its own per job (RAY_TMPDIR=/tmp/sat-ray-JOBID on every node), and
# the end stops the processes that carry it, not `ray stop`: that stops every Ray process of the
# user on the node (it matches process names), another job's cluster on a shared node included.
#
#   sbatch --nodes=2 --gpus-per-node=8 --cpus-per-task=64 --wrap \
#     "scripts/ray_in_slurm.sh experiment=paper_qwen3_30b_a3b trainer.nnodes=2 engine.num_servers=2"
#
# Environment: RAY_PORT (6379), RAY_START_TIMEOUT_S (120: every node joined), SAT (sat), RAY (ray),
# SAT_RAY_TMPDIR (/tmp/sat-ray-$SLURM_JOB_ID: Ray's temp dir on every node; keep it short, Ray's
# socket paths must stay under 107 bytes).
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
RAY_DIR="${SAT_RAY_TMPDIR:-/tmp/sat-ray-${SLURM_JOB_ID:-$$}}"
if ! [[ "$RAY_DIR" =~ ^/[A-Za-z0-9._/-]+$ && ${#RAY_DIR} -le 64 ]]; then
  echo "ray_in_slurm.sh: SAT_RAY_TMPDIR=$RAY_DIR must be an absolute path of at most 64 characters [A-Za-z0-9._/-]" >&2
  exit 2
fi
# on one node: SIGTERM every process whose environment carries RAY_TMPDIR=$1, SIGKILL what is
# left after 15 s (Ray's own grace for `ray stop` is 16 s)
STOP_JOB_RAY='mark="RAY_TMPDIR=$1"
ours() { for p in /proc/[0-9]*; do
  tr "\0" "\n" < "$p/environ" 2>/dev/null | grep -qxF "$mark" && echo "${p#/proc/}"; done; }
for sig in TERM KILL; do
  for pid in $(ours); do kill -s "$sig" "$pid" 2>/dev/null || true; done
  for _ in $(seq 75); do [ -z "$(ours)" ] && exit 0; sleep 0.2; done
done'
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD="${NODES[0]}"
HEAD_IP="$(srun --nodes=1 --ntasks=1 -w "$HEAD" hostname --ip-address | awk '{print $1}')"
GPUS="${SLURM_GPUS_ON_NODE:-0}"
echo "ray_in_slurm.sh: ${#NODES[@]} node(s) ${NODES[*]}; head $HEAD ($HEAD_IP:$PORT), $GPUS GPU(s) per node"
PIDS=()
cleanup() {
  for node in "${NODES[@]}"; do
    # --overlap: the node's CPUs are held by its `ray start` step, a new step would wait for them
    timeout 60 srun --overlap --nodes=1 --ntasks=1 -w "$node" \
      bash -c "$STOP_JOB_RAY" stop "$RAY_DIR" >/dev/null 2>&1 || true
  done
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
srun --nodes=1 --ntasks=1 -w "$HEAD" env RAY_TMPDIR="$RAY_DIR" "$RAY" start --head --node-ip-address="$HEAD_IP" \
  --port="$PORT" --num-gpus="$GPUS" --block &
PIDS+=($!)
for node in "${NODES[@]:1}"; do
  srun --nodes=1 --ntasks=1 -w "$node" env RAY_TMPDIR="$RAY_DIR" "$RAY" start --address="$HEAD_IP:$PORT" \
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
