#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for tests/test_slurm.py (CI starts it).
#
#   tools/slurm_cluster.sh start    install Debian's slurmctld, slurmd, munge if missing
#                                   (apt-get, as root), write $MPX_SLURM_DIR/slurm.conf,
#                                   start munged, slurmctld and slurmd, wait until the
#                                   node is idle; idempotent
#   tools/slurm_cluster.sh status   wait for a start under way, then exit 0 if the
#                                   cluster answers (prints SLURM_CONF=...), else 1
#   tools/slurm_cluster.sh stop     stop the daemons it started
#
# One node (this host) with 4 CPUs declared whatever the machine has, so that
# the tests' 3-rank steps fit on a 2-core CI machine (config_overrides: slurmd
# does not drain a node whose hardware differs). MpiDefault=none, as many
# clusters ship it: srun then gives the ranks no PMI unless asked (--mpi=pmi2),
# the case mpxrun must handle. Everything it writes is under $MPX_SLURM_DIR;
# /etc/slurm is left alone (clients find the cluster through SLURM_CONF).
set -euo pipefail
DIR=${MPX_SLURM_DIR:-/tmp/mpx-slurm}
CONF=$DIR/slurm.conf
LOCK=/tmp/mpx-slurm.lock
export SLURM_CONF=$CONF

answers() {
    command -v sinfo >/dev/null && [ -f "$CONF" ] &&
        timeout 10 sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'
}

install() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
        command -v munged >/dev/null && command -v srun >/dev/null && return 0
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "slurm_cluster: slurmctld/slurmd/munge missing and no root apt-get to install them" >&2
        return 1
    fi
    echo "slurm_cluster: installing slurmctld slurmd munge slurm-client (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd munge slurm-client >/dev/null
}

start() {
    if answers; then
        echo "slurm_cluster: already up (SLURM_CONF=$CONF)"
        return 0
    fi
    install
    # A fresh cluster every start: no jobs or cluster name of an earlier one.
    rm -rf "$DIR/state"
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log" /run/munge
    chown munge:munge /run/munge 2>/dev/null || true
    if ! pgrep -x munged >/dev/null; then
        [ -s /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || create-munge-key -f; }
        chown munge:munge /etc/munge/munge.key 2>/dev/null || true
        su -s /bin/sh munge -c /usr/sbin/munged 2>/dev/null 9>&- || /usr/sbin/munged --force 9>&-
    fi
    local host
    host=$(hostname -s)
    cat >"$CONF" <<CONF
ClusterName=mpxci
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
KillWait=5
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
JobCompType=jobcomp/none
NodeName=$host CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
    pkill -x slurmctld 2>/dev/null || true
    pkill -x slurmd 2>/dev/null || true
    sleep 1
    # 9>&-: a daemon must not inherit the lock's descriptor, or it holds the lock for
    # its whole life and every `status` waits out its flock timeout.
    /usr/sbin/slurmctld -i -f "$CONF" 9>&-
    /usr/sbin/slurmd -f "$CONF" 9>&-
    for _ in $(seq 60); do
        if answers; then
            echo "slurm_cluster: up (SLURM_CONF=$CONF)"
            return 0
        fi
        sleep 1
    done
    echo "slurm_cluster: the node did not come up; logs in $DIR/log" >&2
    tail -n 20 "$DIR"/log/*.log >&2 || true
    return 1
}

case ${1:-} in
start)
    exec 9>"$LOCK"
    flock 9
    start
    ;;
status)
    exec 9>"$LOCK"
    # A start under way (CI starts it beside the first tests; apt-get takes ~30 s).
    # Shorter than the tests' 300 s timeout, so a lock never released is a skip saying
    # why, not a test killed by pytest-timeout.
    flock -w 200 9 || { echo "slurm_cluster: a start still holds $LOCK after 200 s" >&2; exit 1; }
    answers && echo "SLURM_CONF=$CONF"
    ;;
stop)
    pkill -x slurmd 2>/dev/null || true
    pkill -x slurmctld 2>/dev/null || true
    ;;
*)
    echo "usage: $0 start|status|stop" >&2
    exit 2
    ;;
esac
