// The Learn tab in the page: the server sends the test logits once per calibration (props.value);
// every move of T or of the bins is computed and drawn here, without a request. The conventions are
// nctv.metrics': p = softmax(z / T) in float64, confidence = max p, prediction = first argmax,
// equal-width bins ((m-1)/M, m/M] with confidence 0 in the first, ECE = sum |Σacc - Σconf| / N.
const root = element.querySelector(".nl");
const pick = (sel) => root.querySelector(sel);
const range = pick("#learn-t"), box = pick("#learn-t-box"), binsInput = pick("#learn-bins");
const binsOut = pick("#learn-bins-value"), message = pick("#learn-message"), plot = pick("#learn-plot");
const presenter = pick("#learn-presenter"), fitButton = pick("#learn-fit"), note = pick("#learn-note");
const out = {ece: pick("#learn-ece"), accuracy: pick("#learn-accuracy"), confidence: pick("#learn-confidence")};
const binPanel = pick("#learn-bin"), binTitle = pick("#learn-bin-title"), binNote = pick("#learn-bin-note");
const binList = pick("#learn-bin-list"), binMore = pick("#learn-bin-more");
// An opened group lists this many of its pictures (the server accepts up to 200 rows a request).
const BIN_SHOWN = 24;
const T_MIN = Number(range.min), T_MAX = Number(range.max);
let data = null, t = 1, bins = Number(binsInput.value), stats = null;
// The opened group: {bin, m, t, request}, or null.
let opened = null, requests = 0;

function decode(b64, Type) {
  const s = atob(b64), bytes = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) bytes[i] = s.charCodeAt(i);
  return new Type(bytes.buffer);
}

function load(value) {
  if (!value || !value.logits) {
    data = null;
    note.textContent = value ? value.message : "Loading the test logits…";
    return;
  }
  const n = value.n, k = value.k, z = Float64Array.from(decode(value.logits, Float32Array));
  const labels = decode(value.labels, Int32Array), top = new Int32Array(n), correct = new Uint8Array(n);
  for (let i = 0; i < n; i++) {
    let best = 0;
    for (let j = 1; j < k; j++) if (z[i * k + j] > z[i * k + best]) best = j;
    top[i] = best;
    correct[i] = best === labels[i] ? 1 : 0;
  }
  // rows: where each row of a sample lies in the test split (the server's pictures are numbered so).
  const rows = value.rows ? decode(value.rows, Int32Array) : null;
  data = {n, k, z, top, correct, rows, fitted: value.ts_temperature};
  const sample = value.n < value.n_total
    ? `a seeded sample of ${value.n.toLocaleString("en")} of its ${value.n_total.toLocaleString("en")} test pictures`
    : `its ${value.n.toLocaleString("en")} test pictures`;
  note.textContent = `${value.where}: ${sample}. The probabilities are softmax(z / T) of the model's scores z ` +
    "(logits): T > 1 makes them less sure, T < 1 surer; the predicted class never changes.";
}

// The bin of confidence c: the first edge i/M with i/M >= c, minus one (as torch.searchsorted).
function binOf(c, m) {
  let i = Math.ceil(c * m);
  while (i > 0 && (i - 1) / m >= c) i--;
  while (i <= m && i / m < c) i++;
  return Math.min(Math.max(i - 1, 0), m - 1);
}

// The confidence of row i at T: the top class's softmax probability.
function confidenceOf(d, i, temperature) {
  const o = i * d.k, best = d.z[o + d.top[i]] / temperature;
  let s = 0;
  for (let j = 0; j < d.k; j++) s += Math.exp(d.z[o + j] / temperature - best);
  return 1 / s;
}

function compute(d, temperature, m) {
  const counts = new Float64Array(m), sumConf = new Float64Array(m), sumAcc = new Float64Array(m);
  let confTotal = 0, right = 0;
  for (let i = 0; i < d.n; i++) {
    const c = confidenceOf(d, i, temperature), b = binOf(c, m);
    counts[b] += 1;
    sumConf[b] += c;
    sumAcc[b] += d.correct[i];
    confTotal += c;
    right += d.correct[i];
  }
  let gap = 0;
  for (let b = 0; b < m; b++) gap += Math.abs(sumAcc[b] - sumConf[b]);
  return {counts, sumConf, sumAcc, n: d.n, ece: gap / d.n, accuracy: right / d.n, confidence: confTotal / d.n};
}

const pct = (x, digits = 2) => `${(100 * x).toFixed(digits)}%`;
const tText = (x) => (Math.abs(x * 100 - Math.round(x * 100)) < 1e-9 ? x.toFixed(2) : String(Number(x.toFixed(3))));
const edge = (b, m) => String(Number((100 * b / m).toFixed(1)));
const binRange = (b, m) => `${edge(b, m)}–${edge(b + 1, m)}%`;
const count = (x) => x.toLocaleString("en");
// A confidence with two decimals; one that only rounds to 100% says so.
const sure = (c) => (c < 1 && 100 * c >= 99.995 ? ">99.99%" : pct(c));

function readouts() {
  for (const key of ["ece", "accuracy", "confidence"]) {
    out[key].dataset.value = stats ? String(stats[key]) : "";
    out[key].textContent = stats ? pct(stats[key]) : "–";
  }
  root.dataset.temperature = String(t);
  root.dataset.bins = String(bins);
}

function draw() {
  const width = plot.clientWidth, height = plot.clientHeight;
  if (!stats || width < 50 || height < 50) { plot.innerHTML = ""; return; }
  const font = parseFloat(getComputedStyle(root).getPropertyValue("--nl-font")) || 14;
  const legend = [["nl-acc", "Share correct"], ["nl-gap", "Gap to confidence"], ["nl-diag", "Honest model"]];
  // One legend row if it fits (about 0.55 em a character), else one row per entry.
  const legendWidth = legend.reduce((w, [, s]) => w + (s.length * 0.55 + 3) * font, 0);
  const left = font * 4.6, right = font * 1.2;
  const inner = width - left - right;
  const rows = legendWidth <= inner ? 1 : legend.length;
  const top = rows * font * 1.6 + font * 0.6;
  const histH = Math.max(font * 3.5, height * 0.2), between = font * 1.2, bottom = font * 3.6;
  const mainH = height - top - histH - between - bottom;
  const x = (v) => left + v * inner, y = (v) => top + (1 - v) * mainH;
  const hy0 = top + mainH + between, hy = (v) => hy0 + (1 - v) * histH;
  const parts = [];
  const text = (px, py, s, attrs = "") => parts.push(`<text x="${px.toFixed(1)}" y="${py.toFixed(1)}" ${attrs}>${s}</text>`);
  const line = (x1, y1, x2, y2, cls) =>
    parts.push(`<line x1="${x1.toFixed(1)}" y1="${y1.toFixed(1)}" x2="${x2.toFixed(1)}" y2="${y2.toFixed(1)}" class="${cls}"/>`);
  const rect = (x0, y0, w, h, cls) => {
    if (w > 0 && h > 0) parts.push(`<rect x="${x0.toFixed(1)}" y="${y0.toFixed(1)}" width="${w.toFixed(1)}" height="${h.toFixed(1)}" class="${cls}"/>`);
  };
  const yTicks = mainH / 5 >= font * 1.5 ? [0, 0.2, 0.4, 0.6, 0.8, 1] : [0, 0.5, 1];
  for (const v of yTicks) {
    line(x(0), y(v), x(1), y(v), "nl-grid");
    text(x(0) - font * 0.4, y(v) + font * 0.35, pct(v, 0), 'text-anchor="end"');
  }
  const m = bins;
  for (let b = 0; b < m; b++) {
    if (!stats.counts[b]) continue;
    const x0 = x(b / m) + 1, w = inner / m - 2;
    const acc = stats.sumAcc[b] / stats.counts[b], conf = stats.sumConf[b] / stats.counts[b];
    rect(x0, y(acc), w, y(0) - y(acc), "nl-acc");
    // Where the group is right more often than it is sure (under-confident), the gap lies inside the
    // accuracy bar: outlined, not filled, so the bar keeps its colour.
    rect(x0, y(Math.max(acc, conf)), w, Math.abs(y(acc) - y(conf)), acc > conf ? "nl-gap nl-gap-under" : "nl-gap");
    const share = stats.counts[b] / stats.n;
    rect(x0, hy(share), w, hy(0) - hy(share), "nl-hist");
    // The share of the crowded groups, written on the bar (inside it when it is tall).
    if (share >= 0.05 && w >= font * 2) {
      const inside = hy(0) - hy(share) > font * 1.6;
      text(x0 + w / 2, inside ? hy(share) + font * 1.15 : hy(share) - font * 0.3, pct(share, 0),
           `text-anchor="middle"${inside ? ' class="nl-on-bar"' : ""}`);
    }
  }
  line(x(0), y(0), x(1), y(1), "nl-diag");
  // One focusable target per non-empty group over its whole column: click, tap or Enter opens it.
  for (let b = 0; b < m; b++) {
    if (!stats.counts[b]) continue;
    const label = `Open the group of confidence ${binRange(b, m)}: ${count(stats.counts[b])} pictures, ` +
      `${pct(stats.sumAcc[b] / stats.counts[b], 1)} right`;
    const open = opened && opened.bin === b && opened.m === m ? " nl-hit--open" : "";
    parts.push(`<rect x="${(x(b / m) + 1).toFixed(1)}" y="${top.toFixed(1)}" width="${(inner / m - 2).toFixed(1)}" ` +
      `height="${(hy(0) - top).toFixed(1)}" class="nl-hit${open}" data-bin="${b}" tabindex="0" role="button" ` +
      `aria-label="${label}"/>`);
  }
  parts.push(`<rect x="${x(0)}" y="${top}" width="${inner}" height="${mainH}" class="nl-frame"/>`);
  parts.push(`<rect x="${x(0)}" y="${hy0}" width="${inner}" height="${histH}" class="nl-frame"/>`);
  // The count panel's scale is fixed (0 to 100% of the pictures), so it reads the same after every move.
  text(x(0) - font * 0.4, hy(1) + font * 0.8, "100%", 'text-anchor="end"');
  text(x(0) - font * 0.4, hy(0) - font * 0.1, "0%", 'text-anchor="end"');
  text(x(0) + font * 0.4, hy(1) + font * 1.1, "Share of the pictures in each group");
  for (let i = 0; i <= 5; i++) text(x(i / 5), hy(0) + font * 1.4, pct(i / 5, 0), 'text-anchor="middle"');
  text(x(0.5), height - font * 0.4, "Confidence (probability of the predicted class)", 'text-anchor="middle"');
  const yMid = top + mainH / 2;
  text(font * 1.1, yMid, "Share correct", `text-anchor="middle" transform="rotate(-90 ${(font * 1.1).toFixed(1)} ${yMid.toFixed(1)})"`);
  let lx = left, ly = font * 1.2;
  for (const [cls, label] of legend) {
    if (cls === "nl-diag") line(lx, ly, lx + font * 1.6, ly - font * 0.8, cls);
    else rect(lx, ly - font * 0.8, font * 1.6, font * 0.9, cls);
    text(lx + font * 2, ly, label);
    if (rows === 1) lx += (label.length * 0.55 + 3) * font;
    else ly += font * 1.6;
  }
  const title = `Reliability diagram at T = ${tText(t)}, ${m} bins: ECE ${pct(stats.ece)}`;
  plot.innerHTML = `<svg role="group" width="${width}" height="${height}" viewBox="0 0 ${width} ${height}" ` +
    `aria-label="${title}"><title>${title}</title>${parts.join("")}</svg>`;
}

// data-redraw-ms: from the input event (its time stamp) to the diagram and read-outs in the page.
function update(start = performance.now()) {
  stats = data ? compute(data, t, bins) : null;
  readouts();
  draw();
  root.dataset.redrawMs = (performance.now() - start).toFixed(3);
}

function setTemperature(value, start, fromBox = false) {
  t = value;
  range.value = String(value);
  if (!fromBox) box.value = tText(value);
  update(start);
}

// The server writes the explanations and the table for the settled T (slider released, T typed):
// one request for a burst of settles (arrow keys held down), with the latest T and bins.
let settleTimer = null;
function settle() {
  clearTimeout(settleTimer);
  settleTimer = setTimeout(() => {
    trigger("release", {temperature: t, bins});
    // An opened group follows the settled T and bins (not every move: its pictures come from the server).
    if (opened && (opened.t !== t || opened.m !== bins)) openGroup(opened.bin < bins ? opened.bin : bins - 1, false);
  }, 150);
}

// Open group b at the current T and bins: its header from the page's own numbers, its pictures (wrong
// predictions first, then the surest) from the server, asked for by their rows in the test split.
function openGroup(b, focus = true) {
  if (!data || !stats) return;
  const m = bins, members = [];
  for (let i = 0; i < data.n; i++) {
    const c = confidenceOf(data, i, t);
    if (binOf(c, m) === b) members.push([i, c]);
  }
  members.sort((p, q) => data.correct[p[0]] - data.correct[q[0]] || q[1] - p[1]);
  const shown = members.slice(0, BIN_SHOWN), right = stats.counts[b] ? stats.sumAcc[b] / stats.counts[b] : 0;
  requests += 1;
  opened = {bin: b, m, t, request: requests};
  binPanel.dataset.count = String(members.length);
  binPanel.dataset.accuracy = String(right);
  binTitle.textContent = `Confidence ${binRange(b, m)}: ${count(members.length)} pictures` +
    (members.length ? `, ${pct(right, 1)} right` : "");
  binNote.textContent = members.length ? "Loading the pictures…" : `No pictures in this group at T = ${tText(t)}.`;
  binList.replaceChildren();
  binMore.textContent = members.length > shown.length
    ? `… and ${count(members.length - shown.length)} more in this group.` : "";
  binPanel.hidden = false;
  draw();
  if (shown.length) {
    trigger("open_bin", {rows: shown.map(([i]) => (data.rows ? data.rows[i] : i)), temperature: t,
                         request: requests});
  }
  if (focus) {
    binTitle.focus({preventScroll: true});
    binPanel.scrollIntoView({block: "nearest"});
  }
}

function closeGroup() {
  if (!opened) return;
  const b = opened.bin;
  opened = null;
  binPanel.hidden = true;
  binList.replaceChildren();
  draw();
  const bar = plot.querySelector(`.nl-hit[data-bin="${b}"]`);
  if (bar) bar.focus({preventScroll: true});
}

function item(p, at) {
  const li = document.createElement("li"), img = document.createElement("img"), dl = document.createElement("dl");
  li.className = p.right ? "nl-pic" : "nl-pic nl-pic--wrong";
  li.dataset.row = String(p.row);
  img.src = p.src;
  img.alt = `Test picture ${p.row}, a ${p.label}`;
  if (p.small) img.className = "nl-pixelated";
  const verdict = document.createElement("dt");
  verdict.className = "nl-verdict";
  verdict.textContent = p.right ? "Right" : "Wrong";
  dl.append(verdict);
  for (const [name, value] of [["True", p.label], ["Model", p.prediction], ["T = 1", sure(p.confidence_1)],
                               [`T = ${tText(at)}`, sure(p.confidence_t)]]) {
    const dt = document.createElement("dt"), dd = document.createElement("dd");
    dt.textContent = name;
    dd.textContent = value;
    dl.append(dt, dd);
  }
  li.append(img, dl);
  return li;
}

watch("bin", () => {
  const answer = props.bin;
  if (!opened || !answer || answer.request !== opened.request) return;  // closed, or an older group's answer
  if (answer.message) {
    binNote.textContent = answer.message;
    return;
  }
  binNote.textContent = "Wrong predictions first, then the surest; confidence as trained (T = 1) and at " +
    `T = ${tText(opened.t)}` +
    (data && data.rows ? "; groups counted on the page's sample." : ".");
  binList.replaceChildren(...answer.items.map((p) => item(p, opened.t)));
});
pick("#learn-bin-close").addEventListener("click", closeGroup);
plot.addEventListener("click", (e) => {
  const bar = e.target.closest(".nl-hit");
  if (bar) openGroup(Number(bar.dataset.bin));
});
plot.addEventListener("keydown", (e) => {
  const bar = e.target.closest(".nl-hit");
  if (bar && (e.key === "Enter" || e.key === " ")) {
    e.preventDefault();
    openGroup(Number(bar.dataset.bin));
  }
});

range.addEventListener("input", (e) => { message.textContent = ""; setTemperature(Number(range.value), e.timeStamp); });
range.addEventListener("change", settle);
box.addEventListener("input", (e) => {
  const v = Number(box.value);
  if (box.value.trim() !== "" && Number.isFinite(v) && v >= T_MIN && v <= T_MAX) setTemperature(v, e.timeStamp, true);
});
box.addEventListener("change", () => {
  const v = Number(box.value);
  if (box.value.trim() === "" || !Number.isFinite(v)) {
    message.textContent = `Type a number from ${T_MIN} to ${T_MAX}; T stays ${tText(t)}.`;
    box.value = tText(t);
    return;
  }
  const clamped = Math.min(Math.max(v, T_MIN), T_MAX);
  message.textContent = clamped === v ? ""
    : `T = ${box.value} is ${v > T_MAX ? "above the largest" : "below the smallest"} T here; using T = ${tText(clamped)}.`;
  setTemperature(clamped);
  settle();
});
binsInput.addEventListener("input", (e) => {
  bins = Number(binsInput.value);
  binsOut.textContent = String(bins);
  update(e.timeStamp);
});
binsInput.addEventListener("change", settle);
fitButton.addEventListener("click", () => {
  if (!data) return;
  const fitted = Math.min(Math.max(data.fitted, T_MIN), T_MAX);
  message.textContent = `T set to the temperature-scaling fit, ${tText(fitted)}.`;
  setTemperature(fitted);
  settle();
});

function setPresenter(on) {
  root.classList.toggle("nl--present", on);
  root.dataset.presenter = on ? "on" : "off";
  presenter.setAttribute("aria-pressed", String(on));
  presenter.textContent = on ? "Leave presenter mode" : "Presenter mode";
  draw();
}
presenter.addEventListener("click", () => setPresenter(!root.classList.contains("nl--present")));
// Escape closes an opened group first, then leaves presenter mode.
document.addEventListener("keydown", (e) => {
  if (e.key !== "Escape") return;
  if (opened) closeGroup();
  else if (root.classList.contains("nl--present")) setPresenter(false);
});
// The logits come with the first view of the tab, not with the app's first screen: a visitor who
// never opens it never downloads them. Hidden tabs have no size: draw when the box gets one.
let asked = false;
new ResizeObserver(() => {
  if (!props.value && !asked && plot.clientWidth > 0) {
    asked = true;
    trigger("first_view");
  }
  draw();
}).observe(plot);

load(props.value);
update();
// Gradio mounts a tab's content when it is first shown: logits already here come from a calibration
// run before that, whose text the server has not written yet.
if (props.value) settle();
// The logits of the first view, or of a new calibration (after a run in the Calibrate tab); for a new
// calibration the server's text follows too (the first view's text is already the page's).
let viewed = false;
watch("value", () => {
  const firstView = asked && !viewed;
  viewed = true;
  if (opened) closeGroup();  // its rows belong to the logits being replaced
  load(props.value);
  update();
  if (!firstView) settle();
});
