"""docs/metrics-parity.md against a fresh computation, so the page cannot go stale.

relplot and torchmetrics are in the test extra and must import; netcal and torch-uncertainty are
bench-only (the page says why) and their rows are checked only where they are installed. A peer's
row is compared while the installed version is the one the page records (a release may change it).
"""
import numpy as np
import pytest

import nctv.metrics as M
from bench import parity

PAGE_ROWS, PAGE_VARIANTS = parity.read_page(parity.PAGE.read_text())
# Printed with 6 decimals in %: 1e-8 as a fraction is one unit in the last place shown.
TOLERANCE = 1.5e-8


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
                assert got == pytest.approx(want, abs=TOLERANCE), (r.key, name)


def test_variant_table_matches_and_reproduces_the_rows_it_names(logits):
    fresh = parity.variants(*logits)
    assert [name for name, _, _ in fresh] == list(PAGE_VARIANTS)
    for name, value, reproduces in fresh:
        page_value, page_reproduces = PAGE_VARIANTS[name]
        assert value == pytest.approx(page_value, abs=TOLERANCE)
        assert reproduces == page_reproduces
    # The page's explanation, checked: each variant gives the very number of the rows it names.
    # Only peers installed at the version the page records: another release may bin differently.
    rows = {f"{r.library}, {r.given}": r for lib in parity.PEERS if parity.available(lib)
            for r in parity.peer_rows(lib, *logits) if r.ece is not None and page_version_matches(r)}
    checked = 0
    for name, value, reproduces in fresh:
        for label in reproduces:
            if label in rows:
                assert rows[label].ece == pytest.approx(value, abs=1e-9), (name, label)
                checked += 1
    assert checked >= 1  # NCTV's own row, whatever else is installed


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
