"""The feature browser's two pages: their HTML, CSS and JavaScript, inlined in each.

The pages read their data from ``data/*.js`` files through ``<script src>`` (which works
from ``file://``, where ``fetch`` of a JSON file does not): ``data/table.js`` calls
``iocTable({...})`` with the per-unit columns, and ``data/units-NNNNN.js`` calls
``iocChunk(N, {...})`` with the examples and histograms of one chunk of units. All text
from the data reaches the page through ``textContent`` and ``setAttribute`` only.
"""

from __future__ import annotations

from html import escape

__all__ = ["index_page", "unit_page"]

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#222;
margin:0 auto;padding:12px 20px 40px;max-width:1240px}
h1{font-size:20px;margin:4px 0 2px}h2{font-size:15px;margin:18px 0 6px}
.sub{color:#666}a{color:#3451b2;text-decoration:none}a:hover{text-decoration:underline}
table{border-collapse:collapse}th,td{padding:3px 10px;text-align:right;white-space:nowrap}
th{border-bottom:2px solid #bbb;background:#f4f4f6}tbody tr:nth-child(even){background:#fafafa}
td.l,th.l{text-align:left}th.s{cursor:pointer;user-select:none}th.s:hover{background:#e8e8ee}
tr.dead td{color:#aaa}.bar{margin:8px 0;display:flex;gap:10px;align-items:center;flex-wrap:wrap}
button{font:inherit;padding:2px 10px}input[type=number]{width:6em;font:inherit}
.figs{display:flex;gap:24px;flex-wrap:wrap}figure{margin:0}
figcaption{color:#555;font-size:12px;max-width:560px}
svg text{font:11px system-ui,sans-serif;fill:#444}
.ctx{font:13px/1.9 ui-monospace,Menlo,Consolas,monospace;white-space:pre-wrap;
word-break:break-all;text-align:left}
.t{white-space:pre;border-radius:2px;padding:1px 0}
.t.ex{outline:2px solid #222;font-weight:700}.t.none{color:#bbb}
.tok{font-family:ui-monospace,Menlo,Consolas,monospace;white-space:pre}
#examples td{vertical-align:top;border-bottom:1px solid #eee}.msg{color:#a33}
"""

_COMMON_JS = r"""
"use strict";
var T = null;
var TEXT = {tokens: 1, top: 1, key: 1};  // fields of text, not numbers
function numbers(x, name) {  // +-inf arrive as "inf" and "-inf": JSON has no Infinity
  if (TEXT.hasOwnProperty(name)) return x;
  if (x === "inf") return Infinity;
  if (x === "-inf") return -Infinity;
  if (Array.isArray(x)) { for (var i = 0; i < x.length; i++) x[i] = numbers(x[i], ""); }
  else if (x !== null && typeof x === "object")
    for (var k in x) if (x.hasOwnProperty(k)) x[k] = numbers(x[k], k);
  return x;
}
function iocTable(d) { T = numbers(d, ""); }
function el(tag, attrs, text) {
  var e = document.createElement(tag);
  for (var k in attrs || {}) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  return e;
}
function num(v, digits) {
  if (v === null || v === undefined) return "\u2014";
  var a = Math.abs(v);
  if (v !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(digits - 1);
  return String(Number(v.toPrecision(digits)));
}
function count(n) { return String(n).replace(/\B(?=(\d{3})+(?!\d))/g, ","); }
function shown(text) {  // a token's text with its spaces and line breaks visible
  return text.replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5").replace(/\r/g, "\u240d");
}
function tickLabel(x) { return x === 0 ? "1" : "1e" + x; }
// bars(counts, edges (log10), title of one bar, marker (log10) or null): an inline SVG
function bars(counts, edges, what, marker) {
  // R: room for half the last tick's label ("1e3") right of the axis' end
  var NS = "http://www.w3.org/2000/svg", W = 560, H = 170, L = 44, R = 16, TOP = 10, B = 26;
  var svg = document.createElementNS(NS, "svg");
  svg.setAttribute("width", W); svg.setAttribute("height", H);
  svg.setAttribute("viewBox", "0 0 " + W + " " + H);
  function add(tag, attrs, text) {
    var e = document.createElementNS(NS, tag);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    svg.appendChild(e); return e;
  }
  var lo = edges[0], hi = edges[edges.length - 1], top = Math.max(1, Math.max.apply(null, counts));
  function x(v) { return L + (v - lo) / (hi - lo) * (W - L - R); }
  function y(c) { return H - B - c / top * (H - B - TOP); }
  for (var i = 0; i < counts.length; i++) {
    if (!counts[i]) continue;
    var r = add("rect", {x: x(edges[i]) + 0.5, y: y(counts[i]), fill: "#6c7fd8",
      width: Math.max(1, x(edges[i + 1]) - x(edges[i]) - 1), height: H - B - y(counts[i])});
    var t = document.createElementNS(NS, "title");
    t.textContent = counts[i] + " " + what + " in [1e" + edges[i].toFixed(2) + ", 1e" +
      edges[i + 1].toFixed(2) + ")";
    r.appendChild(t);
  }
  add("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, stroke: "#444"});
  add("line", {x1: L, x2: L, y1: TOP, y2: H - B, stroke: "#444"});
  for (var d = Math.ceil(lo); d <= Math.floor(hi); d++) {
    add("line", {x1: x(d), x2: x(d), y1: H - B, y2: H - B + 4, stroke: "#444"});
    add("text", {x: x(d), y: H - B + 16, "text-anchor": "middle"}, tickLabel(d));
  }
  add("text", {x: L - 4, y: TOP + 8, "text-anchor": "end"}, String(top));
  add("text", {x: L - 4, y: H - B, "text-anchor": "end"}, "0");
  if (marker !== null && marker !== undefined && isFinite(marker)) {
    var m = x(Math.min(hi, Math.max(lo, marker)));
    add("line", {x1: m, x2: m, y1: TOP, y2: H - B, stroke: "#d33", "stroke-width": 2});
    // the label on the side of the line with more room: inside whatever its font's width
    var left = m > (L + W - R) / 2;
    add("text", {x: left ? m - 3 : m + 3, y: TOP + 8, "text-anchor": left ? "end" : "start",
      style: "fill:#d33;paint-order:stroke;stroke:#fff;stroke-width:3px"}, "this unit");
  }
  return svg;
}
function header() {
  return "units " + count(T.units) + " \u00b7 rows " + count(T.rows) +
    " \u00b7 active: value > " + T.threshold + " \u00b7 top " + T.k + " examples, \u00b1" +
    T.window + " tokens";
}
"""

_INDEX_JS = r"""
var PAGE = __PAGE__, order = [], key = "unit", dir = 1, page = 0;
var COLS = {unit: null, density: "density", mean: "mean", max: "max", active: "active"};
function sortBy(k) {
  if (key === k) dir = -dir; else { key = k; dir = k === "unit" ? 1 : -1; }
  history.replaceState(null, "", "#sort=" + key + (dir > 0 ? "&asc" : "&desc"));
  arrange(); page = 0; draw();
}
function fromHash() {  // index.html#sort=max (statistics: largest first), #sort=max&asc
  var m = /sort=(\w+)(&asc|&desc)?/.exec(location.hash);
  if (!m || !COLS.hasOwnProperty(m[1])) return;
  key = m[1]; dir = m[2] ? (m[2] === "&asc" ? 1 : -1) : (key === "unit" ? 1 : -1);
}
function arrange() {
  var hide = document.getElementById("hide").checked;
  order = [];
  for (var u = 0; u < T.units; u++) if (!(hide && T.active[u] === 0)) order.push(u);
  if (key === "unit") { if (dir < 0) order.reverse(); return; }
  var col = T[COLS[key]];
  order.sort(function (a, b) {
    var va = col[a], vb = col[b];
    if (va === null || vb === null) return (va === null) - (vb === null) || a - b;
    return (va < vb ? -1 : va > vb ? 1 : 0) * dir || a - b;
  });
}
function draw() {
  var pages = Math.max(1, Math.ceil(order.length / PAGE));
  page = Math.min(Math.max(0, page), pages - 1);
  var body = document.getElementById("rows");
  body.textContent = "";
  for (var i = page * PAGE; i < Math.min(order.length, (page + 1) * PAGE); i++) {
    var u = order[i], tr = el("tr", T.active[u] === 0 ? {"class": "dead"} : {});
    var a = el("a", {href: "unit.html#u=" + u}, String(u));
    var td = el("td"); td.appendChild(a); tr.appendChild(td);
    tr.appendChild(el("td", {title: String(T.density[u])},
      T.active[u] === 0 ? "dead" : num(T.density[u], 3)));
    tr.appendChild(el("td", {}, count(T.active[u])));
    tr.appendChild(el("td", {title: String(T.mean[u])}, num(T.mean[u], 4)));
    tr.appendChild(el("td", {title: String(T.max[u])}, num(T.max[u], 4)));
    var top = T.top[u];
    tr.appendChild(el("td", {"class": "l tok"}, top === null ? "" : shown(top)));
    body.appendChild(tr);
  }
  document.getElementById("where").textContent = "page " + (page + 1) + " of " + pages +
    " (" + count(order.length) + " units)";
  var ths = document.querySelectorAll("th.s");
  for (var j = 0; j < ths.length; j++) {
    var k = ths[j].getAttribute("data-k");
    ths[j].textContent = ths[j].getAttribute("data-label") +
      (k === key ? (dir > 0 ? " \u25b2" : " \u25bc") : "");
  }
}
function go(delta) { page += delta; draw(); }
document.getElementById("head").textContent = header();
var dead = 0;
for (var u = 0; u < T.units; u++) if (T.active[u] === 0) dead++;
document.getElementById("dead").textContent = count(dead) + " dead units (never active in " +
  count(T.rows) + " rows) are not in the histogram; " + count(T.units - dead) + " are.";
document.getElementById("density").appendChild(
  bars(T.density_counts, T.density_edges, "units with density", null));
fromHash(); arrange(); draw();
"""

_UNIT_JS = r"""
var chunks = {}, current = -1;
function iocChunk(i, d) { chunks[i] = numbers(d, ""); show(); }
function want() {  // the unit of #u=N; 0 without one; -1 for anything not a unit number
  var m = /u=([^&]*)/.exec(location.hash);
  if (!m) return 0;
  return /^\d+$/.test(m[1]) ? parseInt(m[1], 10) : -1;
}
function show() {
  var u = want(), c = Math.floor(u / T.chunk), box = document.getElementById("unit");
  if (u < 0 || u >= T.units) {
    current = -1;  // going back to a unit draws it again
    var asked = (/u=([^&]*)/.exec(location.hash) || ["", ""])[1];
    box.textContent = ""; box.appendChild(el("p", {"class": "msg"},
      "no unit " + asked + ": this layer has units 0 to " + (T.units - 1)));
    return;
  }
  if (!chunks[c]) {
    var name = "data/units-" + ("0000" + c).slice(-5) + ".js";
    if (!document.querySelector('script[src="' + name + '"]')) {
      var script = el("script", {src: name});
      script.onerror = function () { current = -1; box.textContent = "cannot read " + name +
        ": write the browser again (lightning-iocatch browse)"; };
      document.head.appendChild(script);
    }
    return;
  }
  if (u !== current) render(u, chunks[c]);
}
function render(u, chunk) {
  current = u;
  var d = chunk.units[u - chunk.start], box = document.getElementById("unit");
  box.textContent = "";
  var nav = el("div", {"class": "bar"});
  nav.appendChild(el("a", {href: "index.html"}, "\u2190 all units"));
  if (u > 0) nav.appendChild(el("a", {href: "#u=" + (u - 1)}, "\u2039 unit " + (u - 1)));
  if (u + 1 < T.units)
    nav.appendChild(el("a", {href: "#u=" + (u + 1)}, "unit " + (u + 1) + " \u203a"));
  box.appendChild(nav);
  box.appendChild(el("h1", {}, "Unit " + u + (T.key ? " of " + T.key : "")));
  box.appendChild(el("div", {"class": "sub"}, header()));
  var active = T.active[u];
  box.appendChild(el("p", {}, active === 0 ? "Dead: never active in " + count(T.rows) +
    " rows." : "Density " + num(T.density[u], 4) + " (" + count(active) + " of " +
    count(T.rows) + " rows > " + T.threshold + ") \u00b7 mean when active " +
    num(T.mean[u], 5) + " \u00b7 max " + num(T.max[u], 6)));
  var figs = el("div", {"class": "figs"});
  var f1 = el("figure");
  f1.appendChild(bars(d.hist, T.hist_edges, "active values", null));
  f1.appendChild(el("figcaption", {}, "This unit's active values by log10 (values below 1e" +
    T.hist_edges[0] + " are in the first bin, above 1e" + T.hist_edges[T.hist_edges.length - 1] +
    " in the last)."));
  var f2 = el("figure");
  f2.appendChild(bars(T.density_counts, T.density_edges, "units with density",
    active ? Math.log10(T.density[u]) : null));
  f2.appendChild(el("figcaption", {}, "The layer's feature density (units by log10 of the " +
    "fraction of rows they are active on), this unit marked."));
  figs.appendChild(f1); figs.appendChild(f2); box.appendChild(figs);
  box.appendChild(el("h2", {}, "Top " + d.examples.length + " examples" +
    (T.decoded ? "" : " (token ids: no tokenizer given)")));
  if (!d.examples.length) { box.appendChild(el("p", {}, "No example recorded.")); return; }
  var table = el("table", {id: "examples"}), head = el("tr");
  ["#", "value", "index", "position", "context"].forEach(function (h) {
    head.appendChild(el("th", h === "context" ? {"class": "l"} : {}, h)); });
  table.appendChild(head);
  var scale = 0;
  d.examples.forEach(function (e) { e[4].forEach(function (v) {
    if (v !== null) scale = Math.max(scale, Math.abs(v)); }); });
  d.examples.forEach(function (x, rank) {
    var e = {value: x[0], index: x[1], position: x[2], ids: x[3], values: x[4]};
    var tr = el("tr", {"class": "example",
      title: "value " + e.value + ", dataset index " + e.index + ", position " + e.position});
    tr.appendChild(el("td", {}, String(rank + 1)));
    tr.appendChild(el("td", {title: String(e.value)}, num(e.value, 5)));
    tr.appendChild(el("td", {}, String(e.index)));
    tr.appendChild(el("td", {}, e.position < 0 ? "sample" : String(e.position)));
    var ctx = el("td", {"class": "ctx"}, e.ids.length ? undefined : "(no tokens kept: window 0)");
    e.ids.forEach(function (id, j) {
      var v = e.values[j], centre = j === T.window;
      if (id < 0 && !centre) return;
      var text = id < 0 ? "\u2205" : id in chunk.tokens ? chunk.tokens[id] : "[" + id + "]";
      var s = el("span", {"class": "t" + (centre ? " ex" : "") + (id < 0 ? " none" : ""),
        "data-id": String(id), "data-value": v === null ? "" : String(v),
        title: (id < 0 ? "no token id recorded" : "token " + JSON.stringify(text) + " (id " +
          id + ")") + ", value " + (v === null ? "none" : v)}, shown(text));
      if (v !== null && scale > 0) {
        var a = Math.min(1, Math.abs(v) / scale).toFixed(3);
        s.style.background = v >= 0 ? "rgba(255,128,0," + a + ")" : "rgba(40,110,255," + a + ")";
      }
      ctx.appendChild(s);
    });
    tr.appendChild(ctx); table.appendChild(tr);
  });
  box.appendChild(table);
  box.appendChild(el("p", {"class": "sub"}, "Each token is shaded by this unit's value on it, " +
    "relative to the largest shown (orange positive, blue negative); the example's own " +
    "token is outlined. Hover for exact values."));
}
window.addEventListener("hashchange", show);
show();
"""

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title><style>__CSS__</style>
<script>__COMMON__</script><script src="data/table.js"></script>
</head><body>
__BODY__
<script>__JS__</script>
</body></html>
"""

_INDEX_BODY = """<h1>__TITLE__</h1><div class="sub" id="head"></div>
<h2>Feature density</h2>
<figure><div id="density"></div><figcaption id="dead"></figcaption></figure>
<h2>Units</h2>
<div class="bar"><button onclick="go(-1e9)">&laquo;</button><button onclick="go(-1)">&lsaquo;
</button><span id="where"></span><button onclick="go(1)">&rsaquo;</button>
<button onclick="go(1e9)">&raquo;</button>
<label><input type="checkbox" id="hide" onchange="arrange(); page = 0; draw()"> hide dead
</label><label>unit <input type="number" min="0" id="jump" onkeydown="if (event.key ===
'Enter') location.href = 'unit.html#u=' + this.value"></label></div>
<table><thead><tr>
<th class="s" data-k="unit" data-label="unit" onclick="sortBy('unit')">unit</th>
<th class="s" data-k="density" data-label="density" onclick="sortBy('density')">density</th>
<th class="s" data-k="active" data-label="active rows" onclick="sortBy('active')">active rows</th>
<th class="s" data-k="mean" data-label="mean when active" onclick="sortBy('mean')">mean</th>
<th class="s" data-k="max" data-label="max activation" onclick="sortBy('max')">max</th>
<th class="l">top token</th></tr></thead><tbody id="rows"></tbody></table>
<noscript>This page draws its table with JavaScript.</noscript>"""

_UNIT_BODY = """<div id="unit">loading&hellip;</div>
<noscript>This page draws the unit with JavaScript.</noscript>"""


def _page(title: str, body: str, script: str) -> str:
    """One page: the title escaped, CSS and JavaScript inline."""
    parts = {"__CSS__": _CSS, "__COMMON__": _COMMON_JS, "__BODY__": body, "__JS__": script}
    page = _PAGE
    for name, text in parts.items():
        page = page.replace(name, text)
    return page.replace("__TITLE__", escape(title))


def index_page(title: str, page_size: int) -> str:
    """``index.html``: the layer's density histogram and the sortable, paginated table."""
    return _page(title, _INDEX_BODY, _INDEX_JS.replace("__PAGE__", str(page_size)))


def unit_page(title: str) -> str:
    """``unit.html``: one unit at a time (``unit.html#u=N``), its chunk loaded on demand."""
    return _page(title, _UNIT_BODY, _UNIT_JS)
