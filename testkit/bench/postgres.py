"""A private Postgres server for one benchmark run, counting the service's statements.

``pg_stat_statements`` says how many statements and transactions the service ran, and which.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from cli.perf.service import free_port, wait_for
from cli.procfs import children

PG_BIN = Path("/usr/lib/postgresql")
BENCH_ROLE = "fleet_bench"  # the benchmark's own reads, left out of the counts


def _pg_bin() -> Path | None:
    versions = sorted(PG_BIN.glob("*/bin/initdb"), reverse=True)
    return versions[0].parent if versions else None


class PrivatePostgres:
    """A Postgres server of this run alone, on a free port, ``pg_stat_statements`` loaded;
    run as the ``postgres`` user when this process is root (``initdb`` refuses root)."""

    def __init__(self, root: Path):
        bindir = _pg_bin()
        if bindir is None:
            raise RuntimeError("initdb not found under /usr/lib/postgresql")
        self.dir = Path(tempfile.mkdtemp(prefix="batchd-pg-"))
        self.port = free_port()
        as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
            as_user = ["runuser", "-u", "postgres", "--"]
        data = self.dir / "data"
        subprocess.run(
            [*as_user, str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.proc = subprocess.Popen(
            [*as_user, str(bindir / "postgres"), "-D", str(data), "-p", str(self.port),
             "-k", str(self.dir), "-c", "listen_addresses=127.0.0.1",
             "-c", "shared_preload_libraries=pg_stat_statements",
             "-c", "pg_stat_statements.track=top", "-c", "max_connections=300",
             "-c", "shared_buffers=256MB"],
            stdout=(root / "postgres.log").open("wb"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        self.admin_url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        wait_for(self._up, 30, "the private Postgres")
        self.sql(f"CREATE EXTENSION pg_stat_statements; CREATE ROLE {BENCH_ROLE} LOGIN")

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError("the private Postgres exited")
        try:
            self.sql("SELECT 1")
            return True
        except Exception:
            return False

    def sql(self, sql: str, db: str = "postgres") -> list[tuple]:
        """Run ``sql`` in ``db`` as the superuser; its rows (none for a statement)."""
        import psycopg

        conninfo = f"host=127.0.0.1 port={self.port} user=postgres dbname={db}"
        with psycopg.connect(conninfo, autocommit=True) as conn:
            cur = conn.execute(sql)
            return cur.fetchall() if cur.description else []

    def postmaster_pid(self) -> int:
        """The postmaster (under ``runuser`` it is the runuser process's child)."""
        pid = self.proc.pid
        kids = children(pid)
        return (
            kids[0] if kids and Path(f"/proc/{pid}/comm").read_text().strip() == "runuser" else pid
        )

    def pids(self) -> list[int]:
        master = self.postmaster_pid()
        return [master, *children(master)]

    def statements(self, db: str) -> tuple[int, int]:
        """(statements, transactions) run in ``db`` so far by roles other than the bench's."""
        calls = self.sql(
            "SELECT coalesce(sum(s.calls), 0) FROM pg_stat_statements s "
            "JOIN pg_database d ON d.oid = s.dbid JOIN pg_roles r ON r.oid = s.userid "
            f"WHERE d.datname = '{db}' AND r.rolname <> '{BENCH_ROLE}'"
        )[0][0]
        xacts = self.sql(
            f"SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = '{db}'"
        )[0][0]
        return int(calls), int(xacts)

    def top_statements(self, db: str, n: int = 12) -> list[tuple[int, str]]:
        """The ``n`` statements run most often in ``db`` (calls, text), the bench's left out."""
        rows = self.sql(
            "SELECT s.calls, regexp_replace(s.query, '\\s+', ' ', 'g') FROM pg_stat_statements s "
            "JOIN pg_database d ON d.oid = s.dbid JOIN pg_roles r ON r.oid = s.userid "
            f"WHERE d.datname = '{db}' AND r.rolname <> '{BENCH_ROLE}' "
            f"ORDER BY s.calls DESC LIMIT {n}"
        )
        return [(int(calls), query[:150]) for calls, query in rows]

    def reset_statements(self) -> None:
        self.sql("SELECT pg_stat_statements_reset()")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
