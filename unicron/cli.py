"""The `unicron` command. Each subsystem registers its own commands; this module only turns
errors into one line for the user and an exit code."""

from __future__ import annotations

import errno
import os
import resource
import sys

import typer

from unicron.errors import UnicronError

app = typer.Typer(
    name="unicron",
    help="A drop-in torchrun that makes distributed PyTorch training heal itself.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # torchrun's users type -h
)


def _version(value: bool) -> None:
    if value:
        from unicron import __version__

        typer.echo(f"unicron {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """A drop-in torchrun that makes distributed PyTorch training heal itself."""


# command -> the module that registers it (``register(app)``), in the order `--help` lists them
COMMANDS = {"run": "unicron.launch.commands", "coordinator": "unicron.coord.commands",
            "plan": "unicron.plan.commands", "simulate": "unicron.plan.commands",
            "status": "unicron.status.commands", "events": "unicron.status.commands"}


def _register(argv: list[str]) -> None:
    """Register the command ``argv`` names, or every command (help, a mistyped name). Imported
    here so that one broken subsystem names itself, and `unicron run` does not pay for the
    planner's imports (networkx, yaml) in every launcher."""
    import importlib

    first = next((a for a in argv if not a.startswith("-")), None)
    named = COMMANDS.get(first or "")
    for module in dict.fromkeys([named] if named else COMMANDS.values()):
        importlib.import_module(module).register(app)


def error_line(message: str) -> None:
    from unicron.consoleline import line_start
    from unicron.textclip import printable

    try:
        sys.stderr.write(f"{line_start()}unicron: error: {printable(message)}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # the console is gone (a closed terminal, a pipe whose reader left): the exit code says it


def main(argv: list[str] | None = None) -> int:
    try:
        args = sys.argv[1:] if argv is None else argv
        _register(args)
        rv = app(args=args, prog_name="unicron", standalone_mode=False)
    except UnicronError as err:
        error_line(str(err))
        return err.exit_code
    except SystemExit as exc:  # click exits through SystemExit in some paths
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        error_line("interrupted")
        return 130
    except Exception as exc:
        # typer vendors click (typer._click); match its exceptions by shape, not by import.
        code = getattr(exc, "exit_code", None)
        if type(exc).__name__ == "Exit" and isinstance(code, int):
            if isinstance(exc.__cause__, KeyboardInterrupt):  # typer's own Ctrl-C: Exit(130), silent
                error_line("interrupted")
            return code
        if hasattr(exc, "format_message") and isinstance(code, int):
            # No command at all: the help just printed says it (click's message is empty there).
            error_line(exc.format_message() or "missing command; see the commands above")
            return code
        if type(exc).__name__ == "Abort":
            error_line("aborted")
            return 130
        if os.environ.get("UNICRON_DEBUG"):
            raise
        if getattr(exc, "errno", None) == errno.EMFILE:  # an OSError, or ZeroMQ's own error
            limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            error_line(f"out of open files (the limit is {limit}: ulimit -n); raise it, or start fewer ranks per node")
            return 1
        error_line(f"internal error: {type(exc).__name__}: {exc} (set UNICRON_DEBUG=1 for the traceback)")
        return 70
    if rv == 130:  # typer turned a Ctrl-C into Exit(130), which standalone_mode=False returns
        error_line("interrupted")
    return rv if isinstance(rv, int) else 0

