"""Ending the ``memfit`` command's process without the interpreter's teardown.

After a trace, the interpreter's teardown frees every object of torch and the model's libraries one by one: 1.7-1.9 s
after a Swin-UNETR estimate with MONAI and transformers loaded, on a 2-core CPU
(benchmarks/results/estimate_time_static_fake_cpu_20261126.md). ``os._exit`` skips it, but also skips the ``atexit``
handlers (logging's flush, the user's own), so they are run first.

Python has no public way to run the ``atexit`` handlers early. Registering a handler of our own that calls
``os._exit`` would not do: handlers run last-registered first, so every handler registered before memfit's (logging's,
at its import) would be skipped. So this module calls CPython's private ``atexit._run_exitfuncs`` (present since
Python 3.0), the one private Python API memfit uses; on an interpreter without it the process ends normally,
slower but the same.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

__all__ = ["exit_now"]


def exit_now(code: int) -> NoReturn:
    """Flush the output, run the ``atexit`` handlers, then end the process with ``code``, skipping the teardown."""
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if run_exit_handlers is None:  # pragma: no cover - not CPython
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    run_exit_handlers()
    sys.stdout.flush()  # what the handlers printed
    sys.stderr.flush()
    os._exit(code)
