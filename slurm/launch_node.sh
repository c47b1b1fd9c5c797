#!/usr/bin/env bash
# One node's part of a multi-node job: `accelerate launch` with this node's rank, the job's size and the head
# node's address, all taken from the scheduler. srun runs it once per node (see finetune.sbatch); on plain hosts
# set the same variables by hand (README, "Several nodes").
#
#   slurm/launch_node.sh CONFIG RECIPE [recipe flags...]
#
# SLURM_NODEID, SLURM_NNODES  this node's index and the node count (srun sets them)
# MAIN_ADDR, MAIN_PORT        the head node's address and a free port on it (finetune.sbatch sets them)
# GPUS_PER_NODE               processes per node (default: SLURM_GPUS_ON_NODE, else the GPUs nvidia-smi lists)
# MESH_FLAGS                  model-parallel sizes replacing the config's, e.g. --parallelism_config_sp_size=4 for
#                             zero3_sp.yaml's sp 8 on nodes of 4 GPUs (optional)
set -euo pipefail

config=${1:?usage: slurm/launch_node.sh CONFIG RECIPE [recipe flags...]}
recipe=${2:?usage: slurm/launch_node.sh CONFIG RECIPE [recipe flags...]}
shift 2
node=${SLURM_NODEID:?not set: run under srun, or export SLURM_NODEID (0 on the head node)}
nodes=${SLURM_NNODES:?not set: run under srun, or export SLURM_NNODES}
addr=${MAIN_ADDR:?not set: the head node address (finetune.sbatch sets it)}
port=${MAIN_PORT:-29500}
per_node=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
if [ -z "$per_node" ]; then  # the GPUs nvidia-smi lists (not their MIG slices); none where it is missing, whose
  # 127 under pipefail would end the script without a word
  per_node=$({ nvidia-smi -L 2>/dev/null || true; } | grep -c '^GPU ' || true)
  if [ "$per_node" = 0 ]; then
    echo "error: no GPUs found on $(hostname) (GPUS_PER_NODE and SLURM_GPUS_ON_NODE unset, nvidia-smi lists none):" \
      "export GPUS_PER_NODE=N, the processes to start on each node" >&2
    exit 2
  fi
fi

# Checked before anything starts: a node id out of range (counted from 1, by hand) would wait out the rendezvous
# for a rank that no node has.
integer() {  # integer NAME VALUE LOWEST HIGHEST WHAT: VALUE in decimal (08 is not bash's octal), or one error line
  case $2 in
    '' | *[!0-9]*) ;;
    *) if [ "$((10#$2))" -ge "$3" ] && [ "$((10#$2))" -le "$4" ]; then echo "$((10#$2))" && return; fi ;;
  esac
  echo "error: $1=$2 is not an integer from $3 to $4: export $1 as $5" >&2
  exit 2
}
nodes=$(integer SLURM_NNODES "$nodes" 1 100000 "the job's node count")
per_node=$(integer GPUS_PER_NODE "$per_node" 1 1024 "the processes to start on each node")
node=$(integer SLURM_NODEID "$node" 0 $((nodes - 1)) "this node's id, counted from 0 (the head node's)")

# Preemption (toolkit/training/stopping.py): `toolkit launch` has torch's launcher forward SLURM's warning signal
# (USR1) to the training processes, not just SIGTERM, gives them TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (300
# unless set) to finish a step and write a checkpoint before killing them, and then exits 75
# (toolkit/distributed/launcher.py).

# A config with a mesh (parallelism_config) keeps its model-parallel axes and gets data-parallel sizes for the job
# (`python -m toolkit mesh`, settings/mesh.py's job_mesh): HYBRID_SHARD replicates across the nodes and shards
# inside each, FSDP2 x TP shards over the replicas, TP alone replicates; one line of error where it cannot fit.
# shellcheck disable=SC2086  # the flags are words
mesh=$(python -m toolkit mesh "$config" --nodes "$nodes" --gpus_per_node "$per_node" ${MESH_FLAGS:-})
# `python -m toolkit launch` is accelerate launch ending on the failed rank's own exit code, without a traceback.
# shellcheck disable=SC2086
exec python -m toolkit launch --config_file "$config" \
  --num_machines "$nodes" --num_processes $((nodes * per_node)) --machine_rank "$node" \
  --main_process_ip "$addr" --main_process_port "$port" $mesh \
  "$recipe" "$@"
