//! Positions of values in the file, and the key paths that name them.

use super::*;

// ------------------------------------------------------------------------------------------
// Positions and key paths
// ------------------------------------------------------------------------------------------

pub(super) struct Doc<'a> {
    pub(super) text: &'a str,
}

impl Doc<'_> {
    /// 1-based line and column (in characters) of byte `offset`.
    pub(super) fn position(&self, offset: usize) -> (usize, usize) {
        let mut offset = offset.min(self.text.len());
        while !self.text.is_char_boundary(offset) {
            offset -= 1;
        }
        let before = &self.text[..offset];
        let line = before.matches('\n').count() + 1;
        let start = before.rfind('\n').map_or(0, |i| i + 1);
        (line, before[start..].chars().count() + 1)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Seg {
    Key(String),
    Index(usize),
}

/// A key path such as `vip[1].backend[0].weight`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct KeyPath(pub(super) Vec<Seg>);

impl KeyPath {
    pub(super) fn key(&self, k: &str) -> KeyPath {
        let mut p = self.clone();
        p.0.push(Seg::Key(k.to_owned()));
        p
    }

    pub(super) fn idx(&self, i: usize) -> KeyPath {
        let mut p = self.clone();
        p.0.push(Seg::Index(i));
        p
    }
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, seg) in self.0.iter().enumerate() {
            match seg {
                Seg::Key(k) => {
                    if i > 0 {
                        f.write_str(".")?;
                    }
                    let bare = !k.is_empty()
                        && k.bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
                    if bare {
                        f.write_str(k)?;
                    } else {
                        write!(f, "{k:?}")?;
                    }
                }
                Seg::Index(n) => write!(f, "[{n}]")?,
            }
        }
        Ok(())
    }
}

/// Span of the value at `path`, or of its deepest ancestor present in the document.
pub(super) fn span_of(root: &Spanned<DeTable>, path: &KeyPath) -> Option<Range<usize>> {
    let mut span = None;
    let mut table = Some(root.get_ref());
    let mut value: Option<&DeValue> = None;
    for seg in &path.0 {
        let next = match (seg, table, value) {
            (Seg::Key(k), Some(t), _) => t.get(k.as_str()),
            (Seg::Key(k), None, Some(DeValue::Table(t))) => t.get(k.as_str()),
            (Seg::Index(i), None, Some(DeValue::Array(a))) => a.get(*i),
            _ => None,
        };
        let Some(next) = next else { break };
        span = Some(next.span());
        table = None;
        value = Some(next.get_ref());
    }
    span
}

/// The key path whose key or value has the smallest span containing `offset`.
pub(super) fn path_at(root: &Spanned<DeTable>, offset: usize) -> KeyPath {
    fn consider(span: Range<usize>, offset: usize, path: &[Seg], best: &mut (usize, Vec<Seg>)) {
        let inside = span.contains(&offset) || (span.is_empty() && span.start == offset);
        if inside && span.len() <= best.0 {
            *best = (span.len(), path.to_vec());
        }
    }
    fn walk(v: &DeValue, offset: usize, path: &mut Vec<Seg>, best: &mut (usize, Vec<Seg>)) {
        match v {
            DeValue::Table(t) => {
                for (k, val) in t.iter() {
                    path.push(Seg::Key(k.get_ref().to_string()));
                    consider(k.span(), offset, path, best);
                    consider(val.span(), offset, path, best);
                    walk(val.get_ref(), offset, path, best);
                    path.pop();
                }
            }
            DeValue::Array(a) => {
                for (i, val) in a.iter().enumerate() {
                    path.push(Seg::Index(i));
                    consider(val.span(), offset, path, best);
                    walk(val.get_ref(), offset, path, best);
                    path.pop();
                }
            }
            _ => {}
        }
    }
    let mut best = (usize::MAX, Vec::new());
    let mut path = Vec::new();
    for (k, val) in root.get_ref().iter() {
        path.push(Seg::Key(k.get_ref().to_string()));
        consider(k.span(), offset, &path, &mut best);
        consider(val.span(), offset, &path, &mut best);
        walk(val.get_ref(), offset, &mut path, &mut best);
        path.pop();
    }
    KeyPath(best.1)
}
