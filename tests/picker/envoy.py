"""A real Envoy (`make envoy-env`) for async tests marked `@pytest.mark.heavy("envoy")`:
simulations/local_envoy.py's, configured by `router.picker.envoy_config`.

    async with running_envoy(tmp_path, endpoints=[...], pickers=[...]) as envoy:
        response = await client.post(envoy.url + "/v1/completions", ...)

It is ready once its admin interface says so and its listener accepts, and, with
`wait_for_pickers`, once its health checks found every picker healthy; otherwise its
pickers may be dead (tests of FailOpen and FailClose). Its log is in `work_dir`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from simulations.local_envoy import LocalEnvoy, local_envoy
from tests import heavy

RunningEnvoy = LocalEnvoy


@asynccontextmanager
async def running_envoy(
    work_dir: Path,
    *,
    endpoints: Sequence[str],
    pickers: Sequence[str],
    wait_for_pickers: bool = False,
    **options: Any,
) -> AsyncIterator[RunningEnvoy]:
    """Envoy with `build_bootstrap(endpoints=..., pickers=..., **options)` on free ports."""
    async with local_envoy(
        heavy.envoy_binary(),
        work_dir,
        endpoints=endpoints,
        pickers=pickers,
        wait_for_pickers=wait_for_pickers,
        **options,
    ) as envoy:
        yield envoy
