// The Learn tab in the page (after diagram.js, whose drawing and smooth ECE it uses): the server
// sends the test logits once per calibration (props.value), with the words of the table, of the
// explanations and of the lesson; every move of T or of the bins is computed, drawn and written here,
// without a request. The conventions are nctv.metrics': p = softmax(z / T) in float64, confidence = max p,
// prediction = first argmax, equal-width bins ((m-1)/M, m/M] with confidence 0 in the first,
// ECE = sum |Σacc - Σconf| / N.
const root = element.querySelector(".nl");
const pick = (sel) => root.querySelector(sel);
const range = pick("#learn-t"), box = pick("#learn-t-box"), binsInput = pick("#learn-bins");
const binsOut = pick("#learn-bins-value"), message = pick("#learn-message"), plot = pick("#learn-plot");
const presenter = pick("#learn-presenter"), fitButton = pick("#learn-fit"), note = pick("#learn-note");
const out = {ece: pick("#learn-ece"), accuracy: pick("#learn-accuracy"), confidence: pick("#learn-confidence")};
const outSmooth = pick("#learn-smooth-ece"), smoothPlot = pick("#learn-smooth"), outAps = pick("#learn-aps");
const tableBox = pick("#learn-table"), textBox = pick("#learn-text");
const lessonBox = pick("#learn-lesson"), lessonTitle = pick("#learn-lesson-title"), lessonText = pick("#learn-lesson-text");
const back = pick("#learn-back"), next = pick("#learn-next"), start = pick("#learn-start");
const copy = pick("#learn-copy"), linkLine = pick("#learn-link");
const panel = groupPanel(root, "learn");
// The table and the explanations come after the diagrams and an opened group's pictures.
root.append(pick(".nl-words"));
// An opened group lists this many of its pictures (the server accepts up to 200 rows a request).
const BIN_SHOWN = 24;
const T_MIN = Number(range.min), T_MAX = Number(range.max);
const BINS_MIN = Number(binsInput.min), BINS_MAX = Number(binsInput.max);
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
  data = {n, k, z, top, correct, rows, labels, fitted: value.ts_temperature, words: value.words,
          linkModel: value.link_model || null, cached: new Map()};
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

// The table's figures at T and m bins (nctv.metrics' accuracy, entropy, ECE, AECE and SCE, step for
// step): p_j = exp(z_j / T - z_top / T) / Σ, entropy −Σ p log p (0 log 0 = 0), AECE over the
// confidence-sorted rows (a stable sort: ties keep their order) in numpy.array_split's groups, SCE
// every class's probabilities in the ECE bins against "is it the label".
function tableScores(d, temperature, m) {
  const n = d.n, k = d.k, p = new Float64Array(k), conf = new Float64Array(n);
  const counts = new Float64Array(m), sumConf = new Float64Array(m), sumAcc = new Float64Array(m);
  const classConf = new Float64Array(k * m), classHits = new Float64Array(k * m);
  let entropy = 0, right = 0;
  for (let i = 0; i < n; i++) {
    const o = i * k, best = d.z[o + d.top[i]] / temperature;
    let s = 0;
    for (let j = 0; j < k; j++) { p[j] = Math.exp(d.z[o + j] / temperature - best); s += p[j]; }
    let h = 0;
    for (let j = 0; j < k; j++) {
      const q = p[j] / s, b = j * m + binOf(q, m);
      if (q > 0) h -= q * Math.log(q);
      classConf[b] += q;
      if (d.labels[i] === j) classHits[b] += 1;
    }
    entropy += h;
    const c = p[d.top[i]] / s, b = binOf(c, m);
    conf[i] = c;
    counts[b] += 1;
    sumConf[b] += c;
    sumAcc[b] += d.correct[i];
    right += d.correct[i];
  }
  let gap = 0, classGap = 0, groupGap = 0;
  for (let b = 0; b < m; b++) gap += Math.abs(sumAcc[b] - sumConf[b]);
  for (let b = 0; b < k * m; b++) classGap += Math.abs(classHits[b] - classConf[b]);
  const order = Array.from({length: n}, (_, i) => i).sort((a, b) => conf[a] - conf[b] || a - b);
  const base = Math.floor(n / m), extra = n % m;
  for (let g = 0, at = 0; g < m; g++) {
    let sc = 0, sa = 0;
    for (const end = at + base + (g < extra ? 1 : 0); at < end; at++) { sc += conf[order[at]]; sa += d.correct[order[at]]; }
    groupGap += Math.abs(sa - sc);
  }
  return {accuracy: right / n, entropy: entropy / n, ece: gap / n, aece: groupGap / n, sce: classGap / n / k};
}

// A number as Python's f"{x:,.{d}f}" writes it (nctv.ui.learn.number): correctly rounded, a tie (the
// double exactly halfway) to the even neighbour where toFixed rounds it up; thousands separated by
// commas; a value that rounds to 0 without a sign.
function fixed(x, d) {
  let s = x.toFixed(d);
  const exact = Math.abs(x).toFixed(100), cut = exact.indexOf(".") + 1 + d;
  if (/^50*$/.test(exact.slice(cut))) {
    const kept = exact.slice(0, d ? cut : cut - 1);
    if (Number(kept[kept.length - 1]) % 2 === 0) s = (x < 0 ? "-" : "") + kept;
  }
  if (Number(s) === 0) s = s.replace("-", "");
  const [whole, frac] = s.split(".");
  return whole.replace(/\B(?=(\d{3})+(?!\d))/g, ",") + (frac === undefined ? "" : `.${frac}`);
}

// {name} in a template from the server replaced by values[name] (nctv.ui.learn.fill); names without a
// value stay as they are.
const fill = (template, values) => template.replace(/\{([a-z]+(?:\.[a-z]+)?)\}/g, (all, name) => values[name] ?? all);

const tText = (x) => (Math.abs(x * 100 - Math.round(x * 100)) < 1e-9 ? x.toFixed(2) : String(Number(x.toFixed(3))));

function readouts() {
  for (const key of ["ece", "accuracy", "confidence"]) {
    out[key].dataset.value = stats ? String(stats[key]) : "";
    out[key].textContent = stats ? pct(stats[key]) : "–";
  }
  root.dataset.temperature = String(t);
  root.dataset.bins = String(bins);
  apsNow = data && data.n >= 4 ? apsSetSize(data, t) : NaN;
  outAps.dataset.value = Number.isFinite(apsNow) ? String(apsNow) : "";
  outAps.textContent = Number.isFinite(apsNow) ? `${apsNow.toFixed(2)} classes` : "–";
}
let apsNow = NaN;

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
  if (!wordsFrame) wordsFrame = requestAnimationFrame(() => { wordsFrame = 0; writeWords(); });
}
let wordsFrame = 0;

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

// ----------------------------------------------------------------------------- the table and the words

// The numbers of the view, written as the server's words want them (words.formats: name → [scale,
// decimals]; nctv.ui.learn.view_values), and the lesson's own: the mean confidence, the APS set sizes
// at T and at T = 1, and the fullest group at T.
function viewValues() {
  const d = data, w = d.words, m = bins;
  const cached = (key, make) => { if (!d.cached.has(key)) d.cached.set(key, make()); return d.cached.get(key); };
  const rows = {one: cached(`one ${m}`, () => tableScores(d, 1, m)), now: tableScores(d, t, m),
                fit: cached(`fit ${m}`, () => tableScores(d, d.fitted, m))};
  const raw = {t, bins: m, width: 1 / m, last: 1 - 1 / m, perbin: d.n / m};
  for (const [row, s] of Object.entries(rows)) for (const [key, v] of Object.entries(s)) raw[`${row}.${key}`] = v;
  const values = {};
  for (const [name, [scale, digits]] of Object.entries(w.formats)) values[name] = fixed(scale * raw[name], digits);
  const fullest = fullestGroup(), count = stats.counts[fullest];
  Object.assign(values, {
    confidence: fixed(100 * stats.confidence, 2), aps: fixed(apsNow, 2),
    "aps.one": fixed(cached("aps one", () => apsSetSize(d, 1)), 2),
    "group.count": fixed(count, 0), "group.range": `<span class="nl-nowrap">${binRange(fullest, m)}</span>`, "group.share": fixed(100 * count / d.n, 1),
    "group.conf": fixed(100 * stats.sumConf[fullest] / count, 2), "group.acc": fixed(100 * stats.sumAcc[fullest] / count, 2),
  });
  return values;
}

// The group holding the most pictures at the view's T and bins (the first of equals).
function fullestGroup() {
  let fullest = 0;
  for (let b = 1; b < bins; b++) if (stats.counts[b] > stats.counts[fullest]) fullest = b;
  return fullest;
}

// The table of T = 1, the view's T and the fit, the explanations and the lesson's paragraph, with the
// view's numbers: at most once a frame, after the diagram.
function writeWords() {
  if (!data || !data.words || !stats) return;
  const begin = performance.now(), w = data.words, values = viewValues();
  const head = w.columns.map(([, label]) => `<th>${escapeXml(label)}</th>`).join("");
  const body = w.rows.map(([row, label]) => `<tr><td>${escapeXml(fill(label, values))}</td>` +
    w.columns.map(([key]) => `<td>${values[`${row}.${key}`]}</td>`).join("") + "</tr>").join("");
  tableBox.innerHTML = `<table><thead><tr><th></th>${head}</tr></thead><tbody>${body}</tbody></table>` +
    `<p>${escapeXml(fill(w.note, values))}</p>`;
  textBox.innerHTML = fill(w.text, values);
  if (step >= 0) lessonText.innerHTML = fill(w.lesson[step].text, values);
  root.dataset.wordsTemperature = String(t);
  root.dataset.wordsBins = String(bins);
  root.dataset.wordsMs = (performance.now() - begin).toFixed(3);
}

// ----------------------------------------------------------------------------- views: the lesson, links

// The lesson's step shown (0-based), or -1.
let step = -1;
// A view asked for before the logits arrived (a link, a step): set once they are here.
let pending = null;

// Set the view: t ("one", "fit" or a number), bins, group (null, "fullest" or a group's index); a part
// left undefined stays as it is.
function setView(view) {
  if (!data) { pending = {...pending, ...view}; return; }
  if (view.bins !== undefined) {
    bins = Math.min(Math.max(Math.round(view.bins), BINS_MIN), BINS_MAX);
    binsInput.value = String(bins);
    binsOut.textContent = String(bins);
  }
  if (view.t !== undefined) {
    const wanted = view.t === "one" ? 1 : view.t === "fit" ? data.fitted : view.t;
    setTemperature(Math.min(Math.max(wanted, T_MIN), T_MAX));
  } else update();
  if (view.group === null) closeGroup();
  else if (view.group !== undefined) {
    const b = view.group === "fullest" ? fullestGroup() : Math.min(view.group, bins - 1);
    openGroup(b, false);
  }
  settle();
}

// Show step i of the lesson (0-based; -1: none, the lesson's bar only) and set its view.
function showStep(i, focus = true) {
  step = i;
  root.dataset.step = String(i + 1);
  const steps = data ? data.words.lesson : null, total = steps ? steps.length : Number(root.dataset.steps);
  start.hidden = i >= 0;
  for (const b of [back, next, pick("#learn-lesson-close")]) b.hidden = i < 0;
  lessonText.hidden = i < 0;
  if (i < 0) {
    lessonTitle.textContent = `A lesson in ${total} steps`;
    layoutLesson();
    return;
  }
  lessonTitle.textContent = `Step ${i + 1} of ${total}` + (steps ? `: ${steps[i].title}` : "");
  back.disabled = i === 0;
  next.disabled = i === total - 1;
  if (steps) {
    lessonText.textContent = "";
    setView({t: steps[i].t, bins: steps[i].bins, group: steps[i].group});
  } else {
    lessonText.textContent = "Loading the test logits…";
    pending = {...pending, step: i};
  }
  layoutLesson();
  if (focus) lessonTitle.focus({preventScroll: true});
}

// The lesson sits above the diagrams: they give up its height and the gap under it.
function layoutLesson() {
  const h = lessonBox.getBoundingClientRect().height + parseFloat(getComputedStyle(root).rowGap || "0");
  root.style.setProperty("--nl-lesson-h", `${Math.ceil(h)}px`);
}
new ResizeObserver(layoutLesson).observe(lessonBox);

start.addEventListener("click", () => showStep(0));
back.addEventListener("click", () => showStep(Math.max(step - 1, 0)));
next.addEventListener("click", () => showStep(step + 1));
pick("#learn-lesson-close").addEventListener("click", () => { showStep(-1); start.focus(); });

// The view asked for before the logits arrived: a step first (it sets its own view), then the rest.
function resume() {
  if (!data || !pending) return;
  const {step: wanted, ...view} = pending;
  pending = null;
  if (wanted !== undefined) showStep(wanted, false);
  if (Object.keys(view).length) setView(view);
}

// A link's view (the first data's "link", read by the server from the page's address with the app's
// own readers: nctv.ui.links), applied once: its step first, then the T, bins and opened group it
// names, then presenter mode.
let linked = false;
function applyLink(link) {
  if (!link || linked) return;
  linked = true;
  if (link.step) showStep(link.step - 1, false);
  const view = {};
  if (link.t !== undefined && link.t !== null) view.t = link.t;
  if (link.bins) view.bins = link.bins;
  if (link.bin) view.group = link.bin - 1;
  if (Object.keys(view).length) setView(view);
  if (link.presenter) setPresenter(true);
}

// The link of what is on screen: Learn, its T (written so that it reads back as the same number), bins,
// presenter mode, the lesson's step, the opened group, and the menu model whose study it shows.
function viewLink() {
  const q = new URLSearchParams({tab: "learn", t: String(t), bins: String(bins)});
  if (root.dataset.presenter === "on") q.set("presenter", "1");
  if (step >= 0) q.set("step", String(step + 1));
  if (opened) q.set("bin", String(opened.bin + 1));
  if (data && data.linkModel) q.set("model", data.linkModel);
  return `${location.origin}${location.pathname}?${q}`;
}

copy.addEventListener("click", async () => {
  const url = viewLink(), field = pick("#learn-link-url"), said = pick("#learn-link-said");
  field.value = url;
  linkLine.hidden = false;
  try {
    await navigator.clipboard.writeText(url);
    said.textContent = "Link copied:";
  } catch {
    // No clipboard here (a page served without https, or refused): the link is selected to copy by hand.
    said.textContent = "Copy this link:";
    field.focus();
    field.select();
  }
});

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

// Once T settles (slider released, T typed): the smoothed diagram's band, and an opened group's pictures;
// one for a burst of settles (arrow keys held down), with the latest T and bins.
let settleTimer = null;
function settle() {
  clearTimeout(settleTimer);
  settleTimer = setTimeout(() => {
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
// run before that.
if (props.value) settle();
resume();
if (props.value) applyLink(props.value.link);
// The logits of the first view, or of a new calibration (after a run in the Calibrate tab): a lesson's
// step is shown again with the new model's numbers.
let viewed = false;
watch("value", () => {
  const firstView = asked && !viewed;
  viewed = true;
  if (opened) closeGroup();  // its rows belong to the logits being replaced
  load(props.value);
  update();
  if (pending) resume();
  else if (step >= 0 && data) showStep(step, false);
  if (props.value) applyLink(props.value.link);
  if (firstView) computeBand();
  else settle();
});
