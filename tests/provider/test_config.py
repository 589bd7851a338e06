"""The configuration reference in README.md and the embedded default-config.toml cannot drift from `Config`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from importlib import resources
from typing import Any

import msgspec
import pytest

from coldsnap_provider._config import Config, KubernetesConfig, RemoteConfig, load_config
from tests.helpers import ROOT

_ROW = re.compile(r"^\| `(?P<key>[a-z_]+(?:\[\])?\.[a-z_]+)` \| (?P<default>`[^`]*`|\*required\*) \|", re.M)


def _toml(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def _default(field: msgspec.structs.FieldInfo) -> str:
    if field.required:
        return "*required*"
    value = field.default if field.default is not msgspec.NODEFAULT else field.default_factory()
    return f"`{_toml(value)}`"


def schema_keys() -> Iterator[tuple[str, str]]:
    """(dotted key, rendered default) of every leaf key of `Config`; `[[remote]]` entries as `remote[].key`
    (and `[[kubernetes]]` ones as `kubernetes[].key`)."""
    entries: dict[str, Any] = {"remote": RemoteConfig, "kubernetes": KubernetesConfig}
    for section in msgspec.structs.fields(Config):
        if section.name in entries:
            for field in msgspec.structs.fields(entries[section.name]):
                yield f"{section.name}[].{field.name}", _default(field)
            continue
        struct = section.default if section.default is not msgspec.NODEFAULT else section.default_factory()
        for field in msgspec.structs.fields(type(struct)):
            yield f"{section.name}.{field.name}", _default(field)


def reference_rows() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    return {match["key"]: match["default"] for match in _ROW.finditer(text)}


def test_readme_reference_lists_every_key_with_its_default() -> None:
    rows = reference_rows()
    wrong = [f"{key}: README says {rows.get(key, 'nothing')}, the code's default is {default}"
             for key, default in schema_keys() if rows.get(key) != default]
    assert not wrong, "README.md ## Configuration → Reference is out of date:\n" + "\n".join(wrong)


def test_readme_reference_names_no_key_the_configuration_lacks() -> None:
    known = {key for key, _ in schema_keys()}
    assert set(reference_rows()) - known == set()


def test_embedded_default_configuration_is_the_schema_default() -> None:
    assert load_config(None) == Config()


@pytest.mark.parametrize(("key", "default"), list(schema_keys()))
def test_embedded_default_configuration_documents_every_key(key: str, default: str) -> None:
    """Each key is set (or, for a [[remote]] entry, shown commented out) in default-config.toml."""
    text = resources.files("coldsnap_provider").joinpath("default-config.toml").read_text()
    section, name = key.split(".")
    if section in ("remote[]", "kubernetes[]"):
        entry = section.removesuffix("[]")
        block = re.search(rf"^# \[\[{entry}\]\]\n(?P<body>(?:^#.*\n?)*)", text, re.M)
        assert block is not None and re.search(rf"^# {name} = ", block["body"], re.M), (
            f"[[{entry}]] {name} is not shown in default-config.toml")
        return
    body = re.search(rf"^\[{section}\]\n(?P<body>(?:(?!^\[).*\n?)*)", text, re.M)
    assert body is not None, f"default-config.toml has no [{section}] section"
    assert re.search(rf"^{name} = ", body["body"], re.M), f"default-config.toml's [{section}] lacks {name}"
