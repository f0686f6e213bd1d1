"""The control plane's ingest: agents stream their workers' KV-cache events over gRPC
(proto/kvplane/wire/v1/control_plane.proto) and the router applies them to the location index.

- validation.py: pure checks, wire message -> domain objects or a Rejection.
- workers.py: this router's view of the workers that connect to it (sequences, states).
- service.py: the Connect stream, the only place that does I/O against the index.
- client.py: the agent side of one stream, used by the demo and the tests.
"""
