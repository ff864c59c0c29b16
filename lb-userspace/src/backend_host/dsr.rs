//! What breaks direct server return on a backend host, judged from facts read off the host
//! ([`read_facts`], a thin shell) by pure rules ([`evaluate`]).
//!
//! The LB delivers the client's packet inside an outer IPv4/IPv6 header; `sluice_decap`
//! strips it on the interface, the stack delivers it to the VIP on `lo`, and the reply goes
//! straight to the client. That breaks when:
//! - strict reverse-path filtering drops the decapsulated packet (its source is the client,
//!   whose route back may leave by another interface);
//! - the host answers ARP for an IPv4 VIP on `lo` (`arp_ignore` 0), or uses a VIP as the
//!   source of its ARP requests (`arp_announce` below 2): neighbours then send VIP traffic
//!   to this host instead of the LB;
//! - the interface has no room for a full-size client packet plus the outer header: the LB
//!   then answers with ICMP "fragmentation needed" and clients' packets shrink.

use std::{ffi::CString, net::IpAddr};

use serde::Serialize;

use super::config::HostConfig;

/// Bytes the LB adds: an outer IPv4 header, or an outer IPv6 one.
pub const OUTER_V4: u32 = 20;
pub const OUTER_V6: u32 = 40;

/// `net.ipv4.conf.<dev>.*` values (`None`: unreadable).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sysctls {
    pub rp_filter: Option<u32>,
    pub arp_ignore: Option<u32>,
    pub arp_announce: Option<u32>,
}

/// One decapsulating interface as found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InterfaceFacts {
    pub name: String,
    /// `None`: the interface does not exist (in this network namespace).
    pub mtu: Option<u32>,
    pub sysctls: Sysctls,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostFacts {
    /// `net.ipv4.conf.all.*`: the kernel uses the larger of `all` and the device's value.
    pub all: Sysctls,
    pub interfaces: Vec<InterfaceFacts>,
}

/// One problem: which check, where, what goes wrong, and the command that fixes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// `interface`, `rp_filter`, `arp_ignore`, `arp_announce` or `mtu` (the metrics label).
    pub check: &'static str,
    pub interface: String,
    pub problem: String,
    pub fix: String,
}

/// Every check's name, so the metrics show a zero for the ones that pass.
pub const CHECKS: [&str; 5] = [
    "interface",
    "rp_filter",
    "arp_ignore",
    "arp_announce",
    "mtu",
];

fn effective(all: Option<u32>, dev: Option<u32>) -> Option<u32> {
    match (all, dev) {
        (Some(a), Some(d)) => Some(a.max(d)),
        (a, d) => a.or(d),
    }
}

/// The problems `facts` show for `cfg`, in interface order.
pub fn evaluate(cfg: &HostConfig, facts: &HostFacts) -> Vec<Finding> {
    let mut out = Vec::new();
    let v4_vips = cfg.vips.iter().any(IpAddr::is_ipv4);
    for f in &facts.interfaces {
        let dev = &f.name;
        let finding = |check, problem: String, fix: String| Finding {
            check,
            interface: dev.clone(),
            problem,
            fix,
        };
        let Some(mtu) = f.mtu else {
            out.push(finding(
                "interface",
                format!("interface {dev} does not exist in this network namespace"),
                "fix `interfaces` in the configuration (see `ip link`)".into(),
            ));
            continue;
        };
        if effective(facts.all.rp_filter, f.sysctls.rp_filter) == Some(1) {
            out.push(finding(
                "rp_filter",
                format!(
                    "strict reverse-path filtering (rp_filter 1) on {dev} drops decapsulated \
                     packets from clients whose route back does not leave by {dev}"
                ),
                format!(
                    "sysctl -w net.ipv4.conf.all.rp_filter=2 net.ipv4.conf.{dev}.rp_filter=2 \
                     (loose)"
                ),
            ));
        }
        if v4_vips {
            if effective(facts.all.arp_ignore, f.sysctls.arp_ignore).is_some_and(|v| v == 0) {
                out.push(finding(
                    "arp_ignore",
                    format!(
                        "arp_ignore 0: {dev} answers ARP requests for the VIPs on lo, so the \
                         segment may send VIP traffic to this host instead of the LB"
                    ),
                    "sysctl -w net.ipv4.conf.all.arp_ignore=1".into(),
                ));
            }
            if effective(facts.all.arp_announce, f.sysctls.arp_announce).is_some_and(|v| v < 2) {
                out.push(finding(
                    "arp_announce",
                    format!(
                        "arp_announce below 2: this host may use a VIP as the source of its ARP \
                         requests on {dev}, teaching neighbours that the VIP is here"
                    ),
                    "sysctl -w net.ipv4.conf.all.arp_announce=2".into(),
                ));
            }
        }
        let need = cfg.client_mtu + OUTER_V6;
        if mtu < need {
            out.push(finding(
                "mtu",
                format!(
                    "{dev}'s MTU {mtu} has no room for a {}-byte client packet plus the outer \
                     header ({OUTER_V4} bytes IPv4, {OUTER_V6} IPv6): the LB answers such packets \
                     with ICMP \"fragmentation needed\" and clients send smaller ones",
                    cfg.client_mtu
                ),
                format!(
                    "ip link set {dev} mtu {need} (the whole path from the LB too), or clamp the \
                     clients' MSS"
                ),
            ));
        }
    }
    out
}

fn read_u32(path: &str) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn sysctls(dev: &str) -> Sysctls {
    // /proc/sys/net shows the reading process's network namespace.
    let k = |key: &str| read_u32(&format!("/proc/sys/net/ipv4/conf/{dev}/{key}"));
    Sysctls {
        rp_filter: k("rp_filter"),
        arp_ignore: k("arp_ignore"),
        arp_announce: k("arp_announce"),
    }
}

/// An interface's MTU in this process's network namespace (an ioctl on a socket, not
/// /sys/class/net, which shows the namespace sysfs was mounted in).
pub fn mtu(dev: &str) -> Option<u32> {
    let name = CString::new(dev).ok()?;
    if name.as_bytes().len() >= libc::IFNAMSIZ {
        return None;
    }
    // SAFETY: a datagram socket used for one ioctl and closed; ifreq is plain data sized by
    // libc, its name NUL-terminated within IFNAMSIZ (checked above).
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return None;
        }
        let mut req: libc::ifreq = std::mem::zeroed();
        for (d, s) in req.ifr_name.iter_mut().zip(name.as_bytes()) {
            *d = *s as libc::c_char;
        }
        let r = libc::ioctl(fd, libc::SIOCGIFMTU, &mut req);
        libc::close(fd);
        (r == 0).then_some(req.ifr_ifru.ifru_mtu as u32)
    }
}

/// Reads what [`evaluate`] judges, for the configured interfaces.
pub fn read_facts(cfg: &HostConfig) -> HostFacts {
    HostFacts {
        all: sysctls("all"),
        interfaces: cfg
            .interfaces
            .iter()
            .map(|i| InterfaceFacts {
                name: i.name.clone(),
                mtu: mtu(&i.name),
                sysctls: sysctls(&i.name),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend_host::config::parse;

    fn cfg(vips: &str) -> HostConfig {
        parse(
            &format!("interfaces = [{{ name = \"eth0\" }}]\nvips = [{vips}]\n"),
            "t",
        )
        .unwrap()
    }

    fn good() -> HostFacts {
        let ok = Sysctls {
            rp_filter: Some(0),
            arp_ignore: Some(1),
            arp_announce: Some(2),
        };
        HostFacts {
            all: ok,
            interfaces: vec![InterfaceFacts {
                name: "eth0".into(),
                mtu: Some(1540),
                sysctls: Sysctls {
                    rp_filter: Some(2),
                    arp_ignore: Some(0),
                    arp_announce: Some(0),
                },
            }],
        }
    }

    fn checks(f: &[Finding]) -> Vec<&str> {
        f.iter().map(|f| f.check).collect()
    }

    #[test]
    fn a_host_set_up_for_dsr_has_no_findings() {
        assert_eq!(evaluate(&cfg(r#""10.0.0.1""#), &good()), vec![]);
    }

    #[test]
    fn strict_rp_filter_on_the_interface_or_all_is_found() {
        let mut f = good();
        f.interfaces[0].sysctls.rp_filter = Some(1);
        f.all.rp_filter = Some(0);
        assert_eq!(checks(&evaluate(&cfg(""), &f)), ["rp_filter"]);
        // The larger value wins: all = 2 makes 1 on the device loose.
        f.all.rp_filter = Some(2);
        assert_eq!(checks(&evaluate(&cfg(""), &f)), Vec::<&str>::new());
        f.interfaces[0].sysctls.rp_filter = Some(0);
        f.all.rp_filter = Some(1);
        let found = evaluate(&cfg(""), &f);
        assert_eq!(checks(&found), ["rp_filter"]);
        assert_eq!(
            found[0].fix,
            "sysctl -w net.ipv4.conf.all.rp_filter=2 net.ipv4.conf.eth0.rp_filter=2 (loose)"
        );
    }

    #[test]
    fn arp_settings_matter_only_for_ipv4_vips() {
        let mut f = good();
        f.all.arp_ignore = Some(0);
        f.all.arp_announce = Some(1);
        assert_eq!(
            checks(&evaluate(&cfg(r#""10.0.0.1""#), &f)),
            ["arp_ignore", "arp_announce"]
        );
        assert_eq!(
            checks(&evaluate(&cfg(r#""fd00::1""#), &f)),
            Vec::<&str>::new()
        );
        // The device's own value counts too.
        f.interfaces[0].sysctls.arp_ignore = Some(1);
        f.interfaces[0].sysctls.arp_announce = Some(2);
        assert_eq!(
            checks(&evaluate(&cfg(r#""10.0.0.1""#), &f)),
            Vec::<&str>::new()
        );
    }

    #[test]
    fn the_mtu_needs_room_for_the_ipv6_outer_header() {
        let mut f = good();
        f.interfaces[0].mtu = Some(1539);
        let found = evaluate(&cfg(""), &f);
        assert_eq!(checks(&found), ["mtu"]);
        assert!(
            found[0].fix.starts_with("ip link set eth0 mtu 1540"),
            "{found:?}"
        );
        f.interfaces[0].mtu = Some(9000);
        assert_eq!(checks(&evaluate(&cfg(""), &f)), Vec::<&str>::new());
    }

    #[test]
    fn a_missing_interface_is_reported_and_nothing_else_about_it() {
        let mut f = good();
        f.interfaces[0].mtu = None;
        f.interfaces[0].sysctls.rp_filter = Some(1);
        assert_eq!(checks(&evaluate(&cfg(""), &f)), ["interface"]);
    }

    #[test]
    fn loopback_has_an_mtu_and_a_missing_device_none() {
        assert!(mtu("lo").is_some_and(|m| m > 0));
        assert_eq!(mtu("sluice-none0"), None);
    }
}
