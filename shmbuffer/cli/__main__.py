"""``python -m shmbuffer.cli``: the same as ``shmbuffer-daemon``."""

import sys

from shmbuffer.cli.parser import main

sys.exit(main())
