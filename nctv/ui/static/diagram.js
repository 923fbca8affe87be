// Reliability diagrams drawn in the page as SVG, shared by the Calibrate and Learn tabs (each widget's
// script is this file followed by its own): the binned diagram (bars, gaps, per-bin intervals, the
// share of the pictures per group), the smoothed diagram (kernel-smoothed accuracy, its band, the
// density of the confidences), the smooth ECE itself, and the panel of an opened group's pictures.
// The smooth ECE follows nctv.metrics step for step (grid, mesh, reflected Gaussian kernel, bisection
// for the bandwidth), so that the page's number is the library's.

const pct = (x, digits = 2) => `${(100 * x).toFixed(digits)}%`;
const count = (x) => x.toLocaleString("en");
const edge = (b, m) => String(Number((100 * b / m).toFixed(1)));
const binRange = (b, m) => `${edge(b, m)}–${edge(b + 1, m)}%`;
// A confidence with two decimals; one that only rounds to 100% says so.
const sure = (c) => (c < 1 && 100 * c >= 99.995 ? ">99.99%" : pct(c));
const escapeXml = (s) => String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
  .replace(/"/g, "&quot;");

// The bin of confidence c: the first edge i/M with i/M >= c, minus one (as torch.searchsorted).
function binOf(c, m) {
  let i = Math.ceil(c * m);
  while (i > 0 && (i - 1) / m >= c) i--;
  while (i <= m && i / m < c) i++;
  return Math.min(Math.max(i - 1, 0), m - 1);
}

// ----------------------------------------------------------------------------- smooth ECE

const SMOOTH_MIN_BANDWIDTH = 1e-3, SMOOTH_STEPS = 10, DENSITY_FLOOR = 1e-4;
// Kernel weights below exp(-72) of the peak change no printed digit: the sums skip them.
const KERNEL_REACH = 12;

// Python's round(): halves go to the even neighbour.
function roundHalfEven(x) {
  const f = Math.floor(x), d = x - f;
  return d > 0.5 || (d === 0.5 && f % 2 !== 0) ? f + 1 : f;
}
const smoothGridSize = (bw) => Math.floor(Math.max(2000, roundHalfEven(20 / bw)) / 2) + 1;
const smoothMeshSize = (bw) => Math.max(200, roundHalfEven(10 / bw));

// numpy.linspace(0, 1, n): i · (1 / (n − 1)), the last point exactly 1.
function linspace(n) {
  const a = new Float64Array(n), step = 1 / (n - 1);
  for (let i = 0; i < n; i++) a[i] = i * step;
  a[n - 1] = 1;
  return a;
}

// Each sample's two weights split between its neighbouring points of a grid on [0, 1].
function spread(conf, wa, wb, grid) {
  const sa = new Float64Array(grid), sb = new Float64Array(grid);
  for (let i = 0; i < conf.length; i++) {
    const pos = conf[i] * (grid - 1);
    const left = Math.min(Math.max(Math.trunc(pos), 0), grid - 2), frac = pos - left;
    sa[left] += wa[i] * (1 - frac);
    sa[left + 1] += wa[i] * frac;
    sb[left] += wb[i] * (1 - frac);
    sb[left + 1] += wb[i] * frac;
  }
  return [sa, sb];
}

// Gaussian-kernel smoothing of two spread grids, reflected at 0 and 1, read off at the mesh points:
// the library's circular convolution over the reflected period, summed directly where the kernel
// reaches (the library weighs a source d grid steps away as the kernel at j/(grid − 1) − 1/2).
function smoothOnMesh(va, vb, bw) {
  const grid = va.length, half = Math.floor(grid / 2), period = 2 * (grid - 1);
  const norm = Math.sqrt(2 * Math.PI) * bw, two = 2 * bw ** 2, step = 1 / (grid - 1);
  const w = new Float64Array(grid);
  let jLow = grid, jHigh = -1;
  for (let j = 0; j < grid; j++) {
    const x = (j === grid - 1 ? 1 : j * step) - 0.5;
    if (Math.abs(x) > KERNEL_REACH * bw) continue;
    w[j] = Math.exp(-x * x / two) / norm;
    jLow = Math.min(jLow, j);
    jHigh = j;
  }
  // ext[s + shift]: the reflected periodic sequence at source index s, for every s a sum can reach.
  const shift = grid - 1 - half, ea = new Float64Array(2 * grid), eb = new Float64Array(2 * grid);
  for (let s = -shift; s <= grid - 1 + half; s++) {
    const r = ((s % period) + period) % period, k = r < grid ? r : period - r;
    ea[s + shift] = va[k];
    eb[s + shift] = vb[k];
  }
  const smoothedA = new Float64Array(grid), smoothedB = new Float64Array(grid), done = new Uint8Array(grid);
  const at = (t) => {
    if (done[t]) return;
    let a = 0, b = 0;
    const base = t + half + shift;
    for (let j = jLow; j <= jHigh; j++) {
      a += w[j] * ea[base - j];
      b += w[j] * eb[base - j];
    }
    smoothedA[t] = a;
    smoothedB[t] = b;
    done[t] = 1;
  };
  const mesh = linspace(smoothMeshSize(bw)), residual = new Float64Array(mesh.length);
  const density = new Float64Array(mesh.length);
  for (let i = 0; i < mesh.length; i++) {
    const pos = mesh[i] * (grid - 1);
    const left = Math.min(Math.max(Math.trunc(pos), 0), grid - 2), frac = pos - left;
    at(left);
    at(left + 1);
    residual[i] = smoothedA[left] * (1 - frac) + smoothedA[left + 1] * frac;
    density[i] = smoothedB[left] * (1 - frac) + smoothedB[left + 1] * frac;
  }
  return {mesh, residual, density};
}

// Smooth ECE of top-label confidences and 0/1 correctness (optional whole-number weights: a
// resample's counts): {value, bandwidth, curve(bw)}; the bandwidth is σ* with smECE_σ* = σ*, found by
// bisection to a multiple of 2⁻¹⁰ (as nctv.metrics.smooth_ece), unless one is given.
function smoothCalibration(conf, correct, weights = null) {
  const n = conf.length, wa = new Float64Array(n), wb = new Float64Array(n);
  let total = 0;
  for (let i = 0; i < n; i++) {
    const k = weights ? weights[i] : 1;
    wa[i] = k * (conf[i] - correct[i]);
    wb[i] = k;
    total += k;
  }
  const spreads = new Map(), sums = new Map();
  const sumsAt = (bw) => {
    if (!sums.has(bw)) {
      const grid = smoothGridSize(bw);
      if (!spreads.has(grid)) spreads.set(grid, spread(conf, wa, wb, grid));
      const [sa, sb] = spreads.get(grid);
      sums.set(bw, smoothOnMesh(sa, sb, bw));
    }
    return sums.get(bw);
  };
  const eceAt = (bw) => {
    const {residual, density} = sumsAt(bw);
    let num = 0, den = 0;
    for (let i = 0; i < residual.length; i++) {
      num += Math.abs(residual[i]);
      den += density[i];
    }
    return num / (den + DENSITY_FLOOR * residual.length);
  };
  // The smoothed accuracy t − r̂(t) and the density of the confidences (∫ ≈ 1) at bandwidth bw.
  const curve = (bw) => {
    const {mesh, residual, density} = sumsAt(bw);
    const accuracy = new Float64Array(mesh.length), dens = new Float64Array(mesh.length);
    for (let i = 0; i < mesh.length; i++) {
      accuracy[i] = mesh[i] - residual[i] / (density[i] + DENSITY_FLOOR);
      dens[i] = density[i] / total;
    }
    return {mesh, accuracy, density: dens};
  };
  return {eceAt, curve, search() {
    let low = 0, high = 1, value = eceAt(1);
    for (let s = 0; s < SMOOTH_STEPS; s++) {
      const mid = (low + high) / 2;
      if (mid < SMOOTH_MIN_BANDWIDTH) {
        low = mid;
        continue;
      }
      const v = eceAt(mid);
      if (mid < v) low = mid;
      else {
        high = mid;
        value = v;
      }
    }
    return {value, bandwidth: high};
  }};
}

// A small seeded generator (mulberry32): the page's resamples are the same on every redraw.
function seededRandom(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

// numpy.quantile's default (linear) on a sorted array.
function quantileSorted(sorted, q) {
  const pos = (sorted.length - 1) * q, lo = Math.floor(pos), hi = Math.min(lo + 1, sorted.length - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo);
}

// ----------------------------------------------------------------------------- drawing

function svgCanvas() {
  const parts = [];
  const f = (v) => v.toFixed(1);
  return {
    parts,
    text(x, y, s, attrs = "") { parts.push(`<text x="${f(x)}" y="${f(y)}" ${attrs}>${s}</text>`); },
    line(x1, y1, x2, y2, cls) {
      parts.push(`<line x1="${f(x1)}" y1="${f(y1)}" x2="${f(x2)}" y2="${f(y2)}" class="${cls}"/>`);
    },
    rect(x, y, w, h, cls, attrs = "") {
      if (w > 0 && h > 0) parts.push(`<rect x="${f(x)}" y="${f(y)}" width="${f(w)}" height="${f(h)}" class="${cls}" ${attrs}/>`);
    },
    path(points, cls, close = false, attrs = "") {
      if (points.length < 2) return;
      parts.push(`<path d="M${points.map(([x, y]) => `${f(x)},${f(y)}`).join("L")}${close ? "Z" : ""}" class="${cls}" ${attrs}/>`);
    },
    svg(width, height, label) {
      return `<svg role="group" width="${width}" height="${height}" viewBox="0 0 ${width} ${height}" ` +
        `aria-label="${escapeXml(label)}"><title>${escapeXml(label)}</title>${parts.join("")}</svg>`;
    },
  };
}

// The left margin: room for the y ticks, and for the rotated y title unless the diagram is narrow
// (the page's key then names the axis).
const leftMargin = (width, font) => (width < font * 22 ? font * 3.2 : font * 4.6);

// Y ticks and the rotated y title shared by both diagrams.
function axes(c, font, x, y, top, mainH, title) {
  const yTicks = mainH / 5 >= font * 1.5 ? [0, 0.2, 0.4, 0.6, 0.8, 1] : [0, 0.5, 1];
  for (const v of yTicks) {
    c.line(x(0), y(v), x(1), y(v), "nd-grid");
    c.text(x(0) - font * 0.4, y(v) + font * 0.35, pct(v, 0), 'text-anchor="end"');
  }
  if (x(0) < font * 4.5) return;
  const yMid = top + mainH / 2, at = font * 1.1;
  c.text(at, yMid, title, `text-anchor="middle" transform="rotate(-90 ${at.toFixed(1)} ${yMid.toFixed(1)})"`);
}

// Confidence ticks under a strip whose bottom is at py, and the x title at the bottom of the box of
// ``width``: "100%" moves left as far as it takes to stay inside the box in a wide font (about 3.2 em).
function xAxis(c, font, x, inner, py, height, width) {
  const ticks = inner / 5 >= font * 3 ? 5 : 2;
  for (let i = 0; i <= ticks; i++) {
    const at = i === ticks ? Math.min(x(1), width - font * 1.7) : x(i / ticks);
    c.text(at, py + font * 1.4, pct(i / ticks, 0), 'text-anchor="middle"');
  }
  const words = inner >= font * 24 ? "Confidence (probability of the predicted class)" : "Confidence";
  c.text(x(0.5), height - font * 0.4, words, 'text-anchor="middle"');
}

// Legend entries above a diagram: one row if they fit (about 0.55 em a character), else one per entry.
function legendRows(c, entries, font, left, inner, draw) {
  if (!entries.length) return 0;
  const width = entries.reduce((w, [, s]) => w + (s.length * 0.55 + 3) * font, 0);
  const rows = width <= inner ? 1 : entries.length;
  if (draw) {
    let lx = left, ly = font * 1.2;
    for (const [cls, label] of entries) {
      if (cls === "nd-diag" || cls === "nd-curve") c.line(lx, ly - font * 0.35, lx + font * 1.6, ly - font * 0.35, cls);
      else c.rect(lx, ly - font * 0.8, font * 1.6, font * 0.9, cls);
      c.text(lx + font * 2, ly, label);
      if (rows === 1) lx += (label.length * 0.55 + 3) * font;
      else ly += font * 1.6;
    }
  }
  return rows;
}

const FADE_STEPS = 8;
const BINNED_LEGEND = [["nd-acc", "Share correct"], ["nd-gap", "Gap to confidence"], ["nd-diag", "Honest model"]];
const SMOOTH_LEGEND = [["nd-curve", "Share correct, smoothed"], ["nd-band", "95% band"], ["nd-diag", "Honest model"]];

// The binned reliability diagram. b: {m, n, counts, confidence, accuracy (bin means), low, high (the
// accuracy's interval per bin, or null)}; o: {width, height, font, label, legend, opened (a bin or -1),
// groupLabel(b) for the clickable targets, or none}.
function binnedSvg(b, o) {
  const {width, height, font} = o;
  const c = svgCanvas();
  const left = leftMargin(width, font), right = font * 1.2, inner = width - left - right;
  const legend = o.legend ? BINNED_LEGEND : [];
  const rows = legendRows(c, legend, font, left, inner, false);
  const top = rows ? rows * font * 1.6 + font * 0.6 : font * 0.8;
  const histH = Math.max(font * 3.5, height * 0.2), between = font * 1.2, bottom = font * 3.6;
  const mainH = height - top - histH - between - bottom;
  const x = (v) => left + v * inner, y = (v) => top + (1 - v) * mainH;
  const hy0 = top + mainH + between, hy = (v) => hy0 + (1 - v) * histH;
  axes(c, font, x, y, top, mainH, "Share correct");
  const m = b.m, w = inner / m - 2;
  let largest = 0;
  for (let k = 1; k < m; k++) if (b.counts[k] > b.counts[largest]) largest = k;
  // The count strip's title, top left (about 0.55 em a character).
  const stripTitle = inner >= font * 17 ? "Share of the pictures in each group" : "Share of pictures";
  const titleEnd = x(0) + font * 0.4 + stripTitle.length * 0.55 * font;
  for (let k = 0; k < m; k++) {
    if (!b.counts[k]) continue;
    const x0 = x(k / m) + 1, acc = b.accuracy[k], conf = b.confidence[k];
    c.rect(x0, y(acc), w, y(0) - y(acc), "nd-acc");
    // Where the group is right more often than it is sure (under-confident), the gap lies inside the
    // accuracy bar: outlined, not filled, so the bar keeps its colour.
    c.rect(x0, y(Math.max(acc, conf)), w, Math.abs(y(acc) - y(conf)), acc > conf ? "nd-gap nd-gap-under" : "nd-gap");
    const share = b.counts[k] / b.n;
    c.rect(x0, hy(share), w, hy(0) - hy(share), "nd-hist");
    // The share of the crowded groups, written on the bar (inside it when it is tall).
    if (share >= 0.05 && w >= font * 2) {
      const inside = hy(0) - hy(share) > font * 1.6;
      c.text(x0 + w / 2, inside ? hy(share) + font * 1.15 : hy(share) - font * 0.3, pct(share, 0),
             `text-anchor="middle"${inside ? ' class="nd-on-bar"' : ""}`);
    } else if (k === largest && share >= 0.05) {
      // Bars too narrow to write on: the largest group's share just above its bar, ending at its right
      // edge (every other bar is lower), where that clears the strip's title; else beside the bar.
      const words = pct(share, 0), base = hy(share) - font * 0.3, textTop = base - font;
      const clearOfTitle = x0 + w - words.length * 0.6 * font > titleEnd || textTop > hy(1) + font * 1.4;
      if (textTop >= hy(1) + font * 0.2 && clearOfTitle) {
        c.text(x0 + w, base, words, 'text-anchor="end"');
      } else if (x0 - x(0) > font * 8) {
        c.text(x0 - font * 0.3, Math.max(hy(share), hy(1) + font * 2.4) + font * 0.9, words, 'text-anchor="end"');
      }
    }
  }
  // The accuracy's interval per group: a whisker with caps at the group's centre.
  if (b.low && b.high) {
    for (let k = 0; k < m; k++) {
      if (!b.counts[k] || b.low[k] === null || b.high[k] === null) continue;
      const cx = x((k + 0.5) / m), cap = Math.min(w * 0.3, font * 0.5);
      c.line(cx, y(b.low[k]), cx, y(b.high[k]), "nd-whisker");
      c.line(cx - cap, y(b.low[k]), cx + cap, y(b.low[k]), "nd-whisker");
      c.line(cx - cap, y(b.high[k]), cx + cap, y(b.high[k]), "nd-whisker");
    }
  }
  c.line(x(0), y(0), x(1), y(1), "nd-diag");
  // One focusable target per non-empty group over its whole column: click, tap or Enter opens it
  // (none where the groups have no pictures to open: no groupLabel).
  for (let k = 0; o.groupLabel && k < m; k++) {
    if (!b.counts[k]) continue;
    const open = o.opened === k ? " nd-hit--open" : "";
    c.rect(x(k / m) + 1, top, w, hy(0) - top, `nd-hit${open}`,
           `data-bin="${k}" tabindex="0" role="button" aria-label="${escapeXml(o.groupLabel(k))}"`);
  }
  c.rect(x(0), top, inner, mainH, "nd-frame");
  c.rect(x(0), hy0, inner, histH, "nd-frame");
  // The count panel's scale is fixed (0 to 100% of the pictures), so it reads the same after every move.
  c.text(x(0) - font * 0.4, hy(1) + font * 0.8, "100%", 'text-anchor="end"');
  c.text(x(0) - font * 0.4, hy(0) - font * 0.1, "0%", 'text-anchor="end"');
  c.text(x(0) + font * 0.4, hy(1) + font * 1.1, stripTitle);
  xAxis(c, font, x, inner, hy(0), height, width);
  legendRows(c, legend, font, left, inner, true);
  return c.svg(width, height, o.label);
}

// The smoothed reliability diagram. s: {mesh, accuracy, density, low, high (or null)}; o: {width,
// height, font, label, legend}.
function smoothSvg(s, o) {
  const {width, height, font} = o;
  const c = svgCanvas();
  const left = leftMargin(width, font), right = font * 1.2, inner = width - left - right;
  const legend = o.legend ? SMOOTH_LEGEND.filter(([cls]) => cls !== "nd-band" || s.low) : [];
  const rows = legendRows(c, legend, font, left, inner, false);
  const top = rows ? rows * font * 1.6 + font * 0.6 : font * 0.8;
  const histH = Math.max(font * 3.5, height * 0.2), between = font * 1.2, bottom = font * 3.6;
  const mainH = height - top - histH - between - bottom;
  const clip = (v) => Math.min(Math.max(v, 0), 1);
  const x = (v) => left + v * inner, y = (v) => top + (1 - clip(v)) * mainH;
  const hy0 = top + mainH + between;
  axes(c, font, x, y, top, mainH, "Share correct");
  const n = s.mesh.length, pts = (ys) => Array.from({length: n}, (_, i) => [x(s.mesh[i]), y(ys[i])]);
  if (s.low && s.high) c.path([...pts(s.high), ...pts(s.low).reverse()], "nd-band", true);
  c.line(x(0), y(0), x(1), y(1), "nd-diag");
  // Where few predictions lie the smoothed curve means little: it fades there (its opacity grows with
  // the density of the confidences, 1 for a uniform density), in a few steps of one path each.
  const level = (i) => Math.round(FADE_STEPS * Math.min(1, 0.15 + (s.density[i] + s.density[i + 1]) / 2));
  const curve = pts(s.accuracy);
  for (let i = 0; i < n - 1;) {
    const k = level(i);
    let j = i;
    while (j < n - 1 && level(j) === k) j++;
    c.path(curve.slice(i, j + 1), "nd-curve", false, `stroke-opacity="${(k / FADE_STEPS).toFixed(2)}"`);
    i = j;
  }
  // The density of the confidences as a profile, scaled to its strip.
  let peak = 0;
  for (let i = 0; i < n; i++) peak = Math.max(peak, s.density[i]);
  if (peak > 0) {
    const profile = Array.from({length: n}, (_, i) => [x(s.mesh[i]), hy0 + histH * (1 - s.density[i] / peak)]);
    c.path([[x(0), hy0 + histH], ...profile, [x(1), hy0 + histH]], "nd-hist", true);
  }
  c.rect(x(0), top, inner, mainH, "nd-frame");
  c.rect(x(0), hy0, inner, histH, "nd-frame");
  c.text(x(0) + font * 0.4, hy0 + font * 1.1, inner >= font * 17 ? "Density of the confidences" : "Density");
  xAxis(c, font, x, inner, hy0 + histH, height, width);
  legendRows(c, legend, font, left, inner, true);
  return c.svg(width, height, o.label);
}

// Presenter mode on a widget's root (the whole screen in large type: diagram.css's nd-present and the
// widget's own class cls), toggled by its button; redraw draws the figures at their new size. Returns
// set(on), for the widget's own Escape.
function presenterMode(root, button, cls, redraw) {
  const set = (on) => {
    root.classList.toggle("nd-present", on);
    root.classList.toggle(cls, on);
    root.dataset.presenter = on ? "on" : "off";
    button.setAttribute("aria-pressed", String(on));
    button.textContent = on ? "Leave presenter mode" : "Presenter mode";
    redraw();
  };
  button.addEventListener("click", () => set(!root.classList.contains(cls)));
  return set;
}

// A key of the diagrams' marks: one small swatch per entry, in the diagrams' own classes (so it follows
// the theme). entries: [kind ("box", "line" or "whisker"), class, words].
function diagramKey(entries) {
  const f = 14, w = f * 1.8;
  const mark = {
    box: (cls) => `<rect x="1" y="1" width="${w - 2}" height="${f - 2}" class="${cls}"/>`,
    line: (cls) => `<line x1="1" y1="${f / 2}" x2="${w - 1}" y2="${f / 2}" class="${cls}"/>`,
    whisker: (cls) => `<line x1="${f * 0.9}" y1="1" x2="${f * 0.9}" y2="${f - 1}" class="${cls}"/>` +
      `<line x1="${f * 0.6}" y1="1" x2="${f * 1.2}" y2="1" class="${cls}"/>` +
      `<line x1="${f * 0.6}" y1="${f - 1}" x2="${f * 1.2}" y2="${f - 1}" class="${cls}"/>`,
  };
  return entries.map(([kind, cls, words]) => `<span><svg width="${w}" height="${f}" aria-hidden="true">` +
    `${mark[kind](cls)}</svg>${words}</span>`).join("");
}

// ----------------------------------------------------------------------------- an opened group

// The panel of an opened group, added at the end of root (ids prefix-bin, prefix-bin-title, …): its
// header at once, its pictures when the server answers the latest request for them.
function groupPanel(root, prefix) {
  const section = document.createElement("section");
  section.className = "nd-bin";
  section.id = `${prefix}-bin`;
  section.hidden = true;
  section.setAttribute("aria-labelledby", `${prefix}-bin-title`);
  section.innerHTML = `<div class="nd-bin-head"><h3 id="${prefix}-bin-title" tabindex="-1"></h3>` +
    `<button type="button" id="${prefix}-bin-close">Close</button></div>` +
    `<p class="nd-bin-note" id="${prefix}-bin-note" role="status" aria-live="polite"></p>` +
    `<ul class="nd-bin-list" id="${prefix}-bin-list"></ul><p class="nd-bin-more" id="${prefix}-bin-more"></p>`;
  root.append(section);
  const part = (name) => section.querySelector(`#${prefix}-bin-${name}`);
  const panel = {section, title: part("title"), note: part("note"), list: part("list"), more: part("more"),
                 close: part("close"), request: 0, isOpen: false};
  // Show a group's header; the number it returns goes with the request for its pictures.
  panel.open = (heading, focus) => {
    panel.request += 1;
    panel.isOpen = true;
    panel.title.textContent = heading;
    panel.note.textContent = "Loading the pictures…";
    panel.list.replaceChildren();
    panel.more.textContent = "";
    section.hidden = false;
    if (focus) {
      panel.title.focus({preventScroll: true});
      section.scrollIntoView({block: "nearest"});
    }
    return panel.request;
  };
  // The server's answer: true when it answers the latest request with pictures (a message is shown).
  panel.accepts = (answer) => {
    if (!panel.isOpen || !answer || answer.request !== panel.request) return false;  // closed, or an older group's
    if (answer.message) panel.note.textContent = answer.message;
    return !answer.message;
  };
  panel.hide = () => {
    panel.isOpen = false;
    section.hidden = true;
    panel.list.replaceChildren();
  };
  return panel;
}

// One picture of an opened group: verdict, true label, the model's answer before and after
// calibration, and the confidence before and after. names: [before, after] of the two columns.
function pictureItem(p, names) {
  const li = document.createElement("li"), img = document.createElement("img"), dl = document.createElement("dl");
  li.className = p.right ? "nd-pic" : "nd-pic nd-pic--wrong";
  li.dataset.row = String(p.row);
  img.src = p.src;
  img.alt = `Test picture ${p.row}, a ${p.label}`;
  if (p.small) img.className = "nd-pixelated";
  const verdict = document.createElement("dt");
  verdict.className = "nd-verdict";
  verdict.textContent = p.right ? "Right" : "Wrong";
  dl.append(verdict);
  const rows = [["True", p.label], ["Model", p.prediction]];
  if (p.prediction_after !== p.prediction) rows.push([`Model, ${names[1]}`, p.prediction_after]);
  rows.push([names[0], sure(p.confidence_before)]);
  if (names[1] !== names[0]) rows.push([names[1], sure(p.confidence_after)]);
  for (const [name, value] of rows) {
    const dt = document.createElement("dt"), dd = document.createElement("dd");
    dt.textContent = name;
    dd.textContent = value;
    dl.append(dt, dd);
  }
  li.append(img, dl);
  return li;
}
