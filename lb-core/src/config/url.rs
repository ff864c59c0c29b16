//! The `http://` URLs of exporters and of etcd's gateway, parsed once when the configuration is
//! read.

use std::{fmt, net::Ipv6Addr};

use serde::{Serialize, Serializer};

/// An `http://` URL split for a plain HTTP/1.1 client.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct HttpUrl {
    /// Host name or address, without IPv6 brackets (for connecting).
    pub host: String,
    pub port: u16,
    /// `host[:port]` as written (the Host header).
    pub authority: String,
    /// Path and query; `/` when the URL has none.
    pub path: String,
}

/// Why a string is not an [`HttpUrl`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UrlError {
    /// `https://`: Sluice speaks plain HTTP to exporters and to etcd's gateway.
    Https,
    /// Not `http://` followed by a host (name, IPv4, or IPv6 in brackets), an optional port
    /// 1..=65535, and no credentials, whitespace or control characters.
    Invalid,
}

impl fmt::Display for UrlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            UrlError::Https => {
                "https is not supported: Sluice speaks plain HTTP; use an http:// endpoint (the \
                 plain-HTTP port, or a local proxy in front of a TLS one)"
            }
            UrlError::Invalid => "not an http:// URL with a valid host[:port]",
        })
    }
}

impl HttpUrl {
    pub fn parse(url: &str) -> Result<HttpUrl, UrlError> {
        if url.starts_with("https://") {
            return Err(UrlError::Https);
        }
        let rest = url.strip_prefix("http://").ok_or(UrlError::Invalid)?;
        if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(UrlError::Invalid);
        }
        let rest = rest.split('#').next().unwrap_or_default();
        let split = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, path) = rest.split_at(split);
        let path = match path {
            "" => "/".to_owned(),
            p if p.starts_with('?') => format!("/{p}"),
            p => p.to_owned(),
        };
        let (host, port) = match authority.strip_prefix('[') {
            Some(v6) => {
                let (h, after) = v6.split_once(']').ok_or(UrlError::Invalid)?;
                if h.parse::<Ipv6Addr>().is_err() {
                    return Err(UrlError::Invalid);
                }
                (h, after.strip_prefix(':'))
            }
            None => match authority.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            },
        };
        let port = match port {
            None => 80,
            Some(p) => p
                .parse::<u16>()
                .ok()
                .filter(|p| *p > 0)
                .ok_or(UrlError::Invalid)?,
        };
        if host.is_empty() || authority.contains('@') {
            return Err(UrlError::Invalid);
        }
        Ok(HttpUrl {
            host: host.to_owned(),
            port,
            authority: authority.to_owned(),
            path,
        })
    }
}

/// Written back as the URL it was parsed from (less any fragment), so a configuration
/// serialises to one that parses again.
impl Serialize for HttpUrl {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl fmt::Display for HttpUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}{}", self.authority, self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let u = HttpUrl::parse("http://10.1.0.1:9400/metrics").unwrap();
        assert_eq!(
            u,
            HttpUrl {
                host: "10.1.0.1".into(),
                port: 9400,
                authority: "10.1.0.1:9400".into(),
                path: "/metrics".into(),
            }
        );
        assert_eq!(u.to_string(), "http://10.1.0.1:9400/metrics");
        let u = HttpUrl::parse("http://[2001:db8:1::11]:30000/metrics?x=1#frag").unwrap();
        assert_eq!((u.host.as_str(), u.port), ("2001:db8:1::11", 30000));
        assert_eq!(
            (u.authority.as_str(), u.path.as_str()),
            ("[2001:db8:1::11]:30000", "/metrics?x=1")
        );
        let u = HttpUrl::parse("http://gpu-node-01").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.path.as_str()),
            ("gpu-node-01", 80, "/")
        );
        assert_eq!(HttpUrl::parse("http://h?q").unwrap().path, "/?q");
        for bad in [
            "http://",
            "http://:80/",
            "http://h:0/",
            "http://h:x/",
            "http://u@h/",
            "ftp://h/",
            "http://[not-v6]/",
            "http://h/a\tb",
            "http://h/\u{7f}",
        ] {
            assert!(HttpUrl::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(HttpUrl::parse("https://h/metrics"), Err(UrlError::Https));
    }
}
