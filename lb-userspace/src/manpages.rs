//! Man pages from the command line's own definition (clap_mangen): `sluice.1` and one page
//! per subcommand (`sluice-backend-list.1`, ...), as the package installs them.

use std::{io::Write, path::Path};

use anyhow::{Context, Result};

/// Writes the pages of `cmd` and its subcommands (hidden ones left out) into `dir`; prints
/// each file written.
pub fn write(cmd: clap::Command, dir: &Path, out: &mut dyn Write) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut cmd = cmd;
    cmd.build();
    page(&cmd, "sluice", dir, out)
}

fn page(cmd: &clap::Command, name: &str, dir: &Path, out: &mut dyn Write) -> Result<()> {
    let path = dir.join(format!("{name}.1"));
    let mut buf = Vec::new();
    clap_mangen::Man::new(cmd.clone().name(name.to_string()))
        .render(&mut buf)
        .with_context(|| format!("rendering {name}.1"))?;
    std::fs::write(&path, buf).with_context(|| format!("writing {}", path.display()))?;
    writeln!(out, "{}", path.display())?;
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        if sub.get_name() == "help" {
            continue;
        }
        page(sub, &format!("{name}-{}", sub.get_name()), dir, out)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn every_visible_command_gets_a_page() {
        let dir = crate::test_dir::TestDir::new("man");
        let mut listed = Vec::new();
        write(crate::cli::Cli::command(), &dir, &mut listed).unwrap();
        let listed = String::from_utf8(listed).unwrap();
        for name in [
            "sluice.1",
            "sluice-run.1",
            "sluice-check.1",
            "sluice-backend-list.1",
            "sluice-backend-host-run.1",
        ] {
            let p = dir.join(name);
            assert!(
                listed.contains(&p.display().to_string()),
                "{name}: {listed}"
            );
            let text = std::fs::read_to_string(&p).unwrap();
            assert!(text.starts_with(".ie"), "{name} is not roff: {text:.80}");
        }
        assert!(
            !dir.join("sluice-manpages.1").exists(),
            "hidden commands get no page"
        );
    }
}
