// The Calibrate tab's reliability diagrams (after diagram.js, whose drawing it uses): the server
// computes every number once per result (props.value: per method the bins with their intervals and
// the smoothed curve); the page draws them in the theme's colours at the size of their boxes, and a
// click on a bar asks the server for that group's pictures.
const root = element.querySelector(".nc");
const pick = (sel) => root.querySelector(sel);
const grid = pick("#calibrate-diagrams"), message = pick("#calibrate-message");
const panel = groupPanel(root, "calibrate");
const REFERENCE = "Uncalibrated";
// The opened group: {method, bin}, or null.
let opened = null;

// The key, once: one small swatch per mark.
function legend() {
  pick("#calibrate-legend").innerHTML = diagramKey([["box", "nd-acc", "Share correct"],
    ["box", "nd-gap", "Gap: surer than right"], ["box", "nd-gap nd-gap-under", "Gap: right more often than sure"],
    ["whisker", "nd-whisker", "95% interval"], ["line", "nd-diag", "Honest model"],
    ["line", "nd-curve", "Share correct, smoothed"], ["box", "nd-band", "95% band"], ["box", "nd-hist", "Share of the pictures"]]);
}

function readout(name, metric, value) {
  return `<dt>${name}</dt><dd data-metric="${metric}" data-value="${value}">${pct(value)}</dd>`;
}

function cards(value) {
  grid.style.setProperty("--nc-cols", String(Math.min(value.methods.length, 5)));
  grid.innerHTML = value.methods.map((m, i) => `<figure class="nc-card" data-index="${i}" ` +
    `data-method="${escapeXml(m.name)}"><figcaption><h3>${escapeXml(m.name)}</h3><dl class="nc-read">` +
    readout("ECE", "ece", m.ece) + readout("Smooth ECE", "smooth_ece", m.smooth.ece) +
    readout("Accuracy", "accuracy", m.accuracy) + "</dl></figcaption>" +
    '<div class="nd-plot nc-binned"></div><div class="nd-plot nc-smooth"></div></figure>').join("");
}

function draw() {
  const value = props.value;
  if (!value || !value.methods) return;
  const font = parseFloat(getComputedStyle(root).getPropertyValue("--nd-font")) || 12, m = value.bins;
  for (const card of grid.querySelectorAll(".nc-card")) {
    const d = value.methods[Number(card.dataset.index)], binned = card.querySelector(".nc-binned");
    const smooth = card.querySelector(".nc-smooth");
    if (binned.clientWidth < 50) continue;  // a hidden tab: drawn when it gets a size
    const fill = (a) => a.map((v) => (v === null ? 0 : v));
    binned.innerHTML = binnedSvg({m, n: value.n, counts: d.counts, accuracy: fill(d.bin_accuracy),
                                  confidence: fill(d.bin_confidence), low: d.low, high: d.high}, {
      width: binned.clientWidth, height: binned.clientHeight, font, legend: false,
      opened: opened && opened.method === d.name ? opened.bin : -1,
      label: `${d.name}: reliability diagram, ${m} bins, ECE ${pct(d.ece)}`,
      groupLabel: (b) => `Open the group of ${d.name} of confidence ${binRange(b, m)}: ${count(d.counts[b])} ` +
        `pictures, ${pct(d.bin_accuracy[b], 1)} right`,
    });
    const s = d.smooth;
    smooth.innerHTML = smoothSvg({mesh: s.mesh, accuracy: s.accuracy, density: s.density, low: s.low, high: s.high}, {
      width: smooth.clientWidth, height: smooth.clientHeight, font, legend: false,
      label: `${d.name}: smoothed reliability diagram, smooth ECE ${pct(s.ece)} (bandwidth ${s.bandwidth.toFixed(3)}), ` +
        `${Math.round(100 * s.level)}% band of ${count(s.resamples)} resamples`,
    });
  }
}

function show() {
  closeGroup(false);
  const value = props.value;
  message.textContent = value && value.message ? value.message : "";
  if (!value || !value.methods) {
    grid.replaceChildren();
    return;
  }
  cards(value);
  draw();
}

// Open group b of a method: its header from the server's numbers, its pictures (wrong predictions
// first, then the surest) from the server.
function openGroup(index, b, focus = true) {
  const d = props.value.methods[index], m = props.value.bins;
  opened = {method: d.name, bin: b};
  panel.section.dataset.count = String(d.counts[b]);
  panel.section.dataset.method = d.name;
  const request = panel.open(`${d.name}, confidence ${binRange(b, m)}: ${count(d.counts[b])} pictures, ` +
    `${pct(d.bin_accuracy[b], 1)} right`, focus);
  draw();
  trigger("open_bin", {method: d.name, bin: b, request});
}

function closeGroup(refocus = true) {
  if (!opened) return;
  const {method, bin} = opened;
  opened = null;
  panel.hide();
  draw();
  if (!refocus) return;
  for (const card of grid.querySelectorAll(".nc-card")) {
    if (card.dataset.method !== method) continue;
    const bar = card.querySelector(`.nd-hit[data-bin="${bin}"]`);
    if (bar) bar.focus({preventScroll: true});
  }
}

watch("bin", () => {
  const answer = props.bin;
  if (!panel.accepts(answer)) return;
  const names = [REFERENCE, opened.method];
  panel.note.textContent = "Wrong predictions first, then the surest; " + (opened.method === REFERENCE
    ? "confidence of the model as trained." : `confidence before calibration (${names[0]}) and after (${names[1]}).`);
  panel.list.replaceChildren(...answer.items.map((p) => pictureItem(p, names)));
  panel.more.textContent = answer.count > answer.items.length
    ? `… and ${count(answer.count - answer.items.length)} more in this group.` : "";
});

function target(e) {
  const bar = e.target.closest(".nd-hit"), card = e.target.closest(".nc-card");
  return bar && card ? [Number(card.dataset.index), Number(bar.dataset.bin)] : null;
}
grid.addEventListener("click", (e) => {
  const hit = target(e);
  if (hit) openGroup(...hit);
});
grid.addEventListener("keydown", (e) => {
  const hit = target(e);
  if (hit && (e.key === "Enter" || e.key === " ")) {
    e.preventDefault();
    openGroup(...hit);
  }
});
panel.close.addEventListener("click", () => closeGroup());
root.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && opened) closeGroup();
});

legend();
// Hidden tabs have no size: draw when the boxes get one, and again at each new size.
new ResizeObserver(() => draw()).observe(grid);
show();
watch("value", show);
