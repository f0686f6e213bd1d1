"""`kvplane engine-sim`: the engine simulator's command line."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from kvplane.core.config import LoggingSettings
from kvplane.core.logsetup import configure_logging
from kvplane.core.serving import run_service
from simulations.engine_sim.app import serve_engine_sim
from simulations.engine_sim.config import add_engine_sim_flags, config_from_args


def build_parser(prog: str = "kvplane engine-sim") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="A vLLM-compatible engine simulator: paged KV cache with prefix caching, "
        "KV events on ZMQ, OpenAI-compatible HTTP, modelled timing. Flags named like "
        "vLLM's take vLLM's formats. VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 sends block "
        "hashes as 32-byte digests, as it does for vLLM.",
    )
    add_engine_sim_flags(parser)
    return parser


def main(argv: Sequence[str], prog: str = "kvplane engine-sim") -> int:
    config = config_from_args(build_parser(prog).parse_args(argv))
    configure_logging(LoggingSettings(level=config.log_level))
    run_service(serve_engine_sim(config))
    return 0
