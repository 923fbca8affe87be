"""The ``nctv`` command: paper-style calibration runs, tables and figures from the terminal.

Every command loads a model (default: the embedded one), draws its calibration and test splits,
runs, and writes into ``--out`` (default ``./out/<command>``): ``results.json`` (schema in
docs/results-schema.md), tables (``table.md``, ``.csv``, ``.tex``, ``.json``) and figures
(``figures/*.png``, ``.pdf`` and interactive ``.html``). ``apply`` instead prints the calibrated
top-k classes of image files with a calibrator saved by ``save_pretrained``. Every command ends
with one summary line on stdout.
Errors are one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

from nctv import __version__
from nctv.methods import short_names
from nctv.settings import (
    CORRUPTION_NAMES,
    DEFAULT_GAMMA,
    GAMMA_CANDIDATES,
    RECIPE_EPOCHS,
    RECIPE_LR,
    DEFAULT_BATCH_SIZE,
    DEFAULT_BINS,
    DEFAULT_CALIBRATION_SIZE,
    DEFAULT_LEVEL,
    DEFAULT_RESAMPLES,
    DEFAULT_SEEDS,
    FITTERS,
    INITS,
    INTERVAL_STYLES,
    PRECISIONS,
    SEVERITIES,
    SHIFT_METHODS,
    SHIFT_SEEDS,
    STUDY_BINS,
    SWEEP_GAMMAS,
    TEMPERATURE_RULES,
    TIMING_RESOLUTIONS,
    NCOptions,
    hub_datasets_available,
)

#: ``nctv train --arch`` presets: name -> (timm architecture, its size arguments).
ARCH_PRESETS = {"small-resnet": ("resnet10t", {"channels": [16, 32, 64, 128], "stem_width": 8})}

EPILOG = """\
examples:
  nctv models                                   list the model zoo
  nctv run                                      all methods, 5 seeds, 10/15/20 bins, embedded model
  nctv run --seeds 2 --bins 15 --methods ts ts-grid nc-fl
  nctv run --model fmnist-vit --calibration-size 2000 --out out/vit
  nctv run --fitter toolkit                     the authors' released recipe for Neural Clamping (SGD, 100 epochs)
  nctv ablation --seeds 3                       Table 4: NC (FL) vs input-only / output-only
  nctv timing                                   Table 7: TS grid vs NC (Eff.) vs NC (FL), seconds
  nctv sweep-gamma --gammas 0 0.25 0.5 0.75 1   Figure 2: ECE, entropy, loss against gamma
  nctv init-study --seeds 5                     Figure 3: random vs data-driven delta init
  nctv shift                                    calibration under noise, blur, contrast, JPEG, ... (5 severities)
  nctv train --dataset bloodmnist --epochs 5    train a classifier, then: nctv run --model local-dir:out/train
  nctv apply --calibrator out/ts IMAGE.png      calibrated top-5 classes of images with a saved calibrator
  nctv push out/run --method ts --repo ORG/NAME one fitted calibrator to the Hugging Face Hub, with a model card

method names for --methods (full names or short ones):
  <short names>

outputs (in --out, default ./out/<command>):
  results.json, table.md / .csv / .tex / .json, figures/*.png / .pdf / .html
""".replace("<short names>", ", ".join(short_names()))  # from the registry: a new method appears here by itself


COMMAND_EXAMPLES = {
    "run": ["nctv run", "nctv run --seeds 2 --bins 15 --methods ts ts-grid nc-fl",
            "nctv run --model fmnist-vit --calibration-size 2000 --out out/vit",
            "nctv run --conformal aps --coverage 0.95",
            "nctv run --model hf-hub:timm/resnet101.tv_in1k --dataset folder:/data/imagenet/val --device cuda"],
    "ablation": ["nctv ablation", "nctv ablation --seeds 3 --gamma 0.5"],
    "timing": ["nctv timing", "nctv timing --resolutions 0.1 0.01 0.001"],
    "sweep-gamma": ["nctv sweep-gamma", "nctv sweep-gamma --gammas 0 0.25 0.5 0.75 1 --calibration-size 2000"],
    "init-study": ["nctv init-study", "nctv init-study --seeds 10 --fitter paper"],
    "shift": ["nctv shift", "nctv shift --corruptions contrast gaussian-noise --severities 1 3 5",
              "nctv shift --calibrate-on contrast/3 --out out/shift-contrast",
              "nctv shift --model fmnist-vit --methods ts ts-grid nc-fl --seeds 3"],
    "train": ["nctv train --epochs 3 --out out/my-resnet",
              "nctv train --dataset bloodmnist --arch resnet18 --epochs 5 --out out/blood",
              "nctv run --model local-dir:out/blood --dataset bloodmnist"],
    "models": ["nctv models", "nctv models --json"],
    "apply": ["nctv apply --calibrator out/ts assets/precomputed/examples/0000-ankle-boot.png",
              "nctv apply --calibrator hf-hub:<org>/<name> --model fmnist-resnet --top-k 3 shoe.png shirt.jpg"],
    "push": ["nctv push out/run --method ts --repo my-name/fmnist-resnet-ts",
             "nctv push out/run --method nc-fl --repo my-org/resnet101-nc --private",
             "nctv push out/run --method ts --repo my-name/fmnist-resnet-ts --dry-run --to out/card"],
}


def _para(text: str) -> str:
    # The raw formatter keeps the examples' layout, so descriptions are wrapped here.
    return textwrap.fill(text, 88)


def _examples(command: str) -> str:
    return "examples:\n" + "\n".join("  " + line for line in COMMAND_EXAMPLES[command])


class CLIError(Exception):
    """A mistake in how the command was called; shown as one line."""


# --------------------------------------------------------------------------- parser


def _whole(text: str, minimum: int, maximum: int) -> int:
    # ASCII digits only: int() also reads other scripts' digits ("٣" is 3) and underscores ("1_0").
    if not re.fullmatch(r"\s*[+-]?[0-9]+\s*", text):
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    v = int(text)
    if not minimum <= v <= maximum:
        raise argparse.ArgumentTypeError(f"expected a whole number from {minimum} to {maximum:,}, got {text}")
    return v


def _positive_int(text: str) -> int:
    from nctv.checks import COUNT_MAX  # at parse time: `nctv --help` imports no torch

    return _whole(text, 1, COUNT_MAX)


def _seed(text: str) -> int:
    from nctv.checks import SEED_MAX

    return _whole(text, 0, SEED_MAX)


def _size(text: str) -> int | None:
    if text.lower() in ("all", "none"):
        return None
    return _positive_int(text)


def _float(text: str) -> float:
    """A finite number: "inf", "nan" and values beyond a float's range (1e999) are refused."""
    from nctv.checks import read_number

    v = read_number(text)
    if v is None:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def _grid_step(text: str) -> float:
    """A temperature grid step: the grid T = step, 2·step, … must stay a grid a computer can hold."""
    from nctv.checks import GRID_STEP_MIN

    v = _float(text)
    if not GRID_STEP_MIN <= v <= 1:
        raise argparse.ArgumentTypeError(f"expected a grid step from {GRID_STEP_MIN:g} to 1, got {text}")
    return v


def _gamma(text: str) -> float:
    from nctv.checks import GAMMA_MAX

    v = _float(text)
    if not 0 <= v <= GAMMA_MAX:
        raise argparse.ArgumentTypeError(f"expected a gamma from 0 to {GAMMA_MAX:g}, got {text}")
    return v


#: ``nctv run --conformal``: the scores of ``nctv.conformal.SCORES`` (written here, so that parsing imports no
#: torch; a test holds the two equal), and "none" for no sets.
CONFORMAL_CHOICES = ("lac", "aps", "raps", "none")


def _coverage(text: str) -> float:
    """A conformal coverage 1 − α: a fraction strictly between 0 and 1 (0.95 for 95 %)."""
    v = _float(text)
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction between 0 and 1 (e.g. 0.95 for 95 %), got {text}")
    return v


def _nc_options(args: argparse.Namespace) -> NCOptions:
    """Neural Clamping's options from the command line (the fitter's own where none is given),
    checked as they are made: a bad one is refused before the model loads, not when its row starts
    after every baseline. γ, λ and the learning rate go as typed: NCOptions reads them (one reading and
    one message each, the app's too)."""
    given = {"gamma": getattr(args, "gamma", None), "weight_decay": args.weight_decay,
             "init": getattr(args, "init", None), "fitter": args.fitter, "epochs": args.epochs, "lr": args.lr,
             "temperature": args.temperature_rule}
    return NCOptions(**{k: v for k, v in given.items() if v is not None})


def _add_common(p: argparse.ArgumentParser, command: str, seeds: bool = True, bins: bool = True,
                gamma: bool = True, init: bool = True, default_seeds: int = DEFAULT_SEEDS) -> None:
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=None, metavar="NAME",
                   help="zoo name, hf-hub:<org>/<name> or local-dir:<folder> (default: the embedded model; "
                        "see `nctv models`)")
    g.add_argument("--dataset", default=None, metavar="NAME",
                   help="fashion-mnist, bloodmnist, cifar100, cifar100-train-tail, imagenet (from the Hub: imagenet-1k "
                        "with a token, else imagenette), imagenet-1k, imagenette, folder:<path>"
                        + (", hf-dataset:<org/name>[@split]" if hub_datasets_available() else "")
                        + " (default: the model's own; docs/datasets.md)")
    g.add_argument("--calibration-seed", type=_seed, default=0, metavar="S",
                   help="seed of the calibration subsample drawn from the pool (default 0)")
    g.add_argument("--calibration-size", type=_size, default=DEFAULT_CALIBRATION_SIZE, metavar="N",
                   help="calibration images drawn from the calibration pool ('all' for the whole pool; "
                        f"default {DEFAULT_CALIBRATION_SIZE})")
    g.add_argument("--test-size", type=_size, default=None, metavar="N",
                   help="test images (default: the whole test split)")
    g.add_argument("--device", default="auto",
                   help="cpu, cuda, cuda:1, mps or auto (default auto: a GPU when present)")
    g.add_argument("--precision", choices=list(PRECISIONS), default="auto",
                   help="precision of the model's passes: auto (default: fp32, or on a GPU mixed precision where one "
                        "measured pass shows it faster and agreeing with fp32), fp32 (forces full precision), bf16, fp16")
    g = p.add_argument_group("run")
    if seeds:
        g.add_argument("--seeds", type=_positive_int, default=default_seeds, metavar="N",
                       help=f"runs of every stochastic method, seeds 0..N-1 (default {default_seeds})")
    if bins:
        g.add_argument("--bins", type=_positive_int, nargs="+", default=list(DEFAULT_BINS), metavar="M",
                       help=f"bin counts of ECE/AECE/SCE (default {' '.join(map(str, DEFAULT_BINS))})")
    g.add_argument("--fitter", choices=list(FITTERS), default=None,
                   help="Neural Clamping fitter: fast (default: T chosen by the calibration ECE of the unperturbed model, "
                        "then δ fitted by L-BFGS at that T; about 10 passes), paper (the paper's SGD recipe with momentum 0.9) or "
                        "toolkit (the authors' released demo recipe); both recipes run 100 epochs exactly as published")
    g.add_argument("--epochs", type=_positive_int, default=None, metavar="N",
                   help=f"epochs of the paper and toolkit recipes (default {RECIPE_EPOCHS}; the fast fitter stops on "
                        "convergence)")
    if gamma:
        # Kept as typed: NCOptions reads it (one parser and one message for the app and the command line).
        g.add_argument("--gamma", default=None, metavar="G",
                       help=f"focal-loss gamma of Neural Clamping (FL) and TS (FL) (default {DEFAULT_GAMMA:g}, as in the "
                            f"paper); auto: Neural Clamping tries {', '.join(f'{g:g}' for g in GAMMA_CANDIDATES)} and "
                            "keeps the lowest calibration ECE")
    g.add_argument("--weight-decay", default=None, metavar="L",
                   help="Neural Clamping's weight decay λ: a number, auto (0.1 × the unperturbed loss, the paper's "
                        "rule) or strong (1 × that loss) (default: the fitter's own; fast: auto)")
    g.add_argument("--temperature-rule", choices=list(TEMPERATURE_RULES), default=None,
                   help="how Neural Clamping sets T: anchored (fast fitter's default: chosen by calibration ECE "
                        "before δ is fitted, then held), fitted (learned with δ; the recipes' default) or selected "
                        "(learned with δ, then re-chosen by calibration ECE) (default: the fitter's own)")
    if init:
        g.add_argument("--init", choices=list(INITS), default=None,
                       help=f"δ initialisation: random (Gaussian) or data (Theorem 1) (default {INITS[0]})")
    g.add_argument("--lr", default=None, metavar="LR",
                   help="learning rate of the paper and toolkit recipes (default: the recipe's, "
                        + " / ".join(f"{v:g}" for v in RECIPE_LR.values()) + ")")
    g.add_argument("--batch-size", type=_positive_int, default=DEFAULT_BATCH_SIZE, metavar="N",
                   help=f"images per call of the model on the CPU; on a GPU the free memory sets it (default {DEFAULT_BATCH_SIZE})")
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=Path("out") / command, metavar="DIR",
                   help=f"output folder (default out/{command})")
    g.add_argument("--no-cache", action="store_true",
                   help="do not read or write the logit cache ($NCTV_CACHE_DIR/logits, default ~/.cache/nctv/logits)")
    g.add_argument("--quiet", action="store_true", help="no progress bars; only the summary line")
    p.set_defaults(read_nc=_nc_options)


def _add_intervals(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("intervals")
    g.add_argument("--interval-level", type=_float, default=DEFAULT_LEVEL, metavar="L",
                   help=f"coverage of every interval (default {DEFAULT_LEVEL})")
    g.add_argument("--resamples", type=_positive_int, default=DEFAULT_RESAMPLES, metavar="N",
                   help=f"resamples of the test split (default {DEFAULT_RESAMPLES}; at least 100)")
    g.add_argument("--interval-seed", type=_seed, default=0, metavar="S", help="seed of the resamples (default 0)")
    g.add_argument("--interval-style", choices=list(INTERVAL_STYLES), default="brackets",
                   help="show intervals as 'value [low, high]' (brackets, the default) or 'value ± half-width' (pm)")


def _add_conformal(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("conformal prediction sets")
    g.add_argument("--conformal", type=str.lower, choices=CONFORMAL_CHOICES, default=None, metavar="SCORE",
                   help="the prediction sets every row is scored with (docs/conformal.md): lac (every class whose "
                        "probability clears one threshold; the smallest sets), aps (the most probable classes until "
                        "their probabilities add up to a threshold), raps (aps with a penalty on unlikely classes) or "
                        "none (no sets) (default lac)")
    g.add_argument("--coverage", type=_coverage, default=None, metavar="C",
                   help="how often a set should hold the true class: a fraction between 0 and 1 (default 0.9)")


def _conformal_settings(args: argparse.Namespace):
    """The run's conformal sets (``RunOptions.conformal``) from ``--conformal`` and ``--coverage``: the
    library's defaults for what is not given; None for ``--conformal none``."""
    if args.conformal == "none":
        if args.coverage is not None:
            raise CLIError("--coverage is the coverage of the conformal sets, and --conformal none makes none: "
                           "leave out one of the two.")
        return None
    from nctv.conformal import ConformalSettings

    given = {"score": args.conformal, "coverage": args.coverage}
    return ConformalSettings(**{k: v for k, v in given.items() if v is not None})


class _TrainFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown in the option list; examples kept as written."""


def _command(sub, name: str, func, summary: str, description: str, formatter=argparse.RawDescriptionHelpFormatter):
    """The subcommand ``name``, run by ``func(args)`` (``func(args, nc)`` where it reads Neural Clamping's options)."""
    p = sub.add_parser(name, help=summary, description=_para(description), epilog=_examples(name),
                       formatter_class=formatter)
    p.set_defaults(func=func)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nctv",
        description=_para("Neural Clamping Toolkit & Visualizer: calibrate a classifier with Neural Clamping and "
                          "the standard baselines, and write paper-style tables and figures."),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"nctv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    parser.set_defaults(read_nc=None)  # a command that fits Neural Clamping sets how its options are read

    p = _command(sub, "run", cmd_run, "compare calibration methods on the test split (Tables 1-3)",
                 "Fit every method on the calibration split, score it on the test split, and write tables (every "
                 "figure with its interval from resampling the test split, best marked only where the data "
                 "separate it, paired differences to the best baseline, Welch's t-test of NC (FL) against the best "
                 "baseline), reliability diagrams and the NC δ image. Prints the main table and the verdict of "
                 "Neural Clamping against TS by grid search.")
    _add_common(p, "run")
    p.add_argument("--logits", type=Path, default=None, metavar="FILE",
                   help="calibrate any classifier's logits instead of a model's: a .npz, .safetensors or .csv file "
                        "of calibration and test logits and labels, or of one set split in halves by "
                        "--calibration-seed (docs/logits.md); the logit methods only")
    p.add_argument("--methods", nargs="+", default=None, metavar="NAME",
                   help="methods to run (full names in quotes, or short names: " + ", ".join(short_names())
                        + "); default: all ten")
    _add_intervals(p)
    _add_conformal(p)

    p = _command(sub, "ablation", cmd_ablation, "NC (FL) against input-only and output-only parts (Table 4)",
                 "Neural Clamping (FL) against f(x + δ*) (input only), f(x)/T* (output only), temperature scaling "
                 "and temperature scaling with focal loss.")
    _add_common(p, "ablation")

    p = _command(sub, "timing", cmd_timing, "run time of TS grid, NC (Eff.) and NC (FL) (Table 7)",
                 "TS by grid search and NC (Eff.) at grid resolutions 0.01 and 0.001, and NC (FL): accuracy, "
                 "entropy, ECE and seconds to fit.")
    _add_common(p, "timing", seeds=False)
    p.add_argument("--resolutions", type=_grid_step, nargs="+", default=list(TIMING_RESOLUTIONS), metavar="STEP",
                   help=f"temperature grid steps (default {' '.join(map(str, TIMING_RESOLUTIONS))})")

    p = _command(sub, "sweep-gamma", cmd_sweep_gamma, "ECE, entropy and loss against gamma (Figure 2)",
                 "Fit Neural Clamping for every gamma and plot ECE, entropy and training loss on the calibration "
                 "and test splits.")
    _add_common(p, "sweep-gamma", seeds=False, bins=False, gamma=False)
    p.add_argument("--gammas", type=_gamma, nargs="+", default=list(SWEEP_GAMMAS), metavar="G",
                   help="gamma values (default 0, 0.05, ..., 1 as in the paper)")
    p.add_argument("--n-bins", type=_positive_int, default=STUDY_BINS, metavar="M",
                   help=f"ECE bins (default {STUDY_BINS})")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the random delta initialisation (default 0)")

    p = _command(sub, "init-study", cmd_init_study, "random vs data-driven delta initialisation (Figure 3)",
                 "Fit Neural Clamping from random and from data-driven (Theorem 1) δ₀, --seeds runs each, and draw "
                 "box plots of entropy, ECE, AECE and SCE on the test split.")
    _add_common(p, "init-study", bins=False, init=False)
    p.add_argument("--n-bins", type=_positive_int, default=STUDY_BINS, metavar="M",
                   help=f"bins of the metrics (default {STUDY_BINS})")

    p = _command(sub, "shift", cmd_shift, "calibration under distribution shift: noisy, blurred, faded test images",
                 "Fit every method once on the clean calibration split (or, with --calibrate-on, on a corrupted "
                 "one), then score it on the clean test split and on every corruption of it (noise, blur, contrast, "
                 "brightness, JPEG, pixelation, rotation; ImageNet-C's definitions) at every severity, each figure "
                 "with its paired interval. Writes the table of ECE and accuracy against severity, Neural Clamping "
                 "against temperature scaling with a verdict per condition, and the figure of ECE against severity "
                 "per corruption and averaged (Ovadia et al. 2019).")
    _add_common(p, "shift", bins=False, default_seeds=SHIFT_SEEDS)
    p.add_argument("--methods", nargs="+", default=None, metavar="NAME",
                   help="methods (full or short names, as for run); default: " + ", ".join(SHIFT_METHODS))
    p.add_argument("--corruptions", nargs="+", default=None, choices=list(CORRUPTION_NAMES) + ["all"], metavar="NAME",
                   help=f"corruptions ({', '.join(CORRUPTION_NAMES)}, or all; default: all but rotation)")
    p.add_argument("--severities", type=lambda t: _whole(t, 1, 5), nargs="+", default=list(SEVERITIES), metavar="S",
                   help="severities from 1 to 5 (default all five; the clean test split is always scored)")
    p.add_argument("--calibrate-on", default=None, metavar="NAME/S",
                   help="fit the calibrators on the calibration split with this corruption, e.g. contrast/3 "
                        "(calibrate for the conditions you deploy in; default: the clean split)")
    p.add_argument("--corruption-seed", type=_seed, default=0, metavar="S",
                   help="seed of the random corruptions (noise, rotation), per image (default 0)")
    p.add_argument("--n-bins", type=_positive_int, default=STUDY_BINS, metavar="M",
                   help=f"ECE bins (default {STUDY_BINS})")
    _add_intervals(p)

    p = _command(sub, "train", cmd_train, "train a classifier for calibration experiments",
                 "Train a timm classifier from scratch (plain recipe, no calibration tricks) and save it as "
                 "config.json + model.safetensors + README.md, loadable with --model local-dir:<out>.",
                 formatter=_TrainFormatter)
    p.add_argument("--dataset", default="fashion-mnist",
                   help="fashion-mnist (local, images 0-54,999), bloodmnist (downloaded once) or npz:<file> with "
                        "train_images/train_labels [test_images/test_labels] (the MedMNIST layout)")
    p.add_argument("--arch", default="small-resnet",
                   help="timm architecture name, or small-resnet = resnet10t with widths 16/32/64/128 and stem 8 "
                        "(the embedded model's size; fast on a CPU)")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="architecture argument, JSON value (repeatable), e.g. --model-arg 'channels=[16,32,64,128]'")
    p.add_argument("--class-names", nargs="+", default=None, metavar="NAME", help="class names for npz data")
    p.add_argument("--epochs", type=_positive_int, default=5, help="training epochs")
    p.add_argument("--batch-size", type=_positive_int, default=128, help="training batch size")
    p.add_argument("--lr", type=_float, default=2e-3, help="peak learning rate (AdamW, cosine schedule)")
    p.add_argument("--train-size", type=_size, default=None, metavar="N", help="use only the first N training images")
    p.add_argument("--seed", type=_seed, default=0, help="training seed")
    p.add_argument("--device", default="auto", help="cpu, cuda, mps or auto")
    p.add_argument("--out", type=Path, default=Path("out") / "train", metavar="DIR", help="model folder to write")
    p.add_argument("--quiet", action="store_true", help="no progress bars; only the summary line")

    p = _command(sub, "models", cmd_models, "list the model zoo", "List the models nctv knows by name.")
    p.add_argument("--json", action="store_true", help="print the list as JSON")

    p = _command(sub, "apply", cmd_apply, "calibrated top-k classes of image files with a saved calibrator",
                 "Load a calibrator saved with save_pretrained (a folder, or hf-hub:<org>/<name>) and the model it "
                 "was fitted for, and print each image's calibrated top-k classes with their confidences. Images "
                 "go through the model's own preprocessing (colour or grey as the model reads them, resize, "
                 "normalisation).")
    p.add_argument("images", nargs="+", metavar="IMAGE", help="image files (PNG, JPEG, WebP, BMP, GIF, ...)")
    p.add_argument("--calibrator", required=True, metavar="DIR",
                   help="folder written by save_pretrained, or hf-hub:<org>/<name>")
    p.add_argument("--model", default=None, metavar="NAME",
                   help="zoo name, hf-hub:<org>/<name> or local-dir:<folder> (default: the model the calibrator "
                        "was saved for)")
    p.add_argument("--top-k", type=_positive_int, default=5, metavar="K", help="classes shown per image (default 5)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, mps or auto (default auto)")

    p = _command(sub, "push", cmd_push, "one fitted calibrator of a run to the Hugging Face Hub, with a model card",
                 "Upload one fitted calibrator of a run folder (written by nctv run) to a Hub repository, in one "
                 "commit: config.json and calibrator.safetensors as save_pretrained writes them, the reliability "
                 "diagram on the test split, and a README model card (base model, splits, a model-index with ECE, "
                 "AECE, smooth ECE, NLL and Brier score on the test split, their 95 % intervals, how to load it). "
                 "The token comes from HF_TOKEN or the Hub's login (hf auth login).")
    p.add_argument("run", type=Path, metavar="RUN", help="run folder written by nctv run (its --out)")
    p.add_argument("--method", required=True, metavar="NAME",
                   help="the calibrator to push: a method of the run, full or short name (e.g. ts, nc-fl)")
    p.add_argument("--repo", required=True, metavar="ORG/NAME", help="the Hub repository (made if it does not exist)")
    p.add_argument("--private", action="store_true", help="make the repository private (when it is made)")
    p.add_argument("--dry-run", action="store_true", help="upload nothing: write the folder to --to instead")
    p.add_argument("--to", type=Path, default=None, metavar="DIR",
                   help="with --dry-run: a new folder to write exactly what would be uploaded")
    return parser


# --------------------------------------------------------------------------- helpers


def resolve_methods(names: Sequence[str] | None) -> list[str] | None:
    """Full method names from full or short names; commas also separate names."""
    if names is None:
        return None
    out = []
    for raw in names:
        for part in str(raw).split(","):
            part = part.strip()
            if part:
                out.append(short_names().get(part.lower(), part))
    if not out:
        raise CLIError("--methods was given without method names.")
    return out


def _load(args: argparse.Namespace):
    from nctv import data, distributed, zoo

    name = args.model or zoo.DEFAULT_MODEL
    with distributed.main_first():  # what is downloaded once is downloaded by one process
        loaded = zoo.load_model(name, device=_device(args.device))
        cal, test = data.get_splits(loaded, dataset=args.dataset, calibration_size=args.calibration_size,
                                    calibration_seed=args.calibration_seed, test_size=args.test_size)
    return loaded, cal, test


def _device(text: str):
    from nctv.inference import resolve_device

    return resolve_device(text)


def _cache(args: argparse.Namespace):
    return False if args.no_cache else None


def _save(figures: dict[str, tuple[Any, Any]], out: Path) -> None:
    """Each figure as PNG and PDF (matplotlib) and HTML (plotly, one shared plotly.min.js)."""
    from nctv.plots import save_figure

    folder = out / "figures"
    for name, (mpl, ply) in figures.items():
        save_figure(mpl, folder / f"{name}.png")
        save_figure(mpl, folder / f"{name}.pdf")
        save_figure(ply, folder / f"{name}.html", plotlyjs="directory")


def _both(fn, data) -> tuple[Any, Any]:
    return fn(data, backend="matplotlib"), fn(data, backend="plotly")


def _main_bins(bins: Sequence[int]) -> int:
    return 15 if 15 in bins else bins[0]


def _run_figures(result, test) -> dict[str, tuple[Any, Any]]:
    from nctv import plots
    from nctv.results import COMPARED_METHOD

    b = _main_bins(result.bins)
    rel = plots.reliability_data_from_result(result, n_bins=b, smooth=True)
    figs = {"reliability": _both(plots.reliability_figure, rel), "confidence": _both(plots.confidence_figure, rel)}
    with_delta = [m for m in result.methods.values() if m.delta is not None and m.delta.ndim == 3]
    nc = next((m for m in with_delta if m.name == COMPARED_METHOD), with_delta[0] if with_delta else None)
    if nc is not None:
        x, _ = next(iter(test.loader(batch_size=1)))
        temperature = nc.params.get("temperature", float("nan"))
        # The normalisation the run recorded, as the app reads it: both draw δ the same way.
        d = plots.delta_image_data(nc.delta, result.settings["mean"], result.settings["std"], example=x[0],
                                   title=f"{nc.name} δ (fitter {result.fitter}, T = {temperature:.3f})")
        figs["delta"] = _both(plots.delta_figure, d)
    return figs


def _finish(result, out: Path, figures=None, model=None, style: str = "brackets") -> str:
    """Numbers first (results.json, tables, with ``model`` the fitted calibrators), then figures,
    so a drawing problem loses no results. Of several processes, only rank 0 writes."""
    from nctv import report

    if not _writes():
        return ""
    result.save(out, model=model)
    report.write_tables(result, out, style)
    if figures is not None:
        _save(figures(), out)
    return report.summary_line(result) + f" -> {out}"


# --------------------------------------------------------------------------- commands


def _run_options(args: argparse.Namespace, nc: NCOptions, **more: Any):
    """The run's options from the command line, with Neural Clamping's ``nc`` inside."""
    from nctv.experiment import RunOptions

    return RunOptions(nc=nc, device=_device(args.device), batch_size=args.batch_size, progress=not args.quiet,
                      precision=args.precision, **more)


def _table_options(args: argparse.Namespace, nc: NCOptions, **more: Any):
    """A table run's options: the study options, its bins, the logit cache, and its seeds where it has them."""
    return _run_options(args, nc, bins=args.bins, cache_dir=_cache(args),
                        **({"seeds": args.seeds} if hasattr(args, "seeds") else {}), **more)


def cmd_run(args: argparse.Namespace, nc: NCOptions) -> str:
    from nctv import experiment

    # Names are checked before the model and data load, so a typo fails at once.
    from nctv.intervals import IntervalSettings

    options = _table_options(args, nc, intervals=IntervalSettings(args.interval_level, args.resamples,
                                                                  args.interval_seed),
                             conformal=_conformal_settings(args))
    if args.logits is not None:
        return _run_logits(args, options)
    methods = experiment.check_methods(resolve_methods(args.methods) or experiment.DEFAULT_METHODS)
    loaded, cal, test = _load(args)
    result = experiment.run_experiment(loaded, cal, test, methods, options)
    line = _finish(result, args.out, lambda: _run_figures(result, test), model=loaded, style=args.interval_style)
    return _shown_run(result, args.interval_style) + line if line else line


def _run_logits(args: argparse.Namespace, options: Any) -> str:
    """``nctv run --logits FILE``: the logit methods on a file's logits (nctv.logits_file)."""
    from nctv import experiment, logits_file

    if args.model is not None or args.dataset is not None:
        raise CLIError("--logits replaces --model and --dataset: the file holds the logits and labels.")
    chosen = resolve_methods(args.methods)
    methods = logits_file.logit_methods(experiment.check_methods(chosen) if chosen else
                                        logits_file.default_logit_methods())
    try:
        data = logits_file.read_logits(args.logits, seed=args.calibration_seed)
        result = logits_file.run_on_logits(data, methods, options)
    except ValueError as e:
        raise CLIError(str(e)) from None
    line = _finish(result, args.out, lambda: _run_figures(result, None), style=args.interval_style)
    return _shown_run(result, args.interval_style) + line if line else line


def _shown_run(result, style: str) -> str:
    """The main table with its intervals and marks, the verdict of NC against TS by grid search, and the
    conformal sets' table (the score and coverage chosen)."""
    from nctv import report

    b = _main_bins(result.bins)
    sentence = report.verdict(result, b)
    sets = report.conformal_table(result)
    return (report.to_markdown(report.results_table(result, b), style) + ("\n" + sentence + "\n" if sentence else "")
            + ("\n" + report.to_markdown(sets, style) if sets is not None else "") + "\n")


def cmd_ablation(args: argparse.Namespace, nc: NCOptions) -> str:
    from nctv import experiment

    options = _table_options(args, nc)
    loaded, cal, test = _load(args)
    result = experiment.run_ablation(loaded, cal, test, options)
    return _finish(result, args.out, lambda: _run_figures(result, test), model=loaded)


def cmd_timing(args: argparse.Namespace, nc: NCOptions) -> str:
    from nctv import experiment

    options = _table_options(args, nc)
    loaded, cal, test = _load(args)
    result = experiment.run_timing(loaded, cal, test, args.resolutions, options)
    return _finish(result, args.out)


def cmd_sweep_gamma(args: argparse.Namespace, nc: NCOptions) -> str:
    from nctv import experiment, plots, report

    options = _run_options(args, nc)
    loaded, cal, test = _load(args)
    result = experiment.run_gamma_sweep(loaded, cal, test, args.gammas, args.n_bins, args.seed, options=options)
    out = args.out
    if not _write_study(result, out, lambda: report.gamma_table(result),
                        lambda: {"gamma": _both(plots.gamma_figure, plots.gamma_curve_data_from_sweep(result))}):
        return ""
    s = result.sweep
    i = int(list(s.gammas).index(s.chosen_gamma))
    test_ece = f", test ECE {100 * s.test['ece'][i]:.2f}%" if s.test is not None else ""
    return (f"sweep-gamma: {len(s.gammas)} gammas on {result.model['name']} in {result.seconds:.1f} s; chosen gamma "
            f"{s.chosen_gamma:g} (calibration ECE {100 * s.cal['ece'][i]:.2f}%{test_ece}; {s.n_bins} bins, fitter "
            f"{s.fitter}) -> {out}")


def cmd_init_study(args: argparse.Namespace, nc: NCOptions) -> str:
    from nctv import experiment, plots, report

    options = _run_options(args, nc)
    loaded, cal, test = _load(args)
    result = experiment.run_init_study(loaded, cal, test, args.seeds, args.n_bins, options=options)
    out = args.out
    if not _write_study(result, out, lambda: report.init_study_table(result),
                        lambda: {"init_study": _both(plots.init_study_figure, plots.init_study_data_from_study(result))}):
        return ""
    ece = result.summary("ece")
    parts = [f"{'data-driven' if k == 'data' else k} ECE {100 * v.mean:.2f} ± {100 * v.std:.2f}%"
             for k, v in ece.items()]
    return (f"init-study: {args.seeds} runs per initialisation on {result.model['name']} in {result.seconds:.1f} s; "
            f"{'; '.join(parts)} ({args.n_bins} bins, fitter {result.fitter}) -> {out}")


def cmd_shift(args: argparse.Namespace, nc: NCOptions) -> str:
    from nctv import experiment, plots, report, shift
    from nctv.corruptions import CORRUPTIONS, DEFAULT_CORRUPTIONS
    from nctv.intervals import IntervalSettings

    methods = experiment.check_methods(resolve_methods(args.methods) or shift.SHIFT_METHODS)
    names = list(CORRUPTIONS) if args.corruptions == ["all"] else (args.corruptions or list(DEFAULT_CORRUPTIONS))
    # The plan is checked before the model and data load: a typo fails at once.
    shift.check_shift_plan(names, args.severities, args.calibrate_on)
    options = _run_options(args, nc, seeds=args.seeds, cache_dir=_cache(args), dataset=args.dataset,
                           intervals=IntervalSettings(args.interval_level, args.resamples, args.interval_seed))
    loaded, cal, test = _load(args)
    result = shift.run_shift(loaded, cal, test, names, args.severities, methods, options,
                             corruption_seed=args.corruption_seed, calibrate_on=args.calibrate_on, n_bins=args.n_bins)
    out = args.out
    if not _writes():
        return ""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(result.to_json(), encoding="utf-8")
    shift.write_tables(result, out, args.interval_style)
    _save({"shift": _both(plots.shift_figure, plots.shift_curve_data(result, "ece")),
           "shift-accuracy": _both(plots.shift_figure, plots.shift_curve_data(result, "accuracy"))}, out)
    table = report.to_markdown(shift.shift_table(result), args.interval_style)
    lines = shift.summary_sentences(result)
    return (table + "\n" + "\n".join(lines) + ("\n" if lines else "") +
            f"\nshift: {len(result.methods)} methods on {result.model['name']} under {len(result.corruptions)} "
            f"corruptions x {len(result.severities)} severities in {result.seconds:.1f} s -> {out}")


def _write_study(result, out: Path, table, figures) -> bool:
    """A study's results.json, table (``table()``) and figures (``figures()``) in ``out``; False, with
    nothing written, on every process but the first of a distributed run."""
    if not _writes():
        return False
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(result.to_json(), encoding="utf-8")
    _write_table(table(), out)
    _save(figures(), out)
    return True


def _write_table(table, out: Path) -> None:
    from nctv import report

    (out / "table.md").write_text(report.to_markdown(table), encoding="utf-8")
    (out / "table.csv").write_text(report.to_csv(table), encoding="utf-8")
    (out / "table.tex").write_text(report.to_latex(table), encoding="utf-8")
    (out / "table.json").write_text(report.to_json(table), encoding="utf-8")


def _model_args(items: Sequence[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CLIError(f"--model-arg {item!r} must look like KEY=VALUE, e.g. stem_width=8.")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def _training_data(args: argparse.Namespace):
    """(train, test or None, class names) as (uint8 images, labels) tuples."""
    import numpy as np

    from nctv import data

    name = args.dataset.strip()
    if name == "fashion-mnist":
        d = data.load_fashion_mnist_idx()
        # The last 5,000 training images are the calibration pool; they must stay unseen.
        train = (d["train_images"][:55_000], d["train_labels"][:55_000])
        return train, (d["test_images"], d["test_labels"]), list(data.FASHION_MNIST_CLASSES)
    if name == "bloodmnist":
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        repo, filename = data.BLOODMNIST_HUB
        try:
            path = hf_hub_download(repo, filename, repo_type="dataset")
        except LocalEntryNotFoundError:
            raise CLIError("BloodMNIST is not cached and the Hugging Face Hub cannot be reached; connect once to "
                           "download it.") from None
        names, path = list(data.BLOODMNIST_CLASSES), Path(path)
    elif name.startswith("npz:"):
        path, names = Path(name[4:]).expanduser(), args.class_names
        if not path.is_file():
            raise CLIError(f"{path} does not exist; give an .npz file with train_images and train_labels.")
    else:
        raise CLIError(f"Unknown training dataset {name!r}; use fashion-mnist, bloodmnist or npz:<file>.")
    with np.load(path, allow_pickle=False) as z:
        if "train_images" not in z.files or "train_labels" not in z.files:
            raise CLIError(f"{path} has no train_images / train_labels arrays (the MedMNIST layout).")
        train = (z["train_images"], z["train_labels"].reshape(-1))
        test = (z["test_images"], z["test_labels"].reshape(-1)) if "test_images" in z.files else None
    return train, test, names


def cmd_train(args: argparse.Namespace) -> str:
    from nctv.training import train_classifier

    train, test, names = _training_data(args)
    if args.train_size is not None:
        train = (train[0][: args.train_size], train[1][: args.train_size])
    arch, model_args = ARCH_PRESETS.get(args.arch, (args.arch, {}))
    model_args = {**model_args, **_model_args(args.model_arg)}
    result = train_classifier(
        arch, model_args, train, out_dir=args.out, class_names=names, test_split=test,
        epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed, device=_device(args.device),
        progress=not args.quiet,
        card={"name": args.out.name, "train_data": f"{args.dataset}: {len(train[1])} training images"})
    t = result.test_metrics
    scores = (f"; test accuracy {100 * t['accuracy']:.2f}%, uncalibrated ECE {100 * t['ece_15']:.2f}%" if t else "")
    return (f"train: {arch} on {args.dataset} ({len(train[1])} images, {args.epochs} epochs) in {result.seconds:.1f} s"
            f"{scores} -> {args.out} (use --model local-dir:{args.out})")


def cmd_models(args: argparse.Namespace) -> str:
    from nctv import zoo

    entries = zoo.list_models()
    if args.json:
        print(json.dumps([{"name": e.name, "source": e.source, "family": e.family, "datasets": list(e.datasets),
                           "embedded": e.embedded, "description": e.description} for e in entries], indent=2))
    else:
        width = max(len(e.name) for e in entries)
        for e in entries:
            mark = "*" if e.name == zoo.DEFAULT_MODEL else " "
            where = "embedded" if e.embedded else "Hub"
            print(f"{mark} {e.name:<{width}}  {where:<8}  {', '.join(e.datasets):<14}  {e.description}")
    return (f"models: {len(entries)} known, {sum(e.embedded for e in entries)} embedded; * = default "
            f"({zoo.DEFAULT_MODEL}). Any timm model works as --model hf-hub:<org>/<name> or local-dir:<folder>.")


def cmd_apply(args: argparse.Namespace) -> str:
    import torch

    from nctv import zoo
    from nctv.calibration import CalibratedModel, load_calibrator
    from nctv.calibration.saving import calibrator_folder, read_config
    from nctv.hub import max_model_bytes

    paths = [_image_file(text) for text in args.images]  # before anything loads: a typo fails at once
    folder = calibrator_folder(args.calibrator)
    config = read_config(folder)
    name = args.model or (config.get("model") or {}).get("name")
    if not name:
        raise CLIError(f"The calibrator {args.calibrator} does not record which model it was fitted for; "
                       "name the model with --model.")
    device = _device(args.device)
    # A model the calibrator names was chosen by whoever wrote the calibrator: the app's cap on Hub
    # weights applies to it. One named with --model is the user's own choice.
    loaded = zoo.load_model(name, device=device, max_weight_bytes=None if args.model else max_model_bytes())
    _check_saved_for(config, loaded, args.calibrator)
    calibrated = CalibratedModel(loaded, load_calibrator(folder, model=loaded))
    k = min(args.top_k, loaded.num_classes)
    for path in paths:
        x = _image_input(path, loaded).to(device)
        with torch.no_grad():
            p = torch.softmax(calibrated(x[None]).double(), dim=1)[0]
        if not bool(torch.isfinite(p).all()):
            raise CLIError(f"The calibrated confidences of {path} are not numbers (NaN or infinite): the calibrator "
                           f"{args.calibrator} does not give usable results with {loaded.name}; fit and save it "
                           "again.")
        _print_top(path, p, loaded.class_names, k)
    return (f"apply: {config['method']} from {args.calibrator} on {len(paths)} image{'s' * (len(paths) != 1)} "
            f"with {loaded.name} (top {k}, calibrated confidences)")


def cmd_push(args: argparse.Namespace) -> str:
    from nctv import push

    if args.dry_run != (args.to is not None):
        raise CLIError("--dry-run and --to go together: --dry-run --to DIR writes the folder instead of uploading it.")
    if args.dry_run:
        folder = push.prepare(args.run, args.method, args.repo, args.to)
        return f"push: dry run, nothing uploaded; {len(list(folder.iterdir()))} files for {args.repo} -> {folder}"
    url = push.push(args.run, args.method, args.repo, private=args.private)
    return f"push: {args.method} of {args.run} -> {args.repo} in one commit ({url})"


def _print_top(path: Path, probabilities, class_names: Sequence[str], k: int) -> None:
    import torch

    top = torch.topk(probabilities, k)
    names = [class_names[int(i)] for i in top.indices]
    width = max(len(n) for n in names)
    print(path)
    for name, p in zip(names, top.values):
        print(f"  {name:<{width}}  {100 * float(p):5.1f} %")


def _image_file(text: str) -> Path:
    """An image path that exists, in a format nctv reads and within its limits (checked as the app checks
    an upload: nctv.images.open_checked reads the header and the structure, not the pixels)."""
    from nctv.images import ALLOWED, ImageError, format_of, open_checked

    path = Path(text).expanduser()
    if not path.is_file():
        raise CLIError(f"{path} does not exist{' (it is a folder)' if path.is_dir() else ''}; give image files.")
    with open(path, "rb") as f:
        if format_of(f.read(12)) is None:  # the app's own sentence asks for an upload
            raise CLIError(f"{path.name} is not an image nctv can read; give {ALLOWED} files.")
    try:
        open_checked(path, path.name).close()
    except ImageError as e:
        raise CLIError(f"{path}: {e}") from None
    return path


def _image_input(path: Path, loaded) -> Any:
    """One preprocessed model input (C, H, W), converted to grey or colour as the model reads images."""
    from nctv.images import ImageError, match_channels, open_image_file

    try:
        image, _ = match_channels(open_image_file(path), int(loaded.data_config["input_size"][0]))
    except ImageError as e:
        raise CLIError(f"{path}: {e}") from None
    return loaded.preprocess(image)


def _check_saved_for(config: dict, loaded, calibrator: str) -> None:
    """Refuse a calibrator fitted for other weights: its δ or T would calibrate the wrong model."""
    from nctv.cache import model_fingerprint
    from nctv.calibration.saving import saved_for

    fingerprint = (config.get("model") or {}).get("fingerprint")
    if fingerprint and fingerprint != model_fingerprint(loaded.model):
        saved_name = (config.get("model") or {}).get("name")
        hint = f"use --model {saved_name}" if saved_name else "use the model it was saved for"
        raise CLIError(f"The calibrator {calibrator} was saved for {saved_for(config)}, not for {loaded.name!r} (the "
                       f"weights differ): {hint}, or a calibrator fitted for this model.")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``nctv`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        nc = None if args.read_nc is None else args.read_nc(args)
        writes = _join_processes(args)
        if getattr(args, "quiet", False):
            os.environ["TQDM_DISABLE"] = "1"
        line = args.func(args) if nc is None else args.func(args, nc)
    except KeyboardInterrupt:
        print("nctv: interrupted", file=sys.stderr)
        return 130
    except (CLIError, ValueError, FileNotFoundError, PermissionError, MemoryError) as e:
        print(f"nctv {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - any failure is reported as one line, never a traceback
        print(f"nctv {args.command}: error: unexpected {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return 2
    finally:
        _leave_processes()
    if writes:
        print(line if line else f"nctv {args.command}: done in {time.perf_counter() - t0:.1f} s")
    return 0


#: Commands that run data-parallel when started by torchrun (docs/distributed.md).
DISTRIBUTED_COMMANDS = ("run", "ablation", "timing", "sweep-gamma", "init-study")


def _join_processes(args: argparse.Namespace) -> bool:
    """Join torchrun's process group, if started by it; True on the process that writes and prints.

    Other processes are quiet (no progress bars, no warnings): they compute the same run."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return True
    if args.command not in DISTRIBUTED_COMMANDS:
        raise CLIError(f"nctv {args.command} runs as one process; start it without torchrun "
                       f"(torchrun runs: {', '.join(DISTRIBUTED_COMMANDS)}).")
    from nctv import distributed

    distributed.init_from_env()
    if not distributed.is_main():
        args.quiet = True
        warnings.simplefilter("ignore")
    return distributed.is_main()


def _leave_processes() -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from nctv import distributed

        distributed.shutdown()


def _writes() -> bool:
    """Whether this process writes the results: always, except on ranks > 0 of a torchrun run."""
    from nctv import distributed

    return distributed.is_main()


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
