"""The map stays true (issue 39, item 5), and each mechanism has one home (item 2).

* `docs/architecture.md` names every module file (``*.py``, ``*.c``, ``*.h``) of every package, in the first
  column of a table under the package's own ``### `<package>` `` heading, by its path inside the package; and
  every file such a cell names exists. A failure lists exactly which modules are missing from the map and which
  the map names that do not exist.
* Every public method of the runtime seam (`Backend`) and of each class that implements it has a docstring: the
  contract (what it does, what it raises, idempotence and cancellation where they matter) is written where a new
  backend's author reads it.
* One JSON-line channel per side of a process boundary: `coldsnap_provider/_framing.py` for the daemon,
  `coldsnap_probe/jsonline.py` for the capsule. No other module of the packages or the engines reads a socket's
  bytes, unless it is listed below with the protocol (not JSON lines) it speaks.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

from tests.helpers import ROOT

PACKAGES = ("coldsnap_provider", "coldsnap_runtime", "coldsnap_probe", "nccl_shim", "engines")
MODULE_SUFFIXES = (".py", ".c", ".h")
_MODULE_PATH = re.compile(r"[\w./-]+\.(?:py|c|h)")


def module_files(root: Path, package: str) -> set[str]:
    """Every module file of `package`, by its path inside the package."""
    base = root / package
    return {str(path.relative_to(base)) for path in base.rglob("*")
            if path.suffix in MODULE_SUFFIXES and path.is_file() and "__pycache__" not in path.parts}


def named_modules(text: str, packages: Iterable[str]) -> dict[str, set[str]]:
    """The module paths each package's section names in the first column of its tables."""
    named: dict[str, set[str]] = {package: set() for package in packages}
    for section in re.split(r"^### ", text, flags=re.M)[1:]:
        heading = re.match(r"`(\w+)`\s*$", section.split("\n", 1)[0])
        if heading is None or heading[1] not in named:
            continue
        body = section.split("\n## ", 1)[0]  # the section ends at the next top-level heading
        for line in body.splitlines():
            if line.startswith("|") and line.count("|") >= 3:
                first = line.split("|")[1]
                named[heading[1]] |= {token for token in re.findall(r"`([^`]+)`", first)
                                      if _MODULE_PATH.fullmatch(token)}
    return named


def map_errors(root: Path, doc: Path, packages: Iterable[str]) -> list[str]:
    named = named_modules(doc.read_text(), packages)
    errors = []
    for package, listed in named.items():
        files = module_files(root, package)
        if missing := sorted(files - listed):
            errors.append(f"{package}: modules missing from the map: {', '.join(missing)}")
        if unknown := sorted(listed - files):
            errors.append(f"{package}: the map names modules that do not exist: {', '.join(unknown)}")
    return errors


def test_architecture_md_names_every_module_and_only_modules_that_exist() -> None:
    errors = map_errors(ROOT, ROOT / "docs/architecture.md", PACKAGES)
    assert not errors, ("docs/architecture.md is out of step with the code (name each module in the first column "
                        "of its package's table, by its path inside the package):\n" + "\n".join(errors))


def test_the_map_rule_can_fail(tmp_path: Path) -> None:
    """A module the map leaves out, a module the map names that is gone, and a name outside a first column or
    outside the package's section are all found."""
    for name in ("pkg/__init__.py", "pkg/_a.py", "pkg/sub/_b.py", "pkg/lib.c", "other/_x.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "map.md").write_text(
        "### `pkg`\n\n| module | owns |\n| --- | --- |\n| `__init__.py`, `_a.py` | things; not `lib.c` |\n"
        "| `_gone.py` | nothing |\n\n`sub/_b.py` is only in prose.\n\n## Elsewhere\n\n| `lib.c` | after the section |\n"
        "\n### `other`\n\n| `_x.py` | x |\n")
    assert map_errors(tmp_path, tmp_path / "map.md", ("pkg", "other")) == [
        "pkg: modules missing from the map: lib.c, sub/_b.py",
        "pkg: the map names modules that do not exist: _gone.py",
    ]


# --- the runtime seam's contract ----------------------------------------------------------------------------------

BACKEND = ROOT / "coldsnap_runtime/backend/_base.py"


def _classes(paths: Iterable[Path]) -> Iterable[tuple[Path, ast.ClassDef]]:
    for path in paths:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                yield path, node


def _methods(cls: ast.ClassDef) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [node for node in cls.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]


def _bases(cls: ast.ClassDef) -> set[str]:
    return {base.id if isinstance(base, ast.Name) else ast.unparse(base) for base in cls.bases}


def backend_classes(paths: Iterable[Path], protocol: ast.ClassDef) -> list[tuple[Path, ast.ClassDef]]:
    """Every class implementing the protocol: one deriving from a known implementation, or one that defines at
    least half of the protocol's methods itself."""
    seam = {method.name for method in _methods(protocol)}
    classes = list(_classes(paths))
    found: list[tuple[Path, ast.ClassDef]] = []
    names: set[str] = set()
    while True:  # to a fixed point: a subclass of a subclass counts too
        more = [(path, cls) for path, cls in classes if cls.name not in names and cls.name != protocol.name
                and (_bases(cls) & names or 2 * len(seam & {m.name for m in _methods(cls)}) >= len(seam))]
        if not more:
            return found
        found += more
        names |= {cls.name for _, cls in more}


def undocumented(classes: Iterable[tuple[Path, ast.ClassDef]], root: Path) -> list[str]:
    """`path:line Class.method` for each public method (no leading underscore) without a docstring."""
    return [f"{path.relative_to(root)}:{method.lineno} {cls.name}.{method.name}" for path, cls in classes
            for method in _methods(cls) if not method.name.startswith("_") and ast.get_docstring(method) is None]


def _protocol() -> ast.ClassDef:
    return next(cls for _, cls in _classes([BACKEND]) if cls.name == "Backend")


def test_backend_and_every_implementation_document_each_public_method() -> None:
    protocol = _protocol()
    paths = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    implementations = backend_classes(paths, protocol)
    assert {cls.name for _, cls in implementations} >= {"DockerBackend", "KubernetesBackend", "RemoteDocker"}
    missing = undocumented([(BACKEND, protocol), *implementations], ROOT)
    assert not missing, "a method of the runtime seam without its contract (a docstring):\n" + "\n".join(missing)
    assert ast.get_docstring(protocol), "Backend states the contract every implementation keeps"


def test_the_contract_rule_can_fail(tmp_path: Path) -> None:
    """An undocumented method of the protocol, of an implementation and of its subclass are found; private
    methods and unrelated classes are not."""
    (tmp_path / "seam.py").write_text(
        "class Backend:\n    def a(self):\n        '''A.'''\n    def b(self): ...\n"
        "class Impl:\n    def a(self):\n        '''A.'''\n    def b(self): pass\n    def _c(self): pass\n"
        "class Sub(Impl):\n    def extra(self): pass\n"
        "class Other:\n    def z(self): pass\n")
    path = tmp_path / "seam.py"
    protocol = next(cls for _, cls in _classes([path]) if cls.name == "Backend")
    found = undocumented([(path, protocol), *backend_classes([path], protocol)], tmp_path)
    assert found == ["seam.py:4 Backend.b", "seam.py:8 Impl.b", "seam.py:11 Sub.extra"]


# --- one JSON-line channel per side -------------------------------------------------------------------------------

# The calls that read (or half-close) a socket: the standard library's and anyio's.
SOCKET_READS = frozenset({"recv", "recv_into", "recvmsg", "recvfrom", "recv_fds", "makefile", "receive",
                          "receive_until", "receive_exactly", "send_eof"})
# The one JSON-line channel of each side of a process boundary (they cannot share code: the capsule-side probe is
# standard library only and never imports the daemon; the daemon's end is anyio's, never a blocking socket).
CHANNELS = {
    "coldsnap_provider/_framing.py": "the daemon side's JSON-line channel (session and control sockets, the client)",
    "coldsnap_probe/jsonline.py": "the capsule side's JSON-line channel (hydration, the hydrator, the engines)",
}
# Modules that read a socket for a protocol that is not JSON lines.
OTHER_PROTOCOLS = {
    "coldsnap_provider/_metrics_http.py": "HTTP/1.1 (GET /metrics)",
    "coldsnap_provider/_huggingface.py": "a descriptor passed back by the source opener (SCM_RIGHTS, no payload)",
    "coldsnap_runtime/backend/_blob_http.py": "HTTP/1.1 to a registry (a capture's blobs, on kept-alive lanes)",
    "coldsnap_runtime/backend/_hijack.py": "the Docker Engine's hijacked attach/exec streams",
    "engines/forking_server.py": "HTTP/1.1 (GET /)",
    "engines/split_server.py": "fixed-size binary records between a front end and its engine core (a socketpair)",
}


def socket_readers(paths: Iterable[Path], root: Path) -> dict[str, list[str]]:
    """For each module that reads a socket: `line call` of each read."""
    found: dict[str, list[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in SOCKET_READS):
                found.setdefault(str(path.relative_to(root)), []).append(f"{node.lineno} {node.func.attr}")
    return {module: sorted(calls, key=lambda call: int(call.split()[0])) for module, calls in found.items()}


def channel_errors(found: Mapping[str, list[str]], allowed: Mapping[str, str]) -> list[str]:
    errors = [f"{module}: reads a socket ({', '.join(calls)}): JSON lines go through coldsnap_probe/jsonline.py "
              "(capsule side) or coldsnap_provider/_framing.py (daemon side); another protocol: list the module "
              "in tests/test_architecture.py with the protocol it speaks"
              for module, calls in sorted(found.items()) if module not in allowed]
    errors += [f"{module}: listed as reading a socket ({why}) but reads none: drop it from the list"
               for module, why in sorted(allowed.items()) if module not in found]
    return errors


def test_one_json_line_channel_per_side() -> None:
    paths = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    errors = channel_errors(socket_readers(paths, ROOT), {**CHANNELS, **OTHER_PROTOCOLS})
    assert not errors, "\n".join(errors)


def test_the_channel_rule_can_fail(tmp_path: Path) -> None:
    """A hand-written JSON-line reader (recv_fds, makefile, anyio's receive) is found; a listed module that no
    longer reads a socket is found too."""
    (tmp_path / "channel.py").write_text("def read(conn):\n    return conn.recv(65536)\n")
    (tmp_path / "by_hand.py").write_text(
        "import socket\ndef one(conn):\n    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 1)\n"
        "    with conn.makefile('rb') as f:\n        return f.readline()\n"
        "async def two(stream):\n    await stream.send_eof()\n    return await stream.receive()\n")
    (tmp_path / "quiet.py").write_text("import json\nx = json.dumps({})\n")
    found = socket_readers(sorted(tmp_path.glob("*.py")), tmp_path)
    errors = channel_errors(found, {"channel.py": "the channel", "quiet.py": "HTTP"})
    assert len(errors) == 2
    assert errors[0].startswith("by_hand.py: reads a socket (3 recv_fds, 4 makefile, 7 send_eof, 8 receive)")
    assert errors[1] == "quiet.py: listed as reading a socket (HTTP) but reads none: drop it from the list"


@pytest.mark.parametrize("module", sorted(CHANNELS))
def test_each_channel_names_its_counterpart_and_why_they_cannot_share_code(module: str) -> None:
    """The decision is written where the next engineer looks: in each channel's docstring."""
    doc = ast.get_docstring(ast.parse((ROOT / module).read_text())) or ""
    other = next(m for m in CHANNELS if m != module)
    assert other in doc and "standard library" in doc, f"{module}'s docstring names {other} and why (stdlib-only)"
