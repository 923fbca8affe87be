"""The Learn tab's lesson: seven steps from an honest model to prediction sets, each setting the view
(T, the bins, an opened group) and saying one short paragraph with the numbers of the model in use.

The page computes every number that depends on the view ({t}, {now.ece}, {group.acc}, …: learn.js
fills them as it fills the table), so a step costs no request; the numbers of the calibration itself
(its fitted temperatures, its run's ECE and intervals) are written here once, when the page gets its
data (:func:`nctv.ui.learn.page_data`). "An honest model" is the same model at the temperature-scaling
fit: the page holds one model's test logits, and that T makes them about as honest as any calibration
in the run (ECE 1.1 % on the shipped default).
"""
from __future__ import annotations

from dataclasses import dataclass

from nctv.ui.session import Calibration

#: A step's T: "one" (the model as trained), "fit" (the temperature-scaling fit) or a number.
FIT, ONE = "fit", "one"
#: A step's opened group: the one that holds the most test pictures at the step's T and bins.
FULLEST = "fullest"


@dataclass(frozen=True)
class Step:
    """One step: its title and the view it sets (``t``; ``bins`` None = the calibration's own; ``group``
    None = no group opened); its paragraph comes from :func:`paragraphs`."""

    title: str
    t: str | float
    bins: int | None = None
    group: str | None = None


STEPS = (
    Step("An honest model", FIT),
    Step("An over-confident model", ONE),
    Step("Reading the diagram", ONE, group=FULLEST),
    Step("Temperature", 2.0),
    Step("ECE and its interval", ONE),
    Step("What Neural Clamping's δ changes", FIT),
    Step("Prediction sets", FIT),
)


def _nc_text(cal: Calibration) -> str:
    """Step 6's paragraph: what Neural Clamping changes, with the run's figures where it has them."""
    nc = cal.nc_method
    ts = cal.metrics.get("Temperature Scaling", {})
    lead = ("Temperature scaling only rescales the scores: the order of the classes, and so every answer, stays. "
            "**Neural Clamping** also learns one small change δ added to every picture before the model sees it, "
            "and a temperature with it.")
    if nc is None or cal.nc_temperature is None or "ece" not in cal.metrics.get(nc, {}) or "ece" not in ts:
        return lead + (" This calibration has no Neural Clamping row: tick it in the Calibrate tab and run, and "
                       "this step gives its figures.")
    m = cal.metrics[nc]
    return (lead + f" In this calibration {nc} learned T = {cal.nc_temperature:.3f}; its test ECE is "
            f"**{100 * m['ece']:.2f}%** against {100 * ts['ece']:.2f}% for temperature scaling ({cal.n_bins} bins), "
            f"accuracy {100 * m['accuracy']:.2f}%. The diagram here is temperature scaling's, T = {{fit}}; the "
            "Calibrate tab draws Neural Clamping's own and shows δ.")


def _interval_text(cal: Calibration) -> str:
    """Step 5's paragraph: ECE is measured on a sample, so it comes with an interval (the run's own)."""
    u = cal.metrics.get("Uncalibrated", {})
    head = ("ECE is measured on {n} test pictures, so it carries noise: at T = {t} and {bins} bins it reads "
            "**{now.ece}%**.")
    if u.get("ece_low") is None or u.get("ece_high") is None:
        return head + " Move the bins slider: with fewer, wider bins ECE changes too."
    return (head + f" The run's 95% interval for the model as trained ({cal.n_bins} bins), from resampling the "
            "test pictures, is "
            f"**[{100 * u['ece_low']:.2f}, {100 * u['ece_high']:.2f}]%**: another draw of as many pictures could "
            "give any figure in it. A difference between two methods counts only when its interval excludes 0. "
            "The bins matter as well: move the bins slider and watch ECE move.")


def paragraphs(cal: Calibration, n: int) -> list[str]:
    """Each step's paragraph (Markdown, **bold** only, with the page's placeholders) for calibration
    ``cal`` whose page holds ``n`` test pictures, in the order of :data:`STEPS`."""
    return [
        "This is what honest looks like. Each bar is a group of test pictures answered with about the same "
        "confidence; its height is the share of them the model got right. For an honest model every bar reaches "
        "the dashed diagonal: of the pictures answered with about 80% confidence, about 80% are right. Here the "
        "bars' average distance from the diagonal, the **ECE**, is **{now.ece}%**. (This is the lesson's model "
        "made honest by temperature scaling, T = {fit}: step 4 shows how.)",
        f"The same {n:,} test pictures as the model answers them after training. It is right on "
        "**{now.accuracy}%** of them, but its mean confidence is **{confidence}%**: it is surer than it is right. "
        "The bars stay below the diagonal and ECE is **{now.ece}%**. Deep networks trained to fit their data are "
        "often like this.",
        "The fullest group, opened below the diagram, holds the {group.count} pictures answered with "
        "{group.range} confidence, {group.share}% of all. Their mean confidence is **{group.conf}%** and "
        "**{group.acc}%** of them are right: the difference is the gap drawn in red. Below the diagram are some "
        "of them, wrong answers first. The strip under the bars shows how many pictures each group holds.",
        "Temperature scaling divides the model's scores by one number T before turning them into probabilities. "
        "T above 1 makes every answer less sure; the answers themselves never change, so accuracy stays "
        "{now.accuracy}%. At T = {t}, ECE is **{now.ece}%** (at T = 1 it was {one.ece}%). The T that fits the "
        "calibration pictures best is **{fit}**, with ECE {fit.ece}%: press \"Set T to the temperature-scaling "
        "fit\", or drag the slider.",
        _interval_text(cal),
        _nc_text(cal),
        "Instead of one answer, a model can give a set of classes that holds the right one 90% of the time (APS "
        "sets: the likeliest classes, added until they are sure enough). At T = {t} such a set holds **{aps}** "
        "classes on average; with the model as trained (T = 1), {aps.one}. A set is only as good as the "
        "probabilities it is built from: move T and watch its size.",
    ]
