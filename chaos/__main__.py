"""`python -m chaos [--short] [--only a,b] [--report FILE]` (what `make chaos` runs)."""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from chaos.report import markdown
from chaos.scenarios import FULL, SCENARIOS, SHORT, run_suite
from chaos.stack import ChaosStack

HEADER = """# Reliability: the chaos report

This file is written by `make chaos` (`python -m chaos`, code in `chaos/`): the latest
run on the machine named below. A shorter run of the same scenarios is part of
`make test` (`tests/chaos/`). Each scenario runs real processes on loopback: a private
Redis, three engine simulators with an agent beside each, two router replicas sharing
the Redis index, and a TCP proxy on every agent-to-router path. Steady load comes from
the official OpenAI client (three tenants, streamed and not, prompts that share
prefixes within a tenant and word for word across tenants); a client that cannot reach
a router at all tries the other one, as a load balancer would.

What is checked, in every scenario:
- **outcomes**: `ok` (answered by the first worker chosen), `retried` (answered after
  the router failed over before the first byte, or after the client moved to the other
  router), `failed` (a clear error: an HTTP error with an OpenAI error body, an error
  event in the stream, or the connection breaking under a killed router), `lost`
  (anything else: no answer within 20 s, an answer cut short without an error, an
  error without a message). Lost must be 0.
- **index = engines**: after the fault and the lease, with the load stopped, the keys
  the Redis index holds for each live worker equal the router's keys recomputed from
  each engine's true block set (`/sim/blocks?prefixes=1`); the time it took.
- **cross-tenant**: hits on a block another cache scope filled, counted by every engine
  simulator over the whole run (engines that die are counted first). Must be 0.
- **purge**: from the fault to the moment the registry stops listing the worker as live
  (no lookup uses its locations from then on); **recover**: from the repair to the
  moment it is live again under a new incarnation (or the router serves again).
- The routers' resident memory, file descriptors and asyncio tasks
  (`kvplane_event_loop_tasks`) before and after the soak and the abusive clients.

Known limits: the agents report to one router at a time (`--control-plane-address`
lists both; the next is tried when a stream ends); drains are per router replica, so
the mid-stream scenario drains on the router it sends through. Fuzzing of the HTTP API,
the gRPC ingest and the event decoder is in `tests/abuse/` and
`tests/worker_agent/test_wire_decoding.py`.
"""


async def _main(args: argparse.Namespace) -> int:
    profile = SHORT if args.short else FULL
    only = set(args.only.split(",")) if args.only else None
    if only is not None and only - {name for name, _, _ in SCENARIOS}:
        print(f"unknown scenarios: {', '.join(sorted(only - {n for n, _, _ in SCENARIOS}))}")
        return 2
    with tempfile.TemporaryDirectory(prefix="kvplane-chaos-") as work:
        fleet = ChaosStack(Path(args.work_dir or work))
        started = time.monotonic()
        try:
            await fleet.start()
            results = await run_suite(fleet, profile, only)
        finally:
            await fleet.stop()
        took = time.monotonic() - started
    machine = f"{platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    report = markdown(results, profile, HEADER) + f"Run took {took:.0f} s on {machine}.\n"
    print(report)
    if args.report:
        await asyncio.to_thread(Path(args.report).write_text, report)
    return 0 if all(result.passed for result in results) else 1


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos", description=__doc__)
    parser.add_argument("--short", action="store_true", help="the short profile (make test)")
    parser.add_argument("--only", help="comma-separated scenario names")
    parser.add_argument("--report", help="write the Markdown report here too")
    parser.add_argument("--work-dir", help="keep logs here (default: a temporary directory)")
    return asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
