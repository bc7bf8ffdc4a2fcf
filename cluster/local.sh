#!/usr/bin/env bash
# The local autoscaling cluster (cluster/local-autoscaling.yaml) started and stopped by pid.
#
#   cluster/local.sh up      # a head on 127.0.0.1:${PORT:-6379}, its job API on
#                            # http://127.0.0.1:${DASHBOARD_PORT:-8265}; fake CPU nodes come and go
#   cluster/local.sh down    # stops it, its fake nodes and their workers, and nothing else
#
# The autoscaler starts each fake node as a raylet that outlives the head's own processes,
# and `ray stop` would stop every Ray of this user on the machine (a `raypipe run`, a test
# suite). So `up` gives the cluster a temp dir of its own and `down` stops the `ray start`
# it ran, then the processes whose command line names that dir, and Ray's own processes
# (`ray::` workers, programs of the ray package) that hold a file in it open: the fake
# nodes' raylets and workers, by pid (a `tail -f` of its log, an editor, a driver of yours
# connected to it are left alone), and removes the dir.
# RAY (default: ray on PATH) and STATE (default: a file in ${XDG_RUNTIME_DIR:-~/.cache}/raypipe,
# a folder only you can write) may be set.
set -euo pipefail
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0  # 127.0.0.1 stays 127.0.0.1 (docs/security.md)
ray=${RAY:-ray}
state=${STATE:-${XDG_RUNTIME_DIR:-$HOME/.cache}/raypipe/local-cluster}
here=$(cd "$(dirname "$0")" && pwd)
me=$(id -u)

is_ray() {  # a Ray program: a ray:: worker, or one run from the ray package's own folders
    local cmd
    cmd=$(tr '\0' ' ' < "$1/cmdline" 2>/dev/null) || return 1
    [[ "$cmd" == ray::* || "$cmd" == */site-packages/ray/* || "$cmd" == */dist-packages/ray/* \
       || "$cmd" == */ray/_private/* || "$cmd" == */ray/dashboard/* \
       || "$cmd" == */ray/autoscaler/* || "$cmd" == */ray/core/src/ray/* ]]
}

with_children() {  # the pids on stdin and every process of this user descending from them
    local -A keep=() parent=()
    local p pid ppid stat grew=1
    while read -r p; do [ -n "$p" ] && keep[$p]=1; done
    for p in /proc/[0-9]*; do
        [ "$(stat -c %u "$p" 2>/dev/null)" = "$me" ] || continue
        stat=$(< "$p/stat") 2>/dev/null || continue
        read -r _ ppid _ <<< "${stat##*) }"  # after the name, which may hold spaces
        parent[${p#/proc/}]=$ppid
    done
    while [ "$grew" = 1 ]; do  # a tool a task started, holding its worker's log: the cluster's
        grew=0
        for pid in "${!parent[@]}"; do
            if [ -z "${keep[$pid]:-}" ] && [ -n "${keep[${parent[$pid]}]:-}" ] && [ "$pid" != "$$" ]; then
                keep[$pid]=1 grew=1
            fi
        done
    done
    for p in "${!keep[@]}"; do echo "$p"; done
}

pids_in() {  # this user's processes of the Ray whose temp dir is $1: its own arguments name
    local dir=$1 p  # it as their temp dir, or Ray's name or hold a file of its sessions
    for p in /proc/[0-9]*; do
        [ "${p#/proc/}" = "$$" ] && continue
        [ "$(stat -c %u "$p" 2>/dev/null)" = "$me" ] || continue
        if tr '\0' '\n' < "$p/cmdline" 2>/dev/null | grep -qE -- "^--temp[-_]dir=$dir\$" \
           || { is_ray "$p" && { tr '\0' '\n' < "$p/cmdline" 2>/dev/null | grep -qE -- "^$dir/session_" \
                                 || ls -l "$p/fd" 2>/dev/null | grep -qF -- "$dir/session_"; }; }; then
            echo "${p#/proc/}"
        fi
    done
}

taken() {  # whether something listens on 127.0.0.1:$1 already
    (exec 3<> "/dev/tcp/127.0.0.1/$1") 2> /dev/null
}

read_state() {  # pid and dir of the cluster `up` started, checked: never another's file
    [ -f "$state" ] && [ -O "$state" ] || { echo "no local cluster of yours is up (no $state)" >&2; exit 1; }
    read -r pid dir < "$state"
    if ! [[ "$pid" =~ ^[0-9]+$ ]] || [ "$pid" -le 1 ] || ! [[ "$dir" =~ ^/tmp/rpl-[A-Za-z0-9]{6}$ ]]; then
        echo "$state does not hold a cluster this script started: remove it" >&2
        exit 1
    fi
}

case "${1:-}" in
up)
    if [ -e "$state" ]; then
        echo "a local cluster is up already ($(cat "$state")): cluster/local.sh down first" >&2
        exit 1
    fi
    port=${PORT:-6379} dash=${DASHBOARD_PORT:-8265}
    for p in "$port" "$dash"; do
        if taken "$p"; then
            echo "127.0.0.1:$p is taken (another Ray?): set PORT= and DASHBOARD_PORT=" >&2
            exit 1
        fi
    done
    mkdir -p -m 700 "$(dirname "$state")"
    dir=$(mktemp -d /tmp/rpl-XXXXXX)  # short: Ray's socket paths live under it
    sed "s/^provider:$/provider:\n  gcs_address: 127.0.0.1:$port/" \
        "$here/local-autoscaling.yaml" > "$dir/autoscaling.yaml"
    RAY_FAKE_CLUSTER=1 setsid "$ray" start --head --block \
        --node-ip-address=127.0.0.1 --port="$port" --num-cpus=1 --dashboard-host=127.0.0.1 \
        --dashboard-port="$dash" \
        --autoscaling-config="$dir/autoscaling.yaml" --temp-dir="$dir" --disable-usage-stats \
        > "$dir/head.log" 2>&1 &
    head=$!
    echo "$head $dir" > "$state"
    for _ in $(seq 240); do  # up once its own session exists and its job API answers
        kill -0 "$head" 2> /dev/null || break
        if [ -e "$dir/session_latest" ] && taken "$dash"; then
            echo "up: RAY_ADDRESS=127.0.0.1:$port, job API http://127.0.0.1:$dash (ray's own" \
                 "commands need RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 to reach it on loopback;" \
                 "log: $dir/head.log; stop: cluster/local.sh down)"
            exit 0
        fi
        sleep 0.5
    done
    echo "the head did not come up (its log: $dir/head.log); stopping what started" >&2
    "$0" down > /dev/null || true
    exit 1
    ;;
down)
    read_state
    if [ -O "$dir" ] && tr '\0' ' ' < "/proc/$pid/cmdline" 2> /dev/null | grep -qF -- "--temp-dir=$dir"; then
        kill -TERM -- "-$pid" 2> /dev/null || true  # ray start --block and its session
        for _ in $(seq 60); do kill -0 "$pid" 2> /dev/null || break; sleep 1; done
        kill -KILL -- "-$pid" 2> /dev/null || true
    fi
    for _ in $(seq 50); do  # the fake nodes, outside that session: by the dir they use
        left=$(pids_in "$dir" | with_children)
        [ -z "$left" ] && break
        kill -KILL $left 2> /dev/null || true
        sleep 0.2
    done
    [ -O "$dir" ] && rm -rf -- "$dir"
    rm -f -- "$state"
    echo "down: stopped the cluster in $dir"
    ;;
*)
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
