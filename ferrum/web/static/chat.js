// The chat page: models from /v1/models, answers streamed from /v1/chat/completions (the
// server-sent events read by hand), conversations kept in this browser's localStorage.
// Images (PNG or JPEG, attached where the chosen model sees) travel as `image_url` parts
// holding data URIs, before the message's text, and are kept with the conversation.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "ferrum.chats";
const SETTINGS = "ferrum.settings";

const saved = JSON.parse(localStorage.getItem(STORE) || "null") || { current: null, chats: [] };
const settings = Object.assign({ model: "", system: "", temperature: 0.7, max_tokens: 512 },
  JSON.parse(localStorage.getItem(SETTINGS) || "{}"));
let running = null; // the AbortController of the answer being streamed
const seeing = new Set(); // the models that take images (capabilities "vision")
let pending = []; // the images attached to the message being written, as data URIs
const IMAGE_URI = /^data:image\/(png|jpeg);base64,[A-Za-z0-9+/]+=*$/;
const MAX_IMAGE_BYTES = 10 * 1024 * 1024; // the server's bound on one image's data URI

function persist() {
  try {
    localStorage.setItem(STORE, JSON.stringify(saved));
    localStorage.setItem(SETTINGS, JSON.stringify(settings));
  } catch (err) { // the browser's storage is full: images take room
    notice("This conversation is too large to keep in the browser (" + err.name + "): delete a chat or export it.");
  }
}

function newChat() {
  const chat = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New chat", messages: [] };
  saved.chats.unshift(chat);
  saved.current = chat.id;
  persist();
  return chat;
}

function current() {
  return saved.chats.find((c) => c.id === saved.current) || newChat();
}

// -- models -------------------------------------------------------------------------------

async function loadModels() {
  const response = await Ferrum.api("/v1/models");
  if (!response.ok) return notice(await Ferrum.errorText(response));
  const models = (await response.json()).data.filter((m) => !(m.meta && m.meta.embedding));
  const select = $("model");
  select.replaceChildren(...models.map((m) =>
    Ferrum.el("option", { value: m.id, text: m.id + (m.loaded ? " (loaded)" : "") })));
  if (!models.some((m) => m.id === settings.model) && models.length) settings.model = models[0].id;
  select.value = settings.model;
  seeing.clear();
  for (const m of models) if ((m.capabilities || []).includes("vision")) seeing.add(m.id);
  showAttach();
}

// -- images -------------------------------------------------------------------------------

// The attach button where the chosen model sees; a model that does not drops what is attached.
function showAttach() {
  const sees = seeing.has(settings.model);
  $("attach").hidden = !sees;
  if (!sees) pending = [];
  renderPending();
}

function readImage(file) {
  return new Promise((resolve, reject) => {
    if (file.type !== "image/png" && file.type !== "image/jpeg") return reject(new Error(file.name + " is not a PNG or JPEG image"));
    const reader = new FileReader();
    reader.onload = () => (reader.result.length > MAX_IMAGE_BYTES
      ? reject(new Error(file.name + " is too large (at most 10 MB)")) : resolve(reader.result));
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attach(files) {
  try {
    for (const file of files) pending.push(await readImage(file));
    notice("");
  } catch (err) {
    notice("Image not attached: " + err.message);
  }
  $("image").value = "";
  renderPending();
}

function thumbs(images, remove) {
  return Ferrum.el("div", { class: "thumbs" }, ...images.map((src, i) => Ferrum.el("span", {},
    Ferrum.el("img", { src, alt: "image " + (i + 1) }),
    remove ? Ferrum.el("button", { type: "button", text: "×", title: "Remove", onclick: () => remove(i) }) : null)));
}

function renderPending() {
  const box = $("attachments");
  box.hidden = !pending.length;
  box.replaceChildren(thumbs(pending, (i) => { pending.splice(i, 1); renderPending(); }));
}

// -- streaming ----------------------------------------------------------------------------

// The JSON events of a server-sent event stream, until [DONE].
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r/g, "");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, cut).split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trim()).join("\n");
      buffer = buffer.slice(cut + 2);
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

function wire(chat) {
  const messages = settings.system ? [{ role: "system", content: settings.system }] : [];
  for (const m of chat.messages) {
    const images = m.images || [];
    if (images.length) {
      const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
      messages.push({ role: m.role, content: [...parts, { type: "text", text: m.content }] });
    } else if (m.content) messages.push({ role: m.role, content: m.content });
  }
  return messages;
}

async function answer(chat) {
  const msg = { role: "assistant", content: "", reasoning: "", model: settings.model, stats: {} };
  const body = {
    model: settings.model, messages: wire(chat), stream: true,
    stream_options: { include_usage: true },
    temperature: Number(settings.temperature), max_tokens: Number(settings.max_tokens),
  };
  chat.messages.push(msg);
  running = new AbortController(); // first: no Edit or Regenerate while it streams
  setBusy(true);
  const view = renderMessages(chat).lastChild;
  const start = performance.now();
  let first = null, pieces = 0, pending = false;
  const paint = () => { pending = false; fillMessage(view, msg, chat); };
  try {
    const response = await Ferrum.api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body), signal: running.signal,
    });
    if (!response.ok) throw new Error(await Ferrum.errorText(response));
    for await (const event of events(response)) {
      if (event.error) throw new Error(event.error.message || String(event.error));
      const delta = (event.choices && event.choices[0] && event.choices[0].delta) || {};
      if (delta.content || delta.reasoning_content) {
        first = first || performance.now();
        pieces++;
        msg.content += delta.content || "";
        msg.reasoning += delta.reasoning_content || "";
      }
      if (event.usage) msg.usage = event.usage;
      const secs = (performance.now() - (first || start)) / 1000;
      msg.stats = { ttft: first && first - start, tokens: pieces, tps: secs > 0 ? pieces / secs : 0, live: true };
      if (!pending) { pending = true; requestAnimationFrame(paint); }
    }
  } catch (err) {
    if (err.name === "AbortError") msg.stopped = true;
    else msg.error = err.message;
  } finally {
    running = null;
    finishStats(msg, start, first);
    persist();
    setBusy(false);
    renderMessages(chat);
  }
}

function finishStats(msg, start, first) {
  const end = performance.now();
  const usage = msg.usage || {};
  const tokens = usage.completion_tokens || msg.stats.tokens || 0;
  const secs = first ? (end - first) / 1000 : 0;
  msg.stats = {
    ttft: first ? first - start : null, tokens,
    tps: secs > 0 ? Math.max(tokens - 1, 0) / secs : null,
    cached: usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : null,
    prompt: usage.prompt_tokens,
  };
  delete msg.usage;
}

// -- rendering ----------------------------------------------------------------------------

function statsText(s) {
  if (!s || s.tokens === undefined) return "";
  const parts = [`${s.tokens} tok`];
  if (s.tps) parts.push(`${s.tps.toFixed(1)} tok/s`);
  if (s.ttft) parts.push(`TTFT ${Math.round(s.ttft)} ms`);
  if (s.prompt !== undefined && s.prompt !== null) parts.push(`prompt ${s.prompt}`);
  if (s.cached !== undefined && s.cached !== null) parts.push(`cached ${s.cached}`);
  return parts.join(" · ");
}

function fillMessage(node, msg, chat) {
  const index = chat.messages.indexOf(msg);
  const last = index === chat.messages.length - 1;
  const parts = [Ferrum.el("div", { class: "role", text: msg.role + (msg.model ? " · " + msg.model : "") })];
  if (msg.reasoning) {
    parts.push(Ferrum.el("details", { class: "reasoning" },
      Ferrum.el("summary", { text: "Reasoning" }), Ferrum.el("pre", { text: msg.reasoning })));
  }
  if (msg.images && msg.images.length) parts.push(thumbs(msg.images));
  parts.push(Markdown.render(msg.content, Ferrum.el("div", { class: "body" })));
  if (msg.error) parts.push(Ferrum.el("p", { class: "error", text: msg.error }));
  const foot = Ferrum.el("div", { class: "foot" },
    Ferrum.el("span", { class: "stats", text: statsText(msg.stats) + (msg.stopped ? " · stopped" : "") }));
  if (!running && msg.role === "user") {
    foot.append(Ferrum.el("button", { type: "button", class: "edit", text: "Edit", onclick: () => edit(chat, index) }));
  }
  if (!running && msg.role === "assistant" && last) {
    foot.append(Ferrum.el("button", { type: "button", class: "regenerate", text: "Regenerate", onclick: () => regenerate(chat) }));
  }
  parts.push(foot);
  node.replaceChildren(...parts);
}

function renderMessages(chat) {
  const box = $("messages");
  box.replaceChildren(...chat.messages.map((m) => {
    const node = Ferrum.el("div", { class: "msg " + m.role });
    fillMessage(node, m, chat);
    return node;
  }));
  box.scrollTop = box.scrollHeight;
  return box;
}

function renderChats() {
  $("chats").replaceChildren(...saved.chats.map((c) => Ferrum.el("li", {},
    Ferrum.el("button", {
      type: "button", text: c.title, class: c.id === saved.current ? "current" : "",
      onclick: () => { if (!running) { saved.current = c.id; persist(); render(); } },
    }))));
}

function render() {
  renderChats();
  renderMessages(current());
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

function notice(text) {
  $("notice").textContent = text;
  $("notice").hidden = !text;
}

// -- actions ------------------------------------------------------------------------------

function send() {
  const text = $("prompt").value.trim();
  if ((!text && !pending.length) || running) return;
  const chat = current();
  if (!chat.messages.length) chat.title = text.slice(0, 40) || "Image";
  const msg = { role: "user", content: text };
  if (pending.length) msg.images = pending;
  chat.messages.push(msg);
  pending = [];
  renderPending();
  $("prompt").value = "";
  renderChats();
  answer(chat);
}

function regenerate(chat) {
  if (running) return;
  if (chat.messages.length && chat.messages[chat.messages.length - 1].role === "assistant") chat.messages.pop();
  answer(chat);
}

// The message goes back to the composer; it and everything after it leave the chat.
function edit(chat, index) {
  if (running) return;
  $("prompt").value = chat.messages[index].content;
  pending = seeing.has(settings.model) ? (chat.messages[index].images || []).slice() : [];
  renderPending();
  chat.messages.splice(index);
  persist();
  renderMessages(chat);
  $("prompt").focus();
}

function exportChats() {
  const blob = new Blob([JSON.stringify(saved.chats, null, 2)], { type: "application/json" });
  const link = Ferrum.el("a", { href: URL.createObjectURL(blob), download: "ferrum-chats.json" });
  link.click();
  URL.revokeObjectURL(link.href);
}

async function importChats(file) {
  try {
    const chats = JSON.parse(await file.text());
    const valid = Array.isArray(chats) && chats.every((c) => c && typeof c.id === "string" && Array.isArray(c.messages));
    if (!valid) throw new Error("not a list of chats");
    const known = new Set(saved.chats.map((c) => c.id));
    saved.chats.unshift(...chats.filter((c) => !known.has(c.id)).map((c) => ({
      id: c.id, title: String(c.title || "Imported"),
      messages: c.messages.filter((m) => m && (m.role === "user" || m.role === "assistant"))
        .map((m) => ({
          role: m.role, content: String(m.content || ""), reasoning: String(m.reasoning || ""), stats: m.stats || {},
          images: Array.isArray(m.images) ? m.images.filter((u) => typeof u === "string" && IMAGE_URI.test(u)) : [],
        })),
    })));
    persist();
    render();
    notice("");
  } catch (err) {
    notice("Import failed: " + err.message);
  }
}

function bind() {
  $("send").onclick = send;
  $("stop").onclick = () => running && running.abort();
  $("prompt").onkeydown = (ev) => { if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); send(); } };
  $("new-chat").onclick = () => { if (!running) { newChat(); render(); } };
  $("delete-chat").onclick = () => {
    if (running) return;
    saved.chats = saved.chats.filter((c) => c.id !== saved.current);
    saved.current = saved.chats.length ? saved.chats[0].id : null;
    persist();
    render();
  };
  $("export").onclick = exportChats;
  $("import").onchange = (ev) => ev.target.files[0] && importChats(ev.target.files[0]);
  $("settings-toggle").onclick = () => { $("settings").hidden = !$("settings").hidden; };
  $("model").onchange = (ev) => { settings.model = ev.target.value; persist(); showAttach(); };
  $("image").onchange = (ev) => attach([...ev.target.files]);
  for (const [id, key] of [["system", "system"], ["temperature", "temperature"], ["max-tokens", "max_tokens"]]) {
    $(id).value = settings[key];
    $(id).oninput = (ev) => { settings[key] = ev.target.value; persist(); };
  }
}

bind();
render();
loadModels().catch((err) => notice("Could not list the models: " + err.message));
