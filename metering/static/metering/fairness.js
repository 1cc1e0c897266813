// The admin fairness page (metering/admin_fairness.py): bar charts of service share against
// weighted share, and each tenant's share ratio over time, refreshed from fairness/data/.
(function () {
  const root = document.getElementById("fairness");
  if (!root || typeof Chart === "undefined") return;
  const charts = {};  // pool -> {shares, ratios}
  const colours = ["#2f6fb0", "#d9822b", "#3a9e5c", "#b5452e", "#7d5ba6", "#8c6d46"];

  function draw(pool) {
    const section = root.querySelector(`section[data-pool="${CSS.escape(pool.pool)}"]`);
    if (!section) return;
    const names = pool.tenants.map((t) => t.tenant);
    let c = charts[pool.pool];
    if (!c) {
      c = charts[pool.pool] = {
        shares: new Chart(section.querySelector("canvas.shares"), {
          type: "bar",
          data: { labels: names, datasets: [
            { label: "service share", data: [], backgroundColor: "#2f6fb0" },
            { label: "weighted share", data: [], backgroundColor: "#c9d6e3" }] },
          options: { maintainAspectRatio: false, animation: false,
                     scales: { y: { min: 0, max: 1 } } },
        }),
        ratios: new Chart(section.querySelector("canvas.ratios"), {
          type: "line", data: { labels: [], datasets: [] },
          options: { maintainAspectRatio: false, animation: false,
                     scales: { y: { min: 0, suggestedMax: 1.5 } } },
        }),
      };
    }
    c.shares.data.labels = names;
    c.shares.data.datasets[0].data = pool.tenants.map((t) => t.service_share);
    c.shares.data.datasets[1].data = pool.tenants.map((t) => t.weighted_share);
    c.shares.update();
    const at = new Date().toLocaleTimeString();
    c.ratios.data.labels.push(at);
    pool.tenants.forEach((t, i) => {
      let ds = c.ratios.data.datasets.find((d) => d.label === t.tenant);
      if (!ds) {
        ds = { label: t.tenant, data: c.ratios.data.labels.slice(0, -1).map(() => null),
               borderColor: colours[i % colours.length], pointRadius: 0 };
        c.ratios.data.datasets.push(ds);
      }
      ds.data.push(t.share_ratio);
    });
    c.ratios.data.datasets.forEach((d) => { while (d.data.length < c.ratios.data.labels.length) d.data.push(null); });
    if (c.ratios.data.labels.length > 120) {
      c.ratios.data.labels.shift();
      c.ratios.data.datasets.forEach((d) => d.data.shift());
    }
    c.ratios.update();
    const diff = section.querySelector(".diff");
    if (diff) diff.textContent = pool.max_service_diff;
  }

  function render(data) { data.pools.forEach(draw); }
  render(JSON.parse(document.getElementById("fairness-data").textContent));
  const every = Number(root.dataset.poll) || 5000;
  setInterval(() => {
    fetch(root.dataset.url, { credentials: "same-origin" })
      .then((r) => (r.ok ? r.json() : null)).then((d) => d && render(d)).catch(() => {});
  }, every);
})();
