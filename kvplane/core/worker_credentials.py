"""Per-worker credentials: a token that proves which worker id an agent may speak for.

The router holds one secret (`control_plane.worker_credential_secret`); each worker's
token is an HMAC of its worker id under that secret, issued by `kvplane worker-token`.
The router verifies a Register's worker id against the token its stream presented, with
nothing stored per worker, and a token issued for one worker is useless for another:
unlike a token every agent shares, a stolen or leaked one speaks for one worker only.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

TOKEN_PREFIX = "kvw1."
_CONTEXT = b"kvplane worker credential v1\x00"  # keeps these MACs apart from other uses
MIN_SECRET_CHARS = 32


def worker_token(secret: str, worker_id: str) -> str:
    mac = hmac.new(secret.encode(), _CONTEXT + worker_id.encode(), hashlib.sha256).digest()
    return TOKEN_PREFIX + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def is_worker_token(secret: str, worker_id: str, presented: bytes) -> bool:
    """Whether `presented` is `worker_id`'s token (compared in constant time)."""
    return hmac.compare_digest(presented, worker_token(secret, worker_id).encode())
