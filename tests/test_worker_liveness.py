"""The worker's frame watch: a moving main thread is told apart from one that sits still."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from unicron.worker.liveness import OVERDUE_S, FrameWatch, MotionJudge, main_thread_cpu, main_thread_signature


def test_motion_judge_needs_repeated_changes() -> None:
    judge = MotionJudge(window=8, min_changes=2)
    assert not judge.add("a") and not judge.add("a")
    assert not judge.add("b"), "one change (a poller waking up once) is not motion"
    assert judge.add("c"), "a second change within the window is"
    for _ in range(8):
        moving = judge.add("c")
    assert not moving, "still for a whole window"
    judge.reset()
    assert not judge.add("x") and not judge.add("y")


def _signatures_of_main_while(body, samples: int = 12) -> list[object]:
    """The main thread's signatures, sampled from another thread while the main thread (this
    test) runs ``body(stop)``."""
    seen: list[object] = []
    stop = threading.Event()

    def sampler() -> None:
        for _ in range(samples):
            time.sleep(0.02)
            seen.append(main_thread_signature())
        stop.set()

    thread = threading.Thread(target=sampler)
    thread.start()
    body(stop)
    thread.join()
    return seen


def test_an_evaluating_main_thread_moves_and_a_waiting_one_does_not() -> None:
    import torch

    # Forward passes through a stack of modules, as an evaluation loop runs: the main thread
    # hands the GIL over in many different frames. (A tight loop inside one function is sampled
    # at the same instruction every time and looks still: see the module docstring.)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(6)])
    batch = torch.ones(4, 8)

    def evaluate(stop: threading.Event) -> None:
        with torch.no_grad():
            while not stop.is_set():
                model(batch)

    def wait(stop: threading.Event) -> None:
        stop.wait()

    moving = _signatures_of_main_while(evaluate, samples=24)
    still = _signatures_of_main_while(wait)
    judge = MotionJudge()
    assert any(judge.add(sig) for sig in moving), moving
    assert len(set(still)) == 1, still
    judge.reset()
    assert not any(judge.add(sig) for sig in still)


def test_a_short_module_stack_evaluating_is_judged_moving_within_a_window() -> None:
    import torch

    from unicron.worker.liveness import SAMPLE_S, WINDOW

    # The evaluation loop of tests/scripts/train_state.py: the sampler sees few distinct frames
    # (the two Linear calls look alike), so only dense sampling finds the changes reliably.
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    batch = torch.ones(64, 8)
    seen: list[object] = []
    stop = threading.Event()

    def sampler() -> None:
        for _ in range(WINDOW):
            time.sleep(SAMPLE_S)
            seen.append(main_thread_signature())
        stop.set()

    thread = threading.Thread(target=sampler)
    thread.start()
    with torch.no_grad():
        while not stop.is_set():
            model(batch)
    thread.join()
    judge = MotionJudge()
    assert any([judge.add(sig) for sig in seen]), seen


class _NeverBack:
    """A main thread in one native call as far as ``MainThreadReturns`` can tell: frames decide."""

    def returned(self) -> bool:
        return False

    def reset(self) -> None:
        pass


def test_frame_watch_reports_motion_only_when_overdue(monkeypatch) -> None:
    import unicron.worker.liveness as liveness

    sent: list[float] = []
    clock = [100.0]
    watch = FrameWatch(lambda: sent.append(clock[0]), clock=lambda: clock[0], cpu=lambda: clock[0],  # 1 core
                       returns=_NeverBack())
    watch._last_boundary = 100.0  # as if a step just completed (no thread started in this test)
    signatures = iter(range(1000))
    monkeypatch.setattr(liveness, "main_thread_signature", lambda: next(signatures))  # always changing
    clock[0] = 100.0 + OVERDUE_S / 2
    assert not watch.sample(clock[0]), "not overdue yet"
    for i in range(1, 4):
        clock[0] = 100.0 + OVERDUE_S + 0.25 * i
        watch.sample(clock[0])
    assert len(sent) == 1, "the second change sends once"
    clock[0] += 0.25
    watch.sample(clock[0])
    assert len(sent) == 1, "at most one message per SEND_EVERY_S"
    clock[0] += 0.3
    assert watch.sample(clock[0]) and len(sent) == 2
    watch._last_boundary = clock[0]  # a step: the window starts over
    clock[0] += 0.1
    assert not watch.sample(clock[0])


def test_frame_watch_begun_before_the_first_step_samples_from_its_own_delay(monkeypatch) -> None:
    import unicron.worker.liveness as liveness

    sent: list[float] = []
    clock = [50.0]
    watch = FrameWatch(lambda: sent.append(clock[0]), clock=lambda: clock[0], cpu=lambda: clock[0],
                       returns=_NeverBack())
    monkeypatch.setattr(watch, "_start_thread", lambda: None)  # sampled by hand below
    signatures = iter(range(1000))
    monkeypatch.setattr(liveness, "main_thread_signature", lambda: next(signatures))
    clock[0] = 200.0
    watch.begin()  # a restarted worker's start: its start-up is judged from here
    clock[0] = 200.0 + liveness.BEFORE_FIRST_STEP_S - 0.1
    assert not watch.sample(clock[0]), "a warm restart steps within the delay: never sampled"
    for i in range(1, 4):
        clock[0] = 200.0 + liveness.BEFORE_FIRST_STEP_S + 0.25 * i
        watch.sample(clock[0])
    assert len(sent) == 1, "Python moving before the first step is reported"
    watch.boundary()  # the first step: the usual rule from here
    clock[0] += OVERDUE_S / 2
    assert not watch.sample(clock[0])


def _moved_while(body) -> int:
    """How many ``moved`` a real FrameWatch (real clock, the main thread's real CPU clock) sends
    in 1.5 s of sampling while the main thread (this test) runs ``body(stop)``."""
    return _reports_while(body)[0]


def _evaluate(stop: threading.Event) -> None:  # an evaluation loop: new calls, a core of CPU
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    with torch.no_grad():
        while not stop.is_set():
            model(torch.ones(64, 8))


def _poll(stop: threading.Event) -> None:  # a new queue.get call every 10 ms, at almost no CPU
    import queue

    q: queue.Queue[int] = queue.Queue()
    while not stop.is_set():
        try:
            q.get(timeout=0.01)
        except queue.Empty:
            pass


def _iterations_for(seconds: float) -> int:
    """Iterations that take at least ``seconds`` at the fastest of five timings (a machine busy
    while it is timed must not make the call short once it is idle)."""
    import hashlib

    fastest = float("inf")
    for _ in range(5):
        began = time.monotonic()
        hashlib.pbkdf2_hmac("sha256", b"unicron", b"salt", 20_000)
        fastest = min(fastest, time.monotonic() - began)
    return int(20_000 * seconds / max(fastest, 1e-4))


_LONG_CALL = _iterations_for(4.0)  # longer than the 1.5 s of sampling even if timed at half speed


def _one_native_call(stop: threading.Event) -> None:  # CPU in one C call, longer than the sampling
    import hashlib

    _one_native_call.entering.set()  # type: ignore[attr-defined]
    hashlib.pbkdf2_hmac("sha256", b"unicron", b"salt", _LONG_CALL)
    # Whether the sampling ended inside the call; if not (the sampler was slow to see the call
    # settle), what it saw last was the way out of it, which is motion.
    _one_native_call.outlasted = stop.is_set()  # type: ignore[attr-defined]


def _moved_in_one_native_call() -> int:
    for _ in range(3):
        moved = _moved_while(_one_native_call)
        if _one_native_call.outlasted:  # type: ignore[attr-defined]
            return moved
    pytest.skip("the machine is too loaded: the sampling never ended inside the call")


# Sampling begins once the main thread is in the call: one sample taken on its way there (on
# a loaded machine it can take longer than a sample's interval) sees it come back from Python.
_one_native_call.entering = threading.Event()  # type: ignore[attr-defined]


def _native_loop(stop: threading.Event) -> None:  # CPU in C calls, one after another, one frame
    import hashlib

    while not stop.is_set():
        hashlib.pbkdf2_hmac("sha256", b"unicron", b"salt", 20_000)


def _moved_and_share(body) -> tuple[int, float]:
    """``_moved_while(body)`` and the share of a core the main thread used meanwhile."""
    wall, cpu = time.monotonic(), main_thread_cpu()
    moved = _moved_while(body)
    return moved, ((main_thread_cpu() or 0.0) - (cpu or 0.0)) / (time.monotonic() - wall)


def test_motion_needs_new_calls_and_the_main_threads_cpu() -> None:
    from unicron.worker.liveness import MIN_CPU

    assert _moved_while(_evaluate) >= 1
    assert _moved_in_one_native_call() == 0
    if main_thread_cpu() is None:  # without the thread's CPU clock the frames alone decide
        return
    # A poll every 10 ms uses about 0.6% of a core here, under MIN_CPU (2%); a machine loaded
    # several times over makes each wake-up dearer (cold caches), and a poll that really took
    # MIN_CPU is motion by the rule. It must be still whenever it took clearly less.
    for _ in range(3):
        moved, share = _moved_and_share(_poll)
        if share < MIN_CPU / 2:
            assert moved == 0, f"a poll at {share:.3f} of a core was taken for motion"
            return
    pytest.skip(f"the machine is too loaded: a 10 ms poll took {share:.3f} of a core")


def test_native_calls_one_after_another_are_motion_one_long_call_is_not() -> None:
    """An evaluation that is one big op per batch shows the sampler the same frame at the same
    call instruction every time, as one long call does; the main thread coming back to the
    interpreter between samples tells them apart (acceptance pass 14: a loop of matmuls between
    steps was called a busy hang)."""
    if main_thread_cpu() is None:  # the loop counts only with the main thread's CPU clock
        pytest.skip("no per-thread CPU clock")
    # The loop counts from a fifth of a core (MIN_CPU_THREAD) up: on a machine loaded several
    # times over, a 1.5 s window can give the thread less. It must count whenever it got more.
    for _ in range(3):
        wall, cpu = time.monotonic(), main_thread_cpu()
        moved = _moved_while(_native_loop)
        share = ((main_thread_cpu() or 0.0) - (cpu or 0.0)) / (time.monotonic() - wall)
        if moved >= 1:
            break
        assert share < 0.3, f"a loop of native calls at {share:.2f} of a core was not motion"
    else:
        pytest.skip(f"the machine is too loaded: the loop got {share:.2f} of a core")
    assert _moved_in_one_native_call() == 0


def _in_debugger(stop: threading.Event) -> None:  # breakpoint(): a person at the prompt, no CPU
    import bdb

    class Held(bdb.Bdb):
        def user_line(self, frame) -> None:
            stop.wait()
            self.set_continue()

    Held().runcall(lambda: None)


def _streaming_eval(stop: threading.Event) -> None:  # batches from loader workers that wait on storage
    import torch
    from torch.utils.data import DataLoader, Dataset

    from unicron.worker.liveness import count_batches_of

    count_batches_of(sys.modules["torch.utils.data.dataloader"])  # as a worker's hooks do

    class Slow(Dataset[int]):
        def __len__(self) -> int:
            return 10_000

        def __getitem__(self, i: int) -> int:
            time.sleep(0.25)  # a read from slow storage: no CPU, a few batches a second
            return i

    batches = iter(DataLoader(Slow(), batch_size=1, num_workers=1))  # the main thread waits in one frame
    for batch in batches:
        torch.as_tensor(batch)
        if stop.is_set():
            break
    batches._shutdown_workers()  # type: ignore[attr-defined]
    for thread in threading.enumerate():  # the queues' feeder threads: none may outlive the test
        if thread.name == "QueueFeederThread":
            thread.join(10)


def test_batches_that_keep_coming_and_a_debugger_are_motion() -> None:
    """Acceptance pass 14: an evaluation over a loader whose workers wait on slow storage, and a
    rank stopped at ``breakpoint()``, were called hangs; the main thread waits at little CPU in
    both, but batches keep coming in one and a person holds the other."""
    assert _moved_while(_streaming_eval) >= 1
    assert _moved_while(_in_debugger) >= 1


def test_work_on_another_thread_moves_while_the_main_thread_waits_for_it() -> None:
    from concurrent.futures import ThreadPoolExecutor

    def on_a_pool(work):
        def body(stop: threading.Event) -> None:
            with ThreadPoolExecutor(1) as pool:
                pool.submit(work, stop).result()  # the main thread waits, one frame, no CPU
        return body

    assert _moved_while(on_a_pool(_evaluate)) >= 1
    assert _moved_while(on_a_pool(_poll)) == 0  # a monitoring thread: new calls, little CPU
    # Acceptance 19A F3: a pool task that is one long native op changes no frame for seconds;
    # it computes while the main thread waits for it (on the main thread itself: one long call).
    if main_thread_cpu() is not None:
        assert _moved_while(on_a_pool(_one_native_call)) >= 1


def test_another_threads_motion_needs_its_own_cpu() -> None:
    from unicron.worker.liveness import OtherThreads

    used = [0.0]
    others = OtherThreads(cpu=lambda _tid: used[0])
    stop = threading.Event()

    def work() -> int:
        return sum(range(50))

    def calls() -> None:  # new Python calls all the time: new frames
        while not stop.is_set():
            work()

    thread = threading.Thread(target=calls, name="evaluator")
    thread.start()
    try:
        verdicts = []
        for i in range(12):  # the frames change; the CPU the fake clock reports decides
            used[0] += 0.05 * 0.1  # a tenth of a core per 0.05 s tick
            verdicts.append(others.moving(i * 0.05))
            time.sleep(0.01)
        assert not any(verdicts)
        for i in range(12, 24):
            used[0] += 0.05 * 0.9
            verdicts.append(others.moving(i * 0.05))
            time.sleep(0.01)
        assert any(verdicts[12:])
    finally:
        stop.set()
        thread.join()
    assert not others.moving(2.0) and not others._seen, "a thread that ended is forgotten"


def test_two_calls_at_the_same_instruction_are_two_samples() -> None:
    # What a sampler sees of `Linear, Tanh, Linear`: the same code at the same instruction, in two
    # different calls. Code and instruction alone called them one frame, still.
    import sys

    from unicron.worker.liveness import FrameSample

    def probe() -> FrameSample:
        frame = sys._getframe()
        return FrameSample(frame, frame.f_lasti)

    first = probe()  # held: the second call cannot get its frame's address
    second = probe()
    assert first.frame.f_code is second.frame.f_code and first.lasti == second.lasti
    assert first != second and first == FrameSample(first.frame, first.lasti)
    judge = MotionJudge(window=4, min_changes=2)
    assert not judge.add(first) and not judge.add(second)
    assert judge.add(probe()), "a third call is the second change"


def _reports_while(body) -> tuple[int, int]:
    """(``moved``, ``data``) a real FrameWatch sends in 1.5 s of sampling while the main thread
    (this test) runs ``body(stop)``."""
    from unicron.worker.liveness import SAMPLE_S

    moved: list[float] = []
    data: list[float] = []
    watch = FrameWatch(lambda: moved.append(time.monotonic()), emit_data=lambda: data.append(time.monotonic()))
    watch._last_boundary = time.monotonic() - 10  # long overdue (no step thread started here)
    stop = threading.Event()

    def sampler() -> None:
        entering = getattr(body, "entering", None)
        if entering is not None:
            assert entering.wait(30), "the body never began"
            # At the same instruction twice, computing in between (not just descheduled): in it.
            deadline, last, cpu = time.monotonic() + 30, None, main_thread_cpu()
            while (now := main_thread_signature()) is None or now != last or (cpu is not None and main_thread_cpu() == cpu):
                assert time.monotonic() < deadline, "the main thread never settled in the call"
                last, cpu = now, main_thread_cpu()
                time.sleep(SAMPLE_S)
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            time.sleep(SAMPLE_S)
            watch.sample(time.monotonic())
        stop.set()

    entering = getattr(body, "entering", None)
    if entering is not None:
        entering.clear()
    thread = threading.Thread(target=sampler)
    thread.start()
    body(stop)
    thread.join()
    return len(moved), len(data)


def _slow_read(stop: threading.Event) -> None:  # a data loader whose read blocks (a slow network file)
    from torch.utils.data import DataLoader, Dataset

    class Slow(Dataset[int]):
        def __len__(self) -> int:
            return 1

        def __getitem__(self, i: int) -> int:
            stop.wait()
            return i

    for _ in DataLoader(Slow(), batch_size=None):
        pass


def test_a_main_thread_waiting_for_its_data_loader_is_reported() -> None:
    moved, data = _reports_while(_slow_read)
    assert moved == 0 and data >= 2, (moved, data)  # every SEND_EVERY_S while it waits
    moved, data = _reports_while(lambda stop: stop.wait())  # a wait of its own (a sleep, a lock)
    assert moved == 0 and data == 0, (moved, data)


def _waits_on_a_thread(work):
    """The main thread waits on a queue while a thread of its own runs ``work(stop)``."""
    import queue

    def body(stop: threading.Event) -> None:
        done: queue.Queue[bool] = queue.Queue()
        thread = threading.Thread(target=lambda: (work(stop), done.put(True)), name="prefetch")
        thread.start()
        done.get()
        thread.join()
    return body


def test_a_main_thread_waiting_on_a_thread_that_reads_its_data_loader_is_reported() -> None:
    moved, data = _reports_while(_waits_on_a_thread(_slow_read))  # a prefetching thread
    assert moved == 0 and data >= 2, (moved, data)
    moved, data = _reports_while(_waits_on_a_thread(lambda stop: stop.wait()))  # a thread of other business
    assert moved == 0 and data == 0, (moved, data)
