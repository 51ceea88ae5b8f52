"""Soak and chaos: the whole service under mixed traffic and scheduled faults, invariants checked.

Soak and chaos: the whole service under mixed traffic for a set time, with faults on a
schedule, its invariants checked all along and printed at the end.

    python -m benchmarks.soak --duration 1800              # 30 minutes, 3 rounds of faults
    python -m benchmarks.soak --duration 150 --json        # the report as JSON on stdout
    python -m benchmarks.soak --duration 600 --json soak.json --keep
    python -m benchmarks.soak --duration 600 --hostile     # and a hostile tenant beside them

The service runs for real: the API (uvicorn), a control worker, beat, model workers (the
tiny demo chat model and the minilm embedding model) and a dispatch worker (an upstream model:
a real ``transformers serve`` on SmolLM2-135M-Instruct behind a loopback TCP proxy;
``--no-upstream`` leaves it out) as ``python -m worker`` starts them, on a
fresh Postgres database and an empty Redis database number, each reached through a loopback
TCP proxy (testkit/proxies/tcp_proxy.py) so the soak can cut them off. Several tenants, each with a
key made by ``batchd keys create`` (entitled to ``high`` priority where keys carry
priorities), submit batches at random: chat, structured-output (json_schema) and embeddings
lines and chat lines for the upstream model, low/normal/high priority, most with a webhook to a loopback receiver (which answers
500 to the first attempt of some events), some with short completion windows that expire
mid-way, some cancelled a few seconds in, a few with a broken line that fails validation.

Faults, in rounds spread over the run (one round per 10 minutes): SIGKILL of a model worker
(the last one; the first stays up so one model worker's memory is watched for the whole
run), a Redis cut, SIGKILL of the control worker, a Postgres cut, an API restart
(SIGTERM), SIGKILL of the dispatch worker, and the upstream server cut off. Killed processes are started again after a second, as a supervisor would; any
process that exits on its own is restarted too and reported.

Invariants (exit 1 when one fails):

* lines: every batch that passed validation has exactly one output or error line per input
  line: none lost, none doubled, none unknown (its files are read when it ends);
* expiry: no batch is seen unfinished more than ``--expiry-grace`` seconds past its window;
* drained: after the traffic stops, every batch ends within ``--drain-timeout``;
* webhooks: every ended batch with a webhook had its event delivered (a 2xx) at least once,
  under one event id, of its status's type, correctly signed;
* rss: each process's RSS after its warm-up grows by at most ``max(--rss-tolerance-mib,
  --rss-tolerance-pct)`` (``--rss-report-only``: reported, not judged);
* http: no 5xx answer but 503, and 503 only during a Postgres or Redis cut (plus
  ``--outage-grace``).

The hostile tenant (``--hostile``, off by default: it costs a few MiB of uploads and some
control-worker time a minute, and its verdict needs a run of several minutes): one more tenant
with its own key that, in alternate phases of the run (``--hostile-phases``, default 4: active
in the 2nd and 4th quarter), uploads files of lines nested 2,000 levels deep and of a million
tiny ``a`` lines and cancels their batches at once, submits batches whose webhook goes to a
loopback receiver that answers one byte a second and never finishes, holds slow raw-socket
uploads open (headers, then a byte every few seconds), floods ``POST
/v1/batches/estimate`` with clients of which half disconnect early, sends 256 MiB bodies (made
as they are sent, chunked or announced by a ``Content-Length``) from 4 senders at once, without
a key to ``POST /v1/batches`` and ``POST /v1/messages/batches`` and with its key past the JSON
routes' limit to ``POST /v1/batches``, and goes past the Uploads API's bounds (parts past an
upload's declared bytes or past ``max_upload_parts``, which the soak sets to 50, parts after a
complete or a cancel) (``benchmarks.soak_hostile`` has the details). Its own batches are exempt
from the invariants above (they are made to fail or be cancelled); five more invariants judge
it and its effect:

* hostile: every hostile batch ended by the end of the drain; a cancelled one's output and
  error files hold at most ``min(its lines, max_requests_per_batch) + 1`` lines; none of its
  answers is a 5xx but 503; no trickled webhook attempt is held open by the service past
  ``webhook_timeout_s`` (plus 5 s). The slow uploads' fate (cut by the server or given up at
  the end of the phase) and Postgres's idle-in-transaction connections with them open are
  reported;
* large_bodies: every large body refused, answered 401 or 413 or its connection closed (one
  with the key may get 503 during a cut), never another answer or none; within 2 s of when the
  refusal was due (the request's start, or for a 413 counted as the body streams, when the
  client had sent past the limit; the p50 and max are reported); and never more than 64 MiB
  (what the sockets' buffers hold) sent past that limit before the answer;
* upload_bounds: each step of the upload abuser answered as it must: 400 for a part past the
  declared bytes or the parts bound, after a complete or a cancel, for a cancel after a
  complete and a complete after a cancel; 200 for the steps between (429, the tenant's upload
  slots taken by its slow uploads, is sent again; 503 only during a cut);
* api_memory: the API's RSS (sampled every second, with its high-water mark for the peaks
  between samples) while the large bodies are sent stays within 256 MiB of its RSS before they
  began, for each run of the API; the baseline, peak and high-water mark are reported;
* neighbours: the normal tenants' batches that completed, by the phase they were created in:
  the median turnaround (create to end) of those created in the hostile phases is at most
  ``--neighbour-tolerance`` (default 2) times that of those created in the quiet ones. A
  ratio within one run is the fair measure on a shared machine; the p90 ratio, each phase's
  median and faults, the medians by kind and the normal tenants' upload and create latencies
  are reported beside it.
"""

from benchmarks.soak.cli import main, parse_args
from benchmarks.soak.faults import FAULTS, OUTAGES, UPSTREAM_FAULTS, FaultEvent, Faults, fault_plan
from benchmarks.soak.invariants import judge
from benchmarks.soak.options import Options
from benchmarks.soak.report import print_report
from benchmarks.soak.run import run
from benchmarks.soak.traffic import SCHEMA, WORDS, Spec, Traffic, TrafficStats, make_spec

__all__ = [
    "FAULTS", "OUTAGES", "SCHEMA", "UPSTREAM_FAULTS", "WORDS", "FaultEvent", "Faults", "Options",
    "Spec", "Traffic", "TrafficStats", "fault_plan", "judge", "main", "make_spec", "parse_args",
    "print_report", "run",
]  # fmt: skip
