//! Everything the CLI and its client print of what the daemon sent goes through here. The daemon refuses
//! control characters in what it stores, but a terminal must never take a byte of a listing
//! or an error for a command: an escape sequence that recolours or retitles root's terminal,
//! a newline that forges a table row, a bidi override that reorders one.

use std::borrow::Cow;

/// Characters a terminal may act on or that change how a line reads: C0 and C1 controls,
/// DEL, and the Unicode bidi embeddings, overrides and isolates.
fn unsafe_char(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `s` for a terminal: each unsafe character as Rust writes it escaped (`\n`, `\u{1b}`).
pub fn text(s: &str) -> Cow<'_, str> {
    if !s.chars().any(unsafe_char) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        if unsafe_char(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Serialized JSON for a terminal: serde_json escapes C0 controls inside strings (those
/// left are its own newlines and indentation) but writes DEL, C1 controls and bidi
/// characters raw; they can only occur inside strings, where `\uXXXX` is the same value.
pub fn json(s: &str) -> Cow<'_, str> {
    let escaped = |c: char| c >= '\u{7f}' && unsafe_char(c);
    if !s.chars().any(escaped) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        if escaped(c) {
            out += &format!("\\u{:04x}", c as u32);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_controls_are_escaped() {
        assert!(matches!(text("r1.a-2 since 3m ago"), Cow::Borrowed(_)));
        assert_eq!(
            text("x\x1b]0;pwned\x07y"),
            "x\\u{1b}]0;pwnedy".replace("pwnedy", "pwned\\u{7}y")
        );
        assert_eq!(text("a\nb\rc\td"), "a\\nb\\rc\\td");
        assert_eq!(text("\u{9b}31m\u{7f}"), "\\u{9b}31m\\u{7f}");
        assert_eq!(text("gpu\u{202e}0"), "gpu\\u{202e}0");
        assert_eq!(text("ünïcode ok"), "ünïcode ok");
    }

    #[test]
    fn json_keeps_its_meaning() {
        let v = serde_json::json!({ "label": "a\u{9b}b\u{202e}c\u{1b}d" });
        let raw = serde_json::to_string_pretty(&v).unwrap();
        let safe = json(&raw);
        assert!(!safe.chars().any(|c| c != '\n' && unsafe_char(c)), "{safe}");
        let back: serde_json::Value = serde_json::from_str(&safe).unwrap();
        assert_eq!(back, v);
    }
}
