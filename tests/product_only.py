"""`python -m tests.product_only ARGS...`: the `kvplane` command as a product-only
install (`pip install kvplane`, no extras) runs it: the tool packages and the `sim`
extra's dependencies cannot be imported."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType

NOT_INSTALLED = frozenset({"simulations", "benchmarks", "chaos", "matplotlib", "openai"})


class _NotInstalled(MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname.split(".")[0] in NOT_INSTALLED:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None  # the usual finders decide


if __name__ == "__main__":
    sys.meta_path.insert(0, _NotInstalled())
    from kvplane.cli import main

    sys.exit(main())
