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
