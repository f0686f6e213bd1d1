"""A vLLM-compatible engine simulator: a real paged KV cache with prefix caching, real
KV events on ZMQ, real OpenAI-compatible HTTP, and a timing model instead of a GPU."""
