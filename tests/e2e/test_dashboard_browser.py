"""The dashboard (/ui) in a real headless browser (Debian's chromium, driven by Selenium through
chromium-driver) against a real service running a real batch: the page loads, the running
batch's progress bar advances without a reload, the model panel shows the engine, a second
tenant does not see the first one's batch, and an admin key sees every tenant's.

``BATCHD_UI_SCREENSHOT=<path.png>`` saves a screenshot of the dashboard mid-run
(docs/dashboard.png, the picture in the README and docs/operations.md, is made that way)."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from cli.perf.service import free_port, wait_for
from testkit.builders.lines import MODEL, chat_line, create_batch
from testkit.engine_gate import ENV as GATE_ENV
from testkit.engine_gate import MODEL_WORKER_GATE, FileGate
from testkit.service.stack import API_KEY, Procs, api_command, stack_env
from testkit.service.stack import celery_command as celery

pytestmark = [pytest.mark.services, pytest.mark.slow]

ADMIN_KEY = "sk-e2e-admin-key"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def _browser():
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip(
            "chromium and chromium-driver are not installed (scripts/test.sh installs them)"
        )
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000", "--no-first-run", "--disable-extensions"):  # fmt: skip
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def _sign_in(driver, base: str, key: str) -> None:
    from selenium.webdriver.common.by import By

    driver.delete_all_cookies()
    driver.get(f"{base}/ui")
    driver.find_element(By.ID, "key").send_keys(key)
    driver.find_element(By.ID, "sign-in").click()
    wait_for(lambda: driver.find_elements(By.ID, "batches"), 20, "the dashboard")


def _progress(driver, batch_id: str) -> float | None:
    from selenium.webdriver.common.by import By

    rows = driver.find_elements(By.ID, f"batch-{batch_id}")
    if not rows:
        return None
    return float(rows[0].find_element(By.CLASS_NAME, "pct").text.rstrip("%"))


def test_dashboard_in_a_browser(pg_url, private_broker, tmp_path, procs: Procs):
    import httpx

    from core.database.auth import create_key
    from core.database.sessions import session_scope

    driver = _browser()
    try:
        with session_scope(pg_url) as session:
            _row, other_key = create_key(session, "globex", "dashboard test")
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        env = stack_env(
            pg_url,
            private_broker,
            tmp_path,
            BATCHD_ADMIN_API_KEYS=ADMIN_KEY,
            BATCHD_CHECKPOINT_EVERY="2",
            BATCHD_CHECKPOINT_INTERVAL_S="0.5",
            BATCHD_SHARD_MAX_REQUESTS="8",
            BATCHD_WORKER_SHARD_CONCURRENCY="2",
            BATCHD_ENGINE_OPTIONS=json.dumps({"max_num_seqs": 2, "admission": "fcfs"}),
            BATCHD_RELEASE_SWEEP_INTERVAL_S="1",
            BATCHD_UI_SAMPLE_INTERVAL_S="1",
            **{GATE_ENV: str(tmp_path / "gates")},
        )
        procs.start("api", api_command(port), env)
        procs.start("control", celery("control", "control", tmp_path), env)
        procs.start("beat", celery("beat", "beat", tmp_path), env)
        procs.start("model", [*celery("model", "model", tmp_path), *MODEL_WORKER_GATE], env)
        procs.wait_log("model", f"model {MODEL} ready", 120)

        # Signed out: the page asks for a key; a wrong key is refused.
        driver.get(f"{base}/ui")
        assert driver.find_elements("id", "key")
        assert httpx.get(f"{base}/ui/data").status_code == 401

        client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {API_KEY}"})
        # The batch advances in stages, however fast the machine: every 16th line holds the
        # engine (testkit.engine_gate) until the page has shown the progress so far.
        gates = [FileGate(tmp_path / "gates", f"dashboard_{k}") for k in range(4)]
        texts = [f"a long dashboard story {i}" for i in range(64)]
        for k, gate in enumerate(gates):
            gate.close()
            texts[16 * k + 15] = f"a dashboard story {gate.marker}"
        data = b"".join(
            json.dumps(chat_line(f"d{i:02d}", text, 16, ignore_eos=True)).encode() + b"\n"
            for i, text in enumerate(texts)
        )
        batch_id = create_batch(client, data)

        _sign_in(driver, base, API_KEY)
        wait_for(lambda: _progress(driver, batch_id) is not None, 30, "the batch row", procs.logs)
        # The bar advances in place (the page polls; it is never reloaded).
        seen: list[float] = []

        def advanced() -> bool:
            value = _progress(driver, batch_id)
            if value and value not in seen:  # shown: let the batch go on to its next stage
                next((g for g in gates if g.path.exists()), gates[-1]).open()
            seen.append(value or 0.0)
            return value is not None and value > 0 and len(set(seen)) >= 3

        wait_for(advanced, 120, "the progress bar to advance", procs.logs)
        for gate in gates:
            gate.open()
        assert seen == sorted(seen), seen
        # The model panel: workers, occupancy, KV, tokens/s, with its charts.
        from selenium.webdriver.common.by import By

        wait_for(
            lambda: driver.find_elements(By.CSS_SELECTOR, ".model .occupancy-now"),
            30,
            "the model panel",
            tmp_path,
        )
        occupancy = driver.find_element(By.CSS_SELECTOR, ".model .occupancy-now b").text
        assert occupancy.endswith("/ 2"), occupancy
        assert driver.find_elements(By.CSS_SELECTOR, "#throughput-chart canvas")
        time.sleep(3)  # a few more samples for the charts
        shot = os.environ.get("BATCHD_UI_SCREENSHOT")
        if shot:
            driver.save_screenshot(shot)

        # Another tenant sees none of it, in the page or in its data.
        _sign_in(driver, base, other_key)
        time.sleep(2)
        assert _progress(driver, batch_id) is None
        assert batch_id not in driver.page_source
        other = httpx.get(f"{base}/ui/data", headers={"Authorization": f"Bearer {other_key}"})
        assert other.status_code == 200
        assert [b["id"] for b in other.json()["batches"]] == []

        # An admin key sees every tenant's batches, with the tenant named.
        _sign_in(driver, base, ADMIN_KEY)
        wait_for(lambda: _progress(driver, batch_id) is not None, 20, "the admin view")
        row = driver.find_element(By.ID, f"batch-{batch_id}")
        assert row.find_element(By.CLASS_NAME, "tenant").text == "default"

        wait_for(
            lambda: client.get(f"/v1/batches/{batch_id}").json()["status"] == "completed",
            240,
            "the batch to complete",
            tmp_path,
        )
        wait_for(lambda: _progress(driver, batch_id) == 100.0, 20, "100% on the page")
    finally:
        driver.quit()
