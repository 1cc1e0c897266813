// The pool page's live status follows the workers' heartbeats without a reload.
(function () {
  const box = document.getElementById("pool-live-box");
  if (!box) return;
  setInterval(async () => {
    if (document.hidden) return;
    try {
      const response = await fetch(box.dataset.url, { credentials: "same-origin" });
      if (response.ok) box.innerHTML = await response.text();
    } catch (err) { /* the next tick tries again */ }
  }, 5000);
})();
