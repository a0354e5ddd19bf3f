#!/bin/sh
# tierproxy-entrypoint: the container's entrypoint (deploy/Containerfile installs it as
# /usr/local/bin/tierproxy-entrypoint). It
#   1. makes `iptables`, `ip6tables` and their -save/-restore tools the flavour (nf_tables or
#      legacy) that the node's kube-proxy and kubelet use, so that tierproxy's rules live in
#      the same netfilter frontend as theirs (rules of the two frontends both run, but each
#      frontend's tools see only their own, and mixing them is how rules go missing); then
#   2. runs its arguments, with the words of $TIERPROXY_AGENT_FLAGS (from the ConfigMap)
#      appended, as PID 1 (exec), so SIGTERM reaches the agent.
#
#   3. raises the soft open files limit to $TIERPROXY_NOFILE (default 165376: what the agent
#      needs for its default --max-connections 65536 and --max-udp-flows 16384, two
#      descriptors each, plus 512 relay pipes and 512 of its own; `tierproxy agent` logs
#      the plan), which needs no capability while the hard limit allows it. Below that the
#      agent takes fewer connections and says so in its log.
#
# TIERPROXY_IPTABLES_MODE: auto (default), nft or legacy. auto looks, in this order, for
#   - the chain KUBE-IPTABLES-HINT in the mangle table, which kubelet creates in the flavour
#     it uses (KEP-3178) for exactly this question;
#   - otherwise the flavour holding more rules (kube-proxy's KUBE-* chains);
#   - otherwise nft, the default of Debian bookworm's iptables and of current distributions.
# TIERPROXY_BIN_DIR (default /run/tierproxy/bin, an emptyDir): where the tool links go; it is
#   put first in PATH. The root file system can stay read-only.
# TIERPROXY_SBIN (default /usr/sbin): where iptables-nft* and iptables-legacy* are.
set -eu

mode="${TIERPROXY_IPTABLES_MODE:-auto}"
bindir="${TIERPROXY_BIN_DIR:-/run/tierproxy/bin}"
sbin="${TIERPROXY_SBIN:-/usr/sbin}"

say() { echo "tierproxy-entrypoint: $*" >&2; }

# The rules ("-A" lines) of flavour $1 in both families, one per line; nothing if its tools
# fail (a flavour whose kernel tables were never loaded, say).
dump() {
  for fam in iptables ip6tables; do
    "$sbin/$fam-$1-save" 2>/dev/null || true
  done
}

count_rules() {
  dump "$1" | grep -c '^-A' || true
}

has_hint() {
  dump "$1" | grep -q '^:KUBE-IPTABLES-HINT '
}

case "$mode" in
  nft | legacy) why="TIERPROXY_IPTABLES_MODE=$mode" ;;
  auto)
    if has_hint nft; then
      mode=nft why="kubelet's KUBE-IPTABLES-HINT chain is in nf_tables"
    elif has_hint legacy; then
      mode=legacy why="kubelet's KUBE-IPTABLES-HINT chain is in legacy iptables"
    else
      nft=$(count_rules nft)
      legacy=$(count_rules legacy)
      if [ "$legacy" -gt "$nft" ]; then
        mode=legacy
      else
        mode=nft
      fi
      why="no KUBE-IPTABLES-HINT chain; rules: nf_tables $nft, legacy $legacy"
    fi
    ;;
  *)
    say "TIERPROXY_IPTABLES_MODE must be auto, nft or legacy, not '$mode'"
    exit 2
    ;;
esac

mkdir -p "$bindir"
for tool in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
  flavoured=$(echo "$tool" | sed "s/tables/tables-$mode/")
  if [ ! -x "$sbin/$flavoured" ]; then
    say "$sbin/$flavoured is missing (iptables mode $mode)"
    exit 2
  fi
  ln -sf "$sbin/$flavoured" "$bindir/$tool"
done
PATH="$bindir:$PATH"
export PATH
say "iptables mode $mode ($why)"

want="${TIERPROXY_NOFILE:-165376}"
hard=$(ulimit -H -n)
if [ "$hard" = unlimited ] || [ "$hard" -ge "$want" ]; then
  ulimit -S -n "$want"
  say "open files limit $want"
else
  ulimit -S -n "$hard"
  say "open files hard limit $hard is below the $want the agent needs at its defaults: it takes fewer connections (its log says how many); raise the container runtime's limit (containerd: LimitNOFILE of its service; CRI-O: default_ulimits)"
fi

if [ "$#" -eq 0 ]; then
  say "no command given"
  exit 2
fi
# Word splitting of the flags is wanted; globbing is not.
set -f
# shellcheck disable=SC2086
exec "$@" ${TIERPROXY_AGENT_FLAGS:-}
