// The dashboard's refresh: poll /ui/data, update the batch rows in place, redraw the charts.
// Plain browser JavaScript and the vendored uPlot; nothing to build.
(function () {
  "use strict";
  const body = document.body;
  const admin = body.dataset.admin === "true";
  const interval = parseInt(body.dataset.intervalMs || "2000", 10);
  const charts = {};

  function text(value) {
    return value === null || value === undefined ? "" : String(value);
  }
  function rate(r) {
    return r === null || r === undefined ? "–" : r.toFixed(1) + "/s";
  }
  function eta(s) {
    if (s === null || s === undefined) return "–";
    s = Math.round(s);
    const pad = (n) => String(n).padStart(2, "0");
    return s >= 3600
      ? Math.floor(s / 3600) + "h" + pad(Math.floor(s / 60) % 60) + "m"
      : Math.floor(s / 60) + "m" + pad(s % 60) + "s";
  }
  function tokens(n) {
    return n >= 1e6 ? (n / 1e6).toFixed(1) + "M" : n >= 1000 ? (n / 1e3).toFixed(1) + "k" : String(n);
  }
  function cache(b) {
    return tokens(b.cached_tokens) + " of " + tokens(b.prompt_tokens) +
      " (predicted " + tokens(b.shareable_tokens) + ")";
  }
  function done(b) {
    const count = b.completed + b.failed + " / " + b.total;
    if (b.max_total_tokens === null || b.max_total_tokens === undefined) return count;
    return count + " · " + tokens(b.spent_tokens) + " of " + tokens(b.max_total_tokens) + " tokens";
  }
  function cell(row, cls, value) {
    const td = document.createElement("td");
    if (cls) td.className = cls;
    td.textContent = value;
    row.appendChild(td);
    return td;
  }
  function newRow(b) {
    const row = document.createElement("tr");
    row.id = "batch-" + b.id;
    row.dataset.batch = b.id;
    cell(row, "id", b.id);
    if (admin) cell(row, "tenant", b.tenant);
    cell(row, "model-name", text(b.model));
    cell(row, "status", "");
    const progress = cell(row, "", "");
    const bar = document.createElement("div");
    bar.className = "bar";
    const fill = document.createElement("div");
    fill.className = "fill";
    bar.appendChild(fill);
    const pct = document.createElement("span");
    pct.className = "pct";
    progress.appendChild(bar);
    progress.appendChild(pct);
    cell(row, "done", "");
    cell(row, "rate", "");
    cell(row, "cache", "");
    cell(row, "eta", "");
    return row;
  }
  function updateBatches(batches) {
    const tbody = document.querySelector("#batches tbody");
    const keep = new Set();
    batches.forEach((b, i) => {
      let row = document.getElementById("batch-" + b.id);
      if (!row) row = newRow(b);
      if (tbody.children[i] !== row) tbody.insertBefore(row, tbody.children[i] || null);
      keep.add(row);
      const pct = Math.round(1000 * b.progress) / 10;
      row.querySelector(".fill").style.width = pct + "%";
      row.querySelector(".pct").textContent = pct + "%";
      const status = row.querySelector(".status");
      status.textContent = b.status + (b.paused ? " (paused)" : "");
      status.className = "status status-" + b.status;
      row.querySelector(".model-name").textContent = b.model || "–";
      row.querySelector(".done").textContent = done(b);
      row.querySelector(".rate").textContent = rate(b.throughput);
      row.querySelector(".cache").textContent = cache(b);
      row.querySelector(".eta").textContent = eta(b.eta_s) + (b.at_risk ? " (at risk)" : "");
    });
    Array.from(tbody.children).forEach((row) => {
      if (!keep.has(row)) row.remove();
    });
  }
  function chart(id, parent, series, data, height) {
    const width = Math.max(320, Math.min(parent.clientWidth || 600, 900));
    if (!charts[id]) {
      const opts = {
        width: width,
        height: height || 160,
        scales: { x: { time: true } },
        series: [{}].concat(series),
        axes: [{}, { size: 50 }],
      };
      charts[id] = new uPlot(opts, data, parent);
    } else {
      charts[id].setData(data);
    }
  }
  function modelBox(name) {
    const id = "model-" + name.replace(/[^A-Za-z0-9_-]/g, "_");
    let box = document.getElementById(id);
    if (box) return box;
    box = document.createElement("div");
    box.className = "model";
    box.id = id;
    const h = document.createElement("h3");
    h.textContent = name;
    box.appendChild(h);
    const figures = document.createElement("div");
    figures.className = "figures";
    box.appendChild(figures);
    const occ = document.createElement("div");
    occ.className = "chart occupancy";
    box.appendChild(occ);
    const tok = document.createElement("div");
    tok.className = "chart tokens";
    box.appendChild(tok);
    let list = document.querySelector("#models .models");
    if (!list) {
      document.getElementById("models").innerHTML = "";
      list = document.createElement("div");
      list.className = "models";
      document.getElementById("models").appendChild(list);
    }
    list.appendChild(box);
    return box;
  }
  function figure(label, value, cls) {
    return "<div class='" + cls + "'><b>" + value + "</b>" + label + "</div>";
  }
  function updateModels(models) {
    Object.keys(models).sort().forEach((name) => {
      const m = models[name];
      const box = modelBox(name);
      const s = m.series;
      const last = s[3].length ? s[3][s[3].length - 1] : 0;
      const u = m.upstream;
      box.querySelector(".figures").innerHTML = u
        ? figure("dispatch workers", m.workers, "workers") +
          figure("in flight / limit", m.running + " / " + u.limit, "occupancy-now") +
          figure("back-offs", u.backoffs, "backoffs-now") +
          (u.guard_cap === null || u.guard_cap === undefined
            ? ""
            : figure("bulk cap (live traffic first)", u.guard_cap, "guard-now")) +
          figure("tokens/s", last.toFixed(1), "tokens-now")
        : figure("workers", m.workers, "workers") +
          figure("running / max_num_seqs", m.running + " / " + m.max_num_seqs, "occupancy-now") +
          figure("KV cache used", (100 * m.kv_usage).toFixed(1) + "%", "kv-now") +
          figure("tokens/s", last.toFixed(1), "tokens-now");
      chart(
        name + "-occ",
        box.querySelector(".occupancy"),
        [
          { label: "occupancy %", stroke: "#3b82f6", width: 2 },
          { label: "KV usage %", stroke: "#f59e0b", width: 2 },
        ],
        [s[0], s[1], s[2]],
        140
      );
      chart(
        name + "-tok",
        box.querySelector(".tokens"),
        [{ label: "tokens/s", stroke: "#10b981", width: 2, fill: "rgba(16,185,129,.1)" }],
        [s[0], s[3]],
        140
      );
    });
  }
  async function refresh() {
    try {
      const response = await fetch("/ui/data", { credentials: "same-origin", cache: "no-store" });
      if (response.status === 401) {
        window.location = "/ui";
        return;
      }
      const data = await response.json();
      updateBatches(data.batches);
      const t = data.throughput;
      chart(
        "throughput",
        document.getElementById("throughput-chart"),
        [{ label: "requests/s", stroke: "#3b82f6", width: 2, fill: "rgba(59,130,246,.1)" }],
        [t[0], t[1]],
        160
      );
      updateModels(data.models);
      document.getElementById("updated").textContent =
        "updated " + new Date(data.time * 1000).toLocaleTimeString();
    } catch (err) {
      document.getElementById("updated").textContent = "update failed: " + err;
    } finally {
      setTimeout(refresh, interval);
    }
  }
  refresh();
})();
