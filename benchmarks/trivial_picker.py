"""A trivial endpoint picker: the floor under kvplane's picker in the bake-off.

It speaks the same protocol as kvplane's (router/picker/protocol.py builds its
answers), over the same grpc.aio server, and decides nothing: no tenant, no
tokenisation, no index, each request to the next endpoint in turn. What kvplane's
picker costs over it is kvplane's own work a request; what it costs is Python gRPC's.

    python -m benchmarks.trivial_picker --port 9002 --endpoint 127.0.0.1:8001 ...
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc.aio
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as async_health

from router.picker.protocol import (
    destination_on_body,
    destination_on_headers,
    go_on_with_headers,
    streamed_body,
)
from router.picker.server import PROCESSOR_SERVICE

_FULL_DUPLEX = ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED


class TrivialPicker:
    def __init__(self, endpoints: Sequence[str]) -> None:
        self._turns: Iterator[str] = itertools.cycle(endpoints)

    async def Process(
        self,
        request_iterator: AsyncIterator[ProcessingRequest],
        context: grpc.aio.ServicerContext[ProcessingRequest, ProcessingResponse],
    ) -> AsyncIterator[ProcessingResponse]:
        full_duplex = False
        body = bytearray()
        async for message in request_iterator:
            if message.HasField("protocol_config"):
                full_duplex = message.protocol_config.request_body_mode == _FULL_DUPLEX
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                if message.request_headers.end_of_stream:
                    yield destination_on_headers([next(self._turns)])
                    return
                if not full_duplex:
                    yield go_on_with_headers()
            elif kind == "request_body":
                body += message.request_body.body
                if message.request_body.end_of_stream:
                    endpoint = [next(self._turns)]
                    if full_duplex:
                        yield destination_on_headers(endpoint)
                        for answer in streamed_body(bytes(body)):
                            yield answer
                    else:
                        yield destination_on_body(endpoint, bytes(body))
                    return


def command(port: int, endpoints: Sequence[str]) -> list[str]:
    """The command line that runs it, in this Python."""
    return [
        sys.executable, "-m", "benchmarks.trivial_picker", "--port", str(port),
        *[arg for endpoint in endpoints for arg in ("--endpoint", endpoint)],
    ]  # fmt: skip


async def started(port: int, endpoints: Sequence[str]) -> tuple[grpc.aio.Server, int]:
    """The picker serving on 127.0.0.1:`port` (0: a free one), and the port."""
    server = grpc.aio.server(
        options=[("grpc.max_concurrent_streams", 1 << 20), ("grpc.so_reuseport", 0)]
    )
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(
        TrivialPicker(endpoints), server
    )
    health = async_health.HealthServicer()
    for service in ("liveness", "readiness", PROCESSOR_SERVICE):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound


async def serve(port: int, endpoints: Sequence[str]) -> None:
    server, _ = await started(port, endpoints)
    await server.wait_for_termination()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--endpoint", action="append", required=True, metavar="IP:PORT")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.port, args.endpoint))


if __name__ == "__main__":
    main()
