"""Every setting that more than one part of NCTV uses, defined once (no heavy imports here).

The library, the command line, the web app, the bench and the scripts read these names; docs/method.md
explains the choices and docs/glossary.md the names.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, fields
from typing import Any

#: Neural Clamping fitters: "fast" (the default: T chosen by calibration ECE, then δ by L-BFGS), and the
#: two published SGD recipes run exactly, "paper" (the paper's text with the authors' momentum) and
#: "toolkit" (the authors' released demo).
FITTERS = ("fast", "paper", "toolkit")
#: How Neural Clamping sets T (nctv.calibration.clamping: "anchored" is the fast fitter's default and
#: its only, "fitted" the recipes' default).
TEMPERATURE_RULES = ("anchored", "fitted", "selected")
#: How Neural Clamping starts δ: "random" (Gaussian) or "data" (Theorem 1's δ̃).
INITS = ("random", "data")
#: Named weight-decay rules: λ is this fraction of the unperturbed model's mean focal loss (at T = 1,
#: or at the anchored T under temperature="anchored"). "auto" is the paper's rule and the default's;
#: "strong" holds δ near 0 (docs/method.md: with T learned jointly, a δ fitted at the paper's λ lowers
#: the calibration ECE more than the test's, and the T chosen after it is biased).
WEIGHT_DECAY_RULES = {"auto": 0.1, "strong": 1.0}
#: The published recipes' epochs and learning rates (nctv.calibration.clamping.RECIPES holds the rest).
RECIPE_EPOCHS = 100
RECIPE_LR = {"paper": 1e-3, "toolkit": 1e-2}
#: The spread σ of a random δ₀ ~ N(0, σ²) per fitter, where NCOptions.init_std is None: the fast fitter
#: starts at δ₀ = 0 (docs/method.md: on every panel model tied with a random start or better, cheaper,
#: and the same on every seed), the paper's recipe at σ = 0.1, the authors' demo at σ = 0.001.
INIT_STDS = {"fast": 0.0, "paper": 0.1, "toolkit": 1e-3}
#: The random δ₀ that the initialisation study (Figure 3) compares with Theorem 1's where the fitter's
#: own start is δ₀ = 0: the paper's, σ = 0.1.
STUDY_RANDOM_INIT_STD = 0.1
#: Neural Clamping's focal-loss γ by default (the paper's) and its δ initialisation.
DEFAULT_GAMMA = 1.0
#: γ values tried by ``gamma="auto"``.
GAMMA_CANDIDATES = (0.0, 0.5, 1.0, 2.0, 3.0)
#: The γ grid of the paper's Figure 2: 0 to 1 in steps of 0.05.
SWEEP_GAMMAS = tuple(round(0.05 * i, 2) for i in range(21))
#: Precisions of the model's passes (nctv.precision): "auto" measures on a GPU; "fp32" forces full precision.
PRECISIONS = ("auto", "fp32", "bf16", "fp16")

#: The rows of a paper-style table (Tables 1–3), in order.
DEFAULT_METHODS = (
    "Uncalibrated",
    "Temperature Scaling",
    "TS by Grid Search",
    "Vector Scaling",
    "Matrix Scaling",
    "MS-ODIR",
    "Dir-ODIR",
    "Neural Clamping (CE)",
    "Neural Clamping (FL)",
    "NC (Eff.)",
)
#: The rows of the ablation (Table 4), with δ frozen at 0 beside the input-only and output-only parts.
ABLATION_METHODS = (
    "Uncalibrated",
    "Temperature Scaling",
    "Temperature Scaling (FL)",
    "NC input only",
    "NC output only",
    "NC δ frozen at 0",
    "Neural Clamping (FL)",
)
#: Calibration images drawn from the calibration pool (the paper's 5,000 for Fashion-MNIST/CIFAR),
#: by the library, the command line and the web app alike.
DEFAULT_CALIBRATION_SIZE = 5000
#: Bin counts every table reports, and the runs (seeds) of every stochastic method.
DEFAULT_BINS = (10, 15, 20)
DEFAULT_SEEDS = 5
#: Images per call of the model on the CPU (on a GPU the free memory sets it; nctv.memory).
DEFAULT_BATCH_SIZE = 512
#: Grid resolutions of the timing table (Table 7).
TIMING_RESOLUTIONS = (0.01, 0.001)
#: Bin count of the table of the timing run, and of the γ sweep and the initialisation study.
STUDY_BINS = 15
#: The web app's Calibrate tab: the methods ticked when the page opens (quick on a CPU; MS-ODIR and
#: Dir-ODIR cross-validate 49 regularisation settings, minutes on a CPU, Matrix Scaling takes tens of
#: seconds: offered, not ticked), and the one bin count the app shows.
APP_METHODS = ("Uncalibrated", "Temperature Scaling", "TS by Grid Search", "Vector Scaling", "Neural Clamping (FL)")
APP_BINS = 15
#: The γ sweep tab's default grid (its "from", "to" and "step" fields: 0 to 1 by 0.1).
APP_SWEEP_GAMMAS = tuple(round(0.1 * i, 4) for i in range(11))
#: The Initialisation tab's default runs per initialisation.
APP_INIT_RUNS = 5
#: Corruptions of a shift study (nctv.corruptions defines each), in table order; the default study
#: leaves out rotation, which is not one of ImageNet-C's corruptions.
CORRUPTION_NAMES = ("gaussian-noise", "shot-noise", "gaussian-blur", "defocus-blur", "contrast", "brightness", "jpeg",
                    "pixelate", "rotation")
SHIFT_CORRUPTIONS = CORRUPTION_NAMES[:-1]
#: A corruption's severities (0, the clean image, is accepted besides them).
SEVERITIES = (1, 2, 3, 4, 5)
#: The rows of a shift study: the paper's simplest and strongest logit-space calibrators and Neural
#: Clamping; fitted once (one seed) by default, as Neural Clamping's δ is fitted once per seed.
SHIFT_METHODS = ("Uncalibrated", "Temperature Scaling", "TS by Grid Search", "Vector Scaling", "Dir-ODIR",
                 "Neural Clamping (FL)")
SHIFT_SEEDS = 1
#: Intervals of a run's figures (nctv.intervals): coverage, resamples of the test split, and how a
#: table shows them ("value [low, high]" or "value ± half-width").
DEFAULT_LEVEL = 0.95
DEFAULT_RESAMPLES = 1000
INTERVAL_STYLES = ("brackets", "pm")


@dataclass(frozen=True)
class NCOptions:
    """Neural Clamping's settings, checked once when made (a bad one raises ``ValueError`` in the
    user's words, before any model pass), then handed whole to ``NeuralClamping``.

    The command line, the app, the bench and the scripts build this object; ``NeuralClamping(model,
    options)`` and ``NeuralClamping(model, gamma=..., ...)`` build the same one.

    gamma: focal-loss γ in [0, 10] (0 = cross entropy), or "auto" (the lowest calibration ECE of
        ``gamma_candidates``, default ``GAMMA_CANDIDATES``). ``gamma_values`` (not a setting) lists the γ
        values a fit tries, in order: ``(gamma,)``, or the sorted candidates of "auto".
    weight_decay: λ ≥ 0 or a rule of ``WEIGHT_DECAY_RULES``; None = the fitter's own.

    γ, λ and the learning rate may be given as text, as typed ("0.5", " Auto ", "default"): the app's
    fields and ``nctv --gamma``, ``--weight-decay`` and ``--lr`` hand it over as it came, and this
    object reads it, in one place per setting with one message each (:meth:`setting`). The fields
    keep what they were given; :meth:`setting`, ``to_dict`` and ``NeuralClamping``'s attributes give
    the value read ("default" and "" give None, the fitter's own).
    init: "random" or "data" (Theorem 1's δ̃; the fit then needs the model's input range).
    fitter: one of ``FITTERS``. epochs, lr, momentum, batch_size, init_std: the SGD recipe's settings,
        None = the recipe's own (for the fast fitter ``batch_size`` is the chunk size of each pass).
    temperature: one of ``TEMPERATURE_RULES``; None = "anchored" for the fast fitter, "fitted" for
        the recipes. learn_delta: False keeps δ at 0 (the "δ frozen at 0" ablation).
    clamp: clamp x + δ to the input range. max_passes, tol: the fast fitter's budget and stopping rule.
    nctv.calibration.clamping describes each rule.
    """

    gamma: float | str = DEFAULT_GAMMA
    weight_decay: float | str | None = None
    init: str = INITS[0]
    fitter: str = "fast"
    epochs: int | None = None
    lr: float | str | None = None
    momentum: float | None = None
    batch_size: int | None = None
    init_std: float | None = None
    learn_delta: bool = True
    temperature: str | None = None
    clamp: bool = False
    gamma_candidates: tuple[float, ...] | None = None
    max_passes: float = 20
    tol: float = 1e-3

    def __post_init__(self) -> None:
        from nctv.checks import EPOCHS_MAX, check_nonnegative, check_positive, check_whole

        # γ (with the candidates of "auto"), λ and the learning rate are read here so that a bad one is
        # refused now, before any model pass; the values are read again where they are used.
        self.gamma_values  # noqa: B018 - read for its checks
        if self.fitter not in FITTERS:
            raise ValueError(f"fitter must be one of {FITTERS}; got {self.fitter!r}.")
        self.setting("weight_decay")
        if self.temperature is not None and self.temperature not in TEMPERATURE_RULES:
            raise ValueError(f"temperature must be one of {TEMPERATURE_RULES}; got {self.temperature!r}.")
        if self.temperature == "anchored" and self.fitter != "fast":
            raise ValueError(f"temperature='anchored' is a rule of the fast fitter; the {self.fitter!r} recipe "
                             "learns T with δ: use temperature='fitted' or 'selected'.")
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}; got {self.init!r}.")
        # SGD settings are checked whenever they are given, even to a fitter that does not use them.
        if self.epochs is not None and check_whole(self.epochs, "epochs") > EPOCHS_MAX:
            raise ValueError(f"epochs must be at most {EPOCHS_MAX:,} (the recipes use 100); got {self.epochs!r}.")
        self.setting("lr")
        if self.momentum is not None and check_nonnegative(self.momentum, "momentum") >= 1:
            raise ValueError(f"momentum must be in [0, 1); got {self.momentum!r}.")
        if self.batch_size is not None:
            check_whole(self.batch_size, "batch_size")
        if self.init_std is not None:
            check_nonnegative(self.init_std, "init_std")
        check_positive(self.max_passes, "max_passes")
        check_nonnegative(self.tol, "tol")

    def setting(self, name: str) -> Any:
        """The setting ``name`` as a fit reads it: γ, λ or the learning rate given as text read into its
        number or word (None for "default"), checked; any other setting as given."""
        value = getattr(self, name)
        read = _TEXT_READERS.get(name)
        return value if read is None else read(value)

    @property
    def gamma_values(self) -> tuple[float, ...]:
        """The γ values a fit tries, in order: ``(gamma,)``, or the sorted candidates of "auto"."""
        from nctv.checks import check_gamma

        gamma = self.setting("gamma")
        if gamma != "auto":
            return (float(gamma),)
        cands = GAMMA_CANDIDATES if self.gamma_candidates is None else self.gamma_candidates
        values = tuple(sorted({check_gamma(c, "each of gamma_candidates") for c in cands}))
        if not values:
            raise ValueError("gamma_candidates is empty; give at least one γ >= 0.")
        return values

    def init_spread(self) -> float:
        """σ of a random δ₀: ``init_std``, else the fitter's own (``INIT_STDS``)."""
        return float(self.init_std) if self.init_std is not None else INIT_STDS[self.fitter]

    @property
    def seeded(self) -> bool:
        """Whether a fit with these options depends on its seed. A recipe shuffles its batches; the fast
        fitter draws nothing but a random δ₀, and none when δ₀ = 0 (its default), when δ starts from
        Theorem 1's δ̃ or when δ is frozen: such a fit is deterministic, one fit is its whole result."""
        if self.fitter != "fast":
            return True
        return self.learn_delta and self.init == "random" and self.init_spread() > 0

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The settings' names, in order."""
        return tuple(f.name for f in fields(cls))

    def changed(self, **settings: Any) -> "NCOptions":
        """A new, checked object with ``settings`` changed (this one stays as it is)."""
        unknown = [k for k in settings if k not in self.names()]
        if unknown:
            raise ValueError(f"Unknown Neural Clamping setting(s) {', '.join(map(repr, unknown))}; "
                             f"use {', '.join(self.names())}.")
        return type(self)(**{**{k: getattr(self, k) for k in self.names()}, **settings})

    def to_dict(self) -> dict[str, Any]:
        """Every setting by name, as read (:meth:`setting`)."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k in self.names() for v in (self.setting(k),)}


def _read_gamma(value: Any) -> float | str:
    """γ: a number in [0, GAMMA_MAX] or "auto" (text: "" is "auto")."""
    from nctv.checks import GAMMA_MAX, check_gamma, check_text, number_or_word, shown

    if not isinstance(value, str):
        check_gamma(value)
        return value
    check_text(value, "Focal-loss gamma (γ)")
    parsed = number_or_word(value, ("", "auto"))
    if parsed is None or (isinstance(parsed, float) and parsed > GAMMA_MAX):
        raise ValueError(f"Focal-loss gamma (γ) must be a number from 0 to {GAMMA_MAX:g} (the paper uses 0 to 5) or "
                         f"'auto'; got {shown(value)}.")
    return "auto" if parsed == "" else parsed


def _read_weight_decay(value: Any) -> float | str | None:
    """λ: a number in [0, WEIGHT_DECAY_MAX], a rule of WEIGHT_DECAY_RULES, or None (text: "default" or "")."""
    from nctv.checks import WEIGHT_DECAY_MAX, check_at_most, check_text, number_or_word, shown

    if not isinstance(value, str):
        if value is not None:
            check_at_most(value, "weight_decay", WEIGHT_DECAY_MAX, "larger holds δ at 0")
        return value
    check_text(value, "Weight decay (λ)")
    parsed = number_or_word(value, ("", "default", *WEIGHT_DECAY_RULES))
    if parsed in ("", "default"):
        return None
    if parsed is None or (isinstance(parsed, float) and parsed > WEIGHT_DECAY_MAX):
        raise ValueError(f"Weight decay (λ) must be a number from 0 to {WEIGHT_DECAY_MAX:,.0f}, 'default', or one of "
                         f"{', '.join(map(repr, WEIGHT_DECAY_RULES))}; got {shown(value)}.")
    return parsed


def _read_lr(value: Any) -> float | None:
    """A recipe's learning rate: a number in (0, LR_MAX], or None (text: "default" or "")."""
    from nctv.checks import LR_MAX, check_at_most, check_positive, check_text, number_or_word, shown

    if not isinstance(value, str):
        if value is not None:
            check_positive(value, "lr")
            check_at_most(value, "lr", LR_MAX, "the recipes use " + " and ".join(f"{v:g}" for v in RECIPE_LR.values()))
        return value
    check_text(value, "The learning rate")
    parsed = number_or_word(value, ("", "default"))
    if parsed in ("", "default"):
        return None
    if not isinstance(parsed, float) or not 0 < parsed <= LR_MAX:
        own = ", ".join(f"{v:g} for the {name}" for name, v in RECIPE_LR.items())
        raise ValueError(f"The learning rate must be 'default' (the recipe's own: {own}) or a number above 0 and at most "
                         f"{LR_MAX:g}; got {shown(value)}.")
    return parsed


#: The settings a person types, each read by one function (NCOptions.setting).
_TEXT_READERS = {"gamma": _read_gamma, "weight_decay": _read_weight_decay, "lr": _read_lr}


def hub_datasets_available() -> bool:
    """Whether Hub datasets (``hf-dataset:<org/name>``, ``imagenet``) can be read: ``pyarrow`` is installed
    (a dependency; nctv.hubdata reads parquet with it)."""
    return importlib.util.find_spec("pyarrow") is not None


def fork_safe_environment() -> None:
    """Settings a ZeroGPU server needs before torch loads (app.py calls this first there).

    The server forks a worker for every GPU call while its own threads may be inside MKL (a picture, a
    table): MKL's memory manager keeps a lock and per-thread bookkeeping that a fork copies half-made,
    and a worker forked at such a moment spun for ever in its first matrix product (tests/test_zerogpu.py
    shows it: about one fork in four with the manager on, none with it off). MKL reads
    ``MKL_DISABLE_FAST_MM`` when torch's library loads, so it is set here, before that; the cost is
    plain ``malloc`` for MKL's work buffers. A value the operator set is kept."""
    os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")
