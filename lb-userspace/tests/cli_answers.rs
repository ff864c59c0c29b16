//! The CLI against admin sockets that misbehave: a command exits 0 only when it read the
//! daemon's complete answer, and `--retry` repeats only what is safe to repeat.

use std::{
    io::{Read, Write},
    os::unix::net::UnixListener,
    path::{Path, PathBuf},
    process::{Command, Output},
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    thread,
    time::Duration,
};

/// Every command that changes the daemon's state (split at spaces).
const MUTATIONS: &[&str] = &[
    "backend add chat 10.1.0.3",
    "backend set-weight chat 10.1.0.1 50",
    "backend drain chat 10.1.0.1 --deadline 10m",
    "backend undrain chat 10.1.0.1",
    "backend remove chat 10.1.0.1",
    "vip add chat --address 10.0.0.1 --port 443",
    "vip remove chat",
    "trace on",
    "lb drain",
    "lb undrain",
];

fn sluice(socket: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .output()
        .expect("running the sluice binary")
}

/// A fake daemon on a fresh socket that reads each connection's request and sends it
/// `answer`, or closes each at once when there is none. Counts connections.
struct Fake {
    socket: PathBuf,
    dir: PathBuf,
    conns: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Fake {
    fn start(name: &str, answer: Option<&'static [u8]>) -> Fake {
        let dir = std::env::temp_dir().join(format!("sluice-cli-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("admin.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let (conns, stop) = (Arc::<AtomicUsize>::default(), Arc::<AtomicBool>::default());
        let thread = thread::spawn({
            let (conns, stop) = (conns.clone(), stop.clone());
            move || {
                // Blocking, so a connection is closed as soon as the client's connect
                // returns, mostly before it has written its request.
                for s in listener.incoming() {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let Ok(mut s) = s else { continue };
                    conns.fetch_add(1, Ordering::Relaxed);
                    let Some(reply) = answer else {
                        continue;
                    };
                    s.set_read_timeout(Some(Duration::from_millis(500)))
                        .unwrap();
                    let _ = s.read(&mut [0u8; 4096]);
                    let _ = s.write_all(reply);
                }
            }
        });
        Fake {
            socket,
            dir,
            conns,
            stop,
            thread: Some(thread),
        }
    }

    fn conns(&self) -> usize {
        self.conns.load(Ordering::Relaxed)
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the accepting thread to see the stop.
        let _ = std::os::unix::net::UnixStream::connect(&self.socket);
        let _ = self.thread.take().unwrap().join();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn assert_failed(out: &Output, args: &[&str], says: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?} exited {out:?}");
    assert!(stderr.contains(says), "{args:?}: {stderr:?} lacks {says:?}");
}

/// A socket that accepts and closes: every change fails, none exits 0 in silence.
#[test]
fn a_closed_connection_fails_every_change() {
    let fake = Fake::start("closes", None);
    let outs: Vec<_> = (0..4)
        .flat_map(|_| MUTATIONS)
        .map(|args| {
            let args: Vec<&str> = args.split(' ').collect();
            let out = sluice(&fake.socket, &args);
            (args, out)
        })
        .collect();
    let silent: Vec<_> = outs
        .iter()
        .filter(|(_, out)| out.status.success())
        .map(|(args, _)| args)
        .collect();
    assert!(
        silent.is_empty(),
        "{} of {} changes exited 0 unanswered: {silent:?}",
        silent.len(),
        outs.len()
    );
    for (args, out) in &outs {
        assert_failed(out, args, "closed the connection without answering");
        assert!(out.stdout.is_empty(), "{args:?}: {out:?}");
    }
}

/// Answers that end early, however they end, are errors: never a success with less.
#[test]
fn a_truncated_answer_fails_every_change() {
    // (answer, what the error says)
    let cases: [(&[u8], &str); 4] = [
        (
            b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n\r\n",
            "has neither Content-Length nor chunked encoding",
        ),
        (
            b"HTTP/1.1 201 Created\r\ncontent-length: 40\r\n\r\n{\"vip\": {\"name\"",
            "was cut short: 15 of 40 body bytes",
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n",
            "chunked answer was cut short",
        ),
        (b"HTTP/1.1 200 OK\r\ncontent-len", "ends within its headers"),
    ];
    for (i, (answer, says)) in cases.into_iter().enumerate() {
        let fake = Fake::start(&format!("cut{i}"), Some(answer));
        for args in MUTATIONS {
            let args: Vec<&str> = args.split(' ').collect();
            let out = sluice(&fake.socket, &args);
            assert_failed(&out, &args, says);
            assert_failed(&out, &args, "may or may not have been applied");
        }
    }
}

/// A 503 with Retry-After is retried for any command (nothing was done); a connection
/// closed without an answer is retried only for a change that is safe to repeat.
#[test]
fn retries_repeat_only_what_is_safe() {
    let busy = Fake::start(
        "busy",
        Some(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 18\r\nretry-after: 1\r\n\r\n{\"error\": \"full\"}\n"),
    );
    let add = ["--retry", "2", "backend", "add", "chat", "10.1.0.3"];
    assert_failed(&sluice(&busy.socket, &add), &add, "full");
    assert_eq!(busy.conns(), 3, "a 503 is tried 1 + 2 times");

    let closes = Fake::start("closes-retry", None);
    assert_failed(
        &sluice(&closes.socket, &add),
        &add,
        "closed the connection without answering",
    );
    assert_eq!(
        closes.conns(),
        1,
        "an add is not repeated after a silent close"
    );
    let weight = [
        "--retry",
        "2",
        "backend",
        "set-weight",
        "chat",
        "10.1.0.1",
        "5",
    ];
    assert_failed(
        &sluice(&closes.socket, &weight),
        &weight,
        "closed the connection without answering",
    );
    assert_eq!(
        closes.conns(),
        1 + 3,
        "a weight is set again after a silent close"
    );

    // Nothing listening: the request reached nobody, so even an add is tried again.
    let gone = std::env::temp_dir().join(format!("sluice-cli-{}-none.sock", std::process::id()));
    let t = std::time::Instant::now();
    assert_failed(&sluice(&gone, &add), &add, "is `sluice run` running?");
    assert!(
        t.elapsed() >= Duration::from_millis(300),
        "{:?}",
        t.elapsed()
    );
}
