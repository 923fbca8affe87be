"""Make ``assets/precomputed/``: the result the web app shows before anyone runs anything.

It is the app's own Calibrate run (``nctv.ui.calibrate.run_calibration``) with the page's default
settings on the embedded default model — so pressing "Run calibration" without changing anything
reproduces it — plus a few test images for the "Try your own image" tab:

    results.json              the RunResult (metrics per method, learned T, γ, λ, settings)
    test_logits.safetensors   calibrated test logits per method (+ "labels"): the reliability diagrams
    delta.safetensors         Neural Clamping's δ (normalised input space), keyed by method name
    calibrators/<method>/     every fitted calibrator (save_pretrained), for the download's calibrators.zip
    examples/*.png            one test image per class, as stored in the dataset (28 × 28 grey)

Run from the repository root:  python scripts/make_precomputed.py
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nctv.results import method_slug  # noqa: E402
from nctv.ui.calibrate import DEFAULT_METHODS, NCSettings, run_calibration  # noqa: E402
from nctv.ui.state import (DEFAULT_BINS, DEFAULT_CALIBRATION_SIZE, SplitSpec, get_model, get_splits,  # noqa: E402
                            precomputed_dir)
from nctv.zoo import DEFAULT_MODEL  # noqa: E402


def write_examples(spec: SplitSpec, folder: Path) -> list[Path]:
    """The first test image of every class, named ``NN-class.png`` (NN: its index in the test split)."""
    _, test = get_splits(spec)
    folder.mkdir(parents=True, exist_ok=True)
    labels = test.labels.tolist()
    written = []
    for k, name in enumerate(test.class_names):
        i = labels.index(k)
        path = folder / f"{i:04d}-{method_slug(name)}.png"
        test.image(i).save(path, optimize=True)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=precomputed_dir(), help="output folder (default: assets/precomputed)")
    ap.add_argument("--calibration-size", type=int, default=DEFAULT_CALIBRATION_SIZE)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bins", type=int, default=DEFAULT_BINS)
    args = ap.parse_args(argv)

    spec = SplitSpec(DEFAULT_MODEL, None, args.calibration_size, args.seed)

    def report(item: tuple) -> None:
        if item[0] == "progress":
            print(f"[{100 * item[1]:5.1f}%] {item[2]}", flush=True)

    result, _ = run_calibration(spec, DEFAULT_METHODS, args.bins, NCSettings(), report)
    if args.out.exists():
        shutil.rmtree(args.out)
    written = result.save(args.out, model=get_model(spec.model))
    written += write_examples(spec, args.out / "examples")
    for p in written:
        print(f"wrote {p} ({p.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
