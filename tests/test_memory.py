"""Memory-adaptive passes: pieces cut to fit the device, halved when it runs out, same numbers."""
import sys

import pytest
import torch
import torch.nn as nn

from nctv import cache, data, experiment, memory
from nctv.calibration.clamping import (
    EfficientNeuralClamping,
    NeuralClamping,
    data_driven_delta,
)
from nctv.calibration.studies import gamma_sweep, init_study
from nctv.inference import model_logits

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = (1, 4, 4)
RANGE = (-3.0, 3.0)
CLOSE = {"rtol": 1e-5, "atol": 1e-6}


def make_model(seed=0):
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        model[3].weight.mul_(2.0)  # confident logits
    return model.eval()


def make_data(model, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *SHAPE, generator=g).clamp(-2.5, 2.5)
    with torch.no_grad():
        y = torch.multinomial(torch.softmax(model(x) / 2.0, dim=1), 1, generator=g).squeeze(1)
    return x, y


class _Log:
    """What a pretend device saw; copies of the model (the fast fitter's float64 twin) share it."""

    def __init__(self):
        self.failures, self.sizes = 0, []

    def __deepcopy__(self, memo):
        return self


class SmallDevice(nn.Module):
    """The model on a pretend device that holds at most ``limit`` images per call: a larger batch
    raises CUDA's out-of-memory error before any work, as a real GPU would mid-forward."""

    def __init__(self, inner, limit):
        super().__init__()
        self.inner, self.limit = inner, limit
        self.log = _Log()

    @property
    def failures(self):
        return self.log.failures

    @property
    def sizes(self):
        return self.log.sizes

    def forward(self, x):
        if x.shape[0] > self.limit:
            self.log.failures += 1
            raise torch.cuda.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {x.shape[0]} images; {self.limit} fit.")
        self.log.sizes.append(x.shape[0])
        return self.inner(x)


@pytest.fixture(scope="module")
def splits():
    model = make_model()
    return model, make_data(model, 600), make_data(model, 300, seed=2)


def quiet(**kw):
    return dict(progress=False, **kw)


#: How close two fast fits whose sums were taken in other pieces come. The fast fitter stops when an
#: iteration lowers its objective by less than tol = 1e-3 relative, and rounding can make it stop one
#: iteration sooner or later, so their objectives agree to a few times tol (measured 2.6e-3 at γ = 1)
#: while δ, weakly held by a small λ, may differ by about 1 % (docs/method.md, "Reproducibility").
FIT_REL = 5e-3


def assert_same_objective(got, ref):
    """Two fast fits of the same problem, summed in other pieces: the same T (anchored on the unperturbed
    logits) and objectives within the stopping rule's reach."""
    assert got.temperature_ == pytest.approx(ref.temperature_, rel=1e-5)
    assert got.objective_ == pytest.approx(ref.objective_, rel=FIT_REL)


def assert_same_fit(got, ref):
    torch.testing.assert_close(got.delta_, ref.delta_, **CLOSE)
    assert got.temperature_ == pytest.approx(ref.temperature_, rel=1e-5)
    assert got.n_passes_ == pytest.approx(ref.n_passes_)


# ---- the sizer on its own -------------------------------------------------------------------


def test_out_of_memory_errors_are_recognised():
    assert memory.is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert memory.is_out_of_memory(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
    assert memory.is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried 9 GB"))
    assert not memory.is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not memory.is_out_of_memory(ValueError("out of memory"))
    assert not memory.is_out_of_memory(memory.DeviceOutOfMemoryError("out of memory"))


def test_sizer_halves_the_failing_piece_and_keeps_the_smaller_size():
    sizer = memory.ChunkSizer("cpu", 100)
    tried = []

    def fn(start, stop):
        tried.append(stop - start)
        if stop - start > 30:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
        return start, stop

    pieces = list(sizer.map(fn, 130))
    assert tried == [100, 50, 25, 25, 25, 25, 25, 5]
    assert pieces == [(0, 25), (25, 50), (50, 75), (75, 100), (100, 125), (125, 130)]
    assert sizer.size == 25
    tried.clear()
    assert [p[1] - p[0] for p in sizer.map(fn, 60)] == [25, 25, 10] and 50 not in tried  # learned once


def test_sizer_passes_other_errors_through():
    def fn(start, stop):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes"):
        list(memory.ChunkSizer("cpu", 8).map(fn, 20))


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_threaded_pieces_arrive_in_order_each_computed_on_one_thread(two_threads):
    import threading

    sizer = memory.ChunkSizer("cpu", 4)
    x = torch.arange(30, dtype=torch.float64).view(30, 1)
    seen = []

    def fn(piece, start, stop):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        assert piece.dtype == torch.float32
        return start, stop, piece.sum().item()

    out = list(sizer.map_threaded(x, fn, workers=2))
    assert [(a, b) for a, b, _ in out] == [(s, min(30, s + 4)) for s in range(0, 30, 4)]
    assert [v for *_, v in out] == [float(sum(range(a, b))) for a, b, _ in out]
    assert {n for n, _ in seen} <= {t.name for t in threading.enumerate() if t.name.startswith("nctv-piece")}
    assert all(n.startswith("nctv-piece") and k == 1 for n, k in seen)
    # The caller keeps its threads, and so does a thread that starts torch after the pool was made.
    assert torch.get_num_threads() == 2
    later = []
    t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert later == [2]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own niceness is Linux's")
def test_threaded_pieces_run_at_their_callers_priority(two_threads):
    """A web app's run computes below the server: its pieces' threads must too, and a caller at the
    server's priority must not be handed those lowered threads afterwards."""
    import os
    import threading

    def own():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    x = torch.zeros(12, 1)
    seen = {}

    def run(lower):
        if lower:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, own() + 5))
        caller = own()
        got = list(memory.ChunkSizer("cpu", 1).map_threaded(x, lambda piece, a, b: own(), workers=2))
        seen[lower] = (caller, set(got))

    for lower in (True, False):  # the lowered caller first: its threads must not serve the other
        t = threading.Thread(target=run, args=(lower,))
        t.start()
        t.join()
    (low, low_pieces), (base, base_pieces) = seen[True], seen[False]
    assert low > base
    assert low_pieces == {low} and base_pieces == {base}


def test_threaded_pieces_back_off_on_out_of_memory_and_pass_other_errors(two_threads):
    sizer = memory.ChunkSizer("cpu", 40)
    x = torch.zeros(100, 1)

    def fn(piece, start, stop):
        if stop - start > 15:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried 9 GB")
        return start, stop

    assert list(sizer.map_threaded(x, fn, workers=2)) == [(s, min(100, s + 10)) for s in range(0, 100, 10)]
    assert sizer.size == 10

    def bad(piece, start, stop):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes"):
        list(memory.ChunkSizer("cpu", 10).map_threaded(x, bad, workers=2))


def test_a_cancelled_threaded_pass_stops_between_pieces(two_threads):
    sizer = memory.ChunkSizer("cpu", 1)
    x = torch.zeros(1000, 1)
    done = []

    def check():
        if len(done) >= 3:
            raise KeyboardInterrupt

    with memory.cancellation(check), pytest.raises(KeyboardInterrupt):
        for r in sizer.map_threaded(x, lambda piece, a, b: a, workers=2):
            done.append(r)
    assert 3 <= len(done) < 1000


def test_a_fast_fit_on_two_threads_is_the_fit_on_one_to_the_last_bit(splits, two_threads):
    """Each piece of a float64 pass runs on one thread however many there are, and the pieces are summed
    in order: the fit on two threads is bit for bit the fit on one."""
    model, (x, y), _ = splits
    two = NeuralClamping(model, init_std=0.1, **quiet()).fit(x, y)
    torch.set_num_threads(1)
    one = NeuralClamping(model, init_std=0.1, **quiet()).fit(x, y)
    assert torch.equal(two.delta_, one.delta_)
    assert two.objective_ == one.objective_ and two.n_passes_ == one.n_passes_


def test_staged_pieces_arrive_in_order_and_the_next_one_is_prefetched():
    x = torch.arange(130 * 6, dtype=torch.float64).reshape(130, 1, 2, 3)  # not float32: converted on the way
    seen = []

    def fn(piece, start, stop):
        seen.append((start, stop))
        assert piece.dtype == torch.float32 and piece.shape == (stop - start, 1, 2, 3)
        torch.testing.assert_close(piece, x[start:stop].float(), rtol=0, atol=0)
        return piece.sum().item()

    sizer = memory.ChunkSizer("cpu", 40)
    with memory.HostStager(x, "cpu", overlap=True) as stager:
        got = list(sizer.map(lambda a, b: fn(stager.take(a, b), a, b), 130))
    assert seen == [(0, 40), (40, 80), (80, 120), (120, 130)]
    assert got == pytest.approx([x[a:b].sum().item() for a, b in seen])
    # the first piece is copied on request; every later one was copied while the previous computed
    assert (stager.copied, stager.prefetched) == (1, 3)


def test_staging_survives_a_back_off():
    x = torch.randn(100, 4)
    sizer = memory.ChunkSizer("cpu", 40)
    tried = []

    def fn(piece, start, stop):
        tried.append(stop - start)
        if stop - start > 20:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
        return piece.clone()

    out = list(sizer.map_inputs(x, fn, overlap=True))
    assert tried == [40, 20, 20, 20, 20, 20]
    torch.testing.assert_close(torch.cat(out), x, rtol=0, atol=0)
    # without overlap (the CPU's default) the same pieces and numbers
    tried.clear()
    assert torch.equal(torch.cat(list(memory.ChunkSizer("cpu", 40).map_inputs(x, fn))), x)


def test_a_stager_prefetches_only_where_it_is_asked_to_or_on_cuda():
    x = torch.zeros(10, 3)
    assert memory.HostStager(x, "cpu").overlap is False
    assert memory.HostStager(x, "meta").overlap is False
    assert memory.HostStager(x, "cpu", overlap=True).overlap is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_staging_on_cuda(monkeypatch):
    monkeypatch.setattr(memory, "PINNED_BLOCK_BYTES", 3 * 4 * 2 * 5)  # 5 rows a block: pieces span blocks
    x = torch.randn(64, 3, 2, 4)
    sizer = memory.ChunkSizer("cuda", 16)
    sizer._measure = False  # keep 16 a piece so that the prefetched ranges match
    out = list(sizer.map_inputs(x, lambda piece, a, b: (piece * 2).cpu()))
    torch.testing.assert_close(torch.cat(out), x * 2, rtol=0, atol=0)
    staging = sizer._staging
    assert staging is not None and list(sizer.map_inputs(x[:16], lambda piece, a, b: 0)) == [0]
    assert sizer._staging is staging  # pinned once per split, not per batch
    with memory.HostStager(x, "cuda") as stager:
        assert stager.overlap and stager.take(0, 16).device.type == "cuda"
        torch.testing.assert_close(stager.take(16, 32).cpu(), x[16:32], rtol=0, atol=0)
        assert stager.prefetched == 1 and stager.staging.blocks[0].is_pinned()


def test_sizer_takes_its_size_from_free_cuda_memory(monkeypatch):
    """The CUDA rule, with the device's counters played on the CPU: the first piece (the configured
    chunk) measures the peak per image, then the share of the free memory sets the size."""
    mib = 2**20
    state = {"allocated": 100 * mib, "peak": 0}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: state.update(peak=state["allocated"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["allocated"] + 50 * mib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (950 * mib, 2000 * mib))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def fn(start, stop):  # 1 MiB per image at its peak
        state["peak"] = max(state["peak"], state["allocated"] + (stop - start) * mib)
        return stop - start

    sizer = memory.ChunkSizer("cuda", 64)
    assert list(sizer.map(fn, 64 + 1000)) == [64, 600, 400]  # 0.6 × (950 + 50) MiB free, 1 MiB each
    assert sizer.size == 600
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10**15, 10**15))
    roomy = memory.ChunkSizer("cuda", 64)
    list(roomy.map(fn, 64))
    assert roomy.size == memory.MAX_CHUNK


def test_one_image_that_does_not_fit_is_a_clear_error(splits):
    model, (x, y), _ = splits
    full = SmallDevice(model, 0)
    with pytest.raises(memory.DeviceOutOfMemoryError, match="single image.*device='cpu'.*CUDA out of memory"):
        model_logits(full, x)
    with pytest.raises(MemoryError, match="single image"):
        NeuralClamping(full, **quiet()).fit(x, y)
    assert full.failures < 20  # halved down to one image, not retried forever


# ---- every pass on a device that holds few images -------------------------------------------


def test_logits_and_the_logit_cache(splits, tmp_path):
    model, (x, y), _ = splits
    small = SmallDevice(model, 70)
    torch.testing.assert_close(model_logits(small, x, batch_size=512), model_logits(model, x, batch_size=512), **CLOSE)
    assert max(small.sizes) <= 70 and small.failures == 3  # 512 → 256 → 128 → 64, then 64 for every piece
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=200)
    z, seen = model_logits(small, loader, return_labels=True)
    torch.testing.assert_close(z, model(x), **CLOSE)
    assert torch.equal(seen, y)
    split = data.TensorSplit(x, y)
    got = cache.split_logits(small, split, tmp_path, batch_size=300)
    torch.testing.assert_close(got.logits, cache.split_logits(model, split, False).logits, **CLOSE)


@pytest.mark.parametrize("fitter", ["fast", "paper", "toolkit"])
def test_fitters_give_the_fit_of_an_unconstrained_device(splits, fitter):
    """The recipes' batches (512 and 1,000 images) are cut into pieces whose gradients are summed:
    every SGD step, hence the fit, is the unconstrained one."""
    model, (x, y), _ = splits
    settings = quiet(fitter=fitter, epochs=3, init="data", input_range=RANGE)
    ref = NeuralClamping(model, **settings).fit(x, y)
    small = SmallDevice(model, 45)
    got = NeuralClamping(small, **settings).fit(x, y)
    assert_same_fit(got, ref)
    assert got.objective_ == pytest.approx(ref.objective_, rel=1e-5)
    assert max(small.sizes) <= 45 and small.failures <= 10  # each of the split's two sizers learns once


def test_frozen_delta_ablation_and_a_streamed_split(splits, monkeypatch):
    model, (x, y), _ = splits
    ref = NeuralClamping(model, fitter="paper", epochs=2, learn_delta=False, **quiet()).fit(x, y)
    assert_same_fit(NeuralClamping(SmallDevice(model, 45), fitter="paper", epochs=2, learn_delta=False,
                                   **quiet()).fit(x, y), ref)
    import nctv.calibration.clamping_fit as clamping_fit

    # From a random δ₀: from the default δ₀ = 0 this small problem's flat objective lets L-BFGS carry the
    # pieces' rounding to 3e-3 of δ (objectives equal to 2e-6), which would hide a real difference.
    ref = NeuralClamping(model, batch_size=128, init_std=0.1, **quiet()).fit(x, y)
    monkeypatch.setattr(clamping_fit, "DEVICE_CACHE_BYTES", 0)  # streamed from the loader on every pass
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=100)
    assert_same_fit(NeuralClamping(SmallDevice(model, 45), batch_size=128, init_std=0.1, **quiet()).fit(loader), ref)


def test_forced_small_chunk_equals_the_normal_chunk(splits):
    model, (x, y), _ = splits
    ref = NeuralClamping(model, batch_size=600, **quiet()).fit(x, y)
    assert_same_objective(NeuralClamping(model, batch_size=7, **quiet()).fit(x, y), ref)


def test_theorem1_and_nc_eff(splits):
    model, (x, y), _ = splits
    small = SmallDevice(model, 33)
    torch.testing.assert_close(data_driven_delta(small, x, RANGE), data_driven_delta(model, x, RANGE), **CLOSE)
    ref = EfficientNeuralClamping(model, input_range=RANGE).fit(x, y)
    got = EfficientNeuralClamping(small, input_range=RANGE).fit(x, y)
    torch.testing.assert_close(got.delta_, ref.delta_, **CLOSE)
    assert got.temperature_ == ref.temperature_
    torch.testing.assert_close(got.predict_logits(x), ref.predict_logits(x), **CLOSE)


def test_gamma_sweep_and_init_study(splits):
    model, (x, y), (xt, yt) = splits
    small = SmallDevice(model, 50)
    # Each γ is a full fit, which may stop one iteration sooner on sums taken in other pieces (at γ = 1
    # here: 9.5 passes whole, 11.5 in pieces of 50): see FIT_REL.
    ref = gamma_sweep(model, x, y, xt, yt, gammas=[0.0, 1.0], **quiet())
    got = gamma_sweep(small, x, y, xt, yt, gammas=[0.0, 1.0], **quiet())
    torch.testing.assert_close(torch.tensor(got.temperature), torch.tensor(ref.temperature), **CLOSE)
    torch.testing.assert_close(torch.tensor(got.objective), torch.tensor(ref.objective), rtol=FIT_REL, atol=0.0)
    ref = init_study(model, (x, y), (xt, yt), n_runs=2, input_range=RANGE, **quiet())
    got = init_study(small, (x, y), (xt, yt), n_runs=2, input_range=RANGE, **quiet())
    for init in ("random", "data"):
        torch.testing.assert_close(torch.tensor(got.values(init, "ece")), torch.tensor(ref.values(init, "ece")), **CLOSE)


def test_a_whole_run_on_a_small_device(splits):
    model, cal, test = splits
    methods = ["Uncalibrated", "TS by Grid Search", "Neural Clamping (CE)", "NC (Eff.)"]
    kw = dict(methods=methods, seeds=1, bins=(15,), cache_dir=False, progress=False, input_range=RANGE)
    ref = experiment.run_experiment(model, cal, test, **kw)
    got = experiment.run_experiment(SmallDevice(model, 40), cal, test, **kw)
    for name in methods:
        assert got.stats(name, "ece").mean == pytest.approx(ref.stats(name, "ece").mean, rel=1e-4, abs=1e-6)
