// Draw the usage dashboard's charts from the JSON the server wrote (gateway/portal/charts.py).
(function () {
  if (typeof Chart === "undefined") return;
  const small = window.matchMedia("(max-width: 600px)").matches;
  Chart.defaults.font.size = small ? 12 : 13;
  Chart.defaults.font.family = "system-ui, sans-serif";

  // Full values (tooltips) with separators and the currency's digits; axis ticks shortened
  // (12K, 1.5M) only where they are large enough for that to lose nothing that matters.
  function formatter(spec, forTicks) {
    const exact = new Intl.NumberFormat(undefined, spec.currency
      ? { minimumFractionDigits: spec.places, maximumFractionDigits: spec.places }
      : { maximumFractionDigits: spec.integer ? 0 : 1 });
    const compact = new Intl.NumberFormat(undefined, { notation: "compact", maximumFractionDigits: 1 });
    // "1 request", "2 requests": the unit is written plural and loses its s for exactly one.
    const suffix = (v) => spec.currency ? " " + spec.currency
      : (!forTicks && spec.unit ? " " + (Math.abs(v) === 1 ? spec.unit.replace(/s$/, "") : spec.unit) : "");
    // One style per axis: compact for every tick once the largest reaches 10,000.
    return (v, i, ticks) => {
      const top = ticks ? Math.max(...ticks.map((t) => Math.abs(t.value))) : Math.abs(v);
      return (forTicks && top >= 10000 ? compact.format(v) : exact.format(v)) + suffix(v);
    };
  }

  // Axis labels are short (a phone fits four); the tooltip's title is the full time with its
  // zone, and a line above the charts names the zone every label is in (the reader's own).
  const zone = Intl.DateTimeFormat().resolvedOptions().timeZone || "UTC";
  const zoneNote = document.getElementById("chart-zone");
  if (zoneNote) zoneNote.textContent = "Times are in your time zone (" + zone + ").";
  function bucketLabel(iso, hourly) {
    const d = new Date(iso);
    if (hourly && small) return d.toLocaleTimeString(undefined, { hour: "2-digit", minute: "2-digit" });
    return hourly
      ? d.toLocaleString(undefined, { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit" })
      : d.toLocaleDateString(undefined, { month: "short", day: "numeric" });
  }
  function fullTime(iso, hourly) {
    const d = new Date(iso);
    return hourly
      ? d.toLocaleString(undefined, { dateStyle: "medium", timeStyle: "short" }) + " " +
        d.toLocaleTimeString(undefined, { timeZoneName: "short" }).split(" ").pop()
      : d.toLocaleDateString(undefined, { dateStyle: "medium" });
  }

  function draw(root) { root.querySelectorAll("figure.chart").forEach((figure) => {
    const node = document.getElementById(figure.id + "-data");
    if (!node) return;
    const spec = JSON.parse(node.textContent);
    const canvas = document.getElementById(spec.id + "-canvas");
    if (!canvas) return;
    const hourly = spec.labels.length > 1 && (new Date(spec.labels[1]) - new Date(spec.labels[0])) < 86400000;
    const full = formatter(spec, false), tick = formatter(spec, true);
    const line = spec.kind === "line";
    new Chart(canvas, {
      type: line ? "line" : "bar",
      data: {
        labels: spec.labels.map((l) => bucketLabel(l, hourly)),
        datasets: spec.datasets.map((d) => ({
          label: d.label, data: d.data, backgroundColor: d.backgroundColor, borderColor: d.borderColor,
          borderWidth: line ? 2 : 0, pointRadius: line ? 2 : 0, spanGaps: false, maxBarThickness: 48,
        })),
      },
      options: {
        responsive: true, maintainAspectRatio: false, animation: false,
        interaction: { mode: "index", intersect: false },
        scales: {
          x: { stacked: !line, ticks: { autoSkip: true, autoSkipPadding: 12, maxRotation: 0, maxTicksLimit: small ? 4 : 12 }, grid: { display: false } },
          y: {
            stacked: !line, beginAtZero: true,
            // The unit on the axis (ms for TTFT); money ticks carry their currency already.
            title: { display: Boolean(spec.unit) && !spec.currency, text: spec.unit },
            ticks: {
              // Counts never show "0.5 requests": integer steps only; money steps in minor units.
              precision: spec.integer ? 0 : spec.places,
              maxTicksLimit: 6,
              callback: (v, i, ticks) => tick(v, i, ticks),
            },
          },
        },
        plugins: {
          legend: { display: false },  // the list under each chart names the series, with totals
          tooltip: {
            callbacks: {
              title: (items) => items.length ? fullTime(spec.labels[items[0].dataIndex], hourly) : "",
              label: (ctx) => `${ctx.dataset.label}: ${ctx.parsed.y === null ? "–" : full(ctx.parsed.y)}`,
              footer: (items) => {
                if (line || items.length < 2) return "";
                return "Total: " + full(items.reduce((s, i) => s + (i.parsed.y || 0), 0));
              },
            },
          },
        },
      },
    });
  }); }
  draw(document);

  // The page follows new usage without a reload: every 30 s (while visible) the same URL is
  // fetched and the tiles and charts are swapped in; rollups are at most about 30 s behind.
  const form = document.getElementById("usage-filters");
  if (form) {
    const range = form.querySelector("select[name=range]");
    range.addEventListener("change", () => form.querySelectorAll("input[type=date]").forEach((i) => { i.value = ""; }));
  }
  const stamp = document.getElementById("usage-updated");
  async function refresh() {
    if (document.hidden) return;
    const url = new URL(location.href);
    url.searchParams.delete("format");
    const response = await fetch(url, { headers: { "X-Requested-With": "refresh" }, credentials: "same-origin" });
    if (!response.ok) return;
    const next = new DOMParser().parseFromString(await response.text(), "text/html");
    for (const id of ["range-totals", "usage-charts"]) {
      const now = document.getElementById(id), fresh = next.getElementById(id);
      if (!now || !fresh) return;
      if (id === "usage-charts") now.querySelectorAll("canvas").forEach((c) => { const ch = Chart.getChart(c); if (ch) ch.destroy(); });
      now.replaceWith(document.adoptNode(fresh));
    }
    draw(document.getElementById("usage-charts"));
    if (stamp) stamp.textContent = "Updated " + new Date().toLocaleTimeString(undefined, { timeZoneName: "short" });
  }
  if (stamp) setInterval(() => { refresh().catch(() => {}); }, 30000);
  window.portalRefreshUsage = refresh;  // the browser tests call it instead of waiting
})();
