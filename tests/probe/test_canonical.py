"""Go-compatible canonical JSON and digests (spec 5.5)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coldsnap_probe.canonical import canonical_json, digest, go_floats
from coldsnap_probe.errors import NotCanonical


def test_adapter_payload_vector() -> None:
    payload = {"dimensions": {"tensor": 1, "pipeline": 1, "data": 1, "expert": 1, "context": 1},
               "runtime": "vllm-direct"}
    assert digest(payload) == "sha256:236933adde8b8b19c2ad3b79d2797964764ac4f7aaf767d4d2431784588a1613"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ({"b": 1, "a": [True, None]}, b'{"a":[true,null],"b":1}'),
        ("\u00e9\U0001f600\n\x01", b'"\\u00e9\\ud83d\\ude00\\n\\u0001"'),
        (10**30, b"1000000000000000000000000000000"),
        (1e16, b"1e+16"),
        (1e-5, b"1e-05"),
        (0.0001, b"0.0001"),
        (-0.0, b"-0.0"),
        (2.5, b"2.5"),
    ],
)
def test_canonical_tokens(value: object, text: bytes) -> None:
    assert canonical_json(value) == text


def test_nan_and_infinity_are_refused() -> None:
    for bad in (float("nan"), float("inf"), {"x": float("-inf")}):
        with pytest.raises(NotCanonical, match="canonical JSON refuses") as info:
            canonical_json(bad)
        assert isinstance(info.value.__cause__, ValueError)  # json's own refusal, chained


def test_go_floats_writes_integral_floats_as_integers() -> None:
    assert canonical_json(go_floats({"seconds": 2.0, "z": -0.0, "x": 2.5, "l": [3.0]})) == \
        b'{"l":[3],"seconds":2,"x":2.5,"z":0}'
    assert go_floats(1e21) == 1e21


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text() |
                    st.floats(allow_nan=False, allow_infinity=False),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                    max_leaves=20))
def test_canonical_json_is_ascii_compact_and_stable(value: object) -> None:
    import json

    text = canonical_json(value)
    text.decode("ascii")
    assert canonical_json(json.loads(text)) == text
