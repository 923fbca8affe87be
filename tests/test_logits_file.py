"""Bring your own logits (nctv.logits_file, `nctv run --logits FILE`): any classifier's logits and
labels, in .npz, .safetensors or .csv, calibrated by the logit methods with the run's metrics and
tables. Known answers: logits whose labels are drawn from softmax(z / 2) are calibrated by T = 2, so
temperature scaling finds T near 2; the uncalibrated ECE equals one computed here by hand with numpy;
the three formats give the same numbers; a file split in halves uses the documented permutation.
Crafted files (NaN, labels out of range, pickled arrays, lying headers, too few rows) are refused in
words before anything is fitted."""
import csv
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from nctv.canonical import canonical_order
from nctv.cli import main
from nctv.logits_file import MAX_LOGITS_VALUES, read_logits, run_on_logits

T_TRUE = 2.0


def _data(n=3000, k=4, seed=0):
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, k)) * 3
    p = np.exp(z / T_TRUE - (z / T_TRUE).max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    y = (rng.random(n)[:, None] > np.cumsum(p, 1)).sum(1)
    return z, y


def _ece_by_hand(z, y, bins=15):
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    conf, pred = p.max(1), p.argmax(1)
    edges = np.linspace(0, 1, bins + 1)
    which = np.clip(np.searchsorted(edges, conf, side="left") - 1, 0, bins - 1)
    return sum(abs(conf[which == b].mean() - (pred == y)[which == b].mean()) * (which == b).mean()
               for b in range(bins) if (which == b).any())


def _write(path, z, y, cut=1500):
    arrays = {"calibration_logits": z[:cut], "calibration_labels": y[:cut], "test_logits": z[cut:],
              "test_labels": y[cut:]}
    if path.suffix == ".npz":
        np.savez(path, **arrays, class_names=np.array(["cat", "dog", "owl", "eel"]))
    elif path.suffix == ".safetensors":
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(path),
                  metadata={"class_names": json.dumps(["cat", "dog", "owl", "eel"])})
    else:
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["split", "label", "cat", "dog", "owl", "eel"])
            for i in range(len(z)):
                w.writerow(["calibration" if i < cut else "test", int(y[i]), *map(repr, z[i].tolist())])
    return path


def test_the_cli_calibrates_a_files_logits_with_known_answers(tmp_path):
    z, y = _data()
    path = _write(tmp_path / "logits.npz", z, y)
    out = tmp_path / "run"
    assert main(["run", "--logits", str(path), "--methods", "uncal", "ts", "vs", "--seeds", "1", "--bins", "15",
                 "--out", str(out), "--quiet"]) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["model"]["name"] == "logits.npz"
    ts = result["methods"]["Temperature Scaling"]["params"]["temperature"]
    assert abs(ts - T_TRUE) < 0.15, ts
    uncal = result["methods"]["Uncalibrated"]["metrics"]["15"]["ece"]["mean"]
    assert uncal == pytest.approx(_ece_by_hand(z[1500:], y[1500:]), abs=1e-9)
    assert (out / "table_main.md").exists() or any(out.glob("*.md"))


@pytest.mark.parametrize("suffix", [".safetensors", ".csv"])
def test_every_format_gives_the_same_run(tmp_path, suffix):
    z, y = _data(n=600)
    runs = []
    for s in (".npz", suffix):
        data = read_logits(_write(tmp_path / f"l{s}", z, y, cut=300))
        assert data.class_names == ("cat", "dog", "owl", "eel") and data.split == "file"
        runs.append(run_on_logits(data, ["Uncalibrated", "Temperature Scaling"], None))
    a, b = (r.methods["Temperature Scaling"] for r in runs)
    assert a.params["temperature"] == pytest.approx(b.params["temperature"], rel=1e-12)
    assert a.metrics[15]["ece"].mean == pytest.approx(b.metrics[15]["ece"].mean, rel=1e-12)


def test_one_set_is_split_in_the_documented_halves(tmp_path):
    z, y = _data(n=101)
    np.savez(tmp_path / "one.npz", logits=z, labels=y)
    data = read_logits(tmp_path / "one.npz", seed=7)
    # numpy's seeded permutation of the rows' places in the canonical order: the same halves for the rows in any order.
    order = canonical_order(z, y)[np.random.default_rng(7).permutation(101)]
    assert np.array_equal(data.calibration_logits, z[order[:50]]) and np.array_equal(data.test_labels, y[order[50:]])
    shuffle = np.random.default_rng(2).permutation(101)
    np.savez(tmp_path / "shuffled.npz", logits=z[shuffle], labels=y[shuffle])
    again = read_logits(tmp_path / "shuffled.npz", seed=7)
    assert np.array_equal(again.calibration_logits, data.calibration_logits)
    assert np.array_equal(again.test_labels, data.test_labels)
    assert data.class_names == ("class 0", "class 1", "class 2", "class 3")


def test_neural_clamping_says_it_needs_the_model(tmp_path, capsys):
    z, y = _data(n=200)
    path = _write(tmp_path / "l.npz", z, y, cut=100)
    assert main(["run", "--logits", str(path), "--methods", "nc-fl", "--out", str(tmp_path / "r"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Neural Clamping (FL) works on the model's inputs" in err and "Temperature Scaling" in err
    assert main(["run", "--logits", str(path), "--model", "fmnist-vit", "--out", str(tmp_path / "r")]) == 2


def _npz(tmp_path, **arrays):
    np.savez(tmp_path / "x.npz", **arrays)
    return tmp_path / "x.npz"


def _lying_npz(tmp_path):
    """A .npz whose logits header declares far more values than the cap (the data is not there)."""
    path = tmp_path / "x.npz"
    header = {"descr": "<f8", "fortran_order": False, "shape": (MAX_LOGITS_VALUES, 2)}
    with zipfile.ZipFile(path, "w") as zf:
        for key, head in (("logits", header), ("labels", {"descr": "<i8", "fortran_order": False, "shape": (3,)})):
            import io
            buf = io.BytesIO()
            np.lib.format.write_array_header_1_0(buf, head)
            zf.writestr(key + ".npy", buf.getvalue() + b"\0" * 24)
    return path


def _file(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return path


Z, Y = _data(n=100)
CRAFTED = [
    (lambda t: _npz(t, logits=np.where(np.arange(400).reshape(100, 4) == 5, np.nan, Z), labels=Y),
     r"logits holds NaN or infinite values"),
    (lambda t: _npz(t, logits=Z, labels=np.where(np.arange(100) == 3, 9, Y)), r"labels holds 9; labels are class "
                                                                                r"indices from 0 to 3"),
    (lambda t: _npz(t, logits=Z, labels=Y + 0.5), r"labels must be whole class indices"),
    (lambda t: _npz(t, logits=Z.astype(np.int64), labels=Y), r"logits must be floating-point numbers"),
    (lambda t: _npz(t, logits=Z[:, :1], labels=Y * 0), r"a classifier has at least 2 classes"),
    (lambda t: _npz(t, logits=Z[:30], labels=Y[:30]), r"the calibration split has 15 examples; at least 20"),
    (lambda t: _npz(t, logits=Z, labels=Y[:99]), r"100 rows of logits but 99 labels"),
    (lambda t: _npz(t, logits=np.array([{"a": 1}] * 2, dtype=object), labels=Y[:2]), r"holds Python objects"),
    (lambda t: _npz(t, scores=Z), r"holds scores; a logits file holds calibration_logits"),
    (lambda t: _npz(t, calibration_logits=Z, calibration_labels=Y, test_logits=Z[:, :3], test_labels=Y),
     r"the calibration logits have 4 classes, the test logits 3"),
    (_lying_npz, r"holds [\d,]+ values; at most [\d,]+ are read \(NCTV_MAX_LOGITS_VALUES\)"),
    (lambda t: _file(t, "x.npz", b"PK\x03\x04 not a zip"), r"is not a \.npz file numpy wrote"),
    (lambda t: _file(t, "x.safetensors", (2**40).to_bytes(8, "little") + b"{}"),
     r"its header length is wrong"),
    (lambda t: _file(t, "x.csv", "label,a,b\n1,0.5\n"), r"line 2: 2 values for 3 columns"),
    (lambda t: _file(t, "x.csv", "a,b\n0.5,1\n"), r"no column 'label'"),
    (lambda t: _file(t, "x.csv", "label,a,b\n٣,0.5,1\n"), r"is not a class index"),
    (lambda t: _file(t, "x.csv", "label,a,b\n1,１e-3,1\n"), r"is not a number"),
    (lambda t: _file(t, "x.csv", "label,a,b\n" + "1,nan,1\n" * 60), r"NaN or infinite"),
    (lambda t: _file(t, "x.pkl", b"\x80\x04"), r"give a \.npz, \.safetensors or \.csv file"),
]


@pytest.mark.parametrize("make, words", CRAFTED)
def test_a_crafted_logits_file_is_refused_in_words(tmp_path, make, words):
    path = make(tmp_path)
    with pytest.raises(ValueError, match=words):
        read_logits(path)


def test_the_apps_calibrate_tab_takes_an_upload_of_logits(tmp_path):
    """The Calibrate tab's "Your own logits" upload: the ticked logit methods run on the file (their
    figures equal the library's run on it), Neural Clamping is named as not run, a clicked group says
    there are no pictures, and an upload of Neural Clamping alone, or of no file, is refused in words."""
    import gradio as gr

    from nctv.ui import calibrate

    z, y = _data(n=800)
    path = _write(tmp_path / "mine.npz", z, y, cut=400)
    *_, out = calibrate.calibrate_logits(str(path), ["Uncalibrated", "Temperature Scaling", "Neural Clamping (FL)"],
                                         15, 0)
    status, table, diagrams, params, delta, files, shown = out
    assert status.startswith("**Done**") and "2 methods on mine.npz (4 classes; 400 calibration and 400 test rows)" \
        in status and "Not run: Neural Clamping (FL) (it needs the model's pictures)" in status
    library = run_on_logits(read_logits(path), ["Uncalibrated", "Temperature Scaling"], None)
    saved = json.loads(Path(next(f for f in files if f.endswith("results.json"))).read_text())
    ts = library.methods["Temperature Scaling"]
    assert saved["methods"]["Temperature Scaling"]["params"]["temperature"] == pytest.approx(ts.params["temperature"])
    assert f"{100 * ts.metrics[15]['ece'].mean:.2f}" in table and "Conformal prediction sets: LAC at 90 % coverage" in table
    assert [m["name"] for m in diagrams["methods"]] == ["Uncalibrated", "Temperature Scaling"]
    with pytest.raises(ValueError, match="no pictures to show"):
        calibrate.group_pictures(shown, "Temperature Scaling", 14)
    for file, methods, words in ((str(path), ["Neural Clamping (FL)"], "Tick at least one method that works on logits"),
                                 (None, ["Temperature Scaling"], "Upload a file of logits first")):
        with pytest.raises(gr.Error, match=words):
            list(calibrate.calibrate_logits(file, methods, 15, 0))
