// Copy a secret shown once to the clipboard.
document.querySelectorAll("[data-copy]").forEach((button) => {
  button.addEventListener("click", async () => {
    const text = document.getElementById(button.dataset.copy).textContent.trim();
    try {
      await navigator.clipboard.writeText(text);
    } catch (err) {  // no clipboard permission (http, old browser): select it for Ctrl+C
      const range = document.createRange();
      range.selectNodeContents(document.getElementById(button.dataset.copy));
      window.getSelection().removeAllRanges();
      window.getSelection().addRange(range);
    }
    document.getElementById("copied").hidden = false;
  });
});
