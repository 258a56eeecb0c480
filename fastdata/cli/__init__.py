"""The ``fastdata`` command: a thin shell over the library. Only this package prints.

``app`` holds the command group, its one error funnel and the shared options; ``write`` the
commands that write a store, ``read`` those that read one; ``advice`` what ``verify`` advises
for a damaged store.
"""

from __future__ import annotations

import sys

from . import read, write  # the commands register themselves on the group
from .app import cli, silence_stdout

__all__ = ["cli", "main", "read", "write"]


def main() -> None:
    """Console-script entry point."""
    try:
        cli()
    finally:
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            silence_stdout()


if __name__ == "__main__":  # pragma: no cover
    main()
