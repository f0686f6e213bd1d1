"""The fleet page in headless Chromium (Debian's chromium and chromedriver, `make
chromium`) against a running fleet: the figures of its tables (all but the ages of the
last events and the funnel's bars) are checked against the fleet API's own answers, the
locality box against the locality query, flow control's section with requests waiting and
shed (and its word when flow control is off), an agent's label cannot inject markup, and
the screenshot the docs show is saved.

KVPLANE_SCREENSHOTS=DIR saves the screenshot there (`make screenshots` sets it to
docs/images); otherwise it goes to the test's temporary folder."""

from __future__ import annotations

import asyncio
import os
import struct
import time
from collections.abc import Callable, Iterator
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from kvplane.core.config import HttpSettings, Settings
from router.flow_control.bands import DEADLINE_HEADER, PRIORITY_HEADER
from router.flow_control.gate import SHED_REASON_HEADER
from tests import heavy
from tests.abuse.conftest import cache_and_wait
from tests.router.flow_control.test_gate import (
    SLOW,
    complete,
    direct,
    engines_idle,
    flow_settings,
    learn_batch_limits,
)
from tests.router.proxy.conftest import (
    MODEL,
    RoutedFleet,
    routed_fleet,
    router_settings,
)
from tests.waiting import wait_until

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
DASH = "\u2013"
# A label an agent registered: it must show as text, never become markup.
MARKUP = '<img src="x" onerror="document.body.dataset.injected = 1">'
SYSTEM = "You are the archive's assistant: cite the shelf and box of every record. " * 6
PAGE_WAIT_S = 20.0
# A base64 token: its "+" and "/" must reach the API as they are from the page's address.
ADMIN_TOKEN = "kv+page/admin=="
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
TOKEN_FORM_SHOWN = "document.getElementById('token-form').checkVisibility()"
FLOW_OFF = (
    "Flow control is off: requests go to their engines however saturated "
    "(flow_control.enabled turns it on)."
)

# What the page's script reads back of a table: each row's key and its cells' texts.
READ_TABLE = """
return [...document.querySelectorAll(`#${arguments[0]} tbody tr`)].map((tr) => ({
  key: tr.dataset.key,
  chosen: tr.classList.contains("chosen"),
  cells: Object.fromEntries([...tr.cells].map((td) => [td.dataset.field, td.textContent])),
}));
"""


# The page's formats (router/static/page.js). JavaScript's toFixed rounds the float's
# exact value, a tie away from zero: Decimal(float) is that exact value.
def fixed(x: float, places: int) -> str:
    return str(Decimal(x).quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP))


def count(n: int | None) -> str:
    return DASH if n is None else f"{n:,}"


def share(x: float | None) -> str:
    return DASH if x is None else fixed(x * 100, 1) + "%"


def decimal(x: float | None) -> str:
    return DASH if x is None else fixed(x, 2)


def units(x: float | None) -> str:
    """A figure in cost units, rounded to a whole one (a tie away from zero, as
    toLocaleString's maximumFractionDigits: 0 does) with thousands' commas."""
    return DASH if x is None else f"{Decimal(x).quantize(Decimal(1), rounding=ROUND_HALF_UP):,}"


def worker_cells(worker: dict[str, Any]) -> dict[str, str]:
    load = worker["load"] or {}
    return {
        "worker_id": worker["worker_id"],
        "state": worker["state"],
        "model": worker["model"],
        "role": (
            f"{worker['role']} ({worker['kv_connector']})"
            if worker["kv_connector"]
            else worker["role"]
        ),
        "engine": f"{worker['engine']['kind']} {worker['engine']['version']}",
        "running": count(load.get("running")),
        "waiting": count(load.get("waiting")),
        "kv_usage": share(load.get("kv_usage")),
        "router_in_flight": count(worker["router_in_flight"]),
        "index_entries": count(worker["index_entries"]),
        "hit_rate": share(worker["cache"]["hit_rate"]),
        "agreement": share(worker["cache"]["agreement"]),
    }


def funnel_cells(row: dict[str, Any]) -> dict[str, str]:
    return {
        "model": row["model"],
        "tenant": row["tenant"],
        "requests": count(row["requests"]),
        "prompt_tokens": count(row["prompt_tokens"]),
        "attainable_tokens": count(row["attainable_tokens"]),
        "predicted_tokens": count(row["predicted_tokens"]),
        "achieved_tokens": count(row["achieved_tokens"]),
        "hit_rate": share(row["hit_rate"]),
        "evicted_from_fleet": count(row["lost_tokens"]["evicted_from_fleet"]),
        "copied": count(row["copied_tokens"]),
        "lost_tokens": "; ".join(
            f"{reason.replace('_', ' ')} {count(tokens)}"
            for reason, tokens in row["lost_tokens"].items()
            if tokens > 0
        )
        or "none",
    }


def prefix_cells(prefix: dict[str, Any]) -> dict[str, str]:
    return {
        "tenant": prefix["tenant"],
        "key": prefix["key"],
        "tokens": count(prefix["tokens"]),
        "requests": count(prefix["requests"]),
        "reused_tokens": count(prefix["reused_tokens"]),
    }


def waiting_in(bands: dict[str, dict[str, int]], tenant: str | None = None) -> int:
    """Requests waiting (band -> tenant -> requests): all tenants', or one's."""
    return sum(
        requests
        for tenants in bands.values()
        for name, requests in tenants.items()
        if tenant is None or name == tenant
    )


def flow_model_cells(model: dict[str, Any]) -> dict[str, str]:
    here, there = model["waiting"], model["waiting_elsewhere"]
    bands = []
    for band in sorted(here.keys() | there.keys(), key=int, reverse=True):
        elsewhere = sum(there.get(band, {}).values())
        bands.append(
            f"band {band}: {count(sum(here.get(band, {}).values()))} here"
            + (f", {count(elsewhere)} elsewhere" if elsewhere else "")
        )
    return {
        "model": model["model"],
        "room": count(model["room"]),
        "waiting": count(waiting_in(here)),
        "waiting_elsewhere": count(waiting_in(there)),
        "bands": "; ".join(bands) or "none",
    }


def flow_tenant_cells(flow: dict[str, Any]) -> list[dict[str, str]]:
    """The tenants' rows: those served or shed, and those waiting or counted before."""
    models = flow["models"]
    served = {tenant["tenant"]: tenant for tenant in flow["tenants"]}
    names = set(served)
    for model in models:
        names |= model["counters"].keys()
        for bands in (model["waiting"], model["waiting_elsewhere"]):
            names |= {name for tenants in bands.values() for name in tenants}
    rows = []
    for name in sorted(names):
        tenant = served.get(name)
        counters = [
            ("" if len(models) == 1 else f"{model['model']} ") + units(model["counters"][name])
            for model in models
            if name in model["counters"]
        ]
        shed = {reason: n for reason, n in (tenant["shed"] if tenant else {}).items() if n > 0}
        here = sum(waiting_in(model["waiting"], name) for model in models)
        elsewhere = sum(waiting_in(model["waiting_elsewhere"], name) for model in models)
        rows.append(
            {
                "tenant": name,
                "waiting": count(here),
                "waiting_elsewhere": count(elsewhere),
                "counter": "; ".join(counters) or DASH,
                "service_tokens": units(tenant["service_tokens"] if tenant else None),
                "service_share": share(tenant["service_share"] if tenant else None),
                "shed": count(sum(shed.values())),
                "shed_reasons": "; ".join(
                    f"{reason.replace('_', ' ')} {count(n)}" for reason, n in shed.items()
                )
                or "none",
            }
        )
    return rows


def locality_cells(worker: dict[str, Any]) -> dict[str, str]:
    return {
        "worker_id": worker["worker_id"],
        "eligible": ("yes, spilled" if worker.get("spilled") else "yes")
        if worker["eligible"]
        else "no",
        "cached_tokens": count(worker["cached_tokens"]),
        "matched_tokens": ", ".join(
            f"{tier} {count(tokens)}" for tier, tokens in worker["matched_tokens"].items()
        )
        or "none",
        "saved_tokens": decimal(worker.get("saved_tokens")),
        "queue_penalty": decimal(worker.get("queue_penalty")),
        "memory_penalty": decimal(worker.get("memory_penalty")),
        "copy_penalty": decimal(worker.get("copy_penalty")),
        "tenant_penalty": decimal(worker.get("tenant_penalty")),
        "score": decimal(worker.get("score")),
    }


def read_table(driver: webdriver.Chrome, table_id: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = driver.execute_script(READ_TABLE, table_id)
    return rows


def cells_of(table: list[dict[str, Any]], fields: list[str]) -> list[dict[str, str | None]]:
    return [{field: row["cells"].get(field) for field in fields} for row in table]


def wait_for(driver: webdriver.Chrome, script: str) -> None:
    """Until `script` (a JavaScript expression) is true in the page."""
    WebDriverWait(driver, PAGE_WAIT_S).until(lambda d: d.execute_script(f"return {script}"))


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    heavy.require("chromium")
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not path.exists():
            pytest.fail(f"no {path}: run `make chromium` (Debian's {package})")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless=new",
        "--no-sandbox",  # the tests may run as root, where Chromium's sandbox cannot
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1500",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    try:
        yield driver
    finally:
        driver.quit()


def page_fleet(
    admin_token: str | None = ADMIN_TOKEN,
    *,
    settings: Settings | None = None,
    workers: int = 2,
    sim_options: dict[str, Any] | None = None,
) -> Any:
    settings = (settings or router_settings()).model_copy(
        update={"http": HttpSettings(port=0, admin_port=0, admin_token=admin_token)}
    )
    return routed_fleet(
        workers,
        settings,
        sim_options=sim_options
        or {"enable_prompt_tokens_details": True, "num_gpu_blocks_override": 1024},
        labels={"worker-1": {"rack": MARKUP}},
    )


async def serve_workload(fleet: RoutedFleet) -> list[str]:
    """Two tenants, two conversations each, growing over three turns: reuse to show.
    Returns the last prompt of each conversation."""
    last = []
    for tenant in ("acme", "globex"):
        for user in range(2):
            history = SYSTEM
            for turn in range(3):
                history += f"User {user} of {tenant} asks for record {turn}. " * 3
                await cache_and_wait(fleet, history, tenant)
            last.append(history)
    return last


async def until_shown(
    driver: webdriver.Chrome,
    api: httpx.AsyncClient,
    *,
    table: str,
    path: str,
    rows: Callable[[Any], list[dict[str, Any]]],
    expected: Callable[[dict[str, Any]], dict[str, str]],
) -> Any:
    """Until the page's `table` shows, row for row, what the API answers at `path` (the
    page refreshes every few seconds, and an agent's load report may land between two
    reads); returns the API's answer."""
    deadline = time.monotonic() + PAGE_WAIT_S
    while True:
        answer = (await api.get(path)).json()
        want = [expected(row) for row in rows(answer)]
        assert want, f"{path} answered no rows"
        page = cells_of(await asyncio.to_thread(read_table, driver, table), list(want[0]))
        if page == want:
            return answer
        if time.monotonic() > deadline:
            raise AssertionError(f"the page's {table} differ from {path}:\n{page}\n{want}")
        await asyncio.sleep(0.5)


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", header[16:24])
    return width, height


@pytest.mark.heavy("chromium")
async def test_the_page_shows_what_the_fleet_api_says(
    browser: webdriver.Chrome, tmp_path: Path
) -> None:
    async with page_fleet() as fleet:
        conversations = await serve_workload(fleet)
        admin = f"http://127.0.0.1:{fleet.router.admin_port}"
        async with httpx.AsyncClient(base_url=admin, headers=ADMIN, timeout=10) as api:
            await asyncio.to_thread(browser.get, f"{admin}/fleet/page#token={ADMIN_TOKEN}")
            await asyncio.to_thread(wait_for, browser, "Number(document.body.dataset.loaded) > 0")
            # The token left the address bar for the tab's storage.
            assert ADMIN_TOKEN not in browser.current_url
            assert not browser.find_element(By.ID, "token-form").is_displayed()

            workers = await until_shown(
                browser,
                api,
                table="workers",
                path="/fleet/workers",
                rows=lambda answer: answer["workers"],
                expected=worker_cells,
            )
            funnel = await until_shown(
                browser,
                api,
                table="funnel",
                path="/fleet/funnel",
                rows=lambda answer: answer["rows"],
                expected=funnel_cells,
            )
            prefixes = await until_shown(
                browser,
                api,
                table="prefixes",
                path="/fleet/prefixes?limit=20",
                rows=lambda answer: answer,
                expected=prefix_cells,
            )

            # The figures were really in play: both workers live and reporting, each
            # tenant's reuse cached and measured.
            assert [w["state"] for w in workers["workers"]] == ["live", "live"]
            assert sum(w["index_entries"] for w in workers["workers"]) > 0
            caches = [w["cache"] for w in workers["workers"]]
            assert sum(cache["requests"] for cache in caches) == 12
            assert all(cache["hit_rate"] for cache in caches if cache["requests"])
            assert [(r["tenant"], r["requests"]) for r in funnel["rows"]] == [
                ("acme", 6),
                ("globex", 6),
            ]
            assert all(r["hit_rate"] > 0.5 for r in funnel["rows"])
            assert {p["tenant"] for p in prefixes} == {"acme", "globex"}
            summary = browser.find_element(By.ID, "summary").text
            assert summary == f"2 of 2 workers live; index reachable; {MODEL}: cache-aware"
            # Flow control is off: the page says so, and shows none of its tables.
            assert (await api.get("/fleet/flow")).json()["enabled"] is False
            assert browser.find_element(By.ID, "flow-summary").text == FLOW_OFF
            assert not browser.find_element(By.ID, "flow").is_displayed()

            # The agent's label is text on the page; no element came of it, nothing ran.
            (labelled,) = [r for r in read_table(browser, "workers") if r["key"] == "worker-1"]
            assert f"rack={MARKUP}" in labelled["cells"]["notes"]
            assert browser.execute_script("return document.querySelectorAll('img').length") == 0
            assert browser.execute_script("return document.body.dataset.injected") is None
            assert "archive's assistant" not in browser.page_source  # no prompt text

            # The locality box asks what POST /fleet/locality answers, and shows all of it.
            prompt = conversations[0]
            query = {"model": MODEL, "tenant": "acme", "prompt": prompt}
            deadline = time.monotonic() + PAGE_WAIT_S
            while True:  # asked twice, page and test: the same answer unless the fleet moved
                await asyncio.to_thread(ask_locality, browser, "acme", prompt)
                answer = (await api.post("/fleet/locality", json=query)).json()
                shown = read_table(browser, "locality-workers")
                want = [locality_cells(w) for w in answer["workers"]]
                if cells_of(shown, list(want[0])) == want or time.monotonic() > deadline:
                    break
            assert cells_of(shown, list(want[0])) == want
            assert all(w["spilled"] is False for w in answer["workers"] if w["eligible"])
            assert [r["key"] for r in shown if r["chosen"]] == [answer["chosen"]]
            chosen = next(w for w in answer["workers"] if w["worker_id"] == answer["chosen"])
            assert chosen["cached_tokens"] > 0  # the conversation is cached where it was sent
            summary = browser.find_element(By.ID, "locality-summary").text
            assert summary == (
                f"{count(answer['prompt_tokens'])} prompt tokens in {answer['blocks']} blocks "
                f"(tenant acme, scope {answer['cache_scope']}); "
                f"the router would pick {answer['chosen']} ({answer['factor']})"
            )

            folder = Path(os.environ.get("KVPLANE_SCREENSHOTS") or tmp_path)
            screenshot = folder / "fleet-page.png"
            assert browser.save_screenshot(str(screenshot))
            width, height = png_size(screenshot)
            assert width == 1400
            assert height > 1000


@pytest.mark.heavy("chromium")
async def test_the_page_shows_who_waits_and_who_was_shed(browser: webdriver.Chrome) -> None:
    """Flow control on, one engine busy: requests wait in two bands, one is shed for its
    deadline; the page's flow tables show what GET /fleet/flow says, then the queue
    drained."""
    settings = flow_settings(max_engine_waiting=0)
    async with page_fleet(settings=settings, workers=1, sim_options=SLOW) as fleet:
        await learn_batch_limits(fleet)
        admin = f"http://127.0.0.1:{fleet.router.admin_port}"
        async with httpx.AsyncClient(base_url=admin, headers=ADMIN, timeout=10) as api:
            served = await complete(fleet, "acme", "served at once")
            assert served.status_code == 200
            await wait_until("the engine is idle again", lambda: engines_idle(fleet))
            # 25 ms a token, one request at a time: the engine is busy for ten seconds
            # with a request the router never saw (none of its own could preempt it).
            (worker,) = fleet.workers
            occupying = asyncio.ensure_future(direct(worker.base_url, "occupying", 400))
            await wait_until("the engine runs it", lambda: not engines_idle(fleet))
            waiting = [
                asyncio.ensure_future(complete(fleet, "acme", f"acme waits {n}")) for n in range(2)
            ]
            waiting.append(  # globex may ask for band 5
                asyncio.ensure_future(
                    complete(fleet, "globex", "globex waits", headers={PRIORITY_HEADER: "5"})
                )
            )

            async def three_wait() -> bool:
                flow = (await api.get("/fleet/flow")).json()
                return sum(waiting_in(m["waiting"]) for m in flow["models"]) == 3

            await wait_until("three requests wait in the router", three_wait)
            shed = await complete(
                fleet, "initech", "cannot wait long", headers={DEADLINE_HEADER: "100"}
            )
            assert shed.status_code == 429
            assert shed.headers[SHED_REASON_HEADER] == "deadline"

            await asyncio.to_thread(browser.get, f"{admin}/fleet/page#token={ADMIN_TOKEN}")
            await asyncio.to_thread(wait_for, browser, "Number(document.body.dataset.loaded) > 0")
            shown = await until_shown(
                browser,
                api,
                table="flow-models",
                path="/fleet/flow",
                rows=lambda answer: answer["models"],
                expected=flow_model_cells,
            )
            tenants = await until_shown(
                browser,
                api,
                table="flow-tenants",
                path="/fleet/flow",
                rows=flow_tenant_cells,
                expected=lambda cells: cells,
            )
            # The figures were really in play: two bands waiting, the room used up, a
            # tenant shed for its deadline, acme's first request counted as its service.
            assert shown["enabled"] is True
            assert browser.find_element(By.ID, "flow").is_displayed()
            rows = {r["key"]: r["cells"] for r in read_table(browser, "flow-models")}
            assert rows[MODEL]["room"] == "0"
            assert rows[MODEL]["bands"] == "band 5: 1 here; band 0: 2 here"
            by_tenant = {r["key"]: r["cells"] for r in read_table(browser, "flow-tenants")}
            assert by_tenant["acme"]["waiting"] == "2"
            assert by_tenant["globex"]["waiting"] == "1"
            assert by_tenant["initech"]["shed"] == "1"
            assert by_tenant["initech"]["shed_reasons"] == "deadline 1"
            assert by_tenant["acme"]["shed_reasons"] == "none"
            assert by_tenant["acme"]["service_share"] == share(1.0)
            assert {t["tenant"] for t in tenants["tenants"]} >= {"acme", "initech"}
            summary = browser.find_element(By.ID, "flow-summary").text
            assert summary == "Flow control is on (this router alone); waiting: 3 here"

            await occupying
            responses = await asyncio.gather(*waiting)
            assert [r.status_code for r in responses] == [200] * 3
            drained = await until_shown(
                browser,
                api,
                table="flow-models",
                path="/fleet/flow",
                rows=lambda answer: answer["models"],
                expected=flow_model_cells,
            )
            assert [m["waiting"] for m in drained["models"]] == [{}]
            assert read_table(browser, "flow-models")[0]["cells"]["bands"] == "none"


def ask_locality(driver: webdriver.Chrome, tenant: str, prompt: str) -> None:
    Select(driver.find_element(By.ID, "locality-model")).select_by_value(MODEL)
    for field, text in (("locality-tenant", tenant), ("locality-prompt", prompt)):
        element = driver.find_element(By.ID, field)
        element.clear()
        element.send_keys(text)
    driver.execute_script("document.getElementById('locality').dataset.state = 'idle'")
    driver.find_element(By.CSS_SELECTOR, "#locality-form button").click()
    wait_for(driver, "document.getElementById('locality').dataset.state === 'answered'")


@pytest.mark.heavy("chromium")
async def test_without_its_token_the_page_asks_for_it(browser: webdriver.Chrome) -> None:
    async with page_fleet() as fleet:
        admin = f"http://127.0.0.1:{fleet.router.admin_port}"
        await asyncio.to_thread(browser.get, f"{admin}/fleet/page")
        await asyncio.to_thread(wait_for, browser, TOKEN_FORM_SHOWN)
        assert "admin token" in browser.find_element(By.ID, "problem").text
        assert browser.execute_script("return document.body.dataset.loaded") == "0"

        def sign_in(token: str) -> None:
            field = browser.find_element(By.ID, "token")
            field.clear()
            field.send_keys(token)
            browser.find_element(By.CSS_SELECTOR, "#token-form button").click()

        await asyncio.to_thread(sign_in, "not-the-token")
        await asyncio.to_thread(wait_for, browser, TOKEN_FORM_SHOWN)
        assert browser.execute_script("return document.body.dataset.loaded") == "0"
        await asyncio.to_thread(sign_in, ADMIN_TOKEN)
        await asyncio.to_thread(wait_for, browser, "Number(document.body.dataset.loaded) > 0")
        assert [r["key"] for r in read_table(browser, "workers")] == ["worker-1", "worker-2"]
        assert browser.find_element(By.ID, "problem").is_displayed() is False


@pytest.mark.heavy("chromium")
async def test_with_the_fleet_api_off_the_page_says_so(browser: webdriver.Chrome) -> None:
    """No admin token configured: the API answers 403, which no token mends, so the
    page shows the router's words rather than asking for one."""
    async with page_fleet(admin_token=None) as fleet:
        admin = f"http://127.0.0.1:{fleet.router.admin_port}"
        await asyncio.to_thread(browser.get, f"{admin}/fleet/page")
        await asyncio.to_thread(
            wait_for, browser, "document.getElementById('problem').checkVisibility()"
        )
        problem = browser.find_element(By.ID, "problem").text
        assert problem.startswith("The router did not answer: workers: 403")
        assert not browser.find_element(By.ID, "token-form").is_displayed()


async def test_the_page_is_served_bare_and_locked_down() -> None:
    """The page's files carry no data, so they need no token; the API still does, and
    the policy lets the page run its own script and reach its own origin only."""
    async with page_fleet() as fleet:
        admin = f"http://127.0.0.1:{fleet.router.admin_port}"
        async with httpx.AsyncClient(base_url=admin, timeout=10) as http:
            page = await http.get("/fleet/page")
            script = await http.get("/fleet/page.js")
            style = await http.get("/fleet/page.css")
            unauthenticated = await http.get("/fleet/workers")
        async with fleet.http() as client_port:
            elsewhere = await client_port.get("/fleet/page")
    assert page.status_code == script.status_code == style.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert script.headers["content-type"] == "text/javascript; charset=utf-8"
    assert style.headers["content-type"] == "text/css; charset=utf-8"
    policy = dict(
        directive.strip().split(" ", 1)
        for directive in page.headers["content-security-policy"].split(";")
    )
    assert policy == {
        "default-src": "'none'",
        "script-src": "'self'",  # nothing inline, nothing evaluated
        "style-src": "'self'",
        "connect-src": "'self'",
        "img-src": "'self'",
        "base-uri": "'none'",
        "form-action": "'none'",
        "frame-ancestors": "'none'",
    }
    assert page.headers["referrer-policy"] == "no-referrer"
    assert "worker-1" not in page.text
    assert unauthenticated.status_code == 401
    assert elsewhere.status_code == 404  # with an admin port, operators' pages are there only
