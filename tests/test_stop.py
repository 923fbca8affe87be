"""Stop means stopped: a cancelled run's worker thread ends within a second or two, closing the handler
waits for it, and the next heavy run starts only after it; the cancellation checks change no result,
and the slow logit-space fits report their folds and iterations. Last, through the launched app: a
Stop during MS-ODIR leaves the server process idle within seconds."""
import os
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nctv.calibration.linear import DirichletODIR, MatrixScaling, MatrixScalingODIR, VectorScaling
from nctv.ui import common
from nctv.ui.common import Worker

pytestmark = pytest.mark.usefixtures("one_thread")

#: What a run's stream says while the worker of an earlier run still computes.
WAITING = ("progress", 0.0, "waiting for the previous run to stop")


def over_confident(n, k, seed=0):
    """Logits of an over-confident model (labels drawn from softmax(z/2)), float64."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, k, dtype=torch.float64, generator=g) * 3
    y = torch.multinomial(torch.softmax(z / 2, 1), 1, generator=g).squeeze(1)
    return z, y


@pytest.fixture(scope="module")
def hundred_classes():
    # MS-ODIR takes about 15 s on these uncancelled (one CPU thread), Dir-ODIR as long, matrix scaling 5 s.
    return over_confident(2000, 100)


def start(calibrator, z, y):
    """A Worker fitting ``calibrator`` as the app's runs do (progress dicts reported as items), its
    stream started and its first progress report received. Returns (worker, stream, first report)."""
    def work(report):
        calibrator.callback = lambda info: report(("progress", info["fraction"], info))
        return calibrator.fit(z, y)

    worker = Worker(work)
    stream = worker.stream()
    for items in stream:
        if items:
            return worker, stream, items[0][2]
    raise AssertionError("the fit ended without a progress report")


def cancel(worker, stream):
    """Close the stream as Gradio does on Stop; returns the seconds the close took. Closing returns
    only once the worker's thread has ended."""
    t0 = time.monotonic()
    stream.close()
    closed = time.monotonic() - t0
    assert not worker._thread.is_alive()
    assert worker.result is None and worker.error is None  # cancelled: neither finished nor failed
    return closed


def test_stop_ends_ms_odir_on_100_classes_at_once_and_the_next_run_waits(hundred_classes):
    z, y = hundred_classes
    worker, stream, first = start(MatrixScalingODIR(), z, y)
    assert first["stage"] == "screening" and first["fold"] == 1 and first["folds"] == 3
    time.sleep(0.5)  # well into the first fold's sweep, of about 150 fits in all
    assert cancel(worker, stream) < 2.0
    # The next run's worker starts at once (the stopped one is gone) and runs to its end.
    z2, y2 = over_confident(300, 4)
    again = Worker(lambda report: VectorScaling().fit(z2, y2))
    assert WAITING not in [item for items in again.stream() for item in items]
    assert isinstance(again.result, VectorScaling)


@pytest.fixture(scope="module")
def two_hundred_classes():
    # Matrix scaling converges in well under a second on hundred_classes; on these it takes about 5 s
    # (one CPU thread), so a cancel half a second in meets it still fitting.
    return over_confident(8000, 200)


@pytest.mark.parametrize("method", [MatrixScaling, DirichletODIR], ids=["matrix-scaling", "dir-odir"])
def test_a_cancel_of_the_other_slow_fits_is_noticed_at_once(request, method):
    z, y = request.getfixturevalue("two_hundred_classes" if method is MatrixScaling else "hundred_classes")
    worker, stream, first = start(method(), z, y)
    assert first["stage"] == ("fit" if method is MatrixScaling else "screening")
    time.sleep(0.5)
    assert cancel(worker, stream) < 2.0


def test_the_next_run_waits_for_a_stopped_worker_that_is_still_busy(monkeypatch):
    """A worker stuck in one long operation (no cancellation check inside it) outlives the bounded
    wait of the handler's close; the next run's work then starts only after it has ended."""
    monkeypatch.setattr(common, "STOP_JOIN_SECONDS", 0.1)
    times = {}

    def stuck(report):
        report(("progress", 0.0, "started"))
        try:
            time.sleep(1.5)  # one long call that no Stop interrupts
        finally:
            times["first ended"] = time.monotonic()

    def second(report):
        times["second started"] = time.monotonic()
        return "second result"

    first = Worker(stuck)
    stream = first.stream()
    while not next(stream):
        pass
    stream.close()  # Stop: the close gives up waiting after 0.1 s
    assert first._thread.is_alive()
    nxt = Worker(second)
    batches = list(nxt.stream())
    assert batches[0] == [WAITING]
    assert times["second started"] >= times["first ended"]
    assert nxt.result == "second result"


def test_a_stop_while_waiting_for_the_previous_run_starts_nothing(monkeypatch):
    monkeypatch.setattr(common, "STOP_JOIN_SECONDS", 0.1)
    release = threading.Event()
    ran = []
    first = Worker(lambda report: (report(("progress", 0.0, "started")), release.wait(30)))
    stream = first.stream()
    while not next(stream):
        pass
    stream.close()
    waiting = Worker(lambda report: ran.append(True))
    pending = waiting.stream()
    assert next(pending) == [WAITING]
    pending.close()  # Stop pressed while it waits
    release.set()
    first._thread.join(10)
    assert not first._thread.is_alive()
    assert waiting._thread.ident is None and not ran  # its work never started
    # The gate is free again: a later run starts at once.
    later = Worker(lambda report: "later")
    assert WAITING not in [item for items in later.stream() for item in items]
    assert later.result == "later"


def test_fast_reports_go_out_together_in_order_and_none_is_lost():
    """A fit that reports 100 times a second (fast passes) gives the page an update at most every
    UPDATE_SECONDS, each holding every report since the last one, in order."""
    def quick(report):
        for i in range(60):
            report(i)
            time.sleep(0.01)
        return "done"

    worker = Worker(quick)
    batches, times = [], []
    for items in worker.stream():
        if items:
            batches.append(items)
            times.append(time.monotonic())
    assert [i for items in batches for i in items] == list(range(60)) and worker.result == "done"
    # Never two updates closer than that, but for the last: the end of the work goes out at once.
    assert len(times) >= 3 and np.diff(times[:-1]).min() >= common.UPDATE_SECONDS * 0.9
    assert len(batches) <= (times[-1] - times[0]) / common.UPDATE_SECONDS + 2  # the first and the last


def test_stop_says_stopped_only_once_that_visitors_run_no_longer_streams():
    """The status after Stop waits for the session's stream to close (the updates it sent before the
    cancel then go out first); for a session with nothing running it answers at once."""
    import contextvars

    import gradio as gr
    from gradio.context import LocalContext

    release = threading.Event()
    worker = Worker(lambda report: (report(("progress", 0.0, "started")), release.wait(30)))
    handler = contextvars.copy_context()  # the context Gradio runs a visitor's event in
    handler.run(LocalContext.request.set, gr.Request(session_hash="visitor-a"))
    stream = worker.stream()
    while not handler.run(next, stream):
        pass
    assert set(common._STREAMS) == {"visitor-a"}
    answers = {}

    def stop_status():
        answers["status"] = common.stopped_status(gr.Request(session_hash="visitor-a"))
        answers["at"] = time.monotonic()

    waiter = threading.Thread(target=stop_status)
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive() and not answers  # still streaming: no "Stopped" yet
    closed = time.monotonic()
    release.set()
    stream.close()
    waiter.join(10)
    assert answers["status"].startswith("**Stopped.**") and answers["at"] >= closed
    assert not common._STREAMS  # nothing left recorded
    # Another visitor, with nothing running: at once.
    assert common.stopped_status(gr.Request(session_hash="visitor-b")).startswith("**Stopped.**")


# --------------------------------------------------------------------------- same results, progress


def inside_a_worker(calibrator, z, y):
    """Fit inside a Worker (cancellation check active, callback set); returns (fitted, reports)."""
    reports = []
    calibrator.callback = reports.append
    worker = Worker(lambda report: calibrator.fit(z, y))
    for _ in worker.stream():
        pass
    assert worker.error is None
    return worker.result, reports


SMALL_GRID = dict(lambdas=(1e-1, 1e1, 1e3), mus=(1e-1, 1e1, 1e3))


@pytest.mark.parametrize("k", [5, 32], ids=["exact-sweep", "screened"])
@pytest.mark.parametrize("method", [MatrixScalingODIR, DirichletODIR], ids=["ms-odir", "dir-odir"])
def test_an_uncancelled_odir_fit_is_unchanged_by_the_checks_and_reports_its_folds(method, k):
    z, y = over_confident(400, k, seed=k)
    plain = method(**SMALL_GRID).fit(z, y)
    fitted, reports = inside_a_worker(method(**SMALL_GRID), z, y)
    assert torch.equal(fitted.weight_, plain.weight_) and torch.equal(fitted.bias_, plain.bias_)
    assert np.array_equal(fitted.cv_nll_, plain.cv_nll_) and fitted.lambda_ == plain.lambda_
    assert fitted.objective_ == plain.objective_ and fitted.n_iter_ == plain.n_iter_
    assert fitted.screened_ == (k >= 30)

    sweep = "screening" if fitted.screened_ else "cross-validation"
    swept = [r for r in reports if r["stage"] == sweep]
    # Every fold walks the 9 grid points in order, and reports each.
    assert [(r["fold"], r["candidate"]) for r in swept] == [(f, c) for f in (1, 2, 3) for c in range(1, 10)]
    assert all(r["folds"] == 3 and r["candidates"] == 9 for r in swept)
    refined = [r for r in reports if r["stage"] == "refining"]
    assert len(refined) == (3 * int(fitted.cv_refined_.sum()) if fitted.screened_ else 0)
    refit = [r for r in reports if r["stage"] == "refit"]
    # One report at the start and one per iteration (none after an iteration whose line search
    # found no lower point: the fit ends there).
    assert [r["iteration"] for r in refit] == list(range(len(refit)))
    assert len(refit) in (fitted.n_iter_, fitted.n_iter_ + 1)
    assert all((r["lambda"], r["mu"]) == (fitted.lambda_, fitted.mu_) for r in refit)
    assert [r["fits"] for r in swept + refined] == list(range(1, len(swept) + len(refined) + 1))
    last = reports[-1]
    assert last["stage"] == "done" and last["fraction"] == 1.0 and last["fits"] == last["total_fits"]
    assert last["total_fits"] == len(swept) + len(refined) + 1 and last["seconds_left"] == 0.0
    fractions = [r["fraction"] for r in reports]
    assert fractions == sorted(fractions) and 0 < fractions[0]
    # The time left is estimated once 2 % of the work is done, not from the first fits alone.
    assert all((r["seconds_left"] is None) == (r["fraction"] < 0.02) for r in reports)


@pytest.mark.parametrize("method", [MatrixScaling, VectorScaling], ids=["matrix-scaling", "vector-scaling"])
def test_an_uncancelled_single_fit_is_unchanged_and_reports_its_iterations(method):
    z, y = over_confident(800, 6, seed=3)
    plain = method().fit(z, y)
    fitted, reports = inside_a_worker(method(), z, y)
    assert torch.equal(fitted.weight_, plain.weight_) and torch.equal(fitted.bias_, plain.bias_)
    assert fitted.objective_ == plain.objective_ and fitted.n_iter_ == plain.n_iter_
    steps = reports[:-1]
    assert [r["iteration"] for r in steps] == list(range(len(steps)))
    assert len(steps) in (fitted.n_iter_, fitted.n_iter_ + 1)
    assert all(r["stage"] == "fit" and r["max_iter"] == 1000 for r in steps)
    # The fit starts at the identity map, whose loss is the NLL of the logits themselves.
    assert steps[0]["loss"] == pytest.approx(float(F.cross_entropy(z, y)), rel=1e-12)
    losses = [r["loss"] for r in steps]
    assert losses == sorted(losses, reverse=True)  # every accepted step lowers the objective
    assert losses[-1] == pytest.approx(fitted.objective_, rel=1e-9)
    assert reports[-1]["stage"] == "done" and reports[-1]["fraction"] == 1.0
    assert steps[0]["fraction"] == 0.0 and steps[0]["seconds_left"] is None
    assert all((r["seconds_left"] is None) == (r["fraction"] < 0.02) for r in reports)


# --------------------------------------------------------------------------- the launched app


def server_pid(url):
    """The process id of the app serving ``url`` (a child of this test session)."""
    port = urllib.parse.urlparse(url).port
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if f"PORT={port}".encode() in env and b"app.py" in cmd:
            return int(proc.name)
    raise AssertionError(f"no app.py process serves port {port}")


def cpu_seconds(pid):
    """User plus system CPU time of a process so far (/proc/<pid>/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the server's CPU time from /proc")
def test_stop_in_the_launched_app_leaves_the_server_idle(server):
    from gradio_client import Client

    from nctv.ui.limits import DEFAULT_DATASET_CHOICE
    from nctv.zoo import DEFAULT_MODEL

    pid = server_pid(server)
    client = Client(server, verbose=False)
    # MS-ODIR on 2,000 calibration images cross-validates for tens of seconds on a CPU.
    job = client.submit(DEFAULT_MODEL, "", DEFAULT_DATASET_CHOICE, 2000, 300, 0, 15, ["MS-ODIR"], "auto", "default",
                        "random", "fast", 100, api_name="/calibrate")
    deadline = time.monotonic() + 600
    while not any("MS-ODIR: " in str(out[0]) and " fold " in str(out[0]) for out in job.outputs()):
        assert not job.done() and time.monotonic() < deadline, "the run ended before MS-ODIR reported a fold"
        time.sleep(0.2)
    busy = cpu_seconds(pid)
    time.sleep(1.0)
    assert cpu_seconds(pid) - busy > 0.1  # the fit computes
    job.cancel()  # the Stop button's event, as the page sends it
    time.sleep(2.0)  # the cancel request, the "Stopped" status and the worker's last iteration
    idle = cpu_seconds(pid)
    time.sleep(3.0)
    assert cpu_seconds(pid) - idle < 0.3  # at most a tenth of a core: nothing computes any more
    assert not job.outputs() or "Done" not in str(job.outputs()[-1][0])  # stopped, not finished


def _niceness(thread_id: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, thread_id)


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own niceness is Linux's")
def test_a_run_computes_below_the_servers_priority_with_the_threads_its_torch_work_starts():
    """A run's worker thread runs RUN_NICENESS steps below the thread that serves the app, and so do
    the threads its torch work starts (the intra-op pool of a matrix product on two threads): while a
    run computes, the light calls take the cores first. The server's own thread keeps its priority,
    and the run's numbers are those of the same work done at the server's priority."""
    assert common.RUN_NICENESS == 10  # the default; the environment sets no other
    server, before = _niceness(threading.get_native_id()), _threads()
    a = torch.randn(600, 600, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    seen = {}

    def work(report):
        torch.set_num_threads(2)  # this thread's pool: the fixture gave the test's thread one
        product = a @ a
        me = threading.get_native_id()
        seen["worker"] = _niceness(me)
        seen["started"] = {t: _niceness(t) for t in _threads() - before - {me}}
        return product

    worker = Worker(work)
    for _ in worker.stream():
        pass
    assert worker.error is None
    assert seen["worker"] == min(19, server + common.RUN_NICENESS)
    assert seen["started"] and set(seen["started"].values()) == {seen["worker"]}
    assert _niceness(threading.get_native_id()) == server
    assert torch.equal(worker.result, a @ a)
