"""Hub models whose repository ships ``pytorch_model.bin`` and no safetensors (the CIFAR-100 entry's,
among many community checkpoints): read through ``torch.load(weights_only=True)`` under the weight
cap, only where there are no safetensors, the tensors checked before use. Every file is real, in the
Hub's cache layout, loaded through the ``hf-hub:`` path a visitor uses."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import timm
import torch

import nctv.zoo as z
from hub_standin import serving

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY = {"channels": [8, 16, 16, 16], "stem_width": 8}

# config.json of edadaltocg/resnet50_cifar100 as the Hub serves it (885 bytes; commit c68206c).
CIFAR100_RESNET50_CONFIG = {
    "architecture": "resnet50", "num_classes": 100, "num_features": 2048,
    "pretrained_cfg": {"num_classes": 100, "input_size": [3, 32, 32], "pool_size": [4, 4], "crop_pct": 1,
                       "interpolation": "bilinear", "fixed_input_size": False,
                       "mean": [0.5071, 0.4867, 0.4408], "std": [0.2675, 0.2565, 0.2761],
                       "first_conv": "conv1", "classifier": "fc"},
    "url": "https://huggingface.co/edadaltocg/resnet50_cifar100/resolve/main/pytorch_model.bin",
    "input_size": [3, 32, 32], "pool_size": [4, 4], "crop_pct": 1, "interpolation": "bilinear",
    "fixed_input_size": False, "mean": [0.5071, 0.4867, 0.4408], "std": [0.2675, 0.2565, 0.2761],
    "first_conv": "conv1", "classifier": "fc",
}


def snapshot(hf_home: Path, repo_id: str, commit: str = "a" * 40) -> Path:
    """An empty snapshot folder of model ``repo_id`` in the Hub's cache layout, its ref pointing to it."""
    repo_dir = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    folder = repo_dir / "snapshots" / commit
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def tiny_model(num_classes: int = 5, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return timm.create_model("resnet10t", num_classes=num_classes, **TINY).eval()


def put_bin_model(hf_home: Path, repo_id: str, model: torch.nn.Module, state=None) -> Path:
    """config.json (timm's) and ``state`` (default: the model's state dict) saved with torch.save as
    pytorch_model.bin: a repository without safetensors."""
    folder = snapshot(hf_home, repo_id)
    timm.models.save_for_hf(model, str(folder), model_args=TINY, safe_serialization=True)
    (folder / "model.safetensors").unlink()
    torch.save(model.state_dict() if state is None else state, folder / "pytorch_model.bin")
    return folder


class _RunsCode:
    """Pickles as a call of ``fn(*args)``: what a hostile checkpoint does to run code when loaded."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def cifar100_resnet50() -> torch.nn.Module:
    """The architecture behind edadaltocg's CIFAR checkpoints: timm's resnet50 with a 3×3 stride-1
    first convolution, no max-pool and a 100-class head."""
    torch.manual_seed(0)
    m = timm.create_model("resnet50", num_classes=100)
    m.conv1 = torch.nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    m.maxpool = torch.nn.Identity()
    return m.eval()


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """This process's Hub client reads a temporary cache and never the network."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hf"


def _logits(model, seed=1, shape=(4, 3, 64, 64)):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return x, model(x)


def test_a_bin_without_safetensors_loads_with_the_original_logits(offline_cache):
    torch.set_num_threads(1)
    model = tiny_model()
    put_bin_model(offline_cache, "nctv-test/bin-only", model)
    m = z.load_model("hf-hub:nctv-test/bin-only")
    x, expected = _logits(model)
    with torch.no_grad():
        assert torch.equal(m.model(x), expected)
    assert m.num_classes == 5 and not m.model.training
    assert not any(p.requires_grad for p in m.model.parameters())


@pytest.mark.parametrize("payload", ["os.system", "builtins.exec"])
def test_a_bin_whose_pickle_calls_a_function_is_refused_unrun(offline_cache, tmp_path, payload):
    marker = tmp_path / "it-ran"
    call = (_RunsCode(os.system, f"touch {marker}") if payload == "os.system"
            else _RunsCode(exec, f"open({str(marker)!r}, 'w').close()"))
    model = tiny_model()
    state = dict(model.state_dict())
    state["conv1.0.weight"] = call  # one entry of an otherwise valid state dict
    put_bin_model(offline_cache, "nctv-test/hostile", model, state)
    called = {"os.system": "posix.system", "builtins.exec": "exec"}[payload]  # as torch names them
    with pytest.raises(ValueError, match=rf"were refused: their pickle asks to call {called}, which a file of "
                                         r"weights never needs \(it could run code\)"):
        z.load_model("hf-hub:nctv-test/hostile")
    assert not marker.exists()


def test_both_weights_in_the_repository_means_the_safetensors(offline_cache, tmp_path):
    marker = tmp_path / "it-ran"
    model = tiny_model()
    folder = snapshot(offline_cache, "nctv-test/both")
    timm.models.save_for_hf(model, str(folder), model_args=TINY, safe_serialization=True)
    # a .bin that would run code, and whose weights differ, beside the safetensors: never opened
    torch.save({"fc.weight": _RunsCode(os.system, f"touch {marker}")}, folder / "pytorch_model.bin")
    m = z.load_model("hf-hub:nctv-test/both")
    x, expected = _logits(model)
    with torch.no_grad():
        assert torch.equal(m.model(x), expected)
    assert not marker.exists()


def test_a_cached_bin_over_the_weight_cap_is_refused_before_it_is_read(offline_cache, tmp_path):
    marker = tmp_path / "it-ran"
    folder = put_bin_model(offline_cache, "nctv-test/big-bin", tiny_model(),
                           {"fc.weight": _RunsCode(os.system, f"touch {marker}")})
    size = (folder / "pytorch_model.bin").stat().st_size
    # The cap's message, not the pickle's: the size was read from the cached file before the file was.
    with pytest.raises(ValueError, match=r"^hf-hub:nctv-test/big-bin has 0\.0 MB of weights; this server loads Hub "
                                         r"models with at most 0\.0 MB of weights\. Pick a smaller model\.$"):
        z.load_model("hf-hub:nctv-test/big-bin", max_weight_bytes=size - 1)
    assert not marker.exists()
    with pytest.raises(ValueError, match="their pickle asks to call posix.system"):
        z.load_model("hf-hub:nctv-test/big-bin", max_weight_bytes=size)


def test_bin_tensors_are_checked_before_use(offline_cache):
    model = tiny_model()
    good = model.state_dict()
    nan = {**good, "fc.weight": good["fc.weight"].clone().fill_(float("nan"))}
    inf = {**good, "fc.bias": good["fc.bias"].clone().fill_(float("-inf"))}
    shape = {**good, "fc.weight": torch.zeros(7, good["fc.weight"].shape[1])}
    kind = {**good, "fc.bias": good["fc.bias"].to(torch.int64)}
    missing = {k: v for k, v in good.items() if k != "fc.bias"}
    extra = {**good, "fc2.weight": torch.zeros(3)}
    cases = [
        (nan, r"hold values that are not finite \(NaN or infinite\) in fc\.weight"),
        (inf, r"not finite \(NaN or infinite\) in fc\.bias"),
        (shape, r"do not fit the architecture in its config\.json: fc\.weight is \(7, 16\) torch\.float32, the "
                r"model's \(5, 16\) torch\.float32"),
        (kind, r"fc\.bias is \(5,\) torch\.int64, the model's \(5,\) torch\.float32"),
        (missing, r"do not fit the architecture in its config\.json: they lack fc\.bias\."),
        (extra, r"they have extra fc2\.weight\."),
        ([good["fc.weight"]], r"does not hold a state dict \(parameter names mapped to tensors\)"),
        ({**good, "note": "text"}, r"does not hold a state dict"),
    ]
    for i, (state, message) in enumerate(cases):
        put_bin_model(offline_cache, f"nctv-test/bad-{i}", model, state)
        with pytest.raises(ValueError, match=message):
            z.load_model(f"hf-hub:nctv-test/bad-{i}")
    folder = snapshot(offline_cache, "nctv-test/truncated")
    put_bin_model(offline_cache, "nctv-test/truncated", model)
    data = (folder / "pytorch_model.bin").read_bytes()
    (folder / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"pytorch_model\.bin is not a readable PyTorch checkpoint"):
        z.load_model("hf-hub:nctv-test/truncated")


def test_local_folders_read_a_bin_the_same_way_and_refuse_other_pickles(tmp_path):
    model = tiny_model()
    folder = tmp_path / "m"
    timm.models.save_for_hf(model, str(folder), model_args=TINY, safe_serialization=True)
    (folder / "model.safetensors").unlink()
    torch.save(model.state_dict(), folder / "model.pth")
    with pytest.raises(ValueError, match=r"has no model\.safetensors\. It has model\.pth: pickle checkpoints can "
                                         r"run code when loaded and are refused \(only pytorch_model\.bin is read"):
        z.load_model(f"local-dir:{folder}")
    (folder / "model.pth").rename(folder / "pytorch_model.bin")
    x, expected = _logits(model)
    with torch.no_grad():
        assert torch.equal(z.load_model(f"local-dir:{folder}").model(x), expected)


OFFLINE_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    torch.set_num_threads(1)
    from safetensors.torch import load_file
    import nctv.zoo as z

    ref = load_file(sys.argv[1])
    m = z.load_model("cifar100-resnet50")
    with torch.no_grad():
        equal = bool(torch.equal(m.model(ref["x"]), ref["y"]))
    print(json.dumps({"equal": equal, "input": list(m.data_config["input_size"]), "classes": m.num_classes,
                      "stride": list(m.model.conv1.stride), "maxpool": type(m.model.maxpool).__name__,
                      "mean": list(m.data_config["mean"]), "source": m.source}))
""")


def test_the_cifar100_entry_loads_its_bin_offline_as_its_authors_built_it(tmp_path):
    """The menu's cifar100-resnet50 with the repository's own config.json and a full-size ResNet-50
    checkpoint of the same layout (random weights), through HF_HOME and HF_HUB_OFFLINE=1."""
    torch.set_num_threads(1)
    hf_home = tmp_path / "hf"
    folder = snapshot(hf_home, "edadaltocg/resnet50_cifar100")
    (folder / "config.json").write_text(json.dumps(CIFAR100_RESNET50_CONFIG, indent=2))
    model = cifar100_resnet50()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    x, y = _logits(model, shape=(3, 3, 32, 32))
    from safetensors.torch import save_file

    save_file({"x": x, "y": y}, str(tmp_path / "ref.safetensors"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "-c", OFFLINE_SCRIPT, str(tmp_path / "ref.safetensors")],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["equal"] and out["classes"] == 100 and out["input"] == [3, 32, 32]
    assert out["stride"] == [1, 1] and out["maxpool"] == "Identity"
    assert out["mean"] == pytest.approx([0.5071, 0.4867, 0.4408])
    assert out["source"] == "hf-hub:edadaltocg/resnet50_cifar100"


def test_a_bin_is_downloaded_only_where_the_hub_has_no_safetensors_and_only_under_the_cap(local_hub, tmp_path):
    model = tiny_model()
    folder = tmp_path / "served"
    timm.models.save_for_hf(model, str(folder), model_args=TINY, safe_serialization=True)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    config, weights = (folder / "config.json").read_bytes(), (folder / "pytorch_model.bin").read_bytes()
    # repositories without model.safetensors
    hub = serving({("nctv-test/bin", "config.json"): config, ("nctv-test/bin", "pytorch_model.bin"): weights,
                   ("nctv-test/big-bin", "config.json"): config, ("nctv-test/big-bin", "pytorch_model.bin"): weights,
                   ("nctv-test/nothing", "config.json"): config},
                  sizes={("nctv-test/big-bin", "pytorch_model.bin"): 600 * 10**6})
    local_hub(hub)
    hub_cache = tmp_path / "hf" / "hub"

    with pytest.raises(ValueError, match=r"^hf-hub:nctv-test/big-bin has 600\.0 MB of weights; this server loads Hub "
                                         r"models with at most 500\.0 MB of weights\. Pick a smaller model\.$"):
        z.load_model("hf-hub:nctv-test/big-bin", max_weight_bytes=500 * 10**6)
    asked = [r for r in hub.seen if "big-bin" in r[1]]
    assert asked == [("HEAD", "/nctv-test/big-bin/resolve/main/model.safetensors"),
                     ("HEAD", "/nctv-test/big-bin/resolve/main/pytorch_model.bin")]  # metadata only
    assert not (hub_cache / "models--nctv-test--big-bin" / "snapshots").exists()

    m = z.load_model("hf-hub:nctv-test/bin", max_weight_bytes=500 * 10**6)
    x, expected = _logits(model)
    with torch.no_grad():
        assert torch.equal(m.model(x), expected)
    fetched = sorted(p.name for p in (hub_cache / "models--nctv-test--bin" / "snapshots").rglob("*") if p.is_file())
    assert fetched == ["config.json", "pytorch_model.bin"]
    assert ("GET", "/nctv-test/bin/resolve/main/model.safetensors") not in hub.seen

    with pytest.raises(ValueError, match=r"^Model 'hf-hub:nctv-test/nothing' has neither model\.safetensors nor "
                                         r"pytorch_model\.bin: it holds no weights NCTV can read\.$"):
        z.load_model("hf-hub:nctv-test/nothing")
