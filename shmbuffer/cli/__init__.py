"""``shmbuffer-daemon``, the command line: it launches the daemon and talks to it as a client.

:mod:`~shmbuffer.cli.parser` is the parser and ``main``; :mod:`~shmbuffer.cli.start` runs a
daemon, :mod:`~shmbuffer.cli.admin` talks to a running one, :mod:`~shmbuffer.cli.demo` runs a
daemon and its demo processes (:mod:`~shmbuffer.cli.demo_loops`), and
:mod:`~shmbuffer.cli.statusview` draws what ``status`` shows. Importing it stays light: ``status``
and ``stop`` answer without torch.
"""

from shmbuffer.cli import parser as _parser
from shmbuffer.cli.parser import *  # noqa: F403 (the parser's names, as listed there)

__all__ = _parser.__all__
