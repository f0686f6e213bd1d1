// The fleet page's script: it asks the fleet API (the admin token) and renders the
// answers as text. Worker ids, labels and tenants come from agents and configuration:
// they only ever become text nodes, never HTML.
"use strict";

const TOKEN_KEY = "kvplane.adminToken";
const REFRESH_MS = 5000;
const DASH = "\u2013";

// The token: from the address's fragment (which no server sees), then out of the
// address bar and into this tab's session storage. Read raw, so that a base64 token's
// "+" stays a "+".
function takeToken() {
  const match = /(?:^|&)token=([^&]*)/.exec(location.hash.slice(1));
  if (match) {
    sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
}

class Unauthorized extends Error {
  constructor(token) {
    super("the admin token was refused");
    this.token = token; // the token refused: a newer one may have been entered since
  }
}

async function api(path, body) {
  const headers = { accept: "application/json" };
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.authorization = "Bearer " + token;
  const init = { headers, cache: "no-store" };
  if (body !== undefined) {
    init.method = "POST";
    headers["content-type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  if (response.status === 401) throw new Unauthorized(token);
  const answer = await response.json().catch(() => null);
  if (!response.ok) {
    // 403 included: the fleet API is off (no admin token configured), which no token mends.
    const message = answer && answer.error ? answer.error.message : response.statusText;
    throw new Error(`${path}: ${response.status} ${message}`);
  }
  return answer;
}

// Formats: the page test formats the API's figures the same way.
const count = (n) => (n === null || n === undefined ? DASH : n.toLocaleString("en-US"));
const share = (x) => (x === null || x === undefined ? DASH : (x * 100).toFixed(1) + "%");
const seconds = (x) => (x === null || x === undefined ? DASH : x.toFixed(1) + " s");
const decimal = (x) => (x === null || x === undefined ? DASH : x.toFixed(2));
const units = (x) =>
  x === null || x === undefined ? DASH : x.toLocaleString("en-US", { maximumFractionDigits: 0 });

function cell(field, text, className) {
  const td = document.createElement("td");
  td.dataset.field = field;
  if (className) td.className = className;
  if (text instanceof Node) td.append(text);
  else td.textContent = text;
  return td;
}

function row(key, cells) {
  const tr = document.createElement("tr");
  tr.dataset.key = key;
  tr.append(...cells);
  return tr;
}

function fill(tableId, rows, emptyText) {
  const table = document.getElementById(tableId);
  const body = table.tBodies[0];
  if (rows.length === 0) {
    const td = document.createElement("td");
    td.colSpan = table.tHead.rows[0].cells.length;
    td.className = "empty";
    td.textContent = emptyText;
    body.replaceChildren(row("", [td]));
  } else {
    body.replaceChildren(...rows);
  }
}

function note(text, className) {
  const span = document.createElement("span");
  span.textContent = text;
  if (className) span.className = className;
  return span;
}

function workerNotes(worker) {
  const notes = document.createElement("div");
  notes.className = "notes";
  if (worker.wiring.blind) notes.append(note("blind: wiring fails", "bad"));
  if (worker.suspect) notes.append(note("suspect", "warn"));
  if (worker.credit_withdrawn_for_s !== null) {
    notes.append(note(`credit withdrawn for ${seconds(worker.credit_withdrawn_for_s)}`, "bad"));
  }
  if (worker.drained_by_operator) notes.append(note("drained by an operator", "warn"));
  if (worker.load && worker.load.engine_down) notes.append(note("engine down", "bad"));
  for (const [name, value] of Object.entries(worker.labels)) {
    notes.append(note(`${name}=${value}`));
  }
  return notes;
}

function renderWorkers(answer) {
  const rows = answer.workers.map((w) => {
    const load = w.load || {};
    return row(w.worker_id, [
      cell("worker_id", w.worker_id, "key"),
      cell("state", w.state),
      cell("model", w.model),
      cell("role", w.kv_connector ? `${w.role} (${w.kv_connector})` : w.role),
      cell("engine", `${w.engine.kind} ${w.engine.version}`),
      cell("running", count(load.running), "number"),
      cell("waiting", count(load.waiting), "number"),
      cell("kv_usage", share(load.kv_usage), "number"),
      cell("router_in_flight", count(w.router_in_flight), "number"),
      cell("index_entries", count(w.index_entries), "number"),
      cell("last_event", seconds(w.last_event_age_s), "number"),
      cell("hit_rate", share(w.cache.hit_rate), "number"),
      cell("agreement", share(w.cache.agreement), "number"),
      cell("notes", workerNotes(w)),
    ]);
  });
  fill("workers", rows, "No worker has registered.");
  // A model whose requests cannot be split as its workers' roles say is shouted.
  const legs = (m) =>
    ({ whole: "", split: ", split" })[m.legs] ?? `, ${m.legs.replaceAll("_", " ").toUpperCase()}`;
  const models = answer.routing.map((m) => `${m.model}: ${m.routing.replace("_", "-")}${legs(m)}`);
  const index = answer.index_reachable ? "index reachable" : "INDEX UNREACHABLE: routing on load only";
  const live = answer.workers.filter((w) => w.state === "live").length;
  document.getElementById("summary").textContent =
    `${live} of ${answer.workers.length} workers live; ${index}; ${models.join(", ") || "no model"}`;
  setModels([...new Set(answer.workers.map((w) => w.model))].sort());
}

function setModels(models) {
  const select = document.getElementById("locality-model");
  const current = [...select.options].map((o) => o.value);
  if (current.join("\n") === models.join("\n")) return;
  const chosen = select.value;
  select.replaceChildren(...models.map((model) => new Option(model, model)));
  if (models.includes(chosen)) select.value = chosen;
}

// The funnel's stages as bars, each a share of the prompt tokens.
function bars(f) {
  const box = document.createElement("div");
  box.className = "bars";
  for (const stage of ["attainable", "predicted", "achieved"]) {
    const bar = document.createElement("div");
    const part = f.prompt_tokens ? f[`${stage}_tokens`] / f.prompt_tokens : 0;
    bar.className = `bar ${stage}`;
    bar.title = `${stage}: ${share(part)} of the prompt tokens`;
    bar.style.width = `${Math.min(100, 100 * part)}%`;
    box.append(bar);
  }
  return box;
}

function renderFunnel(answer) {
  const rows = answer.rows.map((f) => {
    const lost = Object.entries(f.lost_tokens)
      .filter(([, tokens]) => tokens > 0)
      .map(([reason, tokens]) => `${reason.replaceAll("_", " ")} ${count(tokens)}`);
    return row(`${f.model}/${f.tenant}`, [
      cell("model", f.model),
      cell("tenant", f.tenant),
      cell("requests", count(f.requests), "number"),
      cell("prompt_tokens", count(f.prompt_tokens), "number"),
      cell("attainable_tokens", count(f.attainable_tokens), "number"),
      cell("predicted_tokens", count(f.predicted_tokens), "number"),
      cell("achieved_tokens", count(f.achieved_tokens), "number"),
      cell("hit_rate", share(f.hit_rate), "number"),
      cell("evicted_from_fleet", count(f.lost_tokens.evicted_from_fleet), "number"),
      cell("copied", count(f.copied_tokens), "number"),
      cell("bars", bars(f)),
      cell("lost_tokens", lost.join("; ") || "none"),
    ]);
  });
  fill("funnel", rows, "No request has been answered yet.");
}

// Requests waiting: in one band (tenant -> requests), or in all (band -> tenant -> requests),
// all tenants' or one's.
const inBand = (tenants) => Object.values(tenants ?? {}).reduce((n, requests) => n + requests, 0);
const waitingIn = (bands, tenant) =>
  Object.values(bands).reduce(
    (n, tenants) => n + (tenant === undefined ? inBand(tenants) : (tenants[tenant] ?? 0)),
    0,
  );

// Each band's waiting requests, the higher band first: "band 5: 2 here, 1 elsewhere".
function byBand(model) {
  const bands = new Set([...Object.keys(model.waiting), ...Object.keys(model.waiting_elsewhere)]);
  return [...bands]
    .sort((a, b) => Number(b) - Number(a))
    .map((band) => {
      const there = inBand(model.waiting_elsewhere[band]);
      return (
        `band ${band}: ${count(inBand(model.waiting[band]))} here` +
        (there ? `, ${count(there)} elsewhere` : "")
      );
    })
    .join("; ");
}

function renderFlow(answer) {
  const summary = document.getElementById("flow-summary");
  document.getElementById("flow").hidden = !answer.enabled;
  if (!answer.enabled) {
    summary.textContent =
      "Flow control is off: requests go to their engines however saturated " +
      "(flow_control.enabled turns it on).";
    return;
  }
  const models = answer.models.map((m) =>
    row(m.model, [
      cell("model", m.model),
      cell("room", count(m.room), "number"),
      cell("waiting", count(waitingIn(m.waiting)), "number"),
      cell("waiting_elsewhere", count(waitingIn(m.waiting_elsewhere)), "number"),
      cell("bands", byBand(m) || "none"),
    ]),
  );
  fill("flow-models", models, "No request has been served under flow control yet.");
  // Tenants served or shed, and those waiting or counted before either.
  const served = new Map(answer.tenants.map((t) => [t.tenant, t]));
  const names = new Set(served.keys());
  for (const m of answer.models) {
    const bands = [...Object.values(m.waiting), ...Object.values(m.waiting_elsewhere)];
    for (const tenants of [...bands, m.counters]) {
      for (const name of Object.keys(tenants)) names.add(name);
    }
  }
  const tenants = [...names].sort().map((name) => {
    const t = served.get(name);
    const counters = answer.models
      .filter((m) => name in m.counters)
      .map((m) => (answer.models.length === 1 ? "" : `${m.model} `) + units(m.counters[name]));
    const waiting = (key) => answer.models.reduce((n, m) => n + waitingIn(m[key], name), 0);
    const shed = Object.entries(t ? t.shed : {}).filter(([, requests]) => requests > 0);
    const reasons = shed.map(([reason, n]) => `${reason.replaceAll("_", " ")} ${count(n)}`);
    return row(name, [
      cell("tenant", name),
      cell("waiting", count(waiting("waiting")), "number"),
      cell("waiting_elsewhere", count(waiting("waiting_elsewhere")), "number"),
      cell("counter", counters.join("; ") || DASH, "number"),
      cell("service_tokens", units(t ? t.service_tokens : null), "number"),
      cell("service_share", share(t ? t.service_share : null), "number"),
      cell("shed", count(shed.reduce((n, [, requests]) => n + requests, 0)), "number"),
      cell("shed_reasons", reasons.join("; ") || "none"),
    ]);
  });
  fill("flow-tenants", tenants, "No tenant has been served under flow control yet.");
  const here = answer.models.reduce((n, m) => n + waitingIn(m.waiting), 0);
  const there = answer.models.reduce((n, m) => n + waitingIn(m.waiting_elsewhere), 0);
  const replicas =
    answer.replicas === 1 ? "this router alone" : `${answer.replicas} router replicas`;
  summary.textContent =
    `Flow control is on (${replicas}); waiting: ${count(here)} here` +
    (answer.replicas === 1 ? "" : `, ${count(there)} at the other replicas`);
}

function renderPrefixes(prefixes) {
  const rows = prefixes.map((p) =>
    row(`${p.tenant}/${p.key}`, [
      cell("tenant", p.tenant),
      cell("key", p.key, "key"),
      cell("tokens", count(p.tokens), "number"),
      cell("requests", count(p.requests), "number"),
      cell("reused_tokens", count(p.reused_tokens), "number"),
    ]),
  );
  fill("prefixes", rows, "No request has reused a cached prefix yet.");
}

function showProblem(text) {
  const problem = document.getElementById("problem");
  problem.textContent = text;
  problem.hidden = text === "";
}

function askForToken(refused) {
  if (sessionStorage.getItem(TOKEN_KEY) === refused) sessionStorage.removeItem(TOKEN_KEY);
  if (sessionStorage.getItem(TOKEN_KEY) !== null) return; // a newer token is on its way
  document.getElementById("token-form").hidden = false;
  showProblem("The fleet API wants the router's admin token.");
}

// One refresh at a time: the next is scheduled when this one settles, so that a slow
// answer never lands over a newer one. None while the page waits for a token; none
// while its tab is hidden, until it is shown again.
let nextRefresh = null;
let pausedWhileHidden = false;

async function refresh() {
  clearTimeout(nextRefresh);
  nextRefresh = null;
  pausedWhileHidden = false;
  try {
    const [workers, flow, funnel, prefixes] = await Promise.all([
      api("workers"),
      api("flow"),
      api("funnel"),
      api("prefixes?limit=20"),
    ]);
    renderWorkers(workers);
    renderFlow(flow);
    renderFunnel(funnel);
    renderPrefixes(prefixes);
    showProblem("");
    document.getElementById("updated").textContent =
      `updated ${new Date().toLocaleTimeString("en-GB")}`;
    document.body.dataset.loaded = String(Number(document.body.dataset.loaded) + 1);
  } catch (error) {
    if (error instanceof Unauthorized) {
      askForToken(error.token);
      return;
    }
    showProblem(`The router did not answer: ${error.message}`);
  }
  if (document.hidden) pausedWhileHidden = true;
  else nextRefresh = setTimeout(refresh, REFRESH_MS);
}

let asked = 0; // the latest locality query: an earlier one's late answer is dropped

async function locate(event) {
  event.preventDefault();
  const result = document.getElementById("locality");
  const summary = document.getElementById("locality-summary");
  const table = document.getElementById("locality-workers");
  const query = {
    model: document.getElementById("locality-model").value,
    prompt: document.getElementById("locality-prompt").value,
  };
  const tenant = document.getElementById("locality-tenant").value.trim();
  if (tenant) query.tenant = tenant;
  const number = ++asked;
  result.dataset.state = "asking";
  try {
    const answer = await api("locality", query);
    if (number !== asked) return;
    summary.textContent =
      `${count(answer.prompt_tokens)} prompt tokens in ${count(answer.blocks)} blocks ` +
      `(tenant ${answer.tenant}, scope ${answer.cache_scope}); ` +
      `the router would pick ${answer.chosen ?? "no worker"} (${answer.factor})` +
      (answer.index_answered ? "" : "; the index did not answer");
    const rows = answer.workers.map((w) => {
      const tiers = Object.entries(w.matched_tokens).map(([tier, tokens]) => `${tier} ${count(tokens)}`);
      const tr = row(w.worker_id, [
        cell("worker_id", w.worker_id, "key"),
        cell("eligible", w.eligible ? (w.spilled ? "yes, spilled" : "yes") : "no"),
        cell("cached_tokens", count(w.cached_tokens), "number"),
        cell("matched_tokens", tiers.join(", ") || "none"),
        cell("saved_tokens", decimal(w.saved_tokens), "number"),
        cell("queue_penalty", decimal(w.queue_penalty), "number"),
        cell("memory_penalty", decimal(w.memory_penalty), "number"),
        cell("copy_penalty", decimal(w.copy_penalty), "number"),
        cell("tenant_penalty", decimal(w.tenant_penalty), "number"),
        cell("score", decimal(w.score), "number"),
      ]);
      if (w.worker_id === answer.chosen) tr.className = "chosen";
      return tr;
    });
    fill("locality-workers", rows, "No worker serves this model.");
    table.hidden = false;
    result.dataset.state = "answered";
  } catch (error) {
    if (number !== asked) return;
    table.hidden = true;
    if (error instanceof Unauthorized) askForToken(error.token);
    summary.textContent = error instanceof Unauthorized ? "" : error.message;
    result.dataset.state = "failed";
  }
}

function start() {
  takeToken();
  document.getElementById("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, document.getElementById("token").value);
    document.getElementById("token-form").hidden = true;
    refresh();
  });
  document.getElementById("locality-form").addEventListener("submit", locate);
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && pausedWhileHidden) refresh();
  });
  refresh();
}

start();
