// δ made visible (after nctv/ui/delta.py's HTML): the picture as the model gets it, picture + t × k × δ
// and the change k × δ around mid-grey, painted on canvases from the pixel arrays the server sent once
// (data-input, 0–255; data-delta, in 0–255 levels; channel-major). A new amplification k or blend t
// repaints at once, in the page; values are rounded and clipped to 0–255 as a picture's pixels are.
const state = { k: 1, t: 1 };
// The arrays of the view shown, parsed once. Keyed by their text, not by the element: a new value may
// update the element in place (its attributes), and a new picture must not be painted with the old one.
let parsed = null;
function numbers(root) {
  const { input, delta } = root.dataset;
  if (!parsed || parsed.input !== input || parsed.delta !== delta) {
    parsed = { input, delta, x: JSON.parse(input), d: JSON.parse(delta) };
  }
  return parsed;
}
function paint(canvas, c, h, w, value) {
  const ctx = canvas.getContext("2d", { willReadFrequently: true });
  const img = ctx.createImageData(w, h);
  for (let p = 0; p < h * w; p++) {
    for (let rgb = 0; rgb < 3; rgb++) {
      const v = Math.round(value((c === 1 ? 0 : rgb) * h * w + p));
      img.data[4 * p + rgb] = Math.min(255, Math.max(0, v));
    }
    img.data[4 * p + 3] = 255;
  }
  ctx.putImageData(img, 0, 0);
}
function draw() {
  const root = element.querySelector(".nctv-delta");
  if (!root) return;
  const c = +root.dataset.channels, h = +root.dataset.height, w = +root.dataset.width;
  const { x, d } = numbers(root);
  const { k, t } = state;
  root.querySelectorAll(".nctv-amplify input").forEach((r) => { r.checked = +r.value === k; });
  root.querySelector(".nctv-blend input").value = t;
  paint(root.querySelector("canvas[data-panel=input]"), c, h, w, (i) => x[i]);
  paint(root.querySelector("canvas[data-panel=blend]"), c, h, w, (i) => x[i] + t * k * d[i]);
  paint(root.querySelector("canvas[data-panel=change]"), c, h, w, (i) => 128 + k * d[i]);
  root.querySelector("[data-caption=blend]").textContent =
    t === 1 ? `Picture + δ × ${k}` : t === 0 ? "Picture (δ blended out)" : `Picture + ${t} × δ × ${k}`;
  const change = root.querySelector("[data-caption=change]");
  change.textContent = change.textContent.replace(/δ × \d+/, `δ × ${k}`);
  const largest = +root.dataset.largest;
  root.querySelector(".nctv-delta-scale").textContent =
    `At ×${k} the largest change is ${(k * largest).toFixed(1)} of 255 levels` +
    (k * largest > 127 ? " (beyond the range where it is shown: clipped)." : ".");
}
function pick(event) {
  const target = event.target;
  if (!target.closest) return;
  if (target.closest(".nctv-amplify")) state.k = +target.value;
  else if (target.closest(".nctv-blend")) state.t = +target.value;
  else return;
  draw();
}
element.addEventListener("input", pick);
element.addEventListener("change", pick);
watch("value", draw);
draw();
