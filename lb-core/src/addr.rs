//! Conversions between std addresses and the data plane's network-order words.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use lb_common::{FAMILY_V4, FAMILY_V6};

/// Address as the maps store it (wire bytes in each word) and its family.
pub fn to_words(ip: IpAddr) -> ([u32; 4], u8) {
    match ip {
        IpAddr::V4(v4) => ([u32::from_ne_bytes(v4.octets()), 0, 0, 0], FAMILY_V4),
        IpAddr::V6(v6) => {
            let o = v6.octets();
            let w = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            ([w(0), w(4), w(8), w(12)], FAMILY_V6)
        }
    }
}

pub fn from_words(words: [u32; 4], family: u8) -> IpAddr {
    if family == FAMILY_V4 {
        IpAddr::V4(Ipv4Addr::from(words[0].to_ne_bytes()))
    } else {
        let mut o = [0u8; 16];
        for (i, w) in words.iter().enumerate() {
            o[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
        }
        IpAddr::V6(Ipv6Addr::from(o))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip_and_keep_wire_order() {
        for ip in ["10.1.2.3", "2001:db8::1", "::ffff:1.2.3.4"] {
            let ip: IpAddr = ip.parse().unwrap();
            let (w, f) = to_words(ip);
            assert_eq!(from_words(w, f), ip);
        }
        let (w, _) = to_words("10.1.2.3".parse().unwrap());
        assert_eq!(w[0].to_ne_bytes(), [10, 1, 2, 3]);
    }
}
