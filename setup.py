"""The native modules; everything else about the package is in pyproject.toml.

- kvplane.core._chain: the block-key chain. It hashes with xxHash's XXH3, compiled in
  from its header `xxhash.h` (no library is needed at run time). The header is found,
  in this order, in $KVPLANE_XXHASH_INCLUDE, in .tools/xxhash/ (where `make` unpacks
  Debian's libxxhash-dev when the system has none) and in the usual include folders.
- router.index._table: the in-memory index's storage.
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import Extension, setup

_HERE = Path(__file__).parent
_CANDIDATES = [
    os.environ.get("KVPLANE_XXHASH_INCLUDE", ""),
    str(_HERE / ".tools" / "xxhash" / "usr" / "include"),
    "/usr/include",
    "/usr/local/include",
]


def _xxhash_include() -> str:
    for directory in filter(None, _CANDIDATES):
        if (Path(directory) / "xxhash.h").is_file():
            return directory
    raise SystemExit(
        "kvplane: xxhash.h (xxHash's header) was not found in "
        + ", ".join(filter(None, _CANDIDATES))
        + ". Run `make` (it unpacks Debian's libxxhash-dev into .tools/), install "
        "libxxhash-dev, or set KVPLANE_XXHASH_INCLUDE to the folder holding xxhash.h."
    )


_INCLUDE = _xxhash_include()
_FLAGS = ["-O3", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"]

setup(
    ext_modules=[
        Extension(
            "kvplane.core._chain",
            ["kvplane/core/_chain.c"],
            include_dirs=[_INCLUDE],
            extra_compile_args=_FLAGS,
        ),
        Extension("router.index._table", ["router/index/_table.c"], extra_compile_args=_FLAGS),
    ]
)
