"""A node hydrator's peer as the kernel sees it (`PeerView`): the files the asking process could open itself,
opened in its own view and decided by the kernel, never by "uid 0 reads everything".

Why: the hydrator runs as root for peers that may not be, and uid 0 on SO_PEERCRED is not enough: root in
another container (another mount namespace) cannot see a tenant's 0600 weights, and root without
CAP_DAC_OVERRIDE cannot read them. So the files a peer names are opened by a thread of the hydrator's own that
first takes the peer's view, and only then:

* its root: a path resolves beneath the peer's root directory, `/proc/<pid>/root` (which lies in the peer's mount
  namespace), through openat2 with RESOLVE_IN_ROOT (absolute links and `..` stay inside it) and
  RESOLVE_NO_MAGICLINKS; a peer this hydrator's pid namespace cannot see (SO_PEERCRED's pid is 0: a hydrator in
  a container of its own) has its mount namespace joined through its pidfd instead (`setns`, after
  `unshare(CLONE_FS)`, which only this thread does);
* its credentials: the fsuid, fsgid and supplementary groups it connected with (SO_PEERCRED, SO_PEERGROUPS),
  and of the capabilities only CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, only those the peer holds now, in this
  hydrator's user namespace (/proc/<pid>/status); a peer in another user namespace, or one the hydrator cannot
  see, gets neither;

then each path is opened O_PATH (a FIFO or device is never opened for reading), refused unless a regular file,
and reopened for reading through this process's /proc/self/fd: the reopen is where the kernel checks the peer's
read permission (mode bits, ACLs, groups, capabilities), as search permission was checked on the way. Linux keeps
credentials and the root per thread (setfsuid, the raw setgroups and capset syscalls, an unshared fs_struct), so
the connection threads never see them, and the thread ends after its opens.

The pid race: SO_PEERCRED's pid may be reused once the peer exits (pid_max is often 32768). The peer is pinned
by a pidfd (SO_PEERPIDFD, Linux 6.5, which is the connecting process itself; else pidfd_open of the pid, where
the effective uid /proc shows must still be the one it connected with); its /proc entries are read, then the
pidfd is signalled (signal 0): a process alive then was alive all along, so what was read was its own.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import signal
import socket
import stat
import struct
import threading
from collections.abc import Sequence
from types import TracebackType

from .. import jsonline
from ..errors import HydrationError

__all__ = ("OPENERS", "OPEN_TIMEOUT", "PeerView")

SO_PEERGROUPS, SO_PEERPIDFD = 59, 77  # asm-generic/socket.h: Python 3.11's socket module names neither
MAX_GROUPS = 256  # supplementary groups SO_PEERGROUPS answers here (Python caps getsockopt's buffer at 1024 bytes)
_CLONE_FS, _CLONE_NEWNS = 0x200, 0x20000
_RESOLVE_NO_MAGICLINKS, _RESOLVE_IN_ROOT = 0x02, 0x10
_SYS_OPENAT2 = 437  # one number on every architecture (added after the syscall tables were unified)
# glibc's setgroups() sets every thread's groups (its setxid broadcast): the raw syscall sets this thread's only.
_SYS_SETGROUPS = {"x86_64": 116, "aarch64": 159}
_DAC_CAPS = (1 << 1) | (1 << 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH: the capabilities that let a read past DAC
_CAP_VERSION_3 = 0x20080522
OPEN_TIMEOUT = 10.0  # seconds one request's opens may take: a peer's own FUSE mount may never answer
OPENERS = 16  # opening threads at once, those a filesystem holds past OPEN_TIMEOUT included


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class PeerView:
    """The asking process pinned (`pidfd`), its credentials, and its root: `root` (an O_PATH descriptor of
    /proc/<pid>/root) or None when the hydrator cannot see the process (its mount namespace is joined instead).
    A context manager: `close()` closes both descriptors."""

    def __init__(self, peer: jsonline.Peer, pidfd: int, *, groups: tuple[int, ...], caps: int, root: int | None,
                 openers: threading.Semaphore) -> None:
        self.peer, self.pidfd, self.groups, self.caps, self.root = peer, pidfd, groups, caps, root
        self._openers = openers

    @classmethod
    def of(cls, conn: socket.socket, peer: jsonline.Peer, *, openers: threading.Semaphore) -> PeerView:
        """The view of `conn`'s peer (`peer`: its SO_PEERCRED), pinned; refused (HydrationError) for a peer that
        has exited, that this hydrator cannot pin, or whose effective uid is no longer the one it connected as.
        At most `openers` threads open files at once (PeerView.open)."""
        pidfd = _pin(conn, peer)
        try:
            groups = _groups(conn)
            pid = _pid_of(pidfd)
            if pid < 0:
                raise HydrationError(f"peer pid {peer.pid} (uid {peer.uid}) has exited: its view cannot be checked")
            if pid == 0:  # outside this pid namespace: no /proc entry, no capabilities; the pidfd joins its mounts
                return cls(peer, pidfd, groups=groups, caps=0, root=None, openers=openers)
            root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                caps = _dac_caps(pid, peer)
                try:
                    signal.pidfd_send_signal(pidfd, 0)  # alive now: the /proc entries read were its own
                except ProcessLookupError as exc:
                    raise HydrationError(f"peer pid {peer.pid} (uid {peer.uid}) exited while its view was "
                                         "checked") from exc
                except PermissionError:
                    pass  # it exists (only its signals are not ours to send)
            except BaseException:
                os.close(root)
                raise
            return cls(peer, pidfd, groups=groups, caps=caps, root=root, openers=openers)
        except OSError as exc:
            os.close(pidfd)
            raise HydrationError(f"the view of peer pid {peer.pid} (uid {peer.uid}) cannot be read: "
                                 f"{exc.strerror}") from exc
        except BaseException:
            os.close(pidfd)
            raise

    def __enter__(self) -> PeerView:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close the pidfd and the root descriptor (a second close does nothing)."""
        for fd in (self.pidfd, self.root):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.pidfd, self.root = -1, None

    def open(self, paths: Sequence[tuple[str, int]], *, what: str, follow: bool) -> dict[str, int]:
        """Each (path, at least bytes) of `paths` opened for reading (O_RDONLY, keyed by the path as named) as the
        peer could open it in its own view: a regular file of at least that size; with `follow` false, the path
        itself is never a symbolic link (a directory on it may be, resolved in the peer's root). Any path refused
        refuses all (HydrationError naming `what` and the path; none stays open)."""
        if not self._openers.acquire(blocking=False):
            raise HydrationError(f"{OPENERS} opens in peers' views are still running (a filesystem that does not "
                                 "answer?): try again later")
        try:
            job = _Opening(self, paths, what=what, follow=follow, openers=self._openers)
        except BaseException:
            self._openers.release()
            raise
        thread = threading.Thread(target=job.run, name="coldsnap-peer-view", daemon=True)
        try:
            thread.start()
        except BaseException:  # no thread to be had: what it would have used is closed here
            job.close_unstarted()
            raise
        thread.join(OPEN_TIMEOUT)
        return job.result(f"opening {len(paths)} {what}(s) in the view of peer pid {self.peer.pid} "
                          f"(uid {self.peer.uid}) took over {OPEN_TIMEOUT:.0f} s")


class _Opening:
    """One thread's opens as a peer (PeerView.open): it takes the peer's root and credentials, opens, and ends.
    A caller that stopped waiting (OPEN_TIMEOUT) leaves what the thread opens later to the thread to close."""

    def __init__(self, view: PeerView, paths: Sequence[tuple[str, int]], *, what: str, follow: bool,
                 openers: threading.Semaphore) -> None:
        self.view, self.paths, self.what, self.follow, self._openers = view, list(paths), what, follow, openers
        # Invariant (under `_lock`): once `abandoned`, `fds` is the thread's to close; until `done`, the caller's
        # to read only after setting `abandoned` or seeing `done`.
        self._lock = threading.Lock()
        self.fds: dict[str, int] = {}
        self.error: BaseException | None = None
        self.done = self.abandoned = False
        # Its own descriptors: a caller that stopped waiting closes the view's, whose numbers may then be reused.
        held: list[int] = []
        try:
            held.append(os.open("/proc", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))  # ours, before any setns
            held.append(os.dup(view.pidfd))
            if view.root is not None:
                held.append(os.dup(view.root))
        except BaseException:
            for fd in held:
                os.close(fd)
            raise
        self._proc, self._pidfd = held[0], held[1]
        self._root: int | None = held[2] if len(held) > 2 else None

    def close_unstarted(self) -> None:
        """The thread never started: close its descriptors and give its opener back."""
        for fd in (self._proc, self._pidfd, self._root):
            if fd is not None:
                os.close(fd)
        self._openers.release()

    def run(self) -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if self._root is None:
                self._root = _join_mounts(libc, self._pidfd, self.view.peer)
            root = self._root
            _become(libc, self.view, self.view.peer)
            for named, size in self.paths:
                fd = _open_beneath(libc, root, self._proc, named, size, what=self.what, follow=self.follow,
                                   peer=self.view.peer)
                with self._lock:
                    self.fds[named] = fd
                    if self.abandoned:
                        break
        except BaseException as exc:
            self.error = exc
        finally:
            for own in (self._proc, self._pidfd, self._root):
                if own is not None:
                    os.close(own)
            with self._lock:
                self.done = True
                if self.abandoned or self.error is not None:
                    for opened in self.fds.values():
                        os.close(opened)
                    self.fds.clear()
            self._openers.release()

    def result(self, late: str) -> dict[str, int]:
        """The descriptors, or the refusal (HydrationError); `late` when the thread has not finished."""
        with self._lock:
            if not self.done:
                self.abandoned = True
                raise HydrationError(late)
        if self.error is not None:
            if isinstance(self.error, HydrationError):
                raise self.error
            raise HydrationError(f"opening in the view of peer pid {self.view.peer.pid}: "
                                 f"{type(self.error).__name__}: {self.error}") from self.error
        return self.fds


def _pin(conn: socket.socket, peer: jsonline.Peer) -> int:
    """A pidfd of `conn`'s peer: the connecting process itself (SO_PEERPIDFD), else, on a kernel before 6.5,
    pidfd_open of its pid (visible here only; `_dac_caps` then checks its uid is still the one that connected)."""
    try:
        return int(conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD))
    except OSError as exc:
        if exc.errno != errno.ENOPROTOOPT:
            raise HydrationError(f"peer pid {peer.pid} (uid {peer.uid}) cannot be pinned: {exc.strerror}") from exc
    if peer.pid <= 0:
        raise HydrationError(f"peer uid {peer.uid} is outside this hydrator's pid namespace and this kernel cannot "
                             "pin it (SO_PEERPIDFD needs Linux 6.5): its view cannot be checked")
    try:
        return os.pidfd_open(peer.pid)
    except OSError as exc:
        raise HydrationError(f"peer pid {peer.pid} (uid {peer.uid}) cannot be pinned: {exc.strerror}") from exc


def _groups(conn: socket.socket) -> tuple[int, ...]:
    """The supplementary groups the peer connected with (SO_PEERGROUPS)."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * MAX_GROUPS)
    except OSError as exc:
        raise HydrationError(f"the peer's supplementary groups cannot be read (at most {MAX_GROUPS}): "
                             f"{exc.strerror}") from exc
    return struct.unpack(f"{len(raw) // 4}I", raw)


def _pid_of(pidfd: int) -> int:
    """The pinned process's pid in this hydrator's pid namespace: 0 when it is outside it, -1 once it exited."""
    with open(f"/proc/self/fdinfo/{pidfd}", encoding="ascii") as info:
        for line in info:
            if line.startswith("Pid:"):
                return int(line.split()[1])
    raise HydrationError("this kernel's pidfd shows no pid (pidfd fdinfo)")


def _dac_caps(pid: int, peer: jsonline.Peer) -> int:
    """Of CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, those process `pid` holds in this hydrator's user namespace
    (a capability of another user namespace covers only its own uids: none are granted); refused when its
    effective uid is no longer `peer`'s (a pid reused, or a set-user-ID program run since it connected)."""
    with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as status:
        fields = dict(line.split(":", 1) for line in status if ":" in line)
    uid = int(fields["Uid"].split()[1])
    if uid != peer.uid:
        raise HydrationError(f"peer pid {pid} runs as uid {uid} now, not as uid {peer.uid}, which it connected as")
    ours, theirs = os.stat("/proc/self/ns/user"), os.stat(f"/proc/{pid}/ns/user")
    if (ours.st_dev, ours.st_ino) != (theirs.st_dev, theirs.st_ino):
        return 0
    return int(fields["CapEff"], 16) & _DAC_CAPS


def _join_mounts(libc: ctypes.CDLL, pidfd: int, peer: jsonline.Peer) -> int:
    """In this thread only: join the pinned peer's mount namespace (its fs_struct unshared first, so the other
    threads keep theirs); its root, O_PATH."""
    if libc.unshare(_CLONE_FS) != 0 or libc.setns(pidfd, _CLONE_NEWNS) != 0:
        code = ctypes.get_errno()
        raise HydrationError(f"peer uid {peer.uid} is outside this hydrator's pid namespace and its mount "
                             f"namespace cannot be joined ({os.strerror(code)}; the hydrator needs CAP_SYS_ADMIN "
                             "there): its view cannot be checked")
    return os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def _become(libc: ctypes.CDLL, view: PeerView, peer: jsonline.Peer) -> None:
    """In this thread only: the peer's groups, fsgid and fsuid, and of the capabilities only its DAC ones."""
    if sorted(os.getgroups()) != sorted(view.groups):
        number = _SYS_SETGROUPS.get(platform.machine())
        if number is None:
            raise HydrationError(f"setgroups' syscall number on {platform.machine()} is not known here: peers' "
                                 "views cannot be checked")
        groups = (ctypes.c_uint32 * max(1, len(view.groups)))(*view.groups)
        if libc.syscall(ctypes.c_long(number), ctypes.c_size_t(len(view.groups)), groups) != 0:
            raise HydrationError(f"this hydrator (uid {os.geteuid()}) cannot take the groups of peer uid "
                                 f"{peer.uid} ({os.strerror(ctypes.get_errno())}): run it as root")
    libc.setfsgid(ctypes.c_uint32(peer.gid))
    libc.setfsuid(ctypes.c_uint32(peer.uid))
    unchanged = ctypes.c_uint32(-1 & 0xFFFFFFFF)  # an invalid id: each call answers the current one
    if libc.setfsuid(unchanged) & 0xFFFFFFFF != peer.uid or libc.setfsgid(unchanged) & 0xFFFFFFFF != peer.gid:
        raise HydrationError(f"this hydrator (uid {os.geteuid()}) cannot take the credentials of peer uid "
                             f"{peer.uid}: run it as root")
    header, data = _CapHeader(_CAP_VERSION_3, 0), (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise HydrationError(f"capget: {os.strerror(ctypes.get_errno())}")
    data[0].effective, data[1].effective = data[0].permitted & view.caps, 0  # the DAC caps are in the low word
    if libc.capset(ctypes.byref(header), data) != 0:
        raise HydrationError(f"capset: {os.strerror(ctypes.get_errno())}")


def _open_beneath(libc: ctypes.CDLL, root: int, proc: int, named: str, size: int, *, what: str, follow: bool,
                  peer: jsonline.Peer) -> int:
    """`named` opened beneath `root` with this thread's credentials: O_PATH first, a regular file of at least
    `size` bytes, then reopened for reading (the kernel's read check) through `proc` (this process's /proc)."""
    if not os.path.isabs(named) or "\0" in named:
        raise HydrationError(f"{what} {named!r:.200} is not an absolute path")
    try:
        encoded = os.fsencode(named)
    except UnicodeEncodeError as exc:
        raise HydrationError(f"{what} {named!r:.200} is not a file name") from exc
    how = _OpenHow(os.O_PATH | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW), 0,
                   _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    fd = syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(root), ctypes.c_char_p(encoded), ctypes.byref(how),
                 ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        raise _refusal(ctypes.get_errno(), what, named, peer)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < size:
            raise HydrationError(f"{what} {named} is not a regular file of at least {size} bytes")
        try:
            return os.open(f"self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc)
        except OSError as exc:
            raise _refusal(exc.errno or errno.EIO, what, named, peer) from exc
    finally:
        os.close(fd)


def _refusal(code: int, what: str, named: str, peer: jsonline.Peer) -> HydrationError:
    if code in (errno.EACCES, errno.EPERM):
        return HydrationError(f"peer uid {peer.uid} may not read {what} {named}: {os.strerror(code)} (in its own "
                              "view)")
    if code == errno.ENOSYS:
        return HydrationError("this kernel has no openat2 (Linux 5.6): peers' views cannot be checked")
    return HydrationError(f"{what} {named}: {os.strerror(code)} (in the view of peer pid {peer.pid}, uid "
                          f"{peer.uid})")
