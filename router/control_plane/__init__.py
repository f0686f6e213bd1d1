"""The control plane's ingest: agents stream their workers' KV-cache events over gRPC
(proto/kvplane/wire/v1/control_plane.proto) and the router applies them to the location index.

- admission.py: pure checks of who may speak (the bearer token) and which batch is next.
- workers.py: this router's view of the workers that connect to it (sequences, states).
- service.py: the Connect stream, the only place that does I/O against the index.

Messages are decoded and validated by the wire codec (kvplane/wire/codec.py); the agent's
side of a stream is kvplane/wire/stream.py.
"""
