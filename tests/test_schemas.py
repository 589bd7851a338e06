"""The committed JSON Schemas are exactly what the Structs generate."""

from __future__ import annotations

from coldsnap_provider import generate_schemas as generate
from tests.helpers import ROOT


def test_committed_schemas_match_the_structs() -> None:
    generated = generate()
    directory = ROOT / "schemas"
    committed = {p.name: p.read_text() for p in directory.glob("*.schema.json")}
    assert set(committed) == set(generated), "run: python -m coldsnap_provider._schemas schemas"
    for name, text in generated.items():
        assert committed[name] == text, f"{name} drifted; run: python -m coldsnap_provider._schemas schemas"


def test_schemas_carry_the_protocol_rules() -> None:
    text = generate()["runtime-request.schema.json"]
    assert '"additionalProperties": false' in text
    for rule in ("reference: non-empty", "path: absolute, normalised", "mapping key", "GPU device id"):
        assert rule in text
