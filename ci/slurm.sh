#!/usr/bin/env bash
# A real single-host Slurm for the tests: slurmctld and two slurmd (logical nodes n1, n2 on 127.0.0.1,
# one port each) with munge, as root and without systemd, all state under one run directory.
#
#   bash ci/slurm.sh install      Debian's slurm-wlm and munge (apt, root), when slurmctld is missing
#   bash ci/slurm.sh up DIR       write DIR/slurm.conf and a munge key, start munged, slurmctld, slurmd
#                                 n1 and n2 (pid files in DIR), wait until both nodes are idle
#   bash ci/slurm.sh down DIR     stop exactly the daemons whose pid files are in DIR
#
# Clients find the cluster through SLURM_CONF=DIR/slurm.conf (the munge socket is named in it). One
# thing lies outside DIR: /etc/slurm/slurm.conf, Slurm's default path, becomes a link to DIR/slurm.conf
# while the cluster is up, because Snakemake's job step (snakemake-executor-plugin-slurm-jobstep)
# removes SLURM_CONF from the environment of the `srun` it runs inside each job; `down` removes the
# link, and `up` refuses a host whose /etc/slurm/slurm.conf is its own. Accounting is off, as on many
# small clusters: `sacct` fails there, which is what the profiles' `slurm-status-command: squeue` is
# for (docs/guide/cluster.md).
# Each logical node declares SLURM_NODE_CPUS CPUs (default 8) whatever the host has
# (SlurmdParameters=config_overrides), so a 2-core machine can host a job of Ray's logical CPUs.
set -euo pipefail

DAEMONS=(slurmd-n2 slurmd-n1 slurmctld munged)
DEFAULT_CONF=/etc/slurm/slurm.conf
MARK="# single-host test cluster written by ci/slurm.sh"

install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
        return 0
    fi
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "error: slurmctld/slurmd/munged missing; install slurm-wlm and munge (Debian: apt-get, as root)" >&2
        return 2
    fi
    echo "slurm: installing slurm-wlm and munge" >&2
    # the packages' init scripts must not start daemons nobody here would stop: deny them while
    # installing, unless the host already has its own policy
    local policy=/usr/sbin/policy-rc.d own_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && own_policy=1
    fi
    local rc=0 get=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge)
    # the package lists are read as they are (ci/test.sh has just updated them); updated only if that fails
    { "${get[@]}" >/dev/null 2>&1 || { apt-get update -qq && "${get[@]}" >/dev/null; }; } || rc=$?
    [ "$own_policy" = 1 ] && rm -f "$policy"
    return "$rc"
}

free_port() {  # a TCP port nothing listens on now
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

running() {  # the daemons of run directory $1 that are alive
    local name
    for name in "${DAEMONS[@]}"; do
        if [ -s "$1/$name.pid" ] && kill -0 "$(cat "$1/$name.pid")" 2>/dev/null; then echo "$name"; fi
    done
}

up() {
    local dir=$1 cpus=${SLURM_NODE_CPUS:-8}
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    if [ -n "$(running "$dir")" ]; then
        echo "error: Slurm of $dir is running already; run 'bash ci/slurm.sh down $dir' first" >&2
        return 3
    fi
    if [ -e "$DEFAULT_CONF" ] || [ -L "$DEFAULT_CONF" ]; then
        local target owner
        target=$(readlink "$DEFAULT_CONF" || true)
        owner=$(dirname "${target:-/}")
        # a link this script left (a killed test) whose cluster is down may go; anything else stays
        if grep -qs "^$MARK" "$target" && [ -n "$(running "$owner")" ]; then
            echo "error: the test cluster of $owner is still running ($(running "$owner" | xargs)), left by" \
                "an earlier run that was stopped; run 'bash ci/slurm.sh down $owner' first" >&2
            return 3
        fi
        if [ -z "$target" ] || { [ -e "$target" ] && ! grep -qs "^$MARK" "$target"; }; then
            echo "error: $DEFAULT_CONF exists (${target:-a file}): this host runs a Slurm already;" \
                "run the Slurm tests on a host without one" >&2
            return 3
        fi
        rm -f "$DEFAULT_CONF"
    fi
    chmod 700 "$dir"
    mkdir -p "$dir/state" "$dir/spool/n1" "$dir/spool/n2" "$dir/munge"
    chmod 700 "$dir/munge"
    head -c 1024 /dev/urandom >"$dir/munge/munge.key"
    chmod 400 "$dir/munge/munge.key"
    local ctl_port n1_port n2_port host
    ctl_port=$(free_port) n1_port=$(free_port) n2_port=$(free_port)
    host=$(hostname -s)
    cat >"$dir/slurm.conf" <<EOF
$MARK
ClusterName=engine-ci
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctl_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MinJobAge=3600
KillWait=10
InactiveLimit=0
SlurmdTimeout=300
NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$n1_port CPUs=$cpus RealMemory=16000 State=UNKNOWN
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.1 Port=$n2_port CPUs=$cpus RealMemory=16000 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
    mkdir -p "$(dirname "$DEFAULT_CONF")"
    ln -s "$dir/slurm.conf" "$DEFAULT_CONF"
    export SLURM_CONF=$dir/slurm.conf
    munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
        --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munge/munged.seed"
    # -i: ignore state a previous cluster may have left; daemons fork and write their pid files
    slurmctld -i
    slurmd -N n1
    slurmd -N n2
    local deadline=$((SECONDS + 60))
    until [ "$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" = 2 ]; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "error: Slurm nodes n1/n2 not idle within 60 s; logs in $dir" >&2
            sinfo -N -l >&2 || true
            return 4
        fi
        sleep 0.5
    done
    echo "SLURM_CONF=$dir/slurm.conf"
}

down() {
    local dir=$1 name pid left alive=()
    [ -d "$dir" ] || return 0
    dir=$(cd "$dir" && pwd)
    # jobs first, while slurmctld can still cancel them: slurmstepd and its tasks outlive slurmd
    if SLURM_CONF=$dir/slurm.conf scancel --user="$(id -un)" 2>/dev/null; then
        for _ in $(seq 150); do
            [ -z "$(SLURM_CONF=$dir/slurm.conf squeue -h 2>/dev/null)" ] && break
            sleep 0.1
        done
    fi
    for name in "${DAEMONS[@]}"; do
        [ -s "$dir/$name.pid" ] || continue
        pid=$(cat "$dir/$name.pid")
        kill "$pid" 2>/dev/null && alive+=("$pid")
    done
    for _ in $(seq 150); do # 15 s for all of them to exit, then SIGKILL the ones still there
        left=()
        for pid in "${alive[@]}"; do kill -0 "$pid" 2>/dev/null && left+=("$pid"); done
        alive=("${left[@]}")
        [ ${#alive[@]} = 0 ] && break
        sleep 0.1
    done
    for pid in "${alive[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
    if [ "$(readlink "$DEFAULT_CONF" 2>/dev/null)" = "$dir/slurm.conf" ]; then
        rm -f "$DEFAULT_CONF"
    fi
}

case "${1:-}" in
    install) install ;;
    up) install && up "${2:?usage: ci/slurm.sh up DIR}" ;;
    down) down "${2:?usage: ci/slurm.sh down DIR}" ;;
    *) echo "usage: bash ci/slurm.sh install | up DIR | down DIR" >&2; exit 2 ;;
esac
