// The live page: follows /debug/events (SSE) and draws each request's tokens coloured by
// probability, its latency waterfall from arrival to the socket (from the server's stream_end
// stamp) and the batch of each engine step. Plain JS, no build step.
"use strict";

// The API key comes in the URL fragment (/#api_key=KEY), which the browser never sends: it is
// presented once in an Authorization header to get a short-lived session cookie for EventSource.
const apiKey = new URLSearchParams(location.hash.slice(1)).get("api_key");
const KINDS = "request.added,token,request.finished,schedule,forward_batch,forward,stamp";
const MAX_REQUESTS = 30, MAX_TOKENS = 600, MAX_STEPS = 40;
const requests = new Map();  // req_id -> {el, tokens, state}
const steps = new Map();     // step -> row element
let modelName = null;

const $ = (id) => document.getElementById(id);
const esc = (s) => s.replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
const SESSION_RENEW_MS = 240000;  // the server's session cookie lasts 600 s

async function startSession() {
  if (!apiKey) return;
  await fetch("debug/session", {method: "POST", headers: {Authorization: `Bearer ${apiKey}`}});
}

function colour(logprob) {
  const p = logprob == null ? 0 : Math.exp(logprob);
  return `hsl(${Math.round(120 * p)}, 75%, 78%)`;
}

function requestCard(id) {
  let r = requests.get(id);
  if (r) return r;
  const el = document.createElement("div");
  el.className = "req running";
  el.innerHTML = `<div class="head"><b>${esc(id)}</b> <span class="state">running</span>
    <span class="info"></span></div><div class="tokens"></div>`;
  $("requests").prepend(el);
  $("no-requests").style.display = "none";
  r = {el, tokens: el.querySelector(".tokens"), count: 0};
  requests.set(id, r);
  if (requests.size > MAX_REQUESTS) {
    const oldest = requests.keys().next().value;
    requests.get(oldest).el.remove();
    requests.delete(oldest);
  }
  return r;
}

function onToken(ev) {
  const r = requestCard(ev.req_id);
  const p = ev.payload;
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = p.text.replace(/\n/g, "↵\n");
  span.style.background = colour(p.logprob);
  const tops = (p.top_logprobs || []).slice(0, 5).map((t) => `${JSON.stringify(t[2])} ${t[1].toFixed(2)}`);
  span.title = `#${p.position} id ${p.token_id} logprob ${p.logprob == null ? "-inf" : p.logprob.toFixed(3)} ` +
    `rank ${p.rank}\n${tops.join("\n")}`;
  r.tokens.append(span);
  if (++r.count > MAX_TOKENS) r.tokens.firstChild.remove();
}

function onFinished(ev) {
  const r = requestCard(ev.req_id);
  const p = ev.payload;
  r.el.classList.remove("running");
  r.el.querySelector(".state").textContent = `${p.finish_reason}` + (p.matched_stop != null ? ` (${JSON.stringify(p.matched_stop)})` : "");
  const u = p.usage || {};
  const ttft = p.timings && p.timings.ttft != null ? ` · TTFT ${(p.timings.ttft * 1000).toFixed(0)} ms` : "";
  r.el.querySelector(".info").textContent = ` ${u.prompt_tokens || 0} prompt + ${u.completion_tokens || 0} output tokens${ttft}`;
}

// Latency waterfall: one row per frame written, each hand-off a bar (ms after the request's arrival).
// Colours keep blue the strongest channel, apart from the tokens' red-to-green.
const STAGES = [["schedule", "start", "scheduled", "#c7d2fe"], ["forward", "scheduled", "forward_end", "#6366f1"],
  ["sample", "forward_end", "sampled", "#a78bfa"], ["output", "sampled", "output_done", "#818cf8"],
  ["buffered", "first_ready", "ready", "#94a3b8"], ["handoff", "output_done", "ready", "#cbd5e1"],
  ["deliver", "ready", "taken", "#38bdf8"], ["serialize", "taken", "serialized", "#e879f9"],
  ["write", "serialized", "written", "#0ea5e9"]];
const MAX_LAT_ROWS = 40;

function drawWaterfall(r, s) {
  const col = {};
  (s.chunk_columns || []).forEach((name, i) => { col[name] = i; });
  const rows = (s.chunk_rows || []).slice(0, MAX_LAT_ROWS);
  const span = Math.max(1e-6, ...rows.map((row) => row[col.written] || row[col.serialized] || 0));
  const W = 600, H = 7, x = (t) => (W * t / span).toFixed(1);
  let bars = "";
  rows.forEach((row, i) => {
    for (const [stage, a, b, colour] of STAGES) {
      const t0 = row[col[a]], t1 = row[col[b]];
      if (t0 == null || t1 == null || t1 < t0 || (stage === "buffered" && row[col.deltas] < 2)) continue;
      const w = Math.max(0.6, W * (t1 - t0) / span).toFixed(1);
      bars += `<rect x="${x(t0)}" y="${i * H}" width="${w}" height="${H - 1}" fill="${colour}">` +
        `<title>frame ${row[col.seq]} (step ${row[col.step]}, ${row[col.tokens]} token(s)): ${stage} ` +
        `${((t1 - t0) * 1000).toFixed(2)} ms</title></rect>`;
    }
  });
  const ms = (v) => v == null ? "–" : `${(v * 1000).toFixed(1)} ms`;
  const colours = Object.fromEntries(STAGES.map(([stage, , , colour]) => [stage, colour]));
  const shares = Object.entries(s.shares || {}).filter(([, v]) => v >= 0.005).sort((a, b) => b[1] - a[1])
    .map(([k, v]) => `<i style="background:${colours[k] || "#e2e8f0"}"></i>${esc(k)} ${(100 * v).toFixed(0)}%`)
    .join(" ");
  let el = r.el.querySelector(".lat");
  if (!el) { el = document.createElement("div"); el.className = "lat"; r.el.append(el); }
  el.innerHTML = `<div class="dim">socket: first token written ${ms(s.ttft_socket)} · last ${ms(s.e2e_socket)} · ` +
    `${s.chunks} frames${s.coalesced ? ` (${s.coalesced} deltas coalesced)` : ""}` +
    `${s.aborted ? ` · <b class="error">aborted: ${esc(String(s.aborted))}</b>` : ""}<br>${shares}</div>` +
    `<svg viewBox="0 0 ${W} ${Math.max(H, rows.length * H)}" preserveAspectRatio="none" ` +
    `style="height:${Math.max(H, rows.length * H)}px">${bars}</svg>`;
}

function onStamp(ev) {
  const p = ev.payload;
  if (p.stage === "stream_end") drawWaterfall(requestCard(ev.req_id), p.detail || {});
  else if (p.stage === "aborted" && requests.has(ev.req_id)) {
    requests.get(ev.req_id).el.querySelector(".state").textContent = `aborted: ${(p.detail || {}).reason}`;
  }
}

function stepRow(step) {
  let row = steps.get(step);
  if (row) return row;
  row = document.createElement("tr");
  row.innerHTML = `<td>${step}</td><td class="mode"></td><td class="ntok"></td><td class="ms"></td><td class="batch"></td>`;
  $("steps").prepend(row);
  steps.set(step, row);
  if (steps.size > MAX_STEPS) {
    const oldest = steps.keys().next().value;
    steps.get(oldest).remove();
    steps.delete(oldest);
  }
  return row;
}

function onForwardBatch(ev) {
  const p = ev.payload, row = stepRow(ev.step);
  $("g-step").textContent = ev.step;
  row.querySelector(".mode").innerHTML = `<span class="mode-${esc(p.forward_mode)}">${esc(p.forward_mode)}</span>`;
  row.querySelector(".ntok").textContent = p.input_ids.length;
  row.querySelector(".batch").innerHTML = p.req_ids.map((id, i) => {
    const n = p.extend_seq_lens[i];
    return `<span class="chip${n > 1 ? " prefill" : ""}" title="${n} token(s)">${esc(id.slice(-6))}${n > 1 ? "+" + n : ""}</span>`;
  }).join("");
}

function onSchedule(ev) {
  const p = ev.payload;
  $("g-kv").textContent = `${p.kv_used} / ${p.kv_total}`;
  $("g-kvbar").style.width = `${p.kv_total ? (100 * p.kv_used / p.kv_total).toFixed(1) : 0}%`;
}

function onStats(s) {
  $("g-step").textContent = s.step;
  $("g-running").textContent = s.running;
  $("g-waiting").textContent = s.waiting;
  $("g-dropped").textContent = s.dropped;
  onSchedule({payload: s});
}

function connect() {
  const es = new EventSource(`debug/events?kind=${KINDS}`);
  es.onopen = () => { $("status").textContent = "live"; $("status").className = "status live"; };
  es.onerror = () => { $("status").textContent = "disconnected (retrying)"; $("status").className = "status down"; };
  es.onmessage = (msg) => {
    const ev = JSON.parse(msg.data);
    switch (ev.kind) {
      case "server.hello": modelName = ev.model; $("status").title = `model ${ev.model}`; onStats(ev); autorun(); break;
      case "server.stats": onStats(ev); break;
      case "request.added": requestCard(ev.req_id); break;
      case "token": onToken(ev); break;
      case "request.finished": onFinished(ev); break;
      case "forward_batch": onForwardBatch(ev); break;
      case "forward": stepRow(ev.step).querySelector(".ms").textContent = ev.payload.forward_ms.toFixed(1); break;
      case "schedule": onSchedule(ev); break;
      case "stamp": onStamp(ev); break;
    }
  };
}

async function send(prompt, maxTokens, temperature) {
  const answer = $("answer");
  answer.textContent = "";
  answer.classList.remove("error");
  const headers = {"Content-Type": "application/json"};
  if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
  const body = {model: modelName, messages: [{role: "user", content: prompt}], stream: true,
                max_tokens: maxTokens, temperature};
  const res = await fetch("v1/chat/completions", {method: "POST", headers, body: JSON.stringify(body)});
  if (!res.ok) {
    const err = await res.json().catch(() => ({error: {message: res.statusText}}));
    answer.textContent = `${res.status}: ${err.error.message}`;
    answer.classList.add("error");
    return;
  }
  const reader = res.body.getReader(), decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buf += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const line = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = line.replace(/^data: /, "");
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) { answer.textContent += `\n[error] ${chunk.error.message}`; answer.classList.add("error"); continue; }
      for (const c of chunk.choices) if (c.delta && c.delta.content) answer.textContent += c.delta.content;
    }
  }
}

let autoran = false;
function autorun() {  // ?prompt=...&max_tokens=... sends once connected (links, screenshots)
  if (autoran || !params.get("prompt")) return;
  autoran = true;
  send(params.get("prompt"), Number(params.get("max_tokens") || 64), Number(params.get("temperature") || 0));
}

$("try").addEventListener("submit", (e) => {
  e.preventDefault();
  const prompt = $("prompt").value.trim();
  if (prompt) send(prompt, Number($("max-tokens").value), Number($("temperature").value));
});

startSession().finally(connect);
if (apiKey) setInterval(startSession, SESSION_RENEW_MS);
