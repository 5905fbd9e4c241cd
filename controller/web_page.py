# ruff: noqa: E501
"""The dashboard's one page and its script (served by ``controller/web.py``).

Self-contained: no build step, no CDN, no framework. The script polls ``/api/state``
every ``POLL_MS`` and the timeline every ``TIMELINE_MS``, and builds the DOM with
``textContent`` only (job output, reasons and names are never parsed as HTML); the one
exception is the timeline SVG, which the server builds with every value escaped. (The
JavaScript and CSS keep their own line lengths.)

Every run, job and attempt it shows is a link (``<a href>``) to its address, the scheme
of ``controller/web_links.py`` (``/runs/3``, ``/runs/3/jobs/i07.solve``,
``/attempts/42``, ``/runs/3/explain/i07.solve``); a click shows it in place and pushes
the address (``history.pushState``), Back goes back, and a pasted address opens the page
on it (the script reads ``location.pathname``). The top banner is the run's one next step
(``next_step``, ``advice.run_next_step``: the same words and command ``laneway status``
leads with); a controller that is not running is a plain line under it, and an alarm
only when that is the next step. Lanes whose next step has a command (a person must act:
reconcile, raise the budget, resume, start a worker, ...) come first, with their action,
in "Needs you" at the top and at the head of the lanes table, above the running ones; a
done lane or one that waits for capacity is not among them.

An unknown attempt shows its manual ``laneway reconcile ATTEMPT --as ...`` command; once
its evidence is conclusive (``conclusive`` in the state), what it settles as and the
``laneway reconcile --run RUN --from-evidence`` command instead, as ``laneway status``
shows it.
"""

POLL_MS = 2000
TIMELINE_MS = 10000

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>laneway</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 0; color: #111; background: #fafafa; }
header { background: #1f2937; color: #fff; padding: 8px 16px; display: flex; gap: 16px;
  align-items: center; }
header h1 { font-size: 18px; margin: 0; }
header .muted { color: #9ca3af; }
main { padding: 12px 16px; }
section { background: #fff; border: 1px solid #e5e7eb; border-radius: 6px; padding: 8px 12px;
  margin-bottom: 12px; }
section h2 { font-size: 15px; margin: 4px 0 8px; }
table { border-collapse: collapse; width: 100%; }
td, th { border-bottom: 1px solid #eee; padding: 3px 6px; text-align: left;
  vertical-align: top; }
th { font-weight: 600; color: #374151; }
code, pre { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 12px; }
pre { background: #f3f4f6; padding: 6px; overflow: auto; max-height: 320px; margin: 4px 0;
  white-space: pre-wrap; word-break: break-all; }
.alarm { border: 2px solid #b91c1c; background: #fef2f2; }
.alarm h2 { color: #b91c1c; }
.warn { border: 2px solid #92400e; background: #fffbeb; }
.conclusive { color: #166534; }
.idle { color: #92400e; }
.ok { color: #166534; }
.unverified { color: #6b21a8; font-weight: 600; background: #f3e8ff; }
.bar { background: #e5e7eb; height: 10px; width: 160px; display: inline-flex;
  border-radius: 3px; overflow: hidden; vertical-align: middle; }
.bar i { display: block; height: 100%; }
.s-succeeded { background: #3a9d5d; } .s-failed { background: #d9822b; }
.s-running { background: #60a5fa; } .s-ready { background: #a5b4fc; }
.s-waiting { background: #d1d5db; } .s-unknown { background: #111827; }
.s-skipped, .s-cancelled { background: #9ca3af; }
a { color: #1d4ed8; cursor: pointer; }
.cols { display: grid; grid-template-columns: 1fr 1fr; gap: 12px; }
.timeline-box { overflow-x: auto; }
.idle { fill: #fde68a; opacity: .45; } .idle-label { fill: #92400e; }
.lane { font-weight: 600; } .slot { fill: #555; }
.timeline text { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; }
.timeline .grid { stroke: #eee; } .vgrid { stroke: #f1f1f1; } .axis, .tick { stroke: #888; }
#error { color: #b91c1c; }
input { width: 90px; }
</style></head>
<body>
<header><h1>laneway</h1>
<label>run <select id="run"></select></label>
<span id="summary"></span><span class="muted" id="updated"></span><span id="error"></span>
</header>
<main>
<section id="next" class="alarm" hidden><h2 id="next-words"></h2>
<p>the way on: <code id="next-step"></code></p></section>
<p id="controller" class="muted" hidden></p>
<section id="needs" class="alarm" hidden><h2>Needs you: lanes that wait for a person</h2>
<table id="needs-list"></table></section>
<section id="unknown" class="alarm" hidden><h2>Unknown outcomes: dispatch halted until
reconciled</h2><div id="unknown-list"></div></section>
<section><h2>Lanes: what runs, and why a lane is idle</h2><table id="lanes"></table></section>
<section id="controls-box" hidden><h2>Controls in force</h2><table id="controls"></table>
</section>
<div class="cols">
<section><h2>Stages</h2><table id="stages"></table></section>
<section><h2>Running attempts</h2><table id="running"></table></section>
</div>
<section><h2>Timeline</h2><div class="timeline-box" id="timeline"></div></section>
<div class="cols">
<section id="explain-box"><h2>Explain a job</h2>
<form id="explain-form"><input id="explain-job" placeholder="job id or ITEM.STAGE" size="22">
<button>explain</button></form><div id="explain"></div></section>
<section id="attempt-box"><h2>Attempt</h2>
<form id="attempt-form"><input id="attempt-id" placeholder="attempt id" inputmode="numeric">
<button>show</button></form><div id="attempt"></div></section>
</div>
<section><h2>Workers</h2><table id="workers"></table></section>
<section id="gpus-box" hidden><h2>GPUs</h2><table id="gpus"></table></section>
<section><h2>Recent events</h2><table id="events"></table></section>
<section><h2>Runs</h2><table id="runs"></table></section>
</main>
<script src="/app.js"></script>
</body></html>
"""

SCRIPT = r"""'use strict';
const POLL_MS = @POLL_MS@, TIMELINE_MS = @TIMELINE_MS@;
const $ = (id) => document.getElementById(id);
function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (k === 'class') node.className = v;
    else if (k === 'onclick') node.addEventListener('click', v);
    else node.setAttribute(k, v);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}
function table(target, headers, rows) {
  const t = $(target);
  t.replaceChildren(el('tr', {}, ...headers.map((h) => el('th', {}, h))),
    ...rows.map((r) => el('tr', {}, ...r.map((c) => el('td', {}, c)))));
}
function dur(s) {
  if (s === null || s === undefined) return '-';
  s = Math.floor(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  return h ? `${h} h ${String(m).padStart(2, '0')} m` : m ? `${m} m ${String(sec).padStart(2, '0')} s` : `${sec} s`;
}
async function get(path) {
  const response = await fetch(path, {credentials: 'same-origin'});
  const body = response.headers.get('Content-Type').startsWith('application/json')
    ? await response.json() : await response.text();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}
// Addresses: the scheme of controller/web_links.py (each name part quoted as Python's
// quote(safe='') quotes it), read back by route().
const part = (v) => encodeURIComponent(String(v)).replace(/[!'()*]/g, (c) => '%' + c.charCodeAt(0).toString(16).toUpperCase());
const runPath = (r) => `/runs/${r}`;
const jobName = (item, stage) => `${part(item)}.${part(stage)}`;
const jobPath = (r, item, stage) => `${runPath(r)}/jobs/${jobName(item, stage)}`;
const jobIdPath = (r, id) => `${runPath(r)}/jobs/${id}`;
const explainPath = (r, job) => `${runPath(r)}/explain/${job}`;
const attemptPath = (id) => `/attempts/${id}`;
const ID = /^[1-9][0-9]{0,18}$/;
function route(path) {
  const p = path.split('/').slice(1);
  if (p.length === 2 && p[0] === 'attempts' && ID.test(p[1])) return {kind: 'attempt', attempt: Number(p[1])};
  if (p.length < 2 || p[0] !== 'runs' || !ID.test(p[1])) return {kind: 'home'};
  const r = Number(p[1]);
  if (p.length === 2) return {kind: 'run', run: r};
  if (p.length === 4 && (p[2] === 'jobs' || p[2] === 'explain')) {
    try { return {kind: p[2] === 'jobs' ? 'job' : 'explain', run: r, job: decodeURIComponent(p[3])}; }
    catch (error) { return {kind: 'home'}; }
  }
  return {kind: 'home'};
}
let run = null;
function go(path) {
  if (path !== location.pathname) history.pushState(null, '', path);
  apply(route(path));
}
function link(path, text) {
  return el('a', {href: path, onclick: (e) => {
    if (e.button !== 0 || e.metaKey || e.ctrlKey || e.shiftKey || e.altKey) return;  // a new tab: the browser's
    e.preventDefault(); go(path);
  }}, String(text));
}
const attemptLink = (id) => link(attemptPath(id), id);
const jobLink = (r, item, stage) => link(jobPath(r, item, stage), `${item}.${stage}`);
const jobIdLink = (r, id) => link(jobIdPath(r, id), id);
const runLink = (r) => link(runPath(r), `run ${r}`);
// A lane needs a person when its next step (advice.next_step) has a command to type.
function needsYou(l) {
  const step = l.next_step;
  return !!step && !!step.command && step.code !== 'done' && step.code !== 'running';
}
function unverified(l, state) {
  return state.running.filter((r) => r.lane === l.lane && r.verified === false)
    .map((r) => r.unverified_because).filter((w, i, all) => all.indexOf(w) === i);
}
function render(state) {
  run = state.run.id;
  $('summary').replaceChildren(runLink(state.run.id), ` (${state.run.name}): ${state.run.state}`);
  $('updated').textContent = ` · updated ${new Date().toLocaleTimeString()}`;
  // The run's one next step (advice.run_next_step), as `laneway status` leads with it.
  const step = state.next_step;
  $('next').hidden = !step;
  $('next').className = step && step.code === 'no_controller' ? 'alarm' : 'warn';
  $('next-words').textContent = step ? step.words : '';
  $('next-step').textContent = step && step.command ? step.command : '';
  $('next-step').parentNode.hidden = !(step && step.command);
  const c = state.controller;
  // A controller that is not running, said as a fact (the banner says when it matters).
  const quiet = !!c && c.state !== 'running' && state.run.state !== 'finished';
  $('controller').hidden = !quiet;
  $('controller').textContent = quiet ? `controller: ${c.words}` : '';
  const lanes = state.lanes.map((l) => ({l, rank: needsYou(l) ? 0 : l.running ? 1 : 2}))
    .sort((a, b) => a.rank - b.rank).map((x) => x.l);
  const needs = lanes.filter((l) => needsYou(l));
  $('needs').hidden = needs.length === 0;
  table('needs-list', ['lane', 'node', 'waiting jobs', 'why', 'what to do'], needs.map((l) => [
    l.lane, l.node, l.ready + l.waiting, l.reason ? l.reason.words : '',
    el('code', {class: 'action'}, l.action || '')]));
  const unknown = state.unknown;
  $('unknown').hidden = unknown.length === 0;
  $('unknown-list').replaceChildren(...unknown.map((u) => el('div', {class: 'unknown-attempt'},
    el('p', {}, el('b', {}, 'attempt '), attemptLink(u.attempt_id), ' ', jobLink(run, u.item, u.stage), ' (job ',
      jobIdLink(run, u.job_id), `): ${u.reason || ''}`),
    el('p', {}, 'evidence: ', el('code', {}, u.evidence || '(no directory)'),
      u.files.length ? ` (${u.files.join(', ')})` : ' (no files)',
      u.supervisor_pid ? ` · supervisor pid ${u.supervisor_pid}` : '',
      u.child_pid ? ` · child pid ${u.child_pid}` : '',
      u.conclusive ? '' : ' · make sure none of its processes still runs before you reconcile'),
    ...(u.conclusive ? [
      el('p', {class: 'conclusive'}, el('b', {}, 'conclusive: '),
        `settles as ${u.conclusive.outcome} — ${u.conclusive.words}`),
      el('pre', {class: 'settle'}, u.conclusive.settle)]
      : [el('pre', {class: 'reconcile'}, u.reconcile)]))));
  table('lanes', ['lane', 'node', 'running', 'ready', 'waiting', 'done', 'now', 'what to do'],
    lanes.map((l) => [l.lane, l.node, l.running, l.ready, l.waiting, l.done,
      l.running && unverified(l, state).length
        ? el('span', {class: 'unverified'}, `${l.running} UNVERIFIED: ${unverified(l, state).join('; ')}`)
        : l.running ? el('span', {class: 'ok'}, `${l.running} running`)
        : l.reason ? el('span', {class: 'idle'}, `idle ${dur(l.idle_seconds)}: ${l.reason.words}`)
        : (l.ready || l.waiting) ? el('span', {class: 'idle'}, `idle ${dur(l.idle_seconds)}`) : 'done',
      l.action ? el('code', {}, l.action) : '']));
  $('controls-box').hidden = state.controls.length === 0;
  table('controls', ['kind', 'scope', 'set by', 'at', 'why'], state.controls.map((c) =>
    [c.kind, c.scope + (c.lane ? ` ${c.lane}` : ''), c.set_by, c.set_at, c.reason]));
  const order = ['succeeded', 'failed', 'skipped', 'cancelled', 'unknown', 'running', 'ready', 'waiting'];
  table('stages', ['stage', 'progress', 'done', 'running', 'ready', 'waiting', 'failed'],
    Object.entries(state.jobs).map(([stage, by]) => {
      const total = Object.values(by).reduce((a, b) => a + b, 0) || 1;
      const done = (by.succeeded || 0) + (by.failed || 0) + (by.skipped || 0) + (by.cancelled || 0);
      const bar = el('span', {class: 'bar', title: JSON.stringify(by)},
        ...order.filter((s) => by[s]).map((s) => {
          const i = el('i', {class: 's-' + s}); i.style.width = (100 * by[s] / total) + '%'; return i; }));
      return [stage, bar, `${done}/${total}`, by.running || 0, by.ready || 0, by.waiting || 0,
        (by.failed || 0) + (by.unknown ? ` (+${by.unknown} unknown)` : '')];
    }));
  // The GPUs it holds (status_model.held_gpus_words says them the same way).
  const held = (gpus) => (gpus || []).map((d) => {
    const name = `GPU ${d.index}` + (d.uuid ? ` (${d.uuid})` : '');
    return d.whole === false ? `a share of ${name}` : name; }).join(', ') || '-';
  table('running', ['attempt', 'job', 'lane', 'node', 'pid', 'elapsed', 'peak RSS', 'GPUs', 'state'],
    state.running.map((r) => [attemptLink(r.attempt_id), jobLink(run, r.item, r.stage), r.lane, r.node, r.pid,
      `${dur(r.elapsed_seconds)} / ${dur(r.timeout_seconds)}`,
      r.peak_rss_mib === null ? '-' : `${r.peak_rss_mib.toFixed(1)} MiB`, held(r.gpus),
      r.verified === false ? el('span', {class: 'unverified'}, `unverified: ${r.unverified_because}`)
        : r.state]));
  table('workers', ['node', 'worker', 'pid', 'host', 'heartbeat', 'slots', 'state'],
    state.workers.map((w) => [w.node, w.worker_id, w.pid, w.host,
      `${dur(Math.max(0, w.heartbeat_age_seconds))} ago`, w.slots,
      w.liveness === 'stale' ? el('span', {class: 'unverified'}, `stale for ${Math.round(w.heartbeat_age_seconds)} s`)
        : w.liveness === 'lost' ? el('span', {class: 'unverified'}, 'lost') : w.liveness]).concat(
    state.no_worker.map((n) => [n.node, '-', '', '', '', '',
      // The command only while a worker is what the run needs next (the banner says what is).
      !state.next_step || state.next_step.code === 'no_worker'
        ? el('code', {}, `no live worker: ${n.start}`)
        : 'no live worker (none is needed before the next step is taken)'])));
  const gpus = (state.nodes || []).flatMap((n) => (n.gpus || []).map((d) => [n.node,
    `GPU ${d.index}`, d.uuid || '-', `${Math.round(d.used_mib)} of ${Math.round(d.total_mib)} MiB`,
    `${Math.round(d.ours_mib || 0)} MiB`, d.described ? `described by ${d.described}` : 'measured']));
  document.getElementById('gpus-box').hidden = gpus.length === 0;
  table('gpus', ['node', 'device', 'uuid', 'used', 'ours', 'figures'], gpus);
  table('events', ['#', 'at', 'kind', 'job', 'attempt', 'actor', 'detail'],
    state.recent_events.slice().reverse().map((e) => [e.id, e.at, e.kind,
      e.job_id ? jobIdLink(run, e.job_id) : '', e.attempt_id ? attemptLink(e.attempt_id) : '', e.actor,
      JSON.stringify(e.detail)]));
}
async function poll() {
  try {
    render(await get('/api/state' + (run ? `?run=${run}` : '')));
    $('error').textContent = '';
  } catch (error) { $('error').textContent = ` · ${error.message}`; }
}
async function timeline() {
  if (run === null) return;
  try {
    const svg = await get(`/api/timeline?run=${run}`);
    const doc = new DOMParser().parseFromString(svg, 'image/svg+xml');
    $('timeline').replaceChildren(document.importNode(doc.documentElement, true));
  } catch (error) { $('timeline').textContent = error.message; }
}
async function runs() {
  const list = await get('/api/runs');
  $('run').replaceChildren(...list.map((r) => el('option', {value: r.id}, `${r.id} ${r.name} (${r.state})`)));
  if (run !== null) $('run').value = run;
  table('runs', ['run', 'name', 'state', 'created', 'finished'], list.map((r) =>
    [runLink(r.id), r.name, r.state, r.created_at || '-', r.finished_at || '-']));
}
function showRun(r) {
  if (r === run) return;
  run = r;
  $('run').value = r;
  poll();
  timeline();
}
async function explain(job, kind) {
  $('explain-job').value = job;
  try {
    const where = run === null ? '' : `&run=${run}`;
    const r = await get(`/api/explain?job=${encodeURIComponent(job)}${where}`);
    if (kind && route(location.pathname).job === job) {  // a job id in the address: its name instead
      const canonical = kind === 'job' ? jobPath(r.run_id, r.item, r.stage) : explainPath(r.run_id, jobName(r.item, r.stage));
      history.replaceState(null, '', canonical);
    }
    showRun(r.run_id);
    const parts = [el('p', {}, 'job ', r.job_id, ' (', jobLink(r.run_id, r.item, r.stage), `, lane ${r.lane}, `,
      runLink(r.run_id), '): ', el('b', {}, r.state))];
    if (r.blocked_by.length) parts.push(el('ul', {}, ...r.blocked_by.map((b) => el('li', {}, `${b.code}: ${b.words}`))));
    if (r.arithmetic) parts.push(el('pre', {}, JSON.stringify(r.arithmetic, null, 1)));
    if (r.attempt) parts.push(el('p', {}, 'attempt ', attemptLink(r.attempt.attempt_id), `: ${r.attempt.state} ${r.attempt.reason || ''}`));
    if (r.last_attempt) parts.push(el('p', {}, 'last attempt ', attemptLink(r.last_attempt.attempt_id), `: ${r.last_attempt.outcome} (exit ${r.last_attempt.exit_code})`));
    if (r.retry) parts.push(el('pre', {}, r.retry.command));
    $('explain').replaceChildren(...parts);
  } catch (error) { $('explain').textContent = error.message; }
}
async function showAttempt(id) {
  $('attempt-id').value = id;
  try {
    const a = await get(`/api/attempt?id=${id}`);
    showRun(a.run_id);
    const mib = (v) => v === null ? 'not measured' : `${v.toFixed(1)} MiB`;
    const parts = [
      el('p', {}, `attempt ${a.attempt_id} (#${a.number}) of job `, jobIdLink(a.run_id, a.job_id), ' ',
        jobLink(a.run_id, a.item, a.stage), ' in ', runLink(a.run_id), ': ',
        el('b', {}, a.outcome || a.state), a.reason ? ` — ${a.reason}` : ''),
      el('p', {}, `node ${a.node}${a.host ? ' (host ' + a.host + ')' : ''} · exit ${a.exit_code ?? '-'}`
        + `${a.exit_signal ? ' signal ' + a.exit_signal : ''} · peak RSS ${mib(a.peak_rss_mib)}`
        + ` · peak GPU ${mib(a.peak_gpu_mib)} · started ${a.started_at || '-'} · settled ${a.settled_at || '-'}`),
      el('p', {}, 'directory ', el('code', {}, a.attempt_dir))];
    for (const [stream, log] of Object.entries(a.logs)) {
      parts.push(el('h3', {}, `${stream} (last lines)`));
      parts.push(log.text === null ? el('p', {class: 'idle'}, log.unavailable) : el('pre', {class: 'log'}, log.text || '(empty)'));
    }
    $('attempt').replaceChildren(...parts);
  } catch (error) { $('attempt').textContent = error.message; }
}
function apply(where) {
  // What the address names: its run selected, and its job or attempt shown.
  if (where.run !== undefined) showRun(where.run);
  if (where.kind === 'job' || where.kind === 'explain') {
    explain(where.job, where.kind);
    $('explain-box').scrollIntoView();
  } else if (where.kind === 'attempt') {
    showAttempt(where.attempt);
    $('attempt-box').scrollIntoView();
  }
}
window.addEventListener('popstate', () => apply(route(location.pathname)));
$('run').addEventListener('change', () => go(runPath(Number($('run').value))));
$('explain-form').addEventListener('submit', (e) => {
  e.preventDefault();
  const job = $('explain-job').value.trim(), dot = job.lastIndexOf('.');
  if (run !== null && (ID.test(job) || (dot > 0 && dot < job.length - 1))) {
    go(explainPath(run, ID.test(job) ? job : jobName(job.slice(0, dot), job.slice(dot + 1))));
  } else explain(job);
});
$('attempt-form').addEventListener('submit', (e) => {
  e.preventDefault();
  const id = $('attempt-id').value.trim();
  if (ID.test(id)) go(attemptPath(id)); else showAttempt(id);
});
(async () => {
  const first = route(location.pathname);
  if (first.run !== undefined) run = first.run;
  await poll();
  await runs().catch(() => {});
  timeline();
  apply(first);
  setInterval(poll, POLL_MS);
  setInterval(timeline, TIMELINE_MS);
  setInterval(() => runs().catch(() => {}), 30000);
})();
""".replace("@POLL_MS@", str(POLL_MS)).replace("@TIMELINE_MS@", str(TIMELINE_MS))
