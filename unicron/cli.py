"""The `unicron` command. Each subsystem registers its own commands; this module only turns
errors into one line for the user and an exit code."""

from __future__ import annotations

import os
import sys

import typer

from unicron.errors import UnicronError

app = typer.Typer(
    name="unicron",
    help="A drop-in torchrun that makes distributed PyTorch training heal itself.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
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


def _register_all() -> None:
    # Imported here so `unicron --help` stays fast and one broken subsystem names itself.
    from unicron.coord.commands import register as register_coordinator
    from unicron.launch.commands import register as register_run
    from unicron.plan.commands import register as register_plan
    from unicron.status.commands import register as register_status

    register_run(app)
    register_coordinator(app)
    register_plan(app)
    register_status(app)


def error_line(message: str) -> None:
    from unicron.textclip import printable

    try:
        sys.stderr.write(f"unicron: error: {printable(message)}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # the console is gone (a closed terminal, a pipe whose reader left): the exit code says it


def main(argv: list[str] | None = None) -> int:
    try:
        _register_all()
        rv = app(args=argv, prog_name="unicron", standalone_mode=False)
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
        error_line(f"internal error: {type(exc).__name__}: {exc} (set UNICRON_DEBUG=1 for the traceback)")
        return 70
    if rv == 130:  # typer turned a Ctrl-C into Exit(130), which standalone_mode=False returns
        error_line("interrupted")
    return rv if isinstance(rv, int) else 0

