"""`kvplane check`: ask a running router to probe its fleet, and print the verdict.

One command for an operator: for every worker, each link that cache-aware routing rests
on (the engine's events reach the agent; the replay endpoint answers; block sizes fit;
the router tokenises as the engine does; the probe's blocks reach the index under the
router's own keys), pass or fail, with the fix. Plain text or JSON; the exit status is
0 when no check failed (some may be unknown: not proven either way yet, which the text
counts), 1 when one failed, 2 when the router could not be asked.

The router does the work (`POST /fleet/check`, router/fleet_api/api.py); this only calls it.
The admin token comes from KVPLANE_HTTP__ADMIN_TOKEN (a secret: never a flag).
"""

from __future__ import annotations

import argparse
import email.message
import http.client
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import IO, TextIO

from pydantic import ValidationError

from router.fleet_api.models import FleetCheck

TOKEN_VARIABLE = "KVPLANE_HTTP__ADMIN_TOKEN"
EXIT_PASSED, EXIT_FAILED, EXIT_UNASKED = 0, 1, 2
_MARKS = {"pass": "ok  ", "warn": "warn", "fail": "FAIL", "unknown": "?   "}
_HINTS = {
    401: " (is the admin token the router's?)",
    403: " (the router has no admin token: start it with KVPLANE_HTTP__ADMIN_TOKEN)",
    404: " (an admin port moves the fleet API there: --router-url names that port)",
}


# The router's probe may take its engine's whole answer (router.probe.ANSWER_TIMEOUT_S,
# 30 s) and then wait_s for the index: the client waits for both, and more.
_ROUTER_MARGIN_S = 60.0


class CheckUnavailable(Exception):
    """The router could not be asked, or did not answer a fleet check."""


class BlindFleet(Exception):
    """The fleet's wiring check failed: figures measured on it would not be kvplane's."""


def require_wiring(router_url: str, token: str, *, wait_s: float = 5.0) -> FleetCheck:
    """The fleet check, passed; BlindFleet naming each problem otherwise (for tools that
    measure a fleet: the demo, the live bake-off)."""
    try:
        verdict = ask_router(router_url, token, wait_s=wait_s)
    except CheckUnavailable as error:
        raise BlindFleet(f"the wiring check could not run: {error}") from None
    if not verdict.ok:
        raise BlindFleet("the wiring check failed: " + "; ".join(verdict.problems))
    return verdict


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect answers as its own status: urllib would follow it with the token."""

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: email.message.Message,
        newurl: str,
    ) -> None:
        return None


_NO_REDIRECTS = urllib.request.build_opener(_RefuseRedirects)


def ask_router(router_url: str, token: str, *, wait_s: float, probe: bool = True) -> FleetCheck:
    """The router's fleet check (`POST /fleet/check`); CheckUnavailable if there is none."""
    url = router_url.rstrip("/") + "/fleet/check"
    query = urllib.parse.urlencode({"probe": str(probe).lower(), "wait_s": wait_s})
    # One blocking call from a command line: the standard library's client is enough,
    # and the router and the agent need no HTTP client but the proxy's (aiohttp).
    request = _check_request(f"{url}?{query}", token)
    try:
        with _NO_REDIRECTS.open(request, timeout=wait_s + _ROUTER_MARGIN_S) as response:
            body = response.read()
    except urllib.error.HTTPError as error:
        hint = _HINTS.get(error.code, "")
        raise CheckUnavailable(f"{url} answered {error.code}{hint}") from None
    except urllib.error.URLError as error:
        raise CheckUnavailable(f"cannot reach {url} ({error.reason})") from None
    # Timeouts and refusals; not HTTP at the other end; a token or host that cannot go
    # into a request.
    except (OSError, http.client.HTTPException, ValueError) as error:
        raise CheckUnavailable(f"cannot reach {url} ({type(error).__name__})") from None
    try:
        return FleetCheck.model_validate_json(body)
    except ValidationError:
        raise CheckUnavailable(f"{url} did not answer a fleet check") from None


def _check_request(url: str, token: str) -> urllib.request.Request:
    """The check's POST; CheckUnavailable unless `url` is a well-formed http(s) URL
    (urllib would also open file: and other schemes)."""
    if not (token.isascii() and token.isprintable()):
        raise CheckUnavailable(
            f"{TOKEN_VARIABLE} holds a character no header can carry (a trailing newline?)"
        )
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme in ("http", "https") and parts.hostname and parts.port != 0:
            request = urllib.request.Request(url, method="POST")
            request.add_unredirected_header("Authorization", f"Bearer {token}")
            return request
    except ValueError:  # a malformed host or an out-of-range port
        pass
    raise CheckUnavailable(f"{url.partition('?')[0]!r} is not an http:// or https:// URL")


def run_check(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    token = os.environ.get(TOKEN_VARIABLE)
    if not token:
        print(f"kvplane check: set {TOKEN_VARIABLE} to the router's admin token", file=sys.stderr)
        return EXIT_UNASKED
    try:
        verdict = ask_router(args.router_url, token, wait_s=args.wait_s, probe=not args.no_probe)
    except CheckUnavailable as error:
        print(f"kvplane check: {error}", file=sys.stderr)
        return EXIT_UNASKED
    if args.json:
        json.dump(verdict.model_dump(mode="json"), out, indent=2)
        out.write("\n")
    else:
        out.write(render(verdict))
    return EXIT_PASSED if verdict.ok else EXIT_FAILED


def render(verdict: FleetCheck) -> str:
    lines = []
    for worker in verdict.workers:
        head = "ok" if worker.ok else "FAILED"
        blind = ", blind: routed on the router's predictions only" if worker.blind else ""
        lines.append(
            f"worker {worker.worker_id} (model {worker.model}, {worker.state.value}): {head}{blind}"
        )
        for check in worker.checks:
            lines.append(f"  {_MARKS[check.status]}  {check.name:<16} {check.detail}")
            if check.fix and check.status in ("fail", "warn"):
                lines.append(f"        {'':<16} fix: {check.fix}")
    for model in verdict.routing:
        lines.append(f"model {model.model}: {model.routing.replace('_', ' ')}")
    if not verdict.index_reachable:
        lines.append("index: unreachable (routing on load only)")
    unknown = sum(c.status == "unknown" for worker in verdict.workers for c in worker.checks)
    if verdict.ok and unknown:
        lines.append(f"PASSED: no check failed ({unknown} not proven either way yet: '?')")
    elif verdict.ok:
        lines.append("PASSED: every live worker's wiring holds")
    else:
        lines.append(f"FAILED: {len(verdict.problems)} problem(s)")
        lines.extend(f"  - {problem}" for problem in verdict.problems)
    return "\n".join(lines) + "\n"
