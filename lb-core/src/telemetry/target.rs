//! What to scrape for each backend, derived from the configuration.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    path::PathBuf,
};

use super::{BackendKey, Source};
use crate::config::{Config, EngineKind, HttpUrl, RoceConfig};

/// One source of one backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub key: BackendKey,
    pub endpoint: Endpoint,
    pub reader: Reader,
}

/// Where the data comes from. Targets with equal endpoints share one fetch per round.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Endpoint {
    Http(HttpUrl),
    /// A `hw_counters` directory.
    Sysfs(PathBuf),
}

/// How a target reads its part from the endpoint's data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reader {
    Dcgm {
        gpus: Vec<String>,
        uuids: Vec<String>,
    },
    Engine {
        kind: EngineKind,
        model: Option<String>,
    },
    /// node_exporter infiniband counters of one device port.
    RoceExporter {
        device: String,
        port: String,
    },
    RoceSysfs,
}

impl Target {
    pub fn source(&self) -> Source {
        match self.reader {
            Reader::Dcgm { .. } => Source::Dcgm,
            Reader::Engine { .. } => Source::Engine,
            Reader::RoceExporter { .. } | Reader::RoceSysfs => Source::Roce,
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Http(u) => u.fmt(f),
            Endpoint::Sysfs(p) => p.display().fmt(f),
        }
    }
}

/// Every telemetry target of the configuration (its URLs were checked when it was read).
pub fn targets(config: &Config) -> Vec<Target> {
    let mut out = Vec::new();
    for vip in &config.vips {
        for b in &vip.backends {
            let key: BackendKey = (vip.name.clone(), b.address);
            let mut add = |endpoint, reader| {
                out.push(Target {
                    key: key.clone(),
                    endpoint,
                    reader,
                })
            };
            if let Some(d) = &b.dcgm {
                let reader = Reader::Dcgm {
                    gpus: d.gpus.clone(),
                    uuids: d.uuids.clone(),
                };
                add(Endpoint::Http(d.url.clone()), reader);
            }
            if let Some(e) = &b.engine {
                let reader = Reader::Engine {
                    kind: e.kind,
                    model: e.model.clone(),
                };
                add(Endpoint::Http(e.url.clone()), reader);
            }
            match &b.roce {
                Some(RoceConfig::Exporter { url, device, port }) => {
                    let reader = Reader::RoceExporter {
                        device: device.clone(),
                        port: port.clone(),
                    };
                    add(Endpoint::Http(url.clone()), reader);
                }
                Some(RoceConfig::Sysfs { sysfs }) => {
                    add(Endpoint::Sysfs(sysfs.clone()), Reader::RoceSysfs)
                }
                None => {}
            }
        }
    }
    out
}

/// The sources each backend of the configuration expects, for [`super::Hub::configure`];
/// backends without telemetry map to an empty set.
pub fn sources(config: &Config) -> BTreeMap<BackendKey, BTreeSet<Source>> {
    let mut out = BTreeMap::new();
    for vip in &config.vips {
        for b in &vip.backends {
            let set: &mut BTreeSet<Source> = out.entry((vip.name.clone(), b.address)).or_default();
            set.extend(b.dcgm.as_ref().map(|_| Source::Dcgm));
            set.extend(b.engine.as_ref().map(|_| Source::Engine));
            set.extend(b.roce.as_ref().map(|_| Source::Roce));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;

    const BASE: &str = r#"[dataplane]
interfaces = [{ name = "eth0" }]
hash_seed = 1
encap_source_v4 = "172.16.0.0/16"
encap_source_v6 = "fd00:5:1::/96"
"#;

    fn parse(vips: &str) -> Config {
        config::parse(&format!("{BASE}{vips}"), "t.toml").unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn targets_and_sources_from_config() {
        let cfg = parse(
            r#"[[vip]]
name = "chat"
address = "10.100.0.1"
port = 443
  [[vip.backend]]
  address = "10.1.0.1"
  dcgm = { url = "http://10.1.0.1:9400/metrics", gpus = ["0", "1"] }
  engine = { url = "http://10.1.0.1:8000/metrics", kind = "vllm", model = "m" }
  roce = { sysfs = "/sys/class/infiniband/mlx5_0/ports/1/hw_counters" }
  [[vip.backend]]
  address = "10.1.0.2"
  roce = { url = "http://10.1.0.2:9100/metrics", device = "mlx5_0", port = "1" }
  [[vip.backend]]
  address = "10.1.0.3"
"#,
        );
        let t = targets(&cfg);
        let k1 = ("chat".to_owned(), "10.1.0.1".parse().unwrap());
        let k2 = ("chat".to_owned(), "10.1.0.2".parse().unwrap());
        let k3 = ("chat".to_owned(), "10.1.0.3".parse().unwrap());
        assert_eq!(t.len(), 4);
        assert_eq!(
            t[0],
            Target {
                key: k1.clone(),
                endpoint: Endpoint::Http(HttpUrl::parse("http://10.1.0.1:9400/metrics").unwrap()),
                reader: Reader::Dcgm {
                    gpus: vec!["0".into(), "1".into()],
                    uuids: vec![],
                },
            }
        );
        assert_eq!(
            t[1].reader,
            Reader::Engine {
                kind: EngineKind::Vllm,
                model: Some("m".into())
            }
        );
        assert_eq!(
            t[2].endpoint,
            Endpoint::Sysfs("/sys/class/infiniband/mlx5_0/ports/1/hw_counters".into())
        );
        assert_eq!((t[2].source(), &t[3].key), (Source::Roce, &k2));
        assert_eq!(
            t[3].reader,
            Reader::RoceExporter {
                device: "mlx5_0".into(),
                port: "1".into()
            }
        );
        let s = sources(&cfg);
        assert_eq!(s[&k1], [Source::Dcgm, Source::Engine, Source::Roce].into());
        assert_eq!(s[&k2], [Source::Roce].into());
        assert_eq!(s[&k3], BTreeSet::new());
    }

    /// The validator refuses an https URL, naming each key: the scraper cannot speak it, and
    /// failing there would stop `sluice run` after the XDP attach.
    #[test]
    fn https_endpoints_are_refused_by_the_validator_with_their_keys() {
        let text = format!(
            "{BASE}{}",
            r#"[[vip]]
name = "chat"
address = "10.100.0.1"
port = 443
  [[vip.backend]]
  address = "10.1.0.2"
  dcgm = { url = "https://10.1.0.2:9400/metrics" }
  engine = { url = "https://10.1.0.2:8000/metrics", kind = "sglang" }
"#
        );
        let e = config::parse(&text, "t.toml").unwrap_err().to_string();
        let lines: Vec<&str> = e.lines().collect();
        assert_eq!(lines.len(), 2, "{e}");
        assert!(
            lines[0].contains(
                "vip[0].backend[0].dcgm.url: \"https://10.1.0.2:9400/metrics\" is https, which \
                 the telemetry scraper does not speak; allowed: an http:// URL"
            ),
            "{e}"
        );
        assert!(lines[1].contains("vip[0].backend[0].engine.url:"), "{e}");
    }

    #[test]
    fn the_example_configuration() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/sluice.toml");
        let cfg = config::load(std::path::Path::new(path)).unwrap();
        let t = targets(&cfg);
        assert!(t.iter().any(|t| t.source() == Source::Roce));
        let s = sources(&cfg);
        assert_eq!(
            s.len(),
            cfg.vips.iter().map(|v| v.backends.len()).sum::<usize>()
        );
    }
}
