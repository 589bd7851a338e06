"""Property tests of what a node hydrator parses from a peer before it touches a file or the GPU (issue 37 item 8:
a fuzz or property test for every parser the review exercised by hand): the JSON line (`jsonline.parse_request`,
`read_line` over a real socket pair), a weights request's reservation and regions (`request_regions`), a
stage's key (`stage_key`), an adopt's first page (`first_page`) and a stage-dump's parts (`dump_layout`).
Whatever a peer sends, each answers its typed value or refuses with the package's own error; valid inputs built
by strategies come back as they were."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coldsnap_probe import jsonline
from coldsnap_probe.errors import ChannelError, HydrationError
from coldsnap_probe.hydration._hydrator import ADOPT_PAGE, _exited, _stager
from coldsnap_probe.hydration._peer_files import DUMP_ALIGN, STAGE_ALLOCATIONS, dump_layout
from coldsnap_probe.hydration._request_fields import first_page, request_regions, stage_key
from coldsnap_probe.hydration._weights import WeightRegion

# Any JSON value Python's decoder gives (NaN and the infinities included: it accepts them).
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                          max_size=4), max_leaves=12)
FINITE = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                      | st.text(max_size=20),
                      lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                  max_size=4), max_leaves=12)
DIGEST = "sha256-64m:" + "ab" * 32
KEY = re.compile(r"sha256:[0-9a-f]{64}")
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class TestRequestLine:
    @SETTINGS
    @given(st.binary(max_size=2000))
    def test_any_bytes_are_one_json_object_or_a_channel_error(self, line: bytes) -> None:
        try:
            assert isinstance(jsonline.parse_request(line), dict)
        except ChannelError:
            pass

    @SETTINGS
    @given(st.dictionaries(st.text(max_size=10), FINITE, max_size=6))
    def test_an_object_comes_back_as_it_was_sent(self, message: dict[str, Any]) -> None:
        assert jsonline.parse_request(json.dumps(message).encode() + b"\n") == message

    def test_a_request_nested_past_the_decoders_depth_is_a_channel_error_on_a_real_socket(self) -> None:
        """Python's decoder raises RecursionError on "[[[[..." (not a ValueError): read_request let it out."""
        left, right = socket.socketpair()
        with left, right:
            sender = threading.Thread(target=lambda: (left.sendall(b"[" * 200_000 + b"\n"),
                                                      left.shutdown(socket.SHUT_WR)))
            sender.start()
            right.settimeout(10)
            with pytest.raises(ChannelError, match="nests deeper"):
                jsonline.read_request(right)
            sender.join(10)

    @SETTINGS
    @given(st.lists(st.binary(max_size=400), max_size=8))
    def test_a_line_in_any_chunks_on_a_real_socket_is_read_whole_or_to_a_newline(self, chunks: list[bytes]) -> None:
        left, right = socket.socketpair()
        with left, right:
            for chunk in chunks:
                left.sendall(chunk)
            left.shutdown(socket.SHUT_WR)
            right.settimeout(10)
            sent, line = b"".join(chunks), jsonline.read_line(right)
        assert sent.startswith(line) and (line == sent or line.endswith(b"\n"))


class TestWeightsRequest:
    @SETTINGS
    @given(st.dictionaries(st.sampled_from(["base", "size", "regions", "op", "key"]), JSON, max_size=5))
    def test_any_request_gives_its_regions_or_a_hydration_error(self, message: dict[str, Any]) -> None:
        try:
            base, size, regions = request_regions(message)
        except HydrationError:
            return
        assert base == message["base"] and size == message["size"] and regions

    @SETTINGS
    @given(base=st.integers(0, 1 << 48), sizes=st.lists(st.integers(1, 1 << 30), min_size=1, max_size=6),
           gaps=st.lists(st.integers(0, 1 << 20), min_size=6, max_size=6))
    def test_valid_regions_come_back_in_address_order(self, base: int, sizes: list[int], gaps: list[int]) -> None:
        regions, at = [], base
        for index, (size, gap) in enumerate(zip(sizes, gaps, strict=False)):
            at += gap
            regions.append(WeightRegion(f"r{index}", at, size, f"/w/{index}", 0, DIGEST))
            at += size
        message = {"base": base, "size": at - base, "regions": [r.to_json() for r in reversed(regions)]}
        assert request_regions(json.loads(json.dumps(message))) == (base, at - base, tuple(regions))

    @pytest.mark.parametrize("value", [float("inf"), float("nan"), 1.0, "4096", True, -1, None])
    def test_a_reservation_that_is_not_a_whole_number_is_refused_naming_it(self, value: Any) -> None:
        message = {"base": 0, "size": value, "regions": []}
        with pytest.raises(HydrationError, match="size must be a non-negative integer"):
            request_regions(json.loads(json.dumps(message)))


class TestStageRequests:
    @SETTINGS
    @given(JSON)
    def test_a_key_is_a_manifest_digest_or_refused(self, key: Any) -> None:
        if isinstance(key, str) and KEY.fullmatch(key):
            assert stage_key({"key": key}) == key
        else:
            with pytest.raises(HydrationError, match="key must be a manifest digest"):
                stage_key({"key": key})

    @SETTINGS
    @given(value=JSON | st.integers(-40, 200), count=st.integers(1, 200), taken=st.integers(0, 200))
    def test_a_first_page_is_a_whole_page_at_most_the_next(self, value: Any, count: int, taken: int) -> None:
        valid = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < count \
            and value % ADOPT_PAGE == 0 and value <= taken
        if valid:
            assert first_page(value, count, taken) == value
        else:
            with pytest.raises(HydrationError, match="first must be a multiple"):
                first_page(value, count, taken)

    @SETTINGS
    @given(JSON | st.lists(st.dictionaries(st.sampled_from(["file", "bytes", "region", "zero", "x"]), JSON),
                           max_size=5))
    def test_any_parts_give_a_layout_that_keeps_the_rules_or_are_refused(self, parts: Any) -> None:
        try:
            layout, sizes = dump_layout(parts)
        except HydrationError:
            return
        assert [r for _f, _b, r, _z in layout] == sorted(r for _f, _b, r, _z in layout)
        assert {r for _f, _b, r, _z in layout} == set(range(len(sizes))) and len(sizes) <= STAGE_ALLOCATIONS
        assert all(b > 0 and b % DUMP_ALIGN == 0 and f.startswith("/") for f, b, _r, _z in layout)
        assert all(z >= 0 and z >> -(-b // (64 << 20)) == 0 for _f, b, _r, z in layout)  # no chunk beyond the part
        assert sum(sizes) == sum(b for _f, b, _r, _z in layout)

    @SETTINGS
    @given(st.lists(st.tuples(st.integers(1, 8), st.booleans()), min_size=1, max_size=20))
    def test_valid_parts_come_back_as_they_were(self, shape: list[tuple[int, bool]]) -> None:
        parts, region = [], 0
        for index, (blocks, next_region) in enumerate(shape):
            region += 1 if next_region and index else 0
            parts.append({"file": f"/d/seg-{index}.bin", "bytes": blocks * DUMP_ALIGN, "region": region})
        layout, sizes = dump_layout(json.loads(json.dumps(parts)))
        assert layout == tuple((p["file"], p["bytes"], p["region"], 0) for p in parts)
        assert sizes == tuple(sum(p["bytes"] for p in parts if p["region"] == r) for r in range(region + 1))


def test_a_stage_request_s_descriptor_is_its_stager_s_pidfd_and_says_when_it_exits() -> None:
    """A stage lives while its stager does: the one descriptor a stage request may carry is the stager's pidfd
    (anything else is refused naming the rule), and it polls readable once that process exits."""
    assert _stager([]) == -1 and not _exited(-1)
    child = subprocess.Popen(["sleep", "30"])
    pidfd = os.pidfd_open(child.pid)
    read, write = os.pipe()
    try:
        assert _stager([pidfd]) == pidfd and not _exited(pidfd)
        for wrong in ([read], [pidfd, pidfd]):
            with pytest.raises(HydrationError, match="at most one descriptor, its stager's pidfd"):
                _stager(wrong)
        child.kill()
        child.wait()
        assert _exited(pidfd)
    finally:
        for fd in (pidfd, read, write):
            os.close(fd)


@pytest.mark.parametrize(("value", "rule"), [
    pytest.param("32K", "must be a multiple of 4K from 64K to 64M, not 32K", id="below"),
    pytest.param("65M", "must be a multiple of 4K from 64K to 64M, not 65M", id="beyond"),
    pytest.param("100000", "must be a multiple of 4K from 64K to 64M, not 100000", id="not-pages"),
    pytest.param("big", "must be a positive size (bytes, or with K, M, G, T), not big", id="words"),
])
def test_a_bad_dump_chunk_is_refused_naming_the_option_before_anything_starts(
        tmp_path: Any, value: str, rule: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`serve --dump-chunk` (the ring's read size, issue 35's measurement of what bounds the ring)."""
    from coldsnap_probe.hydration.__main__ import main

    sock = tmp_path / "h.sock"
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--staging", "--socket", str(sock), f"--dump-chunk={value}"])
    assert exited.value.code == 2 and not sock.exists()
    stderr = capsys.readouterr().err
    assert "argument --dump-chunk:" in stderr and rule in stderr, stderr
