"""The estimator contract of every calibrator (get_params / set_params / clone), saving and loading in
the Hub's layout (folders, the Hub cache offline), CalibratedModel and `nctv apply`, on the embedded
default model with a small calibration split."""
import hashlib
import http.server
import inspect
import json
import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image

from nctv import cli, data, zoo
from nctv.cache import model_fingerprint
from nctv.calibration import (METHODS, BaseCalibrator, CalibratedModel, ModelMismatchWarning, NotFittedError,
                              load_calibrator, make_method)
from nctv.calibration.saving import CONFIG_NAME, FORMAT_VERSION, TENSORS_NAME, method_name
from nctv.inference import model_logits

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "assets" / "precomputed" / "examples" / "0000-ankle-boot.png"

# Small but real settings, so that every method fits in seconds on the 500-image split.
FAST = {
    "MS-ODIR": {"lambdas": (0.1, 10.0), "mus": (0.1, 10.0), "n_folds": 2},
    "Dir-ODIR": {"lambdas": (0.1, 10.0), "mus": (0.1, 10.0), "n_folds": 2},
    "Neural Clamping (CE)": {"max_passes": 2},
    "Neural Clamping (FL)": {"max_passes": 2, "init": "data"},
    "NC (Eff.)": {"clamp": True},
}


@pytest.fixture(scope="module")
def loaded():
    return zoo.load_model(zoo.DEFAULT_MODEL)


@pytest.fixture(scope="module")
def other_model():
    return zoo.load_model("fmnist-resnet")


@pytest.fixture(scope="module")
def splits(loaded):
    cal, test = data.get_splits(loaded, calibration_size=500, test_size=64)
    xc, yc = cal.tensors()
    xt, _ = test.tensors()
    return xc, yc, model_logits(loaded.model, xc), xt, model_logits(loaded.model, xt)


def _make(name, loaded, **extra):
    spec = METHODS[name]
    kw = {**FAST.get(name, {}), **extra}
    if spec.needs_model:
        kw.setdefault("input_range", loaded.input_range)
    return make_method(name, model=loaded.model if spec.needs_model else None, **kw)


@pytest.fixture(scope="module")
def fitted(loaded, splits):
    xc, yc, zc, _, _ = splits
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fast fitter's small-split warning: 500 images are few, on purpose
        for name, spec in METHODS.items():
            cal = _make(name, loaded)
            out[name] = cal.fit(xc, yc) if spec.needs_model else cal.fit(zc, yc)
    return out


def _outputs(cal, splits):
    _, _, _, xt, zt = splits
    return cal.predict_logits(xt) if hasattr(cal, "predict_logits") else cal.transform(zt)


# ---- the estimator contract -------------------------------------------------------------------


#: A value of every Neural Clamping option, none of them its default.
NEURAL_CLAMPING_OPTIONS = dict(gamma=0.5, weight_decay=0.02, init="data", fitter="paper", epochs=3, lr=0.005,
                               momentum=0.5, batch_size=64, init_std=0.2, learn_delta=False, temperature="selected",
                               clamp=True, gamma_candidates=(0.5, 2.0), max_passes=7, tol=0.01)


@pytest.mark.parametrize("name", list(METHODS))
def test_constructor_stores_every_argument_under_its_name(name, loaded):
    cls = type(_make(name, loaded))
    names = cls._param_names()
    # Neural Clamping's options are one object, checked when it is made: they take real (non-default) values.
    options = NEURAL_CLAMPING_OPTIONS if "options" in inspect.signature(cls).parameters else {}
    sentinels = {n: options.get(n, object()) for n in names}
    cal = cls(**sentinels)
    assert all(getattr(cal, n) is sentinels[n] for n in names)
    assert isinstance(cal, BaseCalibrator)
    if "progress" in names:
        assert _make(name, loaded).progress is False


@pytest.mark.parametrize("name", list(METHODS))
def test_get_set_params_and_clone(name, loaded, fitted):
    cal = fitted[name]
    params = cal.get_params()
    assert list(params) == list(type(cal)._param_names()) and cal.get_params(deep=True) == params
    rebuilt = type(cal)(**params)
    assert rebuilt.get_params() == params and repr(rebuilt) == repr(cal)

    copy = cal.clone()
    assert type(copy) is type(cal) and copy.get_params().keys() == params.keys()
    assert not [k for k in vars(copy) if k.endswith("_")]  # unfitted
    assert repr(copy) == repr(cal)
    if "model" in params:
        assert copy.model is cal.model  # the model is shared, never copied
    if "input_range" in params:
        assert copy.input_range[0] is not cal.input_range[0]  # settings are copied

    assert copy.set_params() is copy
    if params:
        key = next(k for k in params if k != "model")
        copy.set_params(**{key: params[key]})
        assert getattr(copy, key) == params[key]
    with pytest.raises(ValueError, match=r"has no setting 'no_such_setting'; its settings are: ") as e:
        copy.set_params(no_such_setting=1)
    assert all(k in str(e.value) for k in params)


def test_repr_names_the_model_and_shortens_tensors(loaded):
    nc = make_method("Neural Clamping (FL)", model=loaded.model, input_range=loaded.input_range)
    text = repr(nc)
    assert text.startswith("NeuralClamping(model=ResNet, gamma=1.0,") and "tensor(shape=(1, 28, 28))" in text
    assert repr(make_method("Temperature Scaling")) == "TemperatureScaling()"


def test_set_params_changes_the_next_fit(splits):
    _, yc, zc, _, _ = splits
    ts = make_method("Temperature Scaling (FL)")
    assert ts.set_params(gamma=0.0).fit(zc, yc).temperature_ == pytest.approx(
        make_method("Temperature Scaling").fit(zc, yc).temperature_, rel=1e-6)


# ---- save and load ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(METHODS))
def test_round_trip_behaves_identically(name, loaded, fitted, splits, tmp_path):
    cal = fitted[name]
    folder = cal.save_pretrained(tmp_path / "cal", model=loaded)
    assert sorted(p.name for p in folder.iterdir()) == sorted([CONFIG_NAME, TENSORS_NAME])
    config = json.loads((folder / CONFIG_NAME).read_text())
    assert config["nctv_format"] == FORMAT_VERSION and config["method"] == name
    assert config["class"] == type(cal).__name__
    assert config["model"] == {"name": loaded.name, "source": loaded.source, "class": "ResNet",
                               "fingerprint": model_fingerprint(loaded.model)}
    assert config["data_config"]["input_size"] == [1, 28, 28] and config["data_config"]["mean"] == [0.2858]

    back = load_calibrator(folder, model=loaded if METHODS[name].needs_model else None)
    assert type(back) is type(cal)
    assert torch.equal(_outputs(back, splits), _outputs(cal, splits))  # bitwise
    for key, value in vars(cal).items():
        if key.endswith("_") and isinstance(value, (int, float, str, bool)):
            assert getattr(back, key) == value, key
    assert repr(back) == repr(cal)


def test_config_holds_the_fitted_numbers(fitted, tmp_path):
    odir = json.loads((fitted["MS-ODIR"].save_pretrained(tmp_path / "odir") / CONFIG_NAME).read_text())
    assert odir["fitted"]["lambda_"] == fitted["MS-ODIR"].lambda_ and "mu_" in odir["fitted"]
    assert odir["fitted"]["weight_"] == {"__tensor__": "fitted.weight_", "numpy": False}
    assert odir["model"] is None and odir["data_config"] is None  # no model given: none recorded
    nc = json.loads((fitted["Neural Clamping (FL)"].save_pretrained(tmp_path / "nc") / CONFIG_NAME).read_text())
    assert {"temperature_", "gamma_", "weight_decay_", "delta_"} <= set(nc["fitted"])
    assert nc["not_saved"] == ["model", "device", "callback"] and "model" not in nc["params"]
    assert nc["model"]["fingerprint"] and nc["params"]["init"] == "data"


def test_method_name_follows_the_fitted_gamma(loaded):
    nc = make_method("Neural Clamping (FL)", model=loaded.model)
    assert method_name(nc) == "Neural Clamping (FL)"
    nc.gamma_ = 0.0  # gamma="auto" settled on cross entropy
    assert method_name(nc) == "Neural Clamping (CE)"
    nc.gamma_ = 0.5
    assert method_name(nc) == "Neural Clamping (FL)"


def test_loaded_nc_classifies_a_new_image_as_before(loaded, fitted, tmp_path):
    nc = fitted["Neural Clamping (FL)"]
    x = loaded.preprocess(Image.open(EXAMPLE))[None]
    before = nc.predict_logits(x)
    nc.save_pretrained(tmp_path / "nc", model=loaded)
    back = load_calibrator(f"local-dir:{tmp_path / 'nc'}", model=loaded)
    assert torch.equal(back.predict_logits(x), before)
    assert torch.equal(back.delta_, nc.delta_) and back.temperature_ == nc.temperature_


def test_nc_needs_its_model_and_warns_about_another(loaded, other_model, fitted, tmp_path):
    folder = fitted["Neural Clamping (CE)"].save_pretrained(tmp_path / "nc", model=loaded)
    with pytest.raises(ValueError, match=r"works on the model's inputs: pass the model .* 'fmnist-resnet-overconf"):
        load_calibrator(folder)
    with pytest.warns(ModelMismatchWarning, match="fitted for 'fmnist-resnet-overconfident'.*other weights"):
        back = load_calibrator(folder, model=other_model)
    assert back.model is other_model.model
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelMismatchWarning)
        load_calibrator(folder, model=loaded.model)  # the same weights: no warning


def test_saving_refuses_what_cannot_come_back(other_model, fitted, tmp_path):
    with pytest.raises(NotFittedError, match="fit it before save_pretrained"):
        make_method("Temperature Scaling").save_pretrained(tmp_path / "a")
    with pytest.raises(ValueError, match="fitted with another model"):
        fitted["NC (Eff.)"].save_pretrained(tmp_path / "b", model=other_model)

    class Custom(BaseCalibrator):
        pass

    custom = Custom()
    custom.temperature_ = 1.0
    with pytest.raises(ValueError, match="Custom is not one of NCTV's calibration methods"):
        custom.save_pretrained(tmp_path / "c")


def test_loading_explains_bad_folders(fitted, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="does not exist; give a folder written by save_pretrained"):
        load_calibrator(tmp_path / "missing")
    model_folder = zoo.get_entry(zoo.DEFAULT_MODEL).source[len("local-dir:"):]
    with pytest.raises(ValueError, match="has no calibrator.safetensors, so it is not a saved calibrator"):
        load_calibrator(data.assets_dir() / model_folder)

    folder = fitted["Temperature Scaling"].save_pretrained(tmp_path / "ts")
    config = json.loads((folder / CONFIG_NAME).read_text())
    for change, message in [({"nctv_format": FORMAT_VERSION + 1}, "written by a newer NCTV"),
                            ({"nctv_format": None}, "not a saved NCTV calibrator"),
                            ({"class": "os.system"}, "is not one of NCTV's methods"),
                            ({"params": {"colour": 1}}, "settings this NCTV does not know"),
                            ({"fitted": {"__class__": 1}}, "is not a fitted value's name"),
                            ({"fitted": {"temperature_": {"__tensor__": "x"}}}, "lacks the tensor 'x'")]:
        (folder / CONFIG_NAME).write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            load_calibrator(folder)
    (folder / CONFIG_NAME).write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_calibrator(folder)


def test_loading_never_unpickles(fitted, tmp_path, monkeypatch):
    folder = fitted["Dir-ODIR"].save_pretrained(tmp_path / "dir")

    def refuse(*args, **kwargs):
        raise AssertionError("a saved calibrator must load without pickle")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    assert load_calibrator(folder).lambda_ == fitted["Dir-ODIR"].lambda_


def test_hub_round_trip_offline(fitted, splits, tmp_path, monkeypatch):
    from huggingface_hub import constants

    hub = tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    repo = hub / "models--nctv-test--ts-grid"
    fitted["TS by Grid Search"].save_pretrained(repo / "snapshots" / ("b" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("b" * 40)

    back = load_calibrator("hf-hub:nctv-test/ts-grid")
    assert torch.equal(_outputs(back, splits), _outputs(fitted["TS by Grid Search"], splits))
    assert back.grid_.dtype == fitted["TS by Grid Search"].grid_.dtype  # numpy arrays come back as numpy
    with pytest.raises(ValueError, match=r"'hf-hub:nctv-test/never-saved' is not in the Hugging Face cache .* "
                                         "HF_HUB_OFFLINE=1"):
        load_calibrator("hf-hub:nctv-test/never-saved")
    with pytest.raises(ValueError, match="is not a valid Hugging Face model id"):
        load_calibrator("hf-hub:../../etc")


class _CalibratorHub(http.server.BaseHTTPRequestHandler):
    """Serves one saved calibrator as the Hub serves repository files (nctv-test/vs at revision main)."""

    folder: Path = None

    def _answer(self) -> bytes | None:
        repo, _, rest = self.path.lstrip("/").partition("/resolve/")
        revision, _, filename = rest.partition("/")
        found = repo == "nctv-test/vs" and revision == "main" and (self.folder / filename).is_file()
        body = (self.folder / filename).read_bytes() if found else None
        self.send_response(200 if found else 404)
        if not found:
            code = ("RepoNotFound" if repo != "nctv-test/vs" else "RevisionNotFound" if revision != "main"
                    else "EntryNotFound")
            self.send_header("X-Error-Code", code)
        self.send_header("X-Repo-Commit", "e" * 40)
        self.send_header("ETag", f'"{hashlib.sha1(body or b"").hexdigest()}"')
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        return body

    def do_HEAD(self):
        self._answer()

    def do_GET(self):
        body = self._answer()
        if body:
            self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_hub_download_through_a_local_endpoint(fitted, tmp_path, monkeypatch, local_hub):
    """The Hub cannot be reached from where this project is built, so a local endpoint stands in for it."""
    from huggingface_hub import constants

    _CalibratorHub.folder = fitted["Vector Scaling"].save_pretrained(tmp_path / "vs")
    local_hub(_CalibratorHub)
    downloaded = load_calibrator("hf-hub:nctv-test/vs")
    with pytest.raises(ValueError, match=r"'hf-hub:nctv-test/none' does not exist on the Hub \(or is private"):
        load_calibrator("hf-hub:nctv-test/none")
    with pytest.raises(ValueError, match="'hf-hub:nctv-test/vs' has no revision 'v2'"):
        load_calibrator("hf-hub:nctv-test/vs@v2")
    assert torch.equal(downloaded.weight_, fitted["Vector Scaling"].weight_.cpu())
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # downloaded once: the cache serves it from now on
    assert torch.equal(load_calibrator("hf-hub:nctv-test/vs").bias_, downloaded.bias_)


# ---- deployment ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(METHODS))
def test_calibrated_model_matches_the_calibrator(name, loaded, fitted, splits):
    _, _, _, xt, _ = splits
    with torch.no_grad():
        out = CalibratedModel(loaded, fitted[name])(xt)
    assert out.dtype == torch.float32 and torch.equal(out, _outputs(fitted[name], splits))


@pytest.mark.parametrize("name", ["Temperature Scaling", "Dir-ODIR", "Neural Clamping (FL)", "NC (Eff.)"])
def test_calibrated_model_traces_and_exports(name, loaded, fitted, splits):
    _, _, _, xt, _ = splits
    module = CalibratedModel(loaded.model, fitted[name])
    expected = _outputs(fitted[name], splits)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.trace is deprecated in favour of export
        warnings.simplefilter("error", torch.jit.TracerWarning)  # a Python-side branch would freeze in a trace
        traced = torch.jit.trace(module, xt[:2])
    assert torch.equal(traced(xt), expected)
    exported = torch.export.export(module, (xt[:2],))
    # Compared with the module on the same batch of 2: float32 kernels block their sums by batch size, so the
    # rows of a batch of 2 and the same rows of the batch of 64 behind `expected` differ in the last bits
    # (7e-7 apart on this machine); on the same batch the exported graph does the module's arithmetic exactly.
    with torch.no_grad():
        assert torch.equal(exported.module()(xt[:2]), module(xt[:2]))


def test_calibrated_model_clamps_like_nc(loaded, fitted, splits):
    _, _, _, xt, _ = splits
    far = fitted["NC (Eff.)"].clone()  # clamp=True; a δ that pushes every pixel past the input range
    far.delta_, far.temperature_ = torch.full((1, 28, 28), 5.0), 2.0
    module = CalibratedModel(loaded, far)
    assert torch.equal(module.lower, loaded.input_range[0]) and torch.equal(module.upper, loaded.input_range[1])
    with torch.no_grad():
        out = module(xt)
    assert torch.equal(out, far.predict_logits(xt))
    assert not torch.equal(out, model_logits(loaded.model, xt + far.delta_) / far.temperature_)


# ---- nctv apply ------------------------------------------------------------------------------


def _apply(capsys, *args):
    status = cli.main(["apply", *map(str, args)])
    out, err = capsys.readouterr()
    return status, out, err


def test_apply_prints_calibrated_top_k(loaded, fitted, tmp_path, capsys):
    nc = fitted["Neural Clamping (FL)"]
    folder = nc.save_pretrained(tmp_path / "nc", model=loaded)
    second = ROOT / "assets" / "precomputed" / "examples" / "0004-shirt.png"
    status, out, err = _apply(capsys, "--calibrator", folder, "--device", "cpu", EXAMPLE, second)
    assert status == 0, err
    lines = out.splitlines()
    assert lines[0] == str(EXAMPLE) and lines[6] == str(second) and len(lines) == 13
    assert lines[-1].startswith("apply: Neural Clamping (FL) from ") and "fmnist-resnet-overconfident" in lines[-1]
    x = loaded.preprocess(Image.open(EXAMPLE))[None]
    p = torch.softmax(nc.predict_logits(x).double(), dim=1)[0]
    top = torch.topk(p, 5)
    for line, v, i in zip(lines[1:6], top.values, top.indices):
        label, shown = line.strip().rsplit("  ", 1)
        assert label.strip() == loaded.class_names[int(i)] and shown.strip() == f"{100 * float(v):.1f} %"


def test_apply_top_k_and_the_models_name(loaded, fitted, tmp_path, capsys):
    folder = fitted["Temperature Scaling"].save_pretrained(tmp_path / "ts", model=loaded)
    status, out, _ = _apply(capsys, "--calibrator", folder, "--model", zoo.DEFAULT_MODEL, "--top-k", "2", EXAMPLE)
    assert status == 0 and len(out.splitlines()) == 4 and "top 2" in out


def test_apply_explains_mistakes(loaded, other_model, fitted, tmp_path, capsys):
    folder = fitted["Temperature Scaling"].save_pretrained(tmp_path / "ts", model=loaded)
    notes = tmp_path / "notes.png"
    notes.write_text("not a picture")
    cases = [((folder, tmp_path / "missing.png"), "missing.png does not exist"),
             ((folder, notes), "notes.png is not an image nctv can read"),
             ((tmp_path / "nowhere", EXAMPLE), "Calibrator folder .*nowhere does not exist")]
    for (cal, image), message in cases:
        status, _, err = _apply(capsys, "--calibrator", cal, image)
        assert status == 2 and len(err.strip().splitlines()) == 1
        assert err.startswith("nctv apply: error: ") and re.search(message, err), err
    other = fitted["Temperature Scaling"].save_pretrained(tmp_path / "other", model=other_model)
    status, _, err = _apply(capsys, "--calibrator", other, "--model", zoo.DEFAULT_MODEL, EXAMPLE)
    assert status == 2 and "was saved for 'fmnist-resnet', not for 'fmnist-resnet-overconfident'" in err
    assert "use --model fmnist-resnet" in err
    unnamed = fitted["Temperature Scaling"].save_pretrained(tmp_path / "unnamed")
    status, _, err = _apply(capsys, "--calibrator", unnamed, EXAMPLE)
    assert status == 2 and "name the model with --model" in err


def test_apply_is_in_the_help():
    text = cli.build_parser().format_help()
    assert "apply" in text and "nctv apply --calibrator" in text
