"""What the process group's backends are told about the network: where rank 0 listens, which interface
gloo and NCCL use, and where NCCL's flight recorder writes.

Every multi-rank job uses gloo, nccl jobs included: the requeue signal and folder saves go through gloo
side groups. Without GLOO_SOCKET_IFNAME gloo binds to whatever the node's hostname resolves to; where
that is a management network or a loopback address the other nodes cannot reach, the group's setup
waits out its whole timeout. `settle_gloo_interface` (preflight, every rank of a multi-node job) makes
gloo's interface the one the job already reaches rank 0 through, or NCCL's, or stops in one sentence.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from hpctrain.runtime.environment.variables import variables
from hpctrain.runtime.errors import UserError


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


@dataclass(frozen=True)
class NetworkFacts:
    """What this node's network looks like to gloo (`network_facts`; a test gives its own)."""

    host: str  # the hostname
    interfaces: dict[str, str | None]  # each interface's IPv4 address (None: it has none)
    host_address: str | None  # what the hostname resolves to (gloo's default): None if nothing
    master_address: str | None  # what MASTER_ADDR resolves to, if it is set
    route_address: str | None  # the address of this node the kernel sends from toward MASTER_ADDR
    slurm_node: str | None = None  # SLURMD_NODENAME: a node of its own, or one of several slurmd of one host

    def interface_of(self, address: str | None) -> str | None:
        return next((name for name, ip in sorted(self.interfaces.items()) if ip and ip == address), None)

    def listed(self) -> str:
        return ", ".join(f"{n} ({a})" if a else n for n, a in sorted(self.interfaces.items())) or "none"


_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def _ipv4(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _resolve(name: str | None) -> str | None:
    if not name:
        return None
    try:
        return socket.gethostbyname(name)
    except OSError:
        return None


def network_facts(env: Mapping[str, str] | None = None) -> NetworkFacts:
    """This node's interfaces, what its hostname and MASTER_ADDR resolve to, and the local address the
    kernel would send from toward rank 0 (a UDP connect: a route lookup, no packet sent)."""
    env = variables(env)
    host = socket.gethostname()
    interfaces = {name: _ipv4(name) for _, name in socket.if_nameindex()}
    master = _resolve(env.get("MASTER_ADDR"))
    route = None
    if master:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, int(env.get("MASTER_PORT") or 9)))
            route = probe.getsockname()[0]
    return NetworkFacts(host, interfaces, _resolve(host), master, route, env.get("SLURMD_NODENAME"))


def _loopback(address: str | None) -> bool:
    try:
        return address is not None and ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def nccl_matches(spec: str, interfaces: Mapping[str, str | None]) -> list[str]:
    """The interfaces NCCL_SOCKET_IFNAME names, as NCCL reads it: prefixes (`ib` is ib0, ib1), `=` for
    exact names, `^` for all but these; loopback only where named."""
    exact, exclude = spec.startswith("=") or spec.startswith("^="), spec.startswith("^")
    names = [n for n in spec.lstrip("^").lstrip("=").split(",") if n]

    def named(interface: str) -> bool:
        return any(interface == n if exact else interface.startswith(n) for n in names)

    found = [i for i in sorted(interfaces) if named(i) != exclude]
    return [i for i in found if named(i) or not _loopback(interfaces[i])]


GLOO_FIX = "set GLOO_SOCKET_IFNAME (slurm/site.sh) to the interface the nodes share"


def settle_gloo_interface(
    num_nodes: int | None, env: MutableMapping[str, str] | None = None, facts: NetworkFacts | None = None
) -> str | None:
    """Before a multi-node job's process group: the interface gloo binds to on this node, checked or
    chosen. GLOO_SOCKET_IFNAME, if set, must name interfaces of this node with an address; else gloo
    takes NCCL_SOCKET_IFNAME's interface; else the one this node reaches rank 0 through, where the
    hostname resolves elsewhere. Sets GLOO_SOCKET_IFNAME when it chose one and returns a line saying so;
    raises UserError (one sentence) where no interface can serve. Every node on this one machine (all
    addresses loopback, the tests' cluster) needs nothing."""
    env = os.environ if env is None else env
    if not num_nodes or num_nodes <= 1:
        return None
    facts = facts or network_facts(env)
    where = f"{facts.host} (its interfaces: {facts.listed()})"
    if env.get("GLOO_SOCKET_IFNAME"):
        named = [n.strip() for n in env["GLOO_SOCKET_IFNAME"].split(",") if n.strip()]
        unusable = [n for n in named if not facts.interfaces.get(n)]
        if unusable:
            raise UserError(
                f"GLOO_SOCKET_IFNAME={env['GLOO_SOCKET_IFNAME']} names {unusable[0]}, which is no interface "
                f"with an IPv4 address on {where}, so gloo cannot bind there; {GLOO_FIX} (NCCL_SOCKET_IFNAME's, if set)."
            )
        return None
    if env.get("NCCL_SOCKET_IFNAME"):
        spec = env["NCCL_SOCKET_IFNAME"]
        usable = [i for i in nccl_matches(spec, facts.interfaces) if facts.interfaces[i]]
        if not usable:
            raise UserError(
                f"NCCL_SOCKET_IFNAME={spec} matches no interface with an IPv4 address on {where}, so neither "
                f"NCCL nor gloo can use it; set NCCL_SOCKET_IFNAME (slurm/site.sh) to the interface the nodes share."
            )
        env["GLOO_SOCKET_IFNAME"] = usable[0]
        return f"gloo uses {usable[0]} ({facts.interfaces[usable[0]]}) on {facts.host}, as NCCL_SOCKET_IFNAME={spec}"
    if _loopback(facts.master_address) and _loopback(facts.host_address):
        return _loopback_everywhere(env, facts, where)
    route_interface = facts.interface_of(facts.route_address)
    if facts.route_address and facts.route_address == facts.host_address:
        return None  # gloo's default, the hostname's address, is the one that reaches rank 0
    if route_interface is not None and not _loopback(facts.route_address):
        env["GLOO_SOCKET_IFNAME"] = route_interface
        resolved = facts.host_address or "no address"
        return (
            f"gloo uses {route_interface} ({facts.route_address}) on {facts.host}, the interface that reaches rank 0 "
            f"at {env.get('MASTER_ADDR')}, not {resolved} that {facts.host} resolves to"
        )
    unbindable = facts.interface_of(facts.host_address) is None and not _loopback(facts.host_address)
    if facts.host_address is None or unbindable:
        raise UserError(
            f"{facts.host} resolves to {facts.host_address or 'no address'}, which no interface of {where} has, "
            f"and MASTER_ADDR={env.get('MASTER_ADDR', 'unset')} shows no other, so gloo (the requeue signal's and "
            f"folder saves' groups) has nothing to bind to; {GLOO_FIX}."
        )
    return None


def _loopback_everywhere(env: MutableMapping[str, str], facts: NetworkFacts, where: str) -> str | None:
    """Rank 0 and the hostname both resolve to loopback: every node on this one machine (torchrun by hand,
    the tests' cluster of several slurmd on one host), or rank 0's own node of a real cluster, whose name
    its /etc/hosts gives 127.0.1.1, where gloo would bind loopback and the other nodes wait for it. There,
    the one interface with an address is gloo's; with several, the user names it."""
    one_machine = facts.slurm_node is None or facts.slurm_node.split(".")[0] != facts.host.split(".")[0]
    if one_machine:
        return None
    reachable = [n for n, a in sorted(facts.interfaces.items()) if a and not _loopback(a)]
    if len(reachable) == 1:
        env["GLOO_SOCKET_IFNAME"] = reachable[0]
        return (
            f"gloo uses {reachable[0]} ({facts.interfaces[reachable[0]]}) on {facts.host}, its one interface other "
            f"nodes can reach, not {facts.host_address}, a loopback address that {facts.host} resolves to"
        )
    raise UserError(
        f"{facts.host} and MASTER_ADDR={env.get('MASTER_ADDR')} resolve to {facts.host_address} here, a loopback "
        f"address the other nodes cannot reach, and {where} has {len(reachable)} others; {GLOO_FIX}."
    )
