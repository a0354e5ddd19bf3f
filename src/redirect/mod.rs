//! Traffic redirection: tierproxy's netfilter ruleset as a value, and two backends that
//! install it (issue #3 "Redirection", DESIGN §3).
//!
//! A [`RulesetSpec`] (configuration + the node's local pod addresses + the node's own
//! addresses) is everything the ruleset depends on. A [`Backend`] renders it as the exact text
//! it applies ([`Backend::render`], golden-tested and shown by `--dry-run`), applies it
//! atomically and idempotently ([`Backend::apply`]), changes only the pod address sets
//! ([`Backend::update_pods`]) and removes every trace of it ([`Backend::remove`], which also
//! cleans up after a crash). [`select`] picks the backend, probing the kernel with [`probe`]
//! unless the configuration names one.
//!
//! # The rules, in order
//!
//! Interception sits in the mangle PREROUTING hook, the decision in mangle INPUT and
//! FORWARD (iptables: chain `TIERPROXY` jumped to from the top of `mangle PREROUTING`, chain
//! `TIERPROXY-DECIDE` from the top of `mangle INPUT` and `mangle FORWARD`; nftables: base
//! chains `prerouting`, `input` and `forward` of table `inet tierproxy` at priority
//! `mangle`, -150, the last two jumping to chain `decide`). Only packets entering the node
//! take PREROUTING; packets the node itself sends take OUTPUT, which tierproxy does not hook.
//!
//! **Why the decision comes after routing (issue #6, Services).** kube-proxy rewrites a
//! connection to a ClusterIP into one to a backend pod in nat PREROUTING (iptables) or a
//! `dstnat` chain (nftables, priority -100), i.e. after mangle PREROUTING (-150) and before
//! routing. A decision in PREROUTING saw the ClusterIP; in INPUT (TPROXY'd and node-bound
//! packets) and FORWARD (everything the kernel forwards: SCTP, flows not intercepted) the
//! header carries the backend pod and its target port, so policy is decided on the backend
//! pod, as the upstream e2e suite expects. Measured in namespaces (a TPROXY rule in
//! PREROUTING, an nft DNAT at -100, a transparent listener): the SYN is TPROXY'd before the
//! DNAT and the DNAT still applies, so the accepted socket's local address (`getsockname`,
//! the original destination) is the backend's `podIP:targetPort`, and conntrack un-NATs the
//! replies of that socket, so the client sees them come from `ClusterIP:port`. But the
//! later packets of the client's connection reach PREROUTING still addressed to the
//! ClusterIP: `socket --transparent` (rule 2), which looks the socket up by the header,
//! misses them and the handshake never completes (the client's connect succeeded, its data
//! timed out). Rule 3 catches them by a conntrack mark set with the TPROXY; with it the same
//! test passes. UDP needs no such rule: a datagram of a flow to a ClusterIP misses rule 2
//! too, is TPROXY'd to the listener (with its post-DNAT original destination, by which the
//! proxy finds the flow) and decided again (a cache hit). Tested end to end by
//! `tests/service_netns.rs` with the lab's kube-proxy-like DNAT. The alternative, resolving
//! Services from EndpointSlices in tierproxy, would have to pick the backend itself (the
//! proxy would be kube-proxy) to decide on the pod the connection really reaches.
//!
//! kube-proxy's IPVS mode is not covered: IPVS rewrites in LOCAL_IN after mangle INPUT
//! (at `NF_IP_PRI_NAT_SRC - 2`), so the decision still sees the ClusterIP there.
//!
//! raw PREROUTING (`TIERPROXY-SOURCE`, nft `source`, priority raw - 10, before
//! conntrack and before everything below), issue #17:
//!
//! S. **Sources a pod cannot own → drop.** A pod with CAP_NET_RAW (every root container has
//!    it) writes any source address it likes; the ruleset and the decider trust the source,
//!    so a forged one must never get past this chain.
//!    1. Packets arriving on `lo` return: the only packets of the node itself that enter
//!       PREROUTING are those it sends to itself over loopback (its packets to pods leave
//!       through OUTPUT and never come back through PREROUTING).
//!    2. A packet carrying one of the node's own addresses as its source, arriving on any
//!       other interface, is dropped, whatever [`RedirectConfig::source_check`] says: the
//!       "from the node itself" exemption (rule 4, DESIGN §2's kubelet probes) holds only for
//!       what the node itself sent. IPv4 routing drops such martians itself (a local source
//!       on an incoming packet), IPv6 does not: without this rule a pod using its node's
//!       IPv6 address reached pods that policy denies it, undecided and unaudited, on its
//!       own node and across nodes.
//!    3. With [`RedirectConfig::source_check`] (default on): a packet arriving on a local
//!       pod's interface (set `<prefix>-podif-v4`/`-v6`, `hash:net,iface` holding `0/0,IFACE`
//!       per interface; nft set `podif` of `ifname`) whose source the node does not route
//!       back through that interface is dropped (`-m rpfilter --invert`; nft `fib saddr .
//!       iif oif missing`). The interfaces are read from the kernel's routes to the local
//!       pods' addresses ([`Backend::pod_interfaces`]), so a pod can send only from its own
//!       addresses: not another pod's (local or remote), not the node's, not an external
//!       address. Bridged CNIs (one `cni0` for every pod) give the bridge as the interface:
//!       a pod can then still use the address of another pod on the same bridge.
//!
//!    Both drops are counted ([`Backend::drop_counts`]). Both backends test the pod
//!    interfaces first when the check is on and send those packets to a chain of their
//!    own (`TIERPROXY-POD-SOURCE`, nft `pod_source`; `-g` / `goto`), whose reverse-path
//!    check is all that is left for them: it drops a node's own address too (rpfilter
//!    without `--accept-local`, and nft `fib`, reject a source whose route is local), so a
//!    pod's packet costs one set lookup in this chain rather than two (0.91× the chains'
//!    CPU per UDP request and answer, measured in docs/architecture.md, "The rule walk's
//!    matches"). A pod forging its node's address is then counted as a source not routed
//!    via its interface.
//!
//!    **Where the kernel has nft, chains S and 0 are nft rules on the iptables backend
//!    too** ([`IptablesBackend::with_nft_after_dnat`]): table `inet <prefix>-dnat` holds
//!    them with their own sets (local pods, node addresses, enforced pods, pod
//!    interfaces, kept beside the ipsets the mangle chains read), and the raw table holds
//!    none of tierproxy's rules. Every packet entering a node walks these chains, and a
//!    native set lookup or `fib` costs it less than the xt `set` and `rpfilter` matches
//!    iptables-nft runs through its compatibility layer, and one base chain less (the raw
//!    table's PREROUTING): the machine's CPU per UDP datagram 0.94× on one node and across
//!    nodes, per DNS-like flow 0.97× and 0.94× (docs/architecture.md, "The raw chains in
//!    nft").
//!
//! raw PREROUTING and OUTPUT (`TIERPROXY-ZONE-IN`, `TIERPROXY-ZONE-OUT`; nft `zone_in`,
//! `zone_out`, priority raw, before conntrack), when [`RedirectConfig::upstream_zone`] is
//! not 0:
//!
//! 0. **The proxy's upstream legs → their own conntrack zone.** Packets of the upstream
//!    sockets (bypass mark, OUTPUT), and packets to them (PREROUTING: from or to a local
//!    pod, of a socket whose `SO_MARK` is the bypass mark, transparent or not: a leg from
//!    the node's own address is an ordinary socket; iptables reads the mark with `socket
//!    --restore-skmark` and clears the bits again, nft with `socket mark`), get `CT
//!    --zone` (nft `ct zone set`); one socket lookup per packet (a packet from a local pod
//!    to another is looked up only by the rule for packets from a local pod). An upstream
//!    leg is bound to the client's address with a port the node's kernel picks, unaware
//!    of the client kernel's ports, so the legs of two connections can share a 4-tuple; in
//!    one zone, conntrack drops the second leg's SYN when it confirms it (`insert_failed`),
//!    and the client retransmits a second later. Measured in the load-test lab before this rule:
//!    18 of 10,000 connections at concurrency 8 lost their SYN, and new connections/s
//!    fell from 2,600 at concurrency 1 to 2,500 at 8; with it, none, and 4,000/s. The
//!    client legs stay in the default zone, where kube-proxy's DNAT and the conntrack
//!    mark of rule 3 live. So do the agent's own ICMP errors (refusals of rejected
//!    datagrams, relayed port unreachables: `proxy::reject`, `proxy::icmp`), which carry
//!    the bypass mark too: OUTPUT's zone rule spares ICMP and ICMPv6, so that conntrack
//!    finds the client's flow they quote (RELATED) and NAT un-does a ClusterIP's DNAT on
//!    them, as on the kernel's own errors.
//!
//!    **A leg to a pod is untracked** (`-j NOTRACK`, nft `notrack`) when the pod is
//!    local or on a node whose agent enforces (the enforced sets of rule 6): in OUTPUT, a
//!    packet of an upstream socket (not ICMP) to such a pod's address, first; in
//!    PREROUTING, a packet from a local pod to an upstream socket (a reply from a pod
//!    belongs to a leg to that pod), and one from elsewhere whose socket the rule for
//!    packets to a local pod found, when it comes from an enforcing node's pod (chain
//!    `TIERPROXY-ZONE-LEG`, nft `zone_leg`, after that rule's one socket lookup, so that
//!    the packets the kernel forwards to a local pod are still looked up once). Such a leg
//!    needs no NAT (it goes to the pod itself: the client leg's DNAT happened before the
//!    proxy took it, `getsockname` gives the backend; pod-to-pod traffic is never NATed)
//!    and nothing of the ruleset reads its state: rules 2 and 3a take its later packets
//!    whatever their state (3a names `UNTRACKED`), and the decision chain returns TCP past
//!    its SYN. The leg's entry (created, confirmed, looked up by every packet, destroyed)
//!    was half the conntrack work of a connection on one node, and conntrack ~7 % of its
//!    CPU; one entry per such connection is left in the table instead of two (issue #18;
//!    `docs/architecture.md`, "The upstream leg to a local pod, untracked"). A leg to
//!    anywhere else (an external address, a node without an enforcing agent) keeps the
//!    zone: its packets may need the node's SNAT (masquerading), which needs conntrack.
//!    (xt `CT --zone` skips a packet that has its conntrack information, an untracked one
//!    too; nft's `ct zone set` does not, so the nftables backend's untracked rules return.)
//!    With `--upstream-zone 0` none of these rules exists and the legs share the default
//!    zone, as before rule 0.
//!
//!    **TCP between two local pods is untracked, both legs** (nft only: table
//!    `inet <prefix>-dnat` on the iptables backend). In `zone_in`, before the socket
//!    lookups above: TCP whose source and destination are local pods' addresses,
//!    `notrack`, return. Every TCP connection between two pods of the node is proxied
//!    here, so such a packet is a client leg's (its SYN included) or an upstream leg's
//!    reply. Rule 6 sends such an untracked SYN to the proxy's second listener
//!    ([`RedirectConfig::local_pods_port`]), whose `SO_MARK` is the bypass mark: its
//!    request sockets (the SYN-ACK) and accepted sockets take that mark, so the proxy's
//!    side of these client legs leaves through `zone_out`'s rule for upstream sockets to a
//!    local pod, untracked. Nothing reads these connections' state: pod addresses are
//!    never NATed, and rule 3's conntrack mark (for a SYN cookie's ACK) has an untracked
//!    form. The client leg's entry (created by the SYN, confirmed, looked up by every
//!    packet, then held in conntrack's TIME_WAIT) was the last conntrack entry of a
//!    connection on one node (issue #18; docs/architecture.md, "The client leg between
//!    local pods, untracked"). Not by addresses in `zone_out`: a connection to a ClusterIP
//!    whose backend is a local pod is tracked (raw sees the ClusterIP) and goes to the
//!    first listener after its DNAT, with the backend's address as its socket's, and the
//!    proxy's packets of it need conntrack's reverse NAT to leave from the ClusterIP.
//!    Nor to another node's pod: on a server's node, a local pod's reply to a connection
//!    the kernel forwards from an enforced pod is the same packet as a client leg's.
//!
//! PREROUTING (`TIERPROXY`, nft `prerouting`):
//!
//! 1. **Bypass mark → return untouched.** The proxy's upstream sockets carry `SO_MARK` =
//!    bypass mark; when such a packet re-enters PREROUTING (delivery over `lo`) nothing of
//!    tierproxy may touch it, or the proxy would intercept itself. First, so no later rule
//!    sees it.
//! 2. **`socket --transparent` → route and decided mark, accept.** A packet belonging to an
//!    established transparent socket of this host: the client leg of a proxied connection
//!    (the listener's accepted sockets inherit `IP_TRANSPARENT`), and the replies to the
//!    proxy's source-preserving upstream leg, whose socket is bound to the client's address.
//!    Their destination is not local, so the route mark sends them to the local routing table
//!    (Documentation/networking/tproxy.rst, "Redirecting traffic"; iptables-extensions(8),
//!    "socket": `--transparent`; listening sockets bound to the any-address are ignored, as
//!    without `--nowildcard`, nft: `socket wildcard 0`). The decided mark keeps them out of
//!    the queue in INPUT; without this rule upstream connects time out. **Not a TCP SYN**
//!    (two rules: TCP that is not a SYN, and every other protocol): the socket lookup
//!    finds TIME_WAIT sockets too (a TIME_WAIT socket is transparent when the socket it
//!    came from was). When a server closes first, the proxy's client leg makes the active
//!    close and holds the client's 4-tuple in TIME_WAIT for a minute; a client reusing that
//!    source port sent its SYN to the TIME_WAIT socket, which, finding no listener at the
//!    original destination, answered with a bare ACK: the client reset it and sent its SYN
//!    again (measured: 8 resets and 8 retransmissions for 8 reused ports, a stall of up to
//!    a second each; issue #18). A SYN goes on to rule 6, whose TPROXY hands a SYN that
//!    meets a TIME_WAIT socket to the listener and ends the TIME_WAIT
//!    (`nf_tproxy_handle_time_wait4`/`6`, used by xt TPROXY and nft `tproxy` alike).
//! 3. **TCP, not a SYN, original direction, conntrack mark = route mark:** a later packet of
//!    a connection whose SYN rule 6 TPROXY'd (it set the conntrack mark, iptables `CONNMARK`,
//!    nft `ct mark set`, reusing the route mark's bit) that no socket took in rule 2.
//!    - **Destination rewritten by a DNAT after this hook** (`ctstate DNAT`: a ClusterIP;
//!      see above) → as rule 2: rule 2 looked the socket up by the header as it is here,
//!      before the DNAT, and missed; after the DNAT the kernel finds it. Better, where
//!      the kernel has nft's `tproxy` and `socket`: a chain right after the DNAT
//!      (`proxied`, priority -99; the nftables backend's own table, or for the iptables
//!      backend table `inet <prefix>-dnat`) looks the socket up by the rewritten header,
//!      and tproxies a packet no socket owns to the listener, so a SYN cookie completes
//!      for a ClusterIP too.
//!    - **Otherwise → TPROXY to the listener**, as tproxy.rst's own example TPROXYs every
//!      packet no socket owns. This is what completes a SYN cookie: when the listener's SYN
//!      queue is full the kernel answers a SYN with a cookie and keeps no request socket,
//!      so the client's ACK matches no socket in rule 2; TPROXY hands it to the listener,
//!      whose cookie check creates the connection. Before this rule such connections hung
//!      for good (the client's connect succeeded, the proxy never accepted them, and the
//!      kernel cannot reset from an address that is not its own). A DNAT'd connection
//!      cannot be completed in this hook: xt TPROXY runs only in the mangle table, before
//!      the DNAT, where it would look the established socket up by the ClusterIP, miss,
//!      and hand the connection's every later packet to the listener, which resets them.
//!      The chain after the DNAT (above) does it; without nft's `tproxy` (an iptables
//!      node whose kernel lacks CONFIG_NFT_TPROXY or CONFIG_NFT_SOCKET, or has no `nft`),
//!      a cookie-completed connection to a ClusterIP still hangs, which [`select`] says.
//!
//!    - **Untracked, between two local pods** (rule 0 untracks them; nft only, see
//!      there) → TPROXY to the local pods' listener, counted with rule 6's stray drops: a
//!      SYN cookie's ACK completes there as above (the cookie is that listener's), and any
//!      other segment no socket took belongs to no connection the proxy holds (a scan, a
//!      stale segment, a connection between the two pods older than the ruleset), which
//!      the listener resets (an ACK) or discards, so it never reaches its target, as rule
//!      6's drop ensures for tracked TCP. Without a listener it is dropped (xt TPROXY; nft:
//!      a drop rule follows unless [`RedirectConfig::queue_bypass`]).
//!
//!    **Rule 3a: any other TCP that is not a SYN, conntrack state `ESTABLISHED`, `RELATED`
//!    or `UNTRACKED` (neither `INVALID` nor `NEW`) → return.** A later packet of an
//!    established connection that rules 2 and 3 did not take (a connection the kernel
//!    forwards: from an enforced pod, or between two addresses this node does not proxy):
//!    nothing below acts on it (rule 4 returns, rule 5 is UDP's, rule 6 acts on SYNs and
//!    drops only new or invalid TCP past a SYN), so it returns here instead of walking
//!    them. Every packet of a connection across nodes crosses the server's node this way,
//!    in the sender's context (on one node, a client's packets reach the proxy's sockets
//!    in rule 2). Before this rule each one went on through rules 4 to 6: their set
//!    lookups and the intercept chain.
//! 4. **From the node's own addresses over `lo` → return.** Traffic the node sends to
//!    itself; no queue trip (chain S dropped every other packet with a node source).
//!
//! **The kernel UDP path** ([`RedirectConfig::udp_path`] = [`UdpPath::Kernel`], the
//! default; issue #20): every UDP packet returns right after rule 1 (it is neither
//! TPROXY'd nor owned by a proxy socket), and raw's upstream-leg rules (rule 0) skip UDP:
//! in iptables each rule's protocol test comes first; in nft a UDP packet returns from
//! `zone_in` right after its bypass-mark rule, before any of the chain's pod-set
//! lookups (measured in docs/architecture.md, "Measured: UDP through the kernel"). In
//! the decide chain a UDP packet whose conntrack entry is confirmed
//! returns first; a flow's first datagram is queued ([`QueueWhen::Unconfirmed`]) and,
//! allowed, repeated with the decided mark, which adds its class to the kernel-side
//! cache of allowed classes; a later flow of a cached class returns without a queue trip
//! and its entry gets the decided mark's bits as its connection mark, by which the
//! agent finds it in conntrack's new events (`proxy::forwarded`). After the decision
//! (nftables: the decide chain; iptables: table `inet <prefix>-dnat`'s base chains at
//! mangle + 1, where [`Backend::spares_new_events`]), `ct event set destroy` spares the
//! new event of an entry the agent has no use for: a flow decided at the queue (the
//! packet carries the decided mark), and every cached flow but one in
//! [`RulesetSpec::cached_udp_sample`] (`numgen inc mod n`; every one with n = 1, none with
//! 0). A datagram the queue answers with the decided and reject bits together ("allowed,
//! not cached": audit logs its class in full) does not add its class to the cache. Where
//! rules 2–7 name UDP, they describe the proxy path (`--udp-path proxy`).
//!
//! 5. **UDP to the node's own addresses, not `ctstate NEW` → return.** The proxy cannot
//!    take a hostNetwork server's address and port for its reply socket, so UDP to the node
//!    is decided on its first packet (rule 7) and then delivered by the kernel, like SCTP.
//!    The first datagram marks its connection (`CONNMARK` / `ct mark` with the route bit,
//!    which otherwise marks TCP connections only), here, before any DNAT; later datagrams
//!    return by that mark, in both directions. A node port's flow is DNAT'd to a pod, so
//!    its answers come from a local pod: matched by the node's address they were taken
//!    for a UDP flow of their own (rule 6) and proxied to the client from the node's
//!    address (`--udp-path proxy`; found by `tests/service_netns.rs`).
//! 6. **Source or destination a local pod → intercept** (iptables chain
//!    `TIERPROXY-INTERCEPT`): first, TCP that is not a SYN and that conntrack sees as `NEW`
//!    (picked up mid-stream) or `INVALID` is dropped and counted: it belongs to no
//!    connection any decision allowed (an ACK, FIN or Xmas scan from a pod), and forwarded
//!    it would reach its target undecided, which answers it and so tells a scanning pod
//!    which ports are open (a FIN to a closed port is reset, to an open one not). Then TCP
//!    from an **enforced pod** (a pod on another node whose agent enforces; sets
//!    `<prefix>-enforced-v4`/`-v6`, nft `enforced-v4`/`-v6`,
//!    [`RulesetSpec::with_enforced_pods`]) returns: its node's agent proxied the connection
//!    and decided its egress and this pod's ingress already, so this node decides the
//!    ingress again on the SYN (rule 7) and lets the kernel forward the connection instead
//!    of terminating it a second time (issue #18). Then an untracked TCP SYN between two
//!    local pods (rule 0) goes to the local pods' listener
//!    ([`RedirectConfig::local_pods_port`]). Then TCP
//!    SYNs (first their conntrack mark, rule 3) and UDP not to the node's own addresses
//!    ([`tproxy_protocols`]) are TPROXY'd to the listeners (`--on-ip`
//!    [`RedirectConfig::tproxy_addr_v4`]/`_v6`, `--on-port` [`RedirectConfig::tproxy_port`])
//!    with `--tproxy-mark` = route mark, so policy routing delivers them locally (tproxy.rst,
//!    "TPROXY target"; iptables-extensions(8), "TPROXY"). xt TPROXY drops a packet for which
//!    no listener exists; nft's `tproxy` continues with the next rule instead, so the
//!    nftables backend follows it with a drop (fail-closed only: with
//!    [`RedirectConfig::queue_bypass`] such packets pass).
//!
//! INPUT and FORWARD (`TIERPROXY-DECIDE`, nft `decide`):
//!
//! 7. **Bypass mark, TCP past its SYN, decided mark, from the node over `lo`, UDP to the
//!    node not NEW → return** (as rules 1, 2/3, 4, 5; every TCP rule of the chain is for
//!    SYNs, so every later packet of a connection returns before them; a TCP SYN with the
//!    decided mark, repeated by an allow verdict, first adds its class — client,
//!    destination port, server — to the
//!    **kernel-side cache of allowed classes**, sets `<prefix>-allowed-v4`/`-v6`, nft
//!    `allowed-v4`/`-v6`, with a timeout of [`ALLOWED_CACHE_SECS`], emptied at every new
//!    snapshot by [`Backend::flush_allowed`]); then a TCP SYN of a cached class returns
//!    (no queue trip: the proxy decides and audits it as it accepts it); then **a packet of
//!    TCP, UDP or SCTP whose source or destination is
//!    a local pod → NFQUEUE**: TCP SYNs, SCTP when `ctstate NEW`, every UDP datagram
//!    ([`QueueWhen`] says why each). A TCP SYN without the route mark (rule 6 did not
//!    TPROXY it: from an enforced pod) goes to the kernel-forwarded flows' queue, as SCTP
//!    does: the balanced queues may fail open, and what they pass undecided must reach the
//!    proxy, which such a SYN never does. The first packet of every pod flow, egress (source is a
//!    local pod) and ingress (destination is a local pod), goes to userspace before any
//!    handshake, so a denied connection times out (DESIGN §3): a TPROXY'd SYN is queued in
//!    INPUT before the TCP stack sees it. Flows are balanced over the configured queues by
//!    flow hash (`--queue-balance first:last`; nft `queue num first-last`). `--queue-bypass`
//!    (nft `bypass`) only when [`RedirectConfig::queue_bypass`] is set: then the kernel
//!    accepts packets while no program reads the queue (fail-open; the proxy then decides a
//!    TCP or UDP flow itself when it accepts it); otherwise it drops them (fail-closed)
//!    (iptables-extensions(8), "NFQUEUE"). Because interception now precedes the decision,
//!    fail-open no longer covers a node whose agent is gone but whose iptables rules stay:
//!    xt TPROXY drops intercepted packets without a listener. The decider answers an allowed
//!    packet with the REPEAT verdict and the decided mark, so the packet walks the hook
//!    again and this chain returns it; a decided SCTP INIT (and anything not intercepted)
//!    is then forwarded by the kernel (the proxy does not terminate SCTP; denied
//!    associations time out, rejected ones get an ABORT from the agent).
//!
//! **Each chain once a packet.** Rules 6 and 7 test the source, then the destination,
//! against the local pods; a packet between two pods of the node matches both. The
//! iptables backend goes to the intercept and queue chains (`-g`), so what they return or
//! let fall through ends the walk of `PREROUTING` or `INPUT`/`FORWARD` there, and the
//! queue chain looks a class up in the cache once a packet (a UDP flow of a cached class:
//! the rule that queues the uncached ones looked it up, the connection mark follows
//! without a second lookup). The nftables backend has the same rules in one chain, each
//! packet leaving at its first verdict. Before: a same-node SYN of a cached class was
//! looked up twice, a same-node flow of a cached UDP class four times, and a packet the
//! chains do not act on walked both twice (issues #18 and #20; tested by
//! `datapath_netns`'s rule counters).
//!
//! Policy routing (`ip rule fwmark ROUTE/MASK lookup TABLE priority P`, `ip route local
//! default dev lo table TABLE`, both families) is installed and removed with the ruleset,
//! see `routing.rs`.
//!
//! # Backends
//!
//! * [`IptablesBackend`]: ipset `hash:ip` sets filled by `ipset restore` and swapped in
//!   atomically, tierproxy's own chains replaced by one `iptables-restore --noflush` per
//!   family, jumps from `mangle PREROUTING`, `INPUT` and `FORWARD` inserted when missing.
//!   Works on every kernel with xt NFQUEUE/TPROXY/socket/connmark and ipset; this is the
//!   backend CI exercises. Where nft's `tproxy`, `socket`, `reject` and `fib` work, it
//!   adds table `inet <prefix>-dnat` (rule 3 after the DNAT, the refusal chains, and
//!   chains S and 0 in place of its raw table's xt rules).
//! * [`NftablesBackend`]: one `inet` table built in one transaction through the `nftables`
//!   crate's typed JSON API. Needs CONFIG_NFT_QUEUE, which the development machines lack.
//!
//! # What a node needs
//!
//! * iptables backend: `iptables`, `ip6tables`, `iptables-restore`, `ip6tables-restore`,
//!   `iptables-save`, `ip6tables-save` (nf_tables or legacy flavour), `ipset`, and `ip`
//!   (iproute2 with `-j`); kernel options CONFIG_NETFILTER_XT_TARGET_NFQUEUE,
//!   CONFIG_NETFILTER_XT_TARGET_TPROXY, CONFIG_NETFILTER_XT_MATCH_SOCKET,
//!   CONFIG_NETFILTER_XT_MATCH_CONNTRACK, CONFIG_NETFILTER_XT_MATCH_MARK,
//!   CONFIG_NETFILTER_XT_CONNMARK (`connmark` match, `CONNMARK` target),
//!   CONFIG_NETFILTER_XT_TARGET_MARK, CONFIG_NETFILTER_XT_MATCH_COMMENT,
//!   CONFIG_NETFILTER_XT_TARGET_CT with CONFIG_NF_CONNTRACK_ZONES (rule 0; the raw table),
//!   CONFIG_NETFILTER_XT_SET with CONFIG_IP_SET_HASH_IP and CONFIG_IP_SET_HASH_NETIFACE,
//!   CONFIG_NETFILTER_XT_MATCH_RPFILTER and CONFIG_IP6_NF_MATCH_RPFILTER (chain S),
//!   CONFIG_NETFILTER_NETLINK_QUEUE, and
//!   with the nf_tables flavour CONFIG_NFT_COMPAT; IPv6 enabled; `lo` up.
//! * nftables backend: `nft` (JSON support, nftables ≥ 0.9.3) and `ip`; CONFIG_NFT_QUEUE,
//!   CONFIG_NFT_TPROXY, CONFIG_NFT_SOCKET (with `socket mark`), CONFIG_NFT_FIB_INET
//!   (chain S), CONFIG_NFT_CT
//!   with CONFIG_NF_CONNTRACK_ZONES, CONFIG_NFT_REJECT_INET (rule 8),
//!   CONFIG_NETFILTER_NETLINK_QUEUE.
//! * iptables backend, optional: `nft` with CONFIG_NFT_TPROXY, CONFIG_NFT_SOCKET and
//!   CONFIG_NFT_REJECT_INET, for the chain after the DNAT that completes SYN cookies to
//!   ClusterIPs and for the refusal chains (rule 8) (table `inet <prefix>-dnat`; used
//!   when [`select`] finds them).
//! * Both: CAP_NET_ADMIN.
//!
//! # The decider's side of the contract
//!
//! An allowed first packet must be answered with NF_REPEAT and a mark of
//! `(mark & !decided.mask) | decided.value`: the verdict's mark attribute (NFQA_MARK)
//! replaces the whole `skb->mark`, so other owners' bits must be carried over. A denied
//! packet is answered with NF_DROP (no RST, no ICMP). A rejected one (an Antrea `Reject`
//! rule, issue #22) is answered with NF_DROP too, and the agent itself sends its client the
//! refusal (`proxy::reject`: a TCP RST, ICMP administratively prohibited, an SCTP ABORT)
//! on a raw socket carrying the bypass mark, so rule 1 (and rule 7) return it untouched
//! where it comes back in over `lo`; dropped in the queue, it never goes on. Except where
//! the queue passed no conntrack entry (a kernel without
//! CONFIG_NETFILTER_NETLINK_GLUE_CT): only the kernel then knows the ClusterIP or NodePort
//! a DNAT'd client used, so a rejected TCP SYN or kernel-path UDP datagram is answered with
//! NF_ACCEPT and `(mark & !reject.mask) | reject.value`, and rule 8 refuses it.
//!
//! INPUT and FORWARD, priority mangle + 1 (-149; nft base chains `refuse_input` and
//! `refuse_forward`, in the nftables backend's table or the iptables backend's `inet
//! <prefix>-dnat`, [`Backend::refuses`]):
//!
//! 8. **Reject mark → the kernel's reject** (each base chain tests the mark and jumps to
//!    chain `refuse`, so every other packet of the hooks costs one rule): `reject with tcp
//!    reset` for TCP, `icmp host-prohibited` (code 10) for other IPv4, `icmpv6
//!    admin-prohibited` (code 1) for other IPv6: the agent's own answers. The reject
//!    attaches the packet's conntrack entry to its answer, and NAT un-does the DNAT on it
//!    (nft(8), "REJECT STATEMENT"; `nf_send_reset`, `icmp_send`). Right after the decision,
//!    so that no other program's chain sees the accepted packet first; the reader hands
//!    packets over only once these chains are installed (`proxy::reject::KernelRefusal`).
//!
//! What was found on the development machines (kernel 6.18): `nft ... queue` fails with
//! "No such file or directory" (CONFIG_NFT_QUEUE unset), even under `nft -c`, which [`probe`]
//! uses; `nft` `tproxy` and `socket` work. `iptables` is `iptables v1.8.9 (nf_tables)`;
//! NFQUEUE, TPROXY, socket and set work with it (through nft_compat) and with
//! `iptables-legacy`. [`IptablesBackend::new`] uses the default `iptables`;
//! [`IptablesCommands::legacy`] selects the legacy tools for nodes whose kube-proxy uses them.

mod exec;
mod iptables;
mod nft;
mod routing;

use std::collections::BTreeSet;
use std::fmt;
use std::net::IpAddr;

use crate::config::{BackendChoice, ConfigError, RedirectConfig, UdpPath};

pub use self::iptables::{IptablesBackend, IptablesCommands};
pub use self::nft::NftablesBackend;

/// Comment of rule 5's connection mark on the first datagram of a UDP flow to the node.
pub(crate) const COMMENT_UDP_TO_NODE: &str = "tierproxy: UDP to the node itself, marked";

/// Comment of chain S's rule 2, by which [`Backend::drop_counts`] finds its counter.
pub(crate) const COMMENT_NODE_SOURCE: &str = "tierproxy: node address from outside, forged";
/// Comment of chain S's rule 3.
pub(crate) const COMMENT_POD_SOURCE: &str = "tierproxy: source not routed via its pod interface";
/// Comment of rule 6's return for TCP from an enforced pod (not proxied a second time).
pub(crate) const COMMENT_ENFORCED: &str = "tierproxy: from a pod its own node proxied";
/// Comment of rule 6's drop of TCP that belongs to no decided connection.
pub(crate) const COMMENT_STRAY_TCP: &str = "tierproxy: TCP of no decided connection";
/// Comment of rule 0's notrack of TCP between two local pods (raw PREROUTING and OUTPUT).
pub(crate) const COMMENT_LOCAL_PODS_TCP: &str = "tierproxy: TCP between local pods, untracked";
/// Comment of rule 3's hand-over to the listener of untracked TCP between two local pods
/// past its SYN that no socket took; counted with [`COMMENT_STRAY_TCP`]'s drops.
pub(crate) const COMMENT_LOCAL_PODS_NO_SOCKET: &str =
    "tierproxy: TCP between local pods, no socket, to the listener";
/// Comment of rule 6's TPROXY of an untracked SYN between two local pods to the second
/// listener ([`RedirectConfig::local_pods_port`]).
pub(crate) const COMMENT_LOCAL_PODS_SYN: &str =
    "tierproxy: TCP between local pods, to their listener";
/// Comment of rule 3a's return for a later packet of an established TCP connection.
pub(crate) const COMMENT_ESTABLISHED_TCP: &str = "tierproxy: established TCP, not intercepted";
/// Comment of rule 7's return for TCP past its connection's SYN.
pub(crate) const COMMENT_TCP_PAST_SYN: &str = "tierproxy: TCP past its SYN, decided";

/// How long an allowed TCP class stays in the kernel-side cache after its last SYN
/// (seconds; rule 7). Every new snapshot empties the cache ([`Backend::flush_allowed`]).
pub const ALLOWED_CACHE_SECS: u32 = 60;

/// Most classes the kernel-side cache holds (per family). A full cache adds nothing more:
/// the SYNs of classes not in it are queued and decided, as without the cache.
pub const ALLOWED_CACHE_MAX: u32 = 65_536;

/// Protocols whose new flows are sent to NFQUEUE (rule 7), in rule order.
pub const QUEUED_PROTOCOLS: [&str; 3] = ["tcp", "udp", "sctp"];

/// Protocols whose new flows are TPROXY'd to the listener (rule 6) before their decision,
/// for `udp_path` ([`RedirectConfig::udp_path`]). Decided packets of other
/// [`QUEUED_PROTOCOLS`] (SCTP, and UDP on the kernel path) are accepted and forwarded by
/// the kernel, as is decided UDP to the node's own addresses (rule 5).
pub fn tproxy_protocols(udp_path: UdpPath) -> &'static [&'static str] {
    match udp_path {
        UdpPath::Kernel => &["tcp"],
        UdpPath::Proxy => &["tcp", "udp"],
    }
}

/// Which packets of each of [`QUEUED_PROTOCOLS`] rule 7 queues, when no proxy socket took
/// them in rule 2 or 3.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueWhen {
    /// TCP: every SYN (SYN set; ACK, RST, FIN clear), whatever conntrack says. A connection
    /// is never established without a decision: a client's SYN whose 4-tuple equals one of
    /// the proxy's own upstream connections (the proxy binds the client's address, so the
    /// node's conntrack table can hold that tuple already) is `ctstate ESTABLISHED` to
    /// conntrack, and a `ctstate NEW` match would let it be forwarded undecided. Later
    /// packets belong to the proxy's sockets.
    Syn,
    /// UDP through the proxy ([`UdpPath::Proxy`]): every datagram. One of a flow the
    /// proxy has closed (idle, or denied by a new snapshot) is decided again, not forwarded
    /// by the kernel on a conntrack entry that outlived the flow.
    Always,
    /// UDP on the kernel path ([`UdpPath::Kernel`]): a datagram whose conntrack entry is
    /// not confirmed yet (`--ctstatus CONFIRMED` unset; nft `ct status confirmed` unset),
    /// i.e. the first of its 5-tuple, or the first after its entry went (expired, or
    /// deleted by a sweep because a new snapshot denies it: `proxy::forwarded`). Not
    /// `ctstate NEW`: for UDP that holds for every datagram in the original direction
    /// until the first reply, so a one-way flow would be queued datagram by datagram.
    /// Balanced over the queues like TCP SYNs (a flood of new UDP flows dropped 2,681 of
    /// 100,000 first datagrams on the one kernel-forwarded flows' queue, none on two),
    /// except with [`RedirectConfig::queue_bypass`]: then on the kernel-forwarded flows'
    /// queue, which never fails open, as the kernel would forward what passed undecided.
    Unconfirmed,
    /// SCTP: `ctstate NEW` (the INIT); the kernel forwards the rest of an allowed
    /// association.
    New,
}

/// When rule 7 queues a packet of `proto` (one of [`QUEUED_PROTOCOLS`]) on `udp_path`.
pub fn queue_when(proto: &str, udp_path: UdpPath) -> QueueWhen {
    match (proto, udp_path) {
        ("tcp", _) => QueueWhen::Syn,
        ("udp", UdpPath::Proxy) => QueueWhen::Always,
        ("udp", UdpPath::Kernel) => QueueWhen::Unconfirmed,
        _ => QueueWhen::New,
    }
}

/// A failure to install, change or remove the ruleset.
#[derive(Debug, thiserror::Error)]
pub enum RedirectError {
    /// The configuration does not validate.
    #[error("invalid redirect configuration")]
    Config(#[from] ConfigError),
    /// A program could not be started or fed its input.
    #[error("could not run `{command}`")]
    Spawn {
        /// The command line.
        command: String,
        /// Why it could not run.
        #[source]
        source: std::io::Error,
    },
    /// A program exited unsuccessfully.
    #[error("`{command}` failed ({status}): {stderr}")]
    Failed {
        /// The command line.
        command: String,
        /// Its exit status, as printed by the standard library.
        status: String,
        /// Its standard error, trimmed.
        stderr: String,
    },
    /// A program's output could not be understood.
    #[error("unexpected output of `{command}`: {detail}")]
    Output {
        /// The command line.
        command: String,
        /// What was wrong with it.
        detail: String,
    },
}

/// Names of everything tierproxy creates, derived from [`RedirectConfig::name_prefix`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    /// iptables chain jumped to from `mangle PREROUTING`, e.g. `TIERPROXY`.
    pub chain: String,
    /// iptables chain that sets the route mark and accepts, e.g. `TIERPROXY-DIVERT`.
    pub divert_chain: String,
    /// iptables chain that TPROXYs a pod flow's TCP SYNs and UDP, e.g. `TIERPROXY-INTERCEPT`.
    pub intercept_chain: String,
    /// iptables chain jumped to from `mangle INPUT` and `mangle FORWARD` that sends a pod
    /// flow's undecided packets to the queue chain, e.g. `TIERPROXY-DECIDE`.
    pub decide_chain: String,
    /// iptables chain that queues by protocol, e.g. `TIERPROXY-QUEUE`.
    pub queue_chain: String,
    /// iptables chain in the raw table, jumped to from `raw PREROUTING`, that puts the
    /// replies to the proxy's upstream sockets into their conntrack zone (rule 0),
    /// e.g. `TIERPROXY-ZONE-IN`.
    pub zone_in_chain: String,
    /// iptables chain in the raw table, jumped to from the zone-in chain for a reply from
    /// elsewhere to an upstream socket: untracked from an enforcing node's pod, else the
    /// zone (rule 0), e.g. `TIERPROXY-ZONE-LEG`.
    pub zone_leg_chain: String,
    /// iptables chain in the raw table, jumped to from `raw OUTPUT`, that puts the
    /// packets of the proxy's upstream sockets into their conntrack zone (rule 0),
    /// e.g. `TIERPROXY-ZONE-OUT`.
    pub zone_out_chain: String,
    /// iptables chain in the raw table, jumped to first from `raw PREROUTING`, that drops
    /// packets with sources their interface cannot own (chain S), e.g. `TIERPROXY-SOURCE`.
    pub source_chain: String,
    /// iptables chain in the raw table that the source chain sends a packet from a local
    /// pod's interface to: the reverse-path check (chain S, with
    /// [`RedirectConfig::source_check`]), e.g. `TIERPROXY-POD-SOURCE`.
    pub pod_source_chain: String,
    /// Set of local pod IPv4 addresses, e.g. `tierproxy-pods-v4` (nftables: `pods-v4`).
    pub pods_v4: String,
    /// Set of local pod IPv6 addresses.
    pub pods_v6: String,
    /// Set of the node's own IPv4 addresses.
    pub nodes_v4: String,
    /// Set of the node's own IPv6 addresses.
    pub nodes_v6: String,
    /// Set (`hash:net,iface`) of the local pods' interfaces for IPv4, e.g.
    /// `tierproxy-podif-v4` (nftables: one `ifname` set, `podif`).
    pub podif_v4: String,
    /// Set (`hash:net,iface`) of the local pods' interfaces for IPv6.
    pub podif_v6: String,
    /// Set of the IPv4 addresses of pods on other nodes whose agent enforces (their
    /// connections were proxied and decided at their own node; rule 6 does not proxy them
    /// again), e.g. `tierproxy-enforced-v4` (nftables: `enforced-v4`).
    pub enforced_v4: String,
    /// Set of the IPv6 addresses of pods on other nodes whose agent enforces.
    pub enforced_v6: String,
    /// The kernel-side cache of allowed TCP classes, IPv4 (`hash:ip,port,ip`: client,
    /// protocol and port, server; rule 7), e.g. `tierproxy-allowed-v4` (nftables:
    /// `allowed-v4`).
    pub allowed_v4: String,
    /// The same for IPv6.
    pub allowed_v6: String,
    /// nftables table (family `inet`), e.g. `tierproxy`.
    pub table: String,
    /// nftables table (family `inet`) the iptables backend adds for rule 3 after the DNAT
    /// where the kernel has nft's `tproxy`, e.g. `tierproxy-dnat`.
    pub dnat_table: String,
}

impl Names {
    /// The names for `config`'s prefix (ipset names are prefixed, nftables set names are
    /// not: they live in tierproxy's own table).
    pub fn new(config: &RedirectConfig) -> Names {
        let p = &config.name_prefix;
        let up = p.to_ascii_uppercase();
        Names {
            chain: up.clone(),
            divert_chain: format!("{up}-DIVERT"),
            intercept_chain: format!("{up}-INTERCEPT"),
            decide_chain: format!("{up}-DECIDE"),
            queue_chain: format!("{up}-QUEUE"),
            zone_in_chain: format!("{up}-ZONE-IN"),
            zone_leg_chain: format!("{up}-ZONE-LEG"),
            zone_out_chain: format!("{up}-ZONE-OUT"),
            source_chain: format!("{up}-SOURCE"),
            pod_source_chain: format!("{up}-POD-SOURCE"),
            pods_v4: format!("{p}-pods-v4"),
            pods_v6: format!("{p}-pods-v6"),
            nodes_v4: format!("{p}-nodes-v4"),
            nodes_v6: format!("{p}-nodes-v6"),
            podif_v4: format!("{p}-podif-v4"),
            podif_v6: format!("{p}-podif-v6"),
            enforced_v4: format!("{p}-enforced-v4"),
            enforced_v6: format!("{p}-enforced-v6"),
            allowed_v4: format!("{p}-allowed-v4"),
            allowed_v6: format!("{p}-allowed-v6"),
            table: p.clone(),
            dnat_table: format!("{p}-dnat"),
        }
    }
}

/// Everything the ruleset depends on: a validated configuration, the node's local pod
/// addresses, the node's own addresses and the interfaces through which the node routes its
/// local pods' addresses. A plain value; two equal specs render the same text. Addresses
/// are kept sorted and IPv4-mapped IPv6 addresses (`::ffff:a.b.c.d`) are stored as IPv4.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RulesetSpec {
    config: RedirectConfig,
    local_pods: BTreeSet<IpAddr>,
    node_addrs: BTreeSet<IpAddr>,
    pod_interfaces: BTreeSet<String>,
    enforced_pods: BTreeSet<IpAddr>,
    cached_udp_sample: u32,
}

impl RulesetSpec {
    /// A spec from a configuration, the addresses of the pods on this node (pod network only,
    /// not hostNetwork pods) and the node's own addresses.
    ///
    /// # Errors
    /// The configuration's [`ConfigError`].
    pub fn new(
        config: RedirectConfig,
        local_pods: impl IntoIterator<Item = IpAddr>,
        node_addrs: impl IntoIterator<Item = IpAddr>,
    ) -> Result<RulesetSpec, ConfigError> {
        config.validate()?;
        Ok(RulesetSpec {
            config,
            local_pods: local_pods.into_iter().map(|a| a.to_canonical()).collect(),
            node_addrs: node_addrs.into_iter().map(|a| a.to_canonical()).collect(),
            pod_interfaces: BTreeSet::new(),
            enforced_pods: BTreeSet::new(),
            cached_udp_sample: 1,
        })
    }

    /// This spec with conntrack reporting the new entry of one in `n` flows of a cached UDP
    /// class (rule 7, the kernel UDP path): 1, the default, every one; 0, none; `n` ≥ 2,
    /// every `n`th by a counter the node shares (nft `numgen inc mod n`). Every other new
    /// UDP entry of a pod flow that the agent decided (at the queue, or by the cache)
    /// reports only its destroy event: a new event costs the kernel a netlink message to
    /// build and the agent one to read, per DNS-like query (issue #20). The agent sets `n`
    /// to its audit's `--audit-allow-sample` (0 when nothing is audited), so that the flows
    /// it sees are its audit sample ([`Backend::spares_new_events`] says where the
    /// backend can).
    pub fn with_cached_udp_sample(mut self, n: u32) -> Self {
        self.cached_udp_sample = n;
        self
    }

    /// What [`RulesetSpec::with_cached_udp_sample`] set (1 by default).
    pub fn cached_udp_sample(&self) -> u32 {
        self.cached_udp_sample
    }

    /// This spec with `addrs` as the enforced pods (rule 6): the addresses of pods on other
    /// nodes whose agent enforces, whose TCP connections their own node proxied and
    /// decided, in both directions, already. Their SYNs to a local pod are decided here on
    /// the first packet and then forwarded by the kernel, not proxied a second time
    /// (issue #18). An address that is also a local pod's is left out (a pod IP that moved
    /// between nodes while both pods are listed): it is proxied.
    pub fn with_enforced_pods(mut self, addrs: impl IntoIterator<Item = IpAddr>) -> Self {
        self.enforced_pods = addrs
            .into_iter()
            .map(|a| a.to_canonical())
            .filter(|a| !self.local_pods.contains(a))
            .collect();
        self
    }

    /// This spec with `interfaces` as the local pods' interfaces (chain S, rule 3): the
    /// names [`Backend::pod_interfaces`] found. Names that are not valid interface names
    /// (empty, longer than 15 bytes, or holding `/`, `,`, whitespace or quotes) are left out:
    /// they cannot come from the kernel and would not survive the set syntax.
    pub fn with_pod_interfaces(mut self, interfaces: impl IntoIterator<Item = String>) -> Self {
        self.pod_interfaces = valid_ifnames(interfaces);
        self
    }

    /// The (validated) configuration.
    pub fn config(&self) -> &RedirectConfig {
        &self.config
    }

    /// Local pod addresses, sorted (IPv4 before IPv6).
    pub fn local_pods(&self) -> &BTreeSet<IpAddr> {
        &self.local_pods
    }

    /// The node's own addresses, sorted (IPv4 before IPv6).
    pub fn node_addrs(&self) -> &BTreeSet<IpAddr> {
        &self.node_addrs
    }

    /// The interfaces through which the node routes its local pods' addresses, sorted.
    pub fn pod_interfaces(&self) -> &BTreeSet<String> {
        &self.pod_interfaces
    }

    /// The enforced pods' addresses ([`RulesetSpec::with_enforced_pods`]), sorted.
    pub fn enforced_pods(&self) -> &BTreeSet<IpAddr> {
        &self.enforced_pods
    }

    /// The names derived from the configuration.
    pub fn names(&self) -> Names {
        Names::new(&self.config)
    }
}

/// Whether `name` can be a Linux interface name: 1 to 15 bytes (`IFNAMSIZ` - 1), none of
/// them `/`, whitespace, `,` (ipset's element separator) or a quote (netdevice(7),
/// `dev_valid_name` in net/core/dev.c).
pub fn valid_ifname(name: &str) -> bool {
    (1..=15).contains(&name.len())
        && name != "."
        && name != ".."
        && !name.bytes().any(|b| {
            b == b'/'
                || b == b','
                || b == b'"'
                || b == b'\''
                || b.is_ascii_whitespace()
                || b.is_ascii_control()
        })
}

/// The names of `interfaces` that [`valid_ifname`] accepts, sorted.
pub(crate) fn valid_ifnames(interfaces: impl IntoIterator<Item = String>) -> BTreeSet<String> {
    interfaces.into_iter().filter(|i| valid_ifname(i)).collect()
}

/// Packets the ruleset dropped since it was installed, by rule, both families together
/// (the rules' own packet counters: `iptables-save -c`, nft `counter`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DropCounts {
    /// Chain S, rule 2: one of the node's own addresses as source, not from `lo`.
    pub node_source: u64,
    /// Chain S, rule 3: from a local pod's interface, a source not routed back through it.
    pub pod_source: u64,
    /// Rule 6: TCP of a pod flow, not a SYN, `NEW` or `INVALID` to conntrack, no socket's;
    /// and rule 3's untracked TCP between two local pods that no socket took, handed to the
    /// listener (which completes a SYN cookie's ACK and resets or discards the rest).
    pub stray_tcp: u64,
}

/// Splits addresses by family, canonicalising IPv4-mapped IPv6 addresses, sorted and
/// deduplicated.
pub(crate) fn by_family<'a>(
    addrs: impl IntoIterator<Item = &'a IpAddr>,
) -> (BTreeSet<IpAddr>, BTreeSet<IpAddr>) {
    addrs.into_iter().map(|a| a.to_canonical()).partition(IpAddr::is_ipv4)
}

/// The two backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// [`IptablesBackend`].
    Iptables,
    /// [`NftablesBackend`].
    Nftables,
}

impl fmt::Display for BackendKind {
    /// `iptables` or `nftables`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Iptables => "iptables",
            BackendKind::Nftables => "nftables",
        })
    }
}

/// Installs, changes and removes tierproxy's ruleset. Implementations are stateless: every
/// method takes the configuration it needs, so a fresh process can remove what a crashed one
/// left behind.
pub trait Backend: fmt::Debug + Send + Sync {
    /// Which backend this is.
    fn kind(&self) -> BackendKind;

    /// Short name for logs: `iptables` or `nftables`.
    fn name(&self) -> &'static str {
        match self.kind() {
            BackendKind::Iptables => "iptables",
            BackendKind::Nftables => "nftables",
        }
    }

    /// Whether the ruleset holds the refusal chains: after the decision, the kernel's
    /// reject answers a packet the queue accepted with [`RedirectConfig::reject_mark`]. The
    /// nftables backend always has them; the iptables backend in its table `inet
    /// <prefix>-dnat` ([`IptablesBackend::with_nft_after_dnat`]). Without them a reader
    /// must never accept a rejected packet: it would go on undecided.
    fn refuses(&self) -> bool;

    /// Whether the ruleset spares conntrack new events (rule 7,
    /// [`RulesetSpec::with_cached_udp_sample`]): it needs nft's `ct event set` after
    /// conntrack made the entry, which the nftables backend has in its decide chain and the
    /// iptables backend in its table `inet <prefix>-dnat`, where it [`Backend::refuses`].
    /// Elsewhere every new entry reports its new event and the agent samples for itself.
    fn spares_new_events(&self) -> bool {
        self.refuses()
    }

    /// The exact input [`Backend::apply`] feeds to each program, in order, each under a
    /// `### <command line>` header. Deterministic: equal specs give equal text.
    fn render(&self, spec: &RulesetSpec) -> String;

    /// Installs the ruleset, replacing tierproxy's previous one atomically per table (never
    /// touching other chains or tables). Applying the same spec twice changes nothing.
    ///
    /// # Errors
    /// The first failing command, with its standard error. Steps before it stay applied
    /// (e.g. the sets, or policy routing); [`Backend::remove`] clears them.
    fn apply(&self, spec: &RulesetSpec) -> Result<(), RedirectError>;

    /// Adds `add` to and removes `remove` from the local pod sets without rebuilding
    /// anything else. Adding a present or removing an absent address is not an error; an
    /// address in both lists ends up present. Needs the ruleset applied.
    ///
    /// # Errors
    /// [`RedirectError::Config`] for an invalid `config`; the failing command otherwise.
    fn update_pods(
        &self,
        config: &RedirectConfig,
        add: &[IpAddr],
        remove: &[IpAddr],
    ) -> Result<(), RedirectError>;

    /// Makes the local pods' interface sets (chain S, rule 3) hold exactly `interfaces`
    /// (invalid names, see [`valid_ifname`], are left out), without rebuilding anything
    /// else. Needs the ruleset applied.
    ///
    /// # Errors
    /// [`RedirectError::Config`] for an invalid `config`; the failing command otherwise.
    fn set_pod_interfaces(
        &self,
        config: &RedirectConfig,
        interfaces: &BTreeSet<String>,
    ) -> Result<(), RedirectError>;

    /// Makes the enforced pod sets (rule 6, [`RulesetSpec::with_enforced_pods`]) hold
    /// exactly `addrs`, atomically per set, without rebuilding anything else. Needs the
    /// ruleset applied.
    ///
    /// # Errors
    /// [`RedirectError::Config`] for an invalid `config`; the failing command otherwise.
    fn set_enforced_pods(
        &self,
        config: &RedirectConfig,
        addrs: &BTreeSet<IpAddr>,
    ) -> Result<(), RedirectError>;

    /// Empties the kernel-side cache of allowed TCP classes (rule 7). Called for every new
    /// snapshot, so that no SYN skips the decision of the snapshot in force. Needs the
    /// ruleset applied.
    ///
    /// # Errors
    /// [`RedirectError::Config`] for an invalid `config`; the failing command otherwise.
    fn flush_allowed(&self, config: &RedirectConfig) -> Result<(), RedirectError>;

    /// The interfaces through which this node routes `addrs` (its local pods' addresses):
    /// the output device of the kernel's route to each (`ip -j route get`, one `ip -batch`
    /// run). Routes through a gateway, local routes and `lo` are left out (an address whose
    /// route is the node's default route is not a pod of this node's interfaces), as is an
    /// address without a route (a pod whose network is not set up yet).
    ///
    /// # Errors
    /// `ip` cannot run or prints something that is not its JSON.
    fn pod_interfaces(&self, addrs: &[IpAddr]) -> Result<BTreeSet<String>, RedirectError>;

    /// The packets the ruleset's counted drops ([`DropCounts`]) took since it was
    /// installed.
    ///
    /// # Errors
    /// The failing listing command (`iptables-save -c`, `nft -j list table`).
    fn drop_counts(&self, config: &RedirectConfig) -> Result<DropCounts, RedirectError>;

    /// Removes chains, the jump, sets, the table, policy-routing rules and routes that
    /// `config` names. Succeeds when nothing is installed.
    ///
    /// # Errors
    /// [`RedirectError::Config`] for an invalid `config`; the failing command otherwise.
    fn remove(&self, config: &RedirectConfig) -> Result<(), RedirectError>;
}

/// The refusal chains alone ([`Backend::refuses`]) in table `inet <table>`, as the JSON
/// `nft -j -f -` applies (replacing that table if it exists): what every ruleset adds right
/// after the decision, for a namespace whose queue rules are not tierproxy's (the reject
/// tests' router).
pub fn refusal_table(config: &RedirectConfig, table: &str) -> String {
    nft::json(&nft::refusal_batch(config, table))
}

/// What [`probe`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// The backend to use.
    pub kind: BackendKind,
    /// Why: for nftables, that `nft -c` accepted rules with `queue`, `tproxy`, `socket` and
    /// `reject`; for iptables, what `nft` answered.
    pub reason: String,
    /// For the iptables backend: whether the kernel runs nft's `tproxy`, `socket` and
    /// `reject`, so that the backend can add rule 3's chain after the DNAT and rule 8's
    /// refusal chains ([`IptablesBackend::with_nft_after_dnat`]).
    pub nft_tproxy: bool,
}

/// Probes the kernel: [`BackendKind::Nftables`] when `nft -c` (a check that sends the
/// transaction to the kernel and aborts it, so nothing changes) accepts a throwaway table
/// with `queue`, `tproxy`, `socket transparent` and `reject` rules;
/// [`BackendKind::Iptables`] otherwise (no `nft` binary, or a kernel without
/// CONFIG_NFT_QUEUE, CONFIG_NFT_TPROXY, CONFIG_NFT_SOCKET or CONFIG_NFT_REJECT_INET).
pub fn probe() -> Probe {
    match nft::check_kernel_support("nft") {
        Ok(()) => Probe {
            kind: BackendKind::Nftables,
            reason: "nft -c accepted queue, tproxy, socket and reject rules".into(),
            nft_tproxy: true,
        },
        Err(e) => Probe {
            kind: BackendKind::Iptables,
            reason: format!("nftables unusable: {e}"),
            nft_tproxy: nft::check_tproxy_support("nft").is_ok(),
        },
    }
}

/// A chosen backend and why it was chosen.
#[derive(Debug)]
pub struct Selection {
    /// The backend.
    pub backend: Box<dyn Backend>,
    /// `configured` or the [`Probe::reason`].
    pub reason: String,
}

/// The backend for `choice`: the named one, or for [`BackendChoice::Auto`] the one
/// [`probe`] finds. The iptables backend uses the default `iptables` tools, and adds rule
/// 3's chain after the DNAT when the kernel has nft's `tproxy` and `socket` (the reason
/// says whether it does).
pub fn select(choice: BackendChoice) -> Selection {
    let (kind, reason, nft_tproxy) = match choice {
        BackendChoice::Iptables => (
            BackendKind::Iptables,
            "configured".to_owned(),
            nft::check_tproxy_support("nft").is_ok(),
        ),
        BackendChoice::Nftables => (BackendKind::Nftables, "configured".to_owned(), true),
        BackendChoice::Auto => {
            let p = probe();
            (p.kind, p.reason, p.nft_tproxy)
        }
    };
    let (backend, reason): (Box<dyn Backend>, String) = match kind {
        BackendKind::Iptables if nft_tproxy => (
            Box::new(IptablesBackend::new().with_nft_after_dnat("nft")),
            format!(
                "{reason}; nft tproxy, reject and fib work: connections to a ClusterIP \
                 that a SYN cookie completes reach the proxy, the kernel refuses rejected \
                 flows where the queue passes no conntrack entry, and the source check and \
                 the upstream legs' zone are nft rules"
            ),
        ),
        BackendKind::Iptables => (
            Box::new(IptablesBackend::new()),
            format!(
                "{reason}; no nft tproxy, reject or fib: a connection to a ClusterIP that a \
                 SYN cookie completes (the proxy's SYN queue full) hangs, and where the \
                 queue passes no conntrack entry a rejected flow to one times out"
            ),
        ),
        BackendKind::Nftables => (Box::new(NftablesBackend::new()), reason),
    };
    Selection { backend, reason }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_canonicalises_sorts_and_dedups() {
        let pods: Vec<IpAddr> = vec![
            "fd00::2".parse().unwrap(),
            "::ffff:10.0.0.9".parse().unwrap(),
            "10.0.0.2".parse().unwrap(),
            "10.0.0.9".parse().unwrap(),
        ];
        let spec = RulesetSpec::new(RedirectConfig::default(), pods, []).unwrap();
        let got: Vec<String> = spec.local_pods().iter().map(ToString::to_string).collect();
        assert_eq!(got, ["10.0.0.2", "10.0.0.9", "fd00::2"]);
        let (v4, v6) = by_family(spec.local_pods());
        assert_eq!(v4.len(), 2);
        assert_eq!(v6.len(), 1);
    }

    #[test]
    fn spec_rejects_invalid_config() {
        let config = RedirectConfig { tproxy_port: 0, ..Default::default() };
        assert_eq!(RulesetSpec::new(config, [], []), Err(ConfigError::TproxyPortZero));
    }

    #[test]
    fn names_follow_prefix() {
        let names = Names::new(&RedirectConfig { name_prefix: "tp".into(), ..Default::default() });
        assert_eq!(names.chain, "TP");
        assert_eq!(names.divert_chain, "TP-DIVERT");
        assert_eq!(names.pods_v6, "tp-pods-v6");
        assert_eq!(names.table, "tp");
    }

    #[test]
    fn select_honours_configured_choice() {
        assert_eq!(select(BackendChoice::Iptables).backend.kind(), BackendKind::Iptables);
        assert_eq!(select(BackendChoice::Nftables).backend.kind(), BackendKind::Nftables);
        assert_eq!(select(BackendChoice::Nftables).backend.name(), "nftables");
    }
}
