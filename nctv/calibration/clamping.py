"""Neural Clamping: a learned input perturbation δ and one temperature T on a frozen model.

    calibrated logits = f(x + δ) / T
    δ*, T* = argmin  mean_i FL_γ(f(x_i + δ)/T, y_i) + λ‖δ‖²₂        FL_γ = −(1 − p_y)^γ log p_y

δ has the shape of one model input, in the model's preprocessed space (after resize, crop and
normalisation). The model is never changed: it runs in eval mode, its parameters get no gradients
and its weights stay bit-identical. All outputs are logits (never probabilities), float32 on the CPU.

Decisions where the paper leaves room (they hold for every class and function here):

* **λ rules**: "auto" (the paper recipe's and the default's) is 0.1 × the mean focal loss FL_γ of
  the *unperturbed* model (δ = 0, at T = 1, or at the anchored T under the default temperature
  rule) on the calibration split; "strong" is 1.0 × that loss. Measured at δ = 0, λ depends only on
  (model, split, γ).
* **Cost** is counted in passes over the calibration split (``n_passes_``; ``expected_passes()``
  gives the plan): forward + backward to the input = 1, forward only = 0.5.
* **fitter="paper"** and **fitter="toolkit"** run the published recipes exactly (``RECIPES``):
  mini-batch SGD with momentum 0.9 on (δ, T), random δ₀ drawn first from
  ``torch.Generator().manual_seed(seed)``, then one ``randperm`` per epoch from the same generator.
* **δ₀**: the fast fitter starts at δ₀ = 0 (``INIT_STDS``), so a default fit draws nothing random
  and is the same on every seed (on every panel model it is tied with a random start or better,
  and cheaper: docs/method.md); ``init_std=σ`` starts it at δ₀ ~ N(0, σ²) instead, drawn in float64
  (the same on every CPU kernel set, which float32 draws are not). The recipes keep their published
  random starts, drawn as the authors' code draws them.
* **fitter="fast"** (default) minimises the objective with full-batch L-BFGS, gradients
  accumulated over the pieces of each pass and a strong-Wolfe line search; it stops on a relative
  objective change below ``tol`` or at ``max_passes``. Its default temperature rule is "anchored":
  T is chosen first, on the unperturbed calibration logits f(x), by the mean ECE over 10, 15 and 20
  bins (``select_temperature``), held fixed while L-BFGS fits δ alone to the focal objective at
  that T with the paper's λ ("auto"), and kept. The objective's own optimum T is under-confident for
  γ = 1 (a focal loss is not a proper scoring rule), and a T re-chosen after δ is biased by δ's fit
  of the calibration split. The other rules learn log T with δ ("fitted"; T warm-started by an
  exact 1-D solve on the unperturbed logits) and may re-choose it afterwards ("selected", with λ
  "strong"). docs/method.md gives the measurements behind these choices.
* **Repeatability**: random draws come from a local ``torch.Generator`` on the CPU (global RNG
  untouched), so a seeded fit repeats exactly on the CPU, and on a GPU as far as the model's own
  kernels are deterministic. The fast fitter's passes run a float64 copy of the model (batch
  normalisations folded into their convolutions, pieces of at most ``EXACT_CPU_PIECE`` images on the
  CPU, computed side by side on one thread each) from a start that breaks max-pooling ties (``exact_twin``, ``tie_breaking_start``; Theorem 1's
  δ̃ is moved by the same pattern), so its δ and T are the same on every machine, whatever its CPU
  kernels or thread count (docs/method.md, "Reproducibility").
* **init="data"** is Theorem 1's δ̃ (``data_driven_delta``); it needs ``input_range`` = (α, β),
  the preprocessed images of pixel values 0 and 1 (``LoadedModel.input_range``). Without α, β the
  theorem has no room to move δ, so a missing range is an error rather than a silent δ̃ = 0.
* **γ = "auto"** tries ``gamma_candidates`` (default ``GAMMA_CANDIDATES`` = 0, 0.5, 1, 2, 3) and
  keeps the lowest calibration-set ECE (15 bins; ties to the smaller γ). Every candidate is fitted
  on its own, from the same start with the same budget (a recipe: a run of it with the same seed),
  so the fit "auto" keeps is the fit of that γ alone, and a γ sweep's row is a run's fit at that γ.
* **clamp=True** clamps x + δ to [α, β] element-wise (needs ``input_range``).
* **Memory**: every pass calls the model on pieces of ``batch_size`` images on the CPU, and on CUDA
  as many as the free memory allows; a piece that runs out of memory is retried at half its size
  (``nctv.memory``). A recipe's SGD batch cut into pieces gets the sum of its pieces' gradients, so
  its step is the batch's own; results differ from an uncut run by rounding only.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from nctv.calibration.base import BaseCalibrator
from nctv.calibration.deploy import input_bounds
from nctv.checks import check_gamma, check_whole
from nctv.calibration.clamping_fit import (
    FitResult,
    InputStream,
    Problem,
    Reporter,
    SGDSettings,
    StopFitting,
    best_log_temperature,
    check_label_range,
    entropy_gradient,
    EXACT_CPU_PIECE,
    exact_twin,
    fit_fast,
    fit_sgd,
    frozen,
    mean_focal,
    theorem1_delta,
    tie_breaking_start,
)
from nctv import precision
from nctv.inference import DEFAULT_BATCH_SIZE, model_device, resolve_device
from nctv.settings import (FITTERS, GAMMA_CANDIDATES, INIT_STDS, RECIPE_EPOCHS, RECIPE_LR, SWEEP_GAMMAS,
                           WEIGHT_DECAY_RULES, NCOptions)

__all__ = [
    "GAMMA_CANDIDATES", "SWEEP_GAMMAS", "NCOptions", "NeuralClamping", "EfficientNeuralClamping", "StopFitting",
    "data_driven_delta", "GammaFit", "PreparedSplit",
]

#: Temperature rules: "fitted" keeps the objective's T; "selected" re-chooses T on the calibration
#: logits f(x + δ) by the mean ECE over SELECTION_BINS, on the grid SELECTION_STEP … SELECTION_T_MAX;
#: "anchored" (the default, fast fitter only) chooses T that way on the unperturbed logits f(x) before
#: δ is fitted, holds it fixed while δ is fitted, and keeps it. (TEMPERATURE_RULES: nctv.settings.)
SELECTION_BINS = (10, 15, 20)
SELECTION_STEP = 0.001
SELECTION_T_MAX = 10.0


@dataclass(frozen=True)
class Recipe:
    """An SGD recipe for (δ, T) with every setting it fixes (the constructor's None means these)."""

    sgd: SGDSettings
    init_std: float
    weight_decay: float | str
    penalty: str  # "squared": λ‖δ‖²₂; "norm": λ‖δ‖₂
    prob_floor: float  # focal loss on p_y clamped to [floor, 1 − floor]; 0 = no clamp


#: The two published recipes, exactly (docs/method.md gives their sources).
RECIPES = {
    # The paper's text (section 4, appendix A) with the optimiser of the authors' code (momentum 0.9).
    "paper": Recipe(SGDSettings(epochs=RECIPE_EPOCHS, lr=RECIPE_LR["paper"], momentum=0.9, batch_size=512),
                    init_std=INIT_STDS["paper"],
                    weight_decay="auto", penalty="squared", prob_floor=0.0),
    # The authors' demo.py with NCWrapper.train_NC: λ₁‖δ‖₂ not squared, FocalLoss's 1e-7 clamp.
    "toolkit": Recipe(SGDSettings(epochs=RECIPE_EPOCHS, lr=RECIPE_LR["toolkit"], momentum=0.9, batch_size=1000),
                      init_std=INIT_STDS["toolkit"],
                      weight_decay=0.01, penalty="norm", prob_floor=1e-7),
}
assert FITTERS == ("fast", *RECIPES), "nctv.settings.FITTERS must list the fast fitter and every recipe"


# --------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------


def _compute_device(model: torch.nn.Module, device: Any) -> torch.device:
    """The model's own device; a ``device`` that names another one is an error (the model is not moved)."""
    own = model_device(model)
    if device is None:
        return own
    dev = resolve_device(device)
    has_state = any(True for _ in model.parameters()) or any(True for _ in model.buffers())
    if has_state and (dev.type != own.type or (dev.index is not None and own.index is not None and dev.index != own.index)):
        raise ValueError(f"The model is on {own} but device={device!r} was asked for; move the model first (model.to(...)).")
    return own if has_state else dev


def _rule_weight_decay(rule: str, z0: torch.Tensor, labels: torch.Tensor, gamma: float, log_t: float = 0.0) -> float:
    return WEIGHT_DECAY_RULES[rule] * mean_focal(z0, labels, gamma, log_t)


def select_temperature(logits: torch.Tensor, labels: torch.Tensor, n_bins: Sequence[int] = SELECTION_BINS,
                       step: float = SELECTION_STEP, t_max: float = SELECTION_T_MAX) -> tuple[float, float]:
    """The T on step, 2·step, …, t_max minimising the mean ECE over ``n_bins`` of logits / T, and that mean."""
    from nctv.calibration.temperature import grid_search_temperature, temperature_grid

    grid = temperature_grid(step, t_max)
    t, values = grid_search_temperature(logits.detach().cpu(), labels.cpu(), grid=grid, n_bins=tuple(n_bins))
    return t, float(np.nanmin(values))


def _ece(logits: torch.Tensor, labels: torch.Tensor, n_bins: int = 15) -> float:
    from nctv.metrics import ece

    return ece(logits, labels, n_bins=n_bins)


class _InputCalibrator(BaseCalibrator):
    """Common surface of the input-space calibrators: prediction f(x + δ)/T on the model's inputs."""

    model: torch.nn.Module
    _fit_arguments = "inputs, labels"

    def clamp_bounds(self, shape: tuple[int, ...], device: torch.device):
        """(α, β) of the input range on ``device`` when δ is clamped to it, else None."""
        return input_bounds(self.input_range, shape, device) if getattr(self, "clamp", False) else None

    def predict_logits(self, inputs_or_loader: Any, labels: Any = None, use_delta: bool = True,
                       use_temperature: bool = True, batch_size: int = DEFAULT_BATCH_SIZE) -> torch.Tensor:
        """Calibrated logits f(x + δ)/T (N, K), float32 on the CPU.

        ``use_delta=False`` drops δ (the "output only" ablation: f(x)/T); ``use_temperature=False``
        drops T (the "input only" ablation: f(x + δ)). ``labels`` are optional and only checked
        against the number of inputs (a loader's labels are ignored).
        """
        self._check_fitted("delta_")
        batch_size = check_whole(batch_size, "batch_size")
        device = _compute_device(self.model, getattr(self, "device", None))
        with frozen(self.model):
            split = InputStream(inputs_or_loader, labels, device, batch_size, need_labels=False)
            if split.input_shape != tuple(self.delta_.shape):
                raise ValueError(
                    f"inputs have shape {split.input_shape} per sample but δ was fitted for {tuple(self.delta_.shape)}."
                )
            delta = self.delta_.to(device) if use_delta else None
            problem = Problem(self.model, split, 0.0, 0.0, self.clamp_bounds(split.input_shape, device))
            z = problem.logits(delta)
        if use_temperature:
            z = z / self.temperature_
        return z.float().cpu()


# --------------------------------------------------------------------------------------------
# Theorem 1 and NC (Eff.)
# --------------------------------------------------------------------------------------------


def data_driven_delta(model: torch.nn.Module, inputs_or_loader: Any, input_range: Any,
                      batch_size: int = DEFAULT_BATCH_SIZE, device: Any = None) -> torch.Tensor:
    """Theorem 1's data-driven δ̃ (CPU float32 tensor, the shape of one input). One backward pass.

    g = Σ_i ∇_x H(softmax(f(x_i))) (T = 1, natural-log entropy); ℓ, μ the element-wise min and
    max of the inputs; (α, β) = ``input_range`` (numbers or tensors broadcastable to one input);
    η_j = ℓ_j − α_j where g_j < 0, β_j − μ_j where g_j > 0, else 0; δ̃ = sign(g) ⊙ η. An element
    whose data already lie beyond [α, β] gets η = 0. Labels, if the loader yields them, are unused.
    """
    batch_size = check_whole(batch_size, "batch_size")
    dev = _compute_device(model, device)
    with frozen(model):
        split = InputStream(inputs_or_loader, None, dev, batch_size, need_labels=False)
        alpha, beta = input_bounds(input_range, split.input_shape, dev)
        g, lo, hi, _ = entropy_gradient(Problem(model, split, 0.0, 0.0))
    return theorem1_delta(g, lo, hi, alpha, beta).cpu()


class EfficientNeuralClamping(_InputCalibrator):
    """NC (Eff.), the paper's appendix F: δ = δ̃ (Theorem 1), then T by the TS grid search on f(x + δ̃).

    No training: one backward pass for δ̃ and one forward pass for the logits (``n_passes_`` = 1.5),
    then T on the grid ``grid_step``, 2·``grid_step``, …, ``t_max`` with the lowest calibration-set
    ECE (``n_bins`` equal-width bins). ``input_range`` = (α, β) is required.
    """

    def __init__(self, model: torch.nn.Module, input_range: Any = None, grid_step: float = 0.001, t_max: float = 5.0,
                 n_bins: int = 15, clamp: bool = False, batch_size: int = DEFAULT_BATCH_SIZE, device: Any = None):
        self.model = model
        self.input_range = input_range
        self.grid_step = grid_step
        self.t_max = t_max
        self.n_bins = n_bins
        self.clamp = clamp
        self.batch_size = batch_size
        self.device = device

    def fit(self, inputs_or_loader: Any, labels: Any = None) -> "EfficientNeuralClamping":
        from nctv.calibration.temperature import grid_search_temperature, temperature_grid

        grid = temperature_grid(self.grid_step, self.t_max)
        batch_size = check_whole(self.batch_size, "batch_size")
        if self.input_range is None:
            raise ValueError("NC (Eff.) needs input_range=(alpha, beta), the preprocessed images of pixel values 0 and 1.")
        dev = _compute_device(self.model, self.device)
        with frozen(self.model):
            split = InputStream(inputs_or_loader, labels, dev, batch_size)
            alpha, beta = input_bounds(self.input_range, split.input_shape, dev)
            problem = Problem(self.model, split, 0.0, 0.0, (alpha, beta) if self.clamp else None)
            g, lo, hi, z0 = entropy_gradient(problem)
            check_label_range(split.labels, z0.shape[1])
            delta = theorem1_delta(g, lo, hi, alpha, beta)
            z = problem.logits(delta)
        best_t, _ = grid_search_temperature(z.cpu(), split.labels.cpu(), grid=grid, n_bins=self.n_bins)
        self.delta_ = delta.cpu()
        self.temperature_ = float(best_t)
        self.n_passes_ = split.passes
        return self


# --------------------------------------------------------------------------------------------
# Neural Clamping
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Start:
    """What every fit on one calibration split shares: unperturbed logits and, for init="data", δ̃,
    the passes they took, and log T of the anchored rule (chosen on z0; None under other rules)."""

    z0: torch.Tensor | None
    delta_tilde: torch.Tensor | None
    passes: float
    anchor: float | None


@dataclass
class GammaFit:
    """One fit of a γ path (``NeuralClamping.fit_prepared``): its γ, its λ and what the fitter found
    (``result.delta``, ``result.log_t``, ``result.logits`` on the calibration split, ``result.passes``)."""

    gamma: float
    weight_decay: float
    result: FitResult


@dataclass
class PreparedSplit:
    """A calibration split made ready for fits (``NeuralClamping.prepare``): on its device, with the
    first pass that every fit on it shares (the unperturbed logits and, for init="data", δ̃) done."""

    problem: Problem
    start: _Start

    @property
    def labels(self) -> torch.Tensor:
        return self.problem.split.labels

    @property
    def passes(self) -> float:
        """Passes over the split so far, the shared first one included."""
        return self.problem.split.passes


#: The fast fitter warns below this many calibration images per value of δ (see small_split_message).
SMALL_SPLIT_FACTOR = 2


def small_split_message(n: int, size: int) -> str:
    """The warning for a calibration split too small for the fast fitter's δ.

    Measured on the embedded fmnist-resnet (δ of 784 values, 2.05 % uncalibrated test ECE): NC (CE)
    reached 1.06 % test ECE from 5,000 images and 1.81 % from 2,000, but 2.71 % from 1,000 and
    9.8 % from 300, where δ fits the split's noise (calibration ECE 0.4 %, T 0.08).
    """
    return (f"Neural Clamping: {n} calibration images for a δ of {size} values (fewer than "
            f"{SMALL_SPLIT_FACTOR} per value). On so few images δ can fit their noise: the calibration ECE "
            "falls while the test ECE rises. Use more calibration images (5,000 is the paper's size) or a "
            "larger weight decay λ.")


class NeuralClamping(_InputCalibrator):
    """Neural Clamping: learns δ (``delta_``) and T (``temperature_``) on a calibration split.

    Parameters
    ----------
    model: a frozen classifier taking a batch tensor (N, ...) and returning logits (N, K), K >= 2.
    options: the fit's settings, an :class:`~nctv.settings.NCOptions` (checked when it was made);
        keyword ``settings`` (its field names) build the same object, or change the given one:
    gamma: focal-loss γ >= 0 (0 = cross entropy, "NC (CE)"), or "auto" (see the module docstring).
    weight_decay: λ >= 0, or a rule: "auto" = 0.1 × the unperturbed model's mean FL_γ on the split (the
        paper's; at the anchored T under temperature="anchored"), "strong" = 1.0 × it; None = the
        fitter's own ("auto" for "fast" with the anchored T, "strong" for "fast" with another
        temperature rule, "auto" for "paper", 0.01 on the unsquared ‖δ‖₂ for "toolkit").
    init: "random" (δ₀ ~ N(0, σ²), seeded; σ = ``init_std``, by default the fitter's own: 0 for the fast
        fitter, so δ₀ = 0) or "data" (Theorem 1's δ̃; needs ``input_range``).
    fitter: "fast" (L-BFGS, the default), "paper" (the paper's SGD recipe with momentum 0.9) or
        "toolkit" (the authors' released demo); ``RECIPES`` holds the recipes' settings.
    epochs, lr, momentum, batch_size, init_std: the SGD recipe's settings; None = the recipe's own.
        For the fast fitter ``batch_size`` is only the chunk size of each pass on the CPU (on CUDA
        the free memory sets it; ``nctv.memory``).
    temperature: "anchored" (fast fitter only: T is chosen on the unperturbed calibration logits f(x)
        to minimise the mean ECE over 10, 15 and 20 bins, then held fixed while δ minimises the
        objective, and kept), "fitted" (T learned with δ from the objective, as the paper) or
        "selected" (T learned with δ, then re-chosen on f(x + δ) by that mean ECE); None = "anchored"
        for the fast fitter, "fitted" for the recipes.
    learn_delta: False keeps δ at 0 and fits T alone with the same fitter (the "δ frozen at 0" ablation:
        which part of the gain is the temperature's path rather than δ's).
    clamp: clamp x + δ to ``input_range``.
    gamma_candidates: candidates for gamma="auto" (default ``GAMMA_CANDIDATES``).
    max_passes, tol: the fast fitter's budget in passes and its relative-change stopping rule.

    Besides the options, what ties a fit to its data and its caller:
    input_range: (α, β), numbers or tensors of one input's shape.
    seed: makes a run repeat exactly on the same device (a local generator; global RNG untouched).
    device: None = the model's device. The model is never moved.
    progress: show a tqdm bar (default off). callback: called with a dict (step, loss, temperature,
        passes, expected_passes; the paper fitter adds epoch) after every evaluation (fast) or SGD step
        (paper); "loss" is the objective (fast) or the batch loss (paper); "expected_passes" is the
        fit's plan (``expected_passes()``). Raising ``StopFitting`` in it ends the fit early.

    ``get_params`` lists the options by their own names (as ``set_params`` and ``clone`` take them),
    so a saved calibrator records each setting.

    Learned state: ``delta_`` (CPU float32, one input's shape), ``temperature_`` (the T used),
    ``fitted_temperature_`` (the objective's T), ``gamma_``, ``weight_decay_``, ``objective_`` (F at
    (δ, fitted T), exactly over the split), ``history_``,
    ``n_passes_``, ``fitter_``, ``candidates_`` (per tried γ: gamma, weight_decay, temperature,
    objective, ece), ``stopped_early_``.
    """

    stochastic = True
    #: The settings that are not Neural Clamping's options: the data's range and the caller's wiring.
    _RUN_PARAMS = ("input_range", "seed", "device", "progress", "callback")

    def __init__(self, model: torch.nn.Module, options: NCOptions | None = None, *, input_range: Any = None,
                 seed: int = 0, device: Any = None, progress: bool = False,
                 callback: Callable[[dict], Any] | None = None, **settings: Any):
        base = NCOptions() if options is None else options
        self.model = model
        self.options = base.changed(**settings) if settings else base
        self.input_range = input_range
        self.seed = seed
        self.device = device
        self.progress = progress
        self.callback = callback

    def __getattr__(self, name: str) -> Any:
        # Each option reads as an attribute (nc.gamma, nc.fitter), as scikit-learn's settings do: as read
        # (γ typed "0.5" reads 0.5), so that get_params, clone and a saved config hold the values fitted.
        options = self.__dict__.get("options")
        if options is not None and name in NCOptions.names():
            return options.setting(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def _param_names(cls) -> tuple[str, ...]:
        return ("model", *NCOptions.names(), *cls._RUN_PARAMS)

    def set_params(self, **params: Any) -> "NeuralClamping":
        """Change settings by name: options give a new checked ``options`` object; returns ``self``."""
        self._check_param_names(params)
        options = {k: v for k, v in params.items() if k in NCOptions.names()}
        if options:
            self.options = self.options.changed(**options)
        for name, value in params.items():
            if name not in options:
                setattr(self, name, value)
        return self

    # ---- settings ------------------------------------------------------------------------

    def _recipe(self) -> Recipe | None:
        return RECIPES.get(self.fitter)

    def _setting(self, name: str) -> Any:
        """An option as the fit uses it: the given value, or the fitter's own where it is None."""
        value = self.options.setting(name)
        if value is not None:
            return value
        recipe = self._recipe()
        if name in ("epochs", "lr", "momentum", "batch_size"):
            if recipe is None:
                return DEFAULT_BATCH_SIZE if name == "batch_size" else None
            return getattr(recipe.sgd, name)
        if name == "init_std":
            return INIT_STDS["fast"] if recipe is None else recipe.init_std
        if name == "weight_decay":
            if recipe is not None:
                return recipe.weight_decay
            return "auto" if self._setting("temperature") == "anchored" else "strong"
        if name == "temperature":
            return "anchored" if recipe is None else "fitted"
        raise AttributeError(name)

    def _sgd(self) -> SGDSettings:
        return SGDSettings(int(self._setting("epochs")), float(self._setting("lr")), float(self._setting("momentum")),
                           int(self._setting("batch_size")), bool(self.learn_delta))

    def _validate(self) -> None:
        """The fit's needs of the data and its seed (the options were checked when made)."""
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise ValueError(f"seed must be a whole number; got {self.seed!r}.")
        if (self.init == "data" or self.clamp) and self.input_range is None:
            what = "init='data'" if self.init == "data" else "clamp=True"
            raise ValueError(f"{what} needs input_range=(alpha, beta): the preprocessed images of pixel values 0 and 1.")

    def _lambda(self, start: _Start, labels: torch.Tensor, gamma: float, log_t: float = 0.0) -> float:
        weight_decay = self._setting("weight_decay")
        if isinstance(weight_decay, str):
            return _rule_weight_decay(weight_decay, start.z0, labels, gamma, log_t)
        return float(weight_decay)

    # ---- fitting -------------------------------------------------------------------------

    def fit(self, inputs_or_loader: Any, labels: Any = None) -> "NeuralClamping":
        """Learn δ and T on the calibration split (a tensor + ``labels``, or a loader of (x, y))."""
        prepared = self.prepare(inputs_or_loader, labels)
        fits = self.fit_prepared(prepared)
        self._store(prepared, fits)
        if self.callback is not None and self._setting("temperature") == "selected":
            # The live view's last point: the T the fit keeps, chosen after the optimiser stopped.
            self.callback({"step": "selected", "loss": self.objective_, "temperature": self.temperature_,
                           "passes": self.n_passes_, "selected": True})
        return self

    def expected_passes(self, n_gammas: int | None = None) -> float:
        """Passes over the calibration split a fit is planned to take: the recipe's epochs (+ the
        unperturbed pass) per γ, or the fast fitter's budget per γ (the first pass, shared by every γ,
        counted once); the fast fitter may stop sooner. ``n_gammas``: the γ values fitted (default: those
        of ``gamma``)."""
        n = len(self.options.gamma_values) if n_gammas is None else n_gammas
        if self._recipe() is not None:
            return (self._setting("epochs") + 0.5) * n
        first = 1.0 if self.init == "data" else 0.5  # the shared first pass (_start)
        return first + n * (float(self.max_passes) - first)

    def _fit_budget(self, start: _Start) -> float:
        """Passes one γ's fit may take after the shared first pass: a recipe's epochs, or the rest of
        the fast fitter's ``max_passes`` (at least one L-BFGS step)."""
        if self._recipe() is not None:
            return float(self._setting("epochs"))
        return max(float(self.max_passes) - start.passes, 1.0)

    # ---- the steps of fit, public for studies that share work between fits (studies.py) --

    def prepare(self, inputs_or_loader: Any, labels: Any = None) -> PreparedSplit:
        """Check the settings, put the calibration split on the model's device and run the pass
        that every fit on it shares. ``fit`` is ``prepare``, ``fit_prepared``, then keeping the best."""
        self._validate()
        dev = _compute_device(self.model, self.device)
        with frozen(self.model):
            problem = self._problem(inputs_or_loader, labels, dev)
            return PreparedSplit(problem, self._start(problem))

    def fit_prepared(self, prepared: PreparedSplit, gammas: Sequence[float] | None = None,
                     seed: int | None = None) -> list[GammaFit]:
        """One fit per γ (default: those of ``gamma``) on a prepared split, with this object's
        settings and ``seed`` (default ``self.seed``); each γ's fit is the one a fit at that γ alone
        gives. Nothing is stored on ``self``."""
        self._validate()
        if gammas is not None:
            gammas = [check_gamma(g, "each of gammas") for g in gammas]
        with frozen(self.model):
            return self._fit_gammas(prepared.problem, prepared.start, gammas, self.seed if seed is None else seed)

    def choose(self, fits: list[GammaFit], prepared: PreparedSplit) -> tuple[GammaFit, list[dict]]:
        """The fit this object's temperature rule keeps (lowest calibration ECE; ties: the earlier),
        and one summary per fit: gamma, weight_decay, temperature (the T it would use),
        fitted_temperature, objective, ece."""
        return _choose(fits, prepared.labels, self._setting("temperature"))

    def perturbed_logits(self, inputs_or_loader: Any, labels: Any, deltas: Sequence[torch.Tensor | None],
                         prepared: PreparedSplit) -> tuple[list[torch.Tensor], torch.Tensor]:
        """f(x + δ) on another split for each δ in ``deltas`` (clamped as on ``prepared``), reading
        the split once (0.5 pass per δ); returns the logits and the split's labels on the device."""
        dev = prepared.problem.split.device
        with frozen(self.model):
            split = InputStream(inputs_or_loader, labels, dev, int(self._setting("batch_size")))
            problem = Problem(self.model, split, 0.0, 0.0, prepared.problem.clamp_range)
            zs = _multi_logits(problem, deltas)
        check_label_range(split.labels, zs[0].shape[1])
        return zs, split.labels

    def _problem(self, inputs: Any, labels: Any, dev: torch.device) -> Problem:
        split = InputStream(inputs, labels, dev, int(self._setting("batch_size")))
        recipe = self._recipe()
        # The shared first pass reads no loss setting: each fit gets its own γ and λ (_fit_gammas).
        loss = {} if recipe is None else {"penalty": recipe.penalty, "prob_floor": recipe.prob_floor}
        # The fast fitter's passes run in float64, so that its path is the same on every machine
        # (exact_twin says why); under a reduced precision the model runs as that precision says.
        if recipe is None and precision.current().dtype is None:
            loss["exact"] = exact_twin(self.model, dev, split.input_shape)
            if loss["exact"] is not None and dev.type == "cpu":
                split.limit_pieces(EXACT_CPU_PIECE)
                split.use_piece_threads()
        problem = Problem(self.model, split, 0.0, 0.0, self.clamp_bounds(split.input_shape, dev), **loss)
        problem.check_labels()
        size = math.prod(split.input_shape)
        if self.fitter == "fast" and split.n < SMALL_SPLIT_FACTOR * size:
            warnings.warn(small_split_message(split.n, size), stacklevel=4)  # the caller of fit()
        return problem

    def _start(self, problem: Problem) -> _Start:
        """The shared first pass: δ̃ and the unperturbed logits (init="data", 1 pass) or the
        unperturbed logits alone when λ is "auto" or the fast fitter warm-starts T (0.5 pass)."""
        before = problem.split.passes
        z0 = delta_tilde = anchor = None
        if self.init == "data":
            alpha, beta = input_bounds(self.input_range, problem.split.input_shape, problem.split.device)
            g, lo, hi, z0 = entropy_gradient(problem)
            delta_tilde = theorem1_delta(g, lo, hi, alpha, beta)
        elif isinstance(self._setting("weight_decay"), str) or self.fitter == "fast":
            z0 = problem.logits(None)
        if z0 is not None:
            check_label_range(problem.split.labels, z0.shape[1])
        if self._setting("temperature") == "anchored":  # the fast fitter's rule: T from the unperturbed logits
            anchor = math.log(select_temperature(z0, problem.split.labels)[0])
        return _Start(z0, delta_tilde, problem.split.passes - before, anchor)

    def _initial_delta(self, start: _Start, shape: tuple[int, ...], generator: torch.Generator, device) -> torch.Tensor:
        recipe = self._recipe() is not None
        std = float(self._setting("init_std"))
        if self.init == "data":
            delta = start.delta_tilde.clone()
        elif recipe:  # the recipes draw δ₀ as the authors' code does
            delta = (std * torch.randn(shape, generator=generator)).to(device)
        elif std == 0:
            delta = torch.zeros(shape, device=device)
        else:
            # Drawn in float64: torch's scalar and vector CPU kernels draw float32 normals differently
            # (another δ₀ under ATEN_CPU_CAPABILITY=default), float64 ones alike.
            delta = (std * torch.randn(shape, generator=generator, dtype=torch.float64)).float().to(device)
        if not recipe and (self.init == "data" or std == 0):
            # The fast fitter's fixed starts, 0 and Theorem 1's δ̃ (flat wherever the data's range is),
            # leave a flat picture's max-pooling ties in place and the gradient's way through them to
            # rounding: the tie-breaking pattern breaks them.
            delta = delta + tie_breaking_start(shape, device)
        # Drawn even when frozen, so that the frozen run sees the same batch order as the learned one.
        return delta if self.learn_delta else torch.zeros_like(delta)

    def _bar(self, total: float):
        if not self.progress:
            return None
        return tqdm(total=total, unit="pass", desc=f"Neural Clamping ({self.fitter})", leave=False)

    def _fit_gammas(self, problem: Problem, start: _Start, gammas: Sequence[float] | None,
                    seed: int) -> list[GammaFit]:
        """One fit per γ (None: the options' ``gamma_values``), each its own: the same start, budget and
        rules whatever the other γ values, so that a γ's fit is the one a fit at that γ alone gives
        (a sweep's row, a run's row and a choice of "auto" agree). Recipes: a run of the recipe per γ."""
        gammas = self.options.gamma_values if gammas is None else gammas
        shape, dev = problem.split.input_shape, problem.split.device
        fits: list[GammaFit] = []
        bar = self._bar(self.expected_passes(len(gammas)))
        anchor = None if self._recipe() is not None else start.anchor
        lengths: list[float] = []  # passes each γ took (fast fitter)
        try:
            for i, gamma in enumerate(gammas):
                if fits and fits[-1].result.stopped:
                    break
                # A fit's budget is an upper bound (the fast fitter usually stops well before it), so the
                # γ values left are planned at the mean length of those that ended, at the budget before.
                per_fit = sum(lengths) / len(lengths) if lengths else self._fit_budget(start)
                expected = problem.split.passes + (len(gammas) - i) * per_fit
                if bar is not None:
                    bar.total = expected
                report = Reporter(self.callback, bar, expected)
                before = problem.split.passes
                generator = torch.Generator().manual_seed(int(seed))
                delta0 = self._initial_delta(start, shape, generator, dev)
                if self._recipe() is not None:
                    fit = replace(problem, gamma=gamma, weight_decay=self._lambda(start, problem.split.labels, gamma))
                    result = fit_sgd(fit, delta0, generator, self._sgd(), report)
                else:
                    fit = replace(problem, gamma=gamma, weight_decay=self._lambda(
                        start, problem.split.labels, gamma, 0.0 if anchor is None else anchor))
                    log_t0 = best_log_temperature(start.z0, problem.split.labels, gamma) if anchor is None else anchor
                    if self.learn_delta:
                        result = fit_fast(fit, delta0, log_t0, self._fit_budget(start), float(self.tol), report,
                                          fixed_t=anchor is not None)
                    else:  # T alone: the exact 1-D optimum on the unperturbed logits, no further pass
                        result = FitResult(delta0, log_t0, fit.objective_from_logits(start.z0, delta0, log_t0),
                                           start.z0, report.history, 0.0)
                lengths.append(problem.split.passes - before)
                fits.append(GammaFit(gamma, fit.weight_decay, result))
        finally:
            if bar is not None:
                bar.close()
        return fits

    def _store(self, prepared: PreparedSplit, fits: list[GammaFit]) -> None:
        problem = prepared.problem
        check_label_range(problem.split.labels, fits[0].result.logits.shape[1])
        chosen, candidates = self.choose(fits, prepared)
        self.delta_ = chosen.result.delta.detach().cpu().clone()
        self.temperature_ = candidates[fits.index(chosen)]["temperature"]
        self.fitted_temperature_ = math.exp(chosen.result.log_t)
        self.gamma_ = chosen.gamma
        self.weight_decay_ = chosen.weight_decay
        self.objective_ = chosen.result.objective
        self.history_ = chosen.result.history
        self.n_passes_ = problem.split.passes
        self.fitter_ = self.fitter
        self.candidates_ = candidates
        self.stopped_early_ = any(f.result.stopped for f in fits)


def _choose(fits: list[GammaFit], labels: torch.Tensor, rule: str = "fitted") -> tuple[GammaFit, list[dict]]:
    """The fit with the lowest calibration ECE (ties: the earlier one), and a summary per fit.

    With ``rule`` "selected" every fit's T is first re-chosen on its calibration logits (see
    ``select_temperature``) and fits are compared by that criterion; "anchored" keeps the anchored T
    and compares the same criterion (mean ECE over ``SELECTION_BINS``) at it; "fitted" keeps the
    objective's T and compares 15-bin ECE."""
    candidates = []
    for f in fits:
        if rule == "selected":
            t, criterion = select_temperature(f.result.logits, labels)
        elif rule == "anchored":
            t = math.exp(f.result.log_t)
            criterion = float(np.mean([_ece(f.result.logits / t, labels, b) for b in SELECTION_BINS]))
        else:
            t = math.exp(f.result.log_t)
            criterion = _ece(f.result.logits / t, labels)
        candidates.append({"gamma": f.gamma, "weight_decay": f.weight_decay, "temperature": t,
                           "fitted_temperature": math.exp(f.result.log_t), "objective": f.result.objective,
                           "ece": _ece(f.result.logits / t, labels), "criterion": criterion})
    best = min(range(len(fits)), key=lambda i: (candidates[i]["criterion"], i))
    return fits[best], candidates


def _multi_logits(problem: Problem, deltas: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """f(x + δ_r) for several δ's, reading every chunk of the split once (0.5 pass per δ)."""
    with torch.no_grad():
        pieces = list(problem.split.map(lambda x, _: [problem.forward(x, d) for d in deltas]))
    problem.split.count(0.5 * len(deltas))
    return [problem.split.gather(torch.cat(per_delta)) for per_delta in zip(*pieces)]
