#!/usr/bin/env bash
# Stop the daemons that tests/slurm/start_local_cluster.sh started (listed in STATE_DIR/started:
# slurmd and slurmctld by their pid files, munged by its own), and none it found running; print one
# line saying what was stopped and what the start script installed (left installed).
set -uo pipefail
STATE=${1:-${MEGATRON_SP_SLURM_STATE:-/tmp/megatron_sp_slurm}}
stopped=()
stop_pidfile() {   # NAME PIDFILE: TERM, then wait up to 10 s for it to go
    local pid
    [[ -s "$2" ]] || return 0
    pid=$(cat "$2")
    kill "$pid" 2>/dev/null || return 0
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    stopped+=("$1")
}
if [[ -f "$STATE/started" ]]; then
    grep -qx slurmd "$STATE/started" && stop_pidfile slurmd "$STATE/slurmd.pid"
    grep -qx slurmctld "$STATE/started" && stop_pidfile slurmctld "$STATE/slurmctld.pid"
    if grep -qx munged "$STATE/started"; then
        for pidfile in /run/munge/munged.pid /var/run/munge/munged.pid; do
            [[ -s "$pidfile" ]] && { stop_pidfile munged "$pidfile"; break; }
        done
    fi
    rm -f "$STATE/started"
fi
installed=""
[[ -f "$STATE/installed" ]] && installed=$(xargs < "$STATE/installed")
echo "slurm test cluster: stopped ${stopped[*]:-nothing (the tests started no daemon)};" \
     "installed by the tests: ${installed:-nothing}${installed:+ (left installed; apt-get remove $installed undoes it)}"
