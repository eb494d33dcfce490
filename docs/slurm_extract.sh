#!/usr/bin/env bash
# Extract a hidden-state cache to object storage on several nodes, then train a drafter from it.
# Submit: sbatch docs/slurm_extract.sh   (edit the paths, the bucket and the node count first)
#SBATCH --job-name=dflash
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1          # one torchrun agent per node; it starts one process per GPU
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --output=dflash-%j.log
set -euo pipefail

CACHE=s3://my-bucket/caches/qwen3.5-27b-sharegpt-fp8   # every node reads and writes this one cache
MODEL=/shared/models/Qwen3.5-27B
DATA=/shared/data/regenerated.jsonl
RUN=/shared/runs/drafter-$SLURM_JOB_ID                  # checkpoints: a folder every node can reach

# Credentials from the environment only (never on the command line): AWS_ACCESS_KEY_ID,
# AWS_SECRET_ACCESS_KEY, AWS_REGION, and AWS_ENDPOINT_URL for S3-compatible stores.
export AWS_REGION=${AWS_REGION:-us-east-1}
# Node-local scratch for the staging copy, the mirror and the tokenization (fast local NVMe).
export DFLASH_HOME=${SLURM_TMPDIR:-/tmp}/dflash-$SLURM_JOB_ID

HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=29500
launch() {  # srun starts one torchrun agent per node; c10d rendezvous on the first node
  srun --kill-on-bad-exit=1 bash -c "torchrun --nnodes $SLURM_NNODES --node-rank \$SLURM_NODEID \
    --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:$PORT --rdzv-id $SLURM_JOB_ID-$1 \
    $(command -v dflash) ${*:2}"
}

# Rerunning the same job resumes: samples already committed on the store are skipped (any node count).
launch extract extract --model "$MODEL" --data "$DATA" --output "$CACHE" --storage fp8 --no-progress
launch train train --cache "$CACHE" --model "$MODEL" --output "$RUN" --config configs/train_qwen3.5-27b.yaml
