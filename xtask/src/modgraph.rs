//! The module graph of a crate, from its sources: which top-level module names which (through
//! `crate::` paths in code that is not a test), and the cycles in it. Crates keep the pure half
//! apart from the shells; this keeps each crate's modules in layers too, so a module can be
//! read, and moved, after the ones it uses.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::Path,
};

use anyhow::{bail, Context, Result};

/// Edges between a crate's top-level modules: `foo.rs` and `foo/` are one module `foo`.
pub type Graph = BTreeMap<String, BTreeSet<String>>;

/// Fails with every cycle of each crate's module graph (crate source directories, relative to
/// the workspace root).
pub fn check(root: &Path, crates: &[&str]) -> Result<()> {
    let mut found = Vec::new();
    for dir in crates {
        let graph = graph(&root.join(dir))?;
        for cycle in cycles(&graph) {
            found.push(format!("{dir}: {}", cycle.join(" -> ")));
        }
    }
    if !found.is_empty() {
        bail!(
            "module import cycles (move what both sides need into a module of its own, or \
             invert the dependency that points from a lower layer to a higher one):\n  {}",
            found.join("\n  ")
        );
    }
    Ok(())
}

/// The graph of the crate whose sources are in `src`.
pub fn graph(src: &Path) -> Result<Graph> {
    let mut modules = BTreeSet::new();
    for e in fs::read_dir(src).with_context(|| format!("reading {}", src.display()))? {
        let path = e?.path();
        let name = path.file_stem().unwrap_or_default().to_string_lossy();
        let is_module = path.is_dir() || path.extension().is_some_and(|x| x == "rs");
        if is_module && !["lib", "main", "bin"].contains(&name.as_ref()) {
            modules.insert(name.into_owned());
        }
    }
    let mut graph = Graph::new();
    for m in &modules {
        let mut files = Vec::new();
        let file = src.join(format!("{m}.rs"));
        if file.is_file() {
            files.push((file, true));
        }
        collect(&src.join(m), &mut files)?;
        let edges = graph.entry(m.clone()).or_default();
        for (path, top) in files {
            let text =
                fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
            for used in references(&without_tests(&text), top) {
                if used != *m && modules.contains(&used) {
                    edges.insert(used);
                }
            }
        }
    }
    Ok(graph)
}

/// Every `.rs` file under `dir`, except test files; `false`: not a top-level file.
fn collect(dir: &Path, out: &mut Vec<(std::path::PathBuf, bool)>) -> Result<()> {
    if !dir.is_dir() {
        return Ok(());
    }
    for e in fs::read_dir(dir)? {
        let path = e?.path();
        if path.is_dir() {
            collect(&path, out)?;
        } else if path.extension().is_some_and(|x| x == "rs")
            && path.file_name().is_some_and(|n| n != "tests.rs")
        {
            out.push((path, false));
        }
    }
    Ok(())
}

/// `text` without comments and without the items marked `#[cfg(test)]`.
fn without_tests(text: &str) -> String {
    let code: Vec<&str> = text
        .lines()
        .map(|l| l.find("//").map_or(l, |i| &l[..i]))
        .collect();
    let mut out = String::new();
    let mut i = 0;
    while i < code.len() {
        if code[i].trim() != "#[cfg(test)]" {
            out.push_str(code[i]);
            out.push('\n');
            i += 1;
            continue;
        }
        // Skip the item: to its `;` if it has no body, else to its closing brace.
        let mut depth = 0i32;
        let mut opened = false;
        i += 1;
        while i < code.len() {
            for c in code[i].chars() {
                match c {
                    '{' => (depth, opened) = (depth + 1, true),
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            let line = code[i].trim_end();
            i += 1;
            if (opened && depth <= 0) || (!opened && line.ends_with(';')) {
                break;
            }
        }
    }
    out
}

/// The top-level modules `code` names: `crate::m`, each `m` of `crate::{m, n::…}`, and in a
/// top-level file `super::m`.
fn references(code: &str, top: bool) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut prefixes = vec!["crate::"];
    if top {
        prefixes.push("super::");
    }
    for prefix in prefixes {
        let mut rest = code;
        while let Some(at) = rest.find(prefix) {
            let before = rest[..at].chars().next_back();
            rest = &rest[at + prefix.len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            if let Some(group) = rest.strip_prefix('{') {
                out.extend(group_heads(group));
            } else {
                out.extend(ident(rest));
            }
        }
    }
    out
}

/// The first path segment of each entry of a `{…}` use group (the text after its `{`).
fn group_heads(group: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut at_entry = true;
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => at_entry = true,
            c if at_entry && !c.is_whitespace() => {
                at_entry = false;
                heads.extend(ident(&group[i..]));
            }
            _ => {}
        }
    }
    heads
}

fn ident(s: &str) -> Option<String> {
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    (end > 0 && s[..end] != *"self").then(|| s[..end].to_owned())
}

/// One cycle per strongly connected component of more than one module, as a path that
/// returns to its start.
pub fn cycles(graph: &Graph) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut seen: BTreeSet<&String> = BTreeSet::new();
    for start in graph.keys() {
        if seen.contains(start) {
            continue;
        }
        // The modules that reach `start` and are reached from it: its component.
        let from = reachable(graph, start);
        let component: BTreeSet<&String> = from
            .iter()
            .copied()
            .filter(|m| reachable(graph, m).contains(start))
            .collect();
        seen.extend(component.iter().copied());
        if component.len() > 1 {
            out.push(path_back(graph, start, &component));
        }
    }
    out
}

fn reachable<'a>(graph: &'a Graph, from: &'a String) -> BTreeSet<&'a String> {
    let mut seen = BTreeSet::from([from]);
    let mut todo = vec![from];
    while let Some(m) = todo.pop() {
        for n in graph.get(m).into_iter().flatten() {
            if seen.insert(n) {
                todo.push(n);
            }
        }
    }
    seen
}

/// A shortest walk from `start` back to it inside `component` (breadth first).
fn path_back(graph: &Graph, start: &String, component: &BTreeSet<&String>) -> Vec<String> {
    let mut parent: BTreeMap<&String, &String> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    while let Some(m) = queue.pop_front() {
        for n in graph.get(m).into_iter().flatten() {
            if !component.contains(n) {
                continue;
            }
            if n == start {
                let mut path = vec![start.clone()];
                let mut at = m;
                while at != start {
                    path.push(at.clone());
                    at = parent[at];
                }
                path.push(start.clone());
                path.reverse();
                return path;
            }
            if !parent.contains_key(n) {
                parent.insert(n, m);
                queue.push_back(n);
            }
        }
    }
    unreachable!("a module of a component of two or more reaches itself")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_dir::TestDir;

    fn write(dir: &Path, files: &[(&str, &str)]) {
        for (name, text) in files {
            let path = dir.join(name);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text).unwrap();
        }
    }

    #[test]
    fn references_follow_paths_and_use_groups_but_not_tests_or_comments() {
        let dir = TestDir::new("modgraph-refs");
        write(
            &dir,
            &[
                (
                    "lib.rs",
                    "pub mod a; pub mod b; pub mod c; pub mod d; pub mod e;",
                ),
                (
                    "a.rs",
                    "use crate::{b::{X, Y}, c, self as me};\n\
                     // crate::d in a comment\n\
                     #[cfg(test)]\nmod tests {\n    use crate::d;\n}\n",
                ),
                ("b.rs", "fn f() { super::e::g(); }\n"),
                ("c/inner.rs", "fn f() -> crate::d::T { todo!() }\n"),
                ("c/tests.rs", "use crate::a;\n"),
                (
                    "d.rs",
                    "#[cfg(test)]\nuse crate::a;\nfn g() { mycrate::a(); }\n",
                ),
                ("e.rs", ""),
            ],
        );
        let g = graph(&dir).unwrap();
        let names = |m: &str| g[m].iter().cloned().collect::<Vec<_>>();
        assert_eq!(names("a"), ["b", "c"]);
        assert_eq!(names("b"), ["e"]);
        assert_eq!(names("c"), ["d"]);
        assert!(names("d").is_empty());
        assert!(cycles(&g).is_empty());
    }

    #[test]
    fn a_cycle_is_reported_as_a_path_back_to_its_start() {
        let dir = TestDir::new("modgraph-cycle");
        write(
            &dir,
            &[
                ("a.rs", "use crate::b;"),
                ("b.rs", "use crate::c::X;"),
                ("c.rs", "fn f() { crate::a::g() }"),
                ("d.rs", "use crate::a;"),
            ],
        );
        let g = graph(&dir).unwrap();
        assert_eq!(cycles(&g), [["a", "b", "c", "a"]]);
        let err = check(
            dir.parent().unwrap(),
            &[dir.file_name().unwrap().to_str().unwrap()],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains(": a -> b -> c -> a"), "{err}");
    }
}
