# Shared by tests/cluster/slurm.sh and s3.sh (sourced).

alive() {  # alive PIDFILE: the recorded process exists and is no zombie (a killed daemon can linger as one)
  local pid state
  [ -s "$1" ] || return 1
  pid="$(tr -dc 0-9 <"$1")"
  [ -n "$pid" ] && [ -r "/proc/$pid/stat" ] || return 1
  state="$(sed 's/^.*) //' "/proc/$pid/stat" | cut -d' ' -f1)"
  [ "$state" != Z ]
}

wait_for() {  # wait_for SECONDS WHAT CMD...: poll CMD until it succeeds
  local until=$((SECONDS + $1)) what="$2"
  shift 2
  until "$@" >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$until" ]; then
      log "timed out waiting for $what (logs in $DIR/log)"
      return 1
    fi
    sleep 0.2
  done
}

stop_pidfile() {  # stop_pidfile PIDFILE: TERM the recorded process, KILL it after 10 s; never by name
  local pid
  if alive "$1"; then
    pid="$(tr -dc 0-9 <"$1")"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do alive "$1" || break; sleep 0.2; done
    if alive "$1"; then kill -KILL "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$1"
}

install_missing() {  # install_missing "CMD ..." PKG ...: apt-get install PKGs (as root) when a CMD is missing
  local cmds="$1" missing=() cmd
  shift
  for cmd in $cmds; do command -v "$cmd" >/dev/null || missing+=("$cmd"); done
  [ "${#missing[@]}" = 0 ] && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    log "missing ${missing[*]}; installing needs root and apt-get"
    return 3
  fi
  log "installing $*"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@") \
    >"$DIR/log/apt.log" 2>&1 || {
    log "apt-get install failed: $DIR/log/apt.log"
    return 3
  }
}
