// The Shift tab in the page (after diagram.js, whose drawing it uses): the server sends the shift
// study's numbers once (props.value, nctv.ui.shift.page_data); every change of corruption or severity
// is drawn here, without a request: the example pictures, the verdict from the paired interval, the
// curves of ECE against severity, and each method's reliability diagram with its ECE and interval.
const root = element.querySelector(".ns");
const pick = (sel) => root.querySelector(sel);
const menu = pick("#shift-corruption"), range = pick("#shift-severity"), what = pick("#shift-what");
const severityOut = pick("#shift-severity-value"), severityWords = pick("#shift-severity-words");
const verdict = pick("#shift-verdict"), also = pick("#shift-also"), note = pick("#shift-note");
const head = pick("#shift-headline");
const pics = pick("#shift-examples"), picsCaption = pick("#shift-examples-caption");
const curve = pick("#shift-curve"), mean = pick("#shift-mean"), grid = pick("#shift-diagrams");
const presenter = pick("#shift-presenter");
const CLEAN = "clean", AVERAGE = "average";
// What the tab opens on: a corruption that moves every method, at a middle severity.
const FIRST = {corruption: "contrast", severity: 3};
// The reference Neural Clamping is weighed against first, then the others it was compared with.
const FIRST_REFERENCE = "TS by Grid Search";
// levels: the severities of the slider's positions (0, then the study's); at: the slider's position.
let data = null, corruption = null, levels = [0], at = 0, severity = FIRST.severity;

// ----------------------------------------------------------------------------- numbers in words

const points = (x) => (100 * x).toFixed(2);
// A signed difference in percentage points, as nctv.report writes it ("−0.31", "+0.20").
function signed(x) {
  const s = Math.abs(100 * x).toFixed(2);
  return (x < 0 && Number(s) !== 0 ? "−" : "+") + s;
}
// "8.07% [7.49, 8.60]": a figure with its interval (a figure without one stands alone).
function withInterval(f) {
  return f[1] === null || f[2] === null ? pct(f[0]) : `${pct(f[0])} [${points(f[1])}, ${points(f[2])}]`;
}
const conditionKey = (c, s) => (s === 0 ? CLEAN : `${c}/${s}`);
const meanKey = (s) => (s === 0 ? CLEAN : `${AVERAGE}/${s}`);
const corruptionOf = (name) => data.corruptions.find((c) => c.name === name);
const place = (s) => (s === 0 ? "On the clean test pictures" : `Under ${corruptionOf(corruption).words}, severity ${s}`);
const tied = (v) => v[1] <= 0 && 0 <= v[2];

function list(names) {
  return names.length < 2 ? names.join("") : `${names.slice(0, -1).join(", ")} and ${names[names.length - 1]}`;
}

// The verdict of Neural Clamping against temperature scaling under the condition, from the paired
// interval of their ECE difference: a difference whose interval holds 0 is a tie.
function verdictSentence(c) {
  const refs = Object.keys(c.versus);
  if (!data.compared || !refs.length) return `${place(severity)}: the lowest ECE is ${list(c.leaders)}'s.`;
  const other = refs.includes(FIRST_REFERENCE) ? FIRST_REFERENCE : refs[0], v = c.versus[other];
  const numbers = `ECE ${signed(v[0])} [${signed(v[1])}, ${signed(v[2])}] point`;
  if (tied(v)) return `${place(severity)}, ${data.compared} and ${other} are tied: ${numbers}.`;
  return `${place(severity)}, ${data.compared} is ${v[0] < 0 ? "better" : "worse"} calibrated than ${other}: ${numbers}.`;
}

// "Far" from the clean figure: a method's ECE at least FAR above its ECE on the clean pictures, or its
// accuracy at least FAR below (10 percentage points: more than any method's clean ECE in the shipped
// study, and some twenty times the half-width of an interval on 10,000 test pictures). docs/method.md.
const FAR = 0.10;
// "40.7–72.9 %", never broken over two lines (word joiners around the dash, a no-break space before %).
const span1 = (xs) => { const lo = Math.min(...xs), hi = Math.max(...xs);
  return `${(100 * lo).toFixed(1)}${lo.toFixed(3) === hi.toFixed(3) ? "" : `\u2060–\u2060${(100 * hi).toFixed(1)}`}\u00a0%`; };
// The headline's last words, left out in presenter mode (the verdict must fit a projector's screen).
const BROKEN_TAIL = " The comparison below is between broken calibrations.";

// The whole picture before any comparison: where every method is far from its clean figure, on ECE
// (every calibration breaks) or on accuracy (the model breaks), that comes first; else nothing.
function headline(c) {
  if (severity === 0) return "";
  const clean = data.conditions[CLEAN].figures, names = data.methods.map((m) => m.name);
  const of = (figures, metric) => names.map((m) => figures[m][metric][0]);
  const ece = of(c.figures, "ece"), ece0 = of(clean, "ece"), acc = of(c.figures, "accuracy"), acc0 = of(clean, "accuracy");
  const eceFar = ece.every((e, i) => e - ece0[i] >= FAR), accFar = acc.every((a, i) => acc0[i] - a >= FAR);
  const accuracy = `accuracy ${span1(acc)} (clean: ${span1(acc0)})`;
  if (eceFar) return `Every calibration breaks at this severity: every method's ECE is ${span1(ece)} ` +
    `(clean: ${span1(ece0)}), ${accuracy}.`;
  if (accFar) return `The model breaks at this severity: every method's ${accuracy}; ` +
    `ECE ${span1(ece)} (clean: ${span1(ece0)}).`;
  return "";
}

// The other references and the leaders, then what the brackets mean (left out in presenter mode).
function alsoLine(c) {
  const level = Math.round(100 * data.level), parts = [];
  for (const [other, v] of Object.entries(c.versus)) {
    if (other === FIRST_REFERENCE) continue;
    parts.push(`Against ${other}: ${signed(v[0])} [${signed(v[1])}, ${signed(v[2])}] point, ` +
               `${tied(v) ? "tied" : v[0] < 0 ? "better" : "worse"}.`);
  }
  const [best, ...others] = c.leaders;
  parts.push(`Lowest ECE here: ${best}` + (others.length ? ` (tied with it: ${list(others)}).` : "."));
  const span = (text, cls = "") => {
    const e = document.createElement("span");
    e.textContent = text;
    e.className = cls;
    return e;
  };
  return [span(parts.join(" ")), span(` Brackets: the ${level}% interval of the difference, paired over the ` +
                                      "same resamples.", "ns-brackets")];
}

// ----------------------------------------------------------------------------- the page's parts

function fillMenu() {
  menu.replaceChildren(...data.corruptions.map((c) => {
    const o = document.createElement("option");
    o.value = c.name;
    o.textContent = c.title;
    return o;
  }));
  if (!corruption || !corruptionOf(corruption)) {
    corruption = corruptionOf(FIRST.corruption) ? FIRST.corruption : data.corruptions[0].name;
  }
  menu.value = corruption;
  levels = [0, ...data.severities];
  range.max = String(levels.length - 1);
  at = Math.max(levels.indexOf(severity), 0);
  severity = levels[at];
  range.value = String(at);
}

function legend() {
  pick("#shift-legend").innerHTML = data.methods.map((m) => `<span data-method="${escapeXml(m.name)}">` +
    `<svg width="28" height="12" aria-hidden="true"><line x1="1" y1="6" x2="27" y2="6" class="ns-line" ` +
    `style="--c:${m.colour}"/><circle cx="14" cy="6" r="3.5" class="ns-dot" style="--c:${m.colour}"/></svg>` +
    `${escapeXml(m.name)}</span>`).join("") +
    '<span><svg width="28" height="12" aria-hidden="true"><rect x="1" y="1" width="26" height="10" class="ns-band" ' +
    `style="--c:${data.methods[0].colour}"/></svg>${Math.round(100 * data.level)}% interval</span>`;
}

function diagramLegend() {
  pick("#shift-diagram-key").innerHTML = diagramKey([["box", "nd-acc", "Share correct"],
    ["box", "nd-gap", "Gap: surer than right"], ["box", "nd-gap nd-gap-under", "Gap: right more often than sure"],
    ["line", "nd-diag", "Honest model"], ["box", "nd-hist", "Share of the pictures"]]);
}

function cards() {
  grid.innerHTML = data.methods.map((m, i) => `<figure class="ns-card" data-index="${i}" ` +
    `data-method="${escapeXml(m.name)}"><figcaption><h4 style="--c:${m.colour}">${escapeXml(m.name)}</h4>` +
    '<dl class="ns-read"><dt>ECE</dt><dd data-metric="ece"></dd><dt>Accuracy</dt><dd data-metric="accuracy"></dd>' +
    '</dl></figcaption><div class="nd-plot ns-binned"></div></figure>').join("");
}

function examples(key, title) {
  const shown = data.examples[key] || [];
  while (pics.children.length < shown.length) pics.append(document.createElement("img"));
  while (pics.children.length > shown.length) pics.lastChild.remove();
  shown.forEach((png, i) => {
    const img = pics.children[i];
    img.src = `data:image/png;base64,${png}`;
    img.alt = `Test picture ${i + 1}, ${title}`;
  });
  pics.dataset.condition = key;
  picsCaption.textContent = shown.length
    ? `${shown.length} of the test pictures, ${severity === 0 ? "clean" : `${corruptionOf(corruption).words} at severity ${severity}`}, ` +
      "as the model gets them (enlarged)"
    : "No example pictures were saved with this study.";
}

function readouts(c) {
  for (const card of grid.querySelectorAll(".ns-card")) {
    const m = data.methods[Number(card.dataset.index)].name;
    for (const metric of ["ece", "accuracy"]) {
      const dd = card.querySelector(`dd[data-metric="${metric}"]`), f = c.figures[m][metric];
      // The value and its interval each whole: a narrow card moves the interval under the value.
      dd.replaceChildren(...withInterval(f).split(" [").map((part, i) => {
        const span = document.createElement("span");
        span.textContent = i ? ` [${part}` : part;
        return span;
      }));
      dd.dataset.value = String(f[0]);
    }
  }
}

const fontSize = () => parseFloat(getComputedStyle(root).getPropertyValue("--nd-font")) || 12;

function drawDiagrams() {
  if (!data) return;
  const key = conditionKey(corruption, severity), c = data.conditions[key], m = data.n_bins, font = fontSize();
  const fill = (a) => a.map((v) => (v === null ? 0 : v));
  for (const card of grid.querySelectorAll(".ns-card")) {
    const name = data.methods[Number(card.dataset.index)].name, box = card.querySelector(".ns-binned");
    const bins = c.bins[name];
    if (box.clientWidth < 50) continue;  // a hidden tab: drawn when it gets a size
    box.innerHTML = binnedSvg({m, n: bins.count.reduce((a, b) => a + b, 0), counts: bins.count,
                               accuracy: fill(bins.accuracy), confidence: fill(bins.confidence), low: null, high: null}, {
      width: box.clientWidth, height: box.clientHeight, font, legend: false, opened: -1,
      label: `${name}, ${c.title}: reliability diagram, ${m} bins, ECE ${withInterval(c.figures[name].ece)}`,
    });
  }
}

// ECE against severity (0 = clean) for every method: a band for its interval, a line through its
// values, the current severity marked. keys: the condition of each severity.
function curveSvg(box, keys, title) {
  const width = box.clientWidth, height = box.clientHeight, font = fontSize();
  if (width < 50 || height < 50) return "";
  const c = svgCanvas(), last = keys.length - 1;
  const left = font * (width < font * 22 ? 3.4 : 4.6), right = font * 1.2, top = font * 0.8, bottom = font * 3.4;
  const inner = width - left - right, mainH = height - top - bottom;
  let largest = 0;
  for (const k of keys) {
    for (const m of data.methods) {
      const f = data.conditions[k].figures[m.name].ece;
      largest = Math.max(largest, f[2] === null ? f[0] : f[2]);
    }
  }
  const most = Math.max(2, Math.floor(mainH / (font * 2.2)));
  const step = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5].find((s) => largest / s <= most) || 0.5;
  const ceiling = Math.max(step, Math.ceil(largest / step - 1e-9) * step);
  const x = (s) => left + (s / last) * inner, y = (v) => top + (1 - v / ceiling) * mainH;
  for (let v = 0; v <= ceiling + 1e-12; v += step) {
    c.line(x(0), y(v), x(last), y(v), "nd-grid");
    c.text(x(0) - font * 0.4, y(v) + font * 0.35, pct(v, step < 0.01 ? 1 : 0), 'text-anchor="end"');
  }
  // "clean" starts at the axis, clear of the y axis's "0%" beside it.
  c.text(x(0), top + mainH + font * 1.5, "clean");
  for (let s = 1; s <= last; s++) c.text(x(s), top + mainH + font * 1.5, String(levels[s]), 'text-anchor="middle"');
  c.text(x(last / 2), height - font * 0.4, "Severity", 'text-anchor="middle"');
  if (left >= font * 4.5) {
    const mid = top + mainH / 2, at = font * 1.1;
    c.text(at, mid, "ECE", `text-anchor="middle" transform="rotate(-90 ${at.toFixed(1)} ${mid.toFixed(1)})"`);
  }
  c.line(x(at), top, x(at), top + mainH, "ns-now-line");
  const series = data.methods.map((m) => [m, keys.map((k) => data.conditions[k].figures[m.name].ece)]);
  for (const [m, figs] of series) {
    if (figs.some((f) => f[1] === null || f[2] === null)) continue;
    const high = figs.map((f, s) => [x(s), y(f[2])]), low = figs.map((f, s) => [x(s), y(f[1])]).reverse();
    c.path([...high, ...low], "ns-band", true, `style="--c:${m.colour}"`);
  }
  for (const [m, figs] of series) {
    c.path(figs.map((f, s) => [x(s), y(f[0])]), "ns-line", false, `style="--c:${m.colour}"`);
  }
  for (const [m, figs] of series) {
    figs.forEach((f, s) => {
      const now = s === at ? " ns-dot-now" : "";
      c.parts.push(`<circle cx="${x(s).toFixed(1)}" cy="${y(f[0]).toFixed(1)}" r="${(font * (now ? 0.45 : 0.28)).toFixed(1)}" ` +
                   `class="ns-dot${now}" style="--c:${m.colour}"/>`);
    });
  }
  c.rect(x(0), top, inner, mainH, "nd-frame");
  const now = series.map(([m, figs]) => `${m.name} ${pct(figs[at][0])}`).join(", ");
  return c.svg(width, height, `ECE against severity, ${title}, ${data.methods.length} methods; severity ` +
                              `${severity === 0 ? "0 (clean)" : severity} marked: ${now}`);
}

function drawCurves() {
  if (!data) return;
  curve.innerHTML = curveSvg(curve, levels.map((s) => conditionKey(corruption, s)), corruptionOf(corruption).words);
  mean.innerHTML = curveSvg(mean, levels.map(meanKey), "mean over corruptions");
}

// data-redraw-ms: from the input event (its time stamp) to every figure and read-out in the page.
function update(start = performance.now()) {
  if (!data) return;
  const key = conditionKey(corruption, severity), c = data.conditions[key], info = corruptionOf(corruption);
  severityOut.textContent = String(severity);
  severityWords.textContent = at === 0 ? "(clean)" : at === levels.length - 1 ? "(strongest)" : at === 1 ? "(mildest)" : "";
  what.textContent = info.what;
  const broken = headline(c), tail = document.createElement("span");
  tail.className = "ns-headline-tail";
  tail.textContent = broken.startsWith("Every") ? BROKEN_TAIL : "";
  head.replaceChildren(broken, tail);
  head.hidden = !broken;
  root.dataset.broken = broken ? (broken.startsWith("Every") ? "calibration" : "model") : "no";
  verdict.textContent = verdictSentence(c);
  also.replaceChildren(...alsoLine(c));
  examples(key, c.title);
  readouts(c);
  pick("#shift-curve-title").textContent = `ECE under ${info.words}`;
  pick("#shift-diagrams-title").textContent = `Reliability diagrams: ${c.title}`;
  drawCurves();
  drawDiagrams();
  root.dataset.condition = key;
  root.dataset.redrawMs = (performance.now() - start).toFixed(3);
}

function load(value) {
  if (!value || !value.conditions) {
    data = null;
    verdict.textContent = value && value.message ? value.message : "Loading the study…";
    return;
  }
  data = value;
  fillMenu();
  legend();
  diagramLegend();
  cards();
  const level = Math.round(100 * data.level);
  note.textContent = `Model ${data.model}; ${count(data.n_test)} test pictures, the same ones under every ` +
    `condition; ${data.n_bins} bins; ${data.seeds} seed${data.seeds === 1 ? "" : "s"}; Neural Clamping's fitter: ` +
    `${data.fitter}. Brackets: ${level}% intervals from ${count(data.resamples || 0)} resamples of the test ` +
    "pictures, shared by every method and condition, so differences between methods are paired.";
  update();
}

function setPosition(position, start) {
  at = position;
  severity = levels[at];
  range.value = String(at);
  update(start);
}

range.addEventListener("input", (e) => setPosition(Number(range.value), e.timeStamp));
menu.addEventListener("change", (e) => {
  corruption = menu.value;
  update(e.timeStamp);
});
// A click on a curve picks the severity nearest to it.
for (const box of [curve, mean]) {
  box.addEventListener("click", (e) => {
    if (!data) return;
    const svg = box.querySelector("svg");
    if (!svg) return;
    const r = svg.getBoundingClientRect(), font = fontSize(), last = levels.length - 1;
    const left = font * (r.width < font * 22 ? 3.4 : 4.6), inner = r.width - left - font * 1.2;
    const s = Math.round(((e.clientX - r.left - left) / inner) * last);
    if (s >= 0 && s <= last && s !== at) setPosition(s, e.timeStamp);
  });
}

const setPresenter = presenterMode(root, presenter, "ns--present", () => {
  drawCurves();
  drawDiagrams();
});
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && root.classList.contains("ns--present")) setPresenter(false);
});

// The numbers come with the first view of the tab, not with the app's first screen: a visitor who
// never opens it never downloads them. Hidden tabs have no size: draw when the boxes get one.
let asked = false;
const resize = new ResizeObserver(() => {
  if (!props.value && !asked && curve.clientWidth > 0) {
    asked = true;
    trigger("first_view");
  }
  drawCurves();
  drawDiagrams();
});
for (const box of [curve, mean, grid]) resize.observe(box);

load(props.value);
watch("value", () => load(props.value));
