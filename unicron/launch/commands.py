"""`unicron run`: split the raw command line, print help, hand the rest to the agent.

Typer cannot express torchrun's grammar (options, then a script, then the script's own
arguments that may look like options), so the `run` command takes its arguments raw and we split
them here. We do not use argparse's REMAINDER because argparse classifies every token up front:
torchrun fails on ``train.py --no`` ("ambiguous option") and drops the first ``--`` after the
script. Here everything after the script path belongs to the script, verbatim.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field

import typer

from unicron.errors import UsageError
from unicron.launch.args import BY_FLAG, OPTIONS, TORCHRUN, UNICRON, Option, closest_flag

_HELP_FLAGS = ("-h", "--help")
_NEGATIVE_NUMBER = re.compile(r"^-\d+(\.\d*)?$")


class HelpRequested(Exception):
    """`-h/--help` came before the script; ``text`` is the help to print."""

    def __init__(self, text: str) -> None:
        super().__init__("help requested")
        self.text = text


@dataclass(frozen=True)
class SplitArgs:
    """The launcher's options as raw strings (True for switches, a list for repeatable ones)
    and the script with its arguments exactly as given."""

    given: dict[str, object] = field(default_factory=dict)
    spelling: dict[str, str] = field(default_factory=dict)  # dest -> flag as the user typed it
    script: str = ""
    script_args: tuple[str, ...] = ()


def _resolve_long(name: str) -> Option:
    if name in BY_FLAG:
        return BY_FLAG[name]
    # Unique abbreviations work as in argparse; both spellings of one option count as one
    # (argparse on Python 3.11 calls `--nproc` ambiguous between them).
    matches = {o.dest: o for f, o in BY_FLAG.items() if f.startswith("--") and f.startswith(name)}
    if len(matches) == 1:
        return next(iter(matches.values()))
    if matches:
        names = ", ".join(sorted(o.name for o in matches.values()))
        raise UsageError(f"ambiguous option {name}: could be {names}")
    close = closest_flag(name)
    hint = f" (did you mean {close}?)" if close else " (see `unicron run --help`)"
    raise UsageError(f"unrecognized option {name}{hint}")


def _record(out: SplitArgs, opt: Option, value: object, spelling: str) -> None:
    if opt.repeat:
        acc = out.given.setdefault(opt.dest, [])
        assert isinstance(acc, list)
        acc.append(value)
    else:
        out.given[opt.dest] = value  # the last occurrence wins, as in argparse
    out.spelling[opt.dest] = spelling


def _take_value(argv: list[str], i: int, spelling: str) -> str:
    if i >= len(argv) or (argv[i].startswith("-") and len(argv[i]) > 1 and not _NEGATIVE_NUMBER.match(argv[i])):
        raise UsageError(f"{spelling}: expected a value")
    return argv[i]


def split_argv(argv: list[str]) -> SplitArgs:
    """Split `unicron run` arguments into launcher options and the script with its arguments.

    Raises ``HelpRequested`` for -h/--help before the script, ``UsageError`` for anything bad."""
    out = SplitArgs()
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            if i + 1 >= len(argv):
                raise UsageError("missing the training script after --")
            return SplitArgs(out.given, out.spelling, argv[i + 1], tuple(argv[i + 2:]))
        if not tok.startswith("-") or tok == "-":
            return SplitArgs(out.given, out.spelling, tok, tuple(argv[i + 1:]))
        i += 1
        if tok in _HELP_FLAGS:
            raise HelpRequested(format_help())
        if tok.startswith("--"):
            name, eq, inline = tok.partition("=")
            opt = _resolve_long(name)
            if not opt.takes_value:
                if eq:
                    raise UsageError(f"{opt.name} takes no value (got {tok!r})")
                _record(out, opt, True, name)
                continue
            if not eq:
                inline = _take_value(argv, i, name)
                i += 1
            _record(out, opt, inline, name)
            continue
        j = 1  # a cluster of short options: -m, -r3, -mr 3, -t=0:3
        while j < len(tok):
            flag = "-" + tok[j]
            if flag == "-h":
                raise HelpRequested(format_help())
            if flag not in BY_FLAG:
                raise UsageError(f"unrecognized option {flag} in {tok!r} (see `unicron run --help`)")
            opt = BY_FLAG[flag]
            if not opt.takes_value:
                _record(out, opt, True, flag)
                j += 1
                continue
            rest = tok[j + 1:].removeprefix("=")
            if not rest:
                rest = _take_value(argv, i, flag)
                i += 1
            _record(out, opt, rest, flag)
            break
    raise UsageError("missing the training script (usage: unicron run [OPTIONS] SCRIPT [SCRIPT_ARGS...])")


def format_help() -> str:
    parser = argparse.ArgumentParser(
        prog="unicron run",
        usage="unicron run [OPTIONS] SCRIPT [SCRIPT_ARGS...]",
        description="Launch a distributed PyTorch job: a drop-in replacement for torchrun that detects "
        "failures and hangs and heals the job.\nEverything after SCRIPT is passed to it untouched.\n"
        "Precedence: flag > environment (PET_* for torchrun options, UNICRON_* for unicron's) > "
        "Slurm (SLURM_*) > --config file > default. Every --a-b option is also accepted as --a_b.",
        add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-h", "--help", action="store_true", help="Show this help and exit.")
    groups = {g: parser.add_argument_group(g) for g in (TORCHRUN, UNICRON)}
    for opt in OPTIONS:
        notes = []
        if opt.takes_value and opt.default not in (None, "", (), "null"):
            notes.append(f"default: {opt.default}")
        if opt.envs:
            notes.append("env: " + ", ".join(opt.envs))
        text = (opt.help + (f" [{'; '.join(notes)}]" if notes else "")).replace("%", "%%")
        flags = [f for f in opt.flags if not f.startswith("--")] + [opt.name]  # no _ spellings: less noise
        if opt.takes_value:
            groups[opt.group].add_argument(*flags, dest=opt.dest, metavar=opt.metavar or "VALUE", help=text)
        else:
            groups[opt.group].add_argument(*flags, dest=opt.dest, action="store_true", help=text)
    parser.add_argument("script", metavar="SCRIPT",
                        help="Training script (a module with -m, an executable with --no-python).")
    parser.add_argument("script_args", metavar="SCRIPT_ARGS", nargs="*", help="Arguments of the script.")
    return parser.format_help() + (
        "\nThe job secret comes from --secret-file, else UNICRON_SECRET; a single-node job without one\n"
        "gets a random secret. See docs/cli.md for every difference from torchrun.\n"
    )


def register(app: typer.Typer) -> None:
    @app.command(
        "run",
        help="Launch a distributed job; takes torchrun's flags (see `unicron run --help`).",
        add_help_option=False,
        context_settings={
            "allow_extra_args": True,
            "ignore_unknown_options": True,
            "help_option_names": [],
            # Stop at the script, so click passes the script's own arguments through verbatim
            # (including any `--` among them).
            "allow_interspersed_args": False,
        },
    )
    def run(ctx: typer.Context) -> None:
        from unicron.launch.config import parse_run_args

        try:
            cfg = parse_run_args(list(ctx.args), os.environ)
        except HelpRequested as req:
            typer.echo(req.text, nl=False)
            raise SystemExit(0) from None
        from unicron.agent.main import run_job

        # SystemExit, not typer.Exit: with standalone_mode=False click turns Exit into a return
        # value, which callers may drop; SystemExit always carries the code out.
        raise SystemExit(run_job(cfg))
