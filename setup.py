"""Build the optional compiled cores: the prefix index (``exporter.core.index._prefix_core``), the /metrics
family formatter (``exporter.web._render_core``), the worker page scanner
(``exporter.codecs._promtext_core``) and the OTLP wire walk (``exporter.codecs._otlp_core``) and the per-record work
(``exporter.core._records_core``); metadata is in pyproject.toml.

Without Cython or a C compiler the install still succeeds, with a warning, and the exporter runs
on the Python references (``exporter.core.index.prefix_index.CORE`` and ``exporter.web.exposition.CORE`` read
``"reference"``). ``PREFIXSCOPE_NO_COMPILE=1`` builds that pure-Python package on purpose, e.g.
to check on a machine with a compiler what one without it installs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _warn(what: str, exc: BaseException) -> None:
    print(f"WARNING: prefixscope: {what} ({exc}); the exporter falls back to the Python reference",
          file=sys.stderr)


class OptionalBuildExt(build_ext):
    """A build_ext whose failure (no compiler, no headers) is a warning, not a failed install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:
            _warn("the compiled cores could not be built", exc)

    def build_extension(self, ext) -> None:  # type: ignore[no-untyped-def]
        try:
            super().build_extension(ext)
        except Exception as exc:
            _warn(f"building {ext.name} failed", exc)


def _extension(name: str) -> Extension:
    """One module from ``name``'s .pyx and the .pxi files beside it, which it ``include``s: cythonize
    follows the includes itself, and ``depends`` makes a changed .pxi relink the module too."""
    source = Path(*name.split(".")).with_suffix(".pyx")
    parts = sorted(str(p) for p in source.parent.glob("*.pxi"))
    return Extension(name, [str(source)], depends=parts, extra_compile_args=["-O2"])


def extensions() -> list:
    if os.environ.get("PREFIXSCOPE_NO_COMPILE", "").strip().lower() not in ("", "0", "false", "no"):
        print("prefixscope: PREFIXSCOPE_NO_COMPILE is set; building without the compiled cores", file=sys.stderr)
        return []
    try:
        from Cython.Build import cythonize

        return cythonize([_extension(name) for name in ("exporter.core.index._prefix_core", "exporter.web._render_core",
                                                         "exporter.codecs._promtext_core", "exporter.codecs._otlp_core",
                                                         "exporter.core._records_core", "exporter.core._kv_batch_core",
                                                         "exporter.sources._zmq_rounds")],
                         quiet=True)
    except Exception as exc:  # no Cython, or the translation failed
        _warn("the compiled cores were not translated", exc)
        return []


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
