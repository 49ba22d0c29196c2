// The dashboard: /metrics (Prometheus text), /props per model and /slots, polled; rates and
// latency percentiles are worked out here from the counters and histograms between polls.
// Behind `ferrum cluster` every sample carries a `replica` label and /props a `replicas`
// list: each model gets a section per replica (the picker shows one replica or all).
"use strict";

const POLL_MS = 1500;
const KEEP = 120; // points per chart: three minutes
const COLORS = { a: "#b5471b", b: "#2f6db5", c: "#3c9a5f", d: "#8e5bb5", free: "#e3e6ea" };
const history = {}; // section key -> { series name -> values }
let previous = null; // { t, samples } of the last poll
let picked = ""; // the replica shown ("": all of them)

function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    for (const l of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
    samples.push({ name: m[1], labels, value: parseFloat(m[3]) });
  }
  return samples;
}

// A source is one model on one server: { model, replica } (replica undefined on `ferrum serve`).
const mine = (s, src) => s.labels.model === src.model && s.labels.replica === src.replica;

function sum(samples, name, src, labels = {}) {
  let total = 0;
  for (const s of samples) {
    if (s.name !== name || !mine(s, src)) continue;
    if (Object.entries(labels).every(([k, v]) => s.labels[k] === v)) total += s.value;
  }
  return total;
}

function total(samples, name) {
  return samples.filter((s) => s.name === name).reduce((t, s) => t + s.value, 0);
}

// A counter's rate per second since the previous poll.
function rate(now, name, src, dt, labels = {}) {
  if (!previous || dt <= 0) return null;
  return Math.max(0, sum(now, name, src, labels) - sum(previous.samples, name, src, labels)) / dt;
}

// The q-quantile of a histogram's observations since the previous poll (all of them when
// none came since), interpolated inside its bucket as Prometheus's histogram_quantile does.
function quantile(now, name, src, q) {
  const buckets = (samples) => samples.filter((s) => s.name === name + "_bucket" && mine(s, src))
    .map((s) => ({ le: s.labels.le === "+Inf" ? Infinity : parseFloat(s.labels.le), n: s.value }))
    .sort((a, b) => a.le - b.le);
  let cur = buckets(now);
  if (previous) {
    const old = buckets(previous.samples);
    const delta = cur.map((b, i) => ({ le: b.le, n: b.n - (old[i] ? old[i].n : 0) }));
    if (delta.length && delta[delta.length - 1].n > 0) cur = delta;
  }
  const total = cur.length ? cur[cur.length - 1].n : 0;
  if (!total) return null;
  let below = 0, lower = 0;
  for (const b of cur) {
    if (b.n >= q * total) {
      if (b.le === Infinity) return lower;
      return lower + ((b.le - lower) * (q * total - below)) / Math.max(b.n - below, 1e-9);
    }
    below = b.n;
    lower = b.le;
  }
  return lower;
}

// Turn-taking: the share of the time an engine held the cores, or waited for another's turn.
function turns(samples, src, dt) {
  const share = (name, engine) => rate(samples, name, src, dt, { engine });
  return {
    turns_rate: rate(samples, "ferrum_engine_turns_total", src, dt),
    chat_held: share("ferrum_engine_turn_seconds_total", "chat"),
    chat_waited: share("ferrum_engine_turn_wait_seconds_total", "chat"),
    emb_held: share("ferrum_engine_turn_seconds_total", "embeddings"),
    emb_waited: share("ferrum_engine_turn_wait_seconds_total", "embeddings"),
  };
}

function figures(samples, src, props, dt) {
  const hits = sum(samples, "ferrum_prefix_cache_hits_total", src);
  const misses = sum(samples, "ferrum_prefix_cache_misses_total", src);
  const drafted = sum(samples, "ferrum_spec_draft_tokens_total", src);
  const kv = props && props.kv;
  const ms = (v) => (v === null ? null : v * 1000);
  return {
    ...turns(samples, src, dt),
    decode_tps: rate(samples, "ferrum_tokens_generated_total", src, dt),
    prefill_tps: rate(samples, "ferrum_prompt_tokens_total", src, dt),
    cached_tps: rate(samples, "ferrum_prefix_cache_saved_tokens_total", src, dt),
    ttft_p50: ms(quantile(samples, "ferrum_time_to_first_token_seconds", src, 0.5)),
    ttft_p99: ms(quantile(samples, "ferrum_time_to_first_token_seconds", src, 0.99)),
    itl_p50: ms(quantile(samples, "ferrum_inter_token_latency_seconds", src, 0.5)),
    itl_p99: ms(quantile(samples, "ferrum_inter_token_latency_seconds", src, 0.99)),
    in_flight: sum(samples, "ferrum_active_requests", src),
    queue: sum(samples, "ferrum_queue_depth", src),
    hit_ratio: hits + misses ? hits / (hits + misses) : null,
    spec_accept: drafted ? sum(samples, "ferrum_spec_accepted_tokens_total", src) / drafted : null,
    ram_bytes: sum(samples, "ferrum_prefix_tier_bytes", src, { tier: "ram" }),
    disk_bytes: sum(samples, "ferrum_prefix_tier_bytes", src, { tier: "disk" }),
    loads: sum(samples, "ferrum_model_loads_total", src),
    unloads: sum(samples, "ferrum_model_unloads_total", src),
    kv_parked: kv ? kv.blocks_parked : null,
    kv_free: kv ? kv.blocks_free : null,
    kv_running: kv ? Math.max(0, kv.blocks_total - kv.blocks_free - kv.blocks_parked) : null,
  };
}

const TILES = [
  ["decode_tps", "decode tok/s"], ["prefill_tps", "prefill tok/s"], ["cached_tps", "cached tok/s"],
  ["ttft_p50", "TTFT p50 ms"], ["ttft_p99", "TTFT p99 ms"], ["itl_p50", "inter-token p50 ms"],
  ["itl_p99", "inter-token p99 ms"], ["in_flight", "running"], ["queue", "queued"],
  ["hit_ratio", "prefix hit ratio"], ["spec_accept", "draft acceptance"], ["ram_bytes", "RAM tier bytes"],
  ["disk_bytes", "disk tier bytes"], ["loads", "loads"], ["unloads", "unloads"],
  ["turns_rate", "engine turns/s"], ["chat_waited", "waiting for cores"],
];
const PERCENT = new Set(["hit_ratio", "spec_accept", "chat_waited"]);

const CHARTS = [
  ["KV blocks", "stacked", [["kv_running", "running", COLORS.a], ["kv_parked", "parked", COLORS.b], ["kv_free", "free", COLORS.free]]],
  ["tokens per second", "lines", [["decode_tps", "decode", COLORS.a], ["prefill_tps", "prefill", COLORS.b], ["cached_tps", "cached", COLORS.c]]],
  ["latency ms", "lines", [["ttft_p50", "TTFT p50", COLORS.a], ["ttft_p99", "TTFT p99", COLORS.d], ["itl_p50", "ITL p50", COLORS.b], ["itl_p99", "ITL p99", COLORS.c]]],
  ["requests", "lines", [["in_flight", "running", COLORS.a], ["queue", "queued", COLORS.b]]],
  ["hits and acceptance", "lines", [["hit_ratio", "prefix hit ratio", COLORS.c], ["spec_accept", "draft acceptance", COLORS.d]]],
  ["saved prefix tiers bytes", "lines", [["ram_bytes", "RAM", COLORS.a], ["disk_bytes", "disk", COLORS.b]]],
  ["engine turns, share of time", "lines", [["chat_held", "chat held", COLORS.a], ["chat_waited", "chat waited", COLORS.d],
    ["emb_held", "embeddings held", COLORS.b], ["emb_waited", "embeddings waited", COLORS.c]]],
  ["loads and unloads", "lines", [["loads", "loads", COLORS.c], ["unloads", "unloads", COLORS.a]]],
];

const keyOf = (src) => src.model + (src.replica ? " @ " + src.replica : "");

function section(src) {
  const id = "model-" + keyOf(src).replace(/[^\w-]/g, "_");
  let node = document.getElementById(id);
  if (node) return node;
  const attrs = { id, class: "model-section", "data-model": src.model };
  if (src.replica) attrs["data-replica"] = src.replica;
  node = Ferrum.el("section", attrs,
    Ferrum.el("h2", { text: src.replica ? `${src.model} · replica ${src.replica}` : src.model }),
    Ferrum.el("div", { class: "tiles" }, ...TILES.map(([key, label]) => Ferrum.el("div", { class: "tile" },
      Ferrum.el("div", { class: "v", "data-k": key, text: "–" }), Ferrum.el("div", { class: "k", text: label })))),
    Ferrum.el("div", { class: "cards" }, ...CHARTS.map(([title]) => Ferrum.el("div", { class: "card" },
      Ferrum.el("h3", { text: title }), Ferrum.el("canvas", { "data-chart": title })))));
  document.getElementById("models").append(node);
  return node;
}

function show(src, fig) {
  const node = section(src);
  node.hidden = !!(picked && src.replica && src.replica !== picked);
  const past = (history[keyOf(src)] = history[keyOf(src)] || {});
  for (const [key, value] of Object.entries(fig)) {
    (past[key] = past[key] || []).push(value === null ? NaN : value);
    if (past[key].length > KEEP) past[key].shift();
  }
  for (const [key] of TILES) {
    const v = fig[key];
    const text = PERCENT.has(key) ? (v === null ? "–" : (v * 100).toFixed(0) + "%") : Ferrum.fmt(v);
    node.querySelector(`[data-k="${key}"]`).textContent = text;
  }
  for (const [title, kind, lines] of CHARTS) {
    const series = lines.map(([key, label, color]) => ({ label, color, values: past[key] || [] }));
    Plot[kind](node.querySelector(`canvas[data-chart="${title}"]`), series, KEEP);
  }
}

function showSlots(slots) {
  const many = slots.some((s) => s.replica);
  document.querySelector('#slots th[data-col="replica"]').hidden = !many;
  const rows = slots.filter((s) => s.state !== "idle" && (!picked || !s.replica || s.replica === picked))
    .map((s) => Ferrum.el("tr", {}, ...[...(many ? [s.replica] : []), s.model, s.id, s.id_task || "(another key's)",
      s.state, s.n_prompt_tokens, s.n_cached_tokens, s.n_computed_tokens, s.next_token.n_decoded,
      s.next_token.n_remain].map((v) => Ferrum.el("td", { text: String(v) }))));
  const cols = many ? "10" : "9";
  if (!rows.length) rows.push(Ferrum.el("tr", {}, Ferrum.el("td", { colspan: cols, text: "nothing running" })));
  document.querySelector("#slots tbody").replaceChildren(...rows);
}

// The replica picker, shown once there is more than one replica to pick from.
function showPicker(replicas) {
  const select = document.getElementById("replica");
  const names = ["", ...replicas];
  if (select.options.length !== names.length || names.some((r, i) => select.options[i].value !== r)) {
    select.replaceChildren(...names.map((r) => Ferrum.el("option", { value: r, text: r ? "replica " + r : "all replicas" })));
    if (!names.includes(picked)) picked = "";
    select.value = picked;
  }
  select.hidden = replicas.length < 2;
}

document.getElementById("replica").addEventListener("change", (ev) => {
  picked = ev.target.value;
  for (const node of document.querySelectorAll("section[data-replica]")) node.hidden = !!picked && node.dataset.replica !== picked;
});

// Each model on each server the samples speak of.
function sources(samples) {
  const found = new Map();
  for (const s of samples) {
    if (!s.labels.model) continue;
    const src = { model: s.labels.model, replica: s.labels.replica };
    found.set(keyOf(src), src);
  }
  return [...found.values()].sort((a, b) => keyOf(a).localeCompare(keyOf(b)));
}

// A model's /props on one replica: the cluster's answer lists each replica's.
function propsOf(answer, replica) {
  if (!answer || !replica || !Array.isArray(answer.replicas)) return answer;
  return answer.replicas.find((p) => p.replica === replica) || null;
}

async function json(path) {
  const response = await Ferrum.api(path);
  if (!response.ok) throw new Error(path + ": " + (await Ferrum.errorText(response)));
  return response.json();
}

async function poll() {
  const t = performance.now() / 1000;
  const response = await Ferrum.api("/metrics");
  if (!response.ok) throw new Error("/metrics: " + (await Ferrum.errorText(response)));
  const samples = parseMetrics(await response.text());
  const models = [...new Set(samples.map((s) => s.labels.model).filter(Boolean))];
  const replicas = [...new Set(samples.map((s) => s.labels.replica).filter(Boolean))].sort();
  showPicker(replicas);
  const answers = await Promise.all(models.map((m) => json("/props?model=" + encodeURIComponent(m)).catch(() => null)));
  const props = Object.fromEntries(models.map((m, i) => [m, answers[i]]));
  const dt = previous ? t - previous.t : 0;
  for (const src of sources(samples)) {
    const p = propsOf(props[src.model], src.replica);
    if (!p || p.loaded !== false) show(src, figures(samples, src, p, dt));
  }
  previous = { t, samples };
  const where = replicas.length ? ` on ${replicas.length} replica(s)` : "";
  document.getElementById("status").textContent =
    `${total(samples, "ferrum_models_loaded")} model(s) loaded${where} · updated ${new Date().toLocaleTimeString()}`;
  showSlots(await json("/slots"));
}

async function loop() {
  try {
    await poll();
    document.getElementById("notice").hidden = true;
  } catch (err) {
    document.getElementById("notice").textContent = err.message;
    document.getElementById("notice").hidden = false;
  }
  setTimeout(loop, POLL_MS);
}

loop();
