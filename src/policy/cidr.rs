//! CIDR parsing and matching for NetworkPolicy `ipBlock` and ANP/CNP `networks` peers.
//!
//! Sources: `networking.k8s.io/v1` `IPBlock` ("cidr is a string representing the IPBlock
//! Valid examples are "192.168.1.0/24" or "2001:db8::/64""; `except` "will be rejected if
//! they are outside the cidr range"), and network-policy-api `CIDR`
//! (`XValidation: isCIDR(self)`). Both accept host bits and mean the masked network, as
//! CEL's `cidr(...).masked()` and Go's `net.ParseCIDR` do; tierproxy masks them too.

use std::net::IpAddr;

use ipnet::IpNet;

/// Why a CIDR string was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CidrError {
    /// No `/prefix` part.
    #[error("missing /prefix length")]
    MissingPrefix,
    /// The address or the prefix length does not parse, or the prefix is too long.
    #[error("not an IPv4 or IPv6 CIDR")]
    Syntax,
    /// An IPv4-mapped IPv6 address (`::ffff:10.0.0.0/104`), which CEL's `isCIDR` rejects.
    #[error("IPv4-mapped IPv6 addresses are not allowed")]
    Ipv4Mapped,
}

/// Parses `addr/len` and masks host bits: `10.1.2.3/8` → `10.0.0.0/8`.
///
/// # Errors
/// [`CidrError`] for a missing prefix, bad syntax (leading zeros, zones, a prefix longer
/// than the family allows) or an IPv4-mapped IPv6 address.
pub fn parse(s: &str) -> Result<IpNet, CidrError> {
    let (addr, len) = s.split_once('/').ok_or(CidrError::MissingPrefix)?;
    // std's parser, unlike ipnet's, rejects leading zeros ("010.0.0.0"), as Go's netip
    // (behind CEL's isCIDR) does; the prefix must be plain decimal without leading zeros.
    let addr: IpAddr = addr.parse().map_err(|_| CidrError::Syntax)?;
    let strict_len = !len.is_empty()
        && len.bytes().all(|b| b.is_ascii_digit())
        && (len == "0" || !len.starts_with('0'));
    if !strict_len {
        return Err(CidrError::Syntax);
    }
    let len: u8 = len.parse().map_err(|_| CidrError::Syntax)?;
    let net = IpNet::new(addr, len).map_err(|_| CidrError::Syntax)?;
    if let IpNet::V6(v6) = net
        && v6.addr().to_ipv4_mapped().is_some()
    {
        return Err(CidrError::Ipv4Mapped);
    }
    Ok(net.trunc())
}

/// A CIDR with exceptions: an `ipBlock` (`cidr` minus every `except`), or a plain network
/// with no exceptions. Addresses of the other IP family never match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// The network, host bits masked.
    pub net: IpNet,
    /// Networks carved out of `net`, host bits masked.
    pub except: Vec<IpNet>,
}

impl Block {
    /// A network without exceptions.
    pub fn new(net: IpNet) -> Self {
        Block { net, except: Vec::new() }
    }

    /// `true` iff `ip` is inside `net` and outside every `except`.
    #[inline]
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.net.contains(&ip) && !self.except.iter().any(|e| e.contains(&ip))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_bits_are_masked() {
        assert_eq!(parse("10.1.2.3/8").unwrap().to_string(), "10.0.0.0/8");
        assert_eq!(parse("2001:db8::1/32").unwrap().to_string(), "2001:db8::/32");
    }

    #[test]
    fn rejects_bad_syntax() {
        assert_eq!(parse("10.0.0.0"), Err(CidrError::MissingPrefix));
        assert_eq!(parse("10.0.0.0/33"), Err(CidrError::Syntax));
        assert_eq!(parse("010.0.0.0/8"), Err(CidrError::Syntax));
        assert_eq!(parse("fe80::1%eth0/64"), Err(CidrError::Syntax));
        assert_eq!(parse("10.0.0.0/08"), Err(CidrError::Syntax));
        assert_eq!(parse("10.0.0.0/"), Err(CidrError::Syntax));
        assert_eq!(parse("::ffff:10.0.0.0/104"), Err(CidrError::Ipv4Mapped));
    }

    #[test]
    fn except_subtracts_and_families_do_not_mix() {
        let b = Block {
            net: parse("10.0.0.0/8").unwrap(),
            except: vec![parse("10.1.0.0/16").unwrap()],
        };
        assert!(b.contains("10.2.0.1".parse().unwrap()));
        assert!(!b.contains("10.1.0.1".parse().unwrap()));
        assert!(!b.contains("::ffff:10.2.0.1".parse().unwrap()));
        assert!(!Block::new(parse("0.0.0.0/0").unwrap()).contains("::1".parse().unwrap()));
    }
}
