"""One place per method: a method's identity (its paper name, short name, abbreviation, colour, class,
whether it needs the model, whether seeds change it, what it saves, which run settings it takes) lives
in its registry entry (nctv.methods) and nowhere else. Known answers: the entries against the classes
they name (constructor parameters, fitted attributes after a real fit), and a new entry added here at
run time, which the command line, the engine, the tables, the figures and saving then pick up without
any other change."""
import re

import numpy as np
import pytest
import torch

from nctv import methods
from nctv.methods import METHODS, RUN_OPTIONS, MethodSpec, calibration_class


def test_every_entry_is_whole_and_its_names_and_colours_are_its_own():
    specs = list(METHODS.values())
    for field in ("name", "short", "abbreviation", "colour"):
        values = [getattr(s, field) for s in specs]
        assert len(set(values)) == len(values), field
    for s in specs:
        assert re.fullmatch(r"[a-z][a-z-]*", s.short) and re.fullmatch(r"#[0-9a-f]{6}", s.colour), s.name
        assert s.description and s.abbreviation and set(s.run_options) <= set(RUN_OPTIONS), s.name


def test_the_run_settings_an_entry_declares_are_exactly_those_its_class_takes():
    """A class that takes a run's γ, progress flag or progress function says so in its entry (the run
    passes only what the entry declares), and declares nothing its class lacks."""
    for s in METHODS.values():
        params = set(calibration_class(s.cls)._param_names())
        assert params & set(RUN_OPTIONS) == set(s.run_options), s.name


@pytest.mark.parametrize("name", [n for n, s in METHODS.items() if not s.needs_model])
def test_the_fitted_values_an_entry_names_are_what_its_fit_makes(name):
    rng = np.random.default_rng(0)
    z = torch.from_numpy(rng.normal(size=(300, 3)) * 3)
    y = torch.from_numpy(rng.integers(0, 3, 300))
    fitted = METHODS[name].factory().fit(z, y)
    made = {k for k in vars(fitted) if re.fullmatch(r"[a-z][a-z0-9_]*_", k)}
    assert set(METHODS[name].fitted) <= made, name


def test_names_abbreviations_colours_and_short_names_come_from_the_entries():
    from nctv.cli import resolve_methods
    from nctv.plots import _shift_colour
    from nctv.shift import _short
    from nctv.ui.session import NC_METHODS

    for n, s in METHODS.items():
        assert resolve_methods([s.short.upper()]) == [n] and methods.method_spec(s.short) is s
        assert _short(n) == s.abbreviation and _shift_colour(n, 0) == s.colour
    assert NC_METHODS == ("Neural Clamping (FL)", "Neural Clamping (CE)")  # the compared one first
    assert methods.abbreviation("NC input only") == "NC input only"  # an ablation row names itself


def test_a_new_entry_is_picked_up_by_the_cli_the_engine_the_tables_the_figures_and_saving(
        monkeypatch, tmp_path, default_model):
    """The proof that adding a method is one entry: a second temperature scaling, registered here
    only, is run by name and short name, gets its row, abbreviation and colour, is counted by the
    app's GPU estimate as logit work, and saves and loads as its class does."""
    from nctv.calibration import load_calibrator
    from nctv.cli import resolve_methods
    from nctv.data import get_splits
    from nctv.experiment import RunOptions, run_experiment
    from nctv.plots import _shift_colour
    from nctv.report import results_table, to_markdown
    from nctv.shift import _short
    from nctv.ui import gpu

    spec = MethodSpec(name="Temperature Scaling again", short="ts-again", abbreviation="TS²", colour="#123456",
                      cls="TemperatureScaling", fitted=("temperature_",), description="z/T once more")
    monkeypatch.setitem(METHODS, spec.name, spec)
    names = resolve_methods(["uncal,ts-again", "ts"])
    assert names == ["Uncalibrated", spec.name, "Temperature Scaling"]
    cal, test = get_splits(default_model, calibration_size=300, test_size=500)
    result = run_experiment(default_model, cal, test, names, RunOptions.make(seeds=1, bins=(15,), progress=False))
    mine, ts = result.methods[spec.name], result.methods["Temperature Scaling"]
    assert mine.params["temperature"] == pytest.approx(ts.params["temperature"], rel=1e-12)
    assert mine.metrics[15]["ece"].mean == pytest.approx(ts.metrics[15]["ece"].mean, rel=1e-12)
    assert not mine.uses_model and spec.name in to_markdown(results_table(result, 15))
    assert _short(spec.name) == "TS²" and _shift_colour(spec.name, 3) == "#123456"
    assert gpu.calibration_work([spec.name], None, 300, 500, 10).trained == 0
    written = result.save_calibrators(tmp_path / "calibrators", default_model)
    saved = next(p for p in written if p.name == "temperature-scaling-again")
    back = load_calibrator(saved)
    assert float(back.temperature_) == pytest.approx(mine.params["temperature"], rel=1e-12)
