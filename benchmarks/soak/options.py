"""What one soak run does: its traffic, faults, invariants' bounds and servers."""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.soak.faults import FAULTS, UPSTREAM_FAULTS
from benchmarks.soak_hostile import HostileOptions


@dataclass
class Options:
    duration: float = 1800.0
    tenants: int = 4
    submit_every: float = 6.0
    max_lines: int = 24
    model_workers: int = 2
    embeddings: bool = True
    upstream: bool = True  # an upstream model, a real transformers serve, among the traffic
    short_window_share: float = 0.1
    short_windows: tuple[int, ...] = (2, 4, 8)
    cancel_share: float = 0.1
    webhook_share: float = 0.75
    webhook_flaky: float = 0.15
    faults: tuple[str, ...] = FAULTS
    fault_rounds: int = 0  # 0: one per 10 minutes
    fault_start: float = 0.0  # 0: 15% of the duration, at most 60 s
    outage_s: float = 6.0
    outage_grace_s: float = 15.0
    restart_delay_s: float = 1.0
    expiry_grace_s: float = 0.0  # 0: from the service's sweep and recovery settings
    drain_timeout_s: float = 600.0
    webhook_timeout_s: float = 180.0
    warmup_s: float = 0.0  # 0: a quarter of the duration, 60 to 300 s
    rss_interval_s: float = 5.0
    rss_window_s: float = 0.0  # 0: a twentieth of the duration, 15 to 60 s
    rss_tolerance_mib: float = 48.0
    rss_tolerance_pct: float = 10.0
    rss_report_only: bool = False
    poll_s: float = 2.0
    threads: int = 1
    seed: int = 0
    pg_admin_url: str = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    redis_url: str = "redis://127.0.0.1:6379/0"
    env: dict[str, str] = field(default_factory=dict)
    work_dir: str | None = None
    keep: bool = False
    hostile: bool = False  # one more tenant that abuses the service in alternate phases
    hostile_phases: int = 4  # the run cut in this many; the hostile tenant in every other one
    neighbour_tolerance: float = 2.0  # the hostile phases' median turnaround / the quiet ones'
    neighbour_min_samples: int = 3
    hostile_opts: HostileOptions = field(default_factory=HostileOptions)

    def resolve(self) -> Options:
        if not self.upstream:
            self.faults = tuple(f for f in self.faults if f not in UPSTREAM_FAULTS)
        if not self.fault_start:
            self.fault_start = min(60.0, 0.15 * self.duration)
        if not self.warmup_s:
            self.warmup_s = min(300.0, max(60.0, self.duration / 4))
        if not self.rss_window_s:
            self.rss_window_s = min(60.0, max(15.0, self.duration / 20))
        return self
