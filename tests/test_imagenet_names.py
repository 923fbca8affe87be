"""A Hub timm model with 1000 classes answers in ImageNet's class names, through the ``hf-hub:``
path and the Try tab: the model's config names no classes, so they come from timm's ImageNet
information. The model is real (a tiny timm architecture with a 1000-class head) and sits in the
Hub's cache layout, read offline."""
import html
import re

import numpy as np
import pytest
import timm
import torch
from PIL import Image

import nctv.zoo as z
from nctv.inference import model_logits
from nctv.ui import session, try_image

TINY = {"channels": [8, 16, 16, 16], "stem_width": 8}


@pytest.fixture
def imagenet_sized_model(tmp_path, monkeypatch):
    """(name, model): a 1000-class timm model cached as Hub repository nctv-test/tiny-in1k; this
    process's Hub client reads that cache and never the network."""
    from huggingface_hub import constants

    torch.manual_seed(0)
    model = timm.create_model("resnet10t", num_classes=1000, **TINY).eval()
    repo = tmp_path / "hf" / "hub" / "models--nctv-test--tiny-in1k"
    timm.models.save_for_hf(model, str(repo / "snapshots" / ("a" * 40)), model_args=TINY, safe_serialization=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return "hf-hub:nctv-test/tiny-in1k", model


def _imagenet_names() -> list[str]:
    from timm.data import ImageNetInfo

    info = ImageNetInfo("imagenet-1k")
    return [info.index_to_description(i) for i in range(1000)]


def test_a_1000_class_hub_model_is_named_with_imagenet_classes(imagenet_sized_model):
    name, _ = imagenet_sized_model
    m = z.load_model(name)
    assert m.class_names == _imagenet_names()
    assert m.class_names[0] == "tench, Tinca tinca"
    assert m.class_names[999] == "toilet tissue, toilet paper, bathroom tissue"


def test_the_try_tab_answers_an_imagenet_model_in_its_class_names(imagenet_sized_model, tmp_path):
    torch.set_num_threads(1)
    name, model = imagenet_sized_model
    picture = tmp_path / "photo.png"
    Image.fromarray(np.random.default_rng(2).integers(0, 256, (60, 80, 3), dtype=np.uint8)).save(picture)
    cal = session.Calibration(None, name, ts_temperature=1.5, nc_temperature=None, delta=None, nc_method=None,
                              source="a test calibration")
    verdict, page, view, note = try_image.classify(str(picture), cal)
    names = _imagenet_names()
    assert f"This model knows 1,000 classes, among them {', '.join(names[:8])}, …" in note
    # The chart's classes, most likely first, are the model's own answer in ImageNet's words.
    x = z.load_model(name).preprocess(Image.open(picture).convert("RGB"))
    order = torch.argsort(model_logits(model, x[None])[0], descending=True).tolist()
    shown = [html.unescape(c) for c in re.findall(r'data-class="([^"]*)"', page)]
    assert shown and shown[0] == names[order[0]]
    assert set(shown) <= set(names) and shown == [names[i] for i in order[:len(shown)]]
