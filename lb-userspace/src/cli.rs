//! The `sluice` command line: the daemon (`run`) and the admin API's client commands.

mod args;
mod flows;
mod lb;
mod live;
mod print;
mod tenants;
mod vips;

use std::{io::Write, path::Path, process::ExitCode};

use anyhow::{anyhow, bail, Context, Result};
use clap::{CommandFactory, Parser};
use serde_json::{json, Value};

pub use self::args::{
    BackendCommand, Cli, Command, PageKind, Shell, TraceSwitch, VipAdd, VipCommand, VERSION,
};
use self::print::{
    cell, event_row, host_port, items, print_backends, print_events, print_flows, print_sample,
    print_stats, print_status, print_vips, table, timestamp, EVENT_COLUMNS,
};
use crate::{client::Client, config::EngineKind, escape};

/// Parses the process's arguments and runs the command; usage errors exit with 2 (clap).
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    // Not a held StdoutLock: `run` lasts as long as the daemon, and its threads may print.
    let mut out = Stdout::default();
    let result = execute(&cli, &mut out);
    exit_code(result, out.reader_left)
}

/// The exit status of a command's `result`. A broken pipe on standard output (`sluice
/// stats | head`: the reader left) is no failure; any other error, a broken admin socket
/// included, is.
fn exit_code(result: Result<()>, reader_left: bool) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) if reader_left => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// Standard output that remembers whether its reader left.
#[derive(Default)]
struct Stdout {
    reader_left: bool,
}

impl Stdout {
    fn note<T>(&mut self, r: std::io::Result<T>) -> std::io::Result<T> {
        if let Err(e) = &r {
            self.reader_left |= e.kind() == std::io::ErrorKind::BrokenPipe;
        }
        r
    }
}

impl Write for Stdout {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let r = std::io::stdout().write(buf);
        self.note(r)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let r = std::io::stdout().flush();
        self.note(r)
    }
}

/// Runs one command, printing to `out`; an error is a refused request or a failure. With
/// `--watch`, a read command is redrawn in place until interrupted.
pub fn execute(cli: &Cli, out: &mut dyn Write) -> Result<()> {
    let Some(every) = cli.watch else {
        return execute_once(cli, out);
    };
    let reads = matches!(
        &cli.command,
        Command::Status
            | Command::Vip(VipCommand::List)
            | Command::Backend(BackendCommand::List { .. })
            | Command::Flows(_)
            | Command::Stats
            | Command::Events
            | Command::Tenant(tenants::TenantCommand::List)
    );
    if !reads {
        bail!("--watch repeats read commands only: status, vip list, backend list, flows, stats, events, tenant list");
    }
    live::repeat(out, every, None, |w| execute_once(cli, w))
}

fn execute_once(cli: &Cli, out: &mut dyn Write) -> Result<()> {
    let client = Client::new(&cli.socket).with_retries(cli.retry);
    let mut out = Output {
        json: cli.json,
        out,
    };
    match &cli.command {
        Command::Run { config } => run_daemon(config),
        Command::Check { config } => crate::check::command(config, out.json, out.out),
        Command::BackendHost(cmd) => crate::backend_host::cli::execute(cmd, out.json, out.out),
        Command::Manpages { dir } => crate::manpages::write(Cli::command(), dir, out.out),
        Command::Status => out.show(&client.call("GET", "/v1/status", None)?, print_status),
        Command::Lb(cmd) => lb::run(cmd, &client, &mut out),
        Command::Vip(cmd) => vips::vip(cmd, &client, &mut out),
        Command::Backend(cmd) => vips::backend(cmd, &client, &mut out),
        Command::Flows(args) => flows::run(args, &client, &mut out),
        Command::Tenant(cmd) => tenants::run(cmd, &client, &mut out),
        Command::Top { every, events } => {
            let mut prev = None;
            live::repeat(out.out, *every, None, |w| {
                let cur = live::Sample::take(&client)?;
                live::render_top(w, prev.as_ref(), &cur, *events)?;
                prev = Some(cur);
                Ok(())
            })
        }
        Command::Trace { switch } => {
            let v = match switch {
                None => client.call("GET", "/v1/trace", None)?,
                Some(s) => {
                    let body = json!({ "enabled": matches!(s, TraceSwitch::On) });
                    client.call("PUT", "/v1/trace", Some(&body))?
                }
            };
            out.show(&v, |out, v| {
                let on = v["enabled"] == true;
                Ok(writeln!(
                    out,
                    "decision tracing is {}",
                    if on { "on" } else { "off" }
                )?)
            })
        }
        Command::Stats => out.show(&client.call("GET", "/v1/stats", None)?, print_stats),
        Command::Events => out.show(&client.call("GET", "/v1/events", None)?, print_events),
        Command::Telemetry {
            kind,
            file,
            gpus,
            uuids,
            model,
        } => {
            let text = if file.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin()).context("reading standard input")?
            } else {
                std::fs::read_to_string(file)
                    .with_context(|| format!("reading {}", file.display()))?
            };
            let page = crate::telemetry::prom::parse(&text).map_err(|e| anyhow!("{e}"))?;
            let sample = match kind {
                PageKind::Dcgm => crate::telemetry::dcgm::extract(&page, gpus, uuids),
                PageKind::Vllm => {
                    crate::telemetry::engine::extract(&page, EngineKind::Vllm, model.as_deref())
                }
                PageKind::Sglang => {
                    crate::telemetry::engine::extract(&page, EngineKind::Sglang, model.as_deref())
                }
            }
            .map_err(|e| anyhow!("{e}"))?;
            out.show(&serde_json::to_value(&sample)?, print_sample)
        }
        Command::Completions { shell } => {
            let shell = match shell {
                Shell::Bash => clap_complete::Shell::Bash,
                Shell::Zsh => clap_complete::Shell::Zsh,
                Shell::Fish => clap_complete::Shell::Fish,
            };
            clap_complete::generate(shell, &mut Cli::command(), "sluice", out.out);
            Ok(())
        }
        Command::Cleanup { bpffs, force } => cleanup(&client, bpffs, *force, out.out),
    }
}

/// Where a command's answer goes: the API's JSON with --json, else the human form.
struct Output<'a> {
    json: bool,
    out: &'a mut dyn Write,
}

impl Output<'_> {
    fn show(
        &mut self,
        v: &Value,
        human: impl FnOnce(&mut dyn Write, &Value) -> Result<()>,
    ) -> Result<()> {
        if !self.json {
            return human(self.out, v);
        }
        // A removal answers 204 with no body: nothing to print.
        if !v.is_null() {
            let text = serde_json::to_string_pretty(v)?;
            writeln!(self.out, "{}", escape::json(&text))?;
        }
        Ok(())
    }
}

fn run_daemon(config: &Path) -> Result<()> {
    tokio::runtime::Runtime::new()
        .context("starting the async runtime")?
        .block_on(crate::daemon::run(config))
}

fn cleanup(client: &Client, bpffs: &Path, force: bool, out: &mut dyn Write) -> Result<()> {
    if !force {
        if let Ok((_, status)) = client.request("GET", "/v1/status", None) {
            bail!(
                "a sluice daemon (pid {}) answers on {}: stop it first, or pass --force to remove \
                 its data plane anyway (the VIPs' traffic then stops being steered)",
                status["pid"],
                client.socket().display()
            );
        }
    }
    if !bpffs.exists() {
        writeln!(out, "nothing is pinned at {}", bpffs.display())?;
        return Ok(());
    }
    crate::dataplane::remove_pinned(bpffs)?;
    writeln!(
        out,
        "removed the data plane pinned at {} (its XDP programs are detached)",
        bpffs.display()
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        admin::testing::TestServer,
        state::{FlowState, HashMode},
    };

    /// Runs `sluice ARGS` against `srv`: what it printed, or its error message.
    fn sluice(srv: &TestServer, args: &[&str]) -> Result<String, String> {
        let socket = srv.socket.to_str().unwrap();
        let argv = ["sluice", "--socket", socket]
            .into_iter()
            .chain(args.iter().copied());
        let cli = Cli::try_parse_from(argv).map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        execute(&cli, &mut out).map_err(|e| format!("{e:#}"))?;
        Ok(String::from_utf8(out).unwrap())
    }

    #[test]
    fn tenant_set_sends_a_toml_file_and_list_shows_each_tenant_per_vip() {
        let srv = TestServer::start();
        sluice(
            &srv,
            &[
                "vip",
                "add",
                "chat",
                "--address",
                "10.0.0.1",
                "--port",
                "443",
            ],
        )
        .unwrap();
        assert_eq!(
            sluice(&srv, &["tenant", "list"]).unwrap(),
            "no tenants are configured\n"
        );
        let d = crate::test_dir::TestDir::new("cli-tenants");
        let file = d.join("tenants.toml");
        std::fs::write(
            &file,
            "[[tenant]]\nname = \"acme\"\nprefixes = [\"10.0.2.0/24\"]\nweight = 2\n\
             max_sessions = 40\nnew_sessions_per_sec = 10\n",
        )
        .unwrap();
        let out = sluice(&srv, &["tenant", "set", file.to_str().unwrap()]).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert!(
            lines[0].starts_with("TENANT   VIP   PREFIXES     WEIGHT  MAX"),
            "{out}"
        );
        assert!(lines[1].starts_with("default  chat  (others)"), "{out}");
        assert!(
            lines[2].contains("10.0.2.0/24  2       40   10/10"),
            "{out}"
        );
        assert!(lines[2].ends_with("0/0/0                    ok"), "{out}");
        let v: Value =
            serde_json::from_str(&sluice(&srv, &["--json", "tenant", "list"]).unwrap()).unwrap();
        assert_eq!(v["tenant"][0]["name"], "acme");
        assert_eq!(v["tenants"][1]["max_sessions"], 40);
        // A file with a mistake changes nothing and says why.
        std::fs::write(
            &file,
            "[[tenant]]\nname = \"acme\"\nprefixes = [\"10.0.2.1/24\"]\n",
        )
        .unwrap();
        let e = sluice(&srv, &["tenant", "set", file.to_str().unwrap()]).unwrap_err();
        assert!(
            e.contains("tenant[0].prefixes[0]: \"10.0.2.1/24\" has bits set"),
            "{e}"
        );
        assert_eq!(
            srv.state().tenants.list[0].prefixes[0].to_string(),
            "10.0.2.0/24"
        );
    }

    #[test]
    fn telemetry_reads_an_exporter_page_as_the_scraper_does() {
        let srv = TestServer::start();
        let fixture = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../lb-core/tests/fixtures/telemetry/dcgm-exporter.prom"
        );
        let out = sluice(&srv, &["telemetry", "dcgm", fixture, "--gpu", "0"]).unwrap();
        assert!(
            out.lines()
                .any(|l| l.starts_with("gpu_util") && l.ends_with("0.87")),
            "{out}"
        );
        let err = sluice(&srv, &["telemetry", "dcgm", fixture, "--gpu", "9"]).unwrap_err();
        assert!(err.contains('9'), "{err}");
    }

    #[test]
    fn vip_add_then_list() {
        let srv = TestServer::start();
        let out = sluice(
            &srv,
            &[
                "vip",
                "add",
                "chat",
                "--address",
                "10.0.0.1",
                "--port",
                "443",
                "--hash",
                "source",
                "--affinity-window",
                "10m",
                "--flow-state",
                "second-chance",
                "--backend",
                "10.1.0.1",
                "--backend",
                "10.1.0.2:50",
            ],
        )
        .unwrap();
        assert_eq!(out, "added VIP chat: tcp 10.0.0.1:443, 2 backends\n");
        let vip = srv.state().vips["chat"].clone();
        assert_eq!(vip.spec.affinity_secs, 600);
        assert_eq!(vip.spec.hash, HashMode::Source);
        assert_eq!(vip.spec.flow_state, FlowState::SecondChance);
        assert_eq!(vip.backends[&"10.1.0.2".parse().unwrap()].spec.weight, 50);

        let out = sluice(&srv, &["vip", "list"]).unwrap();
        assert_eq!(
            out,
            "NAME  PROTO  ADDRESS       HASH    AFFINITY  PRIO  BACKENDS  FLOWS  PACKETS  BYTES\n\
             chat  tcp    10.0.0.1:443  source  10m       0     2         0      0        0\n"
        );

        let e = sluice(
            &srv,
            &["vip", "add", "chat", "--address", "10.0.0.2", "--port", "1"],
        )
        .unwrap_err();
        assert_eq!(e, "a VIP named \"chat\" exists already");
    }

    #[test]
    fn a_quic_vip_takes_backends_with_server_ids_and_lists_them() {
        let srv = TestServer::start();
        let add_vip = [
            "vip",
            "add",
            "chat-quic",
            "--address",
            "10.0.0.7",
            "--port",
            "443",
            "--protocol",
            "udp",
            "--quic",
            "cid",
            "--quic-server-id-len",
            "3",
            "--quic-config-rotation",
            "2",
        ];
        sluice(&srv, &add_vip).unwrap();
        let vip = srv.state().vips["chat-quic"].clone();
        assert_eq!(vip.spec.quic, crate::state::QuicMode::Cid);
        assert_eq!(
            (vip.spec.quic_server_id_len, vip.spec.quic_config_rotation),
            (3, 2)
        );
        sluice(
            &srv,
            &[
                "backend",
                "add",
                "chat-quic",
                "10.1.0.5",
                "--quic-server-id",
                "0A0B05",
            ],
        )
        .unwrap();
        let e = sluice(&srv, &["backend", "add", "chat-quic", "10.1.0.6"]).unwrap_err();
        assert!(
            e.starts_with("backend 10.1.0.6: quic_server_id: missing (required"),
            "{e}"
        );
        let e = sluice(
            &srv,
            &[
                "backend",
                "add",
                "chat-quic",
                "10.1.0.6",
                "--quic-server-id",
                "0a0b05",
            ],
        )
        .unwrap_err();
        assert!(
            e.contains("is already the server ID of backend 10.1.0.5"),
            "{e}"
        );
        let out = sluice(&srv, &["backend", "list", "chat-quic"]).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].ends_with("DRAIN  QUIC-ID  LABELS"), "{out}");
        assert!(lines[1].contains("  0a0b05   -"), "{out}");
        let v: Value = serde_json::from_str(
            &sluice(&srv, &["--json", "backend", "list", "chat-quic"]).unwrap(),
        )
        .unwrap();
        assert_eq!(v["backends"][0]["quic_server_id"], "0a0b05");
        let v: Value =
            serde_json::from_str(&sluice(&srv, &["--json", "vip", "list"]).unwrap()).unwrap();
        assert_eq!(v["vips"][0]["quic"], "cid", "{v}");
        // A TCP VIP with quic = "cid" is refused, and nothing is added.
        let mut tcp = add_vip;
        tcp[2] = "t";
        tcp[8] = "tcp";
        let e = sluice(&srv, &tcp).unwrap_err();
        assert!(
            e.starts_with("quic: \"cid\" needs protocol = \"udp\""),
            "{e}"
        );
        assert!(!srv.state().vips.contains_key("t"));
        // A backend of another VIP has no server ID: null in JSON.
        sluice(
            &srv,
            &[
                "vip",
                "add",
                "chat",
                "--address",
                "10.0.0.1",
                "--port",
                "443",
                "--backend",
                "10.1.0.1",
            ],
        )
        .unwrap();
        let v: Value =
            serde_json::from_str(&sluice(&srv, &["--json", "backend", "list", "chat"]).unwrap())
                .unwrap();
        assert_eq!(v["backends"][0]["quic_server_id"], Value::Null);
        let v: Value =
            serde_json::from_str(&sluice(&srv, &["--json", "vip", "list"]).unwrap()).unwrap();
        let quic: Vec<&Value> = v["vips"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| &v["quic"])
            .collect();
        assert_eq!(quic, [&Value::from("off"), &Value::from("cid")], "{v}");
    }

    #[test]
    fn backend_drain_then_list() {
        let srv = TestServer::start();
        sluice(
            &srv,
            &[
                "vip",
                "add",
                "chat",
                "--address",
                "10.0.0.1",
                "--port",
                "443",
                "--backend",
                "10.1.0.1",
            ],
        )
        .unwrap();
        sluice(
            &srv,
            &[
                "backend", "add", "chat", "10.1.0.2", "--weight", "5", "--label", "zone=b",
            ],
        )
        .unwrap();
        let out = sluice(
            &srv,
            &["backend", "drain", "chat", "10.1.0.1", "--deadline", "10m"],
        )
        .unwrap();
        assert!(out.starts_with("draining backend 10.1.0.1 of chat: no new flows; removed when its flows end, or at 20"), "{out}");

        let out = sluice(&srv, &["backend", "list", "chat"]).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 3, "{out}");
        assert!(
            lines[0].starts_with(
                "ADDRESS   ID  WEIGHT  EFFECTIVE  STATE     STEERING  SCORE  COOLDOWN  TELEMETRY  INBAND  HANDSHAKES  HEALTHY  FLOWS  PACKETS  BYTES  DRAIN"
            ),
            "{out}"
        );
        assert!(lines[1].starts_with("10.1.0.1  1   100     100        draining  -         -      -         -          -       -           yes      0      0        0      since 0s ago, deadline in 9m 59s"), "{out}");
        assert!(
            lines[2].starts_with(
                "10.1.0.2  2   5       5          active    -         -      -         -          -       -           yes      0      0        0      -"
            ),
            "{out}"
        );
        assert!(lines[2].ends_with("-        zone=b"), "no QUIC ID: {out}");

        let e = sluice(&srv, &["backend", "drain", "chat", "10.1.0.9"]).unwrap_err();
        assert_eq!(
            e,
            "VIP \"chat\" has no backend 10.1.0.9; `sluice backend list chat` shows its backends"
        );
        sluice(&srv, &["backend", "undrain", "chat", "10.1.0.1"]).unwrap();
        sluice(&srv, &["backend", "set-weight", "chat", "10.1.0.1", "7"]).unwrap();
        assert_eq!(
            srv.state()
                .backend("chat", "10.1.0.1".parse().unwrap())
                .unwrap()
                .spec
                .weight,
            7
        );
        assert_eq!(
            sluice(&srv, &["backend", "remove", "chat", "10.1.0.1"]).unwrap(),
            "removed backend 10.1.0.1 from chat\n"
        );
    }

    #[test]
    fn stats_json_is_the_api_answer() {
        let srv = TestServer::start();
        sluice(
            &srv,
            &[
                "vip",
                "add",
                "chat",
                "--address",
                "fd00::1",
                "--port",
                "0",
                "--protocol",
                "udp",
                "--backend",
                "[fd00:1::1]:30",
            ],
        )
        .unwrap();
        let out = sluice(&srv, &["stats", "--json"]).unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v, srv.client().call("GET", "/v1/stats", None).unwrap());
        assert_eq!(v["vips"][0]["vip"], "chat");
        assert_eq!(v["vips"][0]["backends"][0]["address"], "fd00:1::1");
        let human = sluice(&srv, &["stats"]).unwrap();
        assert!(human.starts_with("COUNTER"), "{human}");
        assert!(
            human.contains("chat  fd00:1::1  0        0      0"),
            "{human}"
        );
        // Removals print nothing with --json (the API answers 204).
        assert_eq!(
            sluice(&srv, &["--json", "vip", "remove", "chat"]).unwrap(),
            ""
        );
    }

    #[test]
    fn the_other_read_commands_print_tables() {
        let srv = TestServer::start();
        sluice(
            &srv,
            &[
                "vip",
                "add",
                "chat",
                "--address",
                "10.0.0.1",
                "--port",
                "443",
                "--backend",
                "10.1.0.1",
            ],
        )
        .unwrap();
        let status = sluice(&srv, &["status"]).unwrap();
        assert!(status.contains("interfaces  eth0 (native)\n"), "{status}");
        assert!(status.contains("vips        1\n"), "{status}");
        assert_eq!(
            sluice(&srv, &["flows", "--summary"]).unwrap(),
            "VIP   BACKEND   FLOWS\nchat  (all)     0\nchat  10.1.0.1  0\n"
        );
        assert_eq!(
            sluice(&srv, &["events"]).unwrap(),
            "TIME  KIND  VIP  BACKEND  REASON\n"
        );
    }

    #[test]
    fn run_reports_a_missing_config() {
        let cli =
            Cli::try_parse_from(["sluice", "run", "--config", "/nonexistent/sluice.toml"]).unwrap();
        let e = execute(&cli, &mut Vec::new()).unwrap_err();
        assert!(
            format!("{e:#}").contains("/nonexistent/sluice.toml"),
            "{e:#}"
        );
    }

    /// Whatever a daemon sends, the listing stays one row per backend with no control
    /// character in it: escape sequences must not reach root's terminal through
    /// `sluice backend list`, nor a newline forge a table row.
    #[test]
    fn server_strings_are_escaped_in_every_listing() {
        let hostile = "r1\x1b]0;owned\x07\n10.6.6.6  9  100\u{9b}2J\u{202e}";
        let answer = json!({"backends": [{
            "address": hostile,
            "id": 1,
            "labels": {hostile: hostile},
            "state": hostile,
            "steering": {"state": hostile, "reason": hostile},
        }]});
        let clean = |text: &str, lines: usize| {
            assert_eq!(text.lines().count(), lines, "{text}");
            assert!(
                !text
                    .chars()
                    .any(|c| c != '\n' && escape::text(&c.to_string()) != c.to_string()),
                "{text:?}"
            );
        };
        let mut out = Vec::new();
        print_backends(&mut out, &answer).unwrap();
        let text = String::from_utf8(out).unwrap();
        clean(&text, 2);
        assert!(
            text.contains("r1\\u{1b}]0;owned\\u{7}\\n10.6.6.6"),
            "{text}"
        );
        let mut out = Vec::new();
        print_status(
            &mut out,
            &json!({"interfaces": [{"name": hostile, "mode": hostile}], "version": hostile}),
        )
        .unwrap();
        clean(&String::from_utf8(out).unwrap(), 8);
        let mut out = Vec::new();
        Output {
            json: true,
            out: &mut out,
        }
        .show(&answer, print_backends)
        .unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(!text.contains(['\u{9b}', '\u{202e}']), "{text:?}");
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), answer);
        // A deadline no RFC 3339 date can hold is shown, not a panic.
        assert_eq!(timestamp(u64::MAX), format!("{} ms after 1970", u64::MAX));
    }

    #[test]
    fn usage_errors_exit_2_and_help_reads() {
        Cli::command().debug_assert();
        let e = Cli::try_parse_from([
            "sluice",
            "backend",
            "drain",
            "chat",
            "10.1.0.1",
            "--deadline",
            "soon",
        ])
        .unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(
            e.to_string().contains("e.g. \"500ms\", \"10s\", \"5m\""),
            "{e}"
        );
        let e = Cli::try_parse_from([
            "sluice",
            "backend",
            "drain",
            "chat",
            "10.1.0.1",
            "--deadline",
            "18446744073709552s",
        ])
        .unwrap_err();
        assert!(e.to_string().contains("is longer than 365d"), "{e}");
        let e = Cli::try_parse_from([
            "sluice",
            "vip",
            "add",
            "x",
            "--address",
            "10.0.0.1",
            "--port",
            "1",
            "--protocol",
            "sctp",
        ])
        .unwrap_err();
        assert_eq!(e.exit_code(), 2);
        // Every command's help renders, with its examples.
        let mut cmd = Cli::command();
        for sub in cmd.get_subcommands_mut().filter(|c| c.get_name() != "help") {
            let help = sub.render_long_help().to_string();
            assert!(
                help.contains("Example"),
                "{} has no examples:\n{help}",
                sub.get_name()
            );
            for leaf in sub.get_subcommands_mut().filter(|c| c.get_name() != "help") {
                let help = leaf.render_long_help().to_string();
                assert!(
                    help.contains("Example"),
                    "{} has no examples:\n{help}",
                    leaf.get_name()
                );
            }
        }
    }

    #[test]
    fn cleanup_refuses_while_a_daemon_answers() {
        let srv = TestServer::start();
        let dir = srv.dir.join("bpffs");
        std::fs::create_dir_all(&dir).unwrap();
        let e = sluice(&srv, &["cleanup", "--bpffs", dir.to_str().unwrap()]).unwrap_err();
        assert!(e.starts_with("a sluice daemon (pid "), "{e}");
        assert!(dir.exists());
        let out = sluice(
            &srv,
            &["cleanup", "--force", "--bpffs", dir.to_str().unwrap()],
        )
        .unwrap();
        assert!(out.starts_with("removed the data plane pinned at"), "{out}");
        assert!(!dir.exists());
    }
}
