"""The Ray side of a Slurm job, run by the sbatch script (slurm/ray-train.sbatch) on its nodes:

    python -m megatron_rlvr.launch.ray_join address          # on the head node: "IP PORT"
    python -m megatron_rlvr.launch.ray_join wait ADDR N [--timeout-s S]

`wait` connects to the cluster and prints one line per node as it joins, then exits 0 once
N nodes are alive, or 1 with the missing count when the timeout passes first. Nodes are
named by the `slurm-node` label the script gives each `ray start`.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time

NODE_LABEL = "slurm-node"


def head_address() -> tuple[str, int]:
    """This node's address as Ray sees it, and a free port for the head's GCS."""
    import ray.util

    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return ray.util.get_node_ip_address(), port


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
    sub.add_parser("address", help="print this node's IP and a free port")
    wait = sub.add_parser("wait", help="wait until N Ray nodes are alive")
    wait.add_argument("address")
    wait.add_argument("count", type=int)
    wait.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    if args.command == "address":
        ip, port = head_address()
        print(ip, port)
        return 0
    return 0 if wait_for_nodes(args.address, args.count, args.timeout_s) else 1


if __name__ == "__main__":
    sys.exit(main())
