//! `[[tenant]]` and `[[vip.tenant]]`: names, prefixes and limits, and the rules across them.

use lb_common::MAX_TENANTS;

use super::*;

/// The `[[tenant]]` tables, each checked, then the rules across them: unique names, each
/// prefix in one tenant, at most `MAX_TENANTS - 1` named tenants and `MAX_TENANT_PREFIXES`
/// prefixes.
pub(in crate::config) fn tenants(
    c: &mut Checker,
    root: &KeyPath,
    raw: Vec<RawTenant>,
) -> Option<Vec<TenantConfig>> {
    let mut out = Vec::new();
    let mut ok = true;
    let named = raw
        .iter()
        .filter(|t| t.name.as_deref() != Some(rules::DEFAULT_TENANT))
        .count();
    let max_named = MAX_TENANTS as usize - 1;
    if named > max_named {
        c.err(
            &root.key("tenant"),
            format!(
                "{named} tenants are configured besides \"default\"; allowed: at most \
                 {max_named} (the data plane's tenant ids)"
            ),
        );
        ok = false;
    }
    let total: usize = raw
        .iter()
        .map(|t| t.prefixes.as_ref().map_or(0, Vec::len))
        .sum();
    if total > lb_common::MAX_TENANT_PREFIXES as usize {
        c.err(
            &root.key("tenant"),
            format!(
                "{total} prefixes are configured over all tenants; allowed: at most {} (the \
                 data plane's prefix table)",
                lb_common::MAX_TENANT_PREFIXES
            ),
        );
        ok = false;
    }
    let mut names: HashMap<String, usize> = HashMap::new();
    let mut prefixes: HashMap<Cidr, (usize, String)> = HashMap::new();
    for (i, r) in raw.into_iter().enumerate() {
        let p = root.key("tenant").idx(i);
        let Some(t) = tenant(c, &p, r) else {
            ok = false;
            continue;
        };
        if let Some(first) = names.get(&t.name) {
            c.err(
                &p.key("name"),
                format!(
                    "{:?} is already the name of tenant[{first}]; allowed: a name unique among \
                     tenants",
                    t.name
                ),
            );
            ok = false;
        } else {
            names.insert(t.name.clone(), i);
        }
        for (j, cidr) in t.prefixes.iter().enumerate() {
            if let Some((first, first_name)) = prefixes.get(cidr) {
                c.err(
                    &p.key("prefixes").idx(j),
                    format!(
                        "\"{cidr}\" is already a prefix of tenant[{first}] ({first_name:?}); \
                         allowed: each prefix in one tenant (a longer prefix inside another \
                         tenant's is fine: the longest match wins)"
                    ),
                );
                ok = false;
            } else {
                prefixes.insert(*cidr, (i, t.name.clone()));
            }
        }
        out.push(t);
    }
    ok.then_some(out)
}

fn tenant(c: &mut Checker, p: &KeyPath, r: RawTenant) -> Option<TenantConfig> {
    let name = match r.name {
        None => {
            c.missing(
                &p.key("name"),
                "a unique name of a-z, 0-9, \"-\" and \"_\", or \"default\"",
            );
            None
        }
        Some(n) => c.rule(&p.key("name"), rules::tenant_name(&n)).then_some(n),
    };
    let is_default = name.as_deref() == Some(rules::DEFAULT_TENANT);
    let pp = p.key("prefixes");
    let prefixes = match (r.prefixes, is_default) {
        (Some(list), true) if list.is_empty() => Some(Vec::new()),
        (Some(list), true) => {
            c.err(
                &pp,
                format!(
                    "{:?} is set on the \"default\" tenant, which holds the clients no \
                     prefix matches; allowed: no prefixes on \"default\" (give them a named \
                     tenant)",
                    list[0]
                ),
            );
            None
        }
        (None, true) => Some(Vec::new()),
        (None, false) => {
            c.missing(
                &pp,
                "a non-empty list of client prefixes such as [\"10.0.2.0/24\"]",
            );
            None
        }
        (Some(list), false) if list.is_empty() => {
            c.err(
                &pp,
                "[] is empty; allowed: a non-empty list of client prefixes such as \
                 [\"10.0.2.0/24\"]",
            );
            None
        }
        (Some(list), false) => {
            let mut out = Vec::new();
            let mut ok = true;
            for (j, s) in list.iter().enumerate() {
                match prefix(s) {
                    Ok(cidr) => out.push(cidr),
                    Err(e) => {
                        c.err(&pp.idx(j), e);
                        ok = false;
                    }
                }
            }
            ok.then_some(out)
        }
    };
    let l = limits(
        c,
        p,
        [r.weight, r.max_sessions, r.new_sessions_per_sec, r.burst],
    );
    let burst_ok = c.rule(
        &p.key("burst"),
        rules::tenant_burst(l.burst.unwrap_or(0), l.new_sessions_per_sec.unwrap_or(0)),
    );
    (l.ok && burst_ok).then_some(())?;
    Some(TenantConfig {
        name: name?,
        prefixes: prefixes?,
        weight: l.weight.unwrap_or(1),
        max_sessions: l.max_sessions.unwrap_or(0),
        new_sessions_per_sec: l.new_sessions_per_sec.unwrap_or(0),
        burst: l.burst.unwrap_or(0),
    })
}

/// A client prefix, in the words of the configuration's other prefixes.
fn prefix(s: &str) -> Result<Cidr, String> {
    const ALLOWED: &str = "allowed: an IPv4 or IPv6 network such as \"10.0.2.0/24\" or \
                           \"2001:db8:2::/48\"";
    match s.parse::<Cidr>() {
        Ok(cidr) => Ok(cidr),
        Err(CidrError::HostBits { network }) => Err(format!(
            "{s:?} has bits set below the prefix length; allowed: the network address, \
             \"{network}\""
        )),
        Err(e) => Err(format!("{s:?} is not a prefix ({e}); {ALLOWED}")),
    }
}

/// The limit keys of a `[[tenant]]` or `[[vip.tenant]]`, each range-checked: `None` for an
/// unset key or one out of range (then `ok` is false).
struct Limits {
    weight: Option<u32>,
    max_sessions: Option<u32>,
    new_sessions_per_sec: Option<u32>,
    burst: Option<u32>,
    ok: bool,
}

fn limits(c: &mut Checker, p: &KeyPath, raw: [Option<Int>; 4]) -> Limits {
    let [weight, max_sessions, rate, burst] = raw;
    let mut ok = true;
    let mut one = |key: &str, v: Option<Int>, lo: i64, hi: i64, note: &str| {
        v?;
        let v = c.int(&p.key(key), v, 0u32, lo, hi, note);
        ok &= v.is_some();
        v
    };
    let weight = one(
        "weight",
        weight,
        1,
        rules::TENANT_WEIGHT_MAX.into(),
        " (a share of a busy or full pool)",
    );
    let max_sessions = one(
        "max_sessions",
        max_sessions,
        0,
        u32::MAX.into(),
        " (0 = no limit)",
    );
    let new_sessions_per_sec = one(
        "new_sessions_per_sec",
        rate,
        0,
        rules::TENANT_RATE_MAX.into(),
        " (0 = no limit)",
    );
    let burst = one(
        "burst",
        burst,
        0,
        rules::TENANT_RATE_MAX.into(),
        " (0 = max(1, new_sessions_per_sec))",
    );
    Limits {
        weight,
        max_sessions,
        new_sessions_per_sec,
        burst,
        ok,
    }
}

/// A VIP's `[[vip.tenant]]` overrides: each checked, each name once (whether the names are
/// tenants is checked with the `[[tenant]]` tables, [`overrides_known`]).
pub(in crate::config) fn vip_tenants(
    c: &mut Checker,
    p: &KeyPath,
    raw: Vec<RawVipTenant>,
) -> Option<Vec<TenantOverride>> {
    let mut out = Vec::new();
    let mut ok = true;
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (j, r) in raw.into_iter().enumerate() {
        let tp = p.key("tenant").idx(j);
        let name = match r.name {
            None => {
                c.missing(
                    &tp.key("name"),
                    "the name of a [[tenant]] table, or \"default\"",
                );
                None
            }
            Some(n) => c.rule(&tp.key("name"), rules::tenant_name(&n)).then_some(n),
        };
        if let Some(n) = &name {
            if let Some(first) = seen.get(n) {
                c.err(
                    &tp.key("name"),
                    format!(
                        "{n:?} is already overridden by tenant[{first}] of this VIP; allowed: \
                         one override per tenant and VIP"
                    ),
                );
                ok = false;
            } else {
                seen.insert(n.clone(), j);
            }
        }
        let l = limits(
            c,
            &tp,
            [r.weight, r.max_sessions, r.new_sessions_per_sec, r.burst],
        );
        match name.filter(|_| l.ok) {
            Some(name) => out.push(TenantOverride {
                name,
                weight: l.weight,
                max_sessions: l.max_sessions,
                new_sessions_per_sec: l.new_sessions_per_sec,
                burst: l.burst,
            }),
            None => ok = false,
        }
    }
    ok.then_some(out)
}

/// Each VIP's overrides name a `[[tenant]]` (or `"default"`), and the limits they give
/// keep a burst only with a rate; warns where a second-chance VIP cannot count sessions.
pub(in crate::config) fn overrides_known(
    c: &mut Checker,
    root: &KeyPath,
    vips: &[VipConfig],
    tenants: &[TenantConfig],
) -> bool {
    let mut ok = true;
    for (i, v) in vips.iter().enumerate() {
        let p = root.key("vip").idx(i);
        for (j, o) in v.tenants.iter().enumerate() {
            let tp = p.key("tenant").idx(j);
            if let Err((key, e)) = rules::tenant_override(o, tenants) {
                c.err(&tp.key(key), e);
                ok = false;
            }
        }
        if !tenants.is_empty() && v.flow_state == FlowState::SecondChance {
            c.warn(
                &p.key("flow_state"),
                "\"second-chance\" keeps no connection table, so no session of this VIP is \
                 counted: tenants' max_sessions and shares do not apply to it (their \
                 new_sessions_per_sec does)",
            );
        }
    }
    ok
}
