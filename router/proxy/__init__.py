"""The OpenAI-compatible reverse proxy: request bodies, forwarding, failover."""
