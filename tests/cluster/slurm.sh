#!/usr/bin/env bash
# A one-node SLURM cluster on 127.0.0.1 for the `slurm` tests: munged, mariadbd + slurmdbd (so that
# sacct works and submitit never waits on an UNKNOWN job), slurmctld and slurmd.
#
#   tests/cluster/slurm.sh start    install (Debian, as root) if needed, configure, start; idempotent
#   tests/cluster/slurm.sh stop     stop the daemons this script started, by the PIDs it recorded
#   tests/cluster/slurm.sh env      print `export SLURM_CONF=...` for clients (sbatch, squeue, sacct)
#
# Everything lives in $VITPIPE_SLURM_DIR (default /tmp/vitpipe-slurm): configs, pid files, logs,
# spool and the database. Nothing under /etc is changed. Daemons are stopped by pid file only,
# never by name, so a cluster someone else runs on the machine is left alone.
set -euo pipefail

DIR="${VITPIPE_SLURM_DIR:-/tmp/vitpipe-slurm}"
CONF="$DIR/etc/slurm.conf"
NODE="$(hostname -s)"
DAEMONS=(slurmd slurmctld slurmdbd mariadbd munged)  # stop order; start order is the reverse

log() { echo "slurm.sh: $*" >&2; }

# shellcheck source=tests/cluster/lib.sh
source "$(dirname "$0")/lib.sh"

install() {
  install_missing "slurmctld slurmd slurmdbd sbatch sacct munged mariadbd" slurm-wlm munge slurmdbd mariadb-server
}

configure() {
  local cpus mem
  cpus="$(nproc)"
  mem="$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')"
  mem=$((mem * 9 / 10))
  cat >"$CONF" <<EOF
# written by vitpipe tests/cluster/slurm.sh
ClusterName=vitpipe
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
SchedulerParameters=bf_interval=1,sched_interval=2
ReturnToService=2
KillWait=5
MinJobAge=300
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
  cat >"$DIR/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
EOF
  chmod 600 "$DIR/etc/slurmdbd.conf"
}

start() {
  mkdir -p "$DIR"/{etc,run,log,state,spool,munge,mysql,db}
  install
  configure
  export SLURM_CONF="$CONF"

  if ! alive "$DIR/run/munged.pid"; then
    [ -s /etc/munge/munge.key ] || runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
    mkdir -p /run/munge && chown munge:munge /run/munge "$DIR/munge"
    runuser -u munge -- /usr/sbin/munged --pid-file="$DIR/munge/munged.pid" \
      --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed" --force
    wait_for 10 munged test -s "$DIR/munge/munged.pid"
    cp "$DIR/munge/munged.pid" "$DIR/run/munged.pid"
  fi

  if ! alive "$DIR/run/mariadbd.pid"; then
    if [ ! -d "$DIR/db/mysql" ]; then
      mariadb-install-db --user=mysql --datadir="$DIR/db" --auth-root-authentication-method=socket \
        --skip-test-db >"$DIR/log/mariadb-install.log" 2>&1
    fi
    chown -R mysql:mysql "$DIR/db" "$DIR/mysql"
    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
    setsid mariadbd --user=mysql --datadir="$DIR/db" --socket=/run/mysqld/mysqld.sock --skip-networking \
      --innodb-buffer-pool-size=64M --pid-file="$DIR/mysql/mariadbd.pid" \
      --log-error="$DIR/mysql/mariadbd.log" </dev/null >/dev/null 2>&1 &
    wait_for 30 mariadbd test -s "$DIR/mysql/mariadbd.pid"
    cp "$DIR/mysql/mariadbd.pid" "$DIR/run/mariadbd.pid"
    wait_for 30 "mariadbd socket" test -S /run/mysqld/mysqld.sock
  fi

  if ! alive "$DIR/run/slurmdbd.pid"; then
    slurmdbd
    wait_for 30 slurmdbd bash -c "exec 3<>/dev/tcp/127.0.0.1/6819"
  fi
  if ! alive "$DIR/run/slurmctld.pid"; then
    slurmctld -f "$CONF"
    wait_for 30 slurmctld scontrol ping
  fi
  if ! alive "$DIR/run/slurmd.pid"; then
    slurmd -f "$CONF" -N "$NODE"
  fi
  wait_for 60 "node $NODE idle" bash -c "sinfo -h -o %t | grep -qx idle"
  log "up: SLURM_CONF=$CONF ($(sinfo -h -o '%D node, %c CPUs, %P'))"
}

stop() {
  local name
  for name in "${DAEMONS[@]}"; do stop_pidfile "$DIR/run/$name.pid"; done
  log "stopped"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
