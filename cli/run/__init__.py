"""``batchd run``: an OpenAI batch file through the engine in this process, no servers.

The same line validation as the service (:mod:`core.batchfile.reader`) and the same output and
error lines (:mod:`core.batchfile.results`), in input order. Memory stays bounded whatever the
file's size:

* the input is read lazily, one line at a time (:func:`core.batchfile.reader.iter_lines`);
* at most ``window`` requests are in flight (tokenised, in the engine, or finished but waiting
  for an earlier line) — a bounded reorder buffer in front of the output files;
* the only per-line state is the validation scan's two 8-byte arrays (custom_id hashes and
  line numbers) used to find duplicate custom_ids before anything runs.

Resuming: results go to ``OUT.partial`` and ``ERR.partial`` in input order. Every checkpoint
(``--checkpoint-every`` requests, or ``--checkpoint-interval`` seconds) flushes and fsyncs both,
then atomically replaces ``OUT.progress.json`` with the next input line, its byte offset and the
byte sizes of both partial files. A run that finds a progress file for the same input and
options truncates the partial files to the recorded sizes, seeks the input to the recorded
offset and carries on: even after SIGKILL nothing before the last checkpoint is recomputed and
every request ends up exactly once in OUT or ERR. At the end the partial files are renamed into
place and the progress file is removed.
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
