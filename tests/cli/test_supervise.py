"""The supervisor of ``batchd up`` on real processes: nothing its children started outlives it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A child that starts a grandchild, does not wait for it, and exits on SIGTERM; the grandchild
# lingers half a second after its parent is gone (as multiprocessing's resource tracker does
# after uvicorn's workers) or ignores SIGTERM for good.
CHILD = r"""
import os, signal, subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())])
open(sys.argv[2], "w").write(str(grandchild.pid))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
time.sleep(600)
"""
LINGERS = "import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + (
    "import sys\nwhile os.getppid() == int(sys.argv[1]): time.sleep(0.05)\ntime.sleep(0.5)"
)
STUCK = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(600)"

PROBE = r"""
import json, sys, time
from pathlib import Path
from cli.supervise import Supervisor
child, grandchild, pid_file, grace = sys.argv[1:5]
sup = Supervisor({"child": [sys.executable, "-c", child, grandchild, pid_file]},
                 echo=lambda _: None).start()
while not Path(pid_file).exists() or not Path(pid_file).read_text():
    time.sleep(0.05)
pid = int(Path(pid_file).read_text())
started = time.monotonic()
clean = sup.stop(grace_s=float(grace))
stat = Path(f"/proc/{pid}/stat")
alive = stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
print("RESULT " + json.dumps({"clean": clean, "alive": alive, "gone": not stat.exists(),
                              "waited": time.monotonic() - started}))
"""


def _run(grandchild: str, tmp_path: Path, grace_s: float) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, CHILD, grandchild, str(tmp_path / "pid"), str(grace_s)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_stop_waits_for_what_a_child_left_behind(tmp_path: Path) -> None:
    result = _run(LINGERS, tmp_path, grace_s=20)
    assert result["clean"] and result["gone"]  # ended and reaped
    assert result["waited"] >= 0.5  # it outlived its parent by half a second


def test_stop_kills_what_a_child_left_behind_past_the_grace(tmp_path: Path) -> None:
    result = _run(STUCK, tmp_path, grace_s=1)
    assert not result["clean"] and result["gone"]  # killed and reaped
