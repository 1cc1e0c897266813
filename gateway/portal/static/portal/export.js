// Poll an export job's progress until it is done or failed.
(function () {
  const box = document.getElementById("export");
  if (!box) return;
  async function poll() {
    const response = await fetch(box.dataset.statusUrl, { credentials: "same-origin" });
    if (!response.ok) return setTimeout(poll, 3000);
    const job = await response.json();
    document.getElementById("export-status").textContent = job.status;
    document.getElementById("export-progress").value = job.progress;
    document.getElementById("export-rows").textContent =
      `${job.rows_done.toLocaleString()} / ${job.rows_total.toLocaleString()} rows`;
    if (job.error) {
      const error = document.getElementById("export-error");
      error.textContent = job.error;
      error.hidden = false;
    }
    if (job.status === "done") document.getElementById("export-download").hidden = false;
    else if (job.status !== "failed") setTimeout(poll, 1000);
  }
  poll();
})();
