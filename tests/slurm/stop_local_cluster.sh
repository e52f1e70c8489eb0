#!/usr/bin/env bash
# Stop the daemons that tests/slurm/start_local_cluster.sh started (by their pid files).
set -uo pipefail
STATE=${1:-${MEGATRON_SP_SLURM_STATE:-/tmp/megatron_sp_slurm}}
for pidfile in "$STATE/slurmd.pid" "$STATE/slurmctld.pid"; do
    [[ -s "$pidfile" ]] && kill "$(cat "$pidfile")" 2>/dev/null
done
echo "stopped slurmd and slurmctld under $STATE (munged keeps running)"
