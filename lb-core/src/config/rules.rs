//! The rules an operator's input meets wherever it comes from. The configuration file
//! (`config::parse`, so `sluice run`, SIGHUP and `sluice check`) and the admin API
//! (`State::apply`) call these same functions, so neither accepts what the other refuses.
//! Each returns what is wrong, ending with what is allowed.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

/// Longest label name: a Prometheus-style key, and short enough for one table column.
pub const LABEL_NAME_MAX: usize = 63;
/// Longest label value.
pub const LABEL_VALUE_MAX: usize = 255;
/// Most labels on one backend: they are kept in the state file and shown in every listing.
pub const LABELS_MAX: usize = 32;
/// Longest duration anywhere (timeouts, windows, intervals, drain deadlines). A year is
/// beyond any real use and keeps every conversion to milliseconds or nanoseconds in a u64
/// exact, so a huge value such as `18446744073709552s` cannot wrap to a short drain deadline.
pub const DURATION_MAX: Duration = Duration::from_secs(365 * 24 * 3600);
/// [`DURATION_MAX`] as operators write it.
pub const DURATION_MAX_TEXT: &str = "365d";
/// Largest backend weight (weights are relative shares of the ring; 0 takes no new flows).
pub const WEIGHT_MAX: u32 = 65535;
/// A backend's weight when none is given.
pub const WEIGHT_DEFAULT: u32 = 100;
/// Lowest admission priority class (0 is the highest).
pub const PRIORITY_MAX: u8 = 7;
/// Longest client-affinity window.
pub const AFFINITY_WINDOW_MAX: Duration = Duration::from_secs(24 * 3600);

/// A QUIC-LB server ID's length in octets when none is given.
pub const QUIC_SERVER_ID_LEN_DEFAULT: u8 = 2;
/// Longest QUIC-LB server ID the data plane reads, in octets.
pub const QUIC_SERVER_ID_LEN_MAX: u8 = lb_common::quic::SERVER_ID_LEN_MAX;
/// Highest config rotation codepoint a VIP may use (the next, `0b111`, is QUIC-LB's
/// "unroutable").
pub const QUIC_ROTATION_MAX: u8 = lb_common::quic::ROTATION_UNROUTABLE - 1;

/// Largest tenant weight (a share of a busy or full pool among the tenants using it).
pub const TENANT_WEIGHT_MAX: u32 = 1000;
/// Highest `new_sessions_per_sec` and `burst` of a tenant: the rate's interval stays at
/// least a microsecond, well above the data plane clock's granularity.
pub const TENANT_RATE_MAX: u32 = 1_000_000;
/// The tenant that names the clients no configured prefix matches (data-plane id 0).
pub const DEFAULT_TENANT: &str = "default";

/// An integer within `lo..=hi`; `note` follows the allowed range (e.g. " (0 = off)").
pub fn in_range(v: i64, lo: i64, hi: i64, note: &str) -> Result<(), String> {
    if (lo..=hi).contains(&v) {
        Ok(())
    } else {
        Err(format!("{v} is out of range; allowed: {lo}..={hi}{note}"))
    }
}

/// A backend weight: 0 to [`WEIGHT_MAX`].
pub fn weight(w: i64) -> Result<(), String> {
    in_range(w, 0, WEIGHT_MAX.into(), " (0 = no new flows)")
}

/// A VIP's admission priority class: 0 to [`PRIORITY_MAX`].
pub fn priority(p: i64) -> Result<(), String> {
    in_range(p, 0, PRIORITY_MAX.into(), " (0 = highest)")
}

/// A Maglev ring size: a prime no larger than `RING_SIZE_MAX`.
pub fn ring_size(v: i64) -> Result<u32, String> {
    use lb_common::RING_SIZE_MAX;
    let allowed = format!(
        "allowed: a prime no larger than {RING_SIZE_MAX}, e.g. {} (the default), 16381, 4093 \
         or 1021",
        crate::maglev::DEFAULT_RING_SIZE
    );
    if !(1..=RING_SIZE_MAX as i64).contains(&v) {
        Err(format!("{v} is out of range; {allowed}"))
    } else if !crate::maglev::is_prime(v as u32) {
        Err(format!("{v} is not prime; {allowed}"))
    } else {
        Ok(v as u32)
    }
}

/// A client-affinity window, written `text`: whole seconds, at most [`AFFINITY_WINDOW_MAX`].
pub fn affinity_window(d: Duration, text: &str) -> Result<(), String> {
    if d > AFFINITY_WINDOW_MAX {
        Err(format!(
            "{text:?} is longer than 24h; allowed: 0s..=24h (0s = off)"
        ))
    } else if d.subsec_nanos() != 0 {
        Err(format!(
            "{text:?} is not a whole number of seconds; allowed: whole seconds from 0s to 24h \
             (0s = off)"
        ))
    } else {
        Ok(())
    }
}

/// A VIP name: 1 to 32 of a-z, 0-9, `-` and `_` (it appears in paths and metric labels).
pub fn vip_name(s: &str) -> Result<(), String> {
    if name_chars(s) {
        Ok(())
    } else {
        Err(format!(
            "{} is not a valid VIP name; allowed: 1 to 32 of a-z, 0-9, \"-\" and \"_\"",
            quoted(s)
        ))
    }
}

/// 1 to 32 of a-z, 0-9, `-` and `_`.
fn name_chars(s: &str) -> bool {
    (1..=32).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// A tenant name: 1 to 32 of a-z, 0-9, `-` and `_` (it appears in metric labels).
pub fn tenant_name(s: &str) -> Result<(), String> {
    if name_chars(s) {
        Ok(())
    } else {
        Err(format!(
            "{} is not a valid tenant name; allowed: 1 to 32 of a-z, 0-9, \"-\" and \"_\"",
            quoted(s)
        ))
    }
}

/// A tenant's rate with its burst: a burst needs a rate to refill it.
pub fn tenant_burst(burst: u32, rate: u32) -> Result<(), String> {
    if burst > 0 && rate == 0 {
        Err(format!(
            "{burst} is set without new_sessions_per_sec; allowed: a burst only with a rate \
             (set new_sessions_per_sec, or leave burst out)"
        ))
    } else {
        Ok(())
    }
}

/// A `[[vip.tenant]]` override against the `[[tenant]]` tables: it names one of them (or
/// `"default"`), and the burst it ends up with has a rate. The key at fault and why.
pub fn tenant_override(
    o: &super::TenantOverride,
    tenants: &[super::TenantConfig],
) -> Result<(), (&'static str, String)> {
    let base = match tenants.iter().find(|t| t.name == o.name) {
        Some(t) => t.clone(),
        None if o.name == DEFAULT_TENANT => super::TenantConfig::unlimited_default(),
        None => {
            let known: Vec<String> = tenants.iter().map(|t| format!("{:?}", t.name)).collect();
            let known = if known.is_empty() {
                "no [[tenant]] tables are configured".to_owned()
            } else {
                format!("the tenants are {}", known.join(", "))
            };
            return Err((
                "name",
                format!(
                    "{} names no [[tenant]]; allowed: the name of a [[tenant]] table or \
                     \"default\" ({known})",
                    quoted(&o.name)
                ),
            ));
        }
    };
    let l = base.limits_on(std::slice::from_ref(o));
    tenant_burst(l.burst, l.new_sessions_per_sec).map_err(|e| ("burst", e))
}

/// A backend's labels: at most [`LABELS_MAX`], each name and value a bounded token (no
/// control characters, spaces or quotes reach a terminal or a table row).
pub fn labels(labels: &BTreeMap<String, String>) -> Result<(), String> {
    label_count(labels.len())?;
    labels.iter().try_for_each(|(k, v)| label(k, v))
}

/// At most [`LABELS_MAX`] labels.
pub fn label_count(n: usize) -> Result<(), String> {
    if n > LABELS_MAX {
        return Err(format!("{n} labels; allowed: at most {LABELS_MAX}"));
    }
    Ok(())
}

/// One label: name and value each 1 to [`LABEL_NAME_MAX`] / [`LABEL_VALUE_MAX`] bytes of
/// `A-Z a-z 0-9 _ . -`.
pub fn label(name: &str, value: &str) -> Result<(), String> {
    token(name, LABEL_NAME_MAX, "label name")?;
    token(value, LABEL_VALUE_MAX, "label value")
}

/// A non-empty string of at most `max` bytes of `A-Z a-z 0-9 _ . -` (label names and values,
/// device names).
pub fn token(s: &str, max: usize, what: &str) -> Result<(), String> {
    let ok = (1..=max).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{} is not a valid {what}; allowed: 1 to {max} of A-Z, a-z, 0-9, \"_\", \".\" and \
             \"-\"",
            quoted(s)
        ))
    }
}

/// An address a VIP or backend may have: one host, reachable as itself.
pub fn unicast(ip: IpAddr) -> Result<(), String> {
    let what = match ip {
        _ if ip.is_unspecified() => "the unspecified address",
        _ if ip.is_multicast() => "a multicast address",
        IpAddr::V4(v4) if v4 == Ipv4Addr::BROADCAST => "the broadcast address",
        IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some() => {
            return Err(format!(
                "\"{ip}\" is an IPv4-mapped IPv6 address; allowed: the IPv4 address itself ({})",
                v6.to_ipv4_mapped().expect("matched")
            ))
        }
        _ => return Ok(()),
    };
    Err(format!("\"{ip}\" is {what}; allowed: a unicast address"))
}

/// An address a VIP may have: a unicast address that clients on other hosts can reach
/// (a loopback VIP never sees a packet through the interfaces the data plane is attached to).
pub fn vip_address(ip: IpAddr) -> Result<(), String> {
    unicast(ip)?;
    if ip.is_loopback() {
        return Err(format!(
            "\"{ip}\" is a loopback address; allowed: an address clients reach through the \
             attached interfaces"
        ));
    }
    Ok(())
}

/// A backend of the VIP at `vip`: a unicast host other than loopback (packets to it leave
/// the machine, encapsulated) and other than the VIP itself (the tunnel would loop), of a
/// family the VIP's packets can be carried in, and routable as it stands: not reserved,
/// not link-local (an address without its interface is ambiguous) and not a NAT64 prefix
/// (the translator would send the packets back out as IPv4, unencapsulated).
pub fn backend_address(addr: IpAddr, vip: IpAddr) -> Result<(), String> {
    unicast(addr)?;
    let host = "allowed: an address of the backend host";
    let what = match addr {
        _ if addr.is_loopback() => "a loopback address",
        IpAddr::V4(v4) if v4.octets()[0] >= 240 => "in 240.0.0.0/4 (reserved)",
        IpAddr::V4(v4) if v4.is_link_local() => {
            "link-local (169.254.0.0/16), which names no interface"
        }
        IpAddr::V6(v6) if v6.is_unicast_link_local() => {
            "link-local (fe80::/10), which names no interface"
        }
        IpAddr::V6(v6) if v6.segments()[..6] == [0x64, 0xff9b, 0, 0, 0, 0] => {
            "in the NAT64 prefix 64:ff9b::/96"
        }
        _ if addr == vip => "the VIP's own address",
        _ => "",
    };
    if !what.is_empty() {
        return Err(format!("\"{addr}\" is {what}; {host}"));
    }
    if vip.is_ipv6() && addr.is_ipv4() {
        return Err(format!(
            "\"{addr}\" is IPv4 but the VIP {vip} is IPv6; allowed: an IPv6 backend (IPv6 cannot be \
             encapsulated in IPv4)"
        ));
    }
    Ok(())
}

/// A backend address that is no VIP's (`vips`: each VIP's name and address): packets
/// encapsulated to it would come back to this load balancer.
pub fn backend_not_a_vip<'a>(
    addr: IpAddr,
    mut vips: impl Iterator<Item = (&'a str, IpAddr)>,
) -> Result<(), String> {
    match vips.find(|&(_, a)| a == addr) {
        Some((name, _)) => Err(format!(
            "\"{addr}\" is the address of VIP {name:?}; allowed: an address of the backend host"
        )),
        None => Ok(()),
    }
}

/// A QUIC-LB server ID length: 1 to [`QUIC_SERVER_ID_LEN_MAX`] octets.
pub fn quic_server_id_len(v: i64) -> Result<u8, String> {
    in_range(v, 1, QUIC_SERVER_ID_LEN_MAX.into(), " octets")?;
    Ok(v as u8)
}

/// A QUIC-LB config rotation codepoint: 0 to [`QUIC_ROTATION_MAX`]; 7 is reserved.
pub fn quic_config_rotation(v: i64) -> Result<u8, String> {
    if v == i64::from(lb_common::quic::ROTATION_UNROUTABLE) {
        return Err(format!(
            "{v} is QUIC-LB's reserved \"unroutable\" codepoint; allowed: 0..={QUIC_ROTATION_MAX}"
        ));
    }
    in_range(v, 0, QUIC_ROTATION_MAX.into(), "")?;
    Ok(v as u8)
}

/// A VIP's `quic` mode on its protocol: connection-ID routing only on UDP.
pub fn quic_mode(cid: bool, udp: bool) -> Result<(), String> {
    if cid && !udp {
        Err(
            "\"cid\" needs protocol = \"udp\" (QUIC runs over UDP); allowed: \"off\" on a \
             tcp VIP"
                .to_owned(),
        )
    } else {
        Ok(())
    }
}

/// A backend's QUIC-LB server ID for a VIP whose IDs are `len` octets: exactly `2 * len` hex
/// digits, not all zero. Returns its value as the data plane's key holds it
/// (`lb_common::quic::server_id_value`).
pub fn quic_server_id(s: &str, len: u8) -> Result<u64, String> {
    let digits = 2 * usize::from(len);
    let allowed = format!(
        "allowed: {digits} hex digits (quic_server_id_len = {len} octets), not all zero, \
         unique within the VIP, e.g. {:?}",
        format!(
            "{:0digits$x}",
            0x0a01u64 & (u64::MAX >> (64 - 8 * u32::from(len.clamp(1, 8))))
        )
    );
    if s.len() != digits || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!(
            "{} is not {len} octets of hex; {allowed}",
            quoted(s)
        ));
    }
    let bytes: Vec<u8> = (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("checked digits"))
        .collect();
    let v = lb_common::quic::server_id_value(&bytes);
    if v == 0 {
        return Err(format!("{} is all zero; {allowed}", quoted(s)));
    }
    Ok(v)
}

/// The value of a server ID that [`quic_server_id`] accepted at its own length.
pub fn quic_server_id_value(s: &str) -> Option<u64> {
    let len = u8::try_from(s.len() / 2).ok()?;
    quic_server_id(s, len).ok()
}

/// A duration no longer than [`DURATION_MAX`]; the error follows the value as written.
pub fn bounded(d: Duration) -> Result<Duration, String> {
    if d <= DURATION_MAX {
        Ok(d)
    } else {
        Err(format!(
            "is longer than {DURATION_MAX_TEXT}; allowed: a duration up to {DURATION_MAX_TEXT}"
        ))
    }
}

/// Parses "10m", "1h30m"... no longer than [`DURATION_MAX`].
pub fn duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| {
        format!(
            "{} is not a duration ({e}); allowed: a number and a unit (ns, us, ms, s, m, h, d), \
             e.g. \"500ms\", \"10s\", \"5m\"",
            quoted(s)
        )
    })?;
    bounded(d).map_err(|e| format!("{} {e}", quoted(s)))
}

/// Whole milliseconds of a duration, saturating: exact for anything [`bounded`] accepts.
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Whole nanoseconds of a duration, saturating: exact for anything [`bounded`] accepts.
pub fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Whole seconds of a duration as a u32, saturating (affinity windows are at most a day).
pub fn secs_u32(d: Duration) -> u32 {
    u32::try_from(d.as_secs()).unwrap_or(u32::MAX)
}

/// `s` quoted and escaped for an error message, cut at 80 characters so a megabyte of label
/// does not become a megabyte of log line.
pub fn quoted(s: &str) -> String {
    const KEEP: usize = 80;
    match s.char_indices().nth(KEEP) {
        Some((at, _)) => format!("{:?}... ({} bytes)", &s[..at], s.len()),
        None => format!("{s:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn backend_addresses() {
        let vip = ip("10.200.0.1");
        assert!(backend_address(ip("10.1.0.1"), vip).is_ok());
        for (bad, why) in [
            ("255.255.255.255", "is the broadcast address"),
            ("0.0.0.0", "is the unspecified address"),
            ("224.0.0.1", "is a multicast address"),
            ("127.0.0.1", "is a loopback address"),
            ("10.200.0.1", "is the VIP's own address"),
            ("240.0.0.1", "is in 240.0.0.0/4 (reserved)"),
            ("250.1.2.3", "is in 240.0.0.0/4 (reserved)"),
            ("169.254.10.1", "is link-local (169.254.0.0/16)"),
            (
                "::ffff:10.1.0.1",
                "is an IPv4-mapped IPv6 address; allowed: the IPv4 address itself (10.1.0.1)",
            ),
        ] {
            let e = backend_address(ip(bad), vip).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
        let e = backend_address(ip("10.1.0.1"), ip("fd00::1")).unwrap_err();
        assert!(
            e.contains("\"10.1.0.1\" is IPv4 but the VIP fd00::1 is IPv6"),
            "{e}"
        );
        assert!(backend_address(ip("fd00::2"), ip("fd00::1")).is_ok());
        let v6 = ip("fd00::1");
        for (bad, why) in [
            ("fe80::1", "is link-local (fe80::/10)"),
            ("febf::1", "is link-local (fe80::/10)"),
            ("64:ff9b::a01:1", "is in the NAT64 prefix 64:ff9b::/96"),
            ("::1", "is a loopback address"),
        ] {
            let e = backend_address(ip(bad), v6).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
        // Neighbours of the refused ranges stay valid.
        for (good, vip) in [
            ("169.253.255.1", vip),
            ("223.255.255.1", vip),
            ("fec0::1", v6),
            ("64:ff9b:1::1", v6),
        ] {
            assert!(backend_address(ip(good), vip).is_ok(), "{good}");
        }
    }

    #[test]
    fn vips_are_not_loopback_and_backends_are_no_vip() {
        for bad in ["127.0.0.1", "127.3.2.1", "::1"] {
            let e = vip_address(ip(bad)).unwrap_err();
            assert!(e.contains("is a loopback address"), "{bad}: {e}");
        }
        assert!(vip_address(ip("10.200.0.1")).is_ok());
        let vips = [("chat", ip("10.200.0.1")), ("embed", ip("10.200.0.2"))];
        let e = backend_not_a_vip(ip("10.200.0.2"), vips.into_iter()).unwrap_err();
        assert_eq!(
            e,
            "\"10.200.0.2\" is the address of VIP \"embed\"; allowed: an address of the backend host"
        );
        assert!(backend_not_a_vip(ip("10.1.0.1"), vips.into_iter()).is_ok());
    }

    #[test]
    fn labels_are_bounded_tokens() {
        let one = |k: &str, v: &str| labels(&BTreeMap::from([(k.to_string(), v.to_string())]));
        assert!(one("rack", "r1.a-2_b").is_ok());
        let e = one("rack", "r1\x1b[31m").unwrap_err();
        assert!(
            e.starts_with("\"r1\\u{1b}[31m\" is not a valid label value"),
            "{e}"
        );
        assert!(one("rack", "a\nb").is_err());
        assert!(one("", "x").is_err());
        assert!(one("rack", "").is_err());
        assert!(one(&"k".repeat(LABEL_NAME_MAX), &"v".repeat(LABEL_VALUE_MAX)).is_ok());
        let e = one("rack", &"v".repeat(100_000)).unwrap_err();
        assert!(e.ends_with("allowed: 1 to 255 of A-Z, a-z, 0-9, \"_\", \".\" and \"-\""));
        assert!(e.len() < 300, "the message quotes a bounded part: {e}");
        assert!(one(&"k".repeat(LABEL_NAME_MAX + 1), "v").is_err());
        let many = (0..=LABELS_MAX)
            .map(|i| (format!("k{i}"), "v".into()))
            .collect();
        assert_eq!(labels(&many).unwrap_err(), "33 labels; allowed: at most 32");
    }

    #[test]
    fn durations_are_bounded_and_convert_exactly() {
        assert_eq!(duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(duration("365d"), Ok(DURATION_MAX));
        let e = duration("18446744073709552s").unwrap_err();
        assert_eq!(
            e,
            "\"18446744073709552s\" is longer than 365d; allowed: a duration up to 365d"
        );
        assert!(duration("366d").is_err());
        assert!(duration("soon").unwrap_err().contains("is not a duration"));
        assert_eq!(millis(DURATION_MAX), 31_536_000_000);
        assert_eq!(nanos(DURATION_MAX), 31_536_000_000_000_000);
        assert_eq!(millis(Duration::MAX), u64::MAX, "saturates, never wraps");
        assert_eq!(nanos(Duration::MAX), u64::MAX);
        assert_eq!(secs_u32(Duration::from_secs(86_400)), 86_400);
        assert_eq!(secs_u32(Duration::MAX), u32::MAX);
    }

    #[test]
    fn quic_rules() {
        assert_eq!(quic_server_id("0a01", 2), Ok(0x0a01));
        assert_eq!(quic_server_id("0A01", 2), Ok(0x0a01));
        assert_eq!(quic_server_id("ff", 1), Ok(0xff));
        assert_eq!(
            quic_server_id("0102030405060708", 8),
            Ok(0x0102_0304_0506_0708)
        );
        let e = quic_server_id("a01", 2).unwrap_err();
        assert_eq!(
            e,
            "\"a01\" is not 2 octets of hex; allowed: 4 hex digits (quic_server_id_len = 2 \
             octets), not all zero, unique within the VIP, e.g. \"0a01\""
        );
        assert!(quic_server_id("0g01", 2)
            .unwrap_err()
            .contains("is not 2 octets of hex"));
        assert!(quic_server_id("0a0102", 2).is_err());
        assert!(quic_server_id("+a01", 2).is_err());
        let e = quic_server_id("0000", 2).unwrap_err();
        assert!(
            e.starts_with("\"0000\" is all zero; allowed: 4 hex digits"),
            "{e}"
        );
        assert!(quic_server_id("00", 1).unwrap_err().contains("e.g. \"01\""));
        assert_eq!(quic_server_id_value("0a01"), Some(0x0a01));
        assert_eq!(quic_server_id_value("zz"), None);
        assert_eq!(quic_server_id_len(1), Ok(1));
        assert_eq!(quic_server_id_len(8), Ok(8));
        assert_eq!(
            quic_server_id_len(9).unwrap_err(),
            "9 is out of range; allowed: 1..=8 octets"
        );
        assert!(quic_server_id_len(0).is_err());
        assert_eq!(quic_config_rotation(6), Ok(6));
        assert_eq!(
            quic_config_rotation(7).unwrap_err(),
            "7 is QUIC-LB's reserved \"unroutable\" codepoint; allowed: 0..=6"
        );
        assert!(quic_config_rotation(-1).is_err());
        assert!(quic_mode(true, true).is_ok());
        assert!(quic_mode(false, false).is_ok());
        assert!(quic_mode(true, false)
            .unwrap_err()
            .contains("needs protocol = \"udp\""));
    }

    #[test]
    fn vip_names() {
        assert!(vip_name("chat-1_a").is_ok());
        assert!(vip_name("Chat").is_err());
        assert!(vip_name(&"a".repeat(33)).is_err());
        assert!(vip_name("").is_err());
    }
}
