# Sourced by slurm/train.sbatch, slurm/sweep.sbatch and the jobs of hydra/launcher=slurm before anything runs:
# your site's modules, your environment, and settings every job needs.

# ---- load modules and activate your environment here ---------------------------------------------
# module load cuda/12.4
# source ~/miniconda3/etc/profile.d/conda.sh && conda activate my_env
# The project's .venv by its absolute path (a job submitted with scripts/submit.py runs from a snapshot
# of the code, which holds no venv; HPCTRAIN_PROJECT_ROOT names the project).
venv="${HPCTRAIN_PROJECT_ROOT:-.}/.venv"
if [ -z "${VIRTUAL_ENV:-}" ] && [ -z "${CONDA_PREFIX:-}" ] && [ -f "$venv/bin/activate" ]; then
    source "$venv/bin/activate"
fi

# A wandb-core service named by the submitting shell (a notebook's, on the login node) is not this job's.
unset WANDB_SERVICE
export PYTHONFAULTHANDLER=1                                  # stack traces on crashes and hangs
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"  # a failed collective ends the job
# Network interfaces, when a node's hostname resolves to an address the other nodes cannot reach
# (127.0.1.1, a management network). Every multi-node run checks gloo's before it starts: without
# GLOO_SOCKET_IFNAME it takes NCCL_SOCKET_IFNAME's interface, else the one this node reaches rank 0
# through, and says so; a name no interface of the node has is one sentence. Set them here to choose.
# export NCCL_SOCKET_IFNAME=ib0      # nccl: the GPUs' collectives
# export GLOO_SOCKET_IFNAME=ib0      # gloo: the requeue signal, folder saves (and CPU jobs' collectives)
