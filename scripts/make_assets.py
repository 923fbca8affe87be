"""Build the shipped assets: the embedded Fashion-MNIST splits, the embedded models, and the panel.

    python scripts/make_assets.py data                 # assets/data/fashion-mnist/*.npz + licence
    python scripts/make_assets.py train [NAME ...]     # assets/models/<name>/ (every embedded model by default)
    python scripts/make_assets.py panel [NAME ...]     # the over-confident panel, in ~/.cache/nctv/panel/<name>/

Source data: the Debian package ``dataset-fashion-mnist`` (IDX files in
/usr/share/datasets/fashion-mnist/, content MD5 checked), or ``--source DIR``.
Split: training images 0–54,999 train the models; 55,000–59,999 are the calibration pool (never seen
in training); the official 10,000 test images are the test split.

Training runs on the CPU with fixed seeds and thread counts (see nctv.training.train_classifier for the
recipe), so a rerun on the same machine and library versions gives the same weights. The three
mildly over-confident models were trained as three parallel processes of one thread each:

    for m in fmnist-resnet fmnist-vit fmnist-mixer; do nice python scripts/make_assets.py train $m & done

The over-confident models (``OVERCONFIDENT``) train 40 epochs with neither augmentation nor weight
decay, two threads each, one after the other; the first of them is embedded (``train``), all of
them form the panel that the bench calibrates (``panel``; ``--out`` moves it). Each model's card
records its time, FLOPs, test accuracy and uncalibrated ECE.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nctv.data import FASHION_MNIST_CLASSES, FASHION_MNIST_SYSTEM_DIR, assets_dir, load_fashion_mnist_idx  # noqa: E402
from nctv.training import train_classifier  # noqa: E402

N_TRAIN = 55_000
# MD5 of the *decompressed* IDX content. Debian recompresses the published .gz files (same sizes,
# different gzip headers), so the sums Zalando publishes for the .gz files do not apply there.
MD5 = {
    "train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
    "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
    "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
    "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965",
}

# Sized for ~2-5 MFLOPs per 28×28 image so that Neural Clamping runs in seconds on a laptop CPU.
MODELS = {
    "fmnist-resnet": dict(
        family="ResNet", architecture="resnet10t",
        model_args=dict(channels=[16, 32, 64, 128], stem_width=8),
        train=dict(epochs=6, lr=3e-3, weight_decay=0.05),
        title="fmnist-resnet: a small ResNet for Fashion-MNIST",
        summary=("timm `resnet10t` (one BasicBlock per stage, tiered 3×3 stem) with stage widths 16/32/64/128, "
                 "grey 28×28 input, 10 classes. Trained from scratch on Fashion-MNIST."),
    ),
    "fmnist-vit": dict(
        family="ViT", architecture="vit_tiny_patch16_224",
        model_args=dict(img_size=28, patch_size=7, embed_dim=64, depth=4, num_heads=4, mlp_ratio=2.0),
        train=dict(epochs=6, lr=2e-3, weight_decay=0.05),
        title="fmnist-vit: a small Vision Transformer for Fashion-MNIST",
        summary=("timm `VisionTransformer` (created through `vit_tiny_patch16_224` with its sizes overridden): "
                 "7×7 patches of a grey 28×28 image (16 tokens + class token), width 64, 4 blocks, 4 heads, "
                 "MLP ratio 2. Trained from scratch on Fashion-MNIST."),
    ),
    "fmnist-mixer": dict(
        family="MLP-Mixer", architecture="nctv_mlp_mixer",
        model_args=dict(img_size=28, patch_size=4, embed_dim=48, num_blocks=4, mlp_ratio=[0.5, 2.0]),
        train=dict(epochs=6, lr=3e-3, weight_decay=0.05),
        title="fmnist-mixer: a small MLP-Mixer for Fashion-MNIST",
        summary=("timm `MlpMixer` (registered as `nctv_mlp_mixer` by `import nctv.zoo`, because timm's own mixer "
                 "entrypoints fix patch size and width): 4×4 patches (49 tokens), width 48, 4 blocks, "
                 "token/channel MLP ratios 0.5/2. Trained from scratch on Fashion-MNIST."),
    ),
}


# Over-confident on purpose, like the paper's models: 40 epochs, no augmentation, no weight decay.
_OVERFIT = dict(epochs=40, lr=2e-3, weight_decay=0.0)
_OC_NOTE = ("Trained 40 epochs with neither augmentation nor weight decay, so it fits its training images "
            "exactly and is strongly over-confident on new ones, like the models of the Neural Clamping paper.")
OVERCONFIDENT = {
    "fmnist-resnet-overconfident": dict(
        MODELS["fmnist-resnet"], train=_OVERFIT, seed=0, threads=2,
        title="fmnist-resnet-overconfident: a strongly over-confident ResNet for Fashion-MNIST",
        summary=MODELS["fmnist-resnet"]["summary"] + " " + _OC_NOTE),
    **{f"fmnist-resnet-overconfident-s{seed}": dict(
        MODELS["fmnist-resnet"], train=_OVERFIT, seed=seed, threads=2,
        title=f"fmnist-resnet-overconfident-s{seed}: the over-confident ResNet, training seed {seed}",
        summary=MODELS["fmnist-resnet"]["summary"] + " " + _OC_NOTE) for seed in (1, 2)},
    "fmnist-vit-overconfident": dict(
        MODELS["fmnist-vit"], train=_OVERFIT, seed=0, threads=2,
        title="fmnist-vit-overconfident: a strongly over-confident ViT for Fashion-MNIST",
        summary=MODELS["fmnist-vit"]["summary"] + " " + _OC_NOTE),
    "fmnist-mixer-overconfident": dict(
        MODELS["fmnist-mixer"], train=_OVERFIT, seed=0, threads=2,
        title="fmnist-mixer-overconfident: a strongly over-confident MLP-Mixer for Fashion-MNIST",
        summary=MODELS["fmnist-mixer"]["summary"] + " " + _OC_NOTE),
}
#: The over-confident model shipped in assets/ (the app's and the command line's default).
EMBEDDED_OVERCONFIDENT = "fmnist-resnet-overconfident"
for _name in MODELS:
    MODELS[_name].update(seed=0, threads=1)
EMBEDDED = {**MODELS, EMBEDDED_OVERCONFIDENT: OVERCONFIDENT[EMBEDDED_OVERCONFIDENT]}

DATA_README = """# Fashion-MNIST (embedded splits)

Images and labels from **Fashion-MNIST** by Zalando Research — Han Xiao, Kashif Rasul, Roland Vollgraf,
"Fashion-MNIST: a Novel Image Dataset for Benchmarking Machine Learning Algorithms", arXiv:1708.07747
(2017), https://github.com/zalandoresearch/fashion-mnist — distributed under the MIT licence (see
LICENSE in this folder).

| file | images | taken from |
| --- | --- | --- |
| calibration.npz | 5,000 | official training set, images 55,000–59,999 (never used to train the embedded models) |
| test.npz | 10,000 | official test set (t10k), all images in order |

Each file holds `images` (N, 28, 28) uint8 (0 = black background), `labels` (N,) uint8 with
classes 0–9 = {classes}, and `source_index` (N,) int32, the image's index in its official file.
Load with `numpy.load(path, allow_pickle=False)`. Made by `scripts/make_assets.py data` from the
IDX files (MD5 of their decompressed content checked).
"""

MIT_LICENSE = """The MIT License (MIT)

Copyright © 2017 Zalando SE, https://tech.zalando.com

Permission is hereby granted, free of charge, to any person obtaining a copy of this software and
associated documentation files (the "Software"), to deal in the Software without restriction,
including without limitation the rights to use, copy, modify, merge, publish, distribute,
sublicense, and/or sell copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all copies or
substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT NOT
LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN
NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER LIABILITY,
WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM, OUT OF OR IN CONNECTION WITH THE
SOFTWARE OR THE USE OR OTHER DEALINGS IN THE SOFTWARE.
"""


def check_md5(source: Path) -> None:
    for name, expected in MD5.items():
        gz, raw = source / f"{name}.gz", source / name
        content = gzip.decompress(gz.read_bytes()) if gz.exists() else raw.read_bytes()
        digest = hashlib.md5(content).hexdigest()
        if digest != expected:
            raise SystemExit(f"{name} in {source} has content MD5 {digest}, expected {expected}: not Fashion-MNIST.")


def make_data(source: Path) -> None:
    check_md5(source)
    d = load_fashion_mnist_idx(source)
    out = assets_dir() / "data" / "fashion-mnist"
    out.mkdir(parents=True, exist_ok=True)
    parts = {
        "calibration": (d["train_images"][N_TRAIN:], d["train_labels"][N_TRAIN:], np.arange(N_TRAIN, 60_000)),
        "test": (d["test_images"], d["test_labels"], np.arange(10_000)),
    }
    for name, (images, labels, index) in parts.items():
        np.savez_compressed(out / f"{name}.npz", images=images, labels=labels, source_index=index.astype(np.int32))
    (out / "README.md").write_text(DATA_README.format(classes=", ".join(FASHION_MNIST_CLASSES)), encoding="utf-8")
    (out / "LICENSE").write_text(MIT_LICENSE, encoding="utf-8")
    for p in sorted(out.iterdir()):
        print(f"{p.relative_to(assets_dir())}: {p.stat().st_size / 1024:.0f} KiB")


def _timing_note(spec: dict) -> str:
    if spec["threads"] == 1:
        return ("The training time is wall clock with the three models training in parallel, one thread each, at "
                "low priority on a shared 2-core machine.")
    load = os.getloadavg()[0]
    return (f"The training time is wall clock with {spec['threads']} threads on a {os.cpu_count()}-core machine "
            f"(load average {load:.1f} as training ended; about {spec['threads']} is this training alone).")


def train(names: list[str], specs: dict, out_root: Path, source: Path, progress: bool) -> None:
    d = load_fashion_mnist_idx(source)
    train_split = (d["train_images"][:N_TRAIN], d["train_labels"][:N_TRAIN])
    test_split = (d["test_images"], d["test_labels"])
    for name in names:
        spec = specs[name]
        torch.set_num_threads(spec["threads"])
        t0 = time.perf_counter()
        result = train_classifier(
            spec["architecture"], spec["model_args"], train_split, test_split=test_split,
            out_dir=out_root / name, class_names=FASHION_MNIST_CLASSES, seed=spec["seed"],
            batch_size=128, shift=0, flip=False, progress=progress, **spec["train"],
            card={"name": name, "family": spec["family"], "title": spec["title"], "summary": spec["summary"],
                  "license": "apache-2.0", "datasets": ["zalando-datasets/fashion_mnist"],
                  "test_split": "fashion-mnist test (official 10,000 test images)",
                  "train_data": "Fashion-MNIST training images 0–54,999 (the last 5,000 are the calibration pool "
                                "and were not used)",
                  "extra": [_timing_note(spec), "",
                            "## Data licence", "",
                            "Fashion-MNIST © 2017 Zalando SE, MIT licence (Xiao, Rasul & Vollgraf 2017, "
                            "arXiv:1708.07747).", "",
                            "## Loading", "", "```python", "import nctv.zoo as z",
                            f"m = z.load_model({name!r})  # or timm.create_model('local-dir:<this folder>', pretrained=True)"
                            + ("  # after `import nctv.zoo`" if spec["architecture"] == "nctv_mlp_mixer" else ""),
                            "```"]},
        )
        t = result.test_metrics
        print(f"{name}: {result.seconds:.0f} s training ({time.perf_counter() - t0:.0f} s total), "
              f"test accuracy {100 * t['accuracy']:.2f} %, ECE {100 * t['ece_15']:.2f} %", flush=True)


def default_panel_dir() -> Path:
    from nctv.data import cache_dir

    return cache_dir() / "panel"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["data", "train", "panel"])
    parser.add_argument("names", nargs="*", help="models to train (default: every model of the chosen set)")
    parser.add_argument("--source", type=Path, default=FASHION_MNIST_SYSTEM_DIR, help="folder with the IDX files")
    parser.add_argument("--out", type=Path, default=None, help="panel folder (default ~/.cache/nctv/panel)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.what == "data":
        make_data(args.source)
        return
    specs = EMBEDDED if args.what == "train" else OVERCONFIDENT
    unknown = [n for n in args.names if n not in specs]
    if unknown:
        raise SystemExit(f"Unknown model(s) {unknown}; choose from {', '.join(specs)}.")
    out_root = assets_dir() / "models" if args.what == "train" else (args.out or default_panel_dir())
    train(args.names or list(specs), specs, out_root, args.source, not args.no_progress)


if __name__ == "__main__":
    main()
