"""nctv.forkgate: a ZeroGPU server never forks while another of its threads computes. Each case runs in
a fresh interpreter (the gate hooks every fork of its process, and this test process has threads of
its own), with real threads and real forks, and waits for events, never for a number of seconds."""
import os
import subprocess
import sys
import textwrap

from conftest import REPO

PRELUDE = textwrap.dedent("""
    import logging, os, sys, threading, time
    from nctv import forkgate

    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
    LONG = 120  # bounds a wait that should end at once: a hang is reported, not waited for

    def forked(tag):
        # fork, the child leaving at once; the fork's return (parent side) is recorded
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 7
        events[tag].set()

    def holding():  # a thread computing until told to stop, never reaching a check
        with forkgate.computing():
            events["in"].set()
            events["release"].wait(LONG)

    def until(predicate):
        with forkgate._STATE.cond:
            assert forkgate._STATE.cond.wait_for(predicate, LONG), "waited too long"

    events = {k: threading.Event() for k in ("in", "release", "forked", "b_in", "stop")}
    made = []  # forks made, recorded in the parent before the gate's own after-fork hook runs
    os.register_at_fork(after_in_parent=lambda: made.append(1))
""")


def run(body: str, **env: str) -> str:
    script = PRELUDE + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=dict(os.environ, **env),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_a_fork_waits_for_another_threads_section_and_a_new_section_waits_for_the_fork():
    out = run("""
        forkgate.enable()
        def newcomer():
            with forkgate.computing():
                print("b entered after the fork:", len(made) == 1)
                events["b_in"].set()
        a = threading.Thread(target=holding); a.start()
        events["in"].wait(LONG)
        f = threading.Thread(target=forked, args=("forked",)); f.start()
        until(lambda: forkgate._STATE.forker is not None)  # the fork is waiting
        b = threading.Thread(target=newcomer); b.start()
        print("forked while A computes:", events["forked"].is_set())
        print("b entered while the fork waits:", events["b_in"].is_set())
        events["release"].set()
        for t in (a, f, b): t.join(LONG)
        print("forks that waited:", forkgate.forks_waited())
    """)
    assert "forked while A computes: False" in out
    assert "b entered while the fork waits: False" in out
    assert "b entered after the fork: True" in out
    assert "forks that waited: 1" in out
    assert "forking while" not in out  # made when A left, not at the end of the longest wait


def test_a_long_computation_gives_way_at_its_next_check_and_carries_on_in_its_section():
    """The check is nctv.memory.check_cancelled, which every model pass and fit calls."""
    out = run("""
        from nctv.memory import check_cancelled
        forkgate.enable()
        checks = 0
        def long_run():
            global checks
            with forkgate.computing():
                events["in"].set()
                while not events["stop"].is_set():
                    check_cancelled()
                    checks += 1
                print("still in its section after the fork:", forkgate._STATE.depth.get(threading.get_ident()))
        a = threading.Thread(target=long_run); a.start()
        events["in"].wait(LONG)
        forked("forked")  # from this thread: made once the run reaches a check
        print("forked:", events["forked"].is_set(), "while the run is alive:", a.is_alive())
        events["stop"].set(); a.join(LONG)
        print("checks:", checks > 0, "forks that waited:", forkgate.forks_waited())
    """)
    assert "forked: True while the run is alive: True" in out
    assert "still in its section after the fork: 1" in out
    assert "checks: True forks that waited: 1" in out
    assert "forking while" not in out  # the run gave way, the fork did not give up waiting


def test_a_thread_that_waits_inside_paused_does_not_hold_a_fork_and_the_forking_threads_own_section_never_counts():
    out = run("""
        forkgate.enable()
        def waiter():
            with forkgate.computing():
                with forkgate.paused():  # a handler waiting for its GPU worker's next item
                    events["in"].set()
                    events["release"].wait(LONG)
                print("back in its section:", forkgate._STATE.depth.get(threading.get_ident()))
        a = threading.Thread(target=waiter); a.start()
        events["in"].wait(LONG)
        with forkgate.computing():  # a streaming handler's step forks inside its own section
            forked("forked")
        print("forked while the other waits:", events["forked"].is_set(), a.is_alive())
        events["release"].set(); a.join(LONG)
        print("forks that waited:", forkgate.forks_waited())
    """)
    assert "forked while the other waits: True True" in out
    assert "back in its section: 1" in out
    assert "forks that waited: 0" in out
    assert "forking while" not in out


def test_two_threads_forking_at_once_from_their_sections_both_fork():
    out = run("""
        forkgate.enable()
        start = threading.Barrier(2)
        def fork_in_section(tag):
            with forkgate.computing():
                start.wait(LONG)
                forked(tag)
        events["second"] = threading.Event()
        threads = [threading.Thread(target=fork_in_section, args=(t,)) for t in ("forked", "second")]
        for t in threads: t.start()
        for t in threads: t.join(LONG)
        print("both forked:", events["forked"].is_set() and events["second"].is_set())
    """)
    assert "both forked: True" in out
    assert "forking while" not in out  # neither waited for the other


def test_a_section_that_cannot_end_delays_a_fork_by_the_set_wait_and_no_more():
    out = run("""
        forkgate.enable()
        a = threading.Thread(target=holding); a.start()
        events["in"].wait(LONG)
        forked("forked")
        print("forked while the section is held:", events["forked"].is_set(), a.is_alive())
        events["release"].set(); a.join(LONG)
    """, NCTV_FORK_WAIT_SECONDS="0.2")
    assert "forked while the section is held: True True" in out
    assert "forking while 1 other thread(s) still compute after 0 s" in out


def test_without_the_gate_nothing_waits_and_a_forked_child_turns_it_off():
    out = run("""
        a = threading.Thread(target=holding); a.start()
        events["in"].wait(LONG)
        forked("forked")  # the gate is off: made at once
        print("off: forked while A computes:", events["forked"].is_set())
        events["release"].set(); a.join(LONG)
        forkgate.enable()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(w, b"1" if not forkgate.enabled() else b"0")
            os._exit(0)
        os.waitpid(pid, 0)
        print("child's gate off:", os.read(r, 1) == b"1", "parent's on:", forkgate.enabled())
    """)
    assert "off: forked while A computes: True" in out
    assert "child's gate off: True parent's on: True" in out


def test_on_zerogpu_every_handler_of_the_app_computes_in_a_section_and_keeps_its_kind():
    """gate_handlers, as launch() calls it: plain handlers inside a section for the call, streaming ones
    for each step and not between steps, coroutines left alone; Gradio still sees each one's kind."""
    out = run(f"""
        import asyncio, inspect
        sys.path.insert(0, {str(REPO / "tests" / "zerogpu")!r})
        os.environ["SPACES_ZERO_GPU"] = "1"
        import gradio as gr
        from nctv.ui import gpu
        gpu.prepare_server()
        me = threading.get_ident
        def depth(): return forkgate._STATE.depth.get(me(), 0)
        def plain(x): return depth()
        def stream(x):
            yield depth()
            yield depth()
        async def coro(x): return depth()
        with gr.Blocks() as demo:
            box = gr.Number()
            box.change(plain, box, box); box.submit(stream, box, box); box.blur(coro, box, box)
        gpu.gate_handlers(demo)
        gpu.gate_handlers(demo)  # twice is once
        fns = {{f.name: f.fn for f in demo.fns.values()}}
        print("plain:", fns["plain"](1), "outside:", depth())
        print("stream:", inspect.isgeneratorfunction(fns["stream"]), list(fns["stream"](1)))
        gen = fns["stream"](1); next(gen)
        print("between steps:", depth())
        gen.close()
        print("coro:", inspect.iscoroutinefunction(fns["coro"]), asyncio.run(fns["coro"](1)))
        print("signature kept:", list(inspect.signature(fns["plain"]).parameters))
    """)
    assert "plain: 1 outside: 0" in out
    assert "stream: True [1, 1]" in out
    assert "between steps: 0" in out
    assert "coro: True 0" in out
    assert "signature kept: ['x']" in out
