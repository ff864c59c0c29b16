//! The symbols bpf-linker must export, found by scanning the eBPF crate's sources.
//!
//! bpf-linker internalizes every symbol it is not told to export. An internalized program
//! function is unreferenced and dropped, so its section vanishes; an internalized map stays
//! (the programs use it) but becomes a LOCAL symbol, and aya then fails with
//! `error parsing map`. So every program and every map must be passed with `--export`.
//!
//! The scan reads every `.rs` file under `lb-ebpf/src` with a small Rust lexer (comments,
//! strings and char literals are skipped) and collects:
//! - `#[map]` / `#[btf_map]` (optionally `#[map(name = "X")]`, which renames the symbol)
//!   followed by `[pub] static [mut] NAME`;
//! - a program attribute from aya-ebpf's macros ([`PROGRAM_ATTRS`]: `#[xdp]`,
//!   `#[classifier]`, ...) followed by `[pub] [unsafe] [extern "C"] fn name`.
//!
//! Other attributes and doc comments may sit between the attribute and the item, and the
//! attribute may be written with a path (`#[aya_ebpf::macros::xdp]`). Limits: items produced
//! by `macro_rules!` or hidden in `#[cfg_attr(.., xdp)]` are not seen, and an item disabled by
//! `#[cfg]` is still expected. The build verifies the linked object against this list and
//! checks that no symbol in the maps section is LOCAL, so a miss fails loudly.

use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};

/// aya-ebpf 0.2's program attribute macros (aya-ebpf-macros 0.2). Each emits a `#[no_mangle]`
/// function named like the annotated function, in the program's section.
pub const PROGRAM_ATTRS: &[&str] = &[
    "xdp",
    "classifier",
    "cgroup_device",
    "cgroup_skb",
    "cgroup_sock",
    "cgroup_sock_addr",
    "cgroup_sockopt",
    "cgroup_sysctl",
    "btf_tracepoint",
    "fentry",
    "fexit",
    "flow_dissector",
    "kprobe",
    "kretprobe",
    "lsm",
    "lsm_cgroup",
    "perf_event",
    "raw_tracepoint",
    "sk_lookup",
    "sk_msg",
    "sk_reuseport",
    "sock_ops",
    "socket_filter",
    "stream_parser",
    "stream_verdict",
    "tracepoint",
    "uprobe",
    "uretprobe",
];

/// Map attribute macros: `map` puts the static in section `maps`, `btf_map` in `.maps`.
pub const MAP_ATTRS: &[&str] = &["map", "btf_map"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Map,
    Program,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Export {
    /// The symbol name in the object.
    pub name: String,
    pub kind: Kind,
    /// The attribute that declared it (`xdp`, `map`, ...).
    pub attr: String,
    /// `file:line` of the attribute.
    pub at: String,
}

/// Scans every `.rs` file under `src_dir` (sorted, recursively).
pub fn scan_dir(src_dir: &Path) -> Result<Vec<Export>> {
    let mut files = Vec::new();
    collect_rs(src_dir, &mut files)?;
    files.sort();
    let mut exports: Vec<Export> = Vec::new();
    for file in files {
        let src =
            fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
        let shown = file
            .strip_prefix(crate::cmd::workspace_root())
            .unwrap_or(&file);
        for e in scan_source(&src, &shown.display().to_string())? {
            if let Some(prev) = exports.iter().find(|p| p.name == e.name) {
                bail!(
                    "symbol `{}` is declared twice: {} and {}",
                    e.name,
                    prev.at,
                    e.at
                );
            }
            exports.push(e);
        }
    }
    Ok(exports)
}

fn collect_rs(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            collect_rs(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Punct(char),
    Str(String),
    /// Numbers, char and byte literals, lifetimes: never part of what we match.
    Other,
}

/// Tokens with their line numbers. Good enough for matching attributes and item heads; it
/// does not validate Rust.
fn lex(src: &str) -> Vec<(Tok, usize)> {
    let c: Vec<char> = src.chars().collect();
    let (mut i, mut line, mut out) = (0, 1, Vec::new());
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    while i < c.len() {
        let ch = c[i];
        let start_line = line;
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            // Block comments nest in Rust.
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    line += usize::from(c[i] == '\n');
                    i += 1;
                }
            }
        } else if ch == '"' || ((ch == 'b' || ch == 'c') && at(i + 1) == '"') {
            // "...", b"...", c"..." with escapes.
            i += if ch == '"' { 1 } else { 2 };
            let mut s = String::new();
            while i < c.len() && c[i] != '"' {
                if c[i] == '\\' {
                    s.push(c[i]);
                    i += 1;
                }
                if i < c.len() {
                    line += usize::from(c[i] == '\n');
                    s.push(c[i]);
                    i += 1;
                }
            }
            i += 1;
            out.push((Tok::Str(s), start_line));
        } else if let Some(len) = raw_string_open(&c[i..]) {
            // r"...", r#"..."#, br#"..."# ...: ends at '"' followed by as many '#'.
            let hashes = len - 1 - usize::from(ch == 'b' || ch == 'c') - 1;
            i += len;
            let mut s = String::new();
            while i < c.len() {
                if c[i] == '"' && (1..=hashes).all(|k| at(i + k) == '#') {
                    i += 1 + hashes;
                    break;
                }
                line += usize::from(c[i] == '\n');
                s.push(c[i]);
                i += 1;
            }
            out.push((Tok::Str(s), start_line));
        } else if ch == '\'' {
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a).
            if at(i + 1) == '\\' {
                // Skip the quote, the backslash and the escaped char (which may be a quote).
                i += 3;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                i += 1;
                while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
            }
            out.push((Tok::Other, start_line));
        } else if ch.is_alphabetic() || ch == '_' {
            let s0 = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            let mut ident: String = c[s0..i].iter().collect();
            if ident == "r" && at(i) == '#' && (at(i + 1).is_alphabetic() || at(i + 1) == '_') {
                // r#ident
                i += 1;
                let s1 = i;
                while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
                ident = c[s1..i].iter().collect();
            }
            out.push((Tok::Ident(ident), start_line));
        } else if ch.is_ascii_digit() {
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_' || c[i] == '.') {
                // Stop before `..` of a range.
                if c[i] == '.' && at(i + 1) == '.' {
                    break;
                }
                i += 1;
            }
            out.push((Tok::Other, start_line));
        } else {
            out.push((Tok::Punct(ch), start_line));
            i += 1;
        }
    }
    out
}

/// Length of a raw string's opening (`r"`, `r#"`, `br##"`, `cr"`), if one starts here.
fn raw_string_open(c: &[char]) -> Option<usize> {
    let mut i = match c {
        ['r', ..] => 1,
        ['b' | 'c', 'r', ..] => 2,
        _ => return None,
    };
    while c.get(i) == Some(&'#') {
        i += 1;
    }
    (c.get(i) == Some(&'"')).then_some(i + 1)
}

/// Scans one source file; `file` is only used in messages.
pub fn scan_source(src: &str, file: &str) -> Result<Vec<Export>> {
    let toks = lex(src);
    let mut exports = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        // An outer attribute `#[...]` (not an inner `#![...]`).
        if toks[i].0 != Tok::Punct('#') || toks.get(i + 1).map(|t| &t.0) != Some(&Tok::Punct('[')) {
            i += 1;
            continue;
        }
        let line = toks[i].1;
        let (attr, args, end) = parse_attr(&toks, i);
        i = end;
        let kind = match attr.as_deref() {
            Some(a) if MAP_ATTRS.contains(&a) => Kind::Map,
            Some(a) if PROGRAM_ATTRS.contains(&a) => Kind::Program,
            _ => continue,
        };
        let attr = attr.unwrap_or_default();
        let at = format!("{file}:{line}");
        let item_name = parse_item_name(&toks, end, kind).with_context(|| {
            let expected = match kind {
                Kind::Map => "`[pub] static [mut] NAME`",
                Kind::Program => "`[pub] [unsafe] [extern \"C\"] fn name`",
            };
            format!("{at}: #[{attr}] is not followed by {expected} (the export scanner cannot find the symbol name; see xtask/src/exports.rs)")
        })?;
        // `#[map(name = "X")]` exports the map as X.
        let name = match kind {
            Kind::Map => named_arg(&args, "name").unwrap_or(item_name),
            Kind::Program => item_name,
        };
        exports.push(Export {
            name,
            kind,
            attr,
            at,
        });
    }
    Ok(exports)
}

/// Parses the attribute starting at `toks[start]` (`#`): returns the last segment of its path
/// (`xdp` for `#[aya_ebpf::macros::xdp(frags)]`), the tokens inside its parentheses, and the
/// index after the closing `]`.
fn parse_attr(toks: &[(Tok, usize)], start: usize) -> (Option<String>, Vec<Tok>, usize) {
    let mut i = start + 2;
    let mut name = None;
    // Path: ident (:: ident)*, possibly led by `::`.
    while i < toks.len() {
        match &toks[i].0 {
            Tok::Ident(s) => name = Some(s.clone()),
            Tok::Punct(':') => {}
            _ => break,
        }
        i += 1;
    }
    let mut args = Vec::new();
    let mut depth = 1; // inside `[`
    let args_open = toks.get(i).map(|t| &t.0) == Some(&Tok::Punct('('));
    while i < toks.len() && depth > 0 {
        let t = &toks[i].0;
        match t {
            Tok::Punct('[' | '(' | '{') => depth += 1,
            Tok::Punct(']' | ')' | '}') => depth -= 1,
            _ => {}
        }
        if args_open && depth >= 2 {
            args.push(t.clone());
        }
        i += 1;
    }
    if args_open && !args.is_empty() {
        args.remove(0); // the `(`
    }
    (name, args, i)
}

/// `KEY = "value"` among an attribute's arguments.
fn named_arg(args: &[Tok], key: &str) -> Option<String> {
    args.windows(3).find_map(|w| match w {
        [Tok::Ident(k), Tok::Punct('='), Tok::Str(v)] if k == key => Some(v.clone()),
        _ => None,
    })
}

/// The name of the item after an attribute: skips further attributes and the visibility,
/// then expects `static [mut] NAME` (maps) or `[const] [unsafe] [extern ["abi"]] fn name`
/// (programs).
fn parse_item_name(toks: &[(Tok, usize)], mut i: usize, kind: Kind) -> Option<String> {
    let tok = |i: usize| toks.get(i).map(|t| &t.0);
    let is_ident = |i: usize, s: &str| matches!(tok(i), Some(Tok::Ident(x)) if x == s);
    // Further outer attributes (`#[inline]`, doc comments are already gone).
    while tok(i) == Some(&Tok::Punct('#')) && tok(i + 1) == Some(&Tok::Punct('[')) {
        i = parse_attr(toks, i).2;
    }
    if is_ident(i, "pub") {
        i += 1;
        if tok(i) == Some(&Tok::Punct('(')) {
            while i < toks.len() && tok(i) != Some(&Tok::Punct(')')) {
                i += 1;
            }
            i += 1;
        }
    }
    match kind {
        Kind::Map => {
            if !is_ident(i, "static") {
                return None;
            }
            i += 1;
            if is_ident(i, "mut") {
                i += 1;
            }
        }
        Kind::Program => {
            while is_ident(i, "const") || is_ident(i, "unsafe") || is_ident(i, "extern") {
                i += 1;
                if matches!(tok(i), Some(Tok::Str(_))) {
                    i += 1;
                }
            }
            if !is_ident(i, "fn") {
                return None;
            }
            i += 1;
        }
    }
    match tok(i) {
        Some(Tok::Ident(name)) => Some(name.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(src: &str) -> Vec<(String, Kind)> {
        scan_source(src, "t.rs")
            .unwrap()
            .into_iter()
            .map(|e| (e.name, e.kind))
            .collect()
    }

    #[test]
    fn finds_maps_and_programs() {
        let src = r#"
#![no_std]
use aya_ebpf::{macros::{map, xdp, classifier}, maps::*};

/// Counters.
#[map]
pub static PASS_COUNT: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

#[map(name = "CONNS")]
static mut CONN_TABLE: LruHashMap<u32, u32> = LruHashMap::with_max_entries(1024, 0);

#[map]
#[allow(non_upper_case_globals)]
pub(crate) static rings: Array<u32> = Array::with_max_entries(65537, 0);

#[xdp(frags)]
pub fn sluice_xdp(ctx: XdpContext) -> u32 { try_xdp(ctx).unwrap_or(2) }

#[aya_ebpf::macros::classifier]
#[inline(never)]
fn sluice_decap(ctx: TcContext) -> i32 { 0 }

#[xdp]
pub unsafe extern "C" fn raw_prog(ctx: XdpContext) -> u32 { 2 }
"#;
        assert_eq!(
            names(src),
            vec![
                ("PASS_COUNT".into(), Kind::Map),
                ("CONNS".into(), Kind::Map),
                ("rings".into(), Kind::Map),
                ("sluice_xdp".into(), Kind::Program),
                ("sluice_decap".into(), Kind::Program),
                ("raw_prog".into(), Kind::Program),
            ]
        );
    }

    #[test]
    fn ignores_comments_strings_and_other_attributes() {
        let src = r####"
// #[map] pub static IN_LINE_COMMENT: u32 = 0;
/* #[xdp] pub fn in_block_comment() {}
   /* nested #[map] static NESTED: u8 = 0; */ #[xdp] fn still_comment() {} */
const S: &str = "#[xdp] pub fn in_string() {}";
const R: &str = r#"#[map] static IN_RAW: u8 = 0; "still raw" "#;
const C: char = '#';
const Q: char = '"';
const E: char = '\'';
const U: char = '\u{1F600}';
fn f<'a>(x: &'a u8) -> &'a u8 { x }
#[derive(Clone)]
#[repr(C)]
pub struct NotAMap;
#[test]
fn not_a_program() {}
#[xdp]
pub fn real(ctx: XdpContext) -> u32 { 2 }
"####;
        assert_eq!(names(src), vec![("real".into(), Kind::Program)]);
    }

    #[test]
    fn an_attribute_without_a_recognisable_item_is_an_error() {
        let err = scan_source("#[xdp]\nmacro_rules! m { () => {} }\n", "x.rs").unwrap_err();
        assert!(format!("{err:#}").contains("x.rs:1: #[xdp]"), "{err:#}");
        assert!(scan_source("#[map]\npub const NOT_STATIC: u8 = 0;", "x.rs").is_err());
    }

    #[test]
    fn the_ebpf_crate_scans() {
        let src = crate::cmd::workspace_root().join("lb-ebpf/src");
        let exports = scan_dir(&src).unwrap();
        assert!(
            exports.iter().any(|e| e.kind == Kind::Program),
            "{exports:?}"
        );
    }
}
