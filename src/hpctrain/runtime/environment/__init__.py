"""The one place that reads the cluster's environment: what SLURM, torchrun and Lightning's launcher set
for this process, and what SLURM says when asked. No module here imports torch or Lightning, so the
preflight answers before any heavy import or process group.

    launched       where and how this process was launched: launcher, ranks, SLURM job and array ids,
                   restarts, packed point, run id, node name, project root
    allocated      what it was allocated: visible GPUs, CPUs per process, the job's granted resources
    network        what the backends are told: rank 0's address, gloo's and NCCL's interfaces, NCCL's
                   flight recorder
    devices        the GPUs this process sees (CUDA_VISIBLE_DEVICES mapped to NVML's), their architectures
    cuda           whether the installed torch's CUDA build runs on this node's driver and its GPUs
    launch_checks  whether the launcher starts the processes the trainer config expects (preflight)
    slurm_job      what SLURM says about this job (scontrol, squeue) and what it is asked (requeue, signal)
    pack_shares    how a packed job's node is shared between its points
    variables      the variables they read: the process's environment, or a mapping given instead
"""
