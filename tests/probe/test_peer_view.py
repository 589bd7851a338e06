"""Issue 37 finding 6: the node hydrator opens the files a peer names as the peer could itself, in the peer's own
view (its root and mount namespace, its uid, groups and DAC capabilities), pinned by a pidfd; uid 0 on
SO_PEERCRED no longer reads everything. Every peer is a real process connected over a real Unix socket: root in
a mount namespace of its own where the tenant's directory is an empty tmpfs (root in another container), root
without capabilities (setpriv), tenants of other uids and groups; the hydrator's side runs in another pid
namespace where it cannot see its peers (a hydrator in a container of its own). The tests run as root.

On the code before this change the hydrator's rule was `readable_by`: uid 0 read everything (so the first three
tests were served the tenant's 0600 file) and supplementary groups were never consulted."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldsnap_probe.errors import HydrationError
from coldsnap_probe.hydration._peer_files import held_sources
from coldsnap_probe.hydration._peer_view import OPENERS, PeerView
from coldsnap_probe.jsonline import Peer
from tests.helpers import ROOT
from tests.probe._peers import AS_NOBODY, HOLD, NO_CAPABILITIES, as_uid, connected, hiding, listening, read_all

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the peers are other uids and namespaces")

TENANT, GROUP = 4242, 4343


@pytest.fixture
def tree() -> Iterator[Path]:
    """/tmp/<new>/ (0755, root): `tenant/w.bin` (uid TENANT's, 0600, 'T'), `root.bin` (root's, 0600, 'R'),
    `group/g.bin` (root's, group GROUP, 0640, 'G') and `link.bin`, a symbolic link to tenant/w.bin."""
    top = Path(tempfile.mkdtemp(prefix="cs-peer-view-", dir="/tmp"))
    top.chmod(0o755)
    try:
        (top / "tenant").mkdir(mode=0o755)
        (top / "tenant" / "w.bin").write_bytes(b"T" * 4096)
        (top / "tenant" / "w.bin").chmod(0o600)
        for p in (top / "tenant", top / "tenant" / "w.bin"):
            os.chown(p, TENANT, TENANT)
        (top / "root.bin").write_bytes(b"R" * 4096)
        (top / "root.bin").chmod(0o600)
        (top / "group").mkdir(mode=0o755)
        (top / "group" / "g.bin").write_bytes(b"G" * 4096)
        os.chown(top / "group" / "g.bin", 0, GROUP)
        (top / "group" / "g.bin").chmod(0o640)
        (top / "link.bin").symlink_to(top / "tenant" / "w.bin")
        yield top
    finally:
        shutil.rmtree(top)


def read_as(prefix: tuple[str, ...], path: Path, *, follow: bool = True) -> bytes:
    """`path`'s first 4 bytes, opened by PeerView for a real peer started with `prefix`; HydrationError if the
    peer could not have opened it itself."""
    with listening() as (listener, sock), connected(listener, sock, prefix) as (conn, peer, _):
        with PeerView.of(conn, peer, openers=threading.BoundedSemaphore(OPENERS)) as view:
            fds = view.open([(str(path), 1)], what="source", follow=follow)
            try:
                return read_all(fds[str(path)])[:4]
            finally:
                for fd in fds.values():
                    os.close(fd)


def test_a_root_peer_in_another_mount_namespace_is_refused_a_file_it_cannot_see(tree: Path) -> None:
    """Regression: #37 finding 6 (root in another container got a tenant's 0600 weights)."""
    with pytest.raises(HydrationError, match=r"source .*/tenant/w.bin: No such file or directory \(in the view of "
                                             r"peer pid \d+, uid 0\)"):
        read_as(hiding(tree / "tenant"), tree / "tenant" / "w.bin")


def test_a_root_peer_in_another_mount_namespace_that_sees_the_file_is_served(tree: Path) -> None:
    assert read_as(hiding(tree / "group"), tree / "tenant" / "w.bin") == b"TTTT"


def test_a_root_peer_without_dac_capabilities_is_refused_another_uids_0600_file(tree: Path) -> None:
    """Regression: #37 finding 6: root's uid is not root's capabilities."""
    with pytest.raises(HydrationError, match=r"peer uid 0 may not read source .*/tenant/w.bin: Permission denied"):
        read_as(NO_CAPABILITIES, tree / "tenant" / "w.bin")
    assert read_as(NO_CAPABILITIES, tree / "root.bin") == b"RRRR"  # its own 0600 file: the owner's bits


def test_a_peer_is_served_what_its_uid_and_groups_may_read(tree: Path) -> None:
    assert read_as(as_uid(TENANT), tree / "tenant" / "w.bin") == b"TTTT"
    with pytest.raises(HydrationError, match="peer uid 65534 may not read"):
        read_as(AS_NOBODY, tree / "tenant" / "w.bin")
    with pytest.raises(HydrationError, match="peer uid 65534 may not read"):
        read_as(AS_NOBODY, tree / "group" / "g.bin")
    assert read_as(as_uid(65534, GROUP), tree / "group" / "g.bin") == b"GGGG"  # a supplementary group counts


def test_a_directory_the_peer_cannot_search_hides_a_world_readable_file(tree: Path) -> None:
    (tree / "tenant" / "open.bin").write_bytes(b"O" * 4096)
    (tree / "tenant").chmod(0o700)
    with pytest.raises(HydrationError, match="peer uid 65534 may not read"):
        read_as(AS_NOBODY, tree / "tenant" / "open.bin")
    (tree / "tenant").chmod(0o711)
    assert read_as(AS_NOBODY, tree / "tenant" / "open.bin") == b"OOOO"


def test_links_resolve_in_the_peers_view_and_a_final_link_is_refused_unless_followed(tree: Path) -> None:
    assert read_as(as_uid(TENANT), tree / "link.bin") == b"TTTT"
    with pytest.raises(HydrationError, match="not a regular file"):
        read_as(as_uid(TENANT), tree / "link.bin", follow=False)
    with pytest.raises(HydrationError, match="peer uid 65534 may not read"):  # a link is no way around the mode
        read_as(AS_NOBODY, tree / "link.bin")


def test_a_source_is_the_file_the_peer_sees_at_its_path_not_the_one_the_hydrator_sees(tree: Path) -> None:
    """A peer whose own namespace has another file at the held source's path is not served the held one."""
    held = tree / "group" / "g.bin"
    st = os.stat(held)
    identities = {(st.st_dev, st.st_ino): str(held)}
    planted = ("unshare", "--mount", "--propagation", "private", "sh", "-c",
               f"mount -t tmpfs none {tree / 'group'} && echo x > {held} && exec \"$@\"", "sh")
    semaphore = threading.BoundedSemaphore(OPENERS)
    with listening() as (listener, sock):
        with connected(listener, sock, planted) as (conn, peer, _), \
                PeerView.of(conn, peer, openers=semaphore) as view:
            with pytest.raises(HydrationError, match=f"this hydrator does not hold {held}"):
                held_sources(view, [str(held)], identities)
        with connected(listener, sock) as (conn, peer, _), PeerView.of(conn, peer, openers=semaphore) as view:
            assert held_sources(view, [str(tree / "group" / "g.bin")], identities) == {str(held): str(held)}


def test_a_peer_that_exited_after_connecting_is_refused(tree: Path) -> None:
    """The peer is pinned: once it exits (its connection held by a child), its pid may be another's."""
    leave = ("import os, socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.connect(sys.argv[1])\n"
             "if os.fork() == 0:\n    sys.stdin.read()\n    os._exit(0)\nos._exit(0)\n")
    with listening() as (listener, sock):
        child = subprocess.Popen(["/usr/bin/python3", "-c", leave, str(sock)], stdin=subprocess.PIPE)
        try:
            assert child.wait(20) == 0  # the connecting process is gone; its child holds the connection
            conn, _ = listener.accept()
            with conn, pytest.raises(HydrationError, match=r"peer pid \d+ \(uid 0\) has exited"):
                PeerView.of(conn, Peer.of(conn), openers=threading.BoundedSemaphore(OPENERS))
        finally:
            assert child.stdin is not None
            child.stdin.close()


def test_a_peer_whose_uid_changed_since_it_connected_is_refused(tree: Path) -> None:
    """Root connects, then becomes TENANT: its capabilities are not those of the uid that connected."""
    drop = HOLD.replace("print('connected'", f"os.setresgid({TENANT}, {TENANT}, {TENANT}); os.setresuid({TENANT}, "
                                              f"{TENANT}, {TENANT}); print('connected'")
    with listening() as (listener, sock):
        proc = subprocess.Popen(["/usr/bin/python3", "-c", "import os\n" + drop, str(sock)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "connected"
            conn, _ = listener.accept()
            with conn, pytest.raises(HydrationError, match=rf"runs as uid {TENANT} now, not as uid 0"):
                PeerView.of(conn, Peer.of(conn), openers=threading.BoundedSemaphore(OPENERS))
        finally:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(20)


# The hydrator's side in a pid namespace of its own (as in a container): it answers `count` peers, one JSON
# line each, opening argv[2] in each one's view.
SERVE = """
import json, os, socket, sys, threading
from coldsnap_probe.errors import HydrationError
from coldsnap_probe.hydration._peer_view import PeerView
from coldsnap_probe.jsonline import Peer
path, target, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
listener = socket.socket(socket.AF_UNIX)
listener.bind(path)
os.chmod(path, 0o777)
listener.listen()
print("listening", flush=True)
for _ in range(count):
    conn, _ = listener.accept()
    peer = Peer.of(conn)
    try:
        with PeerView.of(conn, peer, openers=threading.BoundedSemaphore(2)) as view:
            fd = view.open([(target, 1)], what="source", follow=True)[target]
            print(json.dumps({"pid": peer.pid, "read": os.pread(fd, 4, 0).decode()}), flush=True)
            os.close(fd)
    except HydrationError as exc:
        print(json.dumps({"pid": peer.pid, "error": str(exc)}), flush=True)
    conn.close()
"""


def answer_to(server: subprocess.Popen[str], sock: Path, prefix: tuple[str, ...]) -> dict[str, str]:
    """What the SERVE hydrator printed for one peer connecting to `sock` as `prefix` runs it; the peer then ends."""
    assert server.stdout is not None
    peer = subprocess.Popen([*prefix, "/usr/bin/python3", "-c", HOLD, str(sock)], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL)
    try:
        answer: dict[str, str] = json.loads(server.stdout.readline())
    finally:
        assert peer.stdin is not None
        peer.stdin.close()
        peer.wait(20)
    return answer


@pytest.mark.skipif(tuple(map(int, re.findall(r"\d+", platform.release())[:2])) < (6, 5),
                    reason="a peer outside the hydrator's pid namespace is pinned with SO_PEERPIDFD (Linux 6.5)")
def test_a_hydrator_that_cannot_see_its_peers_checks_them_in_their_mount_namespace(tree: Path) -> None:
    """SO_PEERCRED's pid is 0 there: the peer's mount namespace is joined through its pidfd, and a peer the
    hydrator cannot see gets no capability (a root peer reads only what root's mode bits allow)."""
    peers = [hiding(tree / "tenant"), (), as_uid(TENANT)]
    targets = tree / "tenant" / "w.bin"
    with tempfile.TemporaryDirectory(prefix="cs-pidns-", dir="/tmp") as directory:
        Path(directory).chmod(0o755)
        sock = Path(directory) / "h.sock"
        server = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", SERVE,
                                   str(sock), str(targets), str(len(peers))], cwd=ROOT, stdout=subprocess.PIPE,
                                  text=True)
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "listening"
            answers = []
            for prefix in peers:
                answers.append(answer_to(server, sock, prefix))
        finally:
            server.kill()
            server.wait()
    assert all(a["pid"] == 0 for a in answers), answers  # the hydrator cannot see them
    assert "No such file or directory (in the view of peer pid 0, uid 0)" in answers[0]["error"]
    assert "peer uid 0 may not read" in answers[1]["error"]  # root, but no capability is known
    assert answers[2]["read"] == "TTTT"  # the tenant reads its own file


def in_container(image: str, *mounts: Path, options: tuple[str, ...] = ()) -> tuple[str, ...]:
    """A prefix that runs the peer as root in a real container of `image` (the real dockerd): its own mount, pid
    and network namespaces, the host's /usr (for /usr/bin/python3) and `mounts` at their own paths."""
    binds = ["-v", "/usr:/usr:ro", "-v", "/usr/lib:/lib:ro"]
    if os.path.isdir("/usr/lib64"):
        binds += ["-v", "/usr/lib64:/lib64:ro"]
    for mount in mounts:
        binds += ["-v", f"{mount}:{mount}"]
    return ("docker", "run", "--rm", "-i", "--network", "none", *binds, *options, image)


@pytest.mark.skipif(shutil.which("docker") is None, reason="needs the docker CLI and a dockerd")
@pytest.mark.usefixtures("no_leftovers")
def test_root_in_a_container_is_served_only_what_its_mounts_and_capabilities_let_it_read(
        tree: Path, busybox_image: str) -> None:
    """Regression: #37 finding 6, as reported: root in another container (Docker's default capabilities, which
    hold CAP_DAC_OVERRIDE) does not have the tenant's directory, so it is not served the tenant's 0600 file; with
    the directory mounted it is; with it mounted but every capability dropped it is not."""
    weights = tree / "tenant" / "w.bin"
    semaphore = threading.BoundedSemaphore(OPENERS)
    outcomes = []
    with listening() as (listener, sock):
        for mounts, options in (((), ()), ((tree,), ()), ((tree,), ("--cap-drop", "ALL"))):
            prefix = in_container(busybox_image, sock.parent, *mounts, options=options)
            with connected(listener, sock, prefix) as (conn, peer, _), \
                    PeerView.of(conn, peer, openers=semaphore) as view:
                assert peer.uid == 0 and view.root is not None  # root, and visible from here
                try:
                    fds = view.open([(str(weights), 1)], what="source", follow=True)
                    outcomes.append(read_all(fds[str(weights)])[:4].decode())
                    os.close(fds[str(weights)])
                except HydrationError as exc:
                    outcomes.append(str(exc))
    assert "No such file or directory (in the view of peer pid" in outcomes[0], outcomes
    assert outcomes[1] == "TTTT", outcomes
    assert "peer uid 0 may not read source" in outcomes[2], outcomes


def _others_reach(path: Path) -> bool:
    """Whether a uid with no privilege can reach `path` (every directory above it searchable by others)."""
    return all(os.stat(p).st_mode & 0o001 for p in [path, *path.parents])


@pytest.mark.skipif(not _others_reach(Path(ROOT)), reason="nobody cannot reach this checkout to import the probe")
def test_a_hydrator_that_is_not_root_serves_its_own_uid_and_refuses_what_it_cannot_inspect(tree: Path) -> None:
    """Without privilege the hydrator takes no other credentials and reads no other uid's /proc entries: its own
    uid is checked as any peer (its own file read, another's refused by the kernel); root's view is unreadable."""
    (tree / "nobody.bin").write_bytes(b"N" * 4096)
    os.chown(tree / "nobody.bin", 65534, 65534)
    (tree / "nobody.bin").chmod(0o600)
    with tempfile.TemporaryDirectory(prefix="cs-unprivileged-", dir="/tmp") as directory:
        Path(directory).chmod(0o777)
        sock = Path(directory) / "h.sock"
        answers = []
        for target, prefix in ((tree / "nobody.bin", AS_NOBODY), (tree / "tenant" / "w.bin", AS_NOBODY),
                               (tree / "nobody.bin", ())):
            server = subprocess.Popen([*AS_NOBODY, "/usr/bin/python3", "-c", SERVE, str(sock), str(target), "1"],
                                      cwd=ROOT, env={"PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
            try:
                assert server.stdout is not None and server.stdout.readline().strip() == "listening"
                answers.append(answer_to(server, sock, prefix))
            finally:
                server.kill()
                server.wait()
                sock.unlink(missing_ok=True)
    assert answers[0]["read"] == "NNNN"
    assert "peer uid 65534 may not read" in answers[1]["error"]
    assert "(uid 0) cannot be read: Permission denied" in answers[2]["error"]
