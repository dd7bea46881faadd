"""The ``unicron`` console script's entry point.

It only imports the CLI inside a handler: the imports take most of a second (typer, rich,
networkx, numpy), and a Ctrl-C in that window would otherwise end in a traceback instead of
the one line every other interruption gets.
"""

from __future__ import annotations

import sys


def entrypoint() -> None:
    try:
        from unicron.cli import main
    except KeyboardInterrupt:
        sys.stderr.write("unicron: error: interrupted\n")
        sys.stderr.flush()
        sys.exit(130)
    sys.exit(main())
