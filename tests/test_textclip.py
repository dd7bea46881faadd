"""Bounding text a worker controls before it travels (pure)."""

from __future__ import annotations

from unicron.textclip import FAULT_FIELD_LIMITS, clip, clip_fields, clip_line


def test_clip_keeps_short_text_and_both_ends_of_long_text() -> None:
    assert clip("short", 10) == "short"
    text = "HEAD" + "x" * 1000 + "TAIL"
    out = clip(text, 100)
    assert out.startswith("HEADxx") and out.endswith("xxTAIL")
    assert f"[{len(text) - 100} characters left out]" in out
    assert len(out) < 160  # the limit plus the marker


def test_clip_line_bounds_what_a_console_line_shows() -> None:
    assert clip_line("ValueError: bad") == "ValueError: bad"
    line = clip_line("ValueError: " + "X" * 5_000_000)
    assert len(line) < 600 and line.endswith("[4999512 more characters]")


def test_clip_fields_bounds_each_text_field_of_a_fault() -> None:
    fault = {"kind": "exit", "rank": 0, "message": "m" * 10**6, "traceback": "t" * 10**6, "summary": "s",
             "stderr_tail": None}
    clip_fields(fault)
    assert fault["summary"] == "s" and fault["stderr_tail"] is None and fault["rank"] == 0
    for name in ("message", "traceback"):
        assert len(fault[name]) < FAULT_FIELD_LIMITS[name] + 100


def test_an_exception_from_a_data_loader_worker_shows_the_workers_own_line() -> None:
    """Acceptance 19A F2: a corrupt sample was reported everywhere as "Caught ValueError in
    DataLoader worker process 0.": which sample, and what was wrong, were lost. The message is
    torch's own (``ExceptionWrapper.reraise``), made here by a real loader."""
    from torch.utils.data import DataLoader, Dataset

    from unicron.textclip import first_line

    class Corrupt(Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> int:
            raise ValueError(f"corrupt sample {i}\nsecond line of it")

    try:
        next(iter(DataLoader(Corrupt(), num_workers=1)))
    except ValueError as err:
        message = str(err)
    assert message.startswith("Caught ValueError in DataLoader worker process 0.")
    assert first_line(message) == "ValueError: corrupt sample 0 (in DataLoader worker process 0)"
    # The decision's cause and the exception's console line say it once, type included.
    from unicron.agent.ui import fault_line
    from unicron.detect.evidence import short

    assert short(message) == "ValueError: corrupt sample 0 (in DataLoader worker process 0)"
    line = fault_line({"kind": "exception", "rank": 1, "error_type": "ValueError", "message": message}, "n")
    assert line.endswith(": ValueError: corrupt sample 0 (in DataLoader worker process 0)"), line
    from unicron.coord.view import describe_fault

    assert describe_fault({"kind": "exception", "rank": 1, "error_type": "ValueError", "message": message}) == \
        "exception on rank 1: ValueError: corrupt sample 0 (in DataLoader worker process 0)"
    assert first_line("\nplain\nmore") == "plain" and first_line(" \n ") == ""
    assert first_line("Caught X in Y.\nOriginal Traceback (most recent call last):\n  gone") == "Caught X in Y."


def test_unicrons_own_line_starts_a_line_after_an_unterminated_echo() -> None:
    from unicron.consoleline import line_start, note_echoed

    note_echoed(b"epoch 1:  40%|####      |\r")  # a progress bar, mid-line
    assert line_start() == "\n" and line_start() == ""  # once
    note_echoed(b"a whole line\n")
    assert line_start() == ""
