// The dashboard: /metrics (Prometheus text), /props per model and /slots, polled; rates and
// latency percentiles are worked out here from the counters and histograms between polls.
"use strict";

const POLL_MS = 1500;
const KEEP = 120; // points per chart: three minutes
const COLORS = { a: "#b5471b", b: "#2f6db5", c: "#3c9a5f", d: "#8e5bb5", free: "#e3e6ea" };
const history = {}; // model -> { series name -> values }
let previous = null; // { t, samples } of the last poll

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

function sum(samples, name, model, labels = {}) {
  let total = 0;
  for (const s of samples) {
    if (s.name !== name || s.labels.model !== model) continue;
    if (Object.entries(labels).every(([k, v]) => s.labels[k] === v)) total += s.value;
  }
  return total;
}

// A counter's rate per second since the previous poll.
function rate(now, name, model, dt) {
  if (!previous || dt <= 0) return null;
  return Math.max(0, sum(now, name, model) - sum(previous.samples, name, model)) / dt;
}

// The q-quantile of a histogram's observations since the previous poll (all of them when
// none came since), interpolated inside its bucket as Prometheus's histogram_quantile does.
function quantile(now, name, model, q) {
  const buckets = (samples) => samples.filter((s) => s.name === name + "_bucket" && s.labels.model === model)
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

function figures(samples, model, props, dt) {
  const hits = sum(samples, "ferrum_prefix_cache_hits_total", model);
  const misses = sum(samples, "ferrum_prefix_cache_misses_total", model);
  const drafted = sum(samples, "ferrum_spec_draft_tokens_total", model);
  const kv = props && props.kv;
  const ms = (v) => (v === null ? null : v * 1000);
  return {
    decode_tps: rate(samples, "ferrum_tokens_generated_total", model, dt),
    prefill_tps: rate(samples, "ferrum_prompt_tokens_total", model, dt),
    cached_tps: rate(samples, "ferrum_prefix_cache_saved_tokens_total", model, dt),
    ttft_p50: ms(quantile(samples, "ferrum_time_to_first_token_seconds", model, 0.5)),
    ttft_p99: ms(quantile(samples, "ferrum_time_to_first_token_seconds", model, 0.99)),
    itl_p50: ms(quantile(samples, "ferrum_inter_token_latency_seconds", model, 0.5)),
    itl_p99: ms(quantile(samples, "ferrum_inter_token_latency_seconds", model, 0.99)),
    in_flight: sum(samples, "ferrum_active_requests", model),
    queue: sum(samples, "ferrum_queue_depth", model),
    hit_ratio: hits + misses ? hits / (hits + misses) : null,
    spec_accept: drafted ? sum(samples, "ferrum_spec_accepted_tokens_total", model) / drafted : null,
    ram_bytes: sum(samples, "ferrum_prefix_tier_bytes", model, { tier: "ram" }),
    disk_bytes: sum(samples, "ferrum_prefix_tier_bytes", model, { tier: "disk" }),
    loads: sum(samples, "ferrum_model_loads_total", model),
    unloads: sum(samples, "ferrum_model_unloads_total", model),
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
];

const CHARTS = [
  ["KV blocks", "stacked", [["kv_running", "running", COLORS.a], ["kv_parked", "parked", COLORS.b], ["kv_free", "free", COLORS.free]]],
  ["tokens per second", "lines", [["decode_tps", "decode", COLORS.a], ["prefill_tps", "prefill", COLORS.b], ["cached_tps", "cached", COLORS.c]]],
  ["latency ms", "lines", [["ttft_p50", "TTFT p50", COLORS.a], ["ttft_p99", "TTFT p99", COLORS.d], ["itl_p50", "ITL p50", COLORS.b], ["itl_p99", "ITL p99", COLORS.c]]],
  ["requests", "lines", [["in_flight", "running", COLORS.a], ["queue", "queued", COLORS.b]]],
];

function section(model) {
  const id = "model-" + model.replace(/[^\w-]/g, "_");
  let node = document.getElementById(id);
  if (node) return node;
  node = Ferrum.el("section", { id, class: "model-section", "data-model": model },
    Ferrum.el("h2", { text: model }),
    Ferrum.el("div", { class: "tiles" }, ...TILES.map(([key, label]) => Ferrum.el("div", { class: "tile" },
      Ferrum.el("div", { class: "v", "data-k": key, text: "–" }), Ferrum.el("div", { class: "k", text: label })))),
    Ferrum.el("div", { class: "cards" }, ...CHARTS.map(([title]) => Ferrum.el("div", { class: "card" },
      Ferrum.el("h3", { text: title }), Ferrum.el("canvas", { "data-chart": title })))));
  document.getElementById("models").append(node);
  return node;
}

function show(model, fig) {
  const node = section(model);
  const past = (history[model] = history[model] || {});
  for (const [key, value] of Object.entries(fig)) {
    (past[key] = past[key] || []).push(value === null ? NaN : value);
    if (past[key].length > KEEP) past[key].shift();
  }
  for (const [key] of TILES) {
    const v = fig[key];
    const text = key.endsWith("ratio") || key === "spec_accept" ? (v === null ? "–" : (v * 100).toFixed(0) + "%") : Ferrum.fmt(v);
    node.querySelector(`[data-k="${key}"]`).textContent = text;
  }
  for (const [title, kind, lines] of CHARTS) {
    const series = lines.map(([key, label, color]) => ({ label, color, values: past[key] || [] }));
    Plot[kind](node.querySelector(`canvas[data-chart="${title}"]`), series, KEEP);
  }
}

function showSlots(slots) {
  const rows = slots.filter((s) => s.state !== "idle").map((s) => Ferrum.el("tr", {},
    ...[s.model, s.id, s.id_task || "(another key's)", s.state, s.n_prompt_tokens, s.n_cached_tokens,
      s.n_computed_tokens, s.next_token.n_decoded, s.next_token.n_remain].map((v) => Ferrum.el("td", { text: String(v) }))));
  if (!rows.length) rows.push(Ferrum.el("tr", {}, Ferrum.el("td", { colspan: "9", text: "nothing running" })));
  document.querySelector("#slots tbody").replaceChildren(...rows);
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
  const props = await Promise.all(models.map((m) => json("/props?model=" + encodeURIComponent(m)).catch(() => null)));
  const dt = previous ? t - previous.t : 0;
  models.forEach((m, i) => { if (!props[i] || props[i].loaded !== false) show(m, figures(samples, m, props[i], dt)); });
  previous = { t, samples };
  document.getElementById("status").textContent =
    `${sum(samples, "ferrum_models_loaded", undefined)} model(s) loaded · updated ${new Date().toLocaleTimeString()}`;
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
