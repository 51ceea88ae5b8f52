"""The broker between the processes: task and queue names and the producer that sends tasks
by name (``queue``), a question to the control worker that waits for its answer
(``request_reply``), and what ``/readyz`` checks a process can reach (``readiness``)."""
