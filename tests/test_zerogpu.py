"""The ZeroGPU contract, kept: under a stand-in ``spaces`` package (tests/zerogpu/spaces: every GPU
call in a forked worker, arguments and results as pickles, a generator's items one by one, no memory
shared back, ``duration`` enforced) the launched app calibrates through the HTTP API with the same
figures as a run in this process, its Learn and Try tabs then use that visitor's calibration, Stop
ends the worker, and a run that cannot fit the Space's GPU time is refused before it starts. The
fork hazard (a forked child hanging in its first parallel torch operation) is shown, and its fix."""
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError

from conftest import REPO, start_app, stop_app
from nctv import metrics
from nctv.inference import model_logits
from nctv.ui import gpu, limits
from nctv.ui.calibrate import parse_nc_options, run_calibration
from nctv.ui.session import SplitSpec
from nctv.ui.try_image import example_images
from nctv.zoo import DEFAULT_MODEL

STANDIN = REPO / "tests" / "zerogpu"
#: The Space's per-call limit for the launched app: above every run of this module's estimate on the
#: GPU (the fixed 10 s of a call and at most 0.02 s of passes), below the paper's recipe at 1,000
#: epochs on 5,000 pictures (about 1.2 s of passes more, as torch 2.14 counts the default model's FLOPs).
LIMIT_SECONDS = "10.5"
#: The app's durations are the GPU's; the stand-in lets a worker run as many times longer as this CPU
#: is slower now, times this margin for the load changing while the module runs (a busy machine).
LOAD_MARGIN = 10
#: However slow this machine is, no worker of the launched app runs longer: a hung one fails its test
#: (its stacks in the server's log) instead of holding the whole run (each takes seconds here).
WORKER_MAX_SECONDS = "900"
SHARED = (DEFAULT_MODEL, "", limits.DEFAULT_DATASET_CHOICE, 300, 1000, 0, 15)
METHODS = ["Temperature Scaling", "Neural Clamping (FL)"]
NC_FIELDS = ("1", "auto", "random", "fast", 100)  # γ, λ, δ₀, fitter, epochs


def _calls(log: Path) -> list[tuple[str, float, int, str]]:
    """The stand-in's record of GPU calls: (function, duration asked, worker pid, how it ended). Every
    call must have been made inside the visitor's Gradio request (ZeroGPU charges that visitor)."""
    if not log.exists():
        return []
    rows = [line.split("\t") for line in log.read_text().splitlines()]
    assert all(r[4] == "request" for r in rows), [r for r in rows if r[4] != "request"]
    return [(f, float(d), int(p), how) for f, d, p, how, _ in rows]


def cpu_slowdown(loaded) -> float:
    """How many times longer than the Space's GPU (the throughput the app assumes) this machine takes
    for the model's passes now: 512 pictures through ``loaded``, timed after one warm-up pass."""
    x = torch.zeros(512, *loaded.data_config["input_size"])
    model_logits(loaded.model, x[:64])
    t0 = time.perf_counter()
    model_logits(loaded.model, x)
    cpu_flops = gpu.forward_flops(loaded) * len(x) / (time.perf_counter() - t0)
    return max(1.0, gpu.gpu_flops() / cpu_flops)


@pytest.fixture(scope="module")
def zerogpu(tmp_path_factory, default_model):
    """The app launched as on a ZeroGPU Space, with the stand-in ``spaces`` on its path: the app
    estimates its calls on the GPU; the stand-in gives them this machine's measured time."""
    tmp = tmp_path_factory.mktemp("zerogpu")
    log = tmp / "gpu-calls.tsv"
    path = os.pathsep.join(p for p in (str(STANDIN), os.environ.get("PYTHONPATH", "")) if p)
    env = {k: v for k, v in os.environ.items() if k != "NCTV_GPU_TFLOPS"}
    slowdown = cpu_slowdown(default_model) * LOAD_MARGIN
    proc, url = start_app(tmp, PYTHONPATH=path, SPACES_ZERO_GPU="1", SPACES_STANDIN_LOG=str(log),
                          SPACES_STANDIN_SLOWDOWN=f"{slowdown:.6g}", SPACES_STANDIN_MAX_SECONDS=WORKER_MAX_SECONDS,
                          NCTV_GPU_MAX_SECONDS=LIMIT_SECONDS,
                          NCTV_GPU_QUOTA_SECONDS="3600", NCTV_SERVER_MAX_FLOPS="0", base_env=env)
    yield SimpleNamespace(url=url, pid=proc.pid, log=log)
    stop_app(proc)


def test_a_calibration_in_a_forked_worker_equals_this_process_and_learn_and_try_use_it(zerogpu, default_model,
                                                                                       monkeypatch):
    client = Client(zerogpu.url, verbose=False)
    status, _, table, _, params, _, files = client.predict(*SHARED, METHODS, *NC_FIELDS, api_name="/calibrate")
    assert status.startswith("**Done**"), status
    served = json.loads(Path(next(f for f in files if f.endswith("results.json"))).read_text())
    assert any(f.endswith("calibrators.zip") for f in files)  # written by the worker, zipped by the server

    # The same run in this process, without any fork.
    spec = SplitSpec(DEFAULT_MODEL, None, 300, 0, 1000)
    nc = parse_nc_options("fast", NC_FIELDS[1], NC_FIELDS[4], "default", gamma=NC_FIELDS[0], init=NC_FIELDS[2])
    here, calibration = run_calibration(spec, ["Uncalibrated", *METHODS], 15, nc)
    for name, m in here.methods.items():
        got = served["methods"][name]
        for metric, stats in m.metrics[15].items():
            assert got["metrics"]["15"][metric]["mean"] == pytest.approx(stats.mean, rel=1e-6, abs=1e-9), (name, metric)
        if "temperature" in m.params:
            assert got["params"]["temperature"] == pytest.approx(m.params["temperature"], rel=1e-6)

    # It ran in one GPU call, in a worker that was not the server, for the duration its work was estimated at.
    calls = _calls(zerogpu.log)
    (name, seconds, worker, how), = [c for c in calls if c[0] == "_calibration_work"]
    assert how == "done" and worker != zerogpu.pid
    monkeypatch.delenv("NCTV_GPU_TFLOPS", raising=False)  # the app's estimate: the GPU's
    flops = gpu.forward_flops(default_model)
    work = gpu.calibration_work(["Uncalibrated", *METHODS], nc, 300, 1000, 10)
    assert seconds == math.ceil(gpu.estimate_seconds(flops, work))

    # Learn reads this visitor's run: its T = 1 row is the ECE of the run's own uncalibrated test logits,
    # its temperature-scaling row the run's T (they came back from the worker with the result).
    fig, learn_table, _ = client.predict(1.0, 15, api_name="/explore_temperature")
    assert "test split of your run" in json.loads(fig["plot"])["layout"]["title"]["text"]
    z, y = here.methods["Uncalibrated"].test_logits, here.test_labels
    row = next(ln for ln in learn_table.splitlines() if ln.startswith("| T = 1 (uncalibrated) |"))
    assert float(row.strip("|").split("|")[3]) == pytest.approx(round(100 * metrics.ece(z.double(), y, 15), 2))
    ts_t = here.methods["Temperature Scaling"].params["temperature"]
    assert f"| T = {ts_t:.3f} (temperature scaling) |" in learn_table

    # Try classifies with it, in a GPU call of its own: Neural Clamping's confidences are those of this
    # run's δ and T on the picture.
    picture = example_images()[0]
    _, chart, _, note = client.predict(handle_file(picture), api_name="/classify")
    note = note.replace("\u00a0", " ")  # "T = 3.350" is written with no-break spaces
    assert "your run of" in note and f"Neural Clamping (FL) T = {calibration.nc_temperature:.3f}" in note
    from PIL import Image

    x = default_model.preprocess(Image.open(picture))
    p = torch.softmax(model_logits(default_model.model, x[None], delta=calibration.delta).double()
                      / calibration.nc_temperature, -1)[0]
    shown = {m.group(1): float(m.group(2)) for m in
             re.finditer(r'data-class="([^"]*)"><div class="nctv-class-name">.*?data-method="nc" '
                         r'data-confidence="([^"]*)"', chart)}
    assert shown and all(v == pytest.approx(float(p[default_model.class_names.index(c)]), abs=1e-6)
                         for c, v in shown.items())
    assert [c[3] for c in _calls(zerogpu.log) if c[0] == "_picture_work"] == ["done"]


def test_the_gamma_sweep_and_the_initialisation_study_run_in_forked_workers_as_in_this_process(zerogpu):
    """The two study tabs through the HTTP API: each in one GPU call of its own, in a worker, for the
    duration its work was estimated at, with the figures this process computes (one γ and two runs
    each, to keep the test short; the grid and the run count are the handlers' own arguments)."""
    from nctv.ui import gamma, initialisation

    client = Client(zerogpu.url, verbose=False)
    spec = SplitSpec(DEFAULT_MODEL, None, 300, 0, 1000)
    status, _, table, files = client.predict(*SHARED, 1.0, 1.0, 0.1, "auto", "random", "fast", 100, "default",
                                             api_name="/gamma_sweep")
    assert status.startswith("**Done**: 1 γ values"), status
    served = json.loads(Path(next(f for f in files if f.endswith("gamma_sweep.json"))).read_text())
    nc = parse_nc_options("fast", "auto", 100, "default", init="random")
    here = gamma.run_sweep(spec, [1.0], 15, nc, lambda item: None).to_dict()
    for key in ("temperature", "weight_decay", "delta_l2", "passes"):
        assert served[key] == pytest.approx(here[key], rel=1e-6), key
    for split in ("calibration", "test"):
        for metric, values in here["splits"][split].items():
            assert served["splits"][split][metric] == pytest.approx(values, rel=1e-6, abs=1e-9), (split, metric)

    status, _, table, files = client.predict(*SHARED, 2, "1", "auto", "fast", 100, "default", api_name="/init_study")
    assert status.startswith("**Done**: 2 runs per initialisation"), status
    served = json.loads(Path(next(f for f in files if f.endswith("init_study.json"))).read_text())
    nc = parse_nc_options("fast", "auto", 100, "default", gamma="1")
    here = initialisation.run_study(spec, 2, 15, nc, lambda item: None).to_dict()
    for init, runs in here["runs"].items():
        for got, run in zip(served["runs"][init], runs, strict=True):
            assert got == pytest.approx(run, rel=1e-6, abs=1e-9), init

    calls = {c[0]: c for c in _calls(zerogpu.log)}
    for name in ("run_sweep", "run_study"):
        _, seconds, worker, how = calls[name]
        assert how == "done" and worker != zerogpu.pid and seconds > 0


def _children(pid: int) -> set[int]:
    """The live child processes of ``pid`` (from /proc)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found.update(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue
    return found


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads the server's children from /proc")
def test_stop_ends_the_gpu_worker_and_the_next_run_works(zerogpu):
    client = Client(zerogpu.url, verbose=False)
    before = _children(zerogpu.pid)
    # The paper's recipe (100 epochs of SGD) runs for minutes on a CPU.
    job = client.submit(*SHARED, ["Neural Clamping (FL)"], "1", "auto", "random", "paper", 100, api_name="/calibrate")
    deadline = time.monotonic() + 300
    while not any("Neural Clamping" in str(out[0]) for out in job.outputs()):
        assert not job.done() and time.monotonic() < deadline, job.outputs()[-1:] or "no progress"
        time.sleep(0.2)
    workers = _children(zerogpu.pid) - before
    assert len(workers) == 1  # the forked worker, streaming its fit's progress
    job.cancel()  # the Stop button's event, as the page sends it
    deadline = time.monotonic() + 15
    while workers & _children(zerogpu.pid):
        assert time.monotonic() < deadline, "the stopped run's worker is still alive"
        time.sleep(0.2)
    assert not Path(f"/proc/{workers.pop()}").exists()
    calls = [c for c in _calls(zerogpu.log) if c[0] == "_calibration_work"]
    assert calls[-1][3] == "closed"
    status, *_ = client.predict(*SHARED, ["Temperature Scaling"], *NC_FIELDS, api_name="/calibrate")
    assert status.startswith("**Done**")


def test_a_run_that_cannot_fit_the_gpu_time_is_refused_before_it_starts(zerogpu):
    client = Client(zerogpu.url, verbose=False)
    before = len(_calls(zerogpu.log))
    # The paper's recipe for 1,000 epochs on 5,000 pictures: more than the Space's 10.5 s a call.
    with pytest.raises(AppError, match=r"^15,000 pictures \(5,000 calibration, 10,000 test\): about [\d,]+ s on "
                                       r"this Space's GPU; this Space allows \d+ s a run — use [\d,]+ calibration "
                                       r"and [\d,]+ test pictures or fewer\.$"):
        client.predict(DEFAULT_MODEL, "", limits.DEFAULT_DATASET_CHOICE, 5000, 0, 0, 15, ["Neural Clamping (FL)"],
                       "1", "auto", "random", "paper", 1000, api_name="/calibrate")
    assert len(_calls(zerogpu.log)) == before  # no GPU call was made


def test_the_estimate_and_the_refusal_in_words(monkeypatch):
    for name in ("NCTV_GPU_TFLOPS", "NCTV_GPU_MAX_SECONDS", "NCTV_GPU_QUOTA_SECONDS"):
        monkeypatch.delenv(name, raising=False)
    nc = parse_nc_options("fast", "default", 100, "default", gamma="1", init="random")
    # ResNet-101 (15.7 GFLOPs a picture as count_flops counts) at 25,000/25,000 with the app's methods:
    # 100,000 forward (both splits' logits, NC's test pass, NC's calibration pass for its conformal sets)
    # and 10 float64 passes of 25,000 training pictures, each counted as 3 fp32 ones (× 3 for the backward),
    # at 30 TFLOP/s, plus 10 s.
    work = gpu.calibration_work(["Uncalibrated", "Temperature Scaling", "TS by Grid Search", "Vector Scaling",
                                 "Neural Clamping (FL)"], nc, 25_000, 25_000, 1000)
    assert (work.forward, work.trained, work.extra_seconds) == (100_000, 750_000, 0)
    seconds = gpu.estimate_seconds(15.7e9, work)
    assert seconds == pytest.approx(10 + 15.7e9 * (100_000 + 3 * 750_000) / 30e12)
    with pytest.raises(ValueError, match=r"^50,000 pictures \(25,000 calibration, 25,000 test\): about 1240 s on this "
                                         r"Space's GPU; this Space allows 60 s a run — use 1,000 calibration and 1,000 "
                                         r"test pictures or fewer\.$"):
        gpu.check_fits(seconds, 25_000, 25_000)
    assert gpu.check_fits(59.2, 300, 1000) == 60
    monkeypatch.setenv("NCTV_GPU_MAX_SECONDS", "600")
    with pytest.raises(ValueError, match="a visitor's daily GPU quota is 300 s"):
        gpu.check_fits(455, 25_000, 25_000)
    monkeypatch.setenv("NCTV_GPU_MAX_SECONDS", "a minute")
    with pytest.raises(ValueError, match=r"^The environment variable NCTV_GPU_MAX_SECONDS must be a number ≥ 1; it is "
                                         r"'a minute'\.$"):
        gpu.check_fits(10, 10, 10)


# --------------------------------------------------------------------------- the contract in this process

#: Changed by the worker's work: the server's copy must not change (no memory is shared back).
TOUCHED: list[int] = []


def _counting(n: int, pause: float, report):
    for i in range(n):
        TOUCHED.append(i)
        report(("progress", i / n, f"step {i}", os.getpid()))
        time.sleep(pause)
    return {"pid": os.getpid(), "sum": sum(TOUCHED)}


@pytest.fixture
def standin(monkeypatch):
    """ZeroGPU in this process: the stand-in on the path, SPACES_ZERO_GPU set, this process the server."""
    monkeypatch.syspath_prepend(str(STANDIN))
    monkeypatch.setenv("SPACES_ZERO_GPU", "1")
    monkeypatch.setenv(gpu.WORKER_THREADS, "1")
    monkeypatch.setattr(gpu, "_SERVER_PID", os.getpid())
    monkeypatch.delitem(sys.modules, "spaces", raising=False)
    assert gpu.zero_gpu()


def test_items_stream_one_by_one_from_a_forked_worker_and_no_memory_comes_back(standin):
    fn = gpu.gpu_generator(_counting)
    run = gpu.GpuRun(fn, (6, 0.3))
    arrivals = []
    for items in run.stream():
        arrivals += [(time.monotonic(), item) for item in items]
    steps = [item for _, item in arrivals if item[0] == "progress"]
    assert [s[2] for s in steps] == [f"step {i}" for i in range(6)]
    assert {s[3] for s in steps} == {run.result["pid"]} and run.result["pid"] != os.getpid()
    assert arrivals[-1][0] - arrivals[0][0] > 1.0  # they came as they were made, not all at the end
    assert run.result["sum"] == 15 and TOUCHED == []  # the worker's list grew; this process's did not


def test_a_worker_past_its_duration_is_ended_and_the_run_says_so(standin):
    run = gpu.GpuRun(gpu.gpu_generator(_counting), (100, 0.1))
    run.seconds = 2  # the duration the call asks for (a run's prepare step sets it from its estimate)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"^The GPU run was ended after the 2 s it was given \(the estimate for "
                                         r"this work\)\. Try a smaller calibration or test size, or fewer methods\.$"):
        list(run._call())
    assert time.monotonic() - t0 < 15


def test_closing_the_stream_kills_the_worker_at_once(standin):
    fn = gpu.gpu_generator(_counting)
    run = gpu.GpuRun(fn, (100, 0.1))
    stream = run.stream()
    pid = next(item for items in stream for item in items if item[0] == "progress")[3]
    assert Path(f"/proc/{pid}").exists() or not Path("/proc/self").exists()
    t0 = time.monotonic()
    stream.close()  # Gradio closes the handler's generator on Stop
    assert time.monotonic() - t0 < 3
    assert not Path(f"/proc/{pid}").exists()


def _refusing(words: str, kind: type, report=None):
    raise kind(words)


def test_a_workers_error_comes_back_in_its_own_words(standin, default_model, monkeypatch):
    """ZeroGPU returns a worker's exception other than gr.Error as its class name alone (the stand-in
    does as the real package does): the worker sends its errors back as values, so a refusal keeps
    its words and a fault is named."""
    words = "The calibration split holds 3 pictures for 10 classes; use at least 20."
    with pytest.raises(ValueError, match=f"^{re.escape(words)}$"):
        list(gpu.GpuRun(gpu.gpu_generator(_refusing), (words, ValueError)).stream())
    with pytest.raises(RuntimeError, match=r"^ZeroDivisionError in the GPU worker: float division by zero$"):
        list(gpu.GpuRun(gpu.gpu_generator(_refusing), ("float division by zero", ZeroDivisionError)).stream())
    monkeypatch.setenv("NCTV_SERVER_MAX_FLOPS", "0")  # the embedded model's pictures go to the "GPU" too
    with pytest.raises(ValueError, match=f"^{re.escape(words)}$"):
        gpu.call(gpu.gpu_call(_refusing), _refusing, (words, ValueError), default_model, 4)
    assert gpu.call(gpu.gpu_call(max), max, (3, 7), default_model, 4) == 7


# --------------------------------------------------------------------------- the fork hazard

FORK_SCRIPT = textwrap.dedent("""
    import sys, time
    import torch
    sys.path.insert(0, {standin!r})
    import spaces
    from nctv.ui import gpu

    if sys.argv[1] == "prepared":
        gpu.prepare_server()  # what launch() does first
    else:
        torch.set_num_threads(2)  # a server left as it was
    torch.log_softmax(torch.randn(50_000, 100), 1)  # the server's own torch work (tables, diagrams)

    @spaces.GPU(duration={seconds})
    def work():
        torch.set_num_threads(2)
        return float(torch.log_softmax(torch.randn(50_000, 100), 1).sum())

    t0 = time.monotonic()
    try:
        work()
        print("finished", time.monotonic() - t0)
    except Exception as exc:
        print("failed", time.monotonic() - t0, exc)
""")


@pytest.mark.slow
def test_a_forked_worker_hangs_after_the_servers_thread_pool_and_not_after_prepare_server(tmp_path):
    def run(mode: str, seconds: float) -> str:
        script = FORK_SCRIPT.format(standin=str(STANDIN), seconds=seconds)
        env = dict(os.environ, SPACES_ZERO_GPU="1", OMP_NUM_THREADS="2")
        out = subprocess.run([sys.executable, "-c", script, mode], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=120)
        return out.stdout.strip().splitlines()[-1]

    assert run("prepared", 60).startswith("finished")
    # Without it the child's first parallel operation waits for the parent's pool for ever: the
    # stand-in ends it at its duration.
    unprepared = run("as-is", 5)
    assert unprepared.startswith("failed") and "GPU task aborted" in unprepared


MKL_FORK_SCRIPT = textwrap.dedent("""
    import sys, threading
    import torch  # MKL's fast memory manager left on (app.py turns it off): the gate alone must do
    sys.path.insert(0, {standin!r})
    import spaces
    from nctv import forkgate
    from nctv.ui import gpu

    gpu.prepare_server()  # on ZeroGPU it turns the fork gate on
    a, b = torch.randn(1000, 1000), torch.randn(1000, 34)
    stop = False

    def one_product():
        with forkgate.computing():  # as the app's handlers compute (nctv.ui.gpu.gate_handlers)
            (a @ b).sum()

    def server_threads():  # the server's request threads, each new one entering MKL
        while not stop:
            threads = [threading.Thread(target=one_product) for _ in range(4)]
            [t.start() for t in threads]
            [t.join() for t in threads]

    threading.Thread(target=server_threads, daemon=True).start()

    @spaces.GPU(duration={seconds})
    def work():
        torch.set_num_threads(2)
        c, d = torch.randn(1000, 1000), torch.randn(1000, 34)
        for _ in range(50):
            (c @ d).sum()
        return 1

    finished = 0
    for _ in range({forks}):
        try:
            finished += work()
        except Exception:
            pass
    stop = True
    print("finished", finished, "waited", forkgate.forks_waited())
""")


@pytest.mark.slow
def test_a_worker_forked_while_server_threads_are_in_mkl_finishes_behind_the_fork_gate(tmp_path):
    """With neither of the server's two settings, about one fork in four hung in MKL's memory manager
    (measured: 5 of 20, 8 of 30). Turning MKL's fast memory manager off (app.py) made it rarer, not
    nil: a launched app's first run hung in ``mm_account_ptr_by_tid`` once in six starts while its
    warm-up computed. The fork gate (nctv.forkgate) leaves none hanging, even with the manager on: each
    fork waits for the server threads' products to end. A hung worker is ended at its duration."""
    forks = 12
    script = MKL_FORK_SCRIPT.format(standin=str(STANDIN), seconds=60, forks=forks)
    env = {k: v for k, v in os.environ.items() if k != "MKL_DISABLE_FAST_MM"}
    env.update(SPACES_ZERO_GPU="1", OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=1800)
    finished, waited = re.fullmatch(r"finished (\d+) waited (\d+)", out.stdout.strip().splitlines()[-1]).groups()
    assert int(finished) == forks, out.stdout[-2000:] + out.stderr[-2000:]
    assert int(waited) > 0  # the server threads were computing when some forks came: they waited
