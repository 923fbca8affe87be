"""Make ``assets/precomputed/``: the result the web app shows before anyone runs anything.

It is the engine's run (``nctv.experiment.run_experiment``) that the app's Calibrate tab makes with the
page's default settings on the embedded default model — so pressing "Run calibration" without changing
anything reproduces it — plus a few test images for the "Try your own image" tab:

    results.json              the RunResult (metrics per method, learned T, γ, λ, settings)
    test_logits.safetensors   calibrated test logits per method (+ "labels"): the reliability diagrams
    delta.safetensors         Neural Clamping's δ (normalised input space), keyed by method name
    calibrators/<method>/     every fitted calibrator (save_pretrained), for the download's calibrators.zip
    examples/*.png            one test image per class, as stored in the dataset (28 × 28 grey)
    shift.json                the Shift tab's study: the default methods and corruptions at every severity,
                              fitted on the clean calibration split, with 6 corrupted test images per condition
    ood.safetensors           the Try tab's out-of-distribution detector (class means, covariance, held-out
                              scores), fitted as the app fits it: a pre-computed calibration's Try tab then
                              needs neither the calibration images nor a model pass over them

``--only shift`` (or ``--only ood``) writes shift.json (or ood.safetensors) alone and leaves the rest as it is. Each file is what today's code
makes: tests/test_one_answer.py reruns the run and parts of every study with the functions below and
compares them with the shipped files (on any machine: to 1e-5 relative, 1e-4 absolute, the same verdicts;
the Neural Clamping fit itself is the same to about 1e-15 on every CPU), so a change of behaviour cannot
land with a stale result. Each part prints its time when it ends; after a change that moves the shipped
figures, the whole remake is this one command again (docs/app.md gives its times).

Any model of the menu, or any model id, on any dataset: ``--model`` and ``--dataset`` (the model's own
by default; ``--test-size`` keeps the test logits small for a 1000-class model). Another model's study
goes to ``assets/precomputed/models/<name>/``, where the app opens it when a visitor picks that model,
or, uploaded as the folder ``<name>/`` of a Hugging Face dataset repository, to wherever
``NCTV_PRECOMPUTED_REPO`` names (docs/app.md). The Space's operator runs it once on a GPU:

    python scripts/make_precomputed.py --model resnet101-imagenet --calibration-size 5000 --test-size 5000

Run from the repository root:  python scripts/make_precomputed.py
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nctv.data import assets_dir, get_splits  # noqa: E402
from nctv.experiment import RunOptions, run_experiment, run_gamma_sweep, run_init_study  # noqa: E402
from nctv.inference import resolve_device  # noqa: E402
from nctv.results import GAMMA_SWEEP_FILE, INIT_STUDY_FILE, method_slug  # noqa: E402
from nctv.shift import run_shift  # noqa: E402
from nctv.settings import (APP_BINS, APP_INIT_RUNS, APP_METHODS, APP_SWEEP_GAMMAS,  # noqa: E402
                           DEFAULT_CALIBRATION_SIZE, NCOptions)
from nctv.zoo import DEFAULT_MODEL, ENTRIES, load_model  # noqa: E402

#: Corrupted test images kept per condition for the Shift tab.
SHIFT_EXAMPLES = 6
#: The page's Neural Clamping settings left at their defaults: γ = 1, the fast fitter, the fitter's own δ₀
#: (tests/test_one_answer.py checks that the page builds these options).
APP_NC = NCOptions(gamma=1.0, fitter="fast", init="random")


def write_examples(test, folder: Path) -> list[Path]:
    """The first test image of every class, named ``NN-class.png`` (NN: its index in the test split)."""
    folder.mkdir(parents=True, exist_ok=True)
    labels = test.labels.tolist()
    written = []
    for k, name in enumerate(test.class_names):
        i = labels.index(k)
        path = folder / f"{i:04d}-{method_slug(name)}.png"
        test.image(i).save(path, optimize=True)
        written.append(path)
    return written


def default_run(loaded, cal, test, seed: int = 0, bins: int = APP_BINS, callback=None, dataset: str | None = None):
    """The Calibrate tab's run with the page's default settings."""
    options = RunOptions(seeds=[seed], bins=[bins], nc=APP_NC, progress=False, callback=callback, dataset=dataset)
    return run_experiment(loaded, cal, test, APP_METHODS, options)


def default_sweep(loaded, cal, test, seed: int = 0, bins: int = APP_BINS, gammas=APP_SWEEP_GAMMAS, callback=None):
    """The γ sweep tab's first screen: its default grid, 0 to 1 by 0.1, with the page's other settings."""
    return run_gamma_sweep(loaded, cal, test, gammas, bins, seed,
                           options=RunOptions(nc=APP_NC, progress=False, callback=callback))


def default_init_study(loaded, cal, test, seed: int = 0, bins: int = APP_BINS, runs: int = APP_INIT_RUNS,
                       callback=None):
    """The Initialisation tab's: its default of 5 runs per initialisation."""
    return run_init_study(loaded, cal, test, runs, bins, seed,
                          options=RunOptions(nc=APP_NC, progress=False, callback=callback))


def default_shift(loaded, cal, test, seed: int = 0, bins: int = APP_BINS, corruptions=None, methods=None,
                  callback=None):
    """The Shift tab's: every default corruption and severity, the default methods, one seed (a part
    of it: ``corruptions``, ``methods``)."""
    return run_shift(loaded, cal, test, corruptions=corruptions, methods=methods,
                     options=RunOptions(seeds=[seed], nc=APP_NC, progress=False, callback=callback),
                     n_bins=bins, examples=SHIFT_EXAMPLES)


def default_splits(calibration_size: int = DEFAULT_CALIBRATION_SIZE, seed: int = 0, model: str = DEFAULT_MODEL,
                   dataset: str | None = None, test_size: int | None = None):
    """The model (the embedded default unless named) and the splits the page draws by default."""
    loaded = load_model(model, device=resolve_device(None))
    cal, test = get_splits(loaded, dataset, calibration_size=calibration_size, calibration_seed=seed,
                           test_size=test_size)
    return loaded, cal, test


def default_ood(loaded, cal, test, model: str, dataset: str | None, calibration_size: int, seed: int,
                test_size: int | None, out: Path) -> Path:
    """The Try tab's out-of-distribution detector, fitted as the app fits it on these splits
    (``nctv.ood.fit_on_splits``, seed 0), written to ``out/ood.safetensors`` with the draw it belongs to."""
    from nctv.ood import OOD_FILE, fit_on_splits, save_detector, split_about

    path = out / OOD_FILE
    save_detector(fit_on_splits(loaded.model, cal, test), path,
                  split_about(model, dataset, calibration_size, seed, test_size))
    return path


def timed(part: str, make, *args, **kwargs):
    """``make(*args, **kwargs)``, printing how long ``part`` took (the remake's parts, for docs/app.md)."""
    start = time.perf_counter()
    made = make(*args, **kwargs)
    print(f"{part}: {time.perf_counter() - start:.0f} s", flush=True)
    return made


def clear(out: Path) -> None:
    """Empty ``out`` for a new study, keeping the other models' studies (``models/``) inside it."""
    for child in out.iterdir() if out.is_dir() else ():
        if child.name != "models":
            shutil.rmtree(child) if child.is_dir() else child.unlink()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"a menu name or model id (default: {DEFAULT_MODEL})")
    ap.add_argument("--dataset", default=None, help="the model's own dataset unless given")
    ap.add_argument("--test-size", type=int, default=None, help="test images (default: the whole test split)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default: assets/precomputed, or assets/precomputed/models/<name> for "
                         "another model)")
    ap.add_argument("--calibration-size", type=int, default=DEFAULT_CALIBRATION_SIZE)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bins", type=int, default=APP_BINS)
    ap.add_argument("--only", choices=["all", "shift", "ood", "init"], default="all",
                    help="shift: write shift.json alone, keeping every other file; ood: the same for "
                         "ood.safetensors, the Try tab's out-of-distribution detector; init: the same for "
                         "the initialisation study")
    args = ap.parse_args(argv)
    if args.out is None and args.model not in ENTRIES:
        ap.error(f"--out is needed for {args.model!r}: the app opens the studies of its menu's models only")
    if args.out is None:
        args.out = assets_dir() / "precomputed" / ("" if args.model == DEFAULT_MODEL else f"models/{args.model}")

    loaded, cal, test = default_splits(args.calibration_size, args.seed, args.model, args.dataset, args.test_size)

    def report(fraction: float, message: str) -> None:
        print(f"[{100 * fraction:5.1f}%] {message}", flush=True)

    # The menu's models are pre-computed on part of their test pool; the default on all of it (the app's draw).
    test_size = None if args.model == DEFAULT_MODEL else len(test)
    if args.only == "ood":
        args.out.mkdir(parents=True, exist_ok=True)
        print(f"wrote {default_ood(loaded, cal, test, args.model, args.dataset, len(cal), args.seed, test_size, args.out)}")
        return 0
    if args.only == "init":
        study = timed("initialisation study", default_init_study, loaded, cal, test, args.seed, args.bins,
                      callback=report)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / INIT_STUDY_FILE).write_text(study.to_json(), encoding="utf-8")
        print(f"wrote {args.out / INIT_STUDY_FILE}")
        return 0
    shift = timed("shift study", default_shift, loaded, cal, test, args.seed, args.bins, callback=report)
    if args.only == "shift":
        print(f"wrote {shift.save(args.out, indent=None)}")
        return 0
    result = timed("default run", default_run, loaded, cal, test, args.seed, args.bins, report, dataset=args.dataset)
    sweep = timed("γ sweep", default_sweep, loaded, cal, test, args.seed, args.bins, callback=report)
    study = timed("initialisation study", default_init_study, loaded, cal, test, args.seed, args.bins, callback=report)
    clear(args.out)
    written = result.save(args.out, model=loaded)
    for name, study_result in ((GAMMA_SWEEP_FILE, sweep), (INIT_STUDY_FILE, study)):
        (args.out / name).write_text(study_result.to_json(), encoding="utf-8")
        written.append(args.out / name)
    written.append(shift.save(args.out, indent=None))
    written.append(timed("out-of-distribution detector", default_ood, loaded, cal, test, args.model, args.dataset,
                         len(cal), args.seed, test_size, args.out))
    if args.model == DEFAULT_MODEL:  # the Try tab's examples are the embedded default's
        written += write_examples(test, args.out / "examples")
    for p in written:
        print(f"wrote {p} ({p.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
