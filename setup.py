"""The native modules; everything else about the package is in pyproject.toml.

- kvplane.core._chain: the block-key chain, hashing with the project's own XXH3
  (kvplane/core/_xxh3.h): a C compiler and Python's headers are all it needs.
- router.index._table: the in-memory index's storage.
- router.index._lookup_reply: the Redis index's lookup replies read into matches.
"""

from __future__ import annotations

from setuptools import Extension, setup

_FLAGS = ["-O3", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"]

setup(
    ext_modules=[
        Extension(
            "kvplane.core._chain",
            ["kvplane/core/_chain.c"],
            depends=["kvplane/core/_xxh3.h"],
            extra_compile_args=_FLAGS,
        ),
        Extension(
            "router.index._table",
            ["router/index/_table.c"],
            depends=["router/index/_match.h"],
            extra_compile_args=_FLAGS,
        ),
        Extension(
            "router.index._lookup_reply",
            ["router/index/_lookup_reply.c"],
            depends=["router/index/_match.h"],
            extra_compile_args=_FLAGS,
        ),
    ]
)
