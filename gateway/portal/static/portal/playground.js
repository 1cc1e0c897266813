// Playground: POST /v1/chat/completions with stream=true and show the deltas as they arrive.
(function () {
  const $ = (id) => document.getElementById(id);
  const output = $("pg-output"), meta = $("pg-meta");
  let controller = null;

  // The user's one short-lived playground key: the server reuses it until it nears expiry.
  async function useMine() {
    const csrf = document.querySelector("[name=csrfmiddlewaretoken]").value;
    const response = await fetch($("pg-mint").dataset.url, {
      method: "POST", credentials: "same-origin", headers: { "X-CSRFToken": csrf },
    });
    if (!response.ok) { meta.textContent = `Could not get a playground key (HTTP ${response.status}).`; return false; }
    const body = await response.json();
    $("pg-key").value = body.key;
    const until = new Date(body.expires_at).toLocaleTimeString(undefined, { hour: "2-digit", minute: "2-digit", timeZoneName: "short" });
    $("pg-minted").textContent = `Using your playground key ${body.masked}, valid until ${until}.`;
    $("pg-minted").hidden = false;
    return true;
  }
  $("pg-mint").addEventListener("click", useMine);

  const nf = new Intl.NumberFormat();
  function showUsage(rows) {
    const body = $("pg-usage").querySelector("tbody");
    body.replaceChildren();
    for (const [label, value] of rows) {
      const tr = document.createElement("tr"), th = document.createElement("th"), td = document.createElement("td");
      th.textContent = label; td.textContent = value; td.className = "n";
      tr.append(th, td); body.append(tr);
    }
    $("pg-usage").hidden = false;
  }

  $("pg-stop").addEventListener("click", () => controller && controller.abort());

  function handle(event) {
    // One SSE event: "data: {json}" or "data: [DONE]".
    const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("");
    if (!data || data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) { meta.textContent = `Error: ${chunk.error.message}`; return; }
    for (const choice of chunk.choices || []) {
      if (choice.delta && choice.delta.content) output.textContent += choice.delta.content;
      if (choice.finish_reason) meta.dataset.finish = choice.finish_reason;
    }
    if (chunk.usage) meta.dataset.usage = JSON.stringify(chunk.usage);
  }

  $("playground").addEventListener("submit", async (e) => {
    e.preventDefault();
    if (!$("pg-key").value.trim() && !(await useMine())) return;
    output.textContent = ""; meta.textContent = "Waiting for the first token…";
    $("pg-usage").hidden = true; delete meta.dataset.usage; delete meta.dataset.finish;
    controller = new AbortController();
    $("pg-send").disabled = true; $("pg-stop").disabled = false;
    const started = performance.now();
    let first = null, chunks = 0;
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST", signal: controller.signal,
        headers: { "Content-Type": "application/json", Authorization: `Bearer ${$("pg-key").value.trim()}` },
        body: JSON.stringify({
          model: $("pg-model").value, stream: true, stream_options: { include_usage: true },
          max_tokens: parseInt($("pg-max").value, 10) || 64,
          messages: [{ role: "user", content: $("pg-prompt").value }],
        }),
      });
      if (!response.ok) {
        const body = await response.json().catch(() => ({}));
        meta.textContent = `HTTP ${response.status}: ${(body.error && body.error.message) || response.statusText}`;
        return;
      }
      const reader = response.body.getReader(), decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
          if (first === null) first = performance.now() - started;
          chunks += 1;
          handle(event);
          meta.textContent = `Streaming… ${chunks} events, first after ${Math.round(first)} ms`;
        }
      }
      const total = Math.round(performance.now() - started);
      meta.textContent = `Done in ${nf.format(total)} ms, ${chunks} events, first token after ${nf.format(Math.round(first || 0))} ms, finish: ${meta.dataset.finish || "?"}`;
      const usage = meta.dataset.usage ? JSON.parse(meta.dataset.usage) : {};
      const cached = (usage.prompt_tokens_details || {}).cached_tokens;
      showUsage([
        ["Prompt tokens", usage.prompt_tokens === undefined ? "–" : nf.format(usage.prompt_tokens)],
        ["Cached prompt tokens", cached === undefined ? "–" : nf.format(cached)],
        ["Completion tokens", usage.completion_tokens === undefined ? "–" : nf.format(usage.completion_tokens)],
        ["Total tokens", usage.total_tokens === undefined ? "–" : nf.format(usage.total_tokens)],
        ["Time to first token", `${nf.format(Math.round(first || 0))} ms`],
        ["Total time", `${nf.format(total)} ms`],
        ["Events", nf.format(chunks)],
        ["Finish reason", meta.dataset.finish || "?"],
      ]);
    } catch (err) {
      meta.textContent = err.name === "AbortError" ? "Stopped." : `Error: ${err.message}`;
    } finally {
      $("pg-send").disabled = false; $("pg-stop").disabled = true;
    }
  });
})();
