//! Protocols and destination-port matching: numbers, inclusive ranges and named ports.
//!
//! Sources: `networking.k8s.io/v1` `NetworkPolicyPort` ("protocol ... If not specified,
//! this field defaults to TCP"; "endPort indicates that the range of ports from port to
//! endPort if set, inclusive, should be allowed"; a named port refers to a container port
//! of the destination pod), network-policy-api v1alpha1 `AdminNetworkPolicyPort`
//! (`portNumber`, `portRange` "inclusive", `namedPort` "selects a port on a pod(s) based on
//! name") and v1alpha2 `ClusterNetworkPolicyProtocol` (`tcp|udp|sctp.destinationPort`,
//! `destinationNamedPort`).

use std::fmt;
use std::str::FromStr;

/// A transport protocol a policy port can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    /// TCP (IP protocol 6); the default wherever a policy omits the protocol.
    Tcp,
    /// UDP (17).
    Udp,
    /// SCTP (132).
    Sctp,
}

impl Protocol {
    /// The Kubernetes spelling: `TCP`, `UDP`, `SCTP`.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A protocol name other than `TCP`, `UDP` or `SCTP`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown protocol {0:?} (expected TCP, UDP or SCTP)")]
pub struct UnknownProtocol(pub String);

impl FromStr for Protocol {
    type Err = UnknownProtocol;

    /// Parses the Kubernetes spelling, exactly (the API is case-sensitive).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "TCP" => Ok(Protocol::Tcp),
            "UDP" => Ok(Protocol::Udp),
            "SCTP" => Ok(Protocol::Sctp),
            _ => Err(UnknownProtocol(s.to_string())),
        }
    }
}

/// A declared container port of a pod (`spec.containers[].ports[]`), used to resolve named
/// ports on the destination pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedPort {
    /// `name` (an IANA_SVC_NAME).
    pub name: String,
    /// `protocol`, default TCP.
    pub protocol: Protocol,
    /// `containerPort`.
    pub port: u16,
}

/// Which destination ports a port entry covers.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PortSpec {
    /// Every port (a NetworkPolicy port with only a protocol; a CNP `tcp: {}`).
    Any,
    /// `lo..=hi` (a single port has `lo == hi`).
    Range(u16, u16),
    /// A container port name, resolved on the destination pod.
    Named(String),
}

/// One entry of a rule's port list.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PortMatch {
    /// The protocol it is for; `None` for a CNP `destinationNamedPort`, whose protocol is
    /// that of the named container port.
    pub protocol: Option<Protocol>,
    /// The ports.
    pub ports: PortSpec,
}

impl PortMatch {
    /// `true` if a flow with `protocol` to `port` on a destination that declares
    /// `dst_ports` (empty when the destination is not a pod) matches this entry.
    ///
    /// A named port matches iff the destination pod declares a container port with that
    /// name whose protocol equals the flow's (and the entry's, when it has one) and whose
    /// number is the flow's destination port.
    #[inline]
    pub fn matches(&self, protocol: Protocol, port: u16, dst_ports: &[NamedPort]) -> bool {
        if self.protocol.is_some_and(|p| p != protocol) {
            return false;
        }
        match &self.ports {
            PortSpec::Any => true,
            PortSpec::Range(lo, hi) => (*lo..=*hi).contains(&port),
            PortSpec::Named(name) => dst_ports
                .iter()
                .any(|np| np.name == *name && np.protocol == protocol && np.port == port),
        }
    }
}

/// A rule's port list: empty matches every protocol and port (an absent `ports`/`protocols`
/// field); otherwise any entry must match.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Ports(pub Box<[PortMatch]>);

impl Ports {
    /// Matches every protocol and port.
    pub fn any() -> Self {
        Ports(Box::new([]))
    }

    /// See [`PortMatch::matches`]; an empty list matches everything.
    #[inline]
    pub fn matches(&self, protocol: Protocol, port: u16, dst_ports: &[NamedPort]) -> bool {
        self.0.is_empty() || self.0.iter().any(|m| m.matches(protocol, port, dst_ports))
    }

    /// Named ports referenced by this list.
    pub fn named(&self) -> impl Iterator<Item = &str> {
        self.0.iter().filter_map(|m| match &m.ports {
            PortSpec::Named(n) => Some(n.as_str()),
            _ => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(name: &str, protocol: Protocol, port: u16) -> NamedPort {
        NamedPort { name: name.into(), protocol, port }
    }

    #[test]
    fn range_is_inclusive_on_both_ends() {
        let m = PortMatch { protocol: Some(Protocol::Tcp), ports: PortSpec::Range(32000, 32768) };
        assert!(m.matches(Protocol::Tcp, 32000, &[]));
        assert!(m.matches(Protocol::Tcp, 32768, &[]));
        assert!(!m.matches(Protocol::Tcp, 32769, &[]));
        assert!(!m.matches(Protocol::Udp, 32000, &[]));
    }

    #[test]
    fn named_port_needs_name_protocol_and_number() {
        let pod = [named("http", Protocol::Tcp, 8080), named("dns", Protocol::Udp, 53)];
        let http =
            PortMatch { protocol: Some(Protocol::Tcp), ports: PortSpec::Named("http".into()) };
        assert!(http.matches(Protocol::Tcp, 8080, &pod));
        assert!(!http.matches(Protocol::Tcp, 80, &pod));
        assert!(!http.matches(Protocol::Tcp, 8080, &[]));
        let dns_tcp =
            PortMatch { protocol: Some(Protocol::Tcp), ports: PortSpec::Named("dns".into()) };
        assert!(!dns_tcp.matches(Protocol::Tcp, 53, &pod));
        let any_proto = PortMatch { protocol: None, ports: PortSpec::Named("dns".into()) };
        assert!(any_proto.matches(Protocol::Udp, 53, &pod));
        assert!(!any_proto.matches(Protocol::Tcp, 53, &pod));
    }

    #[test]
    fn empty_list_matches_everything() {
        assert!(Ports::any().matches(Protocol::Sctp, 1, &[]));
    }

    #[test]
    fn protocol_parsing_is_exact() {
        assert_eq!("UDP".parse::<Protocol>(), Ok(Protocol::Udp));
        assert!("udp".parse::<Protocol>().is_err());
    }
}
