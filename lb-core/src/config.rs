//! The daemon's TOML configuration: schema, parsing and validation.
//!
//! [`load`] / [`parse`] turn a file into a validated [`Config`]; every field of the result is
//! in range and consistent with the others, so the daemon can program the data plane from it
//! without further checks. The schema is documented key by key in `configs/sluice.toml`.
//!
//! Parsing runs in three stages:
//!
//! 1. TOML syntax. The first syntax error is reported with its line and column.
//! 2. Shape, with serde and `deny_unknown_fields` on every table: unknown keys and values of
//!    the wrong TOML type. Each section, each `[[vip]]` and each `[[vip.backend]]` is read on
//!    its own, so one mistake per table is reported, for every table.
//! 3. Semantics: ranges, formats, uniqueness and cross-key rules. All violations are
//!    collected.
//!
//! Every reported problem is one line of the form
//! `FILE:LINE:COLUMN: KEY.PATH: VALUE problem; allowed: what is accepted`, where the key path
//! uses array indexes (`vip[1].backend[0].weight`) and the line and column point at the
//! offending value (or, for a missing key, at the table that lacks it). Problems that do not
//! stop the daemon from working (a Maglev ring that is small for its backends, say) are
//! returned separately as warnings by [`parse_with_warnings`] / [`load_with_warnings`].
//!
//! Overlapping VIPs: a VIP with `port = 0` (all ports) may share its address and protocol
//! with VIPs on specific ports. The data plane looks up the exact (address, port, protocol)
//! first and falls back to the address's port-0 VIP, so the specific VIPs take their ports
//! and the port-0 VIP takes the rest. Only identical (address, port, protocol) triples are
//! rejected.
//!
//! [`Config`] implements `Serialize` in the same shape as the file (durations as humantime
//! strings, addresses and prefixes as strings), so `toml::to_string(&config)` parses back to
//! an equal `Config`; it also implements `Deserialize`, which runs the same validation (e.g.
//! for state persisted as JSON).

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    ops::Range,
    path::{Path, PathBuf},
    str::FromStr,
    time::Duration,
};

use lb_common::{
    LbConfig, VipKey, AFFINITY_TABLE_SIZE, CONN_TABLE_SIZE, FAMILY_V4, FAMILY_V6, MAX_BACKENDS,
    MAX_VIPS, PROTO_TCP, PROTO_UDP, RING_SIZE_MAX, VIP_F_QUIC_CID, VIP_F_SECOND_CHANCE,
    VIP_F_SRC_HASH,
};
use serde::{de, Deserialize, Serialize, Serializer};
use toml::{
    de::{DeTable, DeValue, ValueDeserializer},
    Spanned,
};

use crate::{
    addr::to_words,
    maglev::{is_prime, DEFAULT_RING_SIZE},
};

pub mod bgp;
pub mod fleet;
pub mod rules;
mod url;

mod errors;
mod positions;
mod semantics;
mod shape;
mod types;

pub use self::{
    errors::*,
    types::*,
    url::{HttpUrl, UrlError},
};
use self::{positions::*, semantics::*, shape::*};

// ------------------------------------------------------------------------------------------
// Entry points
// ------------------------------------------------------------------------------------------

/// Reads and validates the file at `path`; errors name the file as `path.display()`.
pub fn load(path: &Path) -> Result<Config, ConfigError> {
    load_with_warnings(path).map(|(c, _)| c)
}

/// [`load`], also returning the warnings (rendered like errors, one per entry).
pub fn load_with_warnings(path: &Path) -> Result<(Config, Vec<String>), ConfigError> {
    let origin = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => parse_with_warnings(&text, &origin),
        Err(e) => Err(ConfigError {
            origin,
            issues: vec![Issue {
                line: None,
                column: None,
                key: String::new(),
                message: format!("cannot read the configuration: {e}"),
            }],
        }),
    }
}

/// Parses and validates TOML `text`; `origin` (usually the file name) prefixes every error.
pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
    parse_with_warnings(text, origin).map(|(c, _)| c)
}

/// [`parse`], also returning the warnings (rendered like errors, one per entry).
pub fn parse_with_warnings(text: &str, origin: &str) -> Result<(Config, Vec<String>), ConfigError> {
    let doc = Doc { text };
    // Problems are listed in file order; those without a position come last.
    let fail = |mut issues: Vec<Issue>| {
        issues.sort_by_key(|i| (i.line.is_none(), i.line, i.column));
        ConfigError {
            origin: origin.to_owned(),
            issues,
        }
    };
    let root = match DeTable::parse(text) {
        Ok(root) => root,
        Err(e) => {
            let (line, column) = e.span().map(|s| doc.position(s.start)).unzip();
            return Err(fail(vec![Issue {
                line,
                column,
                key: String::new(),
                message: format!("TOML syntax error: {}", e.message()),
            }]));
        }
    };
    let mut shape = Vec::new();
    let raw = raw_from_document(&root, &mut shape);
    if !shape.is_empty() {
        let issues = shape
            .into_iter()
            .map(|(span, key, message)| {
                let (line, column) = doc.position(span.start);
                Issue {
                    line: Some(line),
                    column: Some(column),
                    key,
                    message,
                }
            })
            .collect();
        return Err(fail(issues));
    }
    let locate = |(path, message): (KeyPath, String)| {
        let (line, column) = span_of(&root, &path).map(|s| doc.position(s.start)).unzip();
        Issue {
            line,
            column,
            key: path.to_string(),
            message,
        }
    };
    let (config, issues, warnings) = validate(raw);
    match config {
        Some(c) if issues.is_empty() => {
            let mut warnings: Vec<Issue> = warnings.into_iter().map(locate).collect();
            warnings.sort_by_key(|i| (i.line.is_none(), i.line, i.column));
            let warnings = warnings.iter().map(|w| w.render(origin)).collect();
            Ok((c, warnings))
        }
        _ => Err(fail(issues.into_iter().map(locate).collect())),
    }
}

impl<'de> Deserialize<'de> for Config {
    /// Validates like [`parse`] (errors carry key paths but no positions).
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = RawConfig::deserialize(d)?;
        let (config, issues, _) = validate(raw);
        checked(config, issues, "config")
    }
}

/// The `[[tenant]]` tables on their own, in the file's shape (`{"tenant": [...]}`): what
/// `PUT /v1/tenants` takes and `sluice tenant set` sends.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TenantList {
    #[serde(rename = "tenant")]
    pub tenants: Vec<TenantConfig>,
}

impl<'de> Deserialize<'de> for TenantList {
    /// Validates with the file's checks of `[[tenant]]` (errors carry key paths such as
    /// `tenant[1].prefixes[0]`).
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = RawTenantList::deserialize(d)?;
        let mut c = Checker::default();
        let tenants = tenants(&mut c, &KeyPath::default(), raw.tenant);
        let (issues, _) = c.into_found();
        checked(
            tenants.map(|tenants| TenantList { tenants }),
            issues,
            "tenants",
        )
    }
}

/// `value` when no issue was found, else the issues as one error naming `origin`.
fn checked<T, E: de::Error>(value: Option<T>, issues: Found, origin: &str) -> Result<T, E> {
    match value {
        Some(v) if issues.is_empty() => Ok(v),
        _ => Err(de::Error::custom(ConfigError {
            origin: origin.to_owned(),
            issues: issues
                .into_iter()
                .map(|(path, message)| Issue {
                    line: None,
                    column: None,
                    key: path.to_string(),
                    message,
                })
                .collect(),
        })),
    }
}
