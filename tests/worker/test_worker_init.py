"""A worker imports what its tasks import lazily before any task thread runs: transformers'
lazy module is not safe for concurrent first imports (``cannot import name 'AutoTokenizer'
from 'transformers'`` when a validate and the engine load import at once). Each check runs in
a fresh interpreter, where nothing has imported transformers yet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Builds the worker as ``celery worker -Q batchd.control --pool threads`` does (its init path,
# worker_init included, without consuming), then loads tokenizers, configs and the model from
# many threads released at once.
PROBE = r"""
import json, sys, threading
from worker.infra.celery import TRANSFORMERS_NAMES, app

before = "transformers" in sys.modules
app.Worker(queues=["batchd.control"], pool="threads", concurrency=2, hostname="probe@init",
           without_mingle=True, without_gossip=True, without_heartbeat=True)
import transformers

resolved = [n for n in TRANSFORMERS_NAMES if n in vars(transformers)]
engine_imported = "engine.text.tokenizer" in sys.modules and "engine.host.host" in sys.modules

from engine.text.tokenizer import load_tokenizer
from worker.infra import runtime

path = sys.argv[1]
threads, errors, tokenizers = 16, [], []
start = threading.Barrier(threads)

def job(i):
    try:
        start.wait()
        if i % 4 == 0:
            tokenizers.append(load_tokenizer(path))
        elif i % 4 == 1:
            from transformers import AutoConfig
            AutoConfig.from_pretrained(path)
            tokenizers.append(runtime.tokenizer("batchd-demo"))
        elif i % 4 == 2:
            from transformers import AutoModelForCausalLM
            AutoModelForCausalLM.from_pretrained(path)
        else:  # as the embedding engine loads its encoder
            from transformers import AutoModel
            AutoModel.from_pretrained(path)
    except Exception as exc:
        errors.append(repr(exc))

workers = [threading.Thread(target=job, args=(i,)) for i in range(threads)]
for t in workers:
    t.start()
for t in workers:
    t.join()
encoded = {tuple(tok("hello world")["input_ids"]) for tok in tokenizers}
print("RESULT " + json.dumps({"before": before, "resolved": resolved,
    "engine_imported": engine_imported, "errors": errors,
    "tokenizers": len(tokenizers), "encodings": len(encoded)}))
"""


def test_worker_init_imports_transformers_then_threads_load_tokenizers_at_once(tmp_path, redis_url):
    from core.llms.demo import build

    path = build("llama-tiny")
    env = {
        **os.environ,
        "BATCHD_HOME": str(tmp_path),
        "BATCHD_BROKER_URL": redis_url,
        "BATCHD_MODELS": json.dumps({"batchd-demo": str(path)}),
    }
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["errors"] == []
    assert result["before"] is False, "importing the Celery app must not import transformers"
    assert result["resolved"] == [
        "AutoConfig", "AutoTokenizer", "AutoModelForCausalLM", "AutoModel"
    ]  # fmt: skip
    assert result["engine_imported"]
    assert result["tokenizers"] == 8 and result["encodings"] == 1
