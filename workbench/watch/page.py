"""The watch's live page (`GET /watch`): one self-contained HTML file reading `/watch/status` every second.

Owns the page: the upstream, the reference and its state, the measured floor beside the figures
(or the constant tolerance when none was given), totals by verdict and conformance, the
conformance of each minute (bars), the checker's queue, rate and drops, and the latest real
divergences; a click on one opens its tokens beside the reference's. All text goes in through
`textContent` (token texts are the upstream's, never markup). Does not own the data (metrics.py).
"""

from __future__ import annotations

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>workbench watch</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.2em;color:#222}
h1{font-size:1.2em;margin:0 0 .4em}
.row{display:flex;gap:2em;flex-wrap:wrap;margin:.4em 0}
.k{color:#666}
.bad{color:#b00020;font-weight:600}
.ok{color:#1b7f3b}
#bars{display:flex;align-items:flex-end;gap:2px;height:60px;border-bottom:1px solid #ccc;margin:.6em 0}
#bars div{width:8px;background:#1b7f3b}
#bars div.real{background:#b00020}
table{border-collapse:collapse;margin:.4em 0}
td,th{border-bottom:1px solid #eee;padding:2px 8px;text-align:left;font-variant-numeric:tabular-nums}
tr.div{cursor:pointer}
tr.div:hover{background:#f6f6f6}
td.tok{font-family:ui-monospace,monospace;white-space:pre}
tr.v-real td,tr.v-logprob td{background:#fde7ea}
tr.v-near_tie td{background:#fff6d6}
tr.v-floor td{background:#e8f0fe}
</style></head><body>
<h1>workbench watch <span id="upstream" class="k"></span></h1>
<div class="row"><span>reference <b id="reference"></b> (<span id="state"></span>)</span>
<span>sample <b id="sample"></b></span><span>tolerance <b id="tolerance"></b> nats</span></div>
<div class="row"><span>floor <b id="floor"></b></span><span>inside the floor <b id="inside"></b></span>
<span>beyond the floor <b id="beyond"></b></span></div>
<div class="row"><span>conformance <b id="conformance"></b></span><span>requests checked <b id="checked"></b></span>
<span>with a real divergence <b id="real"></b></span><span>positions <span id="positions"></span></span></div>
<div class="row"><span>checker queue <b id="queue"></b></span><span>dropped <b id="dropped"></b></span>
<span>rate <b id="rate"></b> positions/s</span><span>lag <b id="lag"></b> s</span></div>
<div id="notes" class="bad"></div>
<div class="k">conformance by minute (red: a minute with a real divergence)</div><div id="bars"></div>
<h2 style="font-size:1.05em">Latest real divergences</h2>
<table id="latest"><thead><tr><th>time</th><th>request</th><th>pos</th><th>engine</th><th>reference</th><th>gap</th>
<th>trace</th></tr></thead><tbody></tbody></table>
<div id="detail"></div>
<script>
const $ = (id) => document.getElementById(id);
const fmt = (x, d=4) => x === null || x === undefined ? "\\u2014" : Number(x).toPrecision(d);
function cell(tr, text, cls) { const td = document.createElement("td"); td.textContent = text; if (cls) td.className = cls; tr.appendChild(td); return td; }
function show(d) {
  const table = document.createElement("table");
  const head = document.createElement("tr");
  for (const h of ["pos", "engine token", "logprob", "reference argmax", "\\u0394logprob", "floor", "verdict"]) { const th = document.createElement("th"); th.textContent = h; head.appendChild(th); }
  table.appendChild(head);
  for (const t of d.tokens) {
    const tr = document.createElement("tr"); tr.className = "v-" + t.verdict;
    cell(tr, t.position); cell(tr, JSON.stringify(t.engine.text), "tok"); cell(tr, fmt(t.engine.logprob));
    cell(tr, JSON.stringify(t.reference.text), "tok"); cell(tr, fmt(t.delta, 3));
    cell(tr, t.floor === null || t.floor === undefined ? "\\u2014" : fmt(t.floor, 3)); cell(tr, t.verdict);
    table.appendChild(tr);
  }
  const box = $("detail"); box.replaceChildren();
  const h = document.createElement("h3"); h.style.fontSize = "1em";
  h.textContent = `request ${d.req_id}: tokens beside the reference's (open it: workbench tui ${d.trace} --request ${d.req_id})`;
  box.append(h, table);
}
async function tick() {
  let s;
  try { s = await (await fetch("/watch/status")).json(); } catch (e) { $("state").textContent = "proxy unreachable"; return; }
  $("upstream").textContent = s.upstream; $("reference").textContent = s.reference; $("state").textContent = s.reference_state;
  $("sample").textContent = s.sample; $("tolerance").textContent = s.tolerance;
  const f = s.floor;
  $("floor").textContent = f ? `measured at ${(f.source || {}).url || "?"} (${f.positions} positions, ${f.flips} flips): ` +
    `max |\\u0394logprob| ${fmt(f.max_abs, 3)}, flip margin ${fmt(f.max_flip_margin, 3)}; by |logprob| ` +
    f.bands.map((b) => `${b.band} \\u2264${fmt(b.bound, 2)}`).join(" \\u00b7 ")
    : `none measured: constant tolerance ${s.tolerance} nats (workbench floor; watch --floor FILE)`;
  $("inside").textContent = f ? s.totals.positions.floor : "\\u2014";
  $("beyond").textContent = f ? s.totals.beyond_floor : "\\u2014";
  $("conformance").textContent = s.conformance === null ? "\\u2014" : (100 * s.conformance).toFixed(2) + "%";
  $("checked").textContent = s.totals.requests_checked;
  $("real").textContent = s.totals.requests_real; $("real").className = s.totals.requests_real ? "bad" : "ok";
  $("positions").textContent = Object.entries(s.totals.positions).map(([k, v]) => `${k} ${v}`).join(", ");
  $("queue").textContent = `${s.queue.depth}/${s.queue.capacity}`; $("dropped").textContent = s.queue.dropped;
  $("rate").textContent = fmt(s.checker.positions_per_s, 3); $("lag").textContent = fmt(s.checker.lag_s, 3);
  $("notes").textContent = s.notes.join(" \\u2022 ");
  const bars = $("bars"); bars.replaceChildren();
  for (const b of s.over_time.slice(-90)) {
    const n = Object.values(b.positions).reduce((a, c) => a + c, 0);
    const div = document.createElement("div");
    div.style.height = (n ? 60 * b.positions.ok / n : 0) + "px";
    if (b.requests_real) div.className = "real";
    div.title = `${new Date(b.t * 1000).toLocaleTimeString()}: ${b.requests} requests, ${b.requests_real} real` +
      (f ? `, ${b.positions.floor} positions inside the floor` : "");
    bars.appendChild(div);
  }
  const body = $("latest").tBodies[0]; body.replaceChildren();
  for (const d of s.latest_real) {
    const tr = document.createElement("tr"); tr.className = "div"; tr.onclick = () => show(d);
    cell(tr, new Date(d.time * 1000).toLocaleTimeString()); cell(tr, d.req_id); cell(tr, d.position);
    cell(tr, JSON.stringify(d.engine.text), "tok"); cell(tr, JSON.stringify(d.reference.text), "tok");
    cell(tr, fmt(d.reference.gap, 3)); cell(tr, d.trace.split("/").pop());
    body.appendChild(tr);
  }
}
tick(); setInterval(tick, 1000);
</script></body></html>
"""
