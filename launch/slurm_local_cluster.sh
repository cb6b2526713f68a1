#!/usr/bin/env bash
# A real Slurm cluster on this machine, to try launch/slurm_multinode.sbatch locally (and for
# tests/test_slurm.py and tests/test_slurm_two_node.py). Debian/Ubuntu, as root; no systemd needed
# (containers work). One node by default; SHARDKIT_SLURM_NODES=2 (or more) starts one slurmd per
# node, each in its own UTS + mount namespace (`unshare -u -m`) with its own hostname and its own
# /etc/hosts (a generated file bind-mounted over it), so each is a distinct Slurm node and its jobs
# see their node's hostname. The nodes share this machine's network namespace: each has its own
# address inside 127.0.0.0/8 (loopback: no traffic leaves the machine) and its own slurmd port.
#
#   launch/slurm_local_cluster.sh start     # install slurm-wlm + munge if missing, start munged,
#                                           # slurmctld and the slurmd(s), wait until all are idle
#   eval "$(launch/slurm_local_cluster.sh env)"   # SLURM_CONF for sbatch/squeue/sinfo/scancel
#   launch/slurm_local_cluster.sh status
#   launch/slurm_local_cluster.sh exec NODE CMD...   # CMD as NODE sees the world (its hostname and
#                                           # /etc/hosts): nsenter into that slurmd's namespaces
#   launch/slurm_local_cluster.sh stop      # cancel its jobs, stop every daemon (the namespaces
#                                           # end with their last process)
#
# Everything (munge key, slurm.conf, hosts files, state, logs) lives in SHARDKIT_SLURM_DIR
# (default ${TMPDIR:-/tmp}/shardkit-slurm); nothing under /etc is changed and no service is
# registered. Settings (environment):
#   SHARDKIT_SLURM_DIR            state folder (its path must stay short: the munge socket is in it)
#   SHARDKIT_SLURM_CTLD_PORT      slurmctld port (default 6817); SHARDKIT_SLURM_SLURMD_PORT (6818)
#   SHARDKIT_SLURM_INSTALL=0      never run apt-get (exit 2 when Slurm is missing)
#   SHARDKIT_SLURM_START_TIMEOUT  seconds to wait for the node(s) to become idle (default 60)
#   SHARDKIT_SLURM_NODES          nodes (default 1: this host under its own name, no namespaces)
#   SHARDKIT_SLURM_NODE_PREFIX    names of namespaced nodes: PREFIX1, PREFIX2 ... (default sknode)
#   SHARDKIT_SLURM_NODE_NET       their addresses: NET.1, NET.2 ... (default 127.0.77; loopback only)
# With 2+ nodes, node i's slurmd listens on SHARDKIT_SLURM_SLURMD_PORT + i - 1 and its /etc/hosts
# is $SHARDKIT_SLURM_DIR/hosts/<node> (bind-mounted: edit it in place, not by rename, to change
# what that node resolves; the tests make one node's MASTER_ADDR unreachable this way).
# Exit status: 0 done; 1 usage error or already running; 2 this machine cannot host the cluster
# (not root, no apt-get, the install failed, no UTS/mount namespaces for 2+ nodes); 3 the daemons
# did not come up (their logs follow).
set -euo pipefail

STATE_DIR="${SHARDKIT_SLURM_DIR:-${TMPDIR:-/tmp}/shardkit-slurm}"
CTLD_PORT="${SHARDKIT_SLURM_CTLD_PORT:-6817}"
SLURMD_PORT="${SHARDKIT_SLURM_SLURMD_PORT:-6818}"
INSTALL="${SHARDKIT_SLURM_INSTALL:-1}"
START_TIMEOUT="${SHARDKIT_SLURM_START_TIMEOUT:-60}"
NODES="${SHARDKIT_SLURM_NODES:-1}"
NODE_PREFIX="${SHARDKIT_SLURM_NODE_PREFIX:-sknode}"
NODE_NET="${SHARDKIT_SLURM_NODE_NET:-127.0.77}"
CONF="$STATE_DIR/slurm.conf"
# munged wants every folder above its socket searchable by all (clients run as any user)
MUNGE_SOCKET="$STATE_DIR/run/munge.socket"
export SLURM_CONF="$CONF"

say() { echo "slurm_local_cluster: $*" >&2; }
cannot_host() { say "$*"; exit 2; }
usage_error() { say "$*"; exit 1; }

pid_of() {  # the live pid in a pid file, or nothing
    local file="$1" pid
    [ -s "$file" ] || return 0
    pid="$(tr -dc '0-9' <"$file")"
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then echo "$pid"; fi
}

check_settings() {
    case "$NODES" in
        '' | 0 | *[!0-9]*) usage_error "SHARDKIT_SLURM_NODES='$NODES' is not a node count; set 1 (this host) or 2+" \
            "(namespaced nodes on this machine)" ;;
    esac
    [ "$NODES" -le 200 ] || usage_error "SHARDKIT_SLURM_NODES=$NODES: at most 200 nodes fit in $NODE_NET.1-200"
    case "$NODE_PREFIX" in
        '' | *[!a-z0-9-]* | -* | [0-9]*) usage_error "SHARDKIT_SLURM_NODE_PREFIX='$NODE_PREFIX' is not a usable host" \
            "name prefix; use lower-case letters, digits and '-', starting with a letter (e.g. sknode)" ;;
    esac
    # Loopback only: an address in 127.0.0.0/8 never leaves this machine, whatever the routes say.
    local ok=0
    if [[ "$NODE_NET" =~ ^127\.([0-9]{1,3})\.([0-9]{1,3})$ ]] && [ "${BASH_REMATCH[1]}" -le 255 ] \
        && [ "${BASH_REMATCH[2]}" -le 255 ] && [ "$NODE_NET" != 127.0.0 ]; then ok=1; fi
    [ "$ok" = 1 ] || usage_error "SHARDKIT_SLURM_NODE_NET='$NODE_NET' is not a loopback /24 other than 127.0.0:" \
        "the nodes' addresses must stay on this machine; use e.g. 127.0.77 (nodes get 127.0.77.1, 127.0.77.2 ...)"
}

node_names() {  # the namespaced nodes' names, one a line
    local i
    for i in $(seq "$NODES"); do echo "$NODE_PREFIX$i"; done
}

slurmd_pid_files() {  # every slurmd's pid file, one a line
    if [ "$NODES" = 1 ]; then echo "$STATE_DIR/run/slurmd.pid"; return 0; fi
    local name
    for name in $(node_names); do echo "$STATE_DIR/run/slurmd-$name.pid"; done
}

install_slurm() {
    local missing=()
    for cmd in munged slurmctld slurmd sbatch; do
        command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
    done
    [ "${#missing[@]}" -eq 0 ] && return 0
    [ "$INSTALL" = 1 ] || cannot_host "${missing[*]} not installed and SHARDKIT_SLURM_INSTALL=$INSTALL;" \
        "install them with \`apt-get install -y slurm-wlm munge\`, or unset SHARDKIT_SLURM_INSTALL"
    command -v apt-get >/dev/null 2>&1 || cannot_host "${missing[*]} not installed and there is no apt-get" \
        "on this machine; install Slurm (slurmctld, slurmd, the client tools) and munge with its package manager"
    say "installing slurm-wlm and munge with apt-get (missing: ${missing[*]})"
    local log="$STATE_DIR/apt.log"
    # apt-get update only when the package is unknown (a fresh container has no lists)
    if ! apt-cache show slurm-wlm >/dev/null 2>&1; then
        timeout 180 apt-get update -q >"$log" 2>&1 || cannot_host "apt-get update failed (see $log):" \
            "$(tail -n 3 "$log" | tr '\n' ' ')"
    fi
    DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -q --no-install-recommends slurm-wlm munge \
        >>"$log" 2>&1 || cannot_host "apt-get install slurm-wlm munge failed (see $log): $(tail -n 3 "$log" | tr '\n' ' ')"
}

check_namespaces() {
    # 2+ nodes need UTS + mount namespaces (own hostname, own /etc/hosts): root and a kernel (or
    # container runtime) that allows them. Tried once here, so the reason is named, not a dead slurmd.
    local tool
    for tool in unshare nsenter mount; do
        command -v "$tool" >/dev/null 2>&1 || cannot_host "SHARDKIT_SLURM_NODES=$NODES needs \`$tool\` (util-linux)" \
            "to give each node its own hostname and /etc/hosts; install util-linux, or use SHARDKIT_SLURM_NODES=1"
    done
    local probe="$STATE_DIR/run/namespace-probe" err=""
    echo "127.0.0.1 sk-probe" >"$probe"
    if ! err="$(unshare -u -m sh -c 'hostname sk-probe && mount --bind "$1" /etc/hosts && [ "$(hostname)" = sk-probe ] \
            && grep -q sk-probe /etc/hosts' sh "$probe" 2>&1)"; then
        rm -f "$probe"
        cannot_host "SHARDKIT_SLURM_NODES=$NODES: this machine cannot give a process its own hostname and /etc/hosts" \
            "(\`unshare -u -m\` + \`mount --bind\` failed: ${err:-no message}); a container needs CAP_SYS_ADMIN" \
            "(docker run --privileged, or --cap-add SYS_ADMIN), or use SHARDKIT_SLURM_NODES=1"
    fi
    rm -f "$probe"
}

write_munge_key() {
    local key="$STATE_DIR/munge/munge.key"
    if command -v mungekey >/dev/null 2>&1; then
        mungekey --create --keyfile "$key" --force
    else  # munge < 0.5.14 has no mungekey; any 1 KiB of random bytes is a valid key
        dd if=/dev/urandom of="$key" bs=1024 count=1 status=none
    fi
    chmod 0400 "$key"
}

write_slurm_conf() {
    # The node line is what slurmd measures here (CPUs, sockets, cores, memory), so a node is
    # never drained for "configuration differs from hardware"; NodeAddr (127.0.0.1, or each
    # namespaced node's own loopback address) keeps the daemons' traffic off name resolution.
    local node_line node nodes_lines partition_nodes slurmd_files
    node_line="$(slurmd -C | head -n 1)"
    node="$(sed -n 's/^NodeName=\([^ ]*\).*/\1/p' <<<"$node_line")"
    [ -n "$node" ] || { say "cannot read this host's node line from \`slurmd -C\`: $node_line"; exit 3; }
    if [ "$NODES" = 1 ]; then
        nodes_lines="$node_line NodeAddr=127.0.0.1 State=UNKNOWN"
        partition_nodes="$node"
        slurmd_files="SlurmdSpoolDir=$STATE_DIR/slurmd
SlurmdPidFile=$STATE_DIR/run/slurmd.pid
SlurmdLogFile=$STATE_DIR/log/slurmd.log"
    else
        # One line per namespaced node: the hardware measured here (they share it), the node's own
        # hostname (what its slurmd finds in its UTS namespace), address and port; %n gives each
        # slurmd its own spool folder, pid file and log.
        local hardware="${node_line#NodeName=* }" i name
        nodes_lines=""
        for i in $(seq "$NODES"); do
            name="$NODE_PREFIX$i"
            [ -z "$nodes_lines" ] || nodes_lines="$nodes_lines"$'\n'
            nodes_lines="${nodes_lines}NodeName=$name NodeHostname=$name NodeAddr=$NODE_NET.$i Port=$((SLURMD_PORT + i - 1)) $hardware State=UNKNOWN"
        done
        partition_nodes="$(node_names | paste -sd, -)"
        slurmd_files="SlurmdSpoolDir=$STATE_DIR/slurmd/%n
SlurmdPidFile=$STATE_DIR/run/slurmd-%n.pid
SlurmdLogFile=$STATE_DIR/log/slurmd-%n.log"
    fi
    cat >"$CONF" <<EOF
# Generated by launch/slurm_local_cluster.sh on $node: $NODES node(s), one partition, no accounting.
ClusterName=shardkit-local
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$STATE_DIR/ctld
SlurmctldPidFile=$STATE_DIR/run/slurmctld.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
$slurmd_files
# No cgroup in a container: track job processes through /proc, bind no tasks.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
MailProg=/bin/true
InactiveLimit=0
KillWait=10
MinJobAge=300
$nodes_lines
PartitionName=local Nodes=$partition_nodes Default=YES MaxTime=INFINITE State=UP
EOF
    CTLD_HOST="$node"
}

write_hosts_files() {
    # Every node resolves every node (and the controller's name) to its loopback address; a job's
    # MASTER_ADDR is the first node's name, as on a real cluster. One file per node, so a test can
    # change what one node resolves.
    local i name all
    mkdir -p -m 0755 "$STATE_DIR/hosts"
    all="# /etc/hosts of the nodes of $STATE_DIR (written by launch/slurm_local_cluster.sh)
127.0.0.1 localhost $CTLD_HOST
::1 localhost ip6-localhost ip6-loopback"
    for i in $(seq "$NODES"); do all="$all"$'\n'"$NODE_NET.$i $NODE_PREFIX$i"; done
    for name in $(node_names); do printf '%s\n' "$all" >"$STATE_DIR/hosts/$name"; done
}

start_namespaced_slurmd() {
    # unshare runs slurmd in new UTS + mount namespaces (mounts private: the bind mount stays in
    # them); slurmd daemonizes, and the namespaces end with it and the job steps it started.
    local name="$1"
    unshare -u -m sh -c 'hostname "$1" && mount --bind "$2" /etc/hosts && exec slurmd -f "$3" -N "$1"' \
        sh "$name" "$STATE_DIR/hosts/$name" "$CONF"
}

show_logs() {
    for f in "$STATE_DIR"/log/munged.log "$STATE_DIR"/log/slurmctld.log "$STATE_DIR"/log/slurmd*.log; do
        [ -f "$f" ] && { echo "--- $f (last 15 lines)" >&2; tail -n 15 "$f" >&2; }
    done
    return 0
}

node_state() {  # "idle" once every node is, else sinfo's states (one word per distinct state)
    local states
    states="$(timeout 10 sinfo -h -N -o '%t' 2>/dev/null | sort -u | paste -sd' ' -)"
    if [ "$states" = idle ] && [ "$(timeout 10 sinfo -h -N -o '%N' 2>/dev/null | sort -u | wc -l)" -ne "$NODES" ]; then
        states="idle on fewer than $NODES nodes"
    fi
    echo "$states"
}

start() {
    [ "$(uname -s)" = Linux ] || cannot_host "Slurm needs Linux (this is $(uname -s))"
    [ "$(id -u)" = 0 ] || cannot_host "must run as root (uid $(id -u)): the daemons start jobs as the" \
        "submitting user and apt-get may need to install Slurm; run it with sudo"
    local f running
    for f in "$STATE_DIR"/run/*.pid; do
        [ -e "$f" ] || continue
        running="$(pid_of "$f")"
        if [ -n "$running" ]; then
            say "$(basename "$f" .pid) already running (pid $running) for $STATE_DIR; run \`$0 stop\` first"
            exit 1
        fi
    done
    mkdir -p "$STATE_DIR"
    chmod 0755 "$STATE_DIR"
    install_slurm
    rm -rf "$STATE_DIR"/{munge,ctld,slurmd,run,log,hosts}
    mkdir -p -m 0700 "$STATE_DIR"/{munge,ctld,slurmd,log}
    mkdir -p -m 0755 "$STATE_DIR/run"
    if [ "$NODES" != 1 ]; then check_namespaces; fi
    write_munge_key
    CTLD_HOST=""
    write_slurm_conf
    if [ "$NODES" != 1 ]; then write_hosts_files; fi

    # munged daemonizes once its socket is ready
    munged --key-file "$STATE_DIR/munge/munge.key" --socket "$MUNGE_SOCKET" \
        --pid-file "$STATE_DIR/run/munged.pid" --log-file "$STATE_DIR/log/munged.log" \
        --seed-file "$STATE_DIR/munge/munged.seed" \
        || { say "munged did not start"; show_logs; exit 3; }
    # -c: a fresh state folder, nothing to recover; -f: our config, not /etc/slurm
    slurmctld -c -f "$CONF" || { say "slurmctld did not start"; show_logs; stop_daemons; exit 3; }
    if [ "$NODES" = 1 ]; then
        slurmd -f "$CONF" || { say "slurmd did not start"; show_logs; stop_daemons; exit 3; }
    else
        local name
        for name in $(node_names); do
            start_namespaced_slurmd "$name" || { say "slurmd of node $name did not start"; show_logs; stop_daemons; exit 3; }
        done
    fi

    local waited=0 state=""
    while [ "$waited" -lt "$START_TIMEOUT" ]; do
        state="$(node_state || true)"
        [ "$state" = idle ] && break
        if [ "$waited" -ge 3 ]; then  # all have written their pid files by now; a dead one never comes back
            local dead=""
            for f in "$STATE_DIR/run/slurmctld.pid" $(slurmd_pid_files); do
                [ -n "$(pid_of "$f")" ] || dead="$dead $(basename "$f" .pid)"
            done
            if [ -n "$dead" ]; then
                state="${state:-no answer}; exited:$dead"
                break
            fi
        fi
        sleep 1
        waited=$((waited + 1))
    done
    if [ "$state" != idle ]; then
        say "the node is not idle after ${waited}s (sinfo says: ${state:-no answer}); logs follow"
        show_logs
        stop_daemons
        exit 3
    fi
    say "cluster up in ${waited}s: $(sinfo -h -N -o '%N %t cpus=%c mem=%mMB partition=%P' | paste -sd';' -)" \
        "($(slurmctld -V))"
    say "use it with: export SLURM_CONF=$CONF"
    if [ "$NODES" != 1 ]; then
        say "$NODES nodes, each in its own UTS + mount namespace: $(node_names | paste -sd' ' -);" \
            "see one as its jobs do with \`$0 exec $NODE_PREFIX$NODES getent hosts ${NODE_PREFIX}1\`"
        return 0  # the namespaced nodes resolve each other through their own /etc/hosts
    fi
    local node
    node="$(sinfo -h -N -o '%N' | head -n 1)"
    if command -v getent >/dev/null 2>&1 && ! getent hosts "$node" >/dev/null 2>&1; then
        # the daemons use 127.0.0.1, but a job's MASTER_ADDR is the node's name (as on a real cluster)
        say "warning: this node's name '$node' does not resolve (getent hosts $node), so neither will" \
            "the MASTER_ADDR of launch/slurm_multinode.sbatch; add '127.0.0.1 $node' to /etc/hosts"
    fi
}

stop_daemons() {
    # Jobs first: slurmstepd and the job's processes outlive slurmd if they are not cancelled.
    if [ -n "$(pid_of "$STATE_DIR/run/slurmctld.pid")" ]; then
        local jobs
        jobs="$(timeout 10 squeue -h -o '%i' 2>/dev/null || true)"
        if [ -n "$jobs" ]; then
            # shellcheck disable=SC2086
            timeout 10 scancel $jobs || true
            for _ in $(seq 30); do
                [ -z "$(timeout 10 squeue -h -o '%i' 2>/dev/null || true)" ] && break
                sleep 1
            done
        fi
    fi
    # Every slurmd this state folder started (one, or one per namespaced node), then the rest.
    local f d pid
    for f in "$STATE_DIR"/run/slurmd*.pid "$STATE_DIR/run/slurmctld.pid" "$STATE_DIR/run/munged.pid"; do
        [ -e "$f" ] || continue
        d="$(basename "$f" .pid)"
        pid="$(pid_of "$f")"
        [ -n "$pid" ] || continue
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.2
        done
        if kill -0 "$pid" 2>/dev/null; then
            say "$d (pid $pid) ignored SIGTERM for 10s; killing it"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
}

status() {
    local any=0 f d pid
    for f in "$STATE_DIR/run/munged.pid" "$STATE_DIR/run/slurmctld.pid" $(slurmd_pid_files); do
        d="$(basename "$f" .pid)"
        pid="$(pid_of "$f")"
        if [ -n "$pid" ]; then echo "$d running (pid $pid)"; any=1; else echo "$d not running"; fi
    done
    [ "$any" = 1 ] && timeout 10 sinfo -N || true
}

exec_in_node() {
    [ "$#" -ge 2 ] || usage_error "usage: $0 exec NODE COMMAND [ARGS...] (got '$*')"
    local name="$1" pid
    shift
    pid="$(pid_of "$STATE_DIR/run/slurmd-$name.pid")"
    [ -n "$pid" ] || usage_error "no running slurmd for node '$name' in $STATE_DIR (with SHARDKIT_SLURM_NODES=$NODES" \
        "the nodes are: $(node_names | paste -sd' ' -)); start the cluster first"
    exec nsenter -t "$pid" -u -m -- "$@"
}

case "${1:-}" in
    start) check_settings; start ;;
    stop) stop_daemons; say "stopped (state and logs kept in $STATE_DIR)" ;;
    status) check_settings; status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    exec) check_settings; shift; exec_in_node "$@" ;;
    *) say "usage: $0 start|stop|status|env (got '${1:-}'); or $0 exec NODE COMMAND"; exit 1 ;;
esac
