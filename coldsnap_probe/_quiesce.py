"""What a capture checks in a server it does not control before locking anything (issue 23).

A server people run unchanged has no quiesce call: the worker waits, within a bound, for its open requests
(established TCP connections) to end and otherwise refuses naming them, and refuses a process holding an
io_uring instance (CRIU cannot dump one), noting which run uvloop. Both read /proc only.
"""

from __future__ import annotations

import time
from pathlib import Path

from ._process import endpoint, tree_sockets
from .errors import WorkerError

IDLE_WAIT_S = 5.0  # how long a capture waits for a server's open requests to finish
ESTABLISHED = "01"  # /proc/net/tcp's state column


def open_connections(tree: list[int]) -> list[str]:
    """The tree's established TCP connections (a request being served), as `process P fd F local <- peer`."""
    return [f"process {pid} fd {fd} {endpoint(fields[1])} <- {endpoint(fields[2])}"
            for pid, fd, _, fields in tree_sockets(tree, ("tcp", "tcp6")) if fields[3] == ESTABLISHED]


def wait_idle(tree: list[int], bound: float) -> None:
    """Wait up to `bound` seconds for the tree's open requests to finish, else refuse naming them (CRIU cannot
    carry an established connection into another unit; its client would hang)."""
    deadline = time.monotonic() + bound
    while open_ := open_connections(tree):
        if time.monotonic() >= deadline:
            raise WorkerError(f"capture refused: the server still has {len(open_)} open connection(s) after "
                              f"waiting {bound:g} s for its requests to finish: " + "; ".join(open_[:8]))
        time.sleep(0.05)


def event_loops(tree: list[int]) -> dict[str, str]:
    """Refuse a process holding an io_uring instance (CRIU cannot dump one; refused before anything is locked,
    naming the process); the processes running uvloop, `{pid: "uvloop"}`, for the capture report."""
    found = {}
    for pid in tree:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        if "anon_inode:[io_uring]" in maps:
            raise WorkerError(f"capture refused: process {pid} holds an io_uring instance, which CRIU cannot dump "
                              "(uvloop's libuv keeps one for epoll batching unless the server's unit preloads "
                              "/opt/coldsnap/lib/libcoldsnap_no_io_uring.so: docs/restoring-your-own-server.md)")
        if "/uvloop/loop." in maps:
            found[str(pid)] = "uvloop"
    return found
