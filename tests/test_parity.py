"""docs/metrics-parity.md against a fresh computation, so the page cannot go stale.

relplot and torchmetrics are in the test extra and must import; netcal and torch-uncertainty are
bench-only (the page says why) and their rows are checked only where they are installed. A peer's
row is compared while the installed version is the one the page records (a release may change it).
"""
import numpy as np
import pytest
import torch

import nctv.metrics as M
from bench import parity

PAGE_ROWS, PAGE_VARIANTS = parity.read_page(parity.PAGE.read_text())
# Printed with 6 decimals in %: 1e-8 as a fraction is one unit in the last place shown. This holds for a
# figure computed in float64 (NCTV's, and every peer given float64): its round-off, about N·2⁻⁵³ ≈ 1e-12
# for N = 10,000 test images, is far below it.
TOLERANCE = 1.5e-8
# A figure computed in float32 on another machine is another number. Its softmax rounds each confidence
# to float32 (unit round-off u = 2⁻²⁴), and processors round differently in the last bits (this torch's
# AVX-512, AVX2 and scalar kernels: up to 4 units apart); its bins then sum N confidences in float32, each
# addition rounded again. The sum of n rounded terms drifts like √n·u (rounding errors as random signs,
# Higham & Mary 2019); a bin of n_b images moves its mean confidence by about √n_b·u and the ECE, their
# mean weighted by n_b/N, by at most Σ (n_b/N)·√n_b·u ≤ √N·u; twice that for the two machines:
# 2·√N·u ≈ 1.2e-5. A fresh machine measured 2.4e-8 (0.08070054650 against the page's 0.08070057).
N_IMAGES = 10_000
FLOAT32_TOLERANCE = 2 * N_IMAGES ** 0.5 * 2.0**-24
#: Page rows whose figures come out of float32 arithmetic on the machine that runs them: the peer
#: computes the softmax (and torchmetrics and torch-uncertainty the bins' sums) in float32.
FLOAT32_ROWS = {("relplot", "float32 logits"), ("netcal", "float32 probabilities"),
                ("torchmetrics", "float32 logits"), ("torch-uncertainty", "float32 logits")}
#: How the variants' confidences are made (bench.parity.VARIANTS): in float32 on this machine, or in float64.
FLOAT32_MADE = {"float32", "float32 clipped"}


def page_tolerance(library, given):
    return FLOAT32_TOLERANCE if (library, given) in FLOAT32_ROWS else TOLERANCE


@pytest.fixture(scope="module")
def logits():
    return parity.load_logits()


def fresh_rows(library, logits):
    if parity.PEERS[library][1]:
        __import__(parity.PEER_MODULES.get(library, "nctv"))  # in the test extra: must be installed
    else:
        pytest.importorskip(parity.PEER_MODULES[library], reason=f"{library} is bench-only")
    return parity.peer_rows(library, *logits)


def page_version_matches(row):
    page = [r for r in PAGE_ROWS if r.key == row.key]
    return row.library == "NCTV" or (page and page[0].version == row.version)


def test_page_lists_every_library_and_the_bench_only_ones_are_not_required():
    assert {r.library for r in PAGE_ROWS} == set(parity.PEERS)
    assert {lib for lib, (_, in_ci) in parity.PEERS.items() if not in_ci} == {"netcal", "torch-uncertainty"}


@pytest.mark.parametrize("library", list(parity.PEERS))
def test_page_rows_match_a_fresh_computation(library, logits):
    rows = fresh_rows(library, logits)
    assert {r.key for r in rows} == {r.key for r in PAGE_ROWS if r.library == library}
    if not all(page_version_matches(r) for r in rows):
        pytest.skip(f"the page records another {library} version; run python -m bench.parity --write")
    page = {r.key: r for r in PAGE_ROWS}
    for r in rows:
        for name in ("ece", "smooth_ece"):
            want, got = getattr(page[r.key], name), getattr(r, name)
            assert (want is None) == (got is None), (r.key, name)
            if got is not None:
                assert got == pytest.approx(want, abs=page_tolerance(r.library, r.given)), (r.key, name)


def test_variant_table_matches_and_reproduces_the_rows_it_names(logits):
    fresh = parity.variants(*logits)
    assert [name for name, _, _ in fresh] == list(PAGE_VARIANTS)
    made = {name: how for name, how, _, _ in parity.VARIANTS}
    for name, value, reproduces in fresh:
        page_value, page_reproduces = PAGE_VARIANTS[name]
        tolerance = FLOAT32_TOLERANCE if made[name] in FLOAT32_MADE else TOLERANCE
        assert value == pytest.approx(page_value, abs=tolerance), name
        assert reproduces == page_reproduces
    # The page's explanation, checked: each variant gives the very number of the rows it names.
    # Only peers installed at the version the page records: another release may bin differently.
    rows = {f"{r.library}, {r.given}": r for lib in parity.PEERS if parity.available(lib)
            for r in parity.peer_rows(lib, *logits) if r.ece is not None and page_version_matches(r)}
    # Here both numbers come from this machine, from the same confidences (torch's float32 softmax), except
    # relplot's float32 row: scipy's softmax rounds its float32 confidences c′ apart from torch's c. The
    # ECE, (1/N)·Σ_bins |Σ_{i in bin} (correct_i − c_i)|, then moves by at most (1/N)·Σ|c_i − c′_i| (the
    # triangle inequality, while every image stays in its bin and keeps its prediction: checked).
    # A variant with float32 sums adds the 16 bins' weighted gaps in float32, the peer in the order of its
    # own reduction (vectorised or not: it depends on the processor): a sum of n terms rounds by at most
    # (n − 1)·u·Σ|terms| (Higham, Accuracy and Stability, §4.2), and each gap and weight by a few u more:
    # (N_BINS + 4)·u·ECE ≈ 9e-8 here.
    apart = scipy_float32_spread(*logits)
    switches = {name: s for name, _, s, _ in parity.VARIANTS}
    checked = 0
    for name, value, reproduces in fresh:
        for label in reproduces:
            if label in rows:
                tolerance = 1e-9 + (apart if label == "relplot, float32 logits" else 0.0)
                if switches[name].get("float32_sums"):
                    tolerance += (parity.N_BINS + 4) * 2.0**-24 * value
                assert rows[label].ece == pytest.approx(value, abs=tolerance), (name, label)
                checked += 1
    assert checked >= 1  # NCTV's own row, whatever else is installed


def scipy_float32_spread(z, y):
    """(1/N)·Σ|c_i − c′_i| of the float32 top confidences of torch's softmax (c) and scipy's (c′)."""
    from scipy.special import softmax

    ours = torch.softmax(torch.from_numpy(z), 1).max(1)
    theirs = softmax(z, axis=-1)
    c, c2 = ours.values.double().numpy(), theirs.max(axis=-1).astype(np.float64)
    edges = M.bin_edges(parity.N_BINS).numpy()
    assert np.array_equal(ours.indices.numpy(), theirs.argmax(axis=-1))
    assert np.array_equal(np.searchsorted(edges, c), np.searchsorted(edges, c2))
    return float(np.abs(c - c2).mean())


def test_smooth_ece_rows_of_nctv_and_relplot_agree_on_the_page():
    smooth = {(r.library, r.given): r.smooth_ece for r in PAGE_ROWS}
    assert smooth[("NCTV", "float32 logits")] == pytest.approx(smooth[("relplot", "float64 logits")], abs=1e-8)


def test_ece_variant_switches_on_hand_made_cases():
    # NCTV's conventions give the number of nctv.metrics.ece, confidences on the bin edges included.
    rng = np.random.default_rng(0)
    conf = np.concatenate([np.arange(8, 16) / 15, rng.uniform(0.5, 1, 200)])
    correct = (rng.uniform(size=conf.size) < 0.7).astype(float)
    probs = np.stack([conf, 1 - conf], 1)  # class 0 is always the prediction
    labels = np.where(correct == 1, 0, 1)
    assert parity.ece_variant(conf, correct) == pytest.approx(M.ece(probs, labels, 15, from_probabilities=True),
                                                              abs=1e-15)
    # 1/3 = 5/15 is an edge: (lo, hi] puts it with 0.3, [lo, hi) in the next bin.
    c, y = np.array([5 / 15, 0.3]), np.array([1.0, 0.0])
    assert parity.ece_variant(c, y) == pytest.approx(abs(5 / 15 - 1 + 0.3) / 2)
    assert parity.ece_variant(c, y, left_closed=True) == pytest.approx((1 - 5 / 15 + 0.3) / 2)
    # A wrong 1.0 beside a right 0.95: together their gaps cancel in part, apart they add.
    c, y = np.array([1.0, 0.95]), np.array([0.0, 1.0])
    assert parity.ece_variant(c, y) == pytest.approx((1 - 0.05) / 2)
    assert parity.ece_variant(c, y, left_closed=True, one_apart=True) == pytest.approx((1 + 0.05) / 2)


def test_float32_sums_are_running_sums_rounded_at_every_step():
    rng = np.random.default_rng(1)
    conf = rng.uniform(0.94, 1.0, 5000)  # all in the top bin, all right
    total = np.float32(0)
    for c in conf:
        total = np.float32(total + np.float32(c))
    expected = abs(1 - total / np.float32(conf.size))
    got = parity.ece_variant(conf, np.ones(conf.size), float32_sums=True)
    assert got == pytest.approx(float(expected), abs=1e-7)
    assert got != parity.ece_variant(conf, np.ones(conf.size))


# ------------------------------------------------------------------ the further metrics (bench.parity_further)

from bench import parity_further as further  # noqa: E402

FURTHER_ROWS = further.read_page(parity.PAGE.read_text())
#: Per metric, how far a peer's figure may sit from NCTV's on the page (docs/metrics-parity.md says why):
#: MAPIE's KS statistic sorts jittered confidences (relative jitter 1e-8).
FURTHER_AGREE = {"KS error": 1e-9, "classwise ECE, 15 bins": 1e-14, "debiased ℓ2 error, 15 equal-mass bins": 1e-14,
                 "NLL refinement (temperature scaling)": 1e-8}


@pytest.fixture(scope="module")
def further_data():
    return further.load()


@pytest.mark.parametrize("library", list(further.PEERS))
def test_further_rows_match_a_fresh_computation(library, further_data):
    if not further.available(library):
        pytest.skip(f"{library} is bench-only")
    rows = further.PEERS[library][0](further_data)
    page = {(r.metric, r.library, r.call): r for r in FURTHER_ROWS}
    libraries = {r.library for r in rows}  # NCTV's entry also gives the formula written out
    assert {(r.metric, r.library, r.call) for r in rows} == {k for k in page if k[1] in libraries}
    for r in rows:
        want = page[(r.metric, r.library, r.call)]
        if r.library not in ("NCTV", further.FORMULA) and want.version != r.version:
            pytest.skip(f"the page records another {library} version; run python -m bench.parity_further --write")
        for got, page_value in zip(r.values, want.values):
            # The page's last digit: 1e-8 of a fraction (6 decimals in %, 8 of NLL); p-values 6 digits.
            assert got == pytest.approx(page_value, rel=1e-5 if r.metric.startswith("calibration test") else 0,
                                        abs=1e-8), r


def test_further_peers_agree_with_nctv_on_the_page():
    nctv_rows = {r.metric: r for r in FURTHER_ROWS if r.library == "NCTV"}
    compared = 0
    for r in FURTHER_ROWS:
        if r.library != "NCTV" and r.metric in FURTHER_AGREE:
            for a, b in zip(r.values, nctv_rows[r.metric].values):
                assert a == pytest.approx(b, abs=max(FURTHER_AGREE[r.metric], 1e-8)), r
            compared += 1
    assert compared == 4  # MAPIE's KS, both of Kumar et al.'s, the written-out refinement
