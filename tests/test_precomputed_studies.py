"""A menu model's pre-computed study (scripts/make_precomputed.py --model): found in
assets/precomputed/models/<name>/ or in the Hub dataset repository named by NCTV_PRECOMPUTED_REPO
(real files in the Hub's cache layout, read offline), labelled as the embedded default's is, and
refused in words when a value is not what it must be. The study files are the shipped default's
own, relabelled as another menu model's: real files in the real format."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

import nctv.ui.shipped as shipped
from hub_standin import serving
from nctv.data import assets_dir
from nctv.ui.session import TS_METHOD

SHIPPED = assets_dir() / "precomputed"
FILES = ("results.json", "test_logits.safetensors", "delta.safetensors", "gamma_sweep.json", "init_study.json",
         "shift.json")


def write_study(folder: Path, model: str, change=None) -> Path:
    """The shipped default's study as ``model``'s in ``folder``; ``change(name, data)`` may alter a
    file's contents (a dict of JSON, or of tensors) before it is written."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        if name.endswith(".json"):
            data = json.loads((SHIPPED / name).read_text(encoding="utf-8"))
            data["model"]["name"] = model
            if change:
                change(name, data)
            (folder / name).write_text(json.dumps(data), encoding="utf-8")
        else:
            data = load_file(str(SHIPPED / name))
            if change:
                change(name, data)
            save_file(data, str(folder / name))
    return folder


@pytest.fixture
def studies(tmp_path, monkeypatch):
    """A copy of assets/precomputed (its own files only) as the app's; the loader's cache emptied."""
    root = tmp_path / "precomputed"
    root.mkdir()
    for name in FILES:
        shutil.copy(SHIPPED / name, root / name)
    monkeypatch.setattr(shipped, "precomputed_dir", lambda: root)
    monkeypatch.delenv(shipped.PRECOMPUTED_REPO_VARIABLE, raising=False)
    shipped.load_precomputed.cache_clear()
    shipped.shipped_detector.cache_clear()
    yield root
    shipped.load_precomputed.cache_clear()
    shipped.shipped_detector.cache_clear()


@pytest.fixture
def hub_studies(tmp_path, monkeypatch):
    """``put(model, change=None)``: that model's study in the folder ``<model>/`` of Hub dataset
    repository nctv-test/studies, in the Hub's cache layout; the client reads only the cache."""
    from huggingface_hub import constants

    repo = tmp_path / "hf" / "hub" / "datasets--nctv-test--studies"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("c" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv(shipped.PRECOMPUTED_REPO_VARIABLE, "nctv-test/studies")

    def put(model: str, change=None) -> Path:
        shipped.load_precomputed.cache_clear()
        return write_study(repo / "snapshots" / ("c" * 40) / model, model, change)

    return put


def _assert_labelled_as_shipped(pre, model: str, folder: Path):
    data = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    cal = pre.calibration
    assert cal.source == shipped.PRECOMPUTED_LABEL == "pre-computed, shipped with the app"
    assert cal.model == model and cal.split.model == model
    assert cal.ts_temperature == data["methods"][TS_METHOD]["params"]["temperature"]
    assert torch.equal(cal.delta, load_file(str(folder / "delta.safetensors"))[cal.nc_method])
    assert torch.equal(pre.result.test_labels, load_file(str(folder / "test_logits.safetensors"))["labels"])


def test_a_menu_models_study_in_the_assets_opens_as_the_defaults_does(studies):
    folder = write_study(studies / "models" / "fmnist-vit", "fmnist-vit")
    pre = shipped.load_precomputed("fmnist-vit")
    _assert_labelled_as_shipped(pre, "fmnist-vit", folder)
    for name in ("gamma_sweep.json", "init_study.json", "shift.json"):
        data, path = shipped.study_of("fmnist-vit", name)
        assert path == folder / name and data["model"]["name"] == "fmnist-vit"
    # the default's own study is where it always was; a model without a study has none
    assert shipped.load_precomputed().calibration.model == "fmnist-resnet-overconfident"
    assert shipped.load_precomputed("fmnist-mixer") is None and shipped.study_of("fmnist-mixer", "shift.json") is None


@pytest.mark.parametrize("name", ["../precomputed", "hf-hub:nctv-test/x", "fmnist-vit/../fmnist-vit", ""])
def test_only_menu_names_are_looked_up(studies, name):
    write_study(studies / "models" / "fmnist-vit", "fmnist-vit")
    assert shipped.study_folder(name) is None and shipped.load_precomputed(name) is None


def test_a_menu_models_study_from_the_operators_hub_repository(studies, hub_studies):
    folder = hub_studies("fmnist-mixer")
    pre = shipped.load_precomputed("fmnist-mixer")
    _assert_labelled_as_shipped(pre, "fmnist-mixer", folder)
    assert shipped.study_folder("fmnist-mixer") == folder
    data, path = shipped.study_of("fmnist-mixer", "gamma_sweep.json")
    assert path == folder / "gamma_sweep.json" and data["model"]["name"] == "fmnist-mixer"
    # not in the repository's cache (and offline): no study, nothing fails
    assert shipped.load_precomputed("fmnist-vit") is None
    # a study in the assets comes first
    local = write_study(studies / "models" / "fmnist-mixer", "fmnist-mixer")
    shipped.load_precomputed.cache_clear()
    assert shipped.study_folder("fmnist-mixer") == local


def _set(name: str, key: str, value):
    def change(file: str, data: dict):
        if file == name:
            data[key] = value(data[key]) if callable(value) else value
    return change


def _method(name: str, field: str, value):
    def change(file: str, data: dict):
        if file == "results.json":
            data["methods"][name][field] = value
    return change


def _sweep_nan(file: str, data: dict):
    if file == "gamma_sweep.json":
        data["temperature"][3] = float("nan")


@pytest.mark.parametrize("change, message", [
    (_set("test_logits.safetensors", "Vector Scaling", lambda z: z.index_fill(0, torch.tensor([7]), float("nan"))),
     r"the test logits of Vector Scaling must be 10000 × 10 finite numbers"),
    (_set("test_logits.safetensors", "Uncalibrated", lambda z: z[:, :9].contiguous()),
     r"the test logits of Uncalibrated must be 10000 × 10 finite numbers"),
    (_set("test_logits.safetensors", "labels", lambda y: y.index_fill(0, torch.tensor([0]), 10)),
     r"its test labels must be 10000 class indices below 10"),
    (_set("test_logits.safetensors", "labels", lambda y: y[:-1].contiguous()),
     r"its test labels must be 10000 class indices below 10"),
    (_set("delta.safetensors", "Neural Clamping (FL)", lambda d: d.index_fill(1, torch.tensor([3]), float("inf"))),
     r"the δ of Neural Clamping \(FL\) must be an image of finite numbers"),
    (_method(TS_METHOD, "params", {"temperature": -1.0}), r"the temperature of Temperature Scaling must be a positive"),
    (_set("results.json", "class_names", ["a", "b"]), r"names 2 classes for 10 outputs"),
])
def test_a_downloaded_run_with_a_bad_value_is_refused(studies, hub_studies, change, message):
    hub_studies("fmnist-mixer", change)
    with pytest.raises(ValueError, match=r"^The pre-computed study in .*fmnist-mixer.*" + message):
        shipped.load_precomputed("fmnist-mixer")


def test_a_results_file_without_its_methods_is_refused_in_words(studies, hub_studies):
    def no_methods(file: str, data: dict):
        if file == "results.json":
            del data["methods"]

    hub_studies("fmnist-mixer", no_methods)
    with pytest.raises(ValueError, match=r"^The pre-computed study in .* cannot be shown: it lacks 'methods'\.?$"):
        shipped.load_precomputed("fmnist-mixer")


def test_a_study_of_another_model_is_refused(studies, hub_studies):
    def other(file: str, data: dict):
        if file in ("results.json", "shift.json"):
            data["model"]["name"] = "fmnist-vit"

    hub_studies("fmnist-mixer", other)
    with pytest.raises(ValueError, match=r"is of model 'fmnist-vit', not 'fmnist-mixer'"):
        shipped.load_precomputed("fmnist-mixer")
    with pytest.raises(ValueError, match=r"^The pre-computed shift\.json in .* cannot be shown: it is of model "
                                         r"'fmnist-vit', not 'fmnist-mixer'"):
        shipped.study_of("fmnist-mixer", "shift.json")


def test_downloaded_studies_are_read_by_their_own_checks(studies, hub_studies):
    hub_studies("fmnist-mixer", _sweep_nan)
    with pytest.raises(ValueError, match=r"^The pre-computed gamma_sweep\.json in .* cannot be shown: The saved "
                                         r"study's temperature must be 11 finite numbers"):
        shipped.study_of("fmnist-mixer", "gamma_sweep.json")

    def no_runs(file: str, data: dict):
        if file == "init_study.json":
            del data["runs"]
        if file == "shift.json":
            data["severities"] = [0, 9]

    hub_studies("fmnist-mixer", no_runs)
    with pytest.raises(ValueError, match=r"init_study\.json in .* cannot be shown: it lacks 'runs'"):
        shipped.study_of("fmnist-mixer", "init_study.json")
    with pytest.raises(ValueError, match=r"shift\.json in .* cannot be shown: A shift study's severities must lie"):
        shipped.study_of("fmnist-mixer", "shift.json")


def test_picking_a_menu_model_shows_its_study_and_learn_and_try_use_it(studies):
    import gradio as gr

    from nctv.ui import calibrate, try_image

    folder = write_study(studies / "models" / "fmnist-vit", "fmnist-vit")
    status, table, diagrams, params, delta, files, state, shown = calibrate.menu_model_view("fmnist-vit", "")
    assert status.startswith("Showing the result **pre-computed, shipped with the app** (model fmnist-vit, 5000 "
                             "calibration images")
    assert "Neural Clamping (FL)" in table and "Temperature Scaling" in table
    # an opened group of its diagrams reads this study's test split and confidences
    logits = load_file(str(folder / "test_logits.safetensors"))
    assert shown.split == state.split and shown.split.test_size == 10000 and shown.split.model == "fmnist-vit"
    assert (shown.labels == logits["labels"].numpy()).all()
    assert np.allclose(shown.confidence["Vector Scaling"], torch.softmax(logits["Vector Scaling"], 1).max(1).values)
    group = calibrate.group_pictures(shown, "Vector Scaling", 14)
    assert group["count"] == int((shown.confidence["Vector Scaling"] > 14 / 15).sum()) and group["items"]
    assert state.model == "fmnist-vit" and state.source == shipped.PRECOMPUTED_LABEL
    assert any(Path(f).name == "results.json" for f in files)
    # Learn reads the study's own test logits (no model pass); Try names the study's calibration.
    z, y, where = shipped.test_logits_of(state)
    assert torch.equal(z, logits["Uncalibrated"]) and torch.equal(y, logits["labels"])
    assert where == "fmnist-vit, fashion-mnist test (pre-computed, shipped with the app)"
    _, _, _, note = try_image.classify(str(sorted((SHIPPED / "examples").glob("*.png"))[0]), state)
    assert "Calibration in use: **pre-computed, shipped with the app** — model fmnist-vit" in note
    # No study, or a Hub id typed: the page is left as it is; a study that fails its checks says why.
    skip = gr.skip()
    assert calibrate.menu_model_view("fmnist-mixer", "") == (skip,) * 8
    assert calibrate.menu_model_view("fmnist-vit", "timm/resnet18.a1_in1k") == (skip,) * 8
    write_study(studies / "models" / "fmnist-mixer", "fmnist-mixer",
                _set("test_logits.safetensors", "labels", lambda y: y.index_fill(0, torch.tensor([0]), 10)))
    shipped.load_precomputed.cache_clear()  # read once per server: the test adds a study meanwhile
    answer = calibrate.menu_model_view("fmnist-mixer", "")
    assert answer[0].startswith("**No pre-computed result shown:** The pre-computed study in ")
    assert "its test labels must be 10000 class indices below 10" in answer[0] and answer[1:] == (skip,) * 7


def test_a_study_is_downloaded_from_the_operators_repository(studies, local_hub, tmp_path, monkeypatch):
    made = write_study(tmp_path / "made", "fmnist-vit")
    (made / "shift.json").unlink()  # a study without its shift part: the rest still opens
    hub = serving({("datasets/nctv-test/studies", f"fmnist-vit/{p.name}"): p.read_bytes() for p in made.iterdir()},
                  refusals={"datasets/nctv-test/gated": "GatedRepo"})
    local_hub(hub)
    monkeypatch.setenv(shipped.PRECOMPUTED_REPO_VARIABLE, "nctv-test/studies")
    pre = shipped.load_precomputed("fmnist-vit")
    folder = shipped.study_folder("fmnist-vit")
    assert folder.parent.parent.name == "snapshots" and folder.name == "fmnist-vit"
    _assert_labelled_as_shipped(pre, "fmnist-vit", folder)
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in made.iterdir())
    assert shipped.study_of("fmnist-vit", "shift.json") is None
    asked = [r for r in hub.seen if "/resolve/" in r[1]]
    assert all(path.startswith("/datasets/nctv-test/studies/resolve/main/fmnist-vit/") for _, path in asked)
    assert [r for r in asked if r[0] == "GET"] == [("GET", f"/datasets/nctv-test/studies/resolve/main/fmnist-vit/{n}")
                                                  for n in FILES[:-1]]  # each file once; shift.json is absent
    # once cached, used as it is: opening the study again asks the Hub nothing
    hub.seen.clear()
    shipped.load_precomputed.cache_clear()
    assert shipped.load_precomputed("fmnist-vit").calibration.model == "fmnist-vit"
    assert shipped.study_of("fmnist-vit", "gamma_sweep.json") is not None
    assert not [r for r in hub.seen if "fmnist-vit" in r[1]]
    # none for a model the repository lacks; a repository the server may not read says what to check
    assert shipped.load_precomputed("fmnist-mixer") is None
    monkeypatch.setenv(shipped.PRECOMPUTED_REPO_VARIABLE, "nctv-test/gated")
    shipped.load_precomputed.cache_clear()
    with pytest.raises(ValueError, match=r"is gated: accept its terms on the Hub and log in \(HF_TOKEN\)\. "
                                         r"Check NCTV_PRECOMPUTED_REPO\.$"):
        shipped.load_precomputed("fmnist-mixer")


def test_the_study_tabs_show_a_picked_menu_models_studies(studies):
    import gradio as gr

    from nctv.ui import gamma, initialisation

    write_study(studies / "models" / "fmnist-vit", "fmnist-vit")
    for tab, words in ((gamma, "Showing the sweep *pre-computed, shipped with the app* (model fmnist-vit, γ from 0 "
                               "to 1)"),
                       (initialisation, "Showing the study *pre-computed, shipped with the app* (model fmnist-vit, 5 "
                                        "runs per initialisation)")):
        status, figure, table, files = shipped.menu_study_view(tab.shipped_view, "fmnist-vit", "", outputs=4)
        assert status.startswith(words) and figure is not None and table
        assert str(studies / "models" / "fmnist-vit") in files[0]
        # no study for that model, or a Hub id typed: the tab stays as it is
        assert shipped.menu_study_view(tab.shipped_view, "fmnist-mixer", "", outputs=4) == (gr.skip(),) * 4
        assert shipped.menu_study_view(tab.shipped_view, "fmnist-vit", "org/model", outputs=4) == (gr.skip(),) * 4
        # back to the default model: its own studies
        assert "(model fmnist-resnet-overconfident" in shipped.menu_study_view(
            tab.shipped_view, "fmnist-resnet-overconfident", "", outputs=4)[0]
    write_study(studies / "models" / "fmnist-mixer", "fmnist-mixer", _sweep_nan)
    status, *rest = shipped.menu_study_view(gamma.shipped_view, "fmnist-mixer", "", outputs=4)
    assert status.startswith("**No pre-computed study shown:** The pre-computed gamma_sweep.json in ")
    assert "temperature must be 11 finite numbers" in status and rest == [gr.skip()] * 3


def test_the_shift_tab_shows_a_picked_menu_models_study(studies):
    """The Shift tab's answer to a picked menu model: that model's own shift.json (status, table,
    downloads and the page's numbers), the default's again when the default is picked back, and the
    tab as it is where the model has no study."""
    import gradio as gr

    from nctv.ui import shift as shift_tab

    def change(name, data):  # a study that differs from the default's in a figure the page shows
        if name == "shift.json":
            data["test"]["size"] = 1234

    folder = write_study(studies / "models" / "fmnist-vit", "fmnist-vit", change)
    status, table, versus, files, page = shipped.menu_study_view(shift_tab.menu_view, "fmnist-vit", "", outputs=5)
    assert status.startswith("Showing the study *pre-computed, shipped with the app*: model fmnist-vit, ")
    assert "scored on the 1,234 test pictures" in status and table.startswith("**ECE under distribution shift**") and versus
    assert files[0] == str(folder / "shift.json") and Path(files[1]).read_text(encoding="utf-8").startswith("corruption,severity,method")
    assert page["model"] == "fmnist-vit" and page["n_test"] == 1234
    shipped_page = shift_tab.first_view()
    assert shipped_page["model"] == "fmnist-resnet-overconfident" and page["conditions"] == shipped_page["conditions"]
    back = shipped.menu_study_view(shift_tab.menu_view, "fmnist-resnet-overconfident", "", outputs=5)
    assert back[4]["model"] == "fmnist-resnet-overconfident" and back[3][0] == str(studies / "shift.json")
    assert shipped.menu_study_view(shift_tab.menu_view, "fmnist-mixer", "", outputs=5) == (gr.skip(),) * 5
    assert shipped.menu_study_view(shift_tab.menu_view, "fmnist-vit", "org/model", outputs=5) == (gr.skip(),) * 5


def test_a_study_of_a_downloaded_dataset_is_shown_without_fetching_its_pictures(studies, monkeypatch):
    """A menu model's study made on a downloaded dataset (here one this server cannot reach): picking
    it fetches none of its pictures. δ is shown on a mid-grey picture, an opened group says where the
    pictures are, and Try's out-of-distribution check uses the detector shipped with the study (the
    same verdict and distance as that detector gives), or says it is unavailable without one."""
    import dataclasses
    import re

    import nctv.ui.caches as caches
    from nctv.data import get_splits
    from nctv.ood import fit_on_splits, penultimate_features, save_detector, split_about
    from nctv.ui import calibrate, try_image

    monkeypatch.setattr(caches, "_detectors", caches.Memo(4))
    shipped.shipped_detector.cache_clear()
    monkeypatch.setattr(caches, "_view_only", set())
    nowhere = "hf-dataset:nctv-test/nowhere"

    def change(name, data):
        if name == "results.json":
            data["settings"]["dataset"] = nowhere

    folder = write_study(studies / "models" / "fmnist-vit", "fmnist-vit", change)
    status, _, _, _, delta, _, state, shown = calibrate.menu_model_view("fmnist-vit", "")
    assert status.startswith("Showing the result **pre-computed, shipped with the app** (model fmnist-vit")
    assert state.split.dataset == nowhere
    assert "A mid-grey picture (this study&#x27;s test pictures are not on this server)" in delta
    pixels = np.array(json.loads(re.search(r'data-input="([^"]*)"', delta).group(1)))
    assert pixels.size == 28 * 28 and np.allclose(pixels, 127.5, atol=0.5)
    with pytest.raises(ValueError, match="^The pictures of this pre-computed study are not on this server"):
        calibrate.group_pictures(shown, "Vector Scaling", 14)
    picture = sorted((SHIPPED / "examples").glob("*.png"))[0]
    verdict = try_image.classify(str(picture), state)[0]
    assert 'data-flagged="unknown"' in verdict and "this pre-computed study came without its detector" in verdict
    # The operator's study ships the detector fitted on the study's own draw: Try uses it, no pictures needed.
    loaded = caches.get_model("fmnist-vit")
    cal, test = get_splits(loaded, None, calibration_size=5000, calibration_seed=0, test_size=10000)
    detector = fit_on_splits(loaded.model, cal, test, max_fit_images=300, max_threshold_images=200)
    save_detector(detector, folder / "ood.safetensors", split_about(**dataclasses.asdict(state.split)))
    caches._detectors = caches.Memo(4)
    shipped.shipped_detector.cache_clear()  # looked up once per server: the test writes a new one
    verdict = try_image.classify(str(picture), state)[0]
    x = loaded.preprocess(Image.open(picture).convert("L"))
    distance = float(detector.score(penultimate_features(loaded.model, x[None]))[0])
    flagged = "true" if distance > detector.threshold_ else "false"
    assert f'data-flagged="{flagged}"' in verdict
    assert f"distance {distance:.1f}; pictures above {detector.threshold_:.1f} are flagged" in verdict
    # A detector of another draw is not used for this one.
    save_detector(detector, folder / "ood.safetensors", split_about("fmnist-vit", nowhere, 5000, 1, 10000))
    caches._detectors = caches.Memo(4)
    shipped.shipped_detector.cache_clear()  # looked up once per server: the test writes a new one
    assert 'data-flagged="unknown"' in try_image.classify(str(picture), state)[0]


def test_the_shipped_detector_is_the_one_the_app_fits(monkeypatch):
    """assets/precomputed/ood.safetensors is what the app would fit on the embedded default's draw
    (scripts/make_precomputed.py --only ood): same class means, covariance and threshold."""
    import nctv.ui.caches as caches
    from nctv.ood import OOD_FILE, load_detector

    monkeypatch.setattr(caches, "_detectors", caches.Memo(4))
    shipped.shipped_detector.cache_clear()
    shipped.load_precomputed.cache_clear()
    spec = shipped.load_precomputed().split
    fitted = caches.get_ood_detector(spec)  # nothing saved offered: fitted on the splits
    found = shipped.shipped_detector(spec)
    assert found is not None and found is not fitted
    for name in ("means_", "covariance_", "held_out_scores_"):
        assert torch.allclose(getattr(found, name), getattr(fitted, name), rtol=1e-4, atol=1e-6), name
    assert found.threshold_ == pytest.approx(fitted.threshold_, rel=1e-4)
    assert load_detector(SHIPPED / OOD_FILE)[1]["model"] == spec.model
    monkeypatch.setattr(caches, "_detectors", caches.Memo(4))
    shipped.shipped_detector.cache_clear()
    assert torch.equal(shipped.ood_detector(spec).means_, found.means_)
