# The job's setup lines, in one place: sourced by slurm/train.sbatch, slurm/sweep.sbatch (through it),
# slurm/pack.sbatch, every job of the SLURM launcher (hydra/launcher=slurm) and the `srun torchrun` form
# that scripts/torchrun_command.py --srun prints. Run from the project root, on the allocation's first node.

# Your site's modules, environment and network settings; then a cluster preset's setup lines
# (conf/cluster/<name>.yaml `setup:`, passed by scripts/submit.py --cluster): one home for them, not both.
source "$(dirname "${BASH_SOURCE[0]}")/site.sh"
if [ -n "${HPCTRAIN_CLUSTER_SETUP:-}" ]; then
    eval "${HPCTRAIN_CLUSTER_SETUP}"
fi

# srun (Slurm 22.05 and later) no longer takes --cpus-per-task from the job: without this, a step's tasks
# may get one CPU each (data loader workers and threads all on it). A value set before (a packed job's
# share of the node, your site.sh) stands.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
    export SRUN_CPUS_PER_TASK="${SRUN_CPUS_PER_TASK:-$SLURM_CPUS_PER_TASK}"
fi

# Rank 0 runs on this node (the allocation's first), on a port derived from the job id as Lightning derives
# it (15000 + the id's last four digits), over a wider range: every task computes the same port and nothing
# binds and releases one first (another process could take it meanwhile). Two jobs sharing a node meet only
# when their ids differ by a multiple of 15000; each point of a packed job (HPCTRAIN_PACK_POINT) takes its
# own, 7919 (a prime) further on. The range ends below 32768, where Linux's ephemeral ports begin.
# A MASTER_PORT set before (your site.sh, the submitting shell) stands.
MASTER_ADDR="${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1)}"
MASTER_PORT="${MASTER_PORT:-$((15000 + (${SLURM_JOB_ID:-0} + 7919 * ${HPCTRAIN_PACK_POINT:-0}) % 15000))}"
export MASTER_ADDR MASTER_PORT
