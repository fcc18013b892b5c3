#!/usr/bin/env bash
# local_cluster.sh - a REAL single-node SLURM cluster (munged, MariaDB + slurmdbd, slurmctld, slurmd) on a Debian
# bookworm machine, for the dispatch tests (tests/test_dispatch_slurm.py starts and stops it). Adapted from
# ../shared/slurm/start-local-slurm.sh (its README lists what was found making it work).
#
#   usage: [SLURM_LOCAL_NODES=N] bash tests/slurm/local_cluster.sh [start|stop|status]      (default: start)
#
# start: installs Debian's slurm-wlm packages, munge and MariaDB if missing (apt), writes /etc/slurm/*.conf for
# localhost, starts the daemons that are not running (no systemd; state under $SLURM_LOCAL_ROOT), waits until the
# nodes are idle and runs one `sbatch --wait` smoke job over all of them. Needs root, no stdin.
# stop: ends only the daemons whose pid files this script manages (by pid, never by name).
#
# SLURM_LOCAL_NODES=N (default 1): N > 1 runs N slurmd daemons on this host, one per node (arl-node1..N, each on its
# own port; Debian's slurm-wlm is built with multiple-slurmd support), all at 127.0.0.1: a real N-node cluster for
# multi-node jobs (tests/test_verl_ray_slurm.py). Their names are added to /etc/hosts while it runs.
#
# Accounting stays on: without slurmdbd, submitit's `sacct` reads every state as UNKNOWN and a job killed from
# outside makes a waiting sweep hang. AuthInfo=cred_expire=10 lets a requeued job start again after 11 s (not 121 s).
set -euo pipefail

ROOT=${SLURM_LOCAL_ROOT:-/tmp/arl-slurm}
PARTITION=debug
NODES=${SLURM_LOCAL_NODES:-1}
HOSTS_TAG="# tests/slurm/local_cluster.sh"   # marks the /etc/hosts line that names the nodes (N > 1)
CONF=/etc/slurm/slurm.conf
DBDCONF=/etc/slurm/slurmdbd.conf
DBPASS=slurmdbpass   # local-only MariaDB account (bound to 127.0.0.1 / unix socket)
RUN=$ROOT/run
LOG=$ROOT/log
MYSQL_RUN=$RUN/mysql           # owned by mysql: mariadbd writes its pid file here
MUNGE_PID=/run/munge/munged.pid

log() { printf '[local-slurm %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1fs", b-a}'; }

pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
wait_pidfile() { local i; for i in $(seq 100); do pid_alive "$1" && return 0; sleep 0.1; done; return 1; }

stop_pidfile() {  # stop_pidfile NAME PIDFILE : SIGTERM the recorded pid, wait, SIGKILL after 20 s
  local name=$1 pf=$2 pid i
  pid_alive "$pf" || { rm -f "$pf"; return 0; }
  pid=$(cat "$pf")
  log "stopping $name (pid $pid)"
  kill "$pid" 2>/dev/null || true
  for i in $(seq 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then log "$name did not exit, SIGKILL"; kill -9 "$pid" 2>/dev/null || true; fi
  rm -f "$pf"
}

install_packages() {
  local pkgs=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server) missing=0
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null && command -v slurmdbd >/dev/null && command -v mariadbd >/dev/null || missing=1
  [[ $missing == 0 ]] && { log "packages already installed"; return 0; }
  local t0; t0=$(now)
  log "installing ${pkgs[*]} (apt)"
  export DEBIAN_FRONTEND=noninteractive
  local aptopts=(-o DPkg::Lock::Timeout=600 -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
  apt-get "${aptopts[@]}" update -qq </dev/null >"$LOG/apt.log" 2>&1 || { tail -20 "$LOG/apt.log"; die "apt-get update failed"; }
  apt-get "${aptopts[@]}" install -y -qq --no-install-recommends "${pkgs[@]}" </dev/null >>"$LOG/apt.log" 2>&1 \
    || { tail -30 "$LOG/apt.log"; die "apt-get install failed"; }
  log "packages installed in $(since "$t0")"
}

ensure_host() {  # sets HOST and NODE_NAMES; N > 1: the node names resolve to 127.0.0.1 (as a node's name does)
  HOST=$(hostname -s)
  if ! getent hosts "$HOST" >/dev/null; then
    log "hostname $HOST does not resolve; adding it to /etc/hosts"
    echo "127.0.0.1 $HOST" >>/etc/hosts
  fi
  [[ $NODES =~ ^[1-9][0-9]*$ ]] || die "SLURM_LOCAL_NODES must be a positive number, not '$NODES'"
  if [[ $NODES == 1 ]]; then NODE_NAMES=("$HOST"); remove_node_names; return 0; fi
  NODE_NAMES=()
  local i line; for i in $(seq "$NODES"); do NODE_NAMES+=("arl-node$i"); done
  line="127.0.0.1 ${NODE_NAMES[*]} $HOSTS_TAG"
  grep -qxF "$line" /etc/hosts && return 0
  remove_node_names
  echo "$line" >>/etc/hosts
}

remove_node_names() {  # rewrites /etc/hosts in place (it may be a bind mount, which a rename would not replace)
  grep -q "$HOSTS_TAG" /etc/hosts || return 0
  local kept; kept=$(grep -v "$HOSTS_TAG" /etc/hosts)
  printf '%s\n' "$kept" >/etc/hosts
}

node_list() {  # arl-node[1-N], or this host
  if [[ $NODES == 1 ]]; then echo "$HOST"; else echo "arl-node[1-$NODES]"; fi
}

slurmd_pidfiles() { compgen -G "$RUN/slurmd*.pid" || true; }

ensure_munge_key() {
  if [[ ! -s /etc/munge/munge.key ]]; then
    log "creating munge key"
    install -d -o munge -g munge -m 0700 /etc/munge
    mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
      || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
}

write_config() {  # writes slurm.conf and slurmdbd.conf; sets CONFIG_CHANGED=1 if anything changed
  local node_hw tmp ports=""
  node_hw=$(slurmd -C | head -1)                       # NodeName=<h> CPUs=.. Boards=.. ... RealMemory=..
  [[ $node_hw == NodeName=* ]] || die "slurmd -C failed: $node_hw"
  node_hw=${node_hw#NodeName=* }                       # drop NodeName=..., keep the hardware fields
  # N > 1: one slurmd per node on this host, each on its own port (6821..)
  [[ $NODES == 1 ]] || ports="NodeHostname=$HOST Port=[6821-$((6820 + NODES))] "
  tmp=$(mktemp)
  cat >"$tmp" <<EOF
# generated by tests/slurm/local_cluster.sh - local test cluster of $NODES node(s) on this host
ClusterName=local
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# requeued jobs become eligible cred_expire+1 s after requeue (default 120 s); needs slurmctld restart
AuthInfo=cred_expire=10
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$ROOT/state/ctld
SlurmdSpoolDir=$ROOT/state/d/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
# no cgroups: plain process tracking, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG/jobcomp.log
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=5
MinJobAge=300
NodeName=$(node_list) NodeAddr=127.0.0.1 $ports$node_hw State=UNKNOWN
PartitionName=$PARTITION Nodes=$(node_list) Default=YES MaxTime=INFINITE State=UP
EOF
  CONFIG_CHANGED=0
  install -d -m 0755 /etc/slurm
  if ! cmp -s "$tmp" "$CONF"; then install -m 0644 "$tmp" "$CONF"; CONFIG_CHANGED=1; log "wrote $CONF"; fi
  cat >"$tmp" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DBPASS
StorageLoc=slurm_acct_db
LogFile=$LOG/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
EOF
  if ! cmp -s "$tmp" "$DBDCONF"; then install -m 0600 "$tmp" "$DBDCONF"; CONFIG_CHANGED=1; log "wrote $DBDCONF"; fi
  rm -f "$tmp"
}

start_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then log "munged already running"; return 0; fi
  install -d -o munge -g munge -m 0755 /run/munge
  runuser -u munge -- /usr/sbin/munged --pid-file="$MUNGE_PID" </dev/null && wait_pidfile "$MUNGE_PID" \
    || die "munged failed (see /var/log/munge/munged.log)"
  local i; for i in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n </dev/null | unmunge >/dev/null || die "munged not answering (see /var/log/munge/munged.log)"
  log "munged started (pid $(cat $MUNGE_PID))"
}

start_mariadb() {
  if mariadb-admin ping >/dev/null 2>&1; then log "mariadb already running"; else
    install -d -o mysql -g mysql -m 0755 /run/mysqld "$MYSQL_RUN"
    # datadir /var/lib/mysql was initialised by the Debian postinst
    setsid /usr/sbin/mariadbd --user=mysql --pid-file="$MYSQL_RUN/mariadbd.pid" \
      --log-error="$MYSQL_RUN/mariadb.err" --innodb-buffer-pool-size=64M </dev/null >/dev/null 2>&1 &
    local i; for i in $(seq 150); do mariadb-admin ping >/dev/null 2>&1 && break; sleep 0.2; done
    mariadb-admin ping >/dev/null 2>&1 || { tail -20 "$MYSQL_RUN/mariadb.err"; die "mariadb did not start"; }
    log "mariadb started (pid $(cat "$MYSQL_RUN/mariadbd.pid"))"
  fi
  mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DBPASS';
              GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;" </dev/null
}

start_slurmdbd() {
  pid_alive "$RUN/slurmdbd.pid" && { log "slurmdbd already running"; return 0; }
  /usr/sbin/slurmdbd </dev/null && wait_pidfile "$RUN/slurmdbd.pid" || { tail -20 "$LOG/slurmdbd.log"; die "slurmdbd failed"; }
  local i; for i in $(seq 100); do (echo >/dev/tcp/127.0.0.1/6819) 2>/dev/null && break; sleep 0.2; done
  (echo >/dev/tcp/127.0.0.1/6819) 2>/dev/null || { tail -20 "$LOG/slurmdbd.log"; die "slurmdbd not listening"; }
  log "slurmdbd started (pid $(cat "$RUN/slurmdbd.pid"))"
}

start_slurm_daemons() {
  if pid_alive "$RUN/slurmctld.pid"; then log "slurmctld already running"; else
    /usr/sbin/slurmctld </dev/null && wait_pidfile "$RUN/slurmctld.pid" || { tail -20 "$LOG/slurmctld.log"; die "slurmctld failed"; }
    log "slurmctld started (pid $(cat "$RUN/slurmctld.pid"))"
  fi
  local node
  for node in "${NODE_NAMES[@]}"; do
    if pid_alive "$RUN/slurmd-$node.pid"; then log "slurmd $node already running"; continue; fi
    install -d -m 0755 "$ROOT/state/d/$node"
    /usr/sbin/slurmd -N "$node" </dev/null && wait_pidfile "$RUN/slurmd-$node.pid" \
      || { tail -20 "$LOG/slurmd-$node.log"; die "slurmd $node failed"; }
    log "slurmd $node started (pid $(cat "$RUN/slurmd-$node.pid"))"
  done
}

wait_idle() {
  local i node st="" ready
  for i in $(seq 120); do
    ready=0
    for node in "${NODE_NAMES[@]}"; do
      st=$(sinfo -h -n "$node" -o %t 2>/dev/null || true)
      case $st in
        idle|mix|alloc) ready=$((ready + 1)) ;;
        down*|drain*|drng*|fail*) scontrol update NodeName="$node" State=RESUME 2>/dev/null || true ;;
      esac
    done
    if [[ $ready == "$NODES" ]]; then log "$NODES node(s) up: $(sinfo -h -o '%N %t' | tr '\n' ' ')"; return 0; fi
    sleep 0.5
  done
  sinfo -N -l >&2 || true; tail -20 "$LOG/slurmctld.log" "$LOG"/slurmd-*.log >&2
  die "$((NODES - ready)) of $NODES node(s) not idle after 60 s (last state: ${st:-none})"
}

smoke() {
  local t0 out; t0=$(now)
  out=$(cd "$ROOT" && timeout 120 sbatch --wait --parsable --nodes="$NODES" -o "$LOG/smoke-%j.out" \
    --wrap 'srun printenv SLURMD_NODENAME' </dev/null) || die "smoke job failed"
  log "smoke job $out: '$(tr '\n' ' ' <"$LOG/smoke-$out.out")' in $(since "$t0") (sbatch -> completion)"
}

cmd_start() {
  local t0; t0=$(now)
  [[ $(id -u) == 0 ]] || die "must run as root"
  install -d -m 0755 "$ROOT" "$RUN" "$LOG" "$ROOT/state/ctld" "$ROOT/state/d"
  install_packages
  ensure_host
  ensure_munge_key
  write_config
  if [[ $CONFIG_CHANGED == 1 ]]; then  # config changed: restart what is running (state dir is kept)
    stop_slurmds; stop_pidfile slurmctld "$RUN/slurmctld.pid"
    stop_pidfile slurmdbd "$RUN/slurmdbd.pid"
  fi
  start_munge
  start_mariadb
  start_slurmdbd
  start_slurm_daemons
  wait_idle
  log "cluster up in $(since "$t0")"
  smoke
  sinfo >&2
}

stop_slurmds() {  # every node's, whatever the node count they were started with
  local pf; for pf in $(slurmd_pidfiles); do stop_pidfile "$(basename "$pf" .pid)" "$pf"; done
}

cmd_stop() {
  stop_slurmds
  stop_pidfile slurmctld "$RUN/slurmctld.pid"
  stop_pidfile slurmdbd "$RUN/slurmdbd.pid"
  stop_pidfile mariadbd "$MYSQL_RUN/mariadbd.pid"
  stop_pidfile munged "$MUNGE_PID"
  remove_node_names
}

cmd_status() {
  local n pf
  for n in munged:$MUNGE_PID mariadbd:$MYSQL_RUN/mariadbd.pid slurmdbd:$RUN/slurmdbd.pid \
           slurmctld:$RUN/slurmctld.pid $(for pf in $(slurmd_pidfiles); do echo "$(basename "$pf" .pid):$pf"; done); do
    pf=${n#*:}; if pid_alive "$pf"; then echo "${n%%:*}: running (pid $(cat "$pf"))"; else echo "${n%%:*}: stopped"; fi
  done
  sinfo 2>/dev/null || true
}

case ${1:-start} in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) die "usage: $0 [start|stop|status]" ;;
esac
