"""A node hydrator's stage of a device dump, without a GPU: the `stage-dump` layout (one allocation per region),
the `adopt` pages, the worker collecting every page, and the interposer's control socket taking the descriptors
in pages on one connection (compiled with a harness that only fills the region table: no driver is involved),
with every descriptor closed on every path. tests/probe/test_interposer_gpu.py adopts for real on the H200."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coldsnap_probe import jsonline
from coldsnap_probe.errors import HydrationError
from coldsnap_probe.hydration._peer_files import STAGE_ALLOCATIONS, dump_layout
from coldsnap_probe.hydration._request_fields import first_page
from tests.probe.interposer_harness import UNITY

MIB = 1 << 20


def part(region: int, size: int = 2 * MIB, name: str = "seg-0.bin") -> dict[str, Any]:
    return {"file": f"/images/device-42/{name}", "bytes": size, "region": region}


class TestDumpLayout:
    def test_parts_name_their_region_and_each_region_is_one_allocation(self) -> None:
        layout, sizes = dump_layout([part(0, 4 * MIB), part(1, 1 << 30, "seg-1.bin"), part(1, 6 * MIB, "seg-2.bin"),
                                     part(2, 2 * MIB, "seg-3.bin")])
        assert sizes == (4 * MIB, (1 << 30) + 6 * MIB, 2 * MIB)
        assert layout[1] == ("/images/device-42/seg-1.bin", 1 << 30, 1, 0)

    def test_a_part_names_its_chunks_of_zeros_and_only_its_own(self) -> None:
        """The manifest's `zero` rides with each part (a 1 GiB file: 16 chunks of 64 MiB, the last may be short)."""
        layout, _ = dump_layout([part(0, 1 << 30) | {"zero": 0b1000_0000_0000_0101},
                                 part(1, 66 * MIB, "seg-1.bin") | {"zero": 0b10}])
        assert [z for _f, _b, _r, z in layout] == [0b1000_0000_0000_0101, 0b10]

    @pytest.mark.parametrize(("parts", "error"), [
        pytest.param([], "non-empty list", id="empty"),
        pytest.param([{"file": "/a", "bytes": 2 * MIB}], r"parts\[0\] must be .*region: an integer", id="no-region"),
        pytest.param([part(0) | {"extra": 1}], r"parts\[0\] must be", id="extra-key"),
        pytest.param([part(0, 64 * MIB) | {"zero": 0b10}], r"parts\[0\]\.zero must be a mask of the part's 1 chunks",
                     id="zero-beyond-the-part"),
        pytest.param([part(0, 66 * MIB) | {"zero": 0b100}], r"parts\[0\]\.zero .* 2 chunks", id="zero-beyond-short"),
        pytest.param([part(0) | {"zero": -1}], r"parts\[0\]\.zero must be", id="negative-zero"),
        pytest.param([part(0) | {"zero": True}], r"parts\[0\]\.zero must be", id="bool-zero"),
        pytest.param([part(0) | {"zero": "1"}], r"parts\[0\]\.zero must be", id="string-zero"),
        pytest.param([part(0) | {"region": True}], r"parts\[0\] must be", id="bool-region"),
        pytest.param([part(0) | {"region": -1}], r"parts\[0\] must be", id="negative-region"),
        pytest.param([part(0) | {"region": "0"}], r"parts\[0\] must be", id="string-region"),
        pytest.param([part(0) | {"bytes": MIB}], "positive multiple of 2097152", id="unaligned"),
        pytest.param([part(0) | {"file": "seg-0.bin"}], "absolute path", id="relative"),
        pytest.param([part(1)], r"parts\[0\]\.region is 1: regions are numbered from 0 in order", id="starts-at-1"),
        pytest.param([part(0), part(2)], r"parts\[1\]\.region is 2: .*\(0 or 1\)", id="skips-one"),
        pytest.param([part(0), part(1), part(0)], r"parts\[2\]\.region is 0: .*\(1 or 2\)", id="goes-back"),
    ])
    def test_a_bad_layout_is_refused_naming_the_part_and_the_rule(self, parts: list[Any], error: str) -> None:
        with pytest.raises(HydrationError, match=error):
            dump_layout(parts)

    def test_the_number_of_allocations_is_bounded(self) -> None:
        dump_layout([part(i) for i in range(STAGE_ALLOCATIONS)])
        with pytest.raises(HydrationError, match=f"more than {STAGE_ALLOCATIONS} regions"):
            dump_layout([part(i) for i in range(STAGE_ALLOCATIONS + 1)])


class TestAdoptPages:
    @pytest.mark.parametrize(("first", "count", "taken"), [(0, 1, 0), (0, 40, 0), (16, 40, 16), (0, 40, 32),
                                                          (32, 40, 32)])
    def test_the_next_page_or_a_retry_of_an_earlier_one_is_served(self, first: int, count: int, taken: int) -> None:
        assert first_page(first, count, taken) == first

    @pytest.mark.parametrize(("first", "count", "taken"), [
        pytest.param(8, 40, 16, id="not-a-page"), pytest.param(48, 40, 48, id="beyond-the-stage"),
        pytest.param(32, 40, 16, id="skips-a-page"), pytest.param(-16, 40, 0, id="negative"),
        pytest.param(True, 40, 0, id="bool"), pytest.param("0", 40, 0, id="string"),
    ])
    def test_any_other_page_is_refused(self, first: Any, count: int, taken: int) -> None:
        with pytest.raises(HydrationError, match="first must be a multiple of 16 below the stage's"):
            first_page(first, count, taken)


def open_fds(pid: int) -> dict[str, str]:
    """A process's descriptors and what they name."""
    held = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            held[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass
    return held


def settled(pid: int, before: dict[str, str]) -> dict[str, str]:
    """The server's descriptors once it is done with the last connection (it closes it after the asker left)."""
    give_up = time.monotonic() + 10
    while (now := open_fds(pid)) != before and time.monotonic() < give_up:
        time.sleep(0.02)
    return now


# -- the worker's side: every page, or nothing left open ----------------------------------------------------------
class Pages:
    """A hydrator peer answering `adopt` pages as told (`answer(first)`), with real descriptors (of `files`): what
    the worker must defend itself against when a hydrator is wrong or hostile. Records the `first`s asked."""

    def __init__(self, path: Path, files: list[Path], answer: Any) -> None:
        self.files, self.answer, self.asked = files, answer, []
        self.server = jsonline.LineServer(jsonline.listen(path), self._one, peers=jsonline.Peers()).start()

    def _one(self, conn: socket.socket, _peer: jsonline.Peer) -> jsonline.Answer:
        message = jsonline.read_request(conn)
        self.asked.append(message.get("first"))
        reply, indexes = self.answer(message.get("first"))
        return reply, [os.open(self.files[i], os.O_RDONLY | os.O_CLOEXEC) for i in indexes]


@pytest.fixture
def regions(tmp_path: Path) -> Iterator[tuple[Path, list[Path]]]:
    files = []
    for index in range(20):
        (tmp_path / f"alloc-{index}").write_bytes(b"")
        files.append(tmp_path / f"alloc-{index}")
    yield tmp_path, files


def device_stage(hydrator: Path, count: int) -> Any:
    """A DeviceStage of `count` regions of 2 MiB whose stage was answered (the adopt is what is tested)."""
    from coldsnap_probe.memory._device_dump import DeviceStage
    from tests.probe.test_interposer import dump_in

    dump = dump_in(hydrator.parent / "dump", (2 * MIB,) * count)
    stage = DeviceStage(str(hydrator.parent / "absent.sock"), dump, hydrator.parent / "dump")
    stage.wait(10)
    stage.hydrator, stage.report, stage.ticket = str(hydrator), {"staged": True}, "t"
    return stage


def test_the_worker_takes_every_page_in_order(regions: tuple[Path, list[Path]]) -> None:
    folder, files = regions
    peer = Pages(folder / "h.sock", files, lambda first: ({"ok": True, "first": first, "count": 20,
                                                           "sizes": [2 * MIB] * min(16, 20 - first)},
                                                          range(first, min(first + 16, 20))))
    try:
        fds = device_stage(folder / "h.sock", 20).adopt(timeout=10)
    finally:
        peer.server.close()
    assert fds is not None and peer.asked == [0, 16]
    try:
        assert [os.readlink(f"/proc/self/fd/{fd}") for fd in fds] == [str(f) for f in files]
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize(("answer", "error"), [
    pytest.param(lambda first: ({"ok": True, "first": first, "count": 19, "sizes": [2 * MIB] * 16}, range(16)),
                 "the hydrator holds 19 allocations, the dump 20 regions", id="other-count"),
    pytest.param(lambda first: ({"ok": True, "first": first, "count": 20, "sizes": [2 * MIB] * 16},
                                range(16 if first == 0 else 3)), "page 16: 3 descriptors", id="short-page"),
    pytest.param(lambda first: ({"ok": True, "first": first, "count": 20, "sizes": [4 * MIB] * 16}, range(16)),
                 "page 0: 16 descriptors of", id="other-sizes"),
    pytest.param(lambda first: ({"ok": True, "first": 0, "count": 20, "sizes": [2 * MIB] * 16}, range(16)),
                 "page 16", id="same-page-again"),
    pytest.param(lambda first: (({"ok": True, "first": 0, "count": 20, "sizes": [2 * MIB] * 16}, range(16))
                                if first == 0 else ({"ok": False, "error": "expired"}, range(2))), "expired",
                 id="refused-midway"),
    pytest.param(lambda first: ({"ok": True, "first": first, "count": 20, "sizes": [2 * MIB] * 16}, range(17)),
                 "an answer's message carried over 16 descriptors", id="over-16-in-an-answer"),
])
def test_a_page_that_does_not_fit_leaves_nothing_open(regions: tuple[Path, list[Path]], answer: Any,
                                                      error: str) -> None:
    folder, files = regions
    peer = Pages(folder / "h.sock", files, answer)
    stage = device_stage(folder / "h.sock", 20)
    before = open_fds(os.getpid())
    try:
        assert stage.adopt(timeout=10) is None
    finally:
        peer.server.close()
    assert error in stage.report["adopt_error"]
    assert not {str(f) for f in files} & set(open_fds(os.getpid()).values())
    assert len(open_fds(os.getpid())) <= len(before)


# -- the interposer's side: the control socket's pages (C, no driver) ---------------------------------------------
PAGES_HARNESS = UNITY + r"""

/* Three released regions of 2 MiB (no driver: a staged hydration is refused at the dump directory, after the
 * descriptors were counted and before any driver call), the control socket serving at argv[1]. */
int main(int argc, char **argv)
{
    struct cscu_region r = {0};
    if (argc != 2)
        return 2;
    r.address = 0x7f0000000000ULL;
    r.size = r.requested = (size_t)2 << 20;
    for (int i = 0; i < 3; i++, r.address += (size_t)1 << 30)
        append(&r);
    released = 1;
    if ((listener = bind_socket(argv[1])) < 0)
        return 1;
    puts("ready");
    fflush(stdout);
    for (;;) {
        int conn = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
        if (conn < 0)
            return 1;
        cscu_serve_connection(conn);
        close(conn);
    }
}
"""


Served = tuple[int, str, dict[str, str]]  # the harness's pid, its socket, its descriptors when idle


@pytest.fixture(scope="module")
def pages_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The harness serving, and its descriptors when idle (what every test must find again)."""
    from coldsnap_probe.hydration._interposer import SOURCES

    folder = tmp_path_factory.mktemp("pages")
    (folder / "pages.c").write_text(PAGES_HARNESS)
    subprocess.run(["gcc", "-O1", "-std=gnu11", "-Wall", "-Wextra", "-I", str(SOURCES), "-o", str(folder / "pages"),
                    str(folder / "pages.c"), "-ldl", "-lpthread"], check=True, capture_output=True)
    path = str(folder / "control.sock")
    proc = subprocess.Popen([str(folder / "pages"), path], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        yield proc.pid, path, open_fds(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def exchange(path: str, line: bytes, pages: list[list[int]], *, marks: bytes = b".", leave: bool = False,
             with_line: list[int] | None = None) -> dict[str, Any] | None:
    """The request `line` (with `with_line` descriptors), then one message per page (`marks`, its descriptors);
    the answer, or None when `leave` (the asker goes away without reading it)."""
    from tests.probe.test_interposer import read_answer

    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(40)
        sock.connect(path)
        if with_line:
            socket.send_fds(sock, [line], with_line)
        else:
            sock.sendall(line)
        for page in pages:
            socket.send_fds(sock, [marks], page)
        if leave:
            return None
        sock.shutdown(socket.SHUT_WR)
        return read_answer(sock)


def markers(folder: Path, count: int) -> list[int]:
    """`count` descriptors of files named after this test, to look for in the server afterwards."""
    fds = []
    for index in range(count):
        (folder / f"marker-{index}").write_bytes(b"")
        fds.append(os.open(folder / f"marker-{index}", os.O_RDONLY | os.O_CLOEXEC))
    return fds


HYDRATE = b'{"op": "hydrate", "dir": "/nonexistent/dump", "allocations": "%d"}\n'
COUNTED = "hydrate: dump directory /nonexistent/dump: No such file"  # every descriptor arrived and was counted


@pytest.mark.parametrize(("line", "pages", "with_line", "error"), [
    pytest.param(HYDRATE % 3, [[0], [1, 2]], 0, COUNTED, id="in-pages"),
    pytest.param(HYDRATE % 3, [], 3, COUNTED, id="with-the-line"),
    pytest.param(HYDRATE % 3, [[2]], 2, COUNTED, id="with-the-line-and-a-page"),
    pytest.param(HYDRATE % 3, [[0, 1]], 0, "2 of the 3 announced descriptors arrived before the peer stopped",
                 id="fewer"),
    pytest.param(HYDRATE % 3, [[0, 1], [2, 3]], 0, "4 descriptors arrived, 3 were announced", id="more"),
    pytest.param(HYDRATE % 1, [[0]], 0, COUNTED, id="one-for-the-group"),  # copied from (the 3 regions: 6 MiB)
    pytest.param(HYDRATE % 2, [[0, 1]], 0, "hydrate: 2 staged allocations: neither one per released region (3, "
                 "each adoptable: yes) nor one per group of them", id="not-one-each"),
    pytest.param(HYDRATE % 4, [[0, 1, 2, 3]], 0, "hydrate: 4 staged allocations: neither one per released region "
                 "(3", id="over-the-regions"),
    pytest.param(HYDRATE % 4097, [[0]], 0, "`allocations` must count the staged allocations in decimal, 1 to 4096",
                 id="over-the-cap"),
    pytest.param(HYDRATE % 3, [list(range(17))], 0, "a page carried more than 16 descriptors", id="page-over-16"),
    pytest.param(b'{"op": "hydrate", "dir": "/nonexistent/dump"}\n', [], 1, "come with their count",
                 id="not-announced"),
    pytest.param(b'{"op": "status"}\n', [], 1, "only a hydrate request may carry descriptors", id="status"),
    pytest.param(b'{"op": "status", "allocations": "1"}\n', [], 0, "only a hydrate request may carry",
                 id="status-announcing"),
])
def test_the_control_socket_counts_every_descriptor_and_keeps_none(pages_server: Served, tmp_path: Path,
                                                                   line: bytes, pages: list[list[int]],
                                                                   with_line: int, error: str) -> None:
    pid, path, before = pages_server
    fds = markers(tmp_path, 20)
    try:
        answer = exchange(path, line, [[fds[i] for i in page] for page in pages], with_line=fds[20 - with_line:])
    finally:
        for fd in fds:
            os.close(fd)
    assert answer is not None and answer["ok"] is False and error in answer["error"], answer
    assert settled(pid, before) == before


def test_pages_without_descriptors_are_refused(pages_server: Served, tmp_path: Path) -> None:
    pid, path, before = pages_server
    [fd] = markers(tmp_path, 1)
    try:
        answer = exchange(path, HYDRATE % 3 + b"....", [[fd]])
    finally:
        os.close(fd)
    # However the bytes were glued together on the way: more pages than descriptors is refused.
    assert answer is not None and re.search(r"hydrate: [45] pages brought [01] descriptors: a page carries 1 to 16",
                                            answer["error"]), answer
    assert settled(pid, before) == before


def test_a_peer_that_leaves_midway_leaves_nothing_and_the_next_one_is_served(pages_server: Served,
                                                                            tmp_path: Path) -> None:
    pid, path, before = pages_server
    fds = markers(tmp_path, 3)
    try:
        exchange(path, HYDRATE % 3, [[fds[0]]], leave=True)
    finally:
        for fd in fds:
            os.close(fd)
    assert settled(pid, before) == before  # the server noticed the end of the connection
    assert jsonline.request(path, {"op": "status"}, timeout=10)["released"] is True


def test_the_worker_sends_its_descriptors_in_pages_of_16(pages_server: Served, tmp_path: Path) -> None:
    """jsonline's `page`: the line alone, then pages; the interposer takes what the worker sends (here three)."""
    from coldsnap_probe.memory._device_dump import INTERPOSER_PAGE

    pid, path, before = pages_server
    fds = markers(tmp_path, 3)
    try:
        answer = jsonline.request(path, {"op": "hydrate", "dir": "/nonexistent/dump", "allocations": "3"}, fds=fds,
                                  page=INTERPOSER_PAGE, timeout=30)
    finally:
        for fd in fds:
            os.close(fd)
    assert COUNTED in answer["error"] and settled(pid, before) == before


def test_the_worker_lets_its_descriptors_go_once_sent(pages_server: Served, tmp_path: Path) -> None:
    """jsonline's `sent`: called once the line and every page are out, before the answer is read (the worker closes
    its descriptors then, so that a staged allocation the interposer copied from is freed as soon as it lets go):
    the interposer still counts every descriptor, in flight when the asker closed its own."""
    from coldsnap_probe.memory._device_dump import INTERPOSER_PAGE

    pid, path, before = pages_server
    fds, order = markers(tmp_path, 20), []

    def let_go() -> None:
        order.append("sent")
        while fds:
            os.close(fds.pop())

    try:
        answer = jsonline.request(path, {"op": "hydrate", "dir": "/nonexistent/dump", "allocations": "20"},
                                  fds=list(fds), page=INTERPOSER_PAGE, timeout=30, sent=let_go)
        order.append("answered")
    finally:
        let_go()
    # All 20 arrived (fewer would be "N of the 20 announced descriptors arrived"), then were weighed: 3 regions.
    assert order[:2] == ["sent", "answered"] and "hydrate: 20 staged allocations: neither" in answer["error"]
    assert settled(pid, before) == before


@pytest.mark.parametrize("line", [
    pytest.param(b'{"op": "\\u73XXtatus"}\n', id="two-digits-then-skipped-bytes"),
    pytest.param(b'{"op": "status\\u9"}\n', id="one-digit-at-the-end"),
    pytest.param(b'{"op": "\\u 73status"}\n', id="a-space"),
    pytest.param(b'{"op": "\\u+073status"}\n', id="a-sign"),
])
def test_a_unicode_escape_takes_exactly_four_hex_digits(pages_server: Served, line: bytes) -> None:
    """Regression (review3): sscanf's %4x took one to four digits (after spaces or a sign) and the parse then
    skipped four bytes whatever it took: "\\u73XXtatus" was read as "status" and answered, and an escape at the
    line's end sent the parse past its end."""
    pid, path, before = pages_server
    answer = exchange(path, line, [])
    assert answer == {"ok": False, "error": "request: only printable ASCII \\u escapes (four hex digits) are "
                                            "accepted"}, answer
    assert jsonline.request(path, {"op": "\u0073tatus"}, timeout=10)["ok"] is True  # a real escape still parses
    assert exchange(path, b'{"op": "\\u0073tatus"}\n', [])["ok"] is True  # type: ignore[index]
    assert settled(pid, before) == before


def test_descriptors_trickled_with_the_request_line_stop_at_one_page(pages_server: Served, tmp_path: Path) -> None:
    """Regression (review3): a peer sending its line a byte at a time, 16 descriptors on every byte, had the
    interposer hold up to 4096 of them in the engine until the request's deadline; now more than one page with the
    line is refused at once, and none is kept."""
    pid, path, before = pages_server
    [fd] = markers(tmp_path, 1)
    peak = 0
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(20)
            sock.connect(path)
            try:
                for byte in b'{"op": "hydrate", "allocations": "4096", "dir": "/nonexistent/dump"':
                    socket.send_fds(sock, [bytes([byte])], [fd] * 16)
                    time.sleep(0.005)
                    peak = max(peak, len(open_fds(pid)))
            except OSError:
                pass  # refused and closed: the rest is not sent
            peak = max(peak, len(open_fds(pid)))
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
            data = b""
            while part := sock.recv(65536):
                data += part
    finally:
        os.close(fd)
    assert json.loads(data) == {"ok": False, "error": "request: more than 16 descriptors came with the request "
                                                      "line (send them in pages after it)"}
    assert peak <= len(before) + 33  # the connection, and at most two messages' descriptors
    assert settled(pid, before) == before


@pytest.mark.parametrize(("line", "error"), [
    pytest.param(b'{"op": "release", "op": "status"}\n', "`op` appears twice", id="op-twice"),
    pytest.param(b'{"op": "hydrate", "dir": "/a", "dir": "/nonexistent/dump"}\n', "`dir` appears twice",
                 id="dir-twice"),
    pytest.param(b'{"op": "' + b"s" * 40 + b'"}\n', "`op` is longer than 31 bytes", id="op-too-long"),
    pytest.param(b'{"op": "hydrate", "allocations": "' + b"0" * 30 + b'1"}\n', "`allocations` is longer than 23 bytes",
                 id="allocations-too-long"),
])
def test_a_key_given_twice_or_too_long_is_refused_naming_it(pages_server: Served, line: bytes, error: str) -> None:
    """Regression (review3): a second `op` or `dir` silently replaced the first (`{"op": "release", "op":
    "status"}` was answered as a status), and an over-long value was refused as an unknown key."""
    pid, path, before = pages_server
    assert exchange(path, line, []) == {"ok": False, "error": f"request: {error}"}
    assert settled(pid, before) == before


# -- chunks of zeros: set on the device by the stage, never read nor moved ----------------------------------------
class TestZeroChunks:
    """The stage's plan (`dump_pieces`: the pieces the copy engine reads or sets) from the manifest's masks."""

    def test_marked_chunks_become_runs_of_zeros_and_the_rest_reads_its_file(self) -> None:
        from coldsnap_probe.hydration._copy import ZEROS, Piece, zero_split

        chunk = 64 * MIB
        piece = Piece(0x1000_0000, "/d/seg-0.bin", 0, 4 * chunk + 2 * MIB)  # 5 chunks, the last one short
        assert zero_split(piece, 0b10110, chunk) == [
            Piece(0x1000_0000, "/d/seg-0.bin", 0, chunk),
            Piece(0x1000_0000 + chunk, ZEROS, 0, 2 * chunk),  # neighbours merged: one memset
            Piece(0x1000_0000 + 3 * chunk, "/d/seg-0.bin", 3 * chunk, chunk),
            Piece(0x1000_0000 + 4 * chunk, ZEROS, 0, 2 * MIB)]
        assert zero_split(piece, 0, chunk) == [piece]
        with pytest.raises(HydrationError, match="marks chunks beyond"):
            zero_split(piece, 0b100000, chunk)

    def test_a_stage_reads_only_the_chunks_the_manifest_does_not_mark(self) -> None:
        from coldsnap_probe.hydration._copy import ZEROS
        from coldsnap_probe.hydration._stage_copy import dump_pieces
        from coldsnap_probe.hydration._weights import WeightRegion

        layout, sizes = dump_layout([part(0, 1 << 30) | {"zero": 0xFF00},  # the upper half of 1 GiB is zeros
                                     part(0, 128 * MIB, "seg-1.bin"),
                                     part(1, 192 * MIB, "seg-2.bin") | {"zero": 0b111}])  # all zeros
        parts, at = [], 0
        for index, (named, size, _region, _zero) in enumerate(layout):
            parts.append(WeightRegion(f"part-{index}", at, size, named, 0, ""))
            at += size
        pieces = dump_pieces(parts, layout, 1 << 40)
        reads = [p for p in pieces if p.source != ZEROS]
        assert sum(p.size for p in reads) == (512 + 128) * MIB == sum(sizes) - (512 + 192) * MIB
        assert [(p.dst - (1 << 40), p.source, p.offset, p.size) for p in reads] == [
            (0, "/images/device-42/seg-0.bin", 0, 512 * MIB), (1 << 30, "/images/device-42/seg-1.bin", 0, 128 * MIB)]
        assert [(p.dst - (1 << 40), p.size) for p in pieces if p.source == ZEROS] == [
            (512 * MIB, 512 * MIB), ((1 << 30) + 128 * MIB, 192 * MIB)]
        assert sum(p.size for p in pieces) == sum(sizes)  # every byte of the stage either read or set

    def test_the_worker_names_each_segment_s_zero_chunks_from_the_manifest(self, tmp_path: Path) -> None:
        """The mask comes from the manifest (the stage's key is its digest), never from the file's holes."""
        from coldsnap_probe.hydration import DeviceDump
        from coldsnap_probe.memory._device_dump import DeviceStage
        from tests.probe.test_interposer import dump_in

        value = dump_in(tmp_path / "dump", (2 * MIB, 2 * MIB)).body()
        value["regions"][1]["segments"][0]["zero"] = 1
        dump = DeviceDump.from_json(value, answered=True)
        stage = DeviceStage(str(tmp_path / "absent.sock"), dump, tmp_path / "dump")
        stage.wait(10)
        assert [p.get("zero") for p in stage.parts] == [None, 1]
        assert [z for _f, _b, _r, z in dump_layout(stage.parts)[0]] == [0, 1]

    def test_a_restore_reads_ahead_only_the_chunks_not_marked_zero(self) -> None:
        """prefetch_dumps asks the kernel for each segment's data runs alone (a pulled image's zeros are written
        bytes on disk: reading them ahead would spend the disk on bytes set on the device anyway)."""
        from coldsnap_probe.hydration._interposer import DumpSegment

        chunk = 64 * MIB
        segment = DumpSegment("seg-0.bin", 0, 0x7F0000000000, 4 * chunk + 2 * MIB, "crc32-64m:", zero=0b10110)
        assert segment.data_runs() == [(0, chunk), (3 * chunk, chunk)]
        assert DumpSegment("seg-1.bin", 0, 0, 3 * chunk, "crc32-64m:", zero=0b011).data_runs() == [(2 * chunk, chunk)]
        assert DumpSegment("seg-2.bin", 0, 0, 2 * chunk, "crc32-64m:").data_runs() == [(0, 2 * chunk)]  # merged
        assert DumpSegment("seg-3.bin", 0, 0, 2 * MIB, "crc32-64m:", zero=1).data_runs() == []
