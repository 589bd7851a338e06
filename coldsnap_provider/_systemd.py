"""The bits of systemd's protocols we speak: sd_notify, the watchdog and LISTEN_FDS."""

from __future__ import annotations

import os
import socket

__all__ = ("SD_LISTEN_FDS_START", "listen_fds", "notify", "watchdog_interval")

SD_LISTEN_FDS_START = 3


def notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1") to $NOTIFY_SOCKET; False when not run by systemd."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.sendto(state.encode(), address)
        except OSError:
            return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between watchdog pings (half of WATCHDOG_USEC), or None when disabled."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2_000_000


def listen_fds() -> list[int]:
    """File descriptors passed by socket activation (and unset the variables, as sd_listen_fds does)."""
    pid, count = os.environ.get("LISTEN_PID", ""), os.environ.get("LISTEN_FDS", "")
    for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(key, None)
    if pid != str(os.getpid()) or not count.isdigit():
        return []
    fds = list(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + int(count)))
    for fd in fds:
        os.set_inheritable(fd, False)
    return fds
