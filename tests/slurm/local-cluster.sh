#!/usr/bin/env bash
# Copied from the workplace's ../shared/slurm/local-cluster.sh so that CI, which has only this
# repository, can start the same cluster.
# A real two-node Slurm cluster on this one machine, for tests: slurmctld plus two slurmd
# daemons (nodes n1 and n2, one CPU each, both on 127.0.0.1), no munge (auth/none), no cgroups.
# Debian's slurm-wlm 22.05 package; needs root (apt-get, /etc/slurm, /etc/hosts).
#
#   bash ../shared/slurm/local-cluster.sh start    # install if missing, (re)start, wait until idle
#   bash ../shared/slurm/local-cluster.sh stop     # stop the three daemons this script started
#   bash ../shared/slurm/local-cluster.sh status
#
# Then, e.g.:  srun -N2 --ntasks-per-node=1 printenv SLURM_PROCID
#              sbatch -N2 --ntasks-per-node=1 --signal=B:USR1@30 --requeue job.sh
# Node names n1, n2 resolve to 127.0.0.1 (added to /etc/hosts), so `scontrol show hostnames`
# gives a usable MASTER_ADDR. State lives in $SLURM_TMP (default /tmp/ddpjob-slurm).
set -euo pipefail
T=${SLURM_TMP:-/tmp/ddpjob-slurm}
CPUS=${SLURM_NODE_CPUS:-1}

conf() {
  mkdir -p /etc/slurm "$T"/state "$T"/spool "$T"/log
  cat > /etc/slurm/slurm.conf <<CONF
ClusterName=local
SlurmctldHost=$(hostname -s)
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$T/state
SlurmdSpoolDir=$T/spool/%n
SlurmctldPidFile=$T/slurmctld.pid
SlurmdPidFile=$T/slurmd-%n.pid
SlurmctldLogFile=$T/log/slurmctld.log
SlurmdLogFile=$T/log/slurmd-%n.log
SlurmctldPort=16817
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
KillWait=10
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=n[1-2] NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 Port=17001-17002 CPUs=$CPUS RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
CONF
  grep -qE '^127\.0\.0\.1[[:space:]].*\bn1\b' /etc/hosts || echo "127.0.0.1 n1 n2" >> /etc/hosts
}

stop() {
  for f in "$T"/slurmd-n1.pid "$T"/slurmd-n2.pid "$T"/slurmctld.pid; do
    [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
  done
  sleep 1
}

case ${1:-start} in
  start)
    command -v slurmctld >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm >/dev/null; }
    stop; conf
    slurmctld -i
    slurmd -N n1; slurmd -N n2
    for _ in $(seq 60); do
      [ "$(sinfo -h -o %T 2>/dev/null | sort -u)" = idle ] && { sinfo; exit 0; }
      sleep 0.5
    done
    echo "slurm did not become idle; see $T/log" >&2; sinfo >&2 || true; exit 1 ;;
  stop) stop ;;
  status) sinfo ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
