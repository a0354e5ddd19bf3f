//! Hand-over of the proxy to the next agent on an upgrade or restart (issue #23): the
//! transparent listeners, every live TCP connection — both sockets, the bytes in flight each
//! way, how long it has lived and what it has moved — and every UDP flow of the proxy path
//! pass to the next agent over a Unix socket, and nothing is reset.
//!
//! Protocol, version 2, over a `SOCK_SEQPACKET` Unix socket (unix(7): each message keeps its
//! boundaries and carries its descriptors). A message is one JSON object ([`Message`]) with
//! its descriptors in one `SCM_RIGHTS` control message:
//! 1. next → previous: `hello`, the oldest and newest versions it speaks;
//! 2. previous → next: `accept` with the newest version both speak, or `refuse` with the
//!    reason (no common version): the next agent then starts without a hand-over and says
//!    so, and the previous one drains as at any stop;
//! 3. previous → next: one `queue` per NFQUEUE queue (descriptor: its netlink socket,
//!    bound to the queue, with the packets waiting on it; the previous agent's reader has
//!    stopped reading it), one `listener` per transparent listener (descriptor: the
//!    listening socket), one `connection` per live TCP connection (descriptors: the
//!    client's socket, the upstream socket, then a pipe for each direction with bytes in
//!    flight), one `udp-listener` per transparent UDP listener and one `udp-flow` per live
//!    UDP flow of the proxy path (descriptors: the upstream socket, then the reply socket;
//!    version 2), then `done` with how many of each it sent;
//! 4. next → previous: `ack` once it has taken them in; the previous agent then exits
//!    without resetting anything.
//!
//! A descriptor passed with `SCM_RIGHTS` refers to the same open socket: the same TCP
//! connection with its queued bytes, the same listening socket with the connections
//! waiting in its backlog. A pipe passed holds exactly the bytes the previous agent read
//! and did not write ([`super::relay::Suspended`]). A UDP flow holds no datagram outside its
//! sockets (each one read is sent before the next read), so its sockets' receive queues
//! are all it has in flight. So no connection and no byte is lost or duplicated between
//! the agents; a connection waits, never longer than the hand-over.
//!
//! Versions: 1 has no UDP messages. An agent serving UDP on the proxy path refuses a next
//! agent that speaks only version 1 (it could not take the UDP flows): that one starts
//! without a hand-over, and this one drains when stopped.
//!
//! The giving side: [`Giver`], shared by the proxies ([`super::tcp::serve`],
//! [`super::udp::serve`]) and the thread that serves the socket ([`Giver::serve`]). The
//! taking side: [`take`].
//!
//! Sources: unix(7) (`SOCK_SEQPACKET`, `SCM_RIGHTS`, `SO_PEERCRED`), cmsg(3), issue #23.

use std::io::{self, IoSlice, IoSliceMut};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use socket2::{Domain, SockAddr, Socket, Type};

use super::lifecycle::HandedFlow;
use super::registry::Registry;
use super::relay::{DirectionState, Resume, Suspended};
use crate::policy::ports::Protocol;
use crate::policy::{FlowKey, Revision};

/// The newest protocol version this build speaks (2: UDP listeners and flows of the proxy
/// path pass too).
pub const VERSION: u32 = 2;

/// The first protocol version that carries UDP listeners and flows.
const UDP_VERSION: u32 = 2;

/// The oldest protocol version this build speaks.
pub const OLDEST_VERSION: u32 = 1;

/// Most descriptors one message carries: a connection's two sockets and two pipes (a UDP
/// flow has two sockets).
const MAX_FDS: usize = 4;

/// Most descriptors one `SCM_RIGHTS` message can carry (Linux `include/net/scm.h`
/// `SCM_MAX_FD`): the receive buffer's room, so no message is ever truncated.
const SCM_MAX_FD: usize = 253;

/// Largest message, bytes (a connection's header is about 300).
const MAX_MESSAGE: usize = 16 << 10;

/// How long either side waits for the other's next message before giving up.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(10);

/// One message of the protocol.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
enum Message {
    Hello {
        oldest: u32,
        newest: u32,
    },
    Accept {
        version: u32,
    },
    Refuse {
        reason: String,
    },
    Queue {
        num: u16,
    },
    Listener {
        addr: SocketAddr,
    },
    Connection(Header),
    UdpListener {
        addr: SocketAddr,
    },
    UdpFlow(UdpHeader),
    Done {
        queues: usize,
        listeners: usize,
        connections: usize,
        /// Version 2; absent (0) from a version 1 peer.
        #[serde(default)]
        udp_listeners: usize,
        #[serde(default)]
        udp_flows: usize,
    },
    Ack,
}

/// What a `connection` and a `udp-flow` message say of their flow.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct FlowHeader {
    /// The client's address.
    src: SocketAddr,
    /// The original destination.
    dst: SocketAddr,
    /// How long ago the connection was accepted (the flow's first datagram came),
    /// milliseconds.
    age_ms: u64,
    /// Bytes written to the server so far.
    to_server: u64,
    /// Bytes written to the client so far.
    to_client: u64,
    /// Revision of the snapshot whose decision admitted it.
    revision: u64,
    /// Whether its admission was audited (its end is audited then).
    audited: bool,
    /// When its admitting decision was made, milliseconds since the Unix epoch.
    decided_ms: u64,
}

impl FlowHeader {
    fn new(key: &FlowKey, flow: &HandedFlow, to_server: u64, to_client: u64) -> FlowHeader {
        FlowHeader {
            src: key.src,
            dst: key.dst,
            age_ms: flow.age.as_millis() as u64,
            to_server,
            to_client,
            revision: flow.revision.0,
            audited: flow.audited,
            decided_ms: flow
                .decided
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        }
    }

    /// The flow's key (with `protocol`) and what the next agent learns of it.
    fn flow(&self, protocol: Protocol) -> (FlowKey, HandedFlow) {
        (
            FlowKey { src: self.src, dst: self.dst, protocol },
            HandedFlow {
                age: Duration::from_millis(self.age_ms),
                revision: Revision(self.revision),
                audited: self.audited,
                decided: std::time::UNIX_EPOCH + Duration::from_millis(self.decided_ms),
            },
        )
    }
}

/// A connection's `connection` message; its descriptors travel beside it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Header {
    #[serde(flatten)]
    flow: FlowHeader,
    /// Client → server.
    up: Dir,
    /// Server → client.
    down: Dir,
}

/// A UDP flow's `udp-flow` message (version 2); its two sockets travel beside it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct UdpHeader {
    #[serde(flatten)]
    flow: FlowHeader,
    /// How long ago its last datagram either way crossed it, milliseconds: its idle
    /// timeout goes on from there.
    idle_ms: u64,
}

/// One direction of a [`Header`].
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
struct Dir {
    /// Bytes in this direction's pipe (0: no pipe sent).
    in_flight: usize,
    /// EOF read from the source.
    eof: bool,
    /// EOF passed on.
    done: bool,
}

impl Dir {
    fn of(d: &DirectionState) -> Dir {
        Dir { in_flight: d.in_flight.as_ref().map_or(0, |(_, n)| *n), eof: d.eof, done: d.done }
    }
}

/// A live TCP connection passing between agents.
#[derive(Debug)]
pub struct Connection {
    /// Client address and original destination.
    pub key: FlowKey,
    /// Its age, admitting decision's revision and time, and whether that was audited.
    pub flow: HandedFlow,
    /// Bytes written to the server so far.
    pub to_server: u64,
    /// Bytes written to the client so far.
    pub to_client: u64,
    /// Its sockets and the bytes in flight each way.
    pub relay: Suspended,
}

/// A live UDP flow of the proxy path passing between agents ([`super::udp`]).
#[derive(Debug)]
pub struct UdpFlow {
    /// Client address and original destination.
    pub key: FlowKey,
    /// Its age, admitting decision's revision and time, and whether that was audited.
    pub flow: HandedFlow,
    /// Payload bytes sent to the server so far.
    pub to_server: u64,
    /// Payload bytes sent to the client so far.
    pub to_client: u64,
    /// How long ago its last datagram crossed it.
    pub idle: Duration,
    /// The socket connected to the original destination (the server's replies arrive on
    /// it), with the datagrams queued on it.
    pub upstream: std::net::UdpSocket,
    /// The socket bound to the original destination and connected to the client (the
    /// client's datagrams arrive on it), with the datagrams queued on it.
    pub reply: std::net::UdpSocket,
}

/// What the proxies and the queue readers give the hand-over thread ([`Giver::give`]).
#[derive(Debug)]
pub enum Outgoing {
    /// An NFQUEUE queue's number and netlink socket (a duplicate), its reader parked
    /// ([`Giver::parked`]).
    Queue(u16, OwnedFd),
    /// A transparent listener (a duplicate of its descriptor) and its address.
    Listener(SocketAddr, OwnedFd),
    /// A live connection, stopped where it was.
    Connection(Connection),
    /// A transparent UDP listener (a duplicate of its descriptor) and its address; the UDP
    /// proxy has stopped reading it.
    UdpListener(SocketAddr, OwnedFd),
    /// A live UDP flow of the proxy path, its relay stopped.
    UdpFlow(UdpFlow),
    /// One proxy (TCP, or UDP on the proxy path) has given everything it has.
    Finished,
}

/// How the last hand-over went, as [`Giver::outcome`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The next agent took everything and acknowledged: this agent stops without a drain.
    Completed,
    /// The next agent went away or answered wrongly part-way: the connections not yet sent
    /// were reset; this agent accepts again.
    Failed,
}

/// The giving side of a hand-over, shared by the proxies, the queue readers and the
/// thread serving the socket: the thread asks ([`Giver::requested`], [`Giver::park`]);
/// each queue reader parks and gives its queue ([`Giver::parked`]); each proxy stops
/// accepting and gives its listeners and flows one by one ([`Giver::give`]), then
/// [`Outgoing::Finished`]; the thread sends them and reports how it went
/// ([`Giver::outcome`]).
#[derive(Debug)]
pub struct Giver {
    /// How many queues the readers give in each hand-over.
    queues: usize,
    /// The TCP proxy's request.
    request: tokio::sync::Notify,
    /// The UDP proxy's request, when it serves the proxy path ([`Giver::with_udp_proxy`]).
    request_udp: Option<tokio::sync::Notify>,
    /// Set while the queue readers are to park.
    park: AtomicBool,
    tx: Sender<Outgoing>,
    rx: Receiver<Outgoing>,
    /// Which hand-over is the latest and how it ended.
    outcome: Mutex<Ended>,
    /// Wakes parked queue readers when it ended.
    ended_cv: Condvar,
    /// Wakes the proxy when it ended.
    ended: tokio::sync::Notify,
}

/// The latest hand-over of a [`Giver`]: its number (each [`Giver::begin`] counts one) and
/// how it ended (`None` while under way).
#[derive(Debug, Default)]
struct Ended {
    generation: u64,
    outcome: Option<Outcome>,
}

impl Giver {
    /// A giver for an agent with `queues` NFQUEUE readers (each gives its queue in a
    /// hand-over; 0: none, as in tests of the proxy alone) and the TCP proxy.
    pub fn new(queues: usize) -> Giver {
        let (tx, rx) = crossbeam_channel::unbounded();
        Giver {
            queues,
            request: tokio::sync::Notify::new(),
            request_udp: None,
            park: AtomicBool::new(false),
            tx,
            rx,
            outcome: Mutex::new(Ended::default()),
            ended_cv: Condvar::new(),
            ended: tokio::sync::Notify::new(),
        }
    }

    /// The same giver, with the UDP proxy (`--udp-path proxy`) giving its listeners and
    /// flows too when `udp_proxy` ([`super::udp::serve`]); a next agent that speaks no
    /// version carrying them is refused.
    pub fn with_udp_proxy(mut self, udp_proxy: bool) -> Giver {
        self.request_udp = udp_proxy.then(tokio::sync::Notify::new);
        self
    }

    /// How many proxies give [`Outgoing::Finished`] in each hand-over.
    fn proxies(&self) -> usize {
        1 + usize::from(self.request_udp.is_some())
    }

    /// Asks every proxy to give what it has.
    fn ask(&self) {
        self.request.notify_one();
        if let Some(udp) = &self.request_udp {
            udp.notify_one();
        }
    }

    /// Whether the queue readers are to park now: a hand-over is under way.
    pub fn park(&self) -> bool {
        self.park.load(Ordering::Acquire)
    }

    /// Whether a hand-over is under way or has completed: a stop asked for now must wait
    /// for the proxy's end of it ([`super::tcp::serve`]) instead of draining what the next
    /// agent holds too.
    pub fn committed(&self) -> bool {
        self.park() || self.lock_outcome().outcome == Some(Outcome::Completed)
    }

    /// A queue reader parks: gives queue `num` (a duplicate of its socket, `fd`) and waits
    /// until the hand-over it gave it to ended. Returns `true` when that one failed and the
    /// reader reads on (parking again at once if another hand-over began meanwhile),
    /// `false` when the next agent has the queue (the reader ends).
    ///
    /// The queue is given under the lock that [`Giver::begin`] and [`Giver::end`] take, so
    /// it goes to the hand-over whose generation the reader then waits on. Before, a reader
    /// woken late from a failed hand-over found the next one's empty outcome and waited on
    /// without giving its queue to it, which then failed after its step timeout (review
    /// finding 17 of issue #23).
    pub fn parked(&self, num: u16, fd: OwnedFd) -> bool {
        let mut ended = self.lock_outcome();
        let generation = ended.generation;
        self.give(Outgoing::Queue(num, fd));
        loop {
            if ended.generation != generation {
                // A later hand-over began: the one this reader parked for ended, and only a
                // failed one is followed by another.
                return true;
            }
            match ended.outcome {
                Some(o) => return o == Outcome::Failed,
                None => {
                    ended = self
                        .ended_cv
                        .wait(ended)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                }
            }
        }
    }

    fn lock_outcome(&self) -> std::sync::MutexGuard<'_, Ended> {
        self.outcome.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Returns when a next agent asks the proxy of `protocol` (TCP, or UDP on the proxy
    /// path) for a hand-over (a request made before the wait is kept for it). Never, for
    /// UDP, when this giver has no UDP proxy.
    pub async fn requested(&self, protocol: Protocol) {
        match (protocol, &self.request_udp) {
            (Protocol::Tcp, _) => self.request.notified().await,
            (Protocol::Udp, Some(udp)) => udp.notified().await,
            _ => std::future::pending().await,
        }
    }

    /// Hands `item` to the thread that sends it. Never blocks.
    ///
    /// Outside a hand-over (one that failed and ended already) nobody sends it: a
    /// connection is reset at once, anything else closed (a UDP flow's next datagram is
    /// then decided again and opens a new flow).
    pub fn give(&self, item: Outgoing) {
        if !self.park() {
            if let Outgoing::Connection(c) = item {
                c.relay.abort();
            }
            return;
        }
        // The receiver lives as long as `self`.
        let _ = self.tx.send(item);
    }

    /// Returns how the hand-over under way when it is called ended, once it has (after
    /// [`Outgoing::Finished`] was given); `Failed` when a later one began meanwhile.
    pub async fn outcome(&self) -> Outcome {
        let generation = self.lock_outcome().generation;
        loop {
            let ended = self.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            {
                let e = self.lock_outcome();
                if e.generation != generation {
                    return Outcome::Failed;
                }
                if let Some(o) = e.outcome {
                    return o;
                }
            }
            ended.await;
        }
    }

    /// A proxy's part of a hand-over, once it has stopped taking new flows: gives each of
    /// `listeners` (a listener that could not be duplicated is logged and kept), tells
    /// every live flow of `protocol` to stop for the hand-over (each one's task gives it
    /// on), waits until none is left, gives [`Outgoing::Finished`] and returns how the
    /// hand-over ended.
    pub async fn hand_over_proxy(
        &self,
        registry: &Registry,
        protocol: Protocol,
        listeners: Vec<io::Result<Outgoing>>,
    ) -> Outcome {
        for l in listeners {
            match l {
                Ok(item) => self.give(item),
                Err(e) => {
                    tracing::warn!(error = %e, protocol = protocol.as_str(), "a listener could not be handed over")
                }
            }
        }
        let told = registry.hand_over(protocol);
        tracing::info!(
            protocol = protocol.as_str(),
            flows = told,
            "stopping live flows for the hand-over"
        );
        registry.wait_none(protocol).await;
        registry.hand_over_ended(protocol);
        self.give(Outgoing::Finished);
        self.outcome().await
    }

    /// A hand-over begins: no outcome yet, the readers park. The proxy is asked once they
    /// all have ([`Giver::give_to`]).
    fn begin(&self) {
        // Left over from a hand-over that failed: given as it ended, sent by nobody.
        for item in self.rx.try_iter() {
            if let Outgoing::Connection(c) = item {
                c.relay.abort();
            }
        }
        let mut ended = self.lock_outcome();
        ended.generation += 1;
        ended.outcome = None;
        // Under the lock: a reader giving its queue sees the park and the generation of
        // one hand-over, never the park of one and the generation of another.
        self.park.store(true, Ordering::Release);
        drop(ended);
        // A reader still waiting on the previous one's outcome: it reads on, then parks
        // for this one.
        self.ended_cv.notify_all();
    }

    fn end(&self, outcome: Outcome) {
        let mut ended = self.lock_outcome();
        self.park.store(false, Ordering::Release);
        ended.outcome = Some(outcome);
        drop(ended);
        self.ended_cv.notify_all();
        self.ended.notify_waiters();
    }

    /// Binds the hand-over socket at `path` (a stale file there is replaced; mode 0600)
    /// and serves next agents on a thread of its own, one at a time, until the process
    /// ends: each one that speaks a common version gets this agent's listeners and
    /// connections.
    ///
    /// # Errors
    /// When the socket cannot be created or bound.
    pub fn serve(self: &Arc<Self>, path: &Path) -> io::Result<std::thread::JoinHandle<()>> {
        let listener = bind(path)?;
        let giver = self.clone();
        let path = path.to_owned();
        std::thread::Builder::new().name("tierproxy-handover".into()).spawn(move || {
            loop {
                let peer = match listener.accept() {
                    Ok((s, _)) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, path = %path.display(), "hand-over socket: accept failed");
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    }
                };
                if let Err(e) = giver.give_to(peer) {
                    tracing::warn!(error = %e, "hand-over to the next agent failed");
                }
            }
        })
    }

    /// One next agent on `peer`: the version handshake, then, when it is accepted, the
    /// proxy asked to give everything, which is sent as it comes.
    fn give_to(&self, peer: Socket) -> io::Result<()> {
        peer.set_read_timeout(Some(STEP_TIMEOUT))?;
        peer.set_write_timeout(Some(STEP_TIMEOUT))?;
        same_user(&peer)?;
        let fd: OwnedFd = peer.into();
        let (hello, _) = recv(&fd)?;
        let Message::Hello { oldest, newest } = hello else {
            return Err(protocol(format!("expected hello, got {hello:?}")));
        };
        let Some(version) = common_version(oldest, newest) else {
            let reason = format!(
                "no common hand-over version: the next agent speaks {oldest}..={newest}, this one {OLDEST_VERSION}..={VERSION}"
            );
            send(&fd, &Message::Refuse { reason: reason.clone() }, &[])?;
            return Err(protocol(reason));
        };
        if self.request_udp.is_some() && version < UDP_VERSION {
            let reason = format!(
                "this agent relays UDP flows (--udp-path proxy), which hand-over version {version} cannot carry: the next agent speaks {oldest}..={newest}"
            );
            send(&fd, &Message::Refuse { reason: reason.clone() }, &[])?;
            return Err(protocol(reason));
        }
        if self.lock_outcome().outcome == Some(Outcome::Completed) {
            // This agent gave everything away and acts on nothing (it waits to be stopped):
            // a next agent that still reaches its socket (the agent it handed over to never
            // served the path, or is gone) must start on its own at once, not wait out a
            // hand-over nobody answers (review finding 18 of issue #23).
            let reason = "this agent handed over to another already and holds nothing".to_string();
            send(&fd, &Message::Refuse { reason: reason.clone() }, &[])?;
            tracing::info!(
                "a next agent asked for a hand-over after this one handed over; refused"
            );
            return Ok(());
        }
        send(&fd, &Message::Accept { version }, &[])?;
        // Begun before it is said: a stop asked once the line is out finds the hand-over
        // committed (`Giver::committed`) and sees it through. Said first, a SIGTERM in
        // between drained the agent while the next one was taking its connections
        // (`datapath_netns`'s `an_agent_stopped_during_its_hand_over_exits_once_it_is_over`,
        // which stops the agent right after this line, failed so under a loaded CI run).
        self.begin();
        tracing::info!(version, "handing over to the next agent");
        let (mut queues, mut listeners, mut connections) = (0, 0, 0);
        let (mut udp_listeners, mut udp_flows) = (0, 0);
        let mut finished = 0;
        let mut failed: Option<io::Error> = None;
        // The live connections stop only once every queue reader has parked (an idle one
        // notices within `PARK_CHECK`): that wait is new flows', not theirs.
        let mut asked = self.queues == 0;
        if asked {
            self.ask();
        }
        while finished < self.proxies() || queues < self.queues {
            if failed.is_some() && !asked {
                // The proxy was never asked: nothing more is coming but late queues, which
                // the next hand-over's start closes; the parked readers resume at the end.
                break;
            }
            let item = match self.rx.recv_timeout(STEP_TIMEOUT) {
                Ok(item) => item,
                Err(_) => {
                    // The proxy or a queue reader gave nothing for too long: stuck or gone.
                    failed.get_or_insert(io::Error::other(format!(
                        "proxies finished: {finished} of {}, queues given: {queues} of {}; nothing more for 10 s",
                        self.proxies(),
                        self.queues
                    )));
                    break;
                }
            };
            match &item {
                Outgoing::Finished => {
                    finished += 1;
                    continue;
                }
                Outgoing::Queue(..) => queues += 1,
                _ => {}
            }
            if failed.is_some() {
                // The next agent is gone: what was not sent is reset, as a drain would
                // (the queues are read again by their parked readers).
                if let Outgoing::Connection(c) = item {
                    c.relay.abort();
                }
                continue;
            }
            let sent = match &item {
                Outgoing::Queue(num, q) => {
                    send(&fd, &Message::Queue { num: *num }, &[q.as_raw_fd()])
                }
                Outgoing::Listener(addr, l) => {
                    listeners += 1;
                    send(&fd, &Message::Listener { addr: *addr }, &[l.as_raw_fd()])
                }
                Outgoing::Connection(c) => {
                    connections += 1;
                    send_connection(&fd, c)
                }
                Outgoing::UdpListener(addr, l) => {
                    udp_listeners += 1;
                    send(&fd, &Message::UdpListener { addr: *addr }, &[l.as_raw_fd()])
                }
                Outgoing::UdpFlow(f) => {
                    udp_flows += 1;
                    send_udp_flow(&fd, f)
                }
                Outgoing::Finished => unreachable!("handled above"),
            };
            match sent {
                Err(e) => {
                    if let Outgoing::Connection(c) = item {
                        c.relay.abort();
                    }
                    failed = Some(e);
                }
                // The last queue is the next agent's: the proxies' turn.
                Ok(()) if matches!(item, Outgoing::Queue(..)) && queues == self.queues => {
                    asked = true;
                    self.ask();
                }
                Ok(()) => {}
            }
        }
        let result = match failed {
            Some(e) => Err(e),
            None => {
                let done =
                    Message::Done { queues, listeners, connections, udp_listeners, udp_flows };
                send(&fd, &done, &[]).and_then(|()| {
                    // No timeout now: the next agent reads the queues already, and this
                    // one must not read them again unless the next one is gone (EOF) or
                    // says something else.
                    socket2::SockRef::from(&fd).set_read_timeout(None)?;
                    match recv(&fd)?.0 {
                        Message::Ack => Ok(()),
                        other => Err(protocol(format!("expected ack, got {other:?}"))),
                    }
                })
            }
        };
        match &result {
            Ok(()) => {
                tracing::info!(
                    queues,
                    listeners,
                    connections,
                    udp_listeners,
                    udp_flows,
                    "handed over to the next agent"
                );
                self.end(Outcome::Completed);
            }
            Err(e) => {
                tracing::warn!(error = %e, listeners, connections, udp_flows, "hand-over failed part-way; connections not sent were reset, UDP flows not sent closed");
                self.end(Outcome::Failed);
            }
        }
        result
    }
}

/// Returns when a next agent asks the proxy of `protocol` for a hand-over through
/// `giver` ([`Giver::requested`]); never when there is no giver (no hand-over socket).
pub async fn asked(giver: Option<&Arc<Giver>>, protocol: Protocol) {
    match giver {
        Some(g) => g.requested(protocol).await,
        None => std::future::pending().await,
    }
}

/// A duplicate of listener `l`'s descriptor, with its address `addr`, to give on.
///
/// # Errors
/// When `addr` is one, or the descriptor cannot be duplicated (out of descriptors).
pub fn duplicate(
    l: &impl std::os::fd::AsFd,
    addr: io::Result<SocketAddr>,
) -> io::Result<(SocketAddr, OwnedFd)> {
    Ok((addr?, l.as_fd().try_clone_to_owned()?))
}

/// The newest version both sides speak, if any.
fn common_version(oldest: u32, newest: u32) -> Option<u32> {
    let v = newest.min(VERSION);
    (v >= oldest.max(OLDEST_VERSION)).then_some(v)
}

fn send_connection(fd: &OwnedFd, c: &Connection) -> io::Result<()> {
    let r = &c.relay;
    let header = Header {
        flow: FlowHeader::new(&c.key, &c.flow, c.to_server, c.to_client),
        up: Dir::of(&r.to_server),
        down: Dir::of(&r.to_client),
    };
    let mut fds = vec![r.client.as_raw_fd(), r.server.as_raw_fd()];
    fds.extend(r.to_server.in_flight.as_ref().map(|(p, _)| p.as_raw_fd()));
    fds.extend(r.to_client.in_flight.as_ref().map(|(p, _)| p.as_raw_fd()));
    send(fd, &Message::Connection(header), &fds)
}

fn send_udp_flow(fd: &OwnedFd, f: &UdpFlow) -> io::Result<()> {
    let header = UdpHeader {
        flow: FlowHeader::new(&f.key, &f.flow, f.to_server, f.to_client),
        idle_ms: f.idle.as_millis() as u64,
    };
    send(fd, &Message::UdpFlow(header), &[f.upstream.as_raw_fd(), f.reply.as_raw_fd()])
}

/// What [`take`] found at the hand-over socket.
#[derive(Debug)]
pub enum Take {
    /// No agent listens there: start as usual.
    Nobody,
    /// The running agent speaks no common version, or handed over to another agent
    /// already (its reason): start as usual; an agent that holds anything drains it when
    /// it is stopped.
    Refused(String),
    /// The running agent handed everything over.
    Taken(Taken),
}

/// Listeners and connections taken from the previous agent; [`Taken::ack`] once they are
/// in use, and the previous agent exits.
#[derive(Debug)]
pub struct Taken {
    /// The protocol version used.
    pub version: u32,
    /// The NFQUEUE queues: number and netlink socket.
    pub queues: Vec<(u16, OwnedFd)>,
    /// The transparent listeners, with the addresses they were bound to.
    pub listeners: Vec<(SocketAddr, std::net::TcpListener)>,
    /// The live connections, each stopped where it was.
    pub connections: Vec<Connection>,
    /// The transparent UDP listeners (proxy path), with the addresses they were bound to.
    pub udp_listeners: Vec<(SocketAddr, std::net::UdpSocket)>,
    /// The live UDP flows of the proxy path.
    pub udp_flows: Vec<UdpFlow>,
    socket: OwnedFd,
}

impl Taken {
    /// Tells the previous agent everything arrived; it exits without a reset.
    ///
    /// # Errors
    /// When the previous agent is gone already (it then reset nothing it had sent).
    pub fn ack(self) -> io::Result<()> {
        send(&self.socket, &Message::Ack, &[])
    }
}

/// Asks the agent serving `path` to hand its listeners and live connections over, and
/// takes them. Blocking (each step waits at most [`STEP_TIMEOUT`]).
///
/// # Errors
/// When the socket exists but the exchange fails part-way (the previous agent went away
/// or sent what this version cannot read); a connection received before that is reset.
pub fn take(path: &Path) -> io::Result<Take> {
    let socket = Socket::new(Domain::UNIX, Type::SEQPACKET.cloexec(), None)?;
    match socket.connect(&SockAddr::unix(path)?) {
        Ok(()) => {}
        Err(e)
            if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused) =>
        {
            return Ok(Take::Nobody);
        }
        Err(e) => return Err(e),
    }
    socket.set_read_timeout(Some(STEP_TIMEOUT))?;
    socket.set_write_timeout(Some(STEP_TIMEOUT))?;
    same_user(&socket)?;
    let fd: OwnedFd = socket.into();
    send(&fd, &Message::Hello { oldest: OLDEST_VERSION, newest: VERSION }, &[])?;
    let version = match recv(&fd)?.0 {
        Message::Accept { version } if (OLDEST_VERSION..=VERSION).contains(&version) => version,
        Message::Refuse { reason } => return Ok(Take::Refused(reason)),
        other => return Err(protocol(format!("expected accept or refuse, got {other:?}"))),
    };
    let mut taken = Taken {
        version,
        queues: Vec::new(),
        listeners: Vec::new(),
        connections: Vec::new(),
        udp_listeners: Vec::new(),
        udp_flows: Vec::new(),
        socket: fd,
    };
    match receive_all(&mut taken) {
        Ok(()) => Ok(Take::Taken(taken)),
        Err(e) => {
            // The previous agent let go of what it sent: a connection received so far is
            // this process's alone, and closing it with a FIN would tell both ends it
            // ended well (review finding 12 of issue #23). Reset it.
            for c in taken.connections.drain(..) {
                c.relay.abort();
            }
            Err(e)
        }
    }
}

/// Reads the previous agent's messages into `taken` until `done`.
fn receive_all(taken: &mut Taken) -> io::Result<()> {
    loop {
        let (message, mut fds) = recv(&taken.socket)?;
        match message {
            Message::Queue { num } => {
                let [q] = take_fds::<1>(&mut fds, "queue")?;
                taken.queues.push((num, q));
            }
            Message::Listener { addr } => {
                let [l] = take_fds::<1>(&mut fds, "listener")?;
                let l = std::net::TcpListener::from(l);
                l.set_nonblocking(true)?;
                taken.listeners.push((addr, l));
            }
            Message::Connection(h) => taken.connections.push(connection(h, fds)?),
            Message::UdpListener { addr } => {
                let [l] = take_fds::<1>(&mut fds, "UDP listener")?;
                let l = std::net::UdpSocket::from(l);
                l.set_nonblocking(true)?;
                taken.udp_listeners.push((addr, l));
            }
            Message::UdpFlow(h) => taken.udp_flows.push(udp_flow(h, fds)?),
            Message::Done { queues, listeners, connections, udp_listeners, udp_flows } => {
                let said = (queues, listeners, connections, udp_listeners, udp_flows);
                let arrived = (
                    taken.queues.len(),
                    taken.listeners.len(),
                    taken.connections.len(),
                    taken.udp_listeners.len(),
                    taken.udp_flows.len(),
                );
                if said != arrived {
                    return Err(protocol(format!(
                        "done says {said:?} (queues, listeners, connections, UDP listeners, UDP flows); {arrived:?} arrived"
                    )));
                }
                return Ok(());
            }
            other => return Err(protocol(format!("unexpected {other:?}"))),
        }
    }
}

/// A received `connection` and its descriptors.
fn connection(h: Header, mut fds: Vec<OwnedFd>) -> io::Result<Connection> {
    let want = 2 + usize::from(h.up.in_flight > 0) + usize::from(h.down.in_flight > 0);
    if fds.len() != want {
        return Err(protocol(format!(
            "a connection with {} descriptors, {want} expected",
            fds.len()
        )));
    }
    let [client, server] = take_fds::<2>(&mut fds, "connection")?;
    let mut pipes = fds.into_iter();
    let mut dir = |d: &Dir| DirectionState {
        in_flight: (d.in_flight > 0).then(|| pipes.next().map(|p| (p, d.in_flight))).flatten(),
        eof: d.eof,
        done: d.done,
    };
    let (to_server, to_client) = (dir(&h.up), dir(&h.down));
    let (client, server) = (std::net::TcpStream::from(client), std::net::TcpStream::from(server));
    client.set_nonblocking(true)?;
    server.set_nonblocking(true)?;
    let (key, flow) = h.flow.flow(Protocol::Tcp);
    Ok(Connection {
        key,
        flow,
        to_server: h.flow.to_server,
        to_client: h.flow.to_client,
        relay: Suspended { client, server, to_server, to_client },
    })
}

/// A received `udp-flow` and its descriptors.
fn udp_flow(h: UdpHeader, mut fds: Vec<OwnedFd>) -> io::Result<UdpFlow> {
    if fds.len() != 2 {
        return Err(protocol(format!("a UDP flow with {} descriptors, 2 expected", fds.len())));
    }
    let [upstream, reply] = take_fds::<2>(&mut fds, "UDP flow")?;
    let (upstream, reply) = (std::net::UdpSocket::from(upstream), std::net::UdpSocket::from(reply));
    upstream.set_nonblocking(true)?;
    reply.set_nonblocking(true)?;
    let (key, flow) = h.flow.flow(Protocol::Udp);
    Ok(UdpFlow {
        key,
        flow,
        to_server: h.flow.to_server,
        to_client: h.flow.to_client,
        idle: Duration::from_millis(h.idle_ms),
        upstream,
        reply,
    })
}

impl Suspended {
    /// Where the relay of these sockets resumes.
    pub fn into_resume(self) -> (std::net::TcpStream, std::net::TcpStream, Resume) {
        (self.client, self.server, Resume { to_server: self.to_server, to_client: self.to_client })
    }
}

fn take_fds<const N: usize>(fds: &mut Vec<OwnedFd>, what: &str) -> io::Result<[OwnedFd; N]> {
    if fds.len() < N {
        return Err(protocol(format!("a {what} message with {} descriptors", fds.len())));
    }
    let rest = fds.split_off(N);
    let head = std::mem::replace(fds, rest);
    head.try_into().map_err(|_| protocol(format!("a {what} message's descriptors")))
}

fn protocol(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("hand-over protocol: {what}"))
}

/// Only a process of this agent's user may take its connections (the socket lives on a
/// hostPath that only the agent's pods mount; this is the second lock).
fn same_user(s: &Socket) -> io::Result<()> {
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(s.as_raw_fd()) };
    let cred = nix::sys::socket::getsockopt(&fd, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(io::Error::from)?;
    let me = nix::unistd::geteuid().as_raw();
    if cred.uid() != me {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("hand-over peer runs as uid {}, this agent as {me}", cred.uid()),
        ));
    }
    Ok(())
}

/// A listening `SOCK_SEQPACKET` socket at `path`, replacing a stale one, mode 0600.
fn bind(path: &Path) -> io::Result<Socket> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let s = Socket::new(Domain::UNIX, Type::SEQPACKET.cloexec(), None)?;
    s.bind(&SockAddr::unix(path)?)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    s.listen(4)?;
    Ok(s)
}

/// Sends `message` with `fds`.
fn send(fd: &OwnedFd, message: &Message, fds: &[RawFd]) -> io::Result<()> {
    let body = serde_json::to_vec(message).map_err(io::Error::other)?;
    let iov = [IoSlice::new(&body)];
    let rights = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &rights };
    let n = sendmsg::<()>(fd.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)?;
    if n != body.len() {
        return Err(protocol(format!("sent {n} of {} bytes", body.len())));
    }
    Ok(())
}

/// Receives one message and its descriptors (close-on-exec).
fn recv(fd: &OwnedFd) -> io::Result<(Message, Vec<OwnedFd>)> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    // Room for the most descriptors one message can carry (the kernel's SCM_MAX_FD), not
    // only for the most ours carry: a truncated control message (MSG_CTRUNC) installs the
    // descriptors that fit and nix then refuses to parse it (ENOBUFS), which left them
    // open in this process (review finding 13).
    let mut space = nix::cmsg_space!([RawFd; SCM_MAX_FD]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    let (n, flags, fds) = {
        let msg =
            recvmsg::<()>(fd.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)?;
        let mut fds = Vec::new();
        // Descriptors are owned from here on, whatever else is wrong with the message.
        for c in msg.cmsgs().map_err(io::Error::from)? {
            if let ControlMessageOwned::ScmRights(raw) = c {
                // SAFETY: the kernel just installed these descriptors in this process.
                fds.extend(raw.into_iter().map(|r| unsafe { OwnedFd::from_raw_fd(r) }));
            }
        }
        (msg.bytes, msg.flags, fds)
    };
    if flags.contains(MsgFlags::MSG_TRUNC) {
        return Err(protocol("a message longer than 16 KiB".into()));
    }
    // More descriptors than any message of the protocol carries: refused, and every one
    // closed as `fds` drops.
    if fds.len() > MAX_FDS || flags.contains(MsgFlags::MSG_CTRUNC) {
        return Err(protocol(format!(
            "a message with {} descriptors, more than {MAX_FDS}",
            fds.len()
        )));
    }
    if n == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "hand-over peer closed"));
    }
    let message = serde_json::from_slice(&buf[..n])
        .map_err(|e| protocol(format!("unreadable message: {e}")))?;
    Ok((message, fds))
}

/// The default hand-over socket: on the hostPath the DaemonSet gives every agent pod of a
/// node (`deploy/`), so the next agent finds the running one.
pub fn default_path() -> PathBuf {
    PathBuf::from("/run/tierproxy/handover.sock")
}

/// Helpers of the proxies' hand-over tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::{Take, Taken, take};

    /// Takes over from the agent serving `path`, on a blocking thread as a starting agent
    /// does; panics unless it hands over.
    pub(crate) async fn take_over(path: &std::path::Path) -> Taken {
        let path = path.to_owned();
        match tokio::task::spawn_blocking(move || take(&path)).await.unwrap().unwrap() {
            Take::Taken(t) => t,
            other => panic!("no hand-over: {other:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_common_version_is_chosen_or_none() {
        assert_eq!(common_version(1, 1), Some(1));
        assert_eq!(common_version(1, 7), Some(VERSION));
        assert_eq!(common_version(VERSION + 1, VERSION + 3), None);
        assert_eq!(common_version(0, 0), None);
    }

    /// How many descriptors of this process are open on files under `dir`.
    fn open_under(dir: &Path) -> usize {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|target| target.starts_with(dir))
            .count()
    }

    /// A message with more descriptors than any carries is refused, and none of them stays
    /// open in the receiver (review finding 13: a truncated control message made nix
    /// refuse to parse it, and the descriptors the kernel had installed stayed open).
    #[test]
    fn a_message_with_too_many_descriptors_is_refused_and_leaks_none() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = std::os::unix::net::UnixDatagram::pair().unwrap();
        let (a, b): (OwnedFd, OwnedFd) = (a.into(), b.into());
        let files: Vec<std::fs::File> = (0..MAX_FDS + 2)
            .map(|i| std::fs::File::create(dir.path().join(i.to_string())).unwrap())
            .collect();
        let raw: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
        send(&a, &Message::Ack, &raw).unwrap();
        drop(files);
        let e = recv(&b).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        assert!(e.to_string().contains("6 descriptors, more than 4"), "{e}");
        assert_eq!(open_under(dir.path()), 0, "descriptors left open after the refusal");
        // A message that fits is read as ever.
        send(&a, &Message::Ack, &[]).unwrap();
        assert!(matches!(recv(&b).unwrap(), (Message::Ack, fds) if fds.is_empty()));
    }

    #[test]
    fn nobody_listening_is_no_hand_over() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(take(&dir.path().join("none.sock")).unwrap(), Take::Nobody));
    }

    /// An agent that speaks no version of the next one's refuses, and says why; the next
    /// agent then starts without a hand-over.
    #[test]
    fn an_agent_without_a_common_version_refuses_with_its_reason() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("handover.sock");
        let listener = bind(&path).unwrap();
        let future = std::thread::spawn(move || {
            let (peer, _) = listener.accept().unwrap();
            let fd: OwnedFd = peer.into();
            let (hello, _) = recv(&fd).unwrap();
            assert_eq!(hello, Message::Hello { oldest: OLDEST_VERSION, newest: VERSION });
            // A later agent that speaks only version 9.
            send(&fd, &Message::Refuse { reason: "speaks 9..=9".into() }, &[]).unwrap();
        });
        match take(&path).unwrap() {
            Take::Refused(reason) => assert_eq!(reason, "speaks 9..=9"),
            other => panic!("{other:?}"),
        }
        future.join().unwrap();
        // And the giving side refuses a next agent newer than it.
        let giver = Arc::new(Giver::new(0));
        let path = dir.path().join("giver.sock");
        giver.serve(&path).unwrap();
        let s = Socket::new(Domain::UNIX, Type::SEQPACKET.cloexec(), None).unwrap();
        s.connect(&SockAddr::unix(&path).unwrap()).unwrap();
        let fd: OwnedFd = s.into();
        send(&fd, &Message::Hello { oldest: VERSION + 1, newest: VERSION + 1 }, &[]).unwrap();
        match recv(&fd).unwrap().0 {
            Message::Refuse { reason } => assert!(reason.contains("no common hand-over version")),
            other => panic!("{other:?}"),
        }
    }

    /// An agent relaying UDP on the proxy path refuses a next agent that speaks only
    /// version 1, which has no UDP messages (its flows would be lost), and says why; an
    /// agent without it hands over to that one in version 1.
    #[test]
    fn a_udp_proxy_agent_refuses_a_next_agent_without_udp_hand_over() {
        let dir = tempfile::tempdir().unwrap();
        let ask_v1 = |path: &Path| {
            let s = Socket::new(Domain::UNIX, Type::SEQPACKET.cloexec(), None).unwrap();
            s.connect(&SockAddr::unix(path).unwrap()).unwrap();
            let fd: OwnedFd = s.into();
            send(&fd, &Message::Hello { oldest: 1, newest: 1 }, &[]).unwrap();
            recv(&fd).unwrap().0
        };
        let udp = Arc::new(Giver::new(0).with_udp_proxy(true));
        let path = dir.path().join("udp.sock");
        udp.serve(&path).unwrap();
        match ask_v1(&path) {
            Message::Refuse { reason } => {
                assert!(reason.contains("--udp-path proxy"), "{reason}");
                assert!(reason.contains("1..=1"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        assert!(!udp.park(), "no hand-over began");
        let tcp = Arc::new(Giver::new(0));
        let path = dir.path().join("tcp.sock");
        tcp.serve(&path).unwrap();
        assert_eq!(ask_v1(&path), Message::Accept { version: 1 });
    }

    /// An agent that handed over already refuses the next agent that still reaches its
    /// socket, at once: before, it accepted, asked a proxy that had stopped, and the next
    /// agent waited out the 10 s step timeout before starting on its own (review finding 18
    /// of issue #23).
    #[test]
    fn an_agent_that_handed_over_refuses_the_next_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("giver.sock");
        let giver = Arc::new(Giver::new(1));
        giver.serve(&path).unwrap();
        giver.begin();
        giver.end(Outcome::Completed);
        let asked = std::time::Instant::now();
        match take(&path).unwrap() {
            Take::Refused(reason) => assert!(reason.contains("handed over"), "{reason}"),
            other => panic!("{other:?}"),
        }
        assert!(asked.elapsed() < STEP_TIMEOUT, "refused only after {:?}", asked.elapsed());
        assert!(!giver.park(), "the queue readers of a retired agent are not asked to park");
    }

    /// A reader still waiting on a failed hand-over's outcome when the next one begins
    /// reads on and parks for the new one, giving its queue to it (review finding 17 of
    /// issue #23: it found the new one's empty outcome, waited on without giving its queue,
    /// and the new hand-over failed after its 10 s step timeout).
    #[test]
    fn a_reader_late_from_a_failed_hand_over_parks_for_the_next() {
        let giver = Arc::new(Giver::new(1));
        giver.begin();
        let reader = {
            let g = giver.clone();
            std::thread::spawn(move || {
                // As `queue::read` does: park whenever a hand-over is under way, read (here:
                // wait a little) otherwise, until the next agent has the queue.
                let mut parks = 0;
                let deadline = std::time::Instant::now() + Duration::from_secs(10);
                while std::time::Instant::now() < deadline {
                    if !g.park() {
                        std::thread::sleep(Duration::from_millis(1));
                        continue;
                    }
                    parks += 1;
                    let (a, _b) = std::os::unix::net::UnixDatagram::pair().unwrap();
                    if !g.parked(3, a.into()) {
                        return parks;
                    }
                }
                parks
            })
        };
        let first = giver.rx.recv_timeout(Duration::from_secs(5)).expect("the first queue");
        assert!(matches!(first, Outgoing::Queue(3, _)));
        // The first hand-over fails and the next begins before the reader wakes.
        giver.end(Outcome::Failed);
        giver.begin();
        let second = giver.rx.recv_timeout(Duration::from_secs(5));
        assert!(
            matches!(second, Ok(Outgoing::Queue(3, _))),
            "the reader gave the next one its queue"
        );
        giver.end(Outcome::Completed);
        assert_eq!(reader.join().unwrap(), 2, "parked once per hand-over, then ended");
    }

    /// A message that is not JSON of this protocol is an error naming the protocol, never a
    /// panic.
    #[test]
    fn an_unreadable_message_is_an_error() {
        let (a, b) = std::os::unix::net::UnixDatagram::pair().unwrap();
        a.send(b"{\"type\":\"nonsense\"}").unwrap();
        let fd: OwnedFd = b.into();
        let e = recv(&fd).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("hand-over protocol"), "{e}");
    }

    /// A loopback pair: (the end that connected, the end that was accepted).
    fn pair() -> (std::net::TcpStream, std::net::TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (a, l.accept().unwrap().0)
    }

    /// A stopped connection as the proxy gives it: the client's application end, the
    /// server's, and the connection.
    fn stopped() -> (std::net::TcpStream, std::net::TcpStream, Connection) {
        let (client_app, client) = pair();
        let (server, server_app) = pair();
        let c = Connection {
            key: FlowKey {
                src: client_app.local_addr().unwrap(),
                dst: server_app.local_addr().unwrap(),
                protocol: Protocol::Tcp,
            },
            flow: HandedFlow {
                age: Duration::ZERO,
                revision: Revision(1),
                audited: false,
                decided: std::time::SystemTime::now(),
            },
            to_server: 0,
            to_client: 0,
            relay: Suspended {
                client,
                server,
                to_server: DirectionState::default(),
                to_client: DirectionState::default(),
            },
        };
        (client_app, server_app, c)
    }

    /// A connection given when no hand-over is under way any more (one that failed and
    /// ended as the proxy stopped it) is reset at once, not left in the channel: its
    /// client must not hang (review of issue #23).
    #[test]
    fn a_connection_given_after_a_failed_hand_over_is_reset() {
        let giver = Giver::new(0);
        let (mut client_app, mut server_app, c) = stopped();
        giver.give(Outgoing::Connection(c));
        for app in [&mut client_app, &mut server_app] {
            app.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let e = std::io::Read::read(app, &mut [0u8; 1]).expect_err("reset");
            assert_eq!(e.kind(), io::ErrorKind::ConnectionReset);
        }
        assert!(giver.rx.is_empty());
    }

    /// The previous agent sends a connection, then something this version cannot read: the
    /// next agent's take fails, and the connection it received is reset at both ends, not
    /// closed with a FIN that would tell them it ended well (review finding 12 of #23).
    #[test]
    fn a_connection_received_before_a_failed_take_is_reset() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("handover.sock");
        let listener = bind(&path).unwrap();
        let (mut client_app, mut server_app, c) = stopped();
        let previous = std::thread::spawn(move || {
            let (peer, _) = listener.accept().unwrap();
            let fd: OwnedFd = peer.into();
            assert!(matches!(recv(&fd).unwrap().0, Message::Hello { .. }));
            send(&fd, &Message::Accept { version: VERSION }, &[]).unwrap();
            send_connection(&fd, &c).unwrap();
            // The previous agent lets go of what it sent (its copies close, no FIN: the
            // next agent holds the sockets), then says what the next cannot read.
            drop(c);
            send(&fd, &Message::Ack, &[]).unwrap();
        });
        let e = take(&path).unwrap_err();
        assert!(e.to_string().contains("unexpected Ack"), "{e}");
        previous.join().unwrap();
        for app in [&mut client_app, &mut server_app] {
            app.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let e = std::io::Read::read(app, &mut [0u8; 1]).expect_err("reset, not EOF");
            assert_eq!(e.kind(), io::ErrorKind::ConnectionReset);
        }
    }

    /// The next agent goes away while the queue readers park, before the proxy was asked:
    /// the readers read on at once, not after the 10 s a stuck proxy is given (review of
    /// issue #23).
    #[test]
    fn parked_readers_resume_at_once_when_the_next_agent_leaves_before_the_proxy_is_asked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("handover.sock");
        let giver = Arc::new(Giver::new(1));
        giver.serve(&path).unwrap();
        let s = Socket::new(Domain::UNIX, Type::SEQPACKET.cloexec(), None).unwrap();
        s.connect(&SockAddr::unix(&path).unwrap()).unwrap();
        let fd: OwnedFd = s.into();
        send(&fd, &Message::Hello { oldest: OLDEST_VERSION, newest: VERSION }, &[]).unwrap();
        assert!(matches!(recv(&fd).unwrap().0, Message::Accept { .. }));
        drop(fd);
        // A reader parks once the hand-over began, giving a queue the next agent is not
        // there to take.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !giver.park() {
            assert!(std::time::Instant::now() < deadline, "the hand-over never began");
            std::thread::sleep(Duration::from_millis(1));
        }
        let (reader, resumed) = std::sync::mpsc::channel();
        let g = giver.clone();
        std::thread::spawn(move || {
            let (a, _b) = std::os::unix::net::UnixDatagram::pair().unwrap();
            reader.send(g.parked(3, a.into())).unwrap();
        });
        let read_on = resumed.recv_timeout(Duration::from_secs(5)).expect("the reader resumes");
        assert!(read_on, "the reader reads its queue again");
    }
}
