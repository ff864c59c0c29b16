//! The one validation path of a configuration, shared by `sluice check` and `sluice run`:
//! everything `run` would refuse at start is found here, before anything is attached, and
//! without root or any change to the system (like `haproxy -c` / `nginx -t`).

use std::{io::Write, path::Path};

use crate::{
    config::{self, Config},
    private_file,
    state::{specs, Limits, State},
};

/// A configuration that `sluice run` accepts.
#[derive(Debug)]
pub struct Checked {
    pub config: Config,
    /// The file's text, as read (its hash tells a changed file on restart).
    pub text: String,
    /// Rendered like errors, one per entry; they do not refuse the file.
    pub warnings: Vec<String>,
}

/// Why a configuration is refused: one line per problem (`file:line:col: key: problem`).
#[derive(Debug)]
pub struct Refused(pub Vec<String>);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.join("\n"))
    }
}

impl std::error::Error for Refused {}

/// Reads and validates the file at `path`.
pub fn check_file(path: &Path) -> Result<Checked, Refused> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Refused(vec![format!(
            "{}: cannot read the configuration: {e}",
            path.display()
        )])
    })?;
    check(&text, &path.display().to_string())
}

/// Validates `text` (from `origin`, which prefixes every message): the file's syntax and
/// keys (telemetry URLs included), the VIPs and backends as the daemon's state takes them,
/// and the directories of the files the daemon writes.
pub fn check(text: &str, origin: &str) -> Result<Checked, Refused> {
    let (config, warnings) =
        config::parse_with_warnings(text, origin).map_err(|e| Refused(e.messages()))?;
    let mut problems = Vec::new();
    let limits = Limits {
        max_vips: config.dataplane.max_vips,
    };
    if let Err(e) = State::default().with_specs(&specs(&config), &limits) {
        problems.push(format!("{origin}: vip: {e}"));
    }
    // The daemon writes these as root: a directory another user can write would let that
    // user redirect the writes (`private_file`).
    for (key, file) in [
        ("daemon.state_file", &config.daemon.state_file),
        ("admin.audit_log", &config.admin.audit_log),
    ] {
        if let Err(e) = private_file::check_dir(file) {
            problems.push(format!("{origin}: {key}: {e}"));
        }
    }
    if !problems.is_empty() {
        return Err(Refused(problems));
    }
    Ok(Checked {
        config,
        text: text.to_owned(),
        warnings,
    })
}

/// `sluice check`: prints the verdict (warnings go to stderr); a refused file is the error.
pub fn command(path: &Path, json: bool, out: &mut dyn Write) -> anyhow::Result<()> {
    let c = check_file(path)?;
    for w in &c.warnings {
        eprintln!("warning: {w}");
    }
    let vips = c.config.vips.len();
    let backends: usize = c.config.vips.iter().map(|v| v.backends.len()).sum();
    if json {
        let v = serde_json::json!({
            "config": path.display().to_string(),
            "valid": true,
            "vips": vips,
            "backends": backends,
            "warnings": c.warnings,
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        writeln!(
            out,
            "{}: valid ({vips} VIP(s), {backends} backend(s), {} warning(s))",
            path.display(),
            c.warnings.len()
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = include_str!("../../configs/minimal.toml");
    const FULL: &str = include_str!("../../configs/sluice.toml");

    #[test]
    fn the_example_configurations_pass() {
        for (name, text) in [("minimal.toml", MINIMAL), ("sluice.toml", FULL)] {
            let c = check(text, name).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(c.text, text);
        }
    }

    #[test]
    fn a_syntax_error_is_refused_with_its_position() {
        let e = check("[dataplane\n", "x.toml").unwrap_err();
        assert_eq!(e.0.len(), 1, "{e}");
        assert!(e.0[0].starts_with("x.toml:1:"), "{e}");
    }

    #[test]
    fn state_and_audit_paths_in_a_directory_others_can_write_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = crate::test_dir::TestDir::new("check-shared");
        std::fs::set_permissions(&*dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
        for (section, key, file) in [
            ("daemon", "state_file", "state.json"),
            ("admin", "audit_log", "audit.jsonl"),
        ] {
            let text = format!(
                "{MINIMAL}\n[{section}]\n{key} = \"{}\"\n",
                dir.join(file).display()
            );
            let e = check(&text, "x.toml").unwrap_err();
            assert_eq!(e.0.len(), 1, "{e}");
            assert!(
                e.0[0].starts_with(&format!("x.toml: {section}.{key}: {}", dir.display())),
                "{e}"
            );
            assert!(e.0[0].contains("writable by every user"), "{e}");
        }
    }

    #[test]
    fn an_unreadable_file_is_refused_naming_it() {
        let e = check_file(Path::new("/nonexistent/sluice.toml")).unwrap_err();
        assert!(
            e.0[0].starts_with("/nonexistent/sluice.toml: cannot read the configuration"),
            "{e}"
        );
    }
}
