() => {
  // What the whole page does in the browser (nctv.ui.app.page_script, run once when the page loads).

  // 1. The dataset box keeps what is typed. Gradio's dropdown highlights the first entry that contains
  // the typed text, and Enter picks it: "mnist" became "fashion-mnist" without a word. Enter on typed
  // text that is not the highlighted entry's name leaves the box instead, which keeps the text as typed
  // (the server then checks it, and says at once what it accepts). An entry reached with the arrow keys
  // is still picked by Enter.
  let arrowed = false;
  const datasetInput = (target) => target instanceof HTMLInputElement && target.closest("#dataset-box") !== null;
  const keep = (event) => {
    if (!datasetInput(event.target)) return;
    if (event.type === "keydown" && event.key !== "Enter") {
      arrowed = event.key === "ArrowDown" || event.key === "ArrowUp" || (arrowed && event.key.length > 1);
      return;
    }
    if (event.key !== "Enter" || arrowed) return;
    const typed = event.target.value.trim();
    const entries = [...document.querySelectorAll("#dataset-box ul[role=listbox] li")].map((li) => li.textContent.trim());
    if (!typed || entries.includes(typed)) return;
    event.stopImmediatePropagation();
    event.preventDefault();
    if (event.type === "keydown") event.target.blur();
  };
  window.addEventListener("keydown", keep, true);
  window.addEventListener("keyup", keep, true);

  // 2. A table wider than its box says so (the cue is drawn by the page's styles, nctv.ui.app.APP_CSS):
  // data-overflow="true" while it does not fit, data-scrolled="end" once scrolled to its right end.
  const mark = (box) => {
    const over = box.scrollWidth > box.clientWidth + 1;
    if (box.dataset.overflow !== String(over)) box.dataset.overflow = String(over);
    const end = over && box.scrollLeft + box.clientWidth >= box.scrollWidth - 2 ? "end" : "start";
    if (box.dataset.scrolled !== end) box.dataset.scrolled = end;
  };
  const markAll = () => document.querySelectorAll(".result-table").forEach(mark);
  let pending = false;
  const later = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; markAll(); });
  };
  new MutationObserver(later).observe(document.body, { childList: true, subtree: true, characterData: true,
                                                       attributeFilter: ["class", "style", "hidden"] });
  window.addEventListener("resize", later);
  document.addEventListener("scroll", (e) => {
    if (e.target instanceof Element && e.target.classList.contains("result-table")) mark(e.target);
  }, true);
  markAll();
}
