"""Who may call what: the admin token (the fleet API) and the tenants' API keys (the
OpenAI API, a tenant's own locality query), both `Authorization: Bearer ...`.

Each is a FastAPI security dependency, so that the route that checks a credential is
the route the OpenAPI document says needs it (the `adminToken` and `tenantKey`
schemes). The proxy's hot path asks TenantKey.tenant() directly instead.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi.openapi.models import HTTPBearer as BearerScheme
from fastapi.security.base import SecurityBase
from starlette.requests import Request

from router.errors import ApiError, RequestRefused, documented, required_header
from router.tenants import Tenant, TenantDirectory

_CHALLENGE = {"www-authenticate": "Bearer"}

UNAUTHORIZED = documented(
    "no valid key (Authorization: Bearer KEY)",
    {"www-authenticate": required_header({"type": "string"}, "Bearer")},
)


class TenantKey(SecurityBase):
    """A tenant's API key; anonymous requests pass while anonymous access is on."""

    def __init__(self, tenants: TenantDirectory) -> None:
        self.model = BearerScheme(
            description="a tenant's API key; none while anonymous access is on"
        )
        self.scheme_name = "tenantKey"
        self._tenants = tenants

    def tenant(self, request: Request) -> Tenant | None:
        return self._tenants.authenticate(request.headers.get("authorization"))

    async def __call__(self, request: Request) -> Tenant:
        tenant = self.tenant(request)
        if tenant is None:
            raise unauthorized()
        return tenant

    def requirement(self) -> list[dict[str, list[str]]]:
        """For an operation that checks the key itself (an OpenAPI security requirement)."""
        return [{self.scheme_name: []}]


def unauthorized() -> RequestRefused:
    return RequestRefused(
        401,
        "a valid API key is required (Authorization: Bearer KEY)",
        kind="AuthenticationError",
        outcome="unauthorized",
        headers=_CHALLENGE,
    )


class AdminToken(SecurityBase):
    """`http.admin_token`; without one the fleet API is off (403)."""

    def __init__(self, token: str | None) -> None:
        self.model = BearerScheme(description="http.admin_token")
        self.scheme_name = "adminToken"
        self._token = token

    async def __call__(self, request: Request) -> None:
        if self._token is None:
            raise ApiError(
                403, "the fleet API is off: set http.admin_token", kind="PermissionDenied"
            )
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self._token.encode()
        ):
            raise ApiError(
                401,
                "this route needs the admin token (Authorization: Bearer TOKEN)",
                kind="AuthenticationError",
                headers=_CHALLENGE,
            )


ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {
    401: UNAUTHORIZED,
    403: documented("the fleet API is off: no http.admin_token is configured"),
}
