// Playground: POST /v1/chat/completions with stream=true and show the deltas as they arrive.
(function () {
  const $ = (id) => document.getElementById(id);
  const output = $("pg-output"), meta = $("pg-meta");
  let controller = null;

  $("pg-mint").addEventListener("click", async () => {
    const csrf = document.querySelector("[name=csrfmiddlewaretoken]").value;
    const response = await fetch($("pg-mint").dataset.url, {
      method: "POST", credentials: "same-origin", headers: { "X-CSRFToken": csrf },
    });
    if (!response.ok) { meta.textContent = `Could not create a key (HTTP ${response.status}).`; return; }
    const body = await response.json();
    $("pg-key").value = body.key;
    $("pg-minted").textContent = `Using ${body.masked}, valid until ${body.expires_at}.`;
    $("pg-minted").hidden = false;
  });

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
    output.textContent = ""; meta.textContent = "Waiting for the first token…";
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
      const usage = meta.dataset.usage ? ` · usage ${meta.dataset.usage}` : "";
      meta.textContent = `Done in ${Math.round(performance.now() - started)} ms, ${chunks} events, first token after ${Math.round(first || 0)} ms, finish: ${meta.dataset.finish || "?"}${usage}`;
    } catch (err) {
      meta.textContent = err.name === "AbortError" ? "Stopped." : `Error: ${err.message}`;
    } finally {
      $("pg-send").disabled = false; $("pg-stop").disabled = true;
    }
  });
})();
