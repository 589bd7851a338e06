"""Builds the nccl_shim C library with the system compiler, and puts the system files into the wheel
(metadata lives in pyproject.toml).

The shim is loaded with ctypes, not imported: it is a plain shared object that happens to be
built as an extension so `pip install .` compiles it. NCCL is never linked.

The systemd units, the sysusers.d and tmpfiles.d snippets and the documentation the unit names, the LICENSE and the Kubernetes manifests stay where
they are in the repository (`systemd/`, `README.md`, `docs/`): the build copies them into the wheel as
`coldsnap_provider/_system/`, which `coldsnap-provider install-units` installs onto a machine.
"""

import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).parent
# (source in the repository, path under coldsnap_provider/_system/ in the wheel)
SYSTEM_FILES = [
    *((f"systemd/{p.name}", f"systemd/{p.name}") for p in sorted((HERE / "systemd").glob("coldsnap-provider.*"))),
    ("README.md", "doc/README.md"),
    ("CHANGELOG.md", "doc/CHANGELOG.md"),
    ("LICENSE", "doc/LICENSE"),
    *((f"docs/{p.name}", f"doc/docs/{p.name}") for p in sorted((HERE / "docs").glob("*.md"))),
    # The namespace and RBAC manifests for [[kubernetes]] hosts (docs/kubernetes.md).
    *((f"packaging/kubernetes/{p.name}", f"doc/kubernetes/{p.name}")
      for p in sorted((HERE / "packaging" / "kubernetes").glob("*.yaml"))),
]


class BuildPyWithSystemFiles(build_py):
    """build_py, then the system files copied into the built package."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "coldsnap_provider" / "_system"
        for source, destination in SYSTEM_FILES:
            path = target / destination
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(HERE / source, path)


setup(
    cmdclass={"build_py": BuildPyWithSystemFiles},
    ext_modules=[
        Extension(
            "nccl_shim._csns",
            sources=["nccl_shim/src/coldsnap_nccl_shim.c"],
            include_dirs=["nccl_shim/include"],
            libraries=["dl", "pthread"],
            extra_compile_args=["-std=c11", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden"],
        )
    ],
)
