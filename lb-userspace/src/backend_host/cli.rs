//! `sluice backend-host ...`: the subcommands and their dispatch.

use std::{io::Write, path::PathBuf};

use anyhow::{Context, Result};
use clap::Subcommand;

use super::config::DEFAULT_PATH;

#[derive(Subcommand, Debug)]
pub enum BackendHostCommand {
    /// Attach the decapsulation program, put the VIPs on lo and serve metrics (foreground)
    #[command(after_help = "\
Examples:
  sluice backend-host run --config /etc/sluice/backend-host.toml

Runs until SIGTERM or SIGINT, then detaches and takes the VIPs off lo (unless
keep_dataplane_on_exit); a crash or kill -9 leaves decapsulation running and the next start
re-adopts it. SIGHUP applies the file's `vips`. Needs root (or CAP_BPF, CAP_NET_ADMIN and
CAP_PERFMON) and a bpffs mount.")]
    Run {
        /// The backend host's configuration file (TOML).
        #[arg(long, short, value_name = "FILE", default_value = DEFAULT_PATH)]
        config: PathBuf,
    },

    /// Validate the configuration and report what would break direct server return here
    #[command(after_help = "\
Examples:
  sluice backend-host check --config /etc/sluice/backend-host.toml

Reads the host's sysctls (rp_filter, arp_ignore, arp_announce) and interface MTUs and changes
nothing; needs no root. Exit status 0 when the file is valid and nothing is found, 1 otherwise
(each problem is printed with the command that fixes it).")]
    Check {
        /// The backend host's configuration file (TOML).
        #[arg(long, short, value_name = "FILE", default_value = DEFAULT_PATH)]
        config: PathBuf,
    },

    /// Show what is attached and pinned, the VIPs on lo, the counters and DSR problems
    #[command(after_help = "\
Examples:
  sluice backend-host status --config /etc/sluice/backend-host.toml

Works whether or not the daemon runs (it reads the pinned maps: needs root).")]
    Status {
        /// The backend host's configuration file (TOML).
        #[arg(long, short, value_name = "FILE", default_value = DEFAULT_PATH)]
        config: PathBuf,
    },
}

pub fn execute(cmd: &BackendHostCommand, json: bool, out: &mut dyn Write) -> Result<()> {
    match cmd {
        BackendHostCommand::Run { config } => tokio::runtime::Runtime::new()
            .context("starting the async runtime")?
            .block_on(super::run(config)),
        BackendHostCommand::Check { config } => super::check(config, json, out),
        BackendHostCommand::Status { config } => super::status(config, json, out),
    }
}
