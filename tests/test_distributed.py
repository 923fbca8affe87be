"""Data-parallel runs (nctv.distributed): two CPU processes with gloo reach what one process reaches.

Two processes are started once for the module (torch.multiprocessing.spawn, rendezvous through a
file: torch's FileStore) and run the same scenario as this process; the last test starts
``torchrun -m nctv run`` and compares it with a one-process run. Splits have odd sizes, so the two
processes hold blocks of different lengths.

"The same" means: with the model's inputs cut where the processes cut them (one process with
``batch_size`` = the larger block), every sum is added in the same order, so δ and T agree to
rounding; against one process in one piece, the sums are added in another order, and the fits agree
to a looser tolerance (an ill-posed fit can amplify that difference: docs/distributed.md).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nctv import distributed
from nctv.cache import split_logits
from nctv.calibration import clamping_fit
from nctv.calibration.clamping import EfficientNeuralClamping, NeuralClamping
from nctv.data import TensorSplit
from nctv.inference import model_logits
from nctv.metrics import ece

ROOT = Path(__file__).resolve().parent.parent
N_CAL, N_TEST, CLASSES = 401, 301, 5
SHARD = (N_CAL + 1) // 2  # the larger of the two processes' blocks


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.AvgPool2d(2),
                                torch.nn.Flatten(), torch.nn.Linear(64, CLASSES))
    with torch.no_grad():
        model[-1].weight.mul_(12.0)  # over-confident (T near 2), so that calibration has something to do
    return model.eval()


def tiny_split(model: torch.nn.Module, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (n, 1, 8, 8) and labels: the model's prediction, replaced by a random class 30 % of the time."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    with torch.no_grad():
        pred = model(x).argmax(1)
    noise = torch.randint(0, CLASSES, (n,), generator=g)
    return x, torch.where(torch.rand(n, generator=g) < 0.3, noise, pred)


def _fitted(nc, x_test, y_test) -> dict:
    return {"delta": nc.delta_.clone(), "temperature": nc.temperature_,
            "fitted_temperature": getattr(nc, "fitted_temperature_", nc.temperature_),
            "passes": nc.n_passes_, "ece": ece(nc.predict_logits(x_test), y_test, n_bins=15)}


def scenario(cache: Path) -> dict:
    """What the tests compare: the logit pass (twice, the second from the cache) and the fits."""
    model = tiny_model()
    x, y = tiny_split(model, N_CAL, 1)
    x_test, y_test = tiny_split(model, N_TEST, 2)
    out = {}
    first = split_logits(model, TensorSplit(x_test, y_test), cache, batch_size=64)
    second = split_logits(model, TensorSplit(x_test, y_test), cache, batch_size=64)
    out["logits"], out["hits"] = first.logits, (first.hit, second.hit)
    out["cached_logits"] = second.logits
    out["fast"] = _fitted(NeuralClamping(model, seed=0).fit(x, y), x_test, y_test)
    out["fast_same_pieces"] = _fitted(NeuralClamping(model, seed=0, batch_size=SHARD).fit(x, y), x_test, y_test)
    # Batches of 5 over 2 blocks: some batches lie wholly in one process's block.
    out["toolkit"] = _fitted(NeuralClamping(model, fitter="toolkit", epochs=2, batch_size=5, seed=0).fit(x, y),
                             x_test, y_test)
    out["eff"] = _fitted(EfficientNeuralClamping(model, input_range=(-4.0, 4.0), batch_size=SHARD).fit(x, y),
                         x_test, y_test)
    # The same fits on a split streamed from its dataset on every pass (each process reads its rows).
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
    held, clamping_fit.DEVICE_CACHE_BYTES = clamping_fit.DEVICE_CACHE_BYTES, 0
    try:
        out["fast_streamed"] = _fitted(NeuralClamping(model, seed=0).fit(loader), x_test, y_test)
        out["toolkit_streamed"] = _fitted(NeuralClamping(model, fitter="toolkit", epochs=2, batch_size=5, seed=0)
                                          .fit(loader), x_test, y_test)
    finally:
        clamping_fit.DEVICE_CACHE_BYTES = held
    return out


def _worker(rank: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    try:
        torch.save(scenario(Path(folder) / "cache"), Path(folder) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(one process's results, [rank 0's, rank 1's]) of ``scenario``."""
    folder = tmp_path_factory.mktemp("distributed")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = scenario(folder / "cache-one")
    finally:
        torch.set_num_threads(before)
    mp.spawn(_worker, args=(str(folder),), nprocs=2, join=True)
    return one, [torch.load(folder / f"rank{r}.pt") for r in range(2)]


def test_one_process_is_not_distributed():
    assert not distributed.is_distributed() and distributed.world_size() == 1 and distributed.is_main()
    assert distributed.shard(7) == slice(0, 7)
    t = torch.arange(6.0).view(3, 2)
    assert distributed.all_gather_rows(t, 3) is t and distributed.all_reduce_sum(t)[0] is t


def test_logit_pass_gathers_the_whole_split_in_order(runs):
    one, ranks = runs
    reference = model_logits(tiny_model(), tiny_split(tiny_model(), N_TEST, 2)[0])
    for r in ranks:
        assert r["logits"].shape == (N_TEST, CLASSES)
        torch.testing.assert_close(r["logits"], reference, rtol=0, atol=1e-6)
        assert r["hits"] == (False, True)  # rank 0 wrote the cache and shared what it read back
        assert torch.equal(r["cached_logits"], ranks[0]["logits"])
    torch.testing.assert_close(one["logits"], reference, rtol=0, atol=1e-6)


FITS = ["fast", "fast_same_pieces", "toolkit", "eff", "fast_streamed", "toolkit_streamed"]


@pytest.mark.parametrize("fit", FITS)
def test_every_process_holds_the_same_delta_and_temperature(runs, fit):
    _, (r0, r1) = runs
    assert torch.equal(r0[fit]["delta"], r1[fit]["delta"])
    assert r0[fit]["temperature"] == r1[fit]["temperature"] and r0[fit]["ece"] == r1[fit]["ece"]


@pytest.mark.parametrize("fit, tol", [("fast_same_pieces", 1e-7), ("eff", 1e-7), ("toolkit", 1e-5), ("fast", 1e-5)])
def test_two_processes_reach_what_one_reaches(runs, fit, tol):
    one, (r0, _) = runs
    a, b = one[fit], r0[fit]
    assert (a["delta"] - b["delta"]).abs().max().item() <= tol * max(a["delta"].abs().max().item(), 1.0)
    assert b["fitted_temperature"] == pytest.approx(a["fitted_temperature"], rel=tol)
    assert b["temperature"] == pytest.approx(a["temperature"], rel=tol)
    assert b["ece"] == pytest.approx(a["ece"], abs=1e-6)
    assert b["passes"] == a["passes"]  # passes count the whole split, whichever process ran it


@pytest.mark.parametrize("fit", ["fast", "toolkit"])
def test_a_streamed_split_is_shared_like_a_held_one(runs, fit):
    one, ranks = runs
    for r in (one, *ranks):
        held, streamed = r[fit], r[f"{fit}_streamed"]
        assert (held["delta"] - streamed["delta"]).abs().max().item() <= 1e-7
        assert streamed["temperature"] == pytest.approx(held["temperature"], rel=1e-7)


def _nctv(*args: str, cwd: Path, cache: Path, processes: int = 1) -> subprocess.CompletedProcess:
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"] if processes > 1 else []
    env = dict(os.environ, NCTV_CACHE_DIR=str(cache), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *launch, "-m", "nctv", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_torchrun_nctv_run_writes_one_result_equal_to_one_process(tmp_path):
    # 300 calibration images: two blocks of 150, so one process with pieces of 150 adds in the same order.
    common = ["run", "--methods", "ts", "nc-fl", "--calibration-size", "300", "--test-size", "301", "--seeds", "1",
              "--bins", "15", "--batch-size", "150", "--quiet"]
    two = _nctv(*common, "--out", str(tmp_path / "two"), cwd=tmp_path, cache=tmp_path / "cache-two", processes=2)
    _nctv(*common, "--out", str(tmp_path / "one"), cwd=tmp_path, cache=tmp_path / "cache-one")
    # One process writes and prints: the table once, then one summary line.
    lines = two.stdout.strip().splitlines()
    assert lines[-1].startswith("run: 2 methods") and sum(ln.startswith("run: ") for ln in lines) == 1, two.stdout
    # The results table and the conformal sets' table, each once (not once per process).
    assert sum(ln.startswith("**Calibration on the test split") for ln in lines) == 1, two.stdout
    assert sum(ln.startswith("**Conformal prediction sets") for ln in lines) == 1, two.stdout
    assert sum(ln.startswith("| Method |") for ln in lines) == 2, two.stdout
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("cache")) == ["one", "two"]
    assert len(list((tmp_path / "cache-two" / "logits").glob("*.safetensors"))) == 2
    a, b = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two"))
    for method in ("Temperature Scaling", "Neural Clamping (FL)"):
        pa, pb = a["methods"][method], b["methods"][method]
        assert pb["params"]["temperature"] == pytest.approx(pa["params"]["temperature"], rel=1e-6)
        assert pb["metrics"]["15"]["ece"]["mean"] == pytest.approx(pa["metrics"]["15"]["ece"]["mean"], abs=1e-6)
