"""One rank of test_multihost_netns, started by ``netns_hosts.run_ranks`` in torchrun's environment.

Runs the fixed program of ``output_digest_cases`` (normal dispatch with top-k, cached FP8 dispatch,
combine with weights and bias, padded dispatch and combine, BF16 and FP8 low-latency dispatch and
combine) and writes, as JSON to the path given as the last argument, its digest and what the rank saw
of its host: hostname, network interfaces, the bytes its host's ``GLOO_SOCKET_IFNAME`` sent meanwhile,
the remote IPv4 addresses of its network namespace's established TCP connections, the device of its
/dev/shm, and the node split of a ``Buffer``'s transport.
"""
import json
import os
import socket
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: run as a script, it imports helpers

import moe_comm  # noqa: E402

from helpers.output_digest_cases import output_digest  # noqa: E402

SEED = 7


def _ipv4(hex_address: str) -> str:
    """An address of /proc/net/tcp{,6} (little-endian 32-bit words in hex) as dotted IPv4; a v6
    address that is not v4-mapped stays as its hex."""
    if len(hex_address) == 8:
        return socket.inet_ntoa(struct.pack("<I", int(hex_address, 16)))
    if hex_address[:24].upper() == "0000000000000000FFFF0000":
        return socket.inet_ntoa(struct.pack("<I", int(hex_address[24:], 16)))
    return hex_address


def tcp_peers() -> set[str]:
    """Remote addresses of the established TCP connections of this process's network namespace."""
    peers = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "01":  # ESTABLISHED
                    peers.add(_ipv4(fields[2].split(":")[0]))
    return peers


def main(report_path: str) -> None:
    group = moe_comm.init_from_env(timeout_s=60)
    sent_bytes = Path("/sys/class/net", os.environ["GLOO_SOCKET_IFNAME"], "statistics", "tx_bytes")
    before = int(sent_bytes.read_text())
    digest = output_digest(group, SEED)
    sent = int(sent_bytes.read_text()) - before
    buf = moe_comm.Buffer(group, explicitly_destroy=True)
    report = {"digest": digest, "hostname": socket.gethostname(),
              "interfaces": sorted(name for _, name in socket.if_nameindex()), "if_tx_bytes": sent,
              "tcp_peers": sorted(tcp_peers()), "shm_device": os.stat("/dev/shm").st_dev,
              "transport": buf.transport_name, "nodes": buf.runtime.transport.nodes,
              "internode": buf.topology.internode}
    buf.destroy()
    tmp = report_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, report_path)  # the launcher takes a report that exists as complete


if __name__ == "__main__":
    main(sys.argv[-1])
