"""coldsnap_probe/_adopt.py without a GPU: safetensors headers, the placement plan, the import hook, the
environment switch (a real interpreter started with the adapters folder on PYTHONPATH), and the fallback:
a model the adapter cannot adopt is returned exactly as loaded, the server keeps running."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from coldsnap_probe import _adopt
from coldsnap_probe._adopt import ALIGN, SOCKET_ENV, PatchOnImport, arena_bases, install, plan, read_shards
from coldsnap_probe.errors import HydrationError

ROOT = Path(__file__).resolve().parents[2]


def _safetensors(path: Path, tensors: dict[str, tuple[str, list[int], int]], *, pad: int = 0) -> None:
    """A real safetensors file: 8-byte header length, JSON header, the data section (zeros)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * (offset + pad))


def test_read_shards_and_plan_place_each_parameter_at_its_bytes(tmp_path: Path) -> None:
    _safetensors(tmp_path / "model-00001.safetensors", {"a.weight": ("BF16", [2, 3], 12), "b.bias": ("F32", [3], 12)})
    _safetensors(tmp_path / "model-00002.safetensors", {"c.weight": ("BF16", [4], 8)})
    shards = read_shards(tmp_path)
    assert [Path(s.path).name for s in shards] == ["model-00001.safetensors", "model-00002.safetensors"]
    assert shards[0].size == 24 and shards[0].offset == 8 + len(json.dumps({"__metadata__": {"format": "pt"},
        "a.weight": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
        "b.bias": {"dtype": "F32", "shape": [3], "data_offsets": [12, 24]}}).encode())
    bases, total = arena_bases(shards)
    assert bases == [0, ALIGN] and total == 2 * ALIGN
    placed = plan([("c.weight", "BF16", (4,)), ("b.bias", "F32", (3,)), ("a.weight", "BF16", (2, 3))], shards)
    assert [(p.name, p.offset, p.size) for p in placed] == [("c.weight", ALIGN, 8), ("b.bias", 12, 12),
                                                            ("a.weight", 0, 12)]


@pytest.mark.parametrize(("parameters", "message"), [
    ([("a.weight", "F16", (2, 3))], "parameter a.weight was loaded as F16 \\[2, 3\\] but the file holds BF16"),
    ([("a.weight", "BF16", (3, 2))], "loaded as BF16 \\[3, 2\\]"),
    ([("lm_head.weight", "BF16", (2, 3))], "parameter lm_head.weight is not a tensor of the safetensors files"),
])
def test_plan_refuses_what_is_not_in_the_files_exactly(tmp_path: Path, parameters: list[Any], message: str) -> None:
    _safetensors(tmp_path / "m.safetensors", {"a.weight": ("BF16", [2, 3], 12)})
    with pytest.raises(HydrationError, match=message):
        plan(parameters, read_shards(tmp_path))


def test_plan_needs_shards(tmp_path: Path) -> None:
    with pytest.raises(HydrationError, match="no safetensors shards"):
        plan([("a", "BF16", (1,))], read_shards(tmp_path))


def test_read_shards_refuses_headers_that_lie(tmp_path: Path) -> None:
    (tmp_path / "short.safetensors").write_bytes(b"\1\0")
    with pytest.raises(HydrationError, match="shorter than a safetensors header"):
        read_shards(tmp_path)
    (tmp_path / "short.safetensors").write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(HydrationError, match="header length"):
        read_shards(tmp_path)
    (tmp_path / "short.safetensors").write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(HydrationError, match="not JSON"):
        read_shards(tmp_path)
    raw = json.dumps({"x": {"dtype": "BF16", "shape": [8], "data_offsets": [0, 1 << 20]}}).encode()
    (tmp_path / "short.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 16)
    with pytest.raises(HydrationError, match="tensor 'x' data_offsets \\[0, 1048576\\] lie outside the file"):
        read_shards(tmp_path)


def test_patch_on_import_runs_after_the_module_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "cs_fake_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "modeling.py").write_text("class Model:\n    loaded = 'original'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[str] = []

    def patch(module: ModuleType) -> None:
        seen.append(module.Model.loaded)
        module.Model.loaded = "patched"

    finder = PatchOnImport("cs_fake_pkg.modeling", patch)
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    import cs_fake_pkg.modeling as modeling

    assert seen == ["original"] and modeling.Model.loaded == "patched"
    assert finder not in sys.meta_path  # one import: it stepped aside
    for name in ("cs_fake_pkg.modeling", "cs_fake_pkg"):
        sys.modules.pop(name, None)


class _FakeParameter:
    def __init__(self) -> None:
        self.dtype, self.device, self.shape, self.data = "torch.float32", SimpleNamespace(type="cpu", index=None), \
            (2,), "original data"


class _FakeModel:
    def __init__(self) -> None:
        self.parameter = _FakeParameter()

    def named_parameters(self) -> list[tuple[str, _FakeParameter]]:
        return [("w", self.parameter)]


def _fake_transformers(folder: Path) -> tuple[ModuleType, list[object]]:
    module = ModuleType("transformers.modeling_utils")
    loads: list[object] = []

    class PreTrainedModel:
        @classmethod
        def from_pretrained(cls, source: str, **kwargs: object) -> _FakeModel:
            loads.append((cls.__name__, source, kwargs))
            return _FakeModel()

    module.PreTrainedModel = PreTrainedModel  # type: ignore[attr-defined]
    return module, loads


def test_install_is_inert_unless_the_environment_names_an_absolute_socket(capsys: pytest.CaptureFixture[str]) -> None:
    before = list(sys.meta_path)
    assert install({}) is False
    assert install({SOCKET_ENV: "relative.sock"}) is False
    assert install({SOCKET_ENV: "/run/h.sock", "COLDSNAP_HYDRATION_STRATEGY": "fastest"}) is False
    assert install({SOCKET_ENV: "/run/h.sock", "COLDSNAP_HYDRATOR_SOCKET": "hydrator.sock"}) is False
    assert sys.meta_path == before
    err = capsys.readouterr().err
    assert "must be an absolute path, got 'relative.sock'" in err and "must be ring or register, got 'fastest'" in err
    assert "COLDSNAP_HYDRATOR_SOCKET must be an absolute path, got 'hydrator.sock'" in err


def test_a_model_the_adapter_cannot_adopt_is_served_as_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The CPU fallback: a float32 CPU parameter is refused with the reason, the model comes back untouched."""
    module, loads = _fake_transformers(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers.modeling_utils", module)
    assert install({SOCKET_ENV: str(tmp_path / "h.sock")}) is True
    model = module.PreTrainedModel.from_pretrained(str(tmp_path), dtype="auto")
    assert loads == [("PreTrainedModel", str(tmp_path), {"dtype": "auto"})]
    assert isinstance(model, _FakeModel) and model.parameter.data == "original data"
    said = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert said[-1]["coldsnap_adapter"] == "not adopted: the server keeps the weights as loaded"
    assert "parameter w is float32 on" in said[-1]["error"] and "only CUDA tensors" in said[-1]["error"]
    assert not (tmp_path / "h.sock").exists()
    # A second model, or one named by a Hub id rather than a folder, is not adopted (one arena per process).
    module.PreTrainedModel.from_pretrained("org/model")
    assert capsys.readouterr().err == ""


def test_sitecustomize_installs_only_when_the_unit_environment_asks(tmp_path: Path) -> None:
    """A real interpreter with the adapters folder first on PYTHONPATH, as the unit's environment sets it."""
    program = textwrap.dedent("""
        import sys
        print(any(type(f).__name__ == "PatchOnImport" for f in sys.meta_path))
    """)
    env = {k: v for k, v in os.environ.items() if k != SOCKET_ENV}
    env["PYTHONPATH"] = f"{ROOT / 'coldsnap_probe' / 'adapters'}:{ROOT}"
    off = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, check=True)
    on = subprocess.run([sys.executable, "-c", program], env={**env, SOCKET_ENV: str(tmp_path / "h.sock")},
                        capture_output=True, text=True, check=True)
    assert (off.stdout.strip(), on.stdout.strip()) == ("False", "True"), (off.stderr, on.stderr)


def test_adopt_refuses_before_touching_cuda_when_the_model_is_not_its_files(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan is checked before any arena exists: a parameter missing from the files leaves nothing behind."""
    _safetensors(tmp_path / "m.safetensors", {"other": ("F32", [2], 8)})
    model = _FakeModel()
    model.parameter.device = SimpleNamespace(type="cuda", index=0)
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace())
    with pytest.raises(HydrationError, match="parameter w is not a tensor of the safetensors files"):
        _adopt.adopt(model, str(tmp_path), str(tmp_path / "h.sock"))
    assert model.parameter.data == "original data" and not (tmp_path / "h.sock").exists()
