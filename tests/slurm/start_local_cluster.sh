#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for tests/slurm/test_slurm.py (needs root, Debian/Ubuntu).
#
#   sudo tests/slurm/start_local_cluster.sh [STATE_DIR]    # prints "export SLURM_CONF=..." at the end
#   tests/slurm/stop_local_cluster.sh [STATE_DIR]
#
# Installs munge + slurmctld + slurmd + slurm-client with apt-get when sbatch is missing (set
# MEGATRON_SP_SLURM_NO_INSTALL=1 to refuse; the packages it installed are listed in
# STATE_DIR/installed and left installed), writes a slurm.conf under STATE_DIR (default
# /tmp/megatron_sp_slurm) for this host with every CPU and 2 fake GPUs (gres/gpu backed by /dev/null
# and /dev/zero, so the sbatch scripts' --gpus-per-node requests are accepted; torch still sees no
# CUDA and picks gloo), starts munged, slurmctld and slurmd where they are not running (each one
# it starts is listed in STATE_DIR/started, and stop_local_cluster.sh stops those: the machine is
# left with the daemons it had), and waits until the node is idle.
set -euo pipefail
STATE=${1:-${MEGATRON_SP_SLURM_STATE:-/tmp/megatron_sp_slurm}}
mkdir -p "$STATE"/{ctld,spool,log}
touch "$STATE/started" "$STATE/installed"
started() { grep -qx "$1" "$STATE/started" || echo "$1" >> "$STATE/started"; }

if ! command -v sbatch >/dev/null || ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    if [[ -n "${MEGATRON_SP_SLURM_NO_INSTALL:-}" ]]; then
        echo "error: SLURM is not installed (apt-get install slurmctld slurmd slurm-client munge)" >&2
        exit 1
    fi
    echo "> installing munge and slurm with apt-get (a minute or two)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    PACKAGES="slurmctld slurmd slurm-client munge"
    missing=$(for p in $PACKAGES; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done | xargs)
    apt-get install -y -q --no-install-recommends $PACKAGES >/dev/null
    [[ -z "$missing" ]] || echo "$missing" >> "$STATE/installed"
fi

# munge: one key, one daemon (as the munge user), a socket that slurm finds by default.
if ! munge -n >/dev/null 2>&1; then
    [[ -s /etc/munge/munge.key ]] || { mungekey --create --force 2>/dev/null \
        || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null; }
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    runuser -u munge -- munged --force
    started munged
    for _ in $(seq 50); do munge -n >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n | unmunge >/dev/null
fi

HOST=$(hostname -s)
CPUS=$(nproc)
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))
cat > "$STATE/slurm.conf" <<CONF
ClusterName=megatronsp
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5
# (a requeued job waits cred_expire seconds before it may start again: 120 by default, 5 the least)
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
SlurmctldPort=${MEGATRON_SP_SLURMCTLD_PORT:-16817}
SlurmdPort=${MEGATRON_SP_SLURMD_PORT:-16818}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
# the main scheduling pass every second (default 60 s): a requeued job starts once cred_expire
# has passed, not up to a minute later (one node, a few jobs: the pass costs nothing)
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=30
GresTypes=gpu
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
printf 'AutoDetect=off\nNodeName=%s Name=gpu File=/dev/null,/dev/zero\n' "$HOST" > "$STATE/gres.conf"
export SLURM_CONF=$STATE/slurm.conf

if ! scontrol ping 2>/dev/null | grep -q "is UP"; then
    slurmctld -f "$SLURM_CONF"
    started slurmctld
fi
if [[ ! -s "$STATE/slurmd.pid" ]] || ! kill -0 "$(cat "$STATE/slurmd.pid")" 2>/dev/null; then
    slurmd -f "$SLURM_CONF"
    started slurmd
fi
for _ in $(seq 120); do
    state=$(sinfo -h -N -o "%T" 2>/dev/null | head -n1 || true)
    [[ "$state" == idle* || "$state" == mixed* || "$state" == allocated* ]] && break
    sleep 0.5
done
if [[ "$state" != idle* && "$state" != mixed* && "$state" != allocated* ]]; then
    scontrol update nodename="$HOST" state=resume 2>/dev/null || true
    sleep 1
    state=$(sinfo -h -N -o "%T" | head -n1)
fi
sinfo
[[ "$state" == idle* || "$state" == mixed* || "$state" == allocated* ]] || {
    echo "error: node $HOST is '$state'; see $STATE/log/" >&2; tail -n 20 "$STATE"/log/*.log >&2; exit 1; }
echo "export SLURM_CONF=$SLURM_CONF"
