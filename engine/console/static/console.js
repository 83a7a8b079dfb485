// runplane console: keeps a run page live from its server-sent-events stream.
// Pages work without this script; it only updates counters, bars and charts in place.
"use strict";
(function () {
  var root = document.getElementById("live");
  if (!root || !window.EventSource) { return; }
  var BAR = 600, CW = 240, CH = 48;
  var MAP_STATES = JSON.parse(root.getAttribute("data-map-states") || "{}");

  function duration(s) {
    s = Math.floor(s);
    if (s < 60) { return s + "s"; }
    if (s < 3600) { return Math.floor(s / 60) + "m " + String(s % 60).padStart(2, "0") + "s"; }
    return Math.floor(s / 3600) + "h " + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m";
  }
  function set(scope, field, value) {
    var el = scope.querySelector('[data-field="' + field + '"]');
    if (el) { el.textContent = String(value); }
  }
  // This run's bar, as the page draws it (pages.run_bar): completed, cached, failed out of
  // its source rows.
  function bar(section, t) {
    var total = Math.max(t.source_rows, t.admitted, t.completed + t.failed + t.cached + t.blocked,
                         1), x = 0;
    [["completed", t.completed], ["cached", t.cached], ["failed", t.failed]
    ].forEach(function (pair) {
      var rect = section.querySelector('rect[data-seg="' + pair[0] + '"]');
      var w = BAR * pair[1] / total;
      if (rect) { rect.setAttribute("x", x.toFixed(1)); rect.setAttribute("width", w.toFixed(1)); }
      x += w;
    });
  }
  function chart(section, series) {
    var line = section.querySelector("svg.chart polyline");
    if (!line || !series.length) { return; }  // nothing sampled: keep what is drawn
    var top = Math.max.apply(null, series.concat([1])), step = CW / 59, n = series.length;
    line.setAttribute("points", series.map(function (v, i) {
      return (CW - (n - 1 - i) * step).toFixed(1) + "," + (CH - 2 - (CH - 4) * v / top).toFixed(1);
    }).join(" "));
  }
  function sectionFor(name) {
    var all = root.querySelectorAll("section.map");
    for (var i = 0; i < all.length; i++) {
      if (all[i].getAttribute("data-map") === name) { return all[i]; }
    }
    return null;
  }
  var source = new EventSource(root.getAttribute("data-live"));
  source.addEventListener("progress", function (event) {
    var data = JSON.parse(event.data);
    set(root, "state", data.state);
    set(root, "duration", duration(data.duration_s));
    root.setAttribute("data-updated", String(Date.now()));
    data.tables.forEach(function (t) {
      var section = sectionFor(t.table);
      if (!section) { return; }
      ["admitted", "cached", "completed", "failed", "retried"].forEach(function (f) {
        set(section, f, t[f]);
      });
      set(section, "running", t.running === null ? "-" : t.running);
      set(section, "map_state", MAP_STATES[t.map_state] || t.map_state);
      set(section, "rate", t.rate.toFixed(1));
      set(section, "eta", t.eta_s === null ? "-" : duration(t.eta_s));
      bar(section, t);
      chart(section, t.series);
    });
  });
  source.onerror = function () {
    if (source.readyState === EventSource.CLOSED) { root.setAttribute("data-closed", "1"); }
  };
})();

// The runs page: its list kept current from /ui/live/runs (the rows rebuilt with text nodes only).
(function () {
  var root = document.getElementById("runs-list");
  if (!root || !root.hasAttribute("data-live") || !window.EventSource) { return; }
  var FIGURES = ["admitted", "cached", "completed", "failed", "retried"];
  var showOrg = root.getAttribute("data-show-org") === "1";
  var body = root.querySelector("#runs tbody"), none = document.getElementById("no-runs");

  function duration(s) {
    s = Math.floor(s);
    if (s < 60) { return s + "s"; }
    if (s < 3600) { return Math.floor(s / 60) + "m " + String(s % 60).padStart(2, "0") + "s"; }
    return Math.floor(s / 3600) + "h " + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m";
  }
  function started(iso) {
    return new Date(iso).toISOString().replace("T", " ").slice(0, 19) + " UTC";
  }
  function cell(row, text, cls) {
    var td = document.createElement("td");
    if (cls) { td.className = cls; }
    if (text !== null) { td.textContent = String(text); }
    row.appendChild(td);
    return td;
  }
  function line(run) {
    var tr = document.createElement("tr");
    tr.setAttribute("data-run", run.run_id);
    if (showOrg) { cell(tr, run.org); }
    cell(tr, run.play);
    var link = document.createElement("a"), code = document.createElement("code");
    link.href = "/ui/runs/" + encodeURIComponent(run.play) + "/" + encodeURIComponent(run.run_id)
      + (showOrg ? "?org=" + encodeURIComponent(run.org) : "");
    code.textContent = run.run_id;
    link.appendChild(code);
    cell(tr, null).appendChild(link);
    var state = document.createElement("span");
    state.className = "state-" + run.state;
    state.textContent = run.state;
    cell(tr, null).appendChild(state);
    cell(tr, run.epoch, "num");
    cell(tr, started(run.started));
    cell(tr, duration(run.duration_s));
    FIGURES.forEach(function (name) {
      var td = cell(tr, run.figures === null ? "-" : run.figures[name], "num");
      td.setAttribute("data-figure", name);
    });
    return tr;
  }
  var source = new EventSource(root.getAttribute("data-live"));
  source.addEventListener("runs", function (event) {
    var data = JSON.parse(event.data);
    if (!body) { return; }
    while (body.firstChild) { body.removeChild(body.firstChild); }
    data.runs.forEach(function (run) { body.appendChild(line(run)); });
    if (none) { none.hidden = data.runs.length > 0; }
    root.setAttribute("data-updated", String(Date.now()));
  });
  source.onerror = function () {
    if (source.readyState === EventSource.CLOSED) { root.setAttribute("data-closed", "1"); }
  };
})();
