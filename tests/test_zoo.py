"""nctv.zoo, nctv.hub, nctv.training: the embedded models, Hub loading through the cache, id validation,
the Hub probe and weight cap, the training helper."""
import http.server
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image

import nctv.data as d
import nctv.hub as hub
import nctv.zoo as z
from nctv.training import train_classifier
from nctv import metrics
from nctv.inference import model_logits

EMBEDDED = [e.name for e in z.list_models() if e.embedded]
REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", params=EMBEDDED)
def embedded(request):
    m = z.load_model(request.param)
    _, test = d.get_splits(m, calibration_size=None)
    x, y = test.tensors()
    return m, x, y, model_logits(m.model, x, batch_size=1000)


def test_registry_is_consistent():
    names = [e.name for e in z.list_models()]
    assert len(names) == len(set(names)) and z.DEFAULT_MODEL in names
    assert {e.family for e in z.list_models() if e.embedded} == {"ResNet", "ViT", "MLP-Mixer"}
    for e in z.list_models():
        assert e.source.startswith(("local-dir:", "hf-hub:")) and e.datasets
        if e.embedded:
            assert e.verified_offline
        else:  # the Hub cannot be reached from where this project is built
            assert not e.verified_online and not e.verified_offline
    paper = {e.source for e in z.list_models()}
    assert {"hf-hub:timm/resnet101.tv_in1k", "hf-hub:timm/vit_small_patch16_224.augreg_in21k_ft_in1k",
            "hf-hub:timm/mixer_b16_224.goog_in21k_ft_in1k"} <= paper


def test_embedded_model_is_frozen_and_described(embedded):
    m, *_ = embedded
    assert not m.model.training and not any(p.requires_grad for p in m.model.parameters())
    assert m.class_names == list(d.FASHION_MNIST_CLASSES) and m.default_dataset == "fashion-mnist"
    assert m.data_config["input_size"] == (1, 28, 28) and m.data_config["crop_pct"] == 1.0
    # Recorded as the entry names it (inside the shipped assets): results never hold where they lie.
    assert m.source == z.get_entry(m.name).source and m.source.startswith("local-dir:models/")
    assert m.folder == (d.assets_dir() / m.source[len("local-dir:"):]).resolve()
    assert m.card["metadata"]["nctv"]["name"] == m.name and "Training recipe" in m.card["text"]


def test_input_range_is_preprocessed_black_and_white(embedded):
    m, *_ = embedded
    alpha, beta = m.input_range
    mean, std = m.data_config["mean"][0], m.data_config["std"][0]
    assert alpha.shape == beta.shape == (1, 28, 28)
    assert torch.allclose(alpha, torch.full_like(alpha, (0 - mean) / std), atol=1e-6)
    assert torch.allclose(beta, torch.full_like(beta, (1 - mean) / std), atol=1e-6)


def test_card_accuracy_and_ece_match_a_fresh_measurement(embedded):
    m, x, y, logits = embedded
    card = m.card["metadata"]["nctv"]
    assert card["test_images"] == len(y) == 10000
    assert metrics.accuracy(logits, y) == pytest.approx(card["test_accuracy"], abs=0.001)
    assert metrics.ece(logits, y, n_bins=15) == pytest.approx(card["test_ece_15_bins"], abs=1e-4)
    assert metrics.accuracy(logits, y) > 0.8


def test_card_cost_figures_are_honest(embedded):
    m, *_ = embedded
    card = m.card["metadata"]["nctv"]
    assert card["flops_per_image"] == z.count_flops(m.model, (1, 28, 28)) <= 10_000_000
    assert card["parameters"] == sum(p.numel() for p in m.model.parameters())
    weights = m.folder / "model.safetensors"
    assert card["weights_bytes"] == weights.stat().st_size <= 5 * 1024**2


def test_pil_preprocessing_matches_the_split_tensors(embedded):
    m, x, *_ = embedded
    _, test = d.get_splits(m, calibration_size=None)
    for i in (0, 17, 9999):
        assert torch.equal(m.preprocess(test.image(i)), x[i])
    rgb = Image.fromarray(np.stack([np.asarray(test.image(3))] * 3, axis=-1))
    assert torch.equal(m.preprocess(rgb), x[3])  # colour input is converted to the model's grey


def test_local_dir_loads_as_timm_does(embedded):
    m, x, _, logits = embedded
    again = timm.create_model(f"local-dir:{m.folder}", pretrained=True).eval()
    with torch.no_grad():
        assert torch.equal(again(x[:64]), logits[:64])
    same = z.load_model(f"local-dir:{m.folder}")
    assert same.name == f"local-dir:{m.folder}" and same.class_names == m.class_names


@pytest.mark.parametrize("bad, match", [
    ("", "Unknown model"),
    ("resnet-of-dreams", "Known names: fmnist-resnet"),
    ("hf-hub:not a repo", "not a valid Hugging Face model id"),
    ("hf-hub:a/b/c", "not a valid Hugging Face model id"),
    ("hf-hub:org/../x", "not a valid"),
    ("hf-hub:timm/x@bad rev", "not a valid revision"),
    ("local-dir:../assets/models/fmnist-resnet", r"climbs out with '\.\.'"),
    ("local-dir:/definitely/not/here", "does not exist"),
])
def test_bad_ids_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        z.load_model(bad)


def test_folders_need_config_and_safetensors(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        z.load_model(f"local-dir:{tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"architecture": "resnet18"}))
    torch.save({"w": torch.zeros(1)}, tmp_path / "model.pth")
    with pytest.raises(ValueError, match="pickle checkpoints can run code"):
        z.load_model(f"local-dir:{tmp_path}")
    # pytorch_model.bin alone is read (weights_only), and its tensors must fit the architecture
    (tmp_path / "model.pth").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"do not fit the architecture in its config\.json: they lack bn1\.bias, "
                                         r"bn1\.num_batches_tracked, bn1\.running_mean, bn1\.running_var and \d+ "
                                         r"more; they have extra w\."):
        z.load_model(f"local-dir:{tmp_path}")


def test_a_pickle_beside_the_safetensors_is_never_loaded(tmp_path, default_model):
    # timm before 1.0.29 took the last checkpoint it found in a local-dir folder (a .bin over
    # model.safetensors); the timm lower bound keeps weights coming from safetensors only.
    src = d.assets_dir() / z.get_entry(z.DEFAULT_MODEL).source[len("local-dir:"):]
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a checkpoint: reading it fails")
    m, ref = z.load_model(f"local-dir:{tmp_path}"), default_model
    x = torch.randn(3, *ref.input_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(m.model(x), ref.model(x))


def test_unknown_architecture_is_reported(tmp_path):
    src = z.get_entry(z.DEFAULT_MODEL).source[len("local-dir:"):]
    folder = d.assets_dir() / src
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architecture"] = "no_such_net_9000"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="not known to the installed timm"):
        z.load_model(f"local-dir:{tmp_path}")


# ----------------------------------------------------------------------------- Hub cache

def _put_in_hub_cache(hf_home: Path, repo_id: str, model: torch.nn.Module, commit: str, model_args: dict) -> None:
    """Write a model the way the Hub cache stores a downloaded snapshot of ``repo_id``. ``model_args``
    go into config.json explicitly: only recent timm records a model's size arguments by itself."""
    repo_dir = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    timm.models.save_for_hf(model, str(repo_dir / "snapshots" / commit), model_args=model_args, safe_serialization=True)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)


CIFAR_ARGS = {"layers": [1, 1, 1, 1], "channels": [8, 16, 16, 16], "stem_width": 8}


def _cifar_stem_resnet() -> torch.nn.Module:
    m = timm.create_model("resnet18", num_classes=100, **CIFAR_ARGS)
    m.conv1 = torch.nn.Conv2d(3, m.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
    m.maxpool = torch.nn.Identity()
    return m


OFFLINE_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    torch.set_num_threads(1)
    from safetensors.torch import load_file
    import nctv.zoo as z

    ref = load_file(sys.argv[1])
    out = {}
    m = z.load_model("hf-hub:nctv-test/tiny-resnet")
    with torch.no_grad():
        out["equal"] = bool(torch.equal(m.model(ref["x"]), ref["y"]))
    out["names"] = m.class_names[:2]
    out["frozen"] = not m.model.training and not any(p.requires_grad for p in m.model.parameters())
    c = z.load_model("cifar100-resnet50")
    with torch.no_grad():
        out["cifar_equal"] = bool(torch.equal(c.model(ref["xc"]), ref["yc"]))
    out["cifar_input"] = list(c.data_config["input_size"])
    import nctv.data as d
    blood = z.load_model("local-dir:" + sys.argv[2])
    cal, test = d.get_splits(blood, dataset="bloodmnist", calibration_size=None)
    out["blood_sizes"] = [len(cal), len(test)]
    out["blood_labels"] = [cal.labels.tolist(), test.labels.tolist()]
    out["blood_x"] = bool(torch.equal(test.tensors()[0], ref["blood_test_x"]))
    # What `nctv train --dataset bloodmnist` trains on, read offline from the same cached file.
    from argparse import Namespace
    from nctv.cli import _training_data
    train, test, names = _training_data(Namespace(dataset="bloodmnist", class_names=None))
    out["blood_train"] = [list(train[0].shape), list(test[0].shape), names == list(d.BLOODMNIST_CLASSES)]
    try:
        z.load_model("hf-hub:nctv-test/never-downloaded")
        out["uncached"] = "loaded"
    except ValueError as e:
        out["uncached"] = str(e)
    try:
        z.load_model("resnet101-imagenet")
        out["paper"] = "loaded"
    except ValueError as e:
        out["paper"] = str(e)
    print(json.dumps(out))
""")


def test_hub_models_and_data_load_offline_from_the_cache(tmp_path):
    torch.set_num_threads(1)
    hf_home = tmp_path / "hf"
    tiny = {"channels": [8, 16, 16, 16], "stem_width": 8}
    model = timm.create_model("resnet10t", num_classes=5, **tiny).eval()
    _put_in_hub_cache(hf_home, "nctv-test/tiny-resnet", model, "a" * 40, tiny)
    cifar = _cifar_stem_resnet().eval()
    _put_in_hub_cache(hf_home, "edadaltocg/resnet50_cifar100", cifar, "b" * 40, CIFAR_ARGS)
    g = torch.Generator().manual_seed(0)
    x, xc = torch.randn(4, 3, 64, 64, generator=g), torch.randn(4, 3, 32, 32, generator=g)
    with torch.no_grad():
        tensors = {"x": x, "y": model(x), "xc": xc, "yc": cifar(xc)}
    from safetensors.torch import save_file

    # a stand-in BloodMNIST file in the dataset cache, and an 8-class RGB model to read it with
    rng = np.random.default_rng(0)
    blood = {f"{p}_images": rng.integers(0, 256, (n, 28, 28, 3), dtype=np.uint8) for p, n in
             (("train", 9), ("val", 6), ("test", 4))}
    blood.update({f"{p}_labels": (np.arange(n) % 8).reshape(-1, 1).astype(np.uint8) for p, n in
                  (("train", 9), ("val", 6), ("test", 4))})
    snap = hf_home / "hub" / "datasets--albertvillanova--medmnist-v2" / "snapshots" / ("c" * 40)
    (snap / "data").mkdir(parents=True)
    np.savez_compressed(snap / "data" / "bloodmnist.npz", **blood)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("c" * 40)
    blood_args = {"img_size": 28, "patch_size": 7, "embed_dim": 8, "num_blocks": 1}
    blood_model = timm.create_model("nctv_mlp_mixer", num_classes=8, **blood_args)
    cfg = {"input_size": (3, 28, 28), "mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25), "crop_pct": 1.0,
           "interpolation": "bilinear"}
    blood_model.pretrained_cfg = {**blood_model.pretrained_cfg, **cfg}  # save_for_hf's data_config is recent in timm
    timm.models.save_for_hf(blood_model, str(tmp_path / "blood-model"), model_args=blood_args, safe_serialization=True)
    tensors["blood_test_x"] = ((torch.from_numpy(blood["test_images"]).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.25).contiguous()
    save_file(tensors, str(tmp_path / "ref.safetensors"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO_ROOT))
    # huggingface_hub reads HF_HOME and HF_HUB_OFFLINE at import, so a fresh interpreter is the honest test
    proc = subprocess.run([sys.executable, "-c", OFFLINE_SCRIPT, str(tmp_path / "ref.safetensors"),
                           str(tmp_path / "blood-model")],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["equal"] and out["frozen"] and out["names"] == ["class 0", "class 1"]
    assert out["cifar_equal"] and out["cifar_input"][0] == 3
    assert "needs the network" in out["uncached"] and "nctv-test/tiny-resnet" in out["uncached"]
    assert "fmnist-resnet" in out["uncached"]  # points to what works offline
    assert "needs the network" in out["paper"]
    assert out["blood_sizes"] == [6, 4] and out["blood_x"] and out["blood_train"] == [[9, 28, 28, 3], [4, 28, 28, 3], True]
    assert out["blood_labels"] == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3]]


def test_hub_weight_cap_reads_the_cached_file(tmp_path, monkeypatch):
    from huggingface_hub import constants

    tiny = {"channels": [8, 16, 16, 16], "stem_width": 8}
    model = timm.create_model("resnet10t", num_classes=5, **tiny).eval()
    _put_in_hub_cache(tmp_path / "hf", "nctv-test/tiny-resnet", model, "a" * 40, tiny)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snapshot = tmp_path / "hf" / "hub" / "models--nctv-test--tiny-resnet" / "snapshots" / ("a" * 40)
    size = (snapshot / "model.safetensors").stat().st_size
    with pytest.raises(ValueError, match=r"hf-hub:nctv-test/tiny-resnet has 0\.\d MB of weights; this server loads "
                                         r"Hub models with at most 0\.\d MB"):
        z.load_model("hf-hub:nctv-test/tiny-resnet", max_weight_bytes=size - 1)
    assert z.load_model("hf-hub:nctv-test/tiny-resnet", max_weight_bytes=size).num_classes == 5
    # Not cached and offline: the offline answer, as without a cap.
    with pytest.raises(ValueError, match="needs the network"):
        z.load_model("hf-hub:nctv-test/never-downloaded", max_weight_bytes=size)


def test_weight_cap_decision():
    hub.check_weight_size("m", 10**9, None)
    hub.check_weight_size("m", 500 * 10**6, 500 * 10**6)
    with pytest.raises(ValueError, match="m has 500.0 MB of weights; .* at most 499.9 MB"):
        hub.check_weight_size("m", 500 * 10**6, 499_900_000)
    with pytest.raises(ValueError, match="did not say how large"):
        hub.check_weight_size("m", None, 10**9)


class _HubStandIn(http.server.BaseHTTPRequestHandler):
    """Answers a file's metadata the way the Hub does (size in X-Linked-Size) and records every request."""

    size = 600 * 10**6
    seen: list = []

    def do_HEAD(self):
        self.seen.append(("HEAD", self.path))
        self.send_response(200 if self.path.endswith("/resolve/main/model.safetensors") else 404)
        self.send_header("X-Repo-Commit", "d" * 40)
        self.send_header("ETag", '"0123abcd"')
        self.send_header("X-Linked-Size", str(self.size))
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        self.seen.append(("GET", self.path))
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_hub_weight_cap_is_checked_before_any_download(tmp_path):
    """The Hub cannot be reached from where this project is built, so a local endpoint stands in for it."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HubStandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGINGFACE_")) and not k.lower().endswith("_proxy")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=f"http://127.0.0.1:{server.server_address[1]}",
               PYTHONPATH=str(REPO_ROOT))
    script = ("import nctv.zoo as z\n"
              "try:\n    z.load_model('hf-hub:nctv-test/big-model', max_weight_bytes=500 * 10**6)\n"
              "except ValueError as e:\n    print('MESSAGE', e)\n")
    try:
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("MESSAGE hf-hub:nctv-test/big-model has 600.0 MB of weights; this server loads Hub models with at most "
            "500.0 MB of weights. Pick a smaller model.") in proc.stdout
    # Of the model, only the weights' metadata was asked for (the client asks the endpoint other things too).
    asked = [r for r in _HubStandIn.seen if "big-model" in r[1]]
    assert asked == [("HEAD", "/nctv-test/big-model/resolve/main/model.safetensors")]
    assert not list((tmp_path / "hf").rglob("*.safetensors")) and not list((tmp_path / "hf").rglob("config.json"))


class _RefusingHub(http.server.BaseHTTPRequestHandler):
    """Refuses every file the way the Hub does, with the error code its client reads: nctv-test/none
    does not exist, nctv-test/gated is gated, nctv-test/empty has no file, any other revision than
    main is missing; nctv-test/weights-only has model.safetensors alone (its metadata only)."""

    def _refuse(self):
        repo, _, rest = self.path.lstrip("/").partition("/resolve/")
        if self.command == "HEAD" and (repo, rest) == ("nctv-test/weights-only", "main/model.safetensors"):
            self.send_response(200)
            for header, value in (("X-Repo-Commit", "f" * 40), ("ETag", '"0123abcd"'), ("X-Linked-Size", "1000"),
                                  ("Content-Length", "0")):
                self.send_header(header, value)
            self.end_headers()
            return
        code = {"nctv-test/none": "RepoNotFound", "nctv-test/gated": "GatedRepo"}.get(repo, "EntryNotFound")
        if not rest.startswith("main/") and code == "EntryNotFound":
            code = "RevisionNotFound"
        self.send_response(403 if code == "GatedRepo" else 404)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET = _refuse

    def log_message(self, *args):
        pass


def test_hub_errors_say_what_to_do_about_the_model(local_hub):
    local_hub(_RefusingHub)
    with pytest.raises(ValueError, match=r"^Model 'hf-hub:nctv-test/none' does not exist on the Hub \(or is private"):
        z.load_model("hf-hub:nctv-test/none")
    with pytest.raises(ValueError, match=r"^Model 'hf-hub:nctv-test/gated' is gated: accept its terms"):
        z.load_model("hf-hub:nctv-test/gated")
    with pytest.raises(ValueError, match=r"^Model 'hf-hub:nctv-test/empty' has no revision 'v2'\.$"):
        z.load_model("hf-hub:nctv-test/empty@v2")
    with pytest.raises(ValueError, match=r"^Model 'hf-hub:nctv-test/weights-only' has no config\.json: it is not a timm"):
        z.load_model("hf-hub:nctv-test/weights-only")
    # the weights' metadata is asked first: model.safetensors, then pytorch_model.bin
    with pytest.raises(ValueError, match=r"^Model 'hf-hub:nctv-test/empty' has neither model\.safetensors nor "
                                         r"pytorch_model\.bin: it holds no weights NCTV can read\.$"):
        z.load_model("hf-hub:nctv-test/empty", max_weight_bytes=10**6)


def test_cifar_stem_adapter_only_changes_what_the_checkpoint_needs():
    plain = timm.create_model("resnet18", num_classes=10, layers=[1, 1, 1, 1], channels=[8, 16, 16, 16], stem_width=8)
    shapes = {k: tuple(v.shape) for k, v in plain.state_dict().items()}
    conv = plain.conv1
    z.ADAPTERS["cifar-stem"](plain, shapes)
    assert plain.conv1 is conv  # 7×7 checkpoint: left alone
    cifar = _cifar_stem_resnet()
    target = timm.create_model("resnet18", num_classes=100, layers=[1, 1, 1, 1], channels=[8, 16, 16, 16], stem_width=8)
    z.ADAPTERS["cifar-stem"](target, {k: tuple(v.shape) for k, v in cifar.state_dict().items()})
    target.load_state_dict(cifar.state_dict())
    assert isinstance(target.maxpool, torch.nn.Identity) and target.conv1.stride == (1, 1)


# ----------------------------------------------------------------------------- training helper

def test_train_classifier_saves_a_loadable_model_with_an_honest_card(tmp_path):
    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 240)
    images = (rng.integers(0, 60, (240, 12, 12)) + 60 * y[:, None, None]).astype(np.uint8)
    result = train_classifier(
        "nctv_mlp_mixer", dict(img_size=12, patch_size=4, embed_dim=8, num_blocks=1, mlp_ratio=[0.5, 1.0]),
        (images[:160], y[:160]), test_split=(images[160:], y[160:]), out_dir=tmp_path / "toy",
        class_names=["dark", "mid", "bright"], epochs=2, batch_size=32, progress=False,
        card={"name": "toy", "family": "MLP-Mixer"})
    m = z.load_model(f"local-dir:{tmp_path / 'toy'}")
    assert m.class_names == ["dark", "mid", "bright"] and m.data_config["input_size"] == (1, 12, 12)
    expected_mean = images[:160].astype(np.float64).mean() / 255
    assert m.data_config["mean"][0] == pytest.approx(expected_mean, abs=1e-4)
    x = d.preprocess_arrays(images[160:], m.data_config)
    logits = model_logits(m.model, x)
    card = m.card["metadata"]["nctv"]
    assert card["test_accuracy"] == pytest.approx(metrics.accuracy(logits, y[160:]), abs=1e-6)
    assert card["test_ece_15_bins"] == pytest.approx(metrics.ece(logits, y[160:]), abs=1e-6)
    assert card["seed"] == 0 and len(result.history) == 2
    assert "no label smoothing" in m.card["text"]
    again = train_classifier(
        "nctv_mlp_mixer", dict(img_size=12, patch_size=4, embed_dim=8, num_blocks=1, mlp_ratio=[0.5, 1.0]),
        (images[:160], y[:160]), out_dir=tmp_path / "toy2", class_names=["dark", "mid", "bright"], epochs=2,
        batch_size=32, progress=False)
    same_seed = {k: torch.equal(v, again.model.state_dict()[k]) for k, v in result.model.state_dict().items()}
    assert all(same_seed.values())  # same seed, threads and machine: same weights
    with pytest.raises(ValueError, match="uint8"):
        train_classifier("nctv_mlp_mixer", {}, (images.astype(np.float32), y), out_dir=tmp_path / "bad")


def test_train_classifier_with_a_single_step(tmp_path):
    # One epoch of one batch: the warm-up takes the only step and the cosine part has no length.
    rng = np.random.default_rng(1)
    y = np.arange(16) % 2
    images = (rng.integers(0, 100, (16, 12, 12)) + 100 * y[:, None, None]).astype(np.uint8)
    result = train_classifier(
        "nctv_mlp_mixer", dict(img_size=12, patch_size=4, embed_dim=8, num_blocks=1, mlp_ratio=[0.5, 1.0]),
        (images, y), out_dir=tmp_path / "one-step", class_names=["dark", "bright"], epochs=1, batch_size=16,
        progress=False)
    assert len(result.history) == 1 and np.isfinite(result.history[0]["train_loss"])
    assert (tmp_path / "one-step" / "model.safetensors").exists()


def _closed_port() -> int:
    import socket

    with socket.socket() as s:  # bind, read the port, close: nothing listens there afterwards
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hub_reachable_probes_the_endpoint(monkeypatch):
    import socket

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert hub.hub_reachable()
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    assert not hub.hub_reachable()
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    assert hub.hub_reachable()  # behind a proxy the download itself decides
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert not hub.hub_reachable()


def test_unreachable_hub_answers_at_once_without_retries(tmp_path):
    # No HF_HUB_OFFLINE: the Hub is just not answering (here: a closed local port as its endpoint).
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE" and not k.lower().endswith("_proxy")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}", PYTHONPATH=str(REPO_ROOT))
    script = ("import nctv.zoo as z\n"
              "try:\n    z.load_model('hf-hub:someone/some-model')\n"
              "except ValueError as e:\n    print('MESSAGE', e)\n")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "MESSAGE Model 'hf-hub:someone/some-model' needs the network" in proc.stdout
    assert "cannot be reached" in proc.stdout and "fmnist-resnet" in proc.stdout
    assert "Retry" not in proc.stderr  # the client's retry loop was never entered
