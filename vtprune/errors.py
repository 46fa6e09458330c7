"""The error type for bad user input (a value, a file, an option), reported by the CLI as one line.

:class:`UserError` subclasses ``ValueError``, so code that catches ``ValueError`` keeps working. The command
line (:func:`vtprune.cli.main`) prints ``vtprune: error: <message>`` and exits with status 2 for it (and for
the ``ValueError`` / file errors that the library raises for bad options); anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations


class UserError(ValueError):
    """Something the user gave is unusable; the message names the value and what to do instead."""


def install_extra(extra: str) -> str:
    """The command that installs an optional part from a clone, e.g. ``pip install -c constraints.txt -e ".[demo]"``.

    vtprune is installed from its repository, not from a package index: the extra is named on the clone's path.
    """
    return f'pip install -c constraints.txt -e ".[{extra}]" (in the vtprune clone)'
