"""Builds the nccl_shim C library with the system compiler (metadata lives in pyproject.toml).

The shim is loaded with ctypes, not imported: it is a plain shared object that happens to be
built as an extension so `pip install .` compiles it. NCCL is never linked.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "nccl_shim._csns",
            sources=["nccl_shim/src/coldsnap_nccl_shim.c"],
            include_dirs=["nccl_shim/include"],
            libraries=["dl", "pthread"],
            extra_compile_args=["-std=c11", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden"],
        )
    ]
)
