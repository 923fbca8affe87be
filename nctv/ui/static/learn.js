// The Learn tab in the page (after diagram.js, whose drawing and smooth ECE it uses): the server
// sends the test logits once per calibration (props.value); every move of T or of the bins is
// computed and drawn here, without a request. The conventions are
// nctv.metrics': p = softmax(z / T) in float64, confidence = max p, prediction = first argmax,
// equal-width bins ((m-1)/M, m/M] with confidence 0 in the first, ECE = sum |Σacc - Σconf| / N.
const root = element.querySelector(".nl");
const pick = (sel) => root.querySelector(sel);
const range = pick("#learn-t"), box = pick("#learn-t-box"), binsInput = pick("#learn-bins");
const binsOut = pick("#learn-bins-value"), message = pick("#learn-message"), plot = pick("#learn-plot");
const presenter = pick("#learn-presenter"), fitButton = pick("#learn-fit"), note = pick("#learn-note");
const out = {ece: pick("#learn-ece"), accuracy: pick("#learn-accuracy"), confidence: pick("#learn-confidence")};
const outSmooth = pick("#learn-smooth-ece"), smoothPlot = pick("#learn-smooth"), outAps = pick("#learn-aps");
const panel = groupPanel(root, "learn");
// An opened group lists this many of its pictures (the server accepts up to 200 rows a request).
const BIN_SHOWN = 24;
const T_MIN = Number(range.min), T_MAX = Number(range.max);
let data = null, t = 1, bins = Number(binsInput.value), stats = null;
// The opened group: {bin, m, t}, or null.
let opened = null;

function decode(b64, Type) {
  const s = atob(b64), bytes = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) bytes[i] = s.charCodeAt(i);
  return new Type(bytes.buffer);
}

function load(value) {
  smooth = null;
  band = null;
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
  data = {n, k, z, top, correct, rows, labels, fitted: value.ts_temperature};
  const sample = value.n < value.n_total
    ? `a seeded sample of ${value.n.toLocaleString("en")} of its ${value.n_total.toLocaleString("en")} test pictures`
    : `its ${value.n.toLocaleString("en")} test pictures`;
  note.textContent = `${value.where}: ${sample}. The probabilities are softmax(z / T) of the model's scores z ` +
    "(logits): T > 1 makes them less sure, T < 1 surer; the predicted class never changes.";
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

// APS sets at 90 % (nctv.conformal.aps_mean_set_size, step for step; docs/conformal.md): p = softmax(z / T)
// with its sum taken left to right; classes ranked by p, largest first, ties to the lower class; a
// row's running sums c_r over those ranks; the calibration score is c_r at the label's rank; q̂ is the
// ⌈(n + 1)·0.9⌉-th smallest score of the even rows (+∞ past n); a set holds the ranks with c_r ≤ q̂,
// counted over the odd rows.
function apsSetSize(d, temperature) {
  const k = d.k, p = new Float64Array(k), order = Array.from({length: k}, (_, j) => j), running = new Float64Array(k);
  const ranked = (i) => {
    const o = i * k;
    let top = -Infinity;
    for (let j = 0; j < k; j++) top = Math.max(top, d.z[o + j] / temperature);
    let sum = 0;
    for (let j = 0; j < k; j++) { p[j] = Math.exp(d.z[o + j] / temperature - top); sum += p[j]; }
    for (let j = 0; j < k; j++) p[j] /= sum;
    order.sort((a, b) => p[b] - p[a] || a - b);
    let c = 0;
    for (let r = 0; r < k; r++) { c += p[order[r]]; running[r] = c; }
  };
  const scores = [];
  for (let i = 0; i < d.n; i += 2) {
    ranked(i);
    scores.push(running[order.indexOf(d.labels[i])]);
  }
  scores.sort((a, b) => a - b);
  const at = Math.ceil(((scores.length + 1) * 9) / 10);
  const q = at > scores.length ? Infinity : scores[at - 1];
  let size = 0, rows = 0;
  for (let i = 1; i < d.n; i += 2) {
    ranked(i);
    for (let r = 0; r < k; r++) if (running[r] <= q) size += 1;
    rows += 1;
  }
  return rows ? size / rows : NaN;
}

const tText = (x) => (Math.abs(x * 100 - Math.round(x * 100)) < 1e-9 ? x.toFixed(2) : String(Number(x.toFixed(3))));

function readouts() {
  for (const key of ["ece", "accuracy", "confidence"]) {
    out[key].dataset.value = stats ? String(stats[key]) : "";
    out[key].textContent = stats ? pct(stats[key]) : "–";
  }
  root.dataset.temperature = String(t);
  root.dataset.bins = String(bins);
  const aps = data && data.n >= 4 ? apsSetSize(data, t) : NaN;
  outAps.dataset.value = Number.isFinite(aps) ? String(aps) : "";
  outAps.textContent = Number.isFinite(aps) ? `${aps.toFixed(2)} classes` : "–";
}

// The binned diagram from the page's own counts.
function draw() {
  const width = plot.clientWidth, height = plot.clientHeight;
  if (!stats || width < 50 || height < 50) { plot.innerHTML = ""; return; }
  const m = bins, accuracy = new Float64Array(m), confidence = new Float64Array(m);
  for (let b = 0; b < m; b++) {
    accuracy[b] = stats.counts[b] ? stats.sumAcc[b] / stats.counts[b] : 0;
    confidence[b] = stats.counts[b] ? stats.sumConf[b] / stats.counts[b] : 0;
  }
  plot.innerHTML = binnedSvg({m, n: stats.n, counts: stats.counts, accuracy, confidence, low: null, high: null}, {
    width, height, font: fontSize(), legend: true, opened: opened && opened.m === m ? opened.bin : -1,
    label: `Reliability diagram at T = ${tText(t)}, ${m} bins: ECE ${pct(stats.ece)}`,
    groupLabel: (b) => `Open the group of confidence ${binRange(b, m)}: ${count(stats.counts[b])} pictures, ` +
      `${pct(accuracy[b], 1)} right`,
  });
}

const fontSize = () => parseFloat(getComputedStyle(root).getPropertyValue("--nd-font")) || 14;

// The smoothed diagram: its curve and smooth ECE follow T at most once a frame, after the bars (they
// cost about four times a redraw of the bars); its band follows once T settles.
let smooth = null, band = null, smoothFrame = 0, bandTimer = null;
const BAND_RESAMPLES = 100, BAND_SEED = 0, BAND_LEVEL = 0.95, BAND_CHUNK = 5;

function drawSmooth() {
  const width = smoothPlot.clientWidth, height = smoothPlot.clientHeight;
  if (!smooth || width < 50 || height < 50) { smoothPlot.innerHTML = ""; return; }
  const banded = band && band.t === smooth.t;
  smoothPlot.innerHTML = smoothSvg({...smooth.curve, low: banded ? band.low : null, high: banded ? band.high : null}, {
    width, height, font: fontSize(), legend: true,
    label: `Smoothed reliability diagram at T = ${tText(smooth.t)}: smooth ECE ${pct(smooth.value)} ` +
      `(bandwidth ${smooth.bandwidth.toFixed(3)})` + (banded ? `, ${Math.round(100 * BAND_LEVEL)}% band of ${BAND_RESAMPLES} resamples` : ""),
  });
}

function confidences(temperature) {
  const conf = new Float64Array(data.n);
  for (let i = 0; i < data.n; i++) conf[i] = confidenceOf(data, i, temperature);
  return conf;
}

function computeSmooth() {
  cancelAnimationFrame(smoothFrame);
  smoothFrame = 0;
  if (!data) return;
  const start = performance.now(), conf = confidences(t), calib = smoothCalibration(conf, data.correct);
  const {value, bandwidth} = calib.search();
  smooth = {t, value, bandwidth, conf, curve: calib.curve(bandwidth)};
  outSmooth.dataset.value = String(value);
  outSmooth.textContent = pct(value);
  root.dataset.smoothTemperature = String(t);
  root.dataset.smoothMs = (performance.now() - start).toFixed(3);
  drawSmooth();
}

function scheduleSmooth() {
  if (!smoothFrame) smoothFrame = requestAnimationFrame(computeSmooth);
}

// The band: from the smoothed accuracy of seeded resamples of the pictures at the point estimate's
// bandwidth, pointwise; a few resamples per turn of the page, so that it stays responsive.
function computeBand() {
  clearTimeout(bandTimer);
  if (!smooth || smooth.t !== t) computeSmooth();
  if (!smooth) return;
  const {conf, bandwidth, curve} = smooth, n = conf.length, random = seededRandom(BAND_SEED);
  const curves = [], weights = new Float64Array(n), forT = smooth.t;
  const step = () => {
    if (!smooth || smooth.t !== forT) return;  // T moved on: this band is no longer wanted
    for (let r = 0; r < BAND_CHUNK && curves.length < BAND_RESAMPLES; r++) {
      weights.fill(0);
      for (let i = 0; i < n; i++) weights[Math.floor(random() * n)] += 1;
      curves.push(smoothCalibration(conf, data.correct, weights).curve(bandwidth).accuracy);
    }
    if (curves.length < BAND_RESAMPLES) {
      bandTimer = setTimeout(step, 0);
      return;
    }
    const mesh = curve.mesh.length, low = new Float64Array(mesh), high = new Float64Array(mesh);
    const column = new Float64Array(BAND_RESAMPLES);
    for (let p = 0; p < mesh; p++) {
      for (let r = 0; r < BAND_RESAMPLES; r++) column[r] = curves[r][p];
      column.sort();
      // The basic bootstrap interval, as nctv.intervals.smooth_band: [2·curve − q_high, 2·curve − q_low].
      const twice = 2 * curve.accuracy[p];
      low[p] = Math.min(Math.max(twice - quantileSorted(column, (1 + BAND_LEVEL) / 2), 0), 1);
      high[p] = Math.min(Math.max(twice - quantileSorted(column, (1 - BAND_LEVEL) / 2), 0), 1);
    }
    band = {t: forT, low, high};
    root.dataset.bandTemperature = String(forT);
    drawSmooth();
  };
  bandTimer = setTimeout(step, 0);
}

// data-redraw-ms: from the input event (its time stamp) to the diagram and read-outs in the page.
function update(start = performance.now()) {
  stats = data ? compute(data, t, bins) : null;
  readouts();
  draw();
  scheduleSmooth();
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
    computeBand();
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
  opened = {bin: b, m, t};
  panel.section.dataset.count = String(members.length);
  panel.section.dataset.accuracy = String(right);
  const request = panel.open(`Confidence ${binRange(b, m)}: ${count(members.length)} pictures` +
    (members.length ? `, ${pct(right, 1)} right` : ""), focus);
  if (!members.length) panel.note.textContent = `No pictures in this group at T = ${tText(t)}.`;
  panel.more.textContent = members.length > shown.length
    ? `… and ${count(members.length - shown.length)} more in this group.` : "";
  draw();
  if (shown.length) {
    trigger("open_bin", {rows: shown.map(([i]) => (data.rows ? data.rows[i] : i)), temperature: t, request});
  }
}

function closeGroup() {
  if (!opened) return;
  const b = opened.bin;
  opened = null;
  panel.hide();
  draw();
  const bar = plot.querySelector(`.nd-hit[data-bin="${b}"]`);
  if (bar) bar.focus({preventScroll: true});
}

watch("bin", () => {
  if (!panel.accepts(props.bin)) return;
  panel.note.textContent = "Wrong predictions first, then the surest; confidence as trained (T = 1) and at " +
    `T = ${tText(opened.t)}` +
    (data && data.rows ? "; groups counted on the page's sample." : ".");
  panel.list.replaceChildren(...props.bin.items.map((p) => pictureItem(p, ["T = 1", `T = ${tText(opened.t)}`])));
});
panel.close.addEventListener("click", closeGroup);
plot.addEventListener("click", (e) => {
  const bar = e.target.closest(".nd-hit");
  if (bar) openGroup(Number(bar.dataset.bin));
});
plot.addEventListener("keydown", (e) => {
  const bar = e.target.closest(".nd-hit");
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

const setPresenter = presenterMode(root, presenter, "nl--present", () => {
  draw();
  drawSmooth();
});
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
  drawSmooth();
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
  if (firstView) computeBand();
  else settle();
});
