//! The `http://` URLs of exporters and of etcd's gateway, parsed once when the configuration is
//! read.

use std::fmt;

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

impl HttpUrl {
    pub fn parse(url: &str) -> Result<HttpUrl, String> {
        if url.starts_with("https://") {
            return Err(format!(
                "{url:?}: https is not supported: Sluice speaks plain HTTP to exporters and to \
                 etcd's gateway; use an http:// endpoint (the plain-HTTP port, or a local proxy \
                 in front of a TLS one)"
            ));
        }
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| format!("{url:?} is not an http:// URL"))?;
        let rest = rest.split('#').next().unwrap_or_default();
        let split = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, path) = rest.split_at(split);
        let path = match path {
            "" => "/".to_owned(),
            p if p.starts_with('?') => format!("/{p}"),
            p => p.to_owned(),
        };
        let bad = || format!("{url:?} has no valid host[:port]");
        let (host, port) = match authority.strip_prefix('[') {
            Some(v6) => {
                let (h, after) = v6.split_once(']').ok_or_else(bad)?;
                (h, after.strip_prefix(':'))
            }
            None => match authority.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            },
        };
        let port = match port {
            None => 80,
            Some(p) => p.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(bad)?,
        };
        if host.is_empty() || authority.contains('@') || url.contains(char::is_whitespace) {
            return Err(bad());
        }
        Ok(HttpUrl {
            host: host.to_owned(),
            port,
            authority: authority.to_owned(),
            path,
        })
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
        ] {
            assert!(HttpUrl::parse(bad).is_err(), "{bad}");
        }
        assert!(HttpUrl::parse("https://h/metrics")
            .unwrap_err()
            .contains("https is not supported"));
    }
}
