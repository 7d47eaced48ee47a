"""The Ray side of a Slurm job, run by the sbatch script (slurm/ray-train.sbatch) on its nodes:

    python -m megatron_rlvr.launch.ray_join address [--iface IF]   # on the head node: "IP PORT"
    python -m megatron_rlvr.launch.ray_join wait-head ADDR [--timeout-s S]
    python -m megatron_rlvr.launch.ray_join wait ADDR N [--timeout-s S]

`address` takes the IPv4 address of the given interface (the one Ray, NCCL and gloo are told
to use), else the address Ray would pick. `wait-head` returns once the head's port accepts a
connection, so workers are started against a head that is up (Ray's own retries give up after
about 20 s). `wait` connects to the cluster and prints one line per node as it joins, then
exits 0 once N nodes are alive, or 1 with the missing count when the timeout passes first.
Nodes are named by the `slurm-node` label the script gives each `ray start`.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time

from megatron_rlvr.errors import UserError

NODE_LABEL = "slurm-node"


class JoinError(UserError, RuntimeError):
    """The head's address cannot be had, said in one line."""


def interface_ip(iface: str) -> str:
    """The IPv4 address of network interface `iface` on this node."""
    import psutil

    addresses = psutil.net_if_addrs()
    if iface not in addresses:
        raise JoinError(f"--iface {iface}: no such network interface here (there are: {', '.join(sorted(addresses))})")
    for address in addresses[iface]:
        if address.family == socket.AF_INET:
            return address.address
    raise JoinError(f"--iface {iface}: the interface has no IPv4 address")


def head_address(iface: str = "") -> tuple[str, int]:
    """This node's address for the other nodes (the interface's, given one; else the one Ray
    picks), and a free port for the head's GCS."""
    if iface:
        ip = interface_ip(iface)
    else:
        import ray.util

        ip = ray.util.get_node_ip_address()
        if ip.startswith("127."):
            print(
                f"ray_join: the head's address is {ip}, a loopback address other nodes cannot reach; "
                "give submit --iface (e.g. ib0 or eth0)",
                file=sys.stderr,
            )
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return ip, port


def wait_for_head(address: str, timeout_s: float, poll_s: float = 0.5) -> bool:
    """True once the head at IP:PORT accepts a TCP connection; False after timeout_s."""
    host, _, port = address.rpartition(":")
    start = time.monotonic()
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(5.0, timeout_s)):
                print(f"ray head answering at {address} after {time.monotonic() - start:.1f} s", flush=True)
                return True
        except OSError as err:
            if time.monotonic() - start > timeout_s:
                print(f"ray: the head at {address} did not answer within {timeout_s:g} s ({err})", flush=True)
                return False
        time.sleep(poll_s)


def describe(node: dict) -> str:
    name = node.get("Labels", {}).get(NODE_LABEL) or node["NodeManagerHostname"]
    res = node.get("Resources", {})
    return (
        f"{name} at {node['NodeManagerAddress']}:{node['NodeManagerPort']} "
        f"({res.get('CPU', 0):g} CPUs, {res.get('GPU', 0):g} GPUs)"
    )


def wait_for_nodes(address: str, count: int, timeout_s: float, poll_s: float = 0.5) -> bool:
    """Prints each node as it joins; True once `count` nodes are alive."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # as the nodes were started (see the script)
    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        seen: set[str] = set()
        deadline = time.monotonic() + timeout_s
        while True:
            alive = [n for n in ray.nodes() if n["Alive"]]
            for node in alive:
                if node["NodeID"] not in seen:
                    seen.add(node["NodeID"])
                    print(f"ray node joined: {describe(node)} [{len(seen)}/{count}]", flush=True)
            if len(alive) >= count:
                return True
            if time.monotonic() > deadline:
                print(
                    f"ray: {count - len(alive)} of {count} nodes did not join within "
                    f"{timeout_s:g} s (see the ray-*.log files beside this log)",
                    flush=True,
                )
                return False
            time.sleep(poll_s)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_rlvr.launch.ray_join")
    sub = parser.add_subparsers(dest="command", required=True)
    address = sub.add_parser("address", help="print this node's IP and a free port")
    address.add_argument("--iface", default="", help="take this network interface's IPv4 address")
    head = sub.add_parser("wait-head", help="wait until the head's port accepts connections")
    head.add_argument("address")
    head.add_argument("--timeout-s", type=float, default=300.0)
    wait = sub.add_parser("wait", help="wait until N Ray nodes are alive")
    wait.add_argument("address")
    wait.add_argument("count", type=int)
    wait.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    if args.command == "address":
        try:
            ip, port = head_address(args.iface)
        except JoinError as err:
            print(f"ray_join: {err}", file=sys.stderr)
            return 1
        print(ip, port)
        return 0
    if args.command == "wait-head":
        return 0 if wait_for_head(args.address, args.timeout_s) else 1
    return 0 if wait_for_nodes(args.address, args.count, args.timeout_s) else 1


if __name__ == "__main__":
    sys.exit(main())
