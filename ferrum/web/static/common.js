// What both pages share: the API key (kept in this browser's localStorage and sent as a
// bearer token), fetch with it, a box that asks for the key when the server answers 401,
// and a small element builder that only ever sets text, never HTML.
"use strict";

const Ferrum = (() => {
  const KEY = "ferrum.apiKey";
  let asking = null;

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (name === "text") node.textContent = value;
      else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else node.setAttribute(name, value);
    }
    node.append(...children.filter((c) => c !== null && c !== undefined));
    return node;
  }

  function keyBox() {
    let box = document.getElementById("key-box");
    if (box) return box;
    box = el("div", { id: "key-box", class: "key-box", hidden: "" },
      el("p", { id: "key-message" }),
      el("input", { id: "key-input", type: "password", placeholder: "API key", autocomplete: "off" }),
      el("button", { id: "key-save", type: "button", text: "Use key" }));
    document.body.append(box);
    return box;
  }

  // Resolves once the user has entered a key; every 401 waiting meanwhile shares one box.
  function askKey(message) {
    if (asking) return asking;
    asking = new Promise((resolve) => {
      const box = keyBox();
      const input = box.querySelector("#key-input");
      document.getElementById("key-message").textContent = message;
      box.hidden = false;
      const done = () => {
        if (!input.value.trim()) return;
        localStorage.setItem(KEY, input.value.trim());
        input.value = "";
        box.hidden = true;
        asking = null;
        resolve();
      };
      box.querySelector("#key-save").onclick = done;
      input.onkeydown = (ev) => { if (ev.key === "Enter") done(); };
      input.focus();
    });
    return asking;
  }

  // fetch with the key; on a 401, asks for a key and tries again with it.
  async function api(path, options = {}) {
    for (;;) {
      const headers = Object.assign({}, options.headers);
      const key = localStorage.getItem(KEY);
      if (key) headers.Authorization = "Bearer " + key;
      const response = await fetch(path, Object.assign({}, options, { headers }));
      if (response.status !== 401) return response;
      await askKey(key ? "That API key was refused: enter another." : "This server needs an API key.");
    }
  }

  // An error body in any of the server's shapes, as one line.
  async function errorText(response) {
    try {
      const body = await response.json();
      const err = body.error;
      return (err && (err.message || err)) || JSON.stringify(body);
    } catch (_) {
      return response.status + " " + response.statusText;
    }
  }

  function fmt(value, digits = 1) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    if (Math.abs(value) >= 1e9) return (value / 1e9).toFixed(digits) + "G";
    if (Math.abs(value) >= 1e6) return (value / 1e6).toFixed(digits) + "M";
    if (Math.abs(value) >= 1e4) return (value / 1e3).toFixed(digits) + "k";
    return Number.isInteger(value) ? String(value) : value.toFixed(digits);
  }

  return { api, askKey, el, errorText, fmt };
})();
