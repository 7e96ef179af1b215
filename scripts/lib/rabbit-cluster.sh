# A three-node RabbitMQ cluster on this machine, for the cluster trials
# (issue 40): nodes keyorder-c1@localhost, keyorder-c2@localhost and
# keyorder-c3@localhost, AMQP on 127.0.0.1:5681, 5682 and 5683 (Erlang
# distribution on 25681-25683), each with its data under
# /var/lib/keyorder-rabbitmq-cluster/cN, joined into one cluster. Quorum
# queues declared on it are replicated on all three nodes (RabbitMQ's
# default initial group size is the cluster's size).
#
# Sourced by scripts/services with --clusters (or KEYORDER_CLUSTERS=1),
# after the shared node: it uses that file's log, as_root, wait_for,
# rabbit_env_ulimit, rabbit_fd_limit and CONSUMER_TIMEOUT_MS. Idempotent: a
# node that answers AMQP is left running, and a node already in the cluster
# is not joined again; a node stopped by a node-loss trial is started again
# and rejoins by itself.

RCLUSTER_DIR=/var/lib/keyorder-rabbitmq-cluster
RCLUSTER_NODES="1 2 3"
rcluster_node() { echo "keyorder-c$1@localhost"; }
rcluster_port() { echo $((5680 + $1)); }
rcluster_env() { # rcluster_env N COMMAND...
  local n=$1; shift
  env RABBITMQ_NODENAME="$(rcluster_node "$n")" RABBITMQ_DIST_PORT=$((25680 + n)) \
    RABBITMQ_CONFIG_FILE="$RCLUSTER_DIR/c$n/rabbitmq.conf" RABBITMQ_MNESIA_BASE="$RCLUSTER_DIR/c$n/mnesia" \
    RABBITMQ_LOG_BASE="$RCLUSTER_DIR/c$n/log" RABBITMQ_PID_FILE="$RCLUSTER_DIR/c$n/node.pid" "$@"
}
rcluster_amqp_up() { # rcluster_amqp_up N
  timeout 10 bash -c "exec 3<>/dev/tcp/127.0.0.1/$(rcluster_port "$1") && printf 'AMQP\x00\x00\x09\x01' >&3 &&
    [ \"\$(head -c 1 <&3 | od -An -tx1 | tr -d ' ')\" = 01 ]" 2>/dev/null
}
rcluster_start() { # rcluster_start N: launches node N (the caller waits for it)
  local n=$1 dir="$RCLUSTER_DIR/c$1" pid
  # A VM whose application is stopped (`rabbitmqctl stop_app`, as C24 does)
  # still holds the node's name: start its application.
  if as_root rabbitmqctl -n "$(rcluster_node "$n")" -q ping >/dev/null 2>&1; then
    as_root rabbitmqctl -n "$(rcluster_node "$n")" -q start_app >&2 && return 0
  fi
  # Else the VM holding its distribution port goes (the node's name is in
  # its environment, not its command line: `pkill -f NAME` finds nothing).
  pid=$(ss -Hltnp "sport = :$((25680 + n))" 2>/dev/null | grep -o 'pid=[0-9]*' | head -n 1 | cut -d= -f2) || true
  if [ -n "$pid" ]; then
    as_root kill -9 "$pid" || true
    wait_for "RabbitMQ cluster node c$n's old VM to exit" 30 bash -c "! kill -0 $pid 2>/dev/null"
  fi
  as_root mkdir -p "$dir"
  as_root tee "$dir/rabbitmq.conf" >/dev/null <<CONF
listeners.tcp.local = 127.0.0.1:$(rcluster_port "$n")
consumer_timeout = $CONSUMER_TIMEOUT_MS
cluster_name = keyorder-cluster
CONF
  as_root chown -R rabbitmq:rabbitmq "$RCLUSTER_DIR"
  rabbit_env_ulimit
  (cd /tmp && as_root rcluster_env "$n" rabbitmq-server -detached >&2)
}
# The nodes c1 sees running in its cluster, one per line.
rcluster_running() {
  as_root rabbitmqctl -n "$(rcluster_node 1)" -q cluster_status --formatter json 2>/dev/null |
    python3 -c 'import json,sys; print("\n".join(json.load(sys.stdin).get("running_nodes", [])))'
}
# rcluster_member N: whether node N is in c1's cluster (running or not):
# 0 yes, 1 no, 2 c1 did not say (never read as "no": a "no" resets node N).
rcluster_member() {
  local status
  status=$(as_root rabbitmqctl -n "$(rcluster_node 1)" -q cluster_status --formatter json 2>/dev/null) || return 2
  python3 -c 'import json,sys
try: d=json.loads(sys.argv[2])
except ValueError: sys.exit(2)
sys.exit(0 if sys.argv[1] in d.get("disk_nodes", []) + d.get("ram_nodes", []) else 1)' \
    "$(rcluster_node "$1")" "$status"
}
# Every node that is down is launched before any is waited for: a node that
# was not the last of its cluster to stop (after a reboot, all of them) waits
# for its peers before it answers AMQP, so one started and waited for alone
# would never come up.
rcluster_launched=""
for n in $RCLUSTER_NODES; do
  if ! rcluster_amqp_up "$n"; then
    log "starting RabbitMQ cluster node $(rcluster_node "$n") on 127.0.0.1:$(rcluster_port "$n")"
    rcluster_start "$n"
    rcluster_launched="$rcluster_launched $n"
  fi
done
for n in $rcluster_launched; do
  wait_for "RabbitMQ cluster node c$n ($(rcluster_port "$n"))" 360 rcluster_amqp_up "$n"
done
for n in 2 3; do
  rcluster_is_member=0
  rcluster_member "$n" || rcluster_is_member=$?
  if [ "$rcluster_is_member" = 2 ]; then
    log "$(rcluster_node 1) did not report its cluster's members: not joining (or resetting) $(rcluster_node "$n")"
    exit 1
  fi
  if [ "$rcluster_is_member" = 1 ]; then
    log "joining $(rcluster_node "$n") to $(rcluster_node 1)'s cluster"
    as_root rabbitmqctl -n "$(rcluster_node "$n")" -q stop_app >&2
    as_root rabbitmqctl -n "$(rcluster_node "$n")" -q reset >&2
    as_root rabbitmqctl -n "$(rcluster_node "$n")" -q join_cluster "$(rcluster_node 1)" >&2
    as_root rabbitmqctl -n "$(rcluster_node "$n")" -q start_app >&2
    wait_for "RabbitMQ cluster node c$n to rejoin" 120 rcluster_amqp_up "$n"
  fi
done
rcluster_three() { [ "$(rcluster_running | grep -c .)" = 3 ]; }
wait_for "the RabbitMQ cluster's three nodes to run" 120 rcluster_three
for n in $RCLUSTER_NODES; do
  rabbit_consumer_timeout "$RCLUSTER_DIR/c$n/rabbitmq.conf" -n "$(rcluster_node "$n")"
  rabbit_fd_limit "$(rcluster_port "$n")" -n "$(rcluster_node "$n")"
done
