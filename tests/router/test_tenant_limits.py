"""Per-tenant limits: a token bucket for the rate, a ceiling on requests in progress."""

from __future__ import annotations

from kvplane.core.config import RequestLimits
from router.tenant_limits import TenantLimiter
from router.tenants import Tenant
from tests.clock import ManualClock


def tenant(name: str = "acme", **limits: float) -> Tenant:
    return Tenant(
        name=name, cache_scope=f"tenant:{name}", cache_salt=None, limits=RequestLimits(**limits)
    )


def test_a_tenant_without_limits_is_never_refused() -> None:
    limiter = TenantLimiter(ManualClock())
    unlimited = tenant()
    assert all(limiter.admit(unlimited) is None for _ in range(10_000))
    assert limiter.in_progress(unlimited) == 0  # nothing kept for it


def test_the_rate_allows_a_burst_then_one_request_per_interval() -> None:
    clock = ManualClock()
    limiter = TenantLimiter(clock)
    acme = tenant(requests_per_s=2, burst=3)
    assert [limiter.admit(acme) for _ in range(3)] == [None, None, None]
    refused = limiter.admit(acme)
    assert refused is not None
    assert refused.reason == "rate_limited"
    assert refused.retry_after_s == 1  # half a second, rounded up to Retry-After's unit
    assert "2 requests a second" in refused.message
    clock.advance(0.5)
    assert limiter.admit(acme) is None
    assert limiter.admit(acme) is not None
    clock.advance(100)  # the bucket fills up to its burst, not past it
    assert [limiter.admit(acme) is None for _ in range(4)] == [True, True, True, False]


def test_a_refusal_takes_nothing_from_the_allowance() -> None:
    clock = ManualClock()
    limiter = TenantLimiter(clock)
    slow = tenant(requests_per_s=0.1)  # one request every ten seconds, a burst of one
    assert limiter.admit(slow) is None
    for _ in range(50):
        refusal = limiter.admit(slow)
        assert refusal is not None
        assert refusal.retry_after_s == 10
    clock.advance(10)
    assert limiter.admit(slow) is None


def test_requests_in_progress_are_capped_until_they_end() -> None:
    limiter = TenantLimiter(ManualClock(), busy_retry_after_s=2)
    acme, globex = tenant(concurrent_requests=2), tenant("globex", concurrent_requests=2)
    assert limiter.admit(acme) is None
    assert limiter.admit(acme) is None
    refused = limiter.admit(acme)
    assert refused is not None
    assert (refused.reason, refused.retry_after_s) == ("concurrency_limited", 2)
    assert limiter.admit(globex) is None  # tenants never share an allowance
    limiter.release(acme)
    assert limiter.in_progress(acme) == 1
    assert limiter.admit(acme) is None
    for _ in range(5):  # more releases than admissions never open extra room
        limiter.release(acme)
    assert limiter.in_progress(acme) == 0
