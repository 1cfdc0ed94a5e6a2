"""``python -m kinfer.ops.cli``: the ``kinfer`` command."""

import contextlib
import sys

from kinfer.ops.cli import main

with contextlib.suppress(BrokenPipeError):
    sys.exit(main())
