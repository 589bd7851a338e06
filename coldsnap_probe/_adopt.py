"""The opt-in hydration adapter for servers that load models with transformers' `from_pretrained`.

A server people run unchanged (`transformers serve`, issue 23) knows nothing of ColdSnap. When the unit's
environment names a hydration socket (`COLDSNAP_HYDRATION_SOCKET`) and puts `coldsnap_probe/adapters` on
`PYTHONPATH`, that folder's `sitecustomize` calls `install()`, which patches
`transformers.PreTrainedModel.from_pretrained` the moment transformers defines it (an import hook: nothing
is imported early, nothing changes when the variable is unset). The first model loaded from a local folder
of safetensors shards is then *adopted*: its parameters move into a `WeightArena` laid out as the shards'
data sections (each parameter becomes a view of the arena at its tensor's offset, checked equal to what
transformers loaded), and the arena's control socket serves the restore worker's `release` / `hydrate`. A
forward pre-hook holds every forward pass until the weights are hydrated after a restore.

Anything the adapter cannot prove (a tensor missing from the files, another dtype or shape, a quantized or
CPU parameter, a model from the Hub cache) leaves the model as transformers loaded it and says why on
stderr: the server then runs as without the adapter (the full-image path).

The adapter runs inside a server that has already imported torch; it never imports torch itself (this
package imports only the standard library, cuda-python and pynvml) but uses the server's module.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from .errors import HydrationError

SOCKET_ENV = "COLDSNAP_HYDRATION_SOCKET"
STRATEGY_ENV = "COLDSNAP_HYDRATION_STRATEGY"  # ring (default) or register
HYDRATOR_ENV = "COLDSNAP_HYDRATOR_SOCKET"  # a long-lived hydrator (python -m coldsnap_probe.hydration serve)
REGIONS_FILE = "coldsnap-regions.json"  # precomputed region digests beside the shards (optional)
TARGET_MODULE = "transformers.modeling_utils"
ALIGN = 2 << 20
# safetensors dtype names and the torch dtype attribute each corresponds to
DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
          "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
MAX_HEADER = 100 << 20


@dataclass(frozen=True, slots=True)
class Shard:
    """One safetensors file: its data section (offset, size) and each tensor's (dtype, shape, begin, end)."""

    path: str
    offset: int
    size: int
    tensors: dict[str, tuple[str, tuple[int, ...], int, int]]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one parameter lives in the arena: `offset` bytes from its base, `size` bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    size: int


def read_shards(directory: str | Path) -> list[Shard]:
    """The folder's safetensors files (sorted), each header checked: offsets inside the file, no overlap."""
    shards = []
    for path in sorted(Path(directory).glob("*.safetensors")):
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise HydrationError(f"{path}: shorter than a safetensors header")
            (length,) = struct.unpack("<Q", raw)
            if length > MAX_HEADER:
                raise HydrationError(f"{path}: header length {length} exceeds {MAX_HEADER}")
            try:
                header = json.loads(f.read(length))
            except ValueError as exc:
                raise HydrationError(f"{path}: the header is not JSON: {exc}") from exc
            file_size = os.fstat(f.fileno()).st_size
        if not isinstance(header, dict):
            raise HydrationError(f"{path}: the header is not an object")
        header.pop("__metadata__", None)
        tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, entry in header.items():
            try:
                dtype, shape, (begin, end) = str(entry["dtype"]), tuple(int(n) for n in entry["shape"]), \
                    entry["data_offsets"]
            except (KeyError, TypeError, ValueError) as exc:
                raise HydrationError(f"{path}: tensor {name!r} has no dtype/shape/data_offsets") from exc
            if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end
                    and 8 + length + end <= file_size):
                raise HydrationError(f"{path}: tensor {name!r} data_offsets {[begin, end]} lie outside the file")
            tensors[name] = (dtype, shape, begin, end)
        size = max((t[3] for t in tensors.values()), default=0)
        shards.append(Shard(str(path), 8 + length, size, tensors))
    return shards


def arena_bases(shards: Sequence[Shard]) -> tuple[list[int], int]:
    """Each shard's base in the arena (2 MiB aligned, in order) and the arena's size."""
    bases, total = [], 0
    for shard in shards:
        bases.append(total)
        total += -(-shard.size // ALIGN) * ALIGN
    return bases, total


def plan(parameters: Sequence[tuple[str, str, tuple[int, ...]]], shards: Sequence[Shard]) -> list[Placement]:
    """Place each (name, safetensors dtype, shape) parameter at its tensor's bytes in the arena.

    Raises HydrationError naming the first parameter that is not in the files exactly as loaded: the adapter
    adopts a model whole or not at all."""
    if not shards:
        raise HydrationError("no safetensors shards in the model folder")
    bases, _ = arena_bases(shards)
    where: dict[str, tuple[int, tuple[str, tuple[int, ...], int, int]]] = {}
    for base, shard in zip(bases, shards, strict=True):
        for name, tensor in shard.tensors.items():
            where[name] = (base, tensor)
    placements = []
    for name, dtype, shape in parameters:
        if name not in where:
            raise HydrationError(f"parameter {name} is not a tensor of the safetensors files")
        base, (file_dtype, file_shape, begin, end) = where[name]
        if (file_dtype, file_shape) != (dtype, tuple(shape)):
            raise HydrationError(f"parameter {name} was loaded as {dtype} {list(shape)} but the file holds "
                                 f"{file_dtype} {list(file_shape)}")
        placements.append(Placement(name, dtype, tuple(shape), base + begin, end - begin))
    return placements


def _digests(directory: str, shards: Sequence[Shard]) -> list[str]:
    from . import region_digest  # the package's API (imported late: this module loads before it)

    known: dict[tuple[str, int, int], str] = {}
    try:
        recorded = json.loads(Path(directory, REGIONS_FILE).read_text())
        known = {(str(r["file"]), int(r["offset"]), int(r["size"])): str(r["digest"]) for r in recorded}
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no usable precomputed digests: compute them
    return [known.get((os.path.basename(s.path), s.offset, s.size)) or region_digest(s.path, s.offset, s.size)
            for s in shards]


class _DeviceBytes:
    """A device address range as a CUDA array (torch.as_tensor makes a view of it, no copy)."""

    def __init__(self, address: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


def _say(message: str, **extra: Any) -> None:
    sys.stderr.write(json.dumps({"coldsnap_adapter": message, "unix": time.time(), **extra}) + "\n")
    sys.stderr.flush()


def adopt(model: Any, directory: str, control: str, *, strategy: str = "ring") -> Any:
    """Move `model`'s parameters into a WeightArena filled from `directory`'s shards; serve it on `control`.

    `strategy` is how the worker's hydrations after a restore fill it: `ring` or `register` from the files,
    or `hydrator:<socket>` through a long-lived hydrator that keeps the shards page-locked (the arena's
    allocation is then exportable; the cold load still reads the files through the ring).

    Returns the arena. Raises HydrationError (model untouched) when the model is not exactly its files."""
    torch = sys.modules.get("torch")  # the server's own torch (see the module docstring)
    names = {v: k for k, v in DTYPES.items()}
    parameters = []
    for name, parameter in model.named_parameters():
        kind = str(parameter.dtype).removeprefix("torch.")
        if parameter.device.type != "cuda" or kind not in names:
            raise HydrationError(f"parameter {name} is {kind} on {parameter.device}: only CUDA tensors of "
                                 "the safetensors dtypes are adopted")
        parameters.append((name, names[kind], tuple(parameter.shape)))
    shards = read_shards(directory)
    placements = plan(parameters, shards)
    if torch is None:
        raise HydrationError("torch is not loaded in this process: nothing to adopt")
    from . import WeightArena, WeightRegion

    bases, total = arena_bases(shards)
    device = int(parameter.device.index or 0)
    hydrator = strategy.startswith("hydrator:")
    arena = WeightArena(total, device=device, exportable=hydrator)
    try:
        arena.declare([WeightRegion(f"shard-{i}", arena.address + base, shard.size, shard.path, shard.offset,
                                    digest)
                       for i, (base, shard, digest) in enumerate(zip(bases, shards, _digests(directory, shards),
                                                                     strict=True))])
        report = arena.load(strategy="ring" if hydrator else strategy)
        views = _views(torch, model, arena.address, placements, device)
    except BaseException:
        _discard(arena)  # the model keeps transformers' copy; the arena's memory goes back
        raise
    for parameter, view in views:  # the same Parameter objects, now backed by the arena
        parameter.data = view
    del views
    torch.cuda.empty_cache()  # transformers' copies go back to the device
    model.register_forward_pre_hook(lambda _module, _args: _wait(arena))
    arena.serve(control, strategy=strategy)
    _say("adopted", parameters=len(placements), arena_bytes=arena.size, control=control,
         **{k: v for k, v in report.items() if isinstance(v, int | float)})
    return arena


def _views(torch: Any, model: Any, address: int, placements: Sequence[Placement],
           device: int) -> list[tuple[Any, Any]]:
    """Each parameter with its view of the arena, checked equal to what transformers loaded."""
    by_name = dict(model.named_parameters())
    views = []
    for p in placements:
        raw = torch.as_tensor(_DeviceBytes(address + p.offset, p.size), device=f"cuda:{device}")
        view = raw.view(getattr(torch, DTYPES[p.dtype])).view(p.shape)
        if not torch.equal(view, by_name[p.name].data):
            raise HydrationError(f"parameter {p.name} differs from its bytes in the files (converted at load?)")
        views.append((by_name[p.name], view))
    return views


def _discard(arena: Any) -> None:
    arena._unmap()
    arena.driver.call("cuMemAddressFree", arena.address, arena.size)


def _wait(arena: Any) -> None:
    """Forward pre-hook: after a restore, no forward pass reads the weights before they are hydrated."""
    arena.wait_ready()


# ---------------------------------------------------------------------------------------------------------------
# Installation: patch from_pretrained when transformers defines it


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs `patch(module)` right after the module named `target` executes (once, the first import)."""

    def __init__(self, target: str, patch: Callable[[ModuleType], None]) -> None:
        self.target, self.patch = target, patch

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)  # one import, and the real finders below find the module
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        original = spec.loader
        patch = self.patch

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
                return original.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                original.exec_module(module)
                patch(module)

        spec.loader = Loader()
        return spec


def _patch_from_pretrained(module: ModuleType, control: str, strategy: str) -> None:
    cls = getattr(module, "PreTrainedModel", None)
    descriptor = cls.__dict__.get("from_pretrained") if cls is not None else None
    if not isinstance(descriptor, classmethod):
        _say("not installed: transformers.modeling_utils.PreTrainedModel.from_pretrained is not a classmethod")
        return
    load = descriptor.__func__
    adopted = threading.Event()

    def from_pretrained(klass: Any, *args: Any, **kwargs: Any) -> Any:
        model = load(klass, *args, **kwargs)
        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        if adopted.is_set() or not isinstance(source, str | os.PathLike) or not os.path.isdir(source):
            return model
        adopted.set()  # one arena, one control socket per process
        try:
            adopt(model, os.fspath(source), control, strategy=strategy)
        except Exception as exc:  # whatever went wrong, the server must keep the model it loaded and run on
            _say("not adopted: the server keeps the weights as loaded", error=f"{type(exc).__name__}: {exc}")
        return model

    from_pretrained.__doc__ = load.__doc__
    cls.from_pretrained = classmethod(from_pretrained)  # type: ignore[union-attr]


def install(environ: dict[str, str] | None = None) -> bool:
    """Called by `adapters/sitecustomize.py`: patch transformers when the environment names the socket."""
    env = os.environ if environ is None else environ
    control = env.get(SOCKET_ENV, "")
    if not control:
        return False
    if not os.path.isabs(control):
        _say(f"not installed: {SOCKET_ENV} must be an absolute path, got {control!r}")
        return False
    strategy = env.get(STRATEGY_ENV, "ring")
    if strategy not in ("ring", "register"):
        _say(f"not installed: {STRATEGY_ENV} must be ring or register, got {strategy!r}")
        return False
    hydrator = env.get(HYDRATOR_ENV, "")
    if hydrator and not os.path.isabs(hydrator):
        _say(f"not installed: {HYDRATOR_ENV} must be an absolute path, got {hydrator!r}")
        return False
    strategy = f"hydrator:{hydrator}" if hydrator else strategy
    if TARGET_MODULE in sys.modules:
        _patch_from_pretrained(sys.modules[TARGET_MODULE], control, strategy)
    else:
        sys.meta_path.insert(0, PatchOnImport(TARGET_MODULE, lambda m: _patch_from_pretrained(m, control,
                                                                                               strategy)))
    return True
