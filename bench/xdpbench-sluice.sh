#!/usr/bin/env bash
# sluice_xdp as the daemon loads it, measured with ../shared/tools/xdpbench: the harness of
# the Katran reference figures (its README), so the figures compare with Katran's directly.
#
#   bench/xdpbench-sluice.sh [--record | OUT.json]      (root; after `cargo xtask build`)
#
# A fresh LB namespace runs `sluice run` with four VIPs of 16 backends each: IPv4 and IPv6,
# each once with flow_state "table" and once "second-chance". The backends are addresses in
# a second namespace behind a veth, with a TCP listener for the health checks and permanent
# neighbours on the LB side (the FIB next hop, as in the Katran runs). The program the
# daemon attached is pinned by id in a bpffs mounted outside /sys, next to xdpbench's
# XDP_PASS baseline, and every case runs ROUNDS times, interleaved, on CPU CPU. Raw lines
# (LABEL:repN <xdpbench -q line>) and a JSON summary, net of the same round's baseline, are
# written to OUT.json and OUT.txt: target/bench/xdpbench-sluice.* by default, so a run leaves
# the work tree clean, or with --record bench/results/xdpbench-sluice.* (the committed
# results). Environment: XDPBENCH_SRC, SLUICE, ROUNDS (3), N (200000), CPU (1).
set -euo pipefail

case "${1:-}" in
    --record) OUT=bench/results/xdpbench-sluice.json ;;
    -*) echo "usage: $0 [--record | OUT.json]" >&2; exit 2 ;;
    *) OUT=${1:-target/bench/xdpbench-sluice.json} ;;
esac
SRC=${XDPBENCH_SRC:-$(cd "$(dirname "$0")/../.." && pwd)/shared/tools/xdpbench}
[ -f "$SRC/xdpbench.c" ] || SRC=/work/shared/tools/xdpbench
SLUICE=${SLUICE:-target/release/sluice}
ROUNDS=${ROUNDS:-3}
N=${N:-200000}
CPU=${CPU:-1}
for tool in gcc clang-19 bpftool python3; do
    command -v "$tool" >/dev/null || { echo "missing $tool (apt-get install gcc clang-19 bpftool libbpf-dev python3)" >&2; exit 1; }
done
[ -x "$SLUICE" ] || { echo "no $SLUICE: run cargo xtask build" >&2; exit 1; }

W=$(mktemp -d /tmp/sluice-xdpbench.XXXXXX)
TAG=$$
LB=sxb-lb-$TAG
BE=sxb-be-$TAG
DAEMON=
HEALTH=
cleanup() {
    # Every step runs whatever the one before returned (a killed child's wait returns 143).
    set +e
    if [ -n "$DAEMON" ]; then kill "$DAEMON" 2>/dev/null; wait "$DAEMON" 2>/dev/null; fi
    if [ -n "$HEALTH" ]; then kill "$HEALTH" 2>/dev/null; wait "$HEALTH" 2>/dev/null; fi
    ip netns del "$LB" 2>/dev/null
    ip netns del "$BE" 2>/dev/null
    mountpoint -q "$W/bpf" && umount "$W/bpf"
    rm -rf "$W"
}
trap cleanup EXIT

gcc -O2 -Wall -o "$W/xdpbench" "$SRC/xdpbench.c" -lbpf
clang-19 -O2 -g -target bpf -I/usr/include/x86_64-linux-gnu -c "$SRC/xdp_pass.bpf.c" -o "$W/xdp_pass.bpf.o"
mkdir "$W/bpf"
mount -t bpf bpf "$W/bpf"

ip netns add "$LB"
ip netns add "$BE"
ip link add "xl$TAG" type veth peer name "xb$TAG"
ip link set "xl$TAG" netns "$LB"
ip link set "xb$TAG" netns "$BE"
# Room for the encapsulation on full-size client packets (native XDP on veth takes 3000).
ip -n "$LB" link set "xl$TAG" mtu 3000
ip -n "$BE" link set "xb$TAG" mtu 3000
ip -n "$LB" link set lo up
ip -n "$LB" link set "xl$TAG" up
ip -n "$LB" addr add 10.1.0.254/24 dev "xl$TAG"
ip -n "$LB" -6 addr add fd00:1::fe/64 dev "xl$TAG" nodad
ip netns exec "$LB" sysctl -qw net.ipv4.conf.all.forwarding=1 net.ipv4.conf.lo.forwarding=1 \
    net.ipv6.conf.all.forwarding=1 net.ipv6.conf.lo.forwarding=1
ip -n "$BE" link set lo up
ip -n "$BE" link set "xb$TAG" up
BE_MAC=$(ip -n "$BE" -j link show "xb$TAG" | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["address"])')
backends4=""
backends6=""
for i in $(seq 1 16); do
    ip -n "$BE" addr add "10.1.0.$i/24" dev "xb$TAG"
    ip -n "$BE" -6 addr add "fd00:1::$i/64" dev "xb$TAG" nodad
    ip -n "$LB" neigh replace "10.1.0.$i" lladdr "$BE_MAC" nud permanent dev "xl$TAG"
    ip -n "$LB" -6 neigh replace "fd00:1::$i" lladdr "$BE_MAC" nud permanent dev "xl$TAG"
    backends4+="  [[vip.backend]]
  address = \"10.1.0.$i\"
  health = { kind = \"tcp\", port = 8000 }
"
    backends6+="  [[vip.backend]]
  address = \"fd00:1::$i\"
  health = { kind = \"tcp\", port = 8000 }
"
done
# The health checks' listener (dual stack), for at most 10 minutes.
ip netns exec "$BE" timeout 600 python3 -c '
import socket
s = socket.socket(socket.AF_INET6)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("::", 8000)); s.listen(128)
while True:
    c, _ = s.accept(); c.close()
' &
HEALTH=$!

vip() { # name address flow_state backends
    printf '[[vip]]\nname = "%s"\naddress = "%s"\nport = 80\nflow_state = "%s"\n%s\n' "$1" "$2" "$3" "$4"
}
{
    cat <<EOF
[daemon]
bpffs = "$W/bpf/sluice"
state_file = "$W/state.json"
[admin]
socket = "$W/admin.sock"
audit_log = "$W/audit.jsonl"
[metrics]
enabled = false
[dataplane]
interfaces = [{ name = "xl$TAG" }]
hash_seed = 0x5eed
encap_source_v4 = "172.16.0.0/16"
encap_source_v6 = "fd00:5:1::/96"
[health]
interval = "200ms"
timeout = "150ms"
rise = 1
fall = 2
EOF
    vip t4 10.100.0.1 table "$backends4"
    vip s4 10.100.0.2 second-chance "$backends4"
    vip t6 fd00:100::1 table "$backends6"
    vip s6 fd00:100::2 second-chance "$backends6"
} >"$W/sluice.toml"
ip netns exec "$LB" "$SLUICE" run --config "$W/sluice.toml" >"$W/daemon.log" 2>&1 &
DAEMON=$!

P="$SRC/mkpkt.py"
F="$W/pkts"
mkdir "$F"
python3 "$P" set "$F" --vip 10.100.0.1 --vport 80 --client 10.0.0.2 --cport 12345 --nonvip 10.99.0.1 >/dev/null
for v in 1 2; do
    python3 "$P" one "$F/syn$v.pkt" --src 10.0.0.2 --dst "10.100.0.$v" --proto tcp --sport 12345 --dport 80 --flags S
    python3 "$P" one "$F/ack$v.pkt" --src 10.0.0.2 --dst "10.100.0.$v" --proto tcp --sport 12345 --dport 80 --flags A
    python3 "$P" one "$F/data$v.pkt" --src 10.0.0.2 --dst "10.100.0.$v" --proto tcp --sport 12345 --dport 80 --flags PA --frame-len 1514
    python3 "$P" one "$F/ack6_$v.pkt" --src 2001:db8::2 --dst "fd00:100::$v" --proto tcp --sport 12345 --dport 80 --flags A
done

# The daemon has attached; pin its program by id (the one on our veth) once all four VIPs
# steer (every backend up): bounded wait.
XB() { ip netns exec "$LB" "$W/xdpbench" -c "$CPU" -q "$@"; }
deadline=$((SECONDS + 60))
PROG=
while :; do
    if [ -z "$PROG" ]; then
        id=$(ip netns exec "$LB" bpftool -j net show dev "xl$TAG" 2>/dev/null |
            python3 -c 'import json,sys; x=json.load(sys.stdin)[0]["xdp"]; print(x[0]["id"] if x else "")' 2>/dev/null || true)
        if [ -n "$id" ]; then
            bpftool prog pin id "$id" "$W/bpf/sluice_xdp"
            bpftool prog load "$W/xdp_pass.bpf.o" "$W/bpf/xdpbench_pass" type xdp
            PROG=$W/bpf/sluice_xdp
        fi
    fi
    if [ -n "$PROG" ]; then
        ok=1
        for f in ack1 ack2 ack6_1 ack6_2; do
            XB -p "$PROG" -f "$F/$f.pkt" -n 10 -w 0 | grep -q "action=XDP_REDIRECT" || ok=0
        done
        [ $ok = 1 ] && break
    fi
    if [ $SECONDS -ge $deadline ] || ! kill -0 "$DAEMON" 2>/dev/null; then
        echo "the daemon did not steer all four VIPs through the FIB within 60 s; its log:" >&2
        cat "$W/daemon.log" >&2
        exit 1
    fi
    sleep 0.5
done
echo "pinned sluice_xdp (id $id) of daemon $DAEMON; measuring $ROUNDS rounds" >&2

RAW="$W/raw.txt"
run() { # label args...
    local label=$1
    shift
    echo "$label:rep$round $(XB "$@")" | tee -a "$RAW" >&2
}
# 200k established flows per mode: one unrecorded pass creates them (table mode), every
# round's measured pass hits them again (-V with the same offset).
for v in 1 2; do
    XB -p "$PROG" -f "$F/ack$v.pkt" -V -o 5000000 -n 199000 -w 1000 >/dev/null
done
for round in $(seq 1 "$ROUNDS"); do
    off=$((round * 1000000))
    run pass -p "$W/bpf/xdpbench_pass" -f "$F/ack1.pkt" -n "$N"
    run pass_1514 -p "$W/bpf/xdpbench_pass" -f "$F/data1.pkt" -n "$N"
    run nonvip -p "$PROG" -f "$F/nonvip.pkt" -n "$N"
    for v in 1 2; do
        mode=$([ $v = 1 ] && echo table || echo second_chance)
        run "$mode/established" -p "$PROG" -f "$F/ack$v.pkt" -n "$N"
        run "$mode/data_1514" -p "$PROG" -f "$F/data$v.pkt" -n "$N"
        # New flows, paced under Katran's flood-guard rate as in the reference; fewer calls
        # keep the SYN flows of all rounds from evicting the 200k established ones.
        run "$mode/syn_new" -p "$PROG" -f "$F/syn$v.pkt" -V -o "$((off + v * 100000))" -P 100000 -n 50000
        run "$mode/established_200k" -p "$PROG" -f "$F/ack$v.pkt" -V -o 5000000 -n 199000 -w 1000
        run "$mode/established_v6" -p "$PROG" -f "$F/ack6_$v.pkt" -n "$N"
    done
done

mkdir -p "$(dirname "$OUT")"
cp "$RAW" "${OUT%.json}.txt"
python3 "$(dirname "$0")/xdpbench_summary.py" "$RAW" "$OUT" "$0 $*" "$W/sluice.toml"
exit 0
