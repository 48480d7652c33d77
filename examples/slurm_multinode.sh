#!/usr/bin/env bash
# N nodes x 8 GPUs under SLURM: one torchrun per node, meeting through a c10d rendezvous on the first node.
#
#   sbatch --nodes=4 examples/slurm_multinode.sh train_dit.py --config-name recipes/flow_grpo_fast_ocr \
#       trainer.strategy=fsdp trainer.output_dir=/shared/runs/ocr-fsdp
#
# The run is the same as one node's (`tests/test_multinode.py` checks, on one machine, that two single-process
# "nodes" write the metrics one two-process launch writes, under DDP and FSDP). What every node must see at
# the same path (shared storage): the model (HF_HOME / the hub cache, or a local `model.name` folder; nothing
# downloads on the other nodes while rank 0 fetches), the prompt files (`data.prompt_file`,
# `eval.prompt_file`), a prior cache (`data.prior_cache`), chained weights (`model.ar_weights` /
# `model.dit_weights`) and `trainer.output_dir` (rank 0 writes checkpoints and logs there; every rank reads
# the checkpoint it resumes from, and writes its own RNG state). Give `trainer.output_dir` explicitly: the
# default name has a timestamp, chosen by rank 0 and broadcast, which is fine, but a fixed folder is what
# `trainer.resume=latest` continues after a requeue (`--requeue`; SIGUSR1 via `--signal=USR1@90` makes the
# run checkpoint and exit 0 before the time limit).
#
#SBATCH --job-name=glm-training
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --signal=USR1@90
#SBATCH --requeue
set -euo pipefail

SCRIPT=${1:?usage: sbatch --nodes=N examples/slurm_multinode.sh train_dit.py|train_ar.py [key=value ...]}
shift
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
PYTHON=${PYTHON:-.venv/bin/python}
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=${PORT:-29500}
# One torchrun per node (srun starts one task per node); the rendezvous assigns the global ranks.
srun --kill-on-bad-exit=1 "$PYTHON" -m torch.distributed.run \
    --nnodes="$SLURM_JOB_NUM_NODES" \
    --nproc_per_node="$GPUS_PER_NODE" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="$HEAD:$PORT" \
    --rdzv-id="$SLURM_JOB_ID" \
    "$SCRIPT" "$@"
