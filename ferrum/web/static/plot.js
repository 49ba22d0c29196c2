// Small canvas charts for the dashboard: lines, and areas stacked on each other. Each
// series is { label, color, values } with values oldest first; the newest is drawn at the
// right edge, so a chart scrolls left as values arrive.
"use strict";

const Plot = (() => {
  const LEFT = 42, BOTTOM = 6, TOP = 18;

  function setup(canvas) {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    if (canvas.width !== Math.round(w * dpr)) { canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr); }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "11px system-ui, sans-serif";
    return { ctx, w, h };
  }

  // A round upper bound: 1, 2 or 5 times a power of ten.
  function niceMax(value) {
    if (!(value > 0)) return 1;
    const power = Math.pow(10, Math.floor(Math.log10(value)));
    return [1, 2, 5, 10].map((m) => m * power).find((m) => m >= value);
  }

  function axes(g, max, capacity) {
    const { ctx, w, h } = g;
    ctx.strokeStyle = "#e3e6ea";
    ctx.fillStyle = "#68717d";
    for (const f of [0, 0.5, 1]) {
      const y = TOP + (h - TOP - BOTTOM) * (1 - f);
      ctx.beginPath(); ctx.moveTo(LEFT, y); ctx.lineTo(w, y); ctx.stroke();
      ctx.fillText(Ferrum.fmt(max * f), 2, y + 4);
    }
    const x = (i, n) => w - ((n - 1 - i) * (w - LEFT)) / (capacity - 1);
    const y = (v) => TOP + (h - TOP - BOTTOM) * (1 - Math.min(v, max) / max);
    return { x, y };
  }

  function legend(g, series) {
    let x = LEFT;
    for (const s of series) {
      g.ctx.fillStyle = s.color;
      g.ctx.fillRect(x, 4, 10, 10);
      g.ctx.fillStyle = "#1d232b";
      const text = s.label;
      g.ctx.fillText(text, x + 13, 13);
      x += 22 + g.ctx.measureText(text).width;
    }
  }

  function lines(canvas, series, capacity) {
    const g = setup(canvas);
    const max = niceMax(Math.max(0, ...series.flatMap((s) => s.values.filter(Number.isFinite))));
    const { x, y } = axes(g, max, capacity);
    for (const s of series) {
      g.ctx.strokeStyle = s.color;
      g.ctx.lineWidth = 1.8;
      g.ctx.beginPath();
      s.values.forEach((v, i) => {
        if (!Number.isFinite(v)) return;
        if (i === 0 || !Number.isFinite(s.values[i - 1])) g.ctx.moveTo(x(i, s.values.length), y(v));
        else g.ctx.lineTo(x(i, s.values.length), y(v));
      });
      g.ctx.stroke();
    }
    legend(g, series);
  }

  // Series stacked bottom to top in the order given (e.g. running, parked, free).
  function stacked(canvas, series, capacity) {
    const g = setup(canvas);
    const n = Math.max(0, ...series.map((s) => s.values.length));
    const totals = Array.from({ length: n }, (_, i) => series.reduce((t, s) => t + (s.values[i] || 0), 0));
    const max = niceMax(Math.max(0, ...totals));
    const { x, y } = axes(g, max, capacity);
    const base = new Array(n).fill(0);
    for (const s of series) {
      const top = base.map((b, i) => b + (s.values[i] || 0));
      if (n) {
        g.ctx.fillStyle = s.color;
        g.ctx.beginPath();
        top.forEach((v, i) => (i ? g.ctx.lineTo(x(i, n), y(v)) : g.ctx.moveTo(x(i, n), y(v))));
        for (let i = n - 1; i >= 0; i--) g.ctx.lineTo(x(i, n), y(base[i]));
        g.ctx.closePath();
        g.ctx.fill();
      }
      top.forEach((v, i) => { base[i] = v; });
    }
    legend(g, series);
  }

  return { lines, stacked };
})();
