"""The Calibrate tab's calibrators.zip and the Try tab's loading of it: a real run, its real
download, loaded back as a visitor would; and zips a hostile visitor could send."""
import json
import re
import zipfile
from pathlib import Path

import gradio as gr
import pytest
import torch

from nctv.calibration.saving import CONFIG_NAME, TENSORS_NAME
from nctv.settings import NCOptions
from nctv.ui import calibrate as cal_tab
from nctv.ui import session, try_image
from nctv.ui.upload_calibrator import calibration_from_zip, load_calibrators
from nctv.zoo import DEFAULT_MODEL


@pytest.fixture(scope="module")
def run_and_zip():
    spec = session.SplitSpec(DEFAULT_MODEL, None, 400, 0, 1000)
    nc = NCOptions()
    result, calibration = cal_tab.run_calibration(spec, ["Temperature Scaling", "Neural Clamping (FL)"], 15, nc)
    files = cal_tab.export_files(result, calibration, 15)
    archive = next(Path(f) for f in files if f.endswith("calibrators.zip"))
    return result, calibration, archive


def test_the_download_holds_every_fitted_calibrator(run_and_zip):
    result, _, archive = run_and_zip
    with zipfile.ZipFile(archive) as z:
        names = sorted(n for n in z.namelist() if not n.endswith("/"))
        configs = {n.split("/")[0]: json.loads(z.read(n)) for n in names if n.endswith(CONFIG_NAME)}
    assert set(configs) == {"temperature-scaling", "neural-clamping-fl"}
    assert {n.split("/")[1] for n in names} == {CONFIG_NAME, TENSORS_NAME}
    assert configs["neural-clamping-fl"]["method"] == "Neural Clamping (FL)"
    assert configs["neural-clamping-fl"]["model"]["name"] == DEFAULT_MODEL
    t = result.methods["Temperature Scaling"].params["temperature"]
    assert configs["temperature-scaling"]["fitted"]["temperature_"] == pytest.approx(t, rel=1e-12)


def test_a_loaded_zip_gives_the_same_confidences_as_the_run(run_and_zip):
    _, calibration, archive = run_and_zip
    loaded, line = load_calibrators(str(archive), None)
    assert "Loaded **Neural Clamping (FL)**" in line
    assert torch.equal(loaded.delta, calibration.delta)
    assert loaded.nc_temperature == pytest.approx(calibration.nc_temperature, rel=1e-12)
    assert loaded.ts_temperature == pytest.approx(calibration.ts_temperature, rel=1e-12)
    picture = try_image.example_images()[3]
    before = try_image.classify_image(picture, calibration)
    after = try_image.classify_image(picture, loaded)
    # The chart of confidences and the δ view, to the last digit. The sentence on which bar to trust
    # names the best one from the run's test figures, which a zip of calibrators does not carry: the
    # loaded calibration's says to trust a calibrated bar.
    trust = re.compile(r'<p class="nctv-trust">.*?</p>')
    assert trust.sub("", before[1]) == trust.sub("", after[1]) and before[2] == after[2]
    assert "Trust the " in trust.search(before[1]).group(0)
    assert "Trust a calibrated bar (TS or NC)" in trust.search(after[1]).group(0)
    assert "loaded from calibrators.zip" in after[3]


def _zip(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def test_hostile_or_wrong_zips_are_refused_in_words(run_and_zip, tmp_path):
    _, _, archive = run_and_zip
    with zipfile.ZipFile(archive) as z:
        good = {n: z.read(n) for n in z.namelist() if not n.endswith("/")}
    nc_config = good["neural-clamping-fl/config.json"]
    cases = {
        "outside": ({"../evil/config.json": nc_config}, "outside its folders"),
        "absolute": ({"/tmp/evil/config.json": nc_config}, "outside its folders"),
        "code": ({**good, "neural-clamping-fl/run.py": b"print('hi')"}, "has only config.json"),
        "empty": ({"readme/config.txt": b"x"}, "has only config.json"),
        "no-nc": ({n: d for n, d in good.items() if n.startswith("temperature-scaling/")},
                  "no Neural Clamping calibrator"),
        "other-model": ({n: (d.replace(DEFAULT_MODEL.encode(), b"someone/elses-model") if n.endswith(".json") else d)
                         for n, d in good.items()}, "which this app does not offer"),
    }
    for name, (files, words) in cases.items():
        with pytest.raises(ValueError, match=words):
            calibration_from_zip(_zip(tmp_path / f"{name}.zip", files), None)
    assert not (tmp_path.parent / "evil").exists()
    text = tmp_path / "notes.zip"
    text.write_text("not a zip")
    with pytest.raises(gr.Error, match="not a zip"):
        load_calibrators(str(text), None)


def test_the_visitors_calibration_expires_from_the_session():
    from nctv.ui.app import build_app
    from nctv.ui.upload_calibrator import CALIBRATION_TTL_S

    # Gradio drops a closed tab's state by itself; an open, idle tab's only by its time to live.
    states = [b for b in build_app().blocks.values() if isinstance(b, gr.State)]
    assert any(s.time_to_live == CALIBRATION_TTL_S for s in states)
    assert not [s for s in states if s.time_to_live == float("inf")]
