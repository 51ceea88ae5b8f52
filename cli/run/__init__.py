"""``batchd run``: an OpenAI batch file through the engine in this process, no servers.

The service's line validation and output/error lines (``core.batchfile``), in input order.
Memory stays bounded: the input is read lazily, at most ``window`` requests are in flight, and
the only per-line state is the duplicate-custom_id scan's two 8-byte arrays. Results go to
``OUT.partial``/``ERR.partial``; each checkpoint fsyncs both and atomically replaces
``OUT.progress.json``, so a rerun (even after SIGKILL) resumes there and every request ends up
exactly once in OUT or ERR. In full: docs/api.md ("Offline: ``batchd run``").
"""

from cli.run.command import register, run
from cli.run.options import ModelLoadError, RunError, RunOptions, RunSummary
from cli.run.runner import run_batch_file

__all__ = [
    "ModelLoadError",
    "RunError",
    "RunOptions",
    "RunSummary",
    "register",
    "run",
    "run_batch_file",
]
