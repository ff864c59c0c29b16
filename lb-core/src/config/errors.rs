//! What `load` and `parse` report: one line per problem, with its position.

use super::*;

// ------------------------------------------------------------------------------------------
// Errors
// ------------------------------------------------------------------------------------------

/// One problem found in a configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Issue {
    /// 1-based position of the offending value (or of the table lacking a key); `None` when
    /// unknown (I/O errors, configurations not read from TOML text).
    pub line: Option<usize>,
    pub column: Option<usize>,
    /// Key path such as `vip[1].backend[0].weight`; empty for whole-file problems.
    pub key: String,
    /// The offending value, what is wrong with it and what is allowed.
    pub message: String,
}

impl Issue {
    /// The issue as one line: `ORIGIN[:LINE:COLUMN]: [KEY: ]MESSAGE`.
    pub fn render(&self, origin: &str) -> String {
        let mut s = origin.to_owned();
        if let (Some(l), Some(c)) = (self.line, self.column) {
            s += &format!(":{l}:{c}");
        }
        s += ": ";
        if !self.key.is_empty() {
            s += &self.key;
            s += ": ";
        }
        s += &self.message;
        s
    }
}

/// Everything wrong with a configuration; displays one issue per line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// File path (or the `origin` given to [`parse`]).
    pub origin: String,
    /// At least one.
    pub issues: Vec<Issue>,
}

impl ConfigError {
    /// The issues as rendered lines (what `Display` prints, split).
    pub fn messages(&self) -> Vec<String> {
        self.issues.iter().map(|i| i.render(&self.origin)).collect()
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.messages().join("\n"))
    }
}

impl std::error::Error for ConfigError {}
