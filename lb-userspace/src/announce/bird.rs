//! The shell around BIRD 2: the routes file Sluice owns (two static protocols that bird.conf
//! includes and exports over BGP) and `configure` through BIRD's control socket, the
//! protocol `birdc` speaks. Nothing here decides what is announced.

use std::{collections::BTreeSet, net::IpAddr, path::Path, time::Duration};

use anyhow::{bail, Context, Result};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader},
    net::UnixStream,
};

/// The static protocols the routes file defines; bird.conf's BGP export filters name them.
pub const PROTO_V4: &str = "sluice_v4";
pub const PROTO_V6: &str = "sluice_v6";

/// The routes file for `routes`: one blackhole route per address (the route only carries the
/// prefix to BGP; BIRD's kernel protocol must not export it). Both protocols are always
/// defined, empty when nothing of their family is announced, so bird.conf's filters stay valid.
pub fn render(routes: &BTreeSet<IpAddr>) -> String {
    let mut out = String::from(
        "# Written by sluice ([bgp] routes_file): the VIPs this host announces now.\n",
    );
    for (proto, channel, v6) in [(PROTO_V4, "ipv4", false), (PROTO_V6, "ipv6", true)] {
        out.push_str(&format!("protocol static {proto} {{\n  {channel};\n"));
        for a in routes.iter().filter(|a| a.is_ipv6() == v6) {
            let len = if v6 { 128 } else { 32 };
            out.push_str(&format!("  route {a}/{len} blackhole;\n"));
        }
        out.push_str("}\n");
    }
    out
}

/// Replaces the routes file at once (a reader sees the old or the new one, never a part).
pub fn write_routes(path: &Path, routes: &BTreeSet<IpAddr>) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, render(routes)).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))
}

/// One reply of the control socket: its final code and every line's text.
#[derive(Debug, PartialEq, Eq)]
pub struct Reply {
    pub code: u16,
    pub lines: Vec<String>,
}

/// Reads one reply: lines `DDDD-text` (more follow), ` text` (continuation) and a final
/// `DDDD text`.
async fn read_reply<R: AsyncBufReadExt + Unpin>(r: &mut R) -> Result<Reply> {
    let mut lines = vec![];
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).await? == 0 {
            bail!("BIRD closed the control socket mid-reply");
        }
        let line = line.trim_end_matches('\n');
        let b = line.as_bytes();
        if b.len() >= 5 && b[..4].iter().all(u8::is_ascii_digit) && (b[4] == b' ' || b[4] == b'-') {
            lines.push(line[5..].to_string());
            if b[4] == b' ' {
                return Ok(Reply {
                    code: line[..4].parse()?,
                    lines,
                });
            }
        } else {
            lines.push(line.trim_start().to_string());
        }
    }
}

/// Sends one command and returns its reply (the greeting is read first). Codes 8xxx and
/// 9xxx are BIRD's runtime and parse errors.
pub async fn command(socket: &Path, cmd: &str, timeout: Duration) -> Result<Reply> {
    let run = async {
        let s = UnixStream::connect(socket).await.with_context(|| {
            format!(
                "connecting to BIRD's control socket {} (is bird running with this socket?)",
                socket.display()
            )
        })?;
        let (r, mut w) = s.into_split();
        let mut r = BufReader::new(r);
        read_reply(&mut r)
            .await
            .context("reading BIRD's greeting")?;
        w.write_all(format!("{cmd}\n").as_bytes()).await?;
        read_reply(&mut r).await
    };
    tokio::time::timeout(timeout, run)
        .await
        .map_err(|_| anyhow::anyhow!("BIRD did not answer `{cmd}` within {timeout:?}"))?
}

/// `configure`: BIRD re-reads bird.conf and the routes file; the changed static routes are
/// announced or withdrawn at once.
pub async fn configure(socket: &Path, timeout: Duration) -> Result<()> {
    let r = command(socket, "configure", timeout).await?;
    if r.code >= 8000 {
        bail!(
            "BIRD refused its configuration ({}): {}",
            r.code,
            r.lines.join("; ")
        );
    }
    Ok(())
}

/// A BGP session as `show protocols` lists it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Session {
    pub name: String,
    pub state: String,
    pub info: String,
}

/// The BGP protocols of a `show protocols` reply (`Name Proto Table State Since Info`).
pub fn sessions(r: &Reply) -> Vec<Session> {
    r.lines
        .iter()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 5 && f[1] == "BGP").then(|| Session {
                name: f[0].to_string(),
                state: f[3].to_string(),
                info: f.get(5..).map(|i| i.join(" ")).unwrap_or_default(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_routes_file_defines_both_protocols() {
        let routes = BTreeSet::from(["10.0.0.1".parse().unwrap(), "fd00::5".parse().unwrap()]);
        assert_eq!(
            render(&routes),
            "# Written by sluice ([bgp] routes_file): the VIPs this host announces now.\n\
             protocol static sluice_v4 {\n  ipv4;\n  route 10.0.0.1/32 blackhole;\n}\n\
             protocol static sluice_v6 {\n  ipv6;\n  route fd00::5/128 blackhole;\n}\n"
        );
        assert!(render(&BTreeSet::new()).contains("protocol static sluice_v4 {\n  ipv4;\n}"));
    }

    #[tokio::test]
    async fn replies_and_sessions_parse() {
        let text = "2002-Name       Proto      Table      State  Since         Info\n\
                    1002-device1    Device     ---        up     11:40:01.123  \n\
                    \x20router     BGP        ---        up     11:40:02.456  Established   \n\
                    \x20other      BGP        ---        start  11:40:02.456  Active        Socket: Connection refused\n\
                    0000 \n";
        let mut r = BufReader::new(text.as_bytes());
        let reply = read_reply(&mut r).await.unwrap();
        assert_eq!(reply.code, 0);
        let s = sessions(&reply);
        assert_eq!(s.len(), 2, "{reply:?}");
        assert_eq!(
            (s[0].name.as_str(), s[0].state.as_str(), s[0].info.as_str()),
            ("router", "up", "Established")
        );
        assert_eq!(s[1].info, "Active Socket: Connection refused");
        let mut r = BufReader::new("8002 /etc/bird.conf:3:1 syntax error\n".as_bytes());
        assert_eq!(read_reply(&mut r).await.unwrap().code, 8002);
    }
}
