"""What the process group's backends are told about the network: where rank 0 listens, which interface
gloo and NCCL use, and where NCCL's flight recorder writes."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from hpctrain.runtime.environment.reading import variables


def network_summary(num_nodes: int, env: Mapping[str, str] | None = None, hostname: str | None = None) -> str:
    """One line saying where rank 0 listens and which interface each backend uses, with a warning when a
    multi-node job's gloo would use a loopback address (the others could not reach it: a silent wait)."""
    env = variables(env)
    host = hostname or socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        address = "unresolved"
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        master = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    else:  # the template's local launcher picks a free port when it starts the other ranks
        where = "this machine" if num_nodes <= 1 else "the first node"
        master = f"{env.get('MASTER_ADDR') or where}, on a free port chosen when the ranks start"
    gloo = (
        f"GLOO_SOCKET_IFNAME={env['GLOO_SOCKET_IFNAME']}"
        if env.get("GLOO_SOCKET_IFNAME")
        else f"the address of {host} ({address})"
    )
    nccl = (
        f"NCCL_SOCKET_IFNAME={env['NCCL_SOCKET_IFNAME']}"
        if env.get("NCCL_SOCKET_IFNAME")
        else "its own choice (InfiniBand first, else a non-loopback interface)"
    )
    line = f"network: rank 0 at {master}; gloo uses {gloo}; nccl uses {nccl}"
    if num_nodes > 1 and not env.get("GLOO_SOCKET_IFNAME") and address.startswith("127."):
        line += (
            f"; warning: {host} resolves to {address}, a loopback address other nodes cannot reach: "
            "set GLOO_SOCKET_IFNAME (slurm/train.sbatch) unless every node is this machine"
        )
    return line


FLIGHT_RECORDER_DIR = "flight_recorder"


def flight_recorder_dumps_into(run_dir: str | Path, env: MutableMapping[str, str] | None = None) -> None:
    """NCCL's flight recorder (the last collectives of each rank, written when a collective times out)
    writes into `<run dir>/flight_recorder/rank<N>`, unless the environment already says where. Set
    before the process group exists (NCCL reads it then); slurm/train.sbatch turns the recorder on."""
    env = os.environ if env is None else env
    if "TORCH_FR_DUMP_TEMP_FILE" not in env:
        folder = Path(run_dir) / FLIGHT_RECORDER_DIR
        folder.mkdir(parents=True, exist_ok=True)  # NCCL writes the files, not the folder
        env["TORCH_FR_DUMP_TEMP_FILE"] = f"{folder}/rank"
