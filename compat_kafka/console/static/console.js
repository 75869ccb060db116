// The console's own JavaScript: draws the graphs (uPlot) from /api/series every 10 s and
// appends new records to a live tail. Everything else is server-rendered HTML.
(function () {
  "use strict";
  function drawCharts() {
    document.querySelectorAll(".chart[data-series]").forEach(function (el) {
      var spec = el.dataset.series;
      fetch("/api/series?s=" + encodeURIComponent(spec), {credentials: "same-origin"})
        .then(function (r) { return r.json(); })
        .then(function (d) {
          var s = d[spec];
          if (!s || s.t.length < 2) {
            el.innerHTML = "<b>" + el.dataset.title + "</b><div class='empty'>collecting samples (every 10 s)...</div>";
            return;
          }
          el.innerHTML = "";
          var opts = {title: el.dataset.title, width: 410, height: 180,
                      series: [{}, {label: el.dataset.title, stroke: "#4a6fa5", fill: "rgba(74,111,165,0.1)", spanGaps: false}],
                      axes: [{}, {size: 60}]};
          if (window.uPlot) { new window.uPlot(opts, [s.t, s.v], el); }
          el.dataset.points = String(s.t.length);
          el.classList.add("drawn");
        })
        .catch(function () {});
    });
  }
  function esc(t) { var d = document.createElement("div"); d.textContent = t == null ? "" : String(t); return d.innerHTML; }
  function liveTail() {
    var table = document.querySelector("table[data-live]");
    if (!table) { return; }
    var next = parseInt(table.dataset.next, 10);
    function poll() {
      fetch(table.dataset.live + "&live=1&offset=" + next, {credentials: "same-origin"})
        .then(function (r) { return r.json(); })
        .then(function (d) {
          if (d.next !== undefined) { next = d.next; }
          (d.records || []).forEach(function (x) {
            var tr = document.createElement("tr");
            var hs = (x.headers || []).map(function (h) { return esc(h[0]) + "=" + esc(h[1]); }).join("<br>");
            tr.innerHTML = "<td>" + x.offset + "</td><td class='small'>" + esc(x.timestamp) + "</td><td><pre>" + esc(x.key) +
              "</pre></td><td class='small'>" + hs + "</td><td><pre class='" + esc(x.kind) + "'>" + esc(x.value) + "</pre></td>";
            table.appendChild(tr);
            next = x.offset + 1;
          });
          var rows = table.querySelectorAll("tr");
          for (var i = 1; i < rows.length - 500; i++) { rows[i].remove(); }  // a bounded page
        })
        .catch(function () {})
        .finally(function () { setTimeout(poll, 1000); });
    }
    setTimeout(poll, 1000);
  }
  document.addEventListener("DOMContentLoaded", function () {
    drawCharts();
    if (document.querySelector(".chart[data-series]")) { setInterval(drawCharts, 10000); }
    liveTail();
  });
})();
