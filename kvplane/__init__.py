"""kvplane: its shared core (`kvplane.core`), its wire package (`kvplane.wire`) and, at
the top, the `kvplane` command (`kvplane.cli`). This package itself imports nothing, so
importing a layer never loads another."""
