//! QUIC-LB connection IDs for a QUIC server behind Sluice: a [`ConnectionIdGenerator`] for
//! quinn that puts the server's ID into every connection ID it issues, in the layout of the
//! QUIC-LB draft's unencrypted mode (draft-ietf-quic-load-balancers), which a Sluice VIP
//! configured with `quic = "cid"` routes by. A client that changes its address or port
//! (NAT rebinding, a phone moving between networks, an explicit migration) keeps reaching
//! the same server, with no connection-table state in the load balancer.
//!
//! # Layout
//!
//! ```text
//!  octet 0            octets 1 ..= L               octets L+1 .. L+1+N
//! +---+---------+  +------------------------+  +-------------------------+
//! |rot| low 5   |  | server ID (L octets)   |  | nonce (N >= 4 octets)   |
//! +---+---------+  +------------------------+  +-------------------------+
//!  3 bits  5 bits      big endian as configured       random per connection ID
//! ```
//!
//! - Octet 0: the top three bits are the **config rotation codepoint** (0 to 6; the load
//!   balancer's `quic_config_rotation`; 7 is reserved for unroutable connection IDs). The low
//!   five bits are random, or with [length self-description](QuicLbCids::self_describing)
//!   the connection ID's length less one.
//! - Octets 1 to L: the **server ID**, exactly as configured for this backend
//!   (`quic_server_id = "0a01"` is the two octets `0x0a 0x01`), L = the VIP's
//!   `quic_server_id_len`, 1 to 8 octets here (the draft allows 15; Sluice's data plane reads
//!   at most 8). A server ID must not be all zero.
//! - Then the **nonce**: at least four random octets (from the operating system's random
//!   source), so connection IDs of one connection cannot be linked by an observer other than
//!   the load balancer.
//!
//! The whole connection ID is 1 + L + N octets, at most 20 (QUIC v1 and v2).
//!
//! # Use with quinn
//!
//! ```ignore
//! let cids = sluice_quic_lb::QuicLbCids::new(0, &[0x0a, 0x01], 6)?;
//! let mut endpoint_config = quinn::EndpointConfig::default();
//! endpoint_config.cid_generator(cids.factory());
//! let endpoint = quinn::Endpoint::new(endpoint_config, Some(server_config), socket, runtime)?;
//! ```
//!
//! Every backend of the VIP gets its own server ID and the same rotation and ID length as the
//! load balancer's configuration.

use std::{fmt, time::Duration};

use lb_common::quic;
use quinn_proto::{ConnectionId, ConnectionIdGenerator, InvalidCid};

/// Longest connection ID of QUIC versions 1 and 2.
pub const MAX_CID_LEN: usize = quic::MAX_CID_LEN;
/// Longest server ID Sluice's data plane reads.
pub const MAX_SERVER_ID_LEN: usize = quic::SERVER_ID_LEN_MAX as usize;
/// Shortest nonce the draft allows.
pub const MIN_NONCE_LEN: usize = quic::NONCE_LEN_MIN;
/// Highest config rotation codepoint (the next marks an unroutable connection ID).
pub const MAX_CONFIG_ROTATION: u8 = quic::ROTATION_UNROUTABLE - 1;
/// The rotation codepoint's position in the first octet.
pub const ROTATION_SHIFT: u32 = quic::ROTATION_SHIFT;
const LOW_BITS: u8 = (1 << ROTATION_SHIFT) - 1;

/// Why a [`QuicLbCids`] could not be made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Error {
    /// The config rotation codepoint is over 6.
    ConfigRotation(u8),
    /// The server ID is empty or longer than [`MAX_SERVER_ID_LEN`] octets.
    ServerIdLen(usize),
    /// The server ID is all zero.
    ServerIdZero,
    /// The nonce is shorter than [`MIN_NONCE_LEN`] octets.
    NonceLen(usize),
    /// The connection ID (1 + server ID + nonce) is longer than [`MAX_CID_LEN`] octets.
    CidLen(usize),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::ConfigRotation(r) => write!(
                f,
                "config rotation codepoint {r} is out of range (0 to {MAX_CONFIG_ROTATION})"
            ),
            Error::ServerIdLen(n) => write!(
                f,
                "a server ID of {n} octets: it must have 1 to {MAX_SERVER_ID_LEN}"
            ),
            Error::ServerIdZero => write!(f, "the server ID must not be all zero"),
            Error::NonceLen(n) => write!(
                f,
                "a nonce of {n} octets: it must have at least {MIN_NONCE_LEN}"
            ),
            Error::CidLen(n) => write!(
                f,
                "a connection ID of {n} octets (1 + server ID + nonce): at most {MAX_CID_LEN}"
            ),
        }
    }
}

impl std::error::Error for Error {}

/// Generates QUIC-LB connection IDs naming one server (see the crate docs for the layout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuicLbCids {
    rotation: u8,
    server_id: Vec<u8>,
    nonce_len: usize,
    self_describing: bool,
    lifetime: Option<Duration>,
}

impl QuicLbCids {
    /// Connection IDs with rotation codepoint `config_rotation` (0 to 6), this server's ID
    /// (1 to 8 octets, not all zero) and `nonce_len` random octets (at least 4; the whole
    /// ID at most 20 octets). The first octet's low bits are random and connection IDs do not
    /// expire; see [`QuicLbCids::self_describing`] and [`QuicLbCids::lifetime`].
    pub fn new(config_rotation: u8, server_id: &[u8], nonce_len: usize) -> Result<Self, Error> {
        if config_rotation > MAX_CONFIG_ROTATION {
            return Err(Error::ConfigRotation(config_rotation));
        }
        if server_id.is_empty() || server_id.len() > MAX_SERVER_ID_LEN {
            return Err(Error::ServerIdLen(server_id.len()));
        }
        if server_id.iter().all(|b| *b == 0) {
            return Err(Error::ServerIdZero);
        }
        if nonce_len < MIN_NONCE_LEN {
            return Err(Error::NonceLen(nonce_len));
        }
        let len = 1 + server_id.len() + nonce_len;
        if len > MAX_CID_LEN {
            return Err(Error::CidLen(len));
        }
        Ok(QuicLbCids {
            rotation: config_rotation,
            server_id: server_id.to_vec(),
            nonce_len,
            self_describing: false,
            lifetime: None,
        })
    }

    /// With `on`, the first octet's low five bits carry the connection ID's length less one
    /// (the draft's length self-description), for load balancers that need it to find the
    /// end of the ID; otherwise they are random.
    pub fn self_describing(mut self, on: bool) -> Self {
        self.self_describing = on;
        self
    }

    /// Connection IDs are retired after `lifetime` (quinn issues new ones); None: never.
    pub fn lifetime(mut self, lifetime: Option<Duration>) -> Self {
        self.lifetime = lifetime;
        self
    }

    pub fn config_rotation(&self) -> u8 {
        self.rotation
    }

    pub fn server_id(&self) -> &[u8] {
        &self.server_id
    }

    pub fn nonce_len(&self) -> usize {
        self.nonce_len
    }

    /// The length of every connection ID issued: 1 + server ID + nonce.
    pub fn len(&self) -> usize {
        1 + self.server_id.len() + self.nonce_len
    }

    /// Never: a connection ID has at least six octets.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Writes a fresh connection ID into `out[..self.len()]` and returns that part.
    ///
    /// Panics if `out` is too short, or if the operating system's random source fails
    /// (getrandom; on Linux it does not once the system has booted).
    pub fn fill<'a>(&self, out: &'a mut [u8]) -> &'a [u8] {
        let len = self.len();
        let cid = &mut out[..len];
        getrandom::fill(cid).expect("the operating system's random source failed");
        let low = if self.self_describing {
            (len - 1) as u8
        } else {
            cid[0] & LOW_BITS
        };
        cid[0] = self.rotation << ROTATION_SHIFT | low;
        cid[1..1 + self.server_id.len()].copy_from_slice(&self.server_id);
        cid
    }

    /// A factory for `quinn::EndpointConfig::cid_generator` (quinn-proto's
    /// `EndpointConfig::cid_generator`): every endpoint gets its own copy of this generator.
    pub fn factory(&self) -> impl Fn() -> Box<dyn ConnectionIdGenerator> + Send + Sync + 'static {
        let g = self.clone();
        move || Box::new(g.clone())
    }
}

impl ConnectionIdGenerator for QuicLbCids {
    fn generate_cid(&mut self) -> ConnectionId {
        let mut buf = [0u8; MAX_CID_LEN];
        ConnectionId::new(self.fill(&mut buf))
    }

    /// A connection ID of this length, rotation codepoint and server ID (and length octet,
    /// if self-describing): a short-header packet with any other is not this server's
    /// (misrouted, or garbage) and quinn drops it instead of answering with a stateless reset.
    fn validate(&self, cid: &ConnectionId) -> Result<(), InvalidCid> {
        if cid.len() != self.len() {
            return Err(InvalidCid);
        }
        match server_id_of(cid, self.server_id.len()) {
            Some((r, id)) if r == self.rotation && id == self.server_id.as_slice() => {}
            _ => return Err(InvalidCid),
        }
        if self.self_describing && cid[0] & LOW_BITS != (cid.len() - 1) as u8 {
            return Err(InvalidCid);
        }
        Ok(())
    }

    fn cid_len(&self) -> usize {
        self.len()
    }

    fn cid_lifetime(&self) -> Option<Duration> {
        self.lifetime
    }
}

/// The config rotation codepoint and server ID a QUIC-LB connection ID carries, read as a
/// load balancer would with `server_id_len`-octet server IDs: None when the ID is too short
/// to hold the first octet, the server ID and a four-octet nonce, or is longer than 20
/// octets. The codepoint 7 (unroutable) is returned as is.
pub fn server_id_of(cid: &[u8], server_id_len: usize) -> Option<(u8, &[u8])> {
    if server_id_len == 0
        || cid.len() > MAX_CID_LEN
        || cid.len() < 1 + server_id_len + MIN_NONCE_LEN
    {
        return None;
    }
    Some((cid[0] >> ROTATION_SHIFT, &cid[1..1 + server_id_len]))
}

/// Parses a server ID written in hex (`"0a01"`, as in Sluice's `quic_server_id`): an even
/// number of hex digits, 1 to 8 octets.
pub fn parse_server_id(hex: &str) -> Option<Vec<u8>> {
    let hex = hex.trim();
    if hex.is_empty() || !hex.len().is_multiple_of(2) || hex.len() > 2 * MAX_SERVER_ID_LEN {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn layout_has_rotation_server_id_and_nonce_in_place() {
        for rotation in 0..=MAX_CONFIG_ROTATION {
            let mut g = QuicLbCids::new(rotation, &[0x0a, 0x01], 6).unwrap();
            for _ in 0..50 {
                let cid = g.generate_cid();
                assert_eq!(cid.len(), 9);
                assert_eq!(g.cid_len(), 9);
                assert_eq!(cid[0] >> 5, rotation, "{cid:?}");
                assert_eq!(&cid[1..3], &[0x0a, 0x01]);
                assert_eq!(server_id_of(&cid, 2), Some((rotation, &[0x0a, 0x01][..])));
                assert!(g.validate(&cid).is_ok());
            }
        }
    }

    #[test]
    fn every_server_id_length_fits() {
        for len in 1..=MAX_SERVER_ID_LEN {
            let id: Vec<u8> = (1..=len as u8).collect();
            let mut g = QuicLbCids::new(3, &id, MAX_CID_LEN - 1 - len).unwrap();
            let cid = g.generate_cid();
            assert_eq!(cid.len(), MAX_CID_LEN);
            assert_eq!(&cid[1..1 + len], id.as_slice());
            assert_eq!(server_id_of(&cid, len), Some((3, id.as_slice())));
        }
    }

    #[test]
    fn the_low_bits_are_random_or_the_length() {
        let mut g = QuicLbCids::new(2, &[7], 8).unwrap();
        let lows: HashSet<u8> = (0..200).map(|_| g.generate_cid()[0] & 0x1f).collect();
        assert!(lows.len() > 8, "low bits look constant: {lows:?}");
        let mut g = g.self_describing(true);
        for _ in 0..50 {
            let cid = g.generate_cid();
            assert_eq!(cid[0], 2 << 5 | 9, "{cid:?}");
            assert!(g.validate(&cid).is_ok());
        }
    }

    #[test]
    fn nonces_are_unique() {
        let mut g = QuicLbCids::new(0, &[0x0a, 0x01], 4).unwrap();
        let n = 2000;
        let nonces: HashSet<Vec<u8>> = (0..n).map(|_| g.generate_cid()[3..].to_vec()).collect();
        // 2000 draws from 2^32: a collision has a probability of about 5e-4.
        assert!(nonces.len() >= n - 1, "{} distinct of {n}", nonces.len());
        let mut g = QuicLbCids::new(0, &[0x0a, 0x01], 8).unwrap();
        let cids: HashSet<ConnectionId> = (0..n).map(|_| g.generate_cid()).collect();
        assert_eq!(cids.len(), n);
    }

    #[test]
    fn other_servers_ids_do_not_validate() {
        let g = QuicLbCids::new(1, &[0x0a, 0x01], 6).unwrap();
        let mut other = QuicLbCids::new(1, &[0x0a, 0x02], 6).unwrap();
        let mut rotated = QuicLbCids::new(2, &[0x0a, 0x01], 6).unwrap();
        let mut longer = QuicLbCids::new(1, &[0x0a, 0x01], 7).unwrap();
        assert!(g.validate(&other.generate_cid()).is_err());
        assert!(g.validate(&rotated.generate_cid()).is_err());
        assert!(g.validate(&longer.generate_cid()).is_err());
        let sd = g.clone().self_describing(true);
        let mut cid = [0u8; MAX_CID_LEN];
        let cid = ConnectionId::new(g.fill(&mut cid));
        let matches = cid[0] & 0x1f == 8;
        assert_eq!(sd.validate(&cid).is_ok(), matches);
    }

    #[test]
    fn bad_configurations_are_refused() {
        assert_eq!(
            QuicLbCids::new(7, &[1], 4).unwrap_err(),
            Error::ConfigRotation(7)
        );
        assert_eq!(
            QuicLbCids::new(0, &[], 4).unwrap_err(),
            Error::ServerIdLen(0)
        );
        assert_eq!(
            QuicLbCids::new(0, &[1; 9], 4).unwrap_err(),
            Error::ServerIdLen(9)
        );
        assert_eq!(
            QuicLbCids::new(0, &[0, 0], 4).unwrap_err(),
            Error::ServerIdZero
        );
        assert_eq!(QuicLbCids::new(0, &[1], 3).unwrap_err(), Error::NonceLen(3));
        assert_eq!(
            QuicLbCids::new(0, &[1; 8], 12).unwrap_err(),
            Error::CidLen(21)
        );
        assert!(QuicLbCids::new(6, &[1; 8], 11).is_ok());
        assert!(QuicLbCids::new(0, &[0, 1], 4).is_ok());
        // Messages say what is wrong and what is allowed.
        assert!(Error::ServerIdLen(9).to_string().contains("1 to 8"));
    }

    #[test]
    fn short_or_long_ids_have_no_server_id() {
        assert_eq!(server_id_of(&[0; 6], 2), None);
        assert_eq!(
            server_id_of(&[0x20, 1, 2, 0, 0, 0, 0], 2),
            Some((1, &[1, 2][..]))
        );
        assert_eq!(server_id_of(&[0; 21], 2), None);
        assert_eq!(server_id_of(&[0; 8], 0), None);
        assert_eq!(server_id_of(&[0xff; 8], 1), Some((7, &[0xff][..])));
    }

    #[test]
    fn server_ids_parse_from_hex() {
        assert_eq!(parse_server_id("0a01"), Some(vec![0x0a, 0x01]));
        assert_eq!(parse_server_id("FF"), Some(vec![0xff]));
        assert_eq!(parse_server_id("0a0"), None);
        assert_eq!(parse_server_id(""), None);
        assert_eq!(parse_server_id("zz"), None);
        assert_eq!(parse_server_id("010203040506070809"), None);
    }

    #[test]
    fn the_factory_makes_independent_generators() {
        let g = QuicLbCids::new(0, &[9, 9], 5).unwrap();
        let f = g.factory();
        let (mut a, mut b) = (f(), f());
        assert_eq!(a.cid_len(), 8);
        assert_ne!(a.generate_cid(), b.generate_cid());
    }
}
