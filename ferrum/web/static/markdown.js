// Markdown to DOM nodes. Model output is text: every piece of it reaches the page through
// textContent or a text node, never as HTML, and a link is made only for an http(s) address
// (anything else, javascript: included, stays the text it was). Covers what chat answers
// use: fenced code, headings, lists, quotes, rules, paragraphs; `code`, **bold**, *em*, links.
"use strict";

const Markdown = (() => {
  const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*|\[([^\]]+)\]\(([^)\s]+)\)/g;

  function safeUrl(text) {
    try {
      const url = new URL(text);
      return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
    } catch (_) {
      return null;
    }
  }

  function inline(text, parent) {
    let last = 0;
    for (const m of text.matchAll(INLINE)) {
      parent.append(text.slice(last, m.index));
      last = m.index + m[0].length;
      if (m[1]) parent.append(Ferrum.el("code", { text: m[2] }));
      else if (m[3] !== undefined) inline(m[3], parent.appendChild(document.createElement("strong")));
      else if (m[4] !== undefined) inline(m[4], parent.appendChild(document.createElement("em")));
      else {
        const href = safeUrl(m[6]);
        if (href === null) parent.append(m[0]);
        else parent.append(Ferrum.el("a", { href, text: m[5], target: "_blank", rel: "noopener noreferrer" }));
      }
    }
    parent.append(text.slice(last));
  }

  const BLOCK_START = /^\s*(```|~~~|#{1,6}\s|[-*+]\s|\d+[.)]\s|>)/;

  // The code block at lines[i] (a fence); an unclosed one, mid-stream, runs to the end.
  function code(lines, i, root) {
    const fence = lines[i].trim().slice(0, 3);
    const lang = lines[i].trim().slice(3).trim();
    const body = [];
    for (i++; i < lines.length && !lines[i].trim().startsWith(fence); i++) body.push(lines[i]);
    const pre = Ferrum.el("pre", {}, Ferrum.el("code", { text: body.join("\n") }));
    if (lang) pre.dataset.lang = lang;
    root.append(pre);
    return i + 1;
  }

  function list(lines, i, root, ordered) {
    const item = ordered ? /^\s*\d+[.)]\s+(.*)/ : /^\s*[-*+]\s+(.*)/;
    const node = root.appendChild(document.createElement(ordered ? "ol" : "ul"));
    for (; i < lines.length && item.test(lines[i]); i++) {
      inline(lines[i].match(item)[1], node.appendChild(document.createElement("li")));
    }
    return i;
  }

  function block(lines, i, root) {
    const line = lines[i];
    let m;
    if (/^\s*(```|~~~)/.test(line)) return code(lines, i, root);
    if ((m = line.match(/^(#{1,6})\s+(.*)/))) {
      inline(m[2], root.appendChild(document.createElement("h" + Math.min(m[1].length + 2, 6))));
      return i + 1;
    }
    if (/^\s*[-*+]\s+/.test(line) && !/^(\s*[-*_]){3,}\s*$/.test(line)) return list(lines, i, root, false);
    if (/^\s*\d+[.)]\s+/.test(line)) return list(lines, i, root, true);
    if (/^(\s*[-*_]){3,}\s*$/.test(line)) {
      root.append(document.createElement("hr"));
      return i + 1;
    }
    if (line.startsWith(">")) {
      const quoted = [];
      for (; i < lines.length && lines[i].startsWith(">"); i++) quoted.push(lines[i].replace(/^>\s?/, ""));
      render(quoted.join("\n"), root.appendChild(document.createElement("blockquote")));
      return i;
    }
    const para = [line];
    for (i++; i < lines.length && lines[i].trim() && !BLOCK_START.test(lines[i]); i++) para.push(lines[i]);
    inline(para.join("\n"), root.appendChild(document.createElement("p")));
    return i;
  }

  // Replaces root's children with source rendered.
  function render(source, root) {
    root.replaceChildren();
    const lines = source.replace(/\r\n/g, "\n").split("\n");
    let i = 0;
    while (i < lines.length) i = lines[i].trim() ? block(lines, i, root) : i + 1;
    return root;
  }

  return { render, safeUrl };
})();
