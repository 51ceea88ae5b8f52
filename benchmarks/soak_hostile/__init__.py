"""The hostile tenant of ``benchmarks.soak --hostile``: abuse beside the normal tenants.

The hostile tenant of ``benchmarks.soak --hostile``: one more tenant, with its own key, that
abuses the service in alternate phases of the run (:class:`Phases`: by default the 2nd and 4th
quarter) while the normal tenants go on as usual, so that their batches' turnaround can be
compared between phases of one run (``soak_checks.neighbour_invariant``). While active it
loops over:

* nested lines: a file with request lines nested ``nested_depth`` levels deep (arrays,
  objects, a request whose body is nested) among good lines, in the head or after it; the
  batch is created and cancelled at once;
* amplification: ``amplify_mib`` of ``a`` lines (each one a line the service must answer for)
  after a head of good lines, created and cancelled at once: the cancel reports the lines never
  validated, at most ``max_requests_per_batch`` of them and then one line naming the limit;
* a small batch that runs; every one of its batches has its webhook go to
  :class:`TrickleReceiver`, a loopback server that reads the event and then answers one byte a
  second, never finishing (in quiet phases it answers 200 at once, so the deliveries the
  hostile phase left retrying end);
* slow uploads: ``slow_uploads`` raw-socket ``POST /v1/files`` that send the headers and then
  one byte every ``trickle_every_s``, for the whole phase unless the server cuts them first;
* estimate floods: ``estimates`` concurrent ``POST /v1/batches/estimate`` on a file of
  ``estimate_lines`` lines every ``estimate_every_s``, half of them from clients that give up
  after half a second;
* large bodies: ``body_senders`` raw-socket senders, each every ``body_every_s`` one of
  :data:`BODY_PLANS` in turn: ``body_mib`` of body made as it is sent (chunked, or announced by
  a ``Content-Length``), without a key to ``POST /v1/batches`` and ``POST
  /v1/messages/batches`` (401 before a byte of it is read) and with the hostile key to ``POST
  /v1/batches`` (413: at once on the ``Content-Length``, at the route's limit when chunked).
  A sender reads between pieces and stops at the answer or the close; each attempt's status,
  the bytes it got sent and when the answer came are recorded (:class:`BodyAttempt`), and
  :class:`ApiMemory` samples the API's RSS and high-water mark every second meanwhile;
* upload bounds: every ``upload_every_s``, an upload of 1,024 bytes and one of 1 byte, each
  sent parts past its declared bytes, then completed or cancelled and sent a part (and a
  cancel or complete) after; once a phase, one past the parts bound (``upload_parts``, the
  ``max_upload_parts`` the soak sets). Each step's answer is recorded against
  :data:`UPLOAD_EXPECT`.

Its batches are tracked apart (:class:`HostileTracker`): they are designed to fail or to be
cancelled, so the normal invariants do not apply, but each must end, and a cancelled one's
output and error files together hold at most ``min(lines, max_requests_per_batch) + 1``
lines. Its API answers are logged apart too: a 500 among them is a failure, the rest is
reported. The large bodies, the upload steps and the API's memory are judged by
:func:`large_body_invariant`, :func:`upload_abuse_invariant` and
:func:`api_memory_invariant`."""

from benchmarks.soak_hostile.bodies import (
    BODY_PLANS,
    MIB,
    BodyAttempt,
    BodyPlan,
    SlowUpload,
    send_large_body,
    slow_upload,
)
from benchmarks.soak_hostile.files import (
    CHAT,
    amplifying_file,
    estimate_file,
    nested_file,
    nested_lines,
)
from benchmarks.soak_hostile.invariants import (
    api_memory_invariant,
    hostile_invariant,
    large_body_invariant,
    upload_abuse_invariant,
)
from benchmarks.soak_hostile.phases import Phase, Phases
from benchmarks.soak_hostile.tenant import HOSTILE, HostileOptions, HostileStats, HostileTenant
from benchmarks.soak_hostile.trickle import Trickle, TrickleReceiver
from benchmarks.soak_hostile.uploads import UPLOAD_EXPECT, UploadAnswer
from benchmarks.soak_hostile.watch import ApiMemory, HostileTracker, MemorySample, PgSampler

__all__ = [
    "BODY_PLANS", "CHAT", "HOSTILE", "MIB", "UPLOAD_EXPECT", "ApiMemory", "BodyAttempt", "BodyPlan",
    "HostileOptions", "HostileStats", "HostileTenant", "HostileTracker", "MemorySample",
    "PgSampler", "Phase", "Phases", "SlowUpload", "Trickle", "TrickleReceiver", "UploadAnswer",
    "amplifying_file", "api_memory_invariant", "estimate_file", "hostile_invariant",
    "large_body_invariant", "nested_file", "nested_lines", "send_large_body", "slow_upload",
    "upload_abuse_invariant",
]  # fmt: skip
