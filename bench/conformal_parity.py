"""Conformal sets across libraries: NCTV's LAC, APS and RAPS sets against TorchCP's and MAPIE's.

    PYTHONPATH=.:/path/to/reference python -m bench.conformal_parity

TorchCP (1.2.1) and MAPIE (1.6.0) are no dependencies of NCTV: install them apart, e.g.
``pip install --no-deps --target /tmp/cp-reference torchcp==1.2.1 mapie==1.6.0`` (their own
dependencies, torch, numpy, scipy and scikit-learn, are NCTV's), and put that folder on PYTHONPATH.

Every case feeds the same float64 probabilities to both sides (TorchCP with ``score_type="identity"``)
and counts the test points whose sets differ. Randomised APS / RAPS replay TorchCP's own draws: it
subtracts U · p_y with U from ``torch.rand`` (one per calibration point, one per test point and class),
and NCTV's v is that U (``draws=``). The output is the table of docs/conformal.md, "Parity".
"""
from __future__ import annotations

import argparse
import functools
import warnings
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from bench.parity_problems import parity_problems
from nctv.conformal import ConformalPredictor, ConformalSettings, probabilities

REPO = Path(__file__).resolve().parent.parent
LOGITS = REPO / "assets" / "precomputed" / "test_logits.safetensors"
COVERAGES = (0.9, 0.8, 0.95)


def inputs(seed: int = 0) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(name, calibration p, labels, test p, labels): the shipped study's test logits of three methods cut
    in halves, and synthetic cases: K = 2, K = 100, and rows with tied probabilities."""
    out = []
    stored = load_file(str(LOGITS))
    y = stored["labels"]
    half = len(y) // 2
    for method in ("Uncalibrated", "Temperature Scaling", "Neural Clamping (FL)"):
        p = probabilities(stored[method])
        out.append((f"embedded default, {method}", p[:half], y[:half], p[half:], y[half:]))
    g = torch.Generator().manual_seed(seed)
    for k, n, scale in ((2, 2000, 2.0), (3, 1000, 1.5), (100, 3000, 4.0)):
        z = torch.randn(2 * n, k, generator=g, dtype=torch.float64) * scale
        lab = torch.multinomial(torch.softmax(z, 1), 1, generator=g).squeeze(1)
        p = probabilities(z)
        out.append((f"synthetic K = {k}", p[:n], lab[:n], p[n:], lab[n:]))
    # Ties: logits rounded to whole numbers, so many rows hold equal probabilities.
    z = torch.randint(0, 3, (4000, 5), generator=g).double()
    lab = torch.multinomial(torch.softmax(z, 1), 1, generator=g).squeeze(1)
    p = probabilities(z)
    out.append(("ties, K = 5 (whole-number logits)", p[:2000], lab[:2000], p[2000:], lab[2000:]))
    # The problems every parity bench shares (bench.parity_problems), those not above.
    for name, (z, lab) in parity_problems().items():
        if name in ("7 classes", "20 classes", "7 classes, rounded", "20 classes, rounded", "7 classes, tied"):
            p, lab, half = probabilities(torch.from_numpy(z)), torch.from_numpy(lab), len(lab) // 2
            out.append((f"drawn: {name}", p[:half], lab[:half], p[half:], lab[half:]))
    return out


def tied_rows(p: torch.Tensor) -> torch.Tensor:
    """Whether two probabilities of a row are equal, per row."""
    s = torch.sort(p, dim=1).values
    return (s[:, 1:] == s[:, :-1]).any(1)


@functools.cache
def _torchcp():
    """TorchCP's classification predictors and scores. Its package ``__init__`` also imports its graph,
    language-model and training-loss parts (torch_geometric, transformers, a compiled torchsort), which the
    sets do not use: the two parent packages are registered empty so that only the classification modules load."""
    import importlib.util
    import sys
    import types

    spec = importlib.util.find_spec("torchcp")
    if spec is None:
        raise SystemExit("TorchCP is not on the path; see this module's docstring.")
    root = spec.submodule_search_locations[0]
    for name, sub in (("torchcp", ""), ("torchcp.classification", "/classification")):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [root + sub]
            sys.modules[name] = module
    from torchcp.classification.predictor import ClassConditionalPredictor, SplitPredictor
    from torchcp.classification.score import APS, LAC, RAPS

    return ClassConditionalPredictor, SplitPredictor, APS, LAC, RAPS


def torchcp_sets(score: str, randomized: bool, class_conditional: bool, coverage: float, cal, ycal, test, seed: int):
    """TorchCP's sets, and the U it drew (calibration (n,), test (N, K) per class) for NCTV to replay."""
    ClassConditionalPredictor, SplitPredictor, APS, LAC, RAPS = _torchcp()
    fn = {"lac": lambda: LAC(score_type="identity"),
          "aps": lambda: APS(score_type="identity", randomized=randomized),
          "raps": lambda: RAPS(score_type="identity", randomized=randomized, penalty=0.01, kreg=5)}[score]()
    predictor = (ClassConditionalPredictor if class_conditional else SplitPredictor)(fn, alpha=1 - coverage)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a class too small for its quantile: TorchCP warns, q̂ = +∞
        predictor.calculate_threshold(cal, ycal, 1 - coverage)
    sets = predictor.predict_with_logits(test).bool()
    if not randomized or score == "lac":
        return sets, None, None
    torch.manual_seed(seed)
    u_cal = torch.rand(cal.shape[0])
    # The test U is drawn per rank position (largest probability first), NCTV's v per class.
    u_rank = torch.rand(test.shape)
    order = torch.sort(test, dim=1, descending=True, stable=True).indices
    return sets, u_cal, torch.empty_like(u_rank).scatter_(1, order, u_rank)


def _given_probabilities(k: int):
    """A prefitted classifier whose predict_proba returns its input: how MAPIE is given probabilities."""
    from sklearn.base import BaseEstimator, ClassifierMixin

    class Given(ClassifierMixin, BaseEstimator):
        def fit(self, x, y):
            self.classes_ = np.arange(x.shape[1])
            return self

        def predict_proba(self, x):
            return np.asarray(x)

        def predict(self, x):
            return np.argmax(x, axis=1)

    return Given().fit(np.eye(k), np.arange(k))


def mapie_lac_sets(coverage: float, cal, ycal, test):
    """MAPIE's LAC sets through its documented split API, the probabilities passed through a prefitted
    classifier whose predict_proba returns its input."""
    from mapie.classification import SplitConformalClassifier

    est = _given_probabilities(cal.shape[1])
    cp = SplitConformalClassifier(estimator=est, confidence_level=coverage, conformity_score="lac", prefit=True)
    cp.conformalize(cal.numpy(), ycal.numpy())
    _, sets = cp.predict_set(test.numpy())
    return torch.from_numpy(sets[:, :, 0])


def mapie_aps_sets(coverage: float, cal, ycal, test):
    """MAPIE's APS sets, plain: its calibration draw held at 0 (a random state whose uniforms are 0, so
    the score is the running sum through the label, NCTV's plain score) and ``include_last_label=False``
    (no class past q̂: NCTV's {y : s ≤ q̂}, but where that is empty MAPIE keeps the top class; the
    comparison gives NCTV's empty sets their top class)."""
    from mapie.classification import SplitConformalClassifier

    class NoDraw(np.random.RandomState):
        def uniform(self, low=0.0, high=1.0, size=None):
            return np.zeros(size)

    est = _given_probabilities(cal.shape[1])
    cp = SplitConformalClassifier(estimator=est, confidence_level=coverage, conformity_score="aps", prefit=True,
                                  random_state=NoDraw(0))
    cp.conformalize(cal.numpy(), ycal.numpy())
    _, sets = cp.predict_set(test.numpy(), conformity_score_params={"include_last_label": False})
    return torch.from_numpy(sets[:, :, 0])


def run(seed: int = 0) -> list[dict]:
    rows = []
    for name, cal, ycal, test, ytest in inputs(seed):
        tied_input = bool(tied_rows(cal).any() or tied_rows(test).any())
        for coverage in COVERAGES:
            for score in ("lac", "aps", "raps"):
                for randomized in ((False,) if score == "lac" else (False, True)):
                    for cc in (False, True):
                        ref, u_cal, u_test = torchcp_sets(score, randomized, cc, coverage, cal, ycal, test, seed)
                        # RAPS with TorchCP's λ = 0.01, k_reg = 5 given (NCTV would otherwise tune them).
                        st = ConformalSettings(score, coverage, randomized, penalty=0.01, k_reg=5, class_conditional=cc,
                                               seed=seed)
                        cp = ConformalPredictor(st).fit(cal, ycal, True, draws=u_cal)
                        ours = cp.predict_sets(test, True, draws=u_test)
                        row = {"input": name, "coverage": coverage, "score": score, "randomized": randomized,
                               "class_conditional": cc, "reference": f"TorchCP {version('torchcp')}",
                               "points": int(test.shape[0]), "differ": int((ref != ours).any(1).sum()),
                               "tied_input": tied_input}
                        if cc:
                            # TorchCP keeps the class thresholds in a float32 tensor (torch.zeros(K)): replay that rounding.
                            cp.thresholds_ = cp.thresholds_.float().double()
                            row["differ_q_float32"] = int((ref != cp.predict_sets(test, True, draws=u_test)).any(1).sum())
                        rows.append(row)
            # MAPIE takes only LAC for a binary target.
            for score, reference in (("lac", mapie_lac_sets), ("aps", mapie_aps_sets))[:1 if cal.shape[1] == 2 else 2]:
                ours = ConformalPredictor(ConformalSettings(score, coverage, False)).fit(cal, ycal, True).predict_sets(test, True)
                if score == "aps":  # MAPIE's APS never gives an empty set: it keeps the top class
                    empty = ~ours.any(1)
                    ours[empty, test[empty].argmax(1)] = True
                differ = (reference(coverage, cal, ycal, test) != ours).any(1)
                rows.append({"input": name, "coverage": coverage, "score": score, "randomized": False,
                             "class_conditional": False, "reference": f"MAPIE {version('mapie')}",
                             "points": int(test.shape[0]), "differ": int(differ.sum()), "tied_input": tied_input})
    return rows


def summary(rows: list[dict]) -> str:
    """One Markdown row per (reference, score, randomised, class-conditional): inputs compared, points, differing sets."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["reference"], r["score"], r["randomized"], r["class_conditional"]), []).append(r)
    lines = ["| reference | score | randomised | class-conditional | comparisons | test points | sets that differ "
             "| of them on inputs with no tied probabilities | differ with q̂ rounded to float32 as TorchCP stores it |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for (ref, score, rnd, cc), g in groups.items():
        lines.append(f"| {ref} | {score.upper()} | {'yes' if rnd else 'no'} | {'yes' if cc else 'no'} | {len(g)} | "
                     f"{sum(r['points'] for r in g):,} | {sum(r['differ'] for r in g):,} | "
                     f"{sum(r['differ'] for r in g if not r['tied_input']):,} | "
                     f"{sum(r['differ_q_float32'] for r in g) if cc else '—'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rows = run(args.seed)
    print(summary(rows))
    bad = [r for r in rows if r["differ"]]
    left = [r for r in bad if r.get("differ_q_float32", r["differ"])]
    for r in left:
        print(f"differ: {r}")
    print(f"{len(rows)} comparisons on {len(inputs(args.seed))} inputs; {len(bad)} with differing sets, "
          f"{len(left)} once TorchCP's float32 class thresholds are replayed.")


if __name__ == "__main__":
    main()
