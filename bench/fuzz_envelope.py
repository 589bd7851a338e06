"""A long hypothesis run of the two request decoders (provider envelope, control socket).

    .venv/bin/python bench/fuzz_envelope.py [--examples 100000]

Each input is arbitrary bytes, arbitrary JSON, or a valid request mutated the ways the
hardening issue found dangerous (deep nesting, duplicate keys, trailing newlines, wrong types,
oversize strings, bad UTF-8). The contract: a decoder returns a typed request or raises
``RequestRejected``; anything else (RecursionError, a TypeError, ...) is a crash. The table
gives the count per decoder and the crash total.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import table

from coldsnap_provider import decode_control, decode_request
from coldsnap_runtime.errors import RequestRejected

VALID = {"format": 1, "id": "1767225600000000001", "token": "t", "session": "op-1", "operation": "exec",
         "host": "localhost", "arguments": ["true"]}
VALID_CONTROL = {"format": 1, "id": "c", "operation": "session-open", "session": "op-1", "hosts": ["h"]}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> bytes:
    request = dict(base)
    kind = draw(st.sampled_from(["replace", "add", "deep", "duplicate", "newline", "big", "utf8", "drop"]))
    key = draw(st.sampled_from(sorted(request)))
    if kind == "replace":
        request[key] = draw(json_values)
    elif kind == "add":
        request[draw(st.text(max_size=8))] = draw(json_values)
    elif kind == "drop":
        request.pop(key)
    elif kind == "newline" and isinstance(request[key], str):
        request[key] += draw(st.sampled_from(["\n", "\r", "\x00", "\r\n"]))
    elif kind == "big":
        request[key] = "x" * draw(st.integers(0, 1 << 16))
    text = json.dumps(request, separators=(",", ":"))
    if kind == "deep":
        depth = draw(st.integers(100, 20000))
        text = text[:-1] + f',"{key}":{_nested(depth)}}}'
    elif kind == "duplicate":
        text = text[:-1] + f',"{key}":{json.dumps(draw(json_values))}}}'
    data = text.encode()
    if kind == "utf8":
        data = data.replace(b'"t"', b'"\xff\xfe"', 1)
    return data


def fuzz(name: str, decode: Callable[[bytes], object], base: dict[str, Any], examples: int) -> list[object]:
    """One decoder's row: inputs, accepted, rejected, crashed, seconds."""
    outcomes: Counter[str] = Counter()
    crashes: list[str] = []

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.one_of(st.binary(max_size=256), json_values.map(lambda v: json.dumps(v).encode()), mutated(base)))
    def check(data: bytes) -> None:
        try:
            decode(data)
        except RequestRejected:
            outcomes["rejected"] += 1
        except Exception as exc:  # a crash: the contract allows only RequestRejected
            outcomes["crashed"] += 1
            crashes.append(f"{type(exc).__name__}: {exc}"[:200])
        else:
            outcomes["accepted"] += 1

    started = time.perf_counter()
    check()
    seconds = time.perf_counter() - started
    for crash in crashes[:5]:
        print(f"crash ({name}): {crash}")
    return [name, sum(outcomes.values()), outcomes["accepted"], outcomes["rejected"], outcomes["crashed"],
            f"{seconds:.1f}"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=100_000)
    args = parser.parse_args()
    rows = [fuzz("provider envelope", decode_request, VALID, args.examples),
            fuzz("control request", decode_control, VALID_CONTROL, args.examples)]
    print(table(["decoder", "inputs", "accepted", "rejected", "crashed", "seconds"], rows))


if __name__ == "__main__":
    main()
