# Helpers to start the local Postgres and Redis the tests need when they are not running.
# Sourced by scripts/test.sh.

_port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

ensure_postgres() {
  _port_open 5432 && return 0
  echo "Postgres is not running on 127.0.0.1:5432; trying to start it" >&2
  if command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
  elif command -v docker >/dev/null 2>&1; then
    docker run -d --rm --name batchd-test-pg -p 5432:5432 -e POSTGRES_HOST_AUTH_METHOD=trust postgres:16 || true
  fi
  for _ in $(seq 1 30); do _port_open 5432 && return 0; sleep 1; done
  echo "error: Postgres is needed on 127.0.0.1:5432 (trust auth for user postgres)" >&2
  exit 1
}

ensure_redis() {
  _port_open 6379 && return 0
  echo "Redis is not running on 127.0.0.1:6379; trying to start it" >&2
  if command -v redis-server >/dev/null 2>&1; then
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no || true
  elif command -v docker >/dev/null 2>&1; then
    docker run -d --rm --name batchd-test-redis -p 6379:6379 redis:7 || true
  fi
  for _ in $(seq 1 30); do _port_open 6379 && return 0; sleep 1; done
  echo "error: Redis is needed on 127.0.0.1:6379" >&2
  exit 1
}

# The dashboard's browser test drives Debian's chromium through chromium-driver (browser builds
# cannot be downloaded by Selenium or Playwright here). Installed with apt when missing; the
# test skips only when that is impossible (no apt, no root).
ensure_chromium() {
  command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 && return 0
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="$(command -v sudo || true)"
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" -eq 0 ] || [ -n "$sudo" ]; }; then
    echo "installing chromium and chromium-driver (the dashboard's browser test)" >&2
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      chromium chromium-driver >/dev/null \
      || { $sudo apt-get update -qq >/dev/null && $sudo env DEBIAN_FRONTEND=noninteractive \
             apt-get install -y --no-install-recommends chromium chromium-driver >/dev/null; } \
      || echo "warning: could not install chromium; the browser test will be skipped" >&2
  else
    echo "warning: chromium is missing and apt-get is unavailable; the browser test will be skipped" >&2
  fi
}
