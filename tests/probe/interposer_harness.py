"""The interposer's C test harnesses are unity builds of the library: each includes every source the library is
built from (`_interposer.library_sources`, the product's own list), then adds its own `main`, so a source file
added to the interposer needs no edit in any test."""

from __future__ import annotations

from coldsnap_probe.hydration._interposer import library_sources

__all__ = ("UNITY",)

UNITY = "".join(f'#include "{path.name}"\n' for path in library_sources())
