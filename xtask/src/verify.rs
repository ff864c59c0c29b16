//! Checks the linked BPF object: every exported program and map is a GLOBAL symbol in the
//! right kind of section, and no map was left LOCAL (which aya rejects with
//! `error parsing map`).

use std::{fs, path::Path};

use anyhow::{bail, Context, Result};
use object::{
    Object, ObjectSection, ObjectSymbol, SectionKind, SymbolFlags, SymbolKind, SymbolSection,
};

use crate::exports::{Export, Kind};

/// Sections legacy (`#[map]`) and BTF (`#[btf_map]`) maps live in.
const MAP_SECTIONS: &[&str] = &["maps", ".maps"];

struct Sym {
    name: String,
    global: bool,
    section: String,
    executable: bool,
}

/// Verifies `obj` against `exports` and prints what it found, one line per export.
pub fn verify_object(obj: &Path, exports: &[Export]) -> Result<()> {
    let data = fs::read(obj).with_context(|| format!("reading {}", obj.display()))?;
    let file = object::File::parse(&*data)
        .with_context(|| format!("{} is not an ELF object", obj.display()))?;
    if file.architecture() != object::Architecture::Bpf {
        bail!(
            "{} is not a BPF object ({:?})",
            obj.display(),
            file.architecture()
        );
    }
    let syms: Vec<Sym> = file
        .symbols()
        // Named symbols defined in a section (not the section symbols themselves).
        .filter(|s| s.kind() != SymbolKind::Section && s.name().is_ok_and(|n| !n.is_empty()))
        .filter_map(|s| {
            let SymbolSection::Section(idx) = s.section() else {
                return None;
            };
            let section = file.section_by_index(idx).ok()?;
            let global = match s.flags() {
                SymbolFlags::Elf { st_info, .. } => st_info >> 4 == object::elf::STB_GLOBAL,
                _ => s.is_global(),
            };
            Some(Sym {
                name: s.name().ok()?.to_string(),
                global,
                section: section.name().ok()?.to_string(),
                executable: section.kind() == SectionKind::Text,
            })
        })
        .collect();

    let mut problems = Vec::new();
    println!("verifying {}:", obj.display());
    for e in exports {
        let Some(sym) = syms.iter().find(|s| s.name == e.name) else {
            problems.push(format!(
                "{} `{}` ({}) is not in the object (is it behind a #[cfg]?)",
                kind_name(e.kind),
                e.name,
                e.at
            ));
            continue;
        };
        let binding = if sym.global { "GLOBAL" } else { "LOCAL" };
        println!(
            "  {:<8} {:<28} {:<7} section {}",
            kind_name(e.kind),
            e.name,
            binding,
            sym.section
        );
        if !sym.global {
            problems.push(format!("`{}` is {binding}, not GLOBAL", e.name));
        }
        match e.kind {
            Kind::Map if !MAP_SECTIONS.contains(&sym.section.as_str()) => problems.push(format!(
                "map `{}` is in section `{}`, not `maps`",
                e.name, sym.section
            )),
            Kind::Program if !sym.executable || sym.section == ".text" => {
                problems.push(format!(
                    "program `{}` is in section `{}`, not in a program section (`xdp`, `classifier`, ...)",
                    e.name, sym.section
                ))
            }
            _ => {}
        }
    }
    // A map the source scan missed would still be in the maps section, but LOCAL.
    for s in syms
        .iter()
        .filter(|s| MAP_SECTIONS.contains(&s.section.as_str()))
    {
        if !exports.iter().any(|e| e.name == s.name) {
            problems.push(format!(
                "symbol `{}` in section `{}` was not exported (the export scan in \
                 xtask/src/exports.rs did not find its #[map])",
                s.name, s.section
            ));
        }
    }
    let program_sections = syms
        .iter()
        .filter(|s| s.executable && s.section != ".text")
        .count();
    if program_sections == 0 {
        problems.push("the object has no program section".into());
    }
    if !problems.is_empty() {
        bail!(
            "{} is not loadable as built:\n  - {}\n(every program and map must be exported \
             by bpf-linker; a map symbol left LOCAL fails in aya with `error parsing map`)",
            obj.display(),
            problems.join("\n  - ")
        );
    }
    Ok(())
}

fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Map => "map",
        Kind::Program => "program",
    }
}
