// /keys/: the button beside a key shown once copies it. The clipboard API needs a secure
// context (https, or loopback); on plain http from another address the key is selected
// and copied the older way. Without this script the button stays hidden.
for (const button of document.querySelectorAll("button[data-copy]")) {
  const shown = document.getElementById(button.dataset.copy);
  button.hidden = false;
  button.addEventListener("click", async () => {
    const key = shown.textContent.trim();
    let copied = false;
    if (navigator.clipboard && window.isSecureContext) {
      try {
        await navigator.clipboard.writeText(key);
        copied = true;
      } catch (refused) {
        copied = false;
      }
    }
    if (!copied) {
      const range = document.createRange();
      range.selectNodeContents(shown);
      const selection = window.getSelection();
      selection.removeAllRanges();
      selection.addRange(range);
      try {
        copied = document.execCommand("copy");
      } catch (refused) {
        copied = false;
      }
    }
    button.textContent = copied ? "Copied" : "Selected: press Ctrl+C";
  });
}
