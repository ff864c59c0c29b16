//! systemd's readiness protocol (`sd_notify`, for units with `Type=notify`): one datagram of
//! `KEY=VALUE` lines to the Unix socket named by `$NOTIFY_SOCKET` (a path, or `@name` for
//! the abstract namespace). Without the variable (not started by systemd) nothing is sent.

use std::{io, os::unix::net::UnixDatagram};

/// The variable systemd sets for a `Type=notify` service.
pub const ENV: &str = "NOTIFY_SOCKET";

/// Sends `state` (e.g. `"READY=1\nSTATUS=serving"`) to `$NOTIFY_SOCKET`; returns whether
/// there was a socket to send to. A failure is the caller's to log: systemd then times the
/// start out, which says more than a daemon that refuses to run.
pub fn notify(state: &str) -> io::Result<bool> {
    match std::env::var_os(ENV) {
        Some(addr) if !addr.is_empty() => {
            send(&addr.to_string_lossy(), state)?;
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// Sends `state` to the notification socket at `addr`.
pub fn send(addr: &str, state: &str) -> io::Result<()> {
    let sock = UnixDatagram::unbound()?;
    match addr.strip_prefix('@') {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            let a = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
            sock.send_to_addr(state.as_bytes(), &a)?;
        }
        None => {
            sock.send_to(state.as_bytes(), addr)?;
        }
    }
    Ok(())
}

/// Logs a failed notification (the service manager then sees no readiness).
pub fn ready(status: &str) {
    if let Err(e) = notify(&format!(
        "READY=1\nSTATUS={status}\nMAINPID={}",
        std::process::id()
    )) {
        tracing::error!(error = %e, "telling systemd that the daemon is ready ($NOTIFY_SOCKET)");
    }
}

/// Tells systemd the daemon is stopping (best effort).
pub fn stopping() {
    let _ = notify("STOPPING=1");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_datagram_reaches_a_path_socket() {
        let dir = crate::test_dir::TestDir::new("notify");
        let path = dir.join("notify.sock");
        let rx = UnixDatagram::bind(&path).unwrap();
        send(path.to_str().unwrap(), "READY=1\nSTATUS=up").unwrap();
        let mut buf = [0u8; 64];
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=up");
    }

    #[test]
    fn a_datagram_reaches_an_abstract_socket() {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("sluice-notify-test-{}", std::process::id());
        let a = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let rx = UnixDatagram::bind_addr(&a).unwrap();
        send(&format!("@{name}"), "STOPPING=1").unwrap();
        let mut buf = [0u8; 64];
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");
    }

    #[test]
    fn a_missing_socket_is_an_error() {
        assert!(send("/nonexistent/notify.sock", "READY=1").is_err());
    }
}
