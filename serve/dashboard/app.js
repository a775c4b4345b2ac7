// confluo's dashboard: plain JavaScript over the JSON API under /api/v1, no build step.
// Every value from the API goes into the page as text (textContent), never as HTML.
"use strict";

const API = "/api/v1";
const TOKEN_KEY = "confluo-token";
const SVG = "http://www.w3.org/2000/svg";

let refresh = null; // the current view's refresh timer
let generation = 0; // bumped on navigation: stale renders drop their results
const queueSamples = []; // {t, due, running}, sampled by this page between the server's

// ---- helpers -------------------------------------------------------------------------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "text") el.textContent = v;
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

function svg(tag, attrs, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  for (const child of children) el.append(child instanceof Node ? child : String(child));
  return el;
}

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function api(path, options = {}) {
  // Every call names its client: a write without it is refused as cross-site.
  const headers = { ...(options.headers || {}), "X-Confluo-Client": "dashboard" };
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(API + path, {
    method: options.method || "GET",
    headers,
    body: options.body === undefined ? undefined : JSON.stringify(options.body),
  });
  const text = await response.text();
  const body = text ? JSON.parse(text) : null;
  if (!response.ok) {
    if (response.status === 401) askForToken();
    throw new ApiError(response.status, body && body.code, (body && body.message) || response.statusText);
  }
  return body;
}

function askForToken() {
  const dialog = document.getElementById("token-dialog");
  if (!dialog.open) dialog.showModal();
}

function notice(text, isError) {
  const el = document.getElementById("notice");
  el.textContent = text || "";
  el.hidden = !text;
  el.className = isError ? "error" : "";
}

function ago(iso) {
  if (!iso) return "";
  const s = Math.round((Date.now() - Date.parse(iso)) / 1000);
  if (s < 1) return "now";
  if (s < 90) return `${s} s ago`;
  if (s < 5400) return `${Math.round(s / 60)} min ago`;
  if (s < 129600) return `${Math.round(s / 3600)} h ago`;
  return new Date(iso).toLocaleString();
}

function when(iso) {
  return iso ? h("span", { title: iso, text: ago(iso) }) : h("span", { class: "muted", text: "—" });
}

function status(value) {
  return h("span", { class: `status status-${value}`, "data-status": value, text: value });
}

function short(id) {
  return String(id).slice(0, 8);
}

function link(href, text, attrs = {}) {
  return h("a", { href, ...attrs }, text);
}

function fmtMs(ms) {
  if (ms === null || ms === undefined) return "—";
  return ms < 10 ? `${ms.toFixed(1)} ms` : `${Math.round(ms)} ms`;
}

function params() {
  const [, query = ""] = location.hash.split("?");
  return new URLSearchParams(query);
}

function go(path, query) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(query || {})) if (v !== "" && v !== null && v !== undefined) q.set(k, v);
  const s = q.toString();
  location.hash = s ? `${path}?${s}` : path;
}

function table(headers, rows, empty) {
  const head = h("tr", {}, headers.map((x) => h("th", { class: x.endsWith("#") ? "num" : null, text: x.replace(/#$/, "") })));
  const body = rows.length ? rows : [h("tr", {}, h("td", { colspan: headers.length, class: "muted", text: empty }))];
  return h("table", {}, h("thead", {}, head), h("tbody", {}, body));
}

function live(ok) {
  const el = document.getElementById("live");
  el.textContent = ok ? "live" : "stale";
  el.className = ok ? "" : "stale";
}

// Runs `render` now and then every `ms`, until the next navigation.
function every(ms, render) {
  const mine = generation;
  const tick = async () => {
    if (mine !== generation) return;
    try {
      await render(() => mine === generation);
      live(true);
    } catch (error) {
      live(false);
      if (!(error instanceof ApiError && error.status === 401)) notice(error.message, true);
    }
    if (mine === generation) refresh = setTimeout(tick, ms);
  };
  tick();
}

async function act(button, what, done) {
  button.disabled = true;
  try {
    const result = await what();
    notice(done(result));
  } catch (error) {
    notice(error.message, true);
  } finally {
    button.disabled = false;
  }
}

// ---- executions ----------------------------------------------------------------------

function chart(perMinute, history) {
  const width = 900, height = 180, left = 40, bottom = 20, top = 10;
  const now = Date.now();
  const start = now - 60 * 60 * 1000;
  const x = (t) => left + ((t - start) / (now - start)) * (width - left - 10);
  const maxDone = Math.max(1, ...perMinute.map((m) => m.completed + m.dead));
  // The server's samples (every 15 s over the hour), then this page's since its last one.
  const served = history.map((s) => ({ t: Date.parse(s.at), due: s.due, running: s.running }));
  const since = served.length ? served[served.length - 1].t : 0;
  const samples = served.concat(queueSamples.filter((s) => s.t > since)).filter((s) => s.t >= start);
  const maxQueue = Math.max(1, ...samples.map((s) => s.due + s.running));
  const yDone = (n) => height - bottom - (n / maxDone) * (height - bottom - top);
  const yQueue = (n) => height - bottom - (n / maxQueue) * (height - bottom - top);
  const el = svg("svg", { class: "chart", viewBox: `0 0 ${width} ${height}`, preserveAspectRatio: "none", id: "throughput-chart" });
  const barWidth = Math.max(2, (width - left - 10) / 60 - 2);
  for (const m of perMinute) {
    const t = Date.parse(m.minute);
    el.append(svg("rect", { x: x(t), y: yDone(m.completed), width: barWidth, height: height - bottom - yDone(m.completed), fill: "#1f8a4c" },
      svg("title", {}, `${new Date(t).toLocaleTimeString()}: ${m.completed} completed, ${m.dead} dead`)));
    if (m.dead) el.append(svg("rect", { x: x(t), y: yDone(m.completed + m.dead), width: barWidth, height: yDone(m.completed) - yDone(m.completed + m.dead), fill: "#c23b3b" }));
  }
  if (samples.length > 1) {
    const points = samples.map((s) => `${x(s.t)},${yQueue(s.due + s.running)}`).join(" ");
    el.append(svg("polyline", { points, fill: "none", stroke: "#2f6fd6", "stroke-width": 2 }));
  }
  el.append(svg("text", { x: 2, y: top + 8 }, `${maxDone}/min`));
  el.append(svg("text", { x: 2, y: height - bottom }, "0"));
  el.append(svg("text", { x: left, y: height - 4 }, "an hour ago"));
  el.append(svg("text", { x: width - 40, y: height - 4 }, "now"));
  el.append(svg("text", { x: width - 200, y: top + 8 }, `queue (blue): up to ${maxQueue}`));
  return el;
}

function card(label, value, id) {
  return h("div", { class: "card" }, h("div", { class: "value", id, text: value }), h("div", { class: "label", text: label }));
}

async function startForm() {
  const workflows = await api("/workflows").catch(() => []);
  const names = [...new Set(workflows.map((w) => w.definition.name))];
  const select = h("select", { id: "start-workflow" }, names.map((n) => h("option", { value: n, text: n })));
  const input = h("input", { id: "start-input", placeholder: "input (JSON), e.g. 100", size: 30 });
  const button = h("button", { id: "start-button", type: "submit", text: "Start" });
  return h("form", {
    class: "filters",
    onsubmit: (e) => {
      e.preventDefault();
      let value = null;
      try {
        value = input.value.trim() ? JSON.parse(input.value) : null;
      } catch (error) {
        notice(`the input is not JSON: ${error.message}`, true);
        return;
      }
      act(button, () => api("/executions", { method: "POST", body: { workflow: select.value, input: value } }), (r) => {
        go(`/executions/${r.id}`);
        return `started ${short(r.id)}`;
      });
    },
  }, h("strong", { text: "Start" }), select, input, button);
}

async function executionsView(view) {
  const p = params();
  const workflow = h("input", { name: "workflow", placeholder: "workflow", value: p.get("workflow") || "" });
  const which = h("select", { name: "status" }, ["", "running", "completed", "failed", "cancelled", "timed_out"].map((s) =>
    h("option", { value: s, selected: s === (p.get("status") || ""), text: s || "any status" })));
  const filters = h("form", { class: "filters", onsubmit: (e) => { e.preventDefault(); go("/", { workflow: workflow.value, status: which.value }); } },
    workflow, which, h("button", { type: "submit", text: "Filter" }));
  const top = h("div"), list = h("div");
  view.replaceChildren(h("h1", { text: "Executions" }), top, await startForm(), filters, list);
  every(2000, async (current) => {
    const q = new URLSearchParams({ limit: "50" });
    if (p.get("workflow")) q.set("workflow", p.get("workflow"));
    if (p.get("status")) q.set("status", p.get("status"));
    const [stats, executions] = await Promise.all([api("/stats"), api(`/executions?${q}`)]);
    if (!current()) return;
    queueSamples.push({ t: Date.now(), due: stats.queue.due, running: stats.queue.running });
    while (queueSamples.length > 3600) queueSamples.shift();
    const e = stats.executions, a = stats.activity;
    top.replaceChildren(
      h("div", { class: "cards" },
        card("running", e.running, "stat-running"), card("completed", e.completed, "stat-completed"),
        card("failed", e.failed), card("cancelled", e.cancelled), card("timed out", e.timed_out),
        card("tasks due", stats.queue.due, "stat-due"), card("tasks running", stats.queue.running),
        card("dead letters", a.tasks.dead), card("workers alive", stats.workers.alive, "stat-workers"),
        card(`fired → next stage claimed, p50 / p95 (${a.hand_over.in_firing_transaction} of ${a.hand_over.groups} in the firing transaction)`,
          `${fmtMs(a.hand_over.p50_ms)} / ${fmtMs(a.hand_over.p95_ms)}`)),
      auditorPanel(stats.auditor),
      h("h2", { text: "Members finished per minute, and the queue's depth" }),
      chart(a.per_minute, stats.queue_history || []));
    list.replaceChildren(table(["execution", "workflow", "status", "stage", "started", "finished", "error"],
      executions.map((x) => h("tr", { "data-execution": x.id },
        h("td", {}, link(`#/executions/${x.id}`, short(x.id), { class: "mono" })),
        h("td", { text: `${x.workflow} v${x.version}` }), h("td", {}, status(x.status)),
        h("td", { class: "num", text: x.current_stage }), h("td", {}, when(x.created_at)), h("td", {}, when(x.finished_at)),
        h("td", { class: "muted", text: x.error || "" }))), "no executions"));
  });
}

// The auditor that workers run by themselves: what it found, repaired, and could not.
function auditorPanel(auditor) {
  if (!auditor) return h("div");
  const last = auditor.last_round_at ? when(auditor.last_round_at) : h("span", { text: "no round yet (workers run one every minute)" });
  const summary = h("p", { id: "auditor", class: auditor.unrepaired.length ? "auditor-bad" : "muted" },
    h("span", { text: `Auditor: ${auditor.rounds} rounds, ${auditor.found} found, ${auditor.repaired} repaired, ${auditor.unrepaired.length} unrepaired; last round ` }), last);
  if (!auditor.unrepaired.length) return summary;
  return h("div", {}, summary, table(["execution", "finding", "found"],
    auditor.unrepaired.map((u) => h("tr", { "data-unrepaired": u.execution_id },
      h("td", {}, link(`#/executions/${u.execution_id}`, short(u.execution_id), { class: "mono" })),
      h("td", { text: u.finding }), h("td", {}, when(u.at)))), ""));
}

// ---- one execution -------------------------------------------------------------------

function progress(stage) {
  const pct = (n) => (stage.width ? (100 * n) / stage.width : 0);
  let at = 0;
  const part = (cls, n) => {
    // Set through the CSSOM: the page's Content-Security-Policy refuses style attributes.
    const el = h("span", { class: cls });
    el.style.left = `${at}%`;
    el.style.width = `${pct(n)}%`;
    at += pct(n);
    return el;
  };
  return h("div", { class: "bar", title: `${stage.completed} completed, ${stage.dead} dead, ${stage.cancelled} cancelled of ${stage.width}` },
    part("done", stage.completed), part("dead", stage.dead), part("gone", stage.cancelled));
}

function errorsOf(detail) {
  return h("ol", { class: "errors" }, detail.errors.map((e) => h("li", {}, h("span", { class: "muted", text: `attempt ${e.attempt}, ${ago(e.at)}: ` }), e.error)));
}

function reprocessButton(task) {
  const button = h("button", { "data-reprocess": task, text: "Reprocess" });
  button.addEventListener("click", () => act(button, () => api(`/dead-letters/${task}/reprocess`, { method: "POST" }),
    (r) => `reprocessed ${short(task)}${r.resumed ? ": its execution runs again" : ""}`));
  return button;
}

async function executionView(view, id) {
  const p = params();
  const head = h("div"), stages = h("div"), members = h("div"), dead = h("div"), detail = h("div", { id: "member-detail" });
  const hooks = h("div", { id: "notifications" });
  view.replaceChildren(head, stages, members, detail, dead, hooks);
  let stageIndex = p.has("stage") ? Number(p.get("stage")) : null;
  const memberStatus = p.get("member_status") || "";
  const after = p.get("after");
  every(1000, async (current) => {
    const x = await api(`/executions/${id}`);
    if (stageIndex === null) stageIndex = x.stages.length ? x.stages.reduce((best, s) => (s.width > x.stages[best].width ? s.index : best), 0) : 0;
    const q = new URLSearchParams({ limit: "50" });
    if (after) q.set("after", after);
    if (memberStatus) q.set("status", memberStatus);
    const [page, notifications] = await Promise.all([
      x.stages.length ? api(`/executions/${id}/stages/${stageIndex}/members?${q}`) : { members: [], next_after: null },
      api(`/executions/${id}/notifications`),
    ]);
    if (!current()) return;
    const cancel = x.status === "running" ? h("button", { class: "danger", id: "cancel-button", text: "Cancel" }) : null;
    if (cancel) cancel.addEventListener("click", () => act(cancel, () => api(`/executions/${id}/cancel`, { method: "POST" }), () => "cancelled"));
    head.replaceChildren(
      h("h1", {}, `${x.workflow} v${x.version} `, h("span", { class: "mono muted", text: x.id }), " ", status(x.status), " ", cancel),
      h("p", { class: "muted" }, "started ", when(x.created_at), x.finished_at ? [", finished ", when(x.finished_at)] : "",
        x.deadline ? [", deadline ", h("span", { text: x.deadline })] : "", x.idempotency_key ? `, key ${x.idempotency_key}` : ""),
      x.error ? h("p", { class: "status-failed", text: x.error }) : "",
      x.output !== null && x.output !== undefined
        ? h("div", {}, h("strong", { text: "Output" }), h("pre", { id: "output", text: JSON.stringify(x.output, null, 2) }))
        : "");
    stages.replaceChildren(h("h2", { text: "Stages" }), table(
      ["#", "stage", "kind", "fan-in", "width#", "remaining#", "progress", "completed#", "dead#", "running#", "pending#", "attempts#", "entered", "fired"],
      x.stages.map((s) => h("tr", { "data-stage": s.index, class: s.index === stageIndex ? "selected" : null },
        h("td", { class: "num", text: s.index }),
        h("td", {}, link(`#/executions/${id}?stage=${s.index}`, s.name)),
        h("td", s.branch
          ? { class: "branch", title: `selected value: ${JSON.stringify(s.branch.value)}`,
              text: `branch: took ${s.branch.arm === null ? "otherwise" : JSON.stringify(s.branch.arm)}` }
          : s.kind === "signal" && s.pending > 0
            ? { class: "signal", title: s.wakes_at || "no timeout",
                text: `signal: waiting${s.wakes_at ? `, times out ${new Date(s.wakes_at).toLocaleString()}` : ""}` }
          : s.wakes_at
            ? { class: "sleep", title: s.wakes_at, text: `sleep: wakes ${new Date(s.wakes_at).toLocaleString()}` }
            : { text: s.kind }),
        h("td", { text: s.fan_in || "" }), h("td", { class: "num", text: s.width }),
        h("td", { class: "num" }, h("span", { class: "countdown", id: `countdown-${s.index}`, text: s.remaining })),
        h("td", {}, progress(s)),
        h("td", { class: "num", text: s.completed }), h("td", { class: "num", text: s.dead }),
        h("td", { class: "num", text: s.running }), h("td", { class: "num", text: s.pending }),
        h("td", { class: "num", text: s.attempts }), h("td", {}, when(s.entered_at)),
        h("td", {}, s.fired_at ? h("span", { title: s.fired_at, text: `${ago(s.fired_at)} (${Math.round(Date.parse(s.fired_at) - Date.parse(s.entered_at))} ms after entry)` }) : h("span", { class: "muted", text: "not yet" })))),
      "no stage entered yet"));
    const stage = x.stages[stageIndex];
    const statusFilter = h("select", { id: "member-status" }, ["", "pending", "running", "completed", "dead", "cancelled"].map((s) =>
      h("option", { value: s, selected: s === memberStatus, text: s || "any status" })));
    statusFilter.addEventListener("change", () => go(`/executions/${id}`, { stage: stageIndex, member_status: statusFilter.value }));
    const pager = h("div", { class: "pager" },
      after ? link(`#/executions/${id}?${new URLSearchParams({ stage: stageIndex, ...(memberStatus ? { member_status: memberStatus } : {}) })}`, "« first page") : "",
      page.next_after !== null ? link(`#/executions/${id}?${new URLSearchParams({ stage: stageIndex, after: page.next_after, ...(memberStatus ? { member_status: memberStatus } : {}) })}`, "next page »", { id: "next-page" }) : "",
      h("span", { class: "muted", text: after ? `members after item ${after}` : "" }));
    members.replaceChildren(
      h("h2", {}, `Members of ${stage ? stage.name : "—"} `, statusFilter),
      pager,
      table(["item#", "status", "attempts#", "reprocessed#", "started", "finished", "last error", ""],
        page.members.map((m) => h("tr", { "data-member": m.item_index },
          h("td", { class: "num", text: m.item_index }), h("td", {}, status(m.status)),
          h("td", { class: "num", text: m.attempts }), h("td", { class: "num", text: m.reprocessed }),
          h("td", {}, when(m.started_at)), h("td", {}, when(m.finished_at)),
          h("td", { class: "muted", text: m.last_error || "" }),
          h("td", {}, m.last_error ? h("button", { text: "Errors", onclick: () => showTask(detail, m.task_id) }) : ""))),
        "no members on this page"));
    dead.replaceChildren(h("h2", { text: `Dead letters (${x.dead_letters.length}${x.dead_letters.length >= 100 ? "+" : ""})` }),
      table(["stage", "item#", "attempts#", "error", ""], x.dead_letters.map((d) => h("tr", { "data-dead": d.task_id },
        h("td", { text: d.handler }), h("td", { class: "num", text: d.item_index }), h("td", { class: "num", text: d.attempts }),
        h("td", { text: d.errors.length ? d.errors[d.errors.length - 1].error : "" }), h("td", {}, reprocessButton(d.task_id)))), "none"));
    hooks.replaceChildren(...(notifications.length ? [h("h2", { text: "Webhooks" }),
      table(["event", "url", "status", "attempts#", "last answer", "last error", "written", "delivered"],
        notifications.map((n) => h("tr", { "data-notification": n.id },
          h("td", { text: n.event }), h("td", { class: "mono", text: n.url }), h("td", {}, status(n.status)),
          h("td", { class: "num", text: n.attempts }), h("td", { class: "num", text: n.last_status === null ? "—" : n.last_status }),
          h("td", { class: "muted", text: n.last_error || "" }), h("td", {}, when(n.created_at)), h("td", {}, when(n.delivered_at)))),
        "none")] : []));
  });
}

// Any member: every attempt's error, its input and output; Reprocess when it is dead.
async function showTask(target, task) {
  try {
    const m = await api(`/tasks/${task}`);
    target.replaceChildren(h("h2", { text: `Task ${short(task)}: ${m.handler}, item ${m.item_index}` }),
      h("p", {}, status(m.status), ` ${m.attempts} attempt(s), reprocessed ${m.reprocessed} time(s) `, m.status === "dead" ? reprocessButton(task) : ""),
      m.input !== null ? h("pre", { text: JSON.stringify(m.input, null, 2) }) : h("p", { class: "muted", text: "input: its stage's input" }),
      errorsOf(m));
  } catch (error) {
    target.replaceChildren(h("p", { class: "muted", text: error.message }));
  }
}

async function showDead(target, task) {
  try {
    const d = await api(`/dead-letters/${task}`);
    target.replaceChildren(h("h2", { text: `Task ${short(task)}: ${d.handler}, item ${d.item_index}` }),
      h("p", {}, status("dead"), ` ${d.attempts} attempt(s), reprocessed ${d.reprocessed} time(s) `, reprocessButton(task)),
      d.input !== null ? h("pre", { text: JSON.stringify(d.input, null, 2) }) : h("p", { class: "muted", text: "input: its stage's input" }),
      errorsOf(d));
  } catch (error) {
    target.replaceChildren(h("p", { class: "muted", text: error.message }));
  }
}

// ---- dead letters, workers -------------------------------------------------------------

async function deadLettersView(view) {
  const p = params();
  const workflow = h("input", { name: "workflow", placeholder: "workflow", value: p.get("workflow") || "" });
  const execution = h("input", { name: "execution", placeholder: "execution id", size: 36, value: p.get("execution") || "" });
  const all = h("button", { type: "button", id: "reprocess-all", text: "Reprocess all matching" });
  all.addEventListener("click", () => {
    const body = {};
    if (p.get("workflow")) body.workflow = p.get("workflow");
    if (p.get("execution")) body.execution = p.get("execution");
    if (!Object.keys(body).length) return notice("filter by a workflow or an execution first", true);
    act(all, () => api("/dead-letters/reprocess", { method: "POST", body }), (r) => `reprocessed ${r.reprocessed.length} dead letter(s)${r.failed.length ? `, ${r.failed.length} refused: ${r.failed[0].error.message}` : ""}`);
  });
  const filters = h("form", { class: "filters", onsubmit: (e) => { e.preventDefault(); go("/dead-letters", { workflow: workflow.value, execution: execution.value }); } },
    workflow, execution, h("button", { type: "submit", text: "Filter" }), all);
  const list = h("div"), detail = h("div", { id: "dead-detail" });
  view.replaceChildren(h("h1", { text: "Dead letters" }), filters, list, detail);
  every(2000, async (current) => {
    const q = new URLSearchParams({ limit: "100" });
    for (const k of ["workflow", "execution"]) if (p.get(k)) q.set(k, p.get(k));
    const rows = await api(`/dead-letters?${q}`);
    if (!current()) return;
    list.replaceChildren(table(["task", "workflow", "execution", "stage", "item#", "attempts#", "last error", "dead", ""],
      rows.map((d) => h("tr", { "data-dead": d.task_id },
        h("td", { class: "mono", text: short(d.task_id) }), h("td", { text: `${d.workflow} v${d.version}` }),
        h("td", {}, link(`#/executions/${d.execution_id}`, short(d.execution_id), { class: "mono" }), " ", status(d.execution_status)),
        h("td", { text: d.stage }), h("td", { class: "num", text: d.item_index }), h("td", { class: "num", text: d.attempts }),
        h("td", { class: "muted", text: d.last_error || "" }), h("td", {}, when(d.dead_at)),
        h("td", {}, h("button", { text: "Errors", onclick: () => showDead(detail, d.task_id) }), " ", reprocessButton(d.task_id)))),
      "no dead letters"));
  });
}

async function workersView(view) {
  const list = h("div");
  view.replaceChildren(h("h1", { text: "Workers" }), list);
  every(2000, async (current) => {
    const workers = await api("/workers");
    if (!current()) return;
    list.replaceChildren(table(["worker", "state", "host", "pid#", "version", "handlers", "concurrency#", "running#", "started", "last seen"],
      workers.map((w) => h("tr", { "data-worker": w.id },
        h("td", { class: "mono", text: w.id }), h("td", {}, status(w.state)), h("td", { text: w.host }),
        h("td", { class: "num", text: w.pid }), h("td", { text: w.version }),
        h("td", { text: w.handlers.map((x) => `${x.workflow}/${x.handler}`).join(", ") }),
        h("td", { class: "num", text: w.concurrency }), h("td", { class: "num", text: w.running }),
        h("td", {}, when(w.started_at)), h("td", {}, when(w.last_seen)))),
      "no workers in the last hour"));
  });
}

// ---- routing ---------------------------------------------------------------------------

function route() {
  generation += 1;
  clearTimeout(refresh);
  notice("");
  const view = document.getElementById("view");
  const path = location.hash.replace(/^#/, "").split("?")[0] || "/";
  const section = path.startsWith("/dead-letters") ? "dead-letters" : path.startsWith("/workers") ? "workers" : "executions";
  for (const a of document.querySelectorAll("header nav a")) a.classList.toggle("active", a.dataset.nav === section);
  const execution = path.match(/^\/executions\/([0-9a-f-]{36})$/);
  const render = execution ? executionView(view, execution[1])
    : section === "dead-letters" ? deadLettersView(view)
    : section === "workers" ? workersView(view)
    : executionsView(view);
  render.catch((error) => notice(error.message, true));
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("token-form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, document.getElementById("token-input").value.trim());
    document.getElementById("token-dialog").close();
    route();
  });
  window.addEventListener("hashchange", route);
  route();
});
