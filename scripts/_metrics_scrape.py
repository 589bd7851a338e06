"""Save one scrape of a daemon's metrics endpoint (unix:/path or host:port) and print its phase series.

    python3 scripts/_metrics_scrape.py ADDRESS OUTFILE

Used by the GPU-machine scripts after their restores (issue 26: the scrape holds the restore phases
of that run); stdlib only. Exits 1 when the scrape holds no restore phase.
"""

from __future__ import annotations

import socket
import sys


def scrape(address: str) -> bytes:
    if address.startswith("unix:"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(address.removeprefix("unix:"))
    else:
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)))
    with sock:
        sock.settimeout(10)
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: device\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"scrape failed: {head[:200]!r}")
    return body


def main() -> int:
    address, out = sys.argv[1], sys.argv[2]
    body = scrape(address)
    with open(out, "wb") as f:
        f.write(body)
    wanted = ("coldsnap_restore_phase_seconds_sum", "coldsnap_restore_phase_seconds_count",
              "coldsnap_capture_phase_seconds_sum", "coldsnap_provider_capsule_reports")
    lines = [line for line in body.decode().splitlines() if line.startswith(wanted)]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0 if any(line.startswith("coldsnap_restore_phase_seconds_count") for line in lines) else 1


if __name__ == "__main__":
    raise SystemExit(main())
