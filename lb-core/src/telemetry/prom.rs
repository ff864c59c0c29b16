//! A strict parser for the Prometheus text exposition format (0.0.4), accepting the
//! OpenMetrics additions that exporters emit (`# EOF`, exemplars, float timestamps).
//!
//! Strict means a malformed line fails the whole page with its line number: a page that is
//! half wrong cannot be trusted to be half right. `# HELP`, `# TYPE` and other comments are
//! checked for shape and dropped; timestamps and exemplars are checked and dropped (samples
//! are taken as of the scrape). Label values are unescaped (`\\`, `\"`, `\n`).
//!
//! Written here because the crates.io parsers tried fail on real exporter pages:
//! prometheus-parse 0.2 drops every series whose name has a `:` (all of vLLM's and SGLang's)
//! and skips malformed lines silently; prom_text_format_parser 0.1 rejects a page with a
//! `# TYPE` that has no samples yet (prometheus_client emits those) and knows no exemplars;
//! openmetrics-parser is LGPL-3.0.

use std::borrow::Cow;

/// Largest page accepted. dcgm-exporter with every field on 8 GPUs, or vLLM with all of
/// its histograms, stays well below 1 MiB.
pub const MAX_PAGE_BYTES: usize = 8 << 20;

/// One sample line.
#[derive(Clone, Debug, PartialEq)]
pub struct Series<'a> {
    pub name: &'a str,
    pub labels: Vec<(&'a str, Cow<'a, str>)>,
    pub value: f64,
}

impl Series<'_> {
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_ref())
    }
}

/// A parsed page, borrowing from its text.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Page<'a> {
    pub series: Vec<Series<'a>>,
}

impl<'a> Page<'a> {
    /// The series of one metric, in page order.
    pub fn get<'p>(&'p self, name: &'p str) -> impl Iterator<Item = &'p Series<'a>> + 'p {
        self.series.iter().filter(move |s| s.name == name)
    }

    pub fn has(&self, name: &str) -> bool {
        self.get(name).next().is_some()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {msg}")]
pub struct ParseError {
    /// 1-based; 0 for the page as a whole.
    pub line: usize,
    pub msg: String,
}

const TYPES: &[&str] = &[
    "counter",
    "gauge",
    "histogram",
    "summary",
    "untyped",
    // OpenMetrics
    "unknown",
    "info",
    "stateset",
    "gaugehistogram",
];

pub fn parse(text: &str) -> Result<Page<'_>, ParseError> {
    if text.len() > MAX_PAGE_BYTES {
        return Err(ParseError {
            line: 0,
            msg: format!(
                "page is {} bytes; the limit is {MAX_PAGE_BYTES}",
                text.len()
            ),
        });
    }
    let mut page = Page::default();
    let mut lines = text.split('\n').enumerate();
    for (i, raw) in lines.by_ref() {
        let err = |msg: String| ParseError { line: i + 1, msg };
        let mut c = Cursor::new(raw.strip_suffix('\r').unwrap_or(raw));
        c.blanks();
        match c.peek() {
            None => {}
            Some(b'#') => match comment(&mut c).map_err(err)? {
                Comment::Eof => break,
                Comment::Other => {}
            },
            Some(_) => page.series.push(sample(&mut c).map_err(err)?),
        }
    }
    if let Some((i, _)) = lines.find(|(_, l)| !l.trim().is_empty()) {
        return Err(ParseError {
            line: i + 1,
            msg: "content after `# EOF`".into(),
        });
    }
    Ok(page)
}

enum Comment {
    Eof,
    Other,
}

/// `# HELP name text`, `# TYPE name type`, `# EOF`, or any other comment.
fn comment(c: &mut Cursor<'_>) -> Result<Comment, String> {
    c.bump();
    c.blanks();
    let word = c.take_while(|b| !is_blank(b));
    match word {
        "HELP" | "TYPE" => {
            if !c.blanks() {
                return Err(format!("`# {word}` without a metric name"));
            }
            c.name(true)
                .ok_or_else(|| format!("`# {word}` is not followed by a metric name"))?;
            if word == "TYPE" {
                c.blanks();
                let kind = c.take_while(|b| !is_blank(b));
                if !TYPES.contains(&kind) {
                    return Err(format!(
                        "unknown metric type {:?}; allowed: {}",
                        clip(kind),
                        TYPES.join(", ")
                    ));
                }
                c.blanks();
                c.end()?;
            } else if !c.at_end() && !c.blanks() {
                return Err("`# HELP` metric name runs into its text".into());
            }
            Ok(Comment::Other)
        }
        "EOF" => {
            c.end()?;
            Ok(Comment::Eof)
        }
        _ => Ok(Comment::Other),
    }
}

/// `name[{labels}] value [timestamp] [# {labels} value [timestamp]]`
fn sample<'a>(c: &mut Cursor<'a>) -> Result<Series<'a>, String> {
    let name = c
        .name(true)
        .ok_or_else(|| format!("{:?} is not a metric name", clip(c.rest())))?;
    let gap = c.blanks();
    let labels = if c.peek() == Some(b'{') {
        let labels = labels(c)?;
        c.blanks();
        labels
    } else if gap || c.at_end() {
        Vec::new()
    } else {
        return Err(format!(
            "metric name {name:?} runs into {:?}",
            clip(c.rest())
        ));
    };
    let value = number(c.token()).map_err(|e| format!("value of {name}: {e}"))?;
    let had_blank = c.blanks();
    if had_blank && !matches!(c.peek(), None | Some(b'#')) {
        let ts = c.token();
        number(ts)
            .ok()
            .filter(|t| t.is_finite())
            .ok_or_else(|| format!("timestamp of {name}: {:?} is not a number", clip(ts)))?;
        c.blanks();
    }
    if c.peek() == Some(b'#') {
        exemplar(c).map_err(|e| format!("exemplar of {name}: {e}"))?;
    }
    c.end()?;
    Ok(Series {
        name,
        labels,
        value,
    })
}

/// OpenMetrics exemplar: `# {labels} value [timestamp]`; checked and dropped.
fn exemplar(c: &mut Cursor<'_>) -> Result<(), String> {
    c.bump();
    c.blanks();
    if c.peek() != Some(b'{') {
        return Err("expected `{` after `#`".into());
    }
    labels(c)?;
    c.blanks();
    number(c.token())?;
    if c.blanks() && !c.at_end() {
        number(c.token())?;
    }
    Ok(())
}

/// `{name="value", ...}` with an optional trailing comma; duplicate names are an error.
fn labels<'a>(c: &mut Cursor<'a>) -> Result<Vec<(&'a str, Cow<'a, str>)>, String> {
    c.bump();
    let mut out: Vec<(&'a str, Cow<'a, str>)> = Vec::new();
    loop {
        c.blanks();
        match c.peek() {
            Some(b'}') => {
                c.bump();
                return Ok(out);
            }
            None => return Err("unterminated label set".into()),
            Some(_) => {}
        }
        let key = c
            .name(false)
            .ok_or_else(|| format!("expected a label name at {:?}", clip(c.rest())))?;
        c.blanks();
        if c.peek() != Some(b'=') {
            return Err(format!("expected `=` after label {key:?}"));
        }
        c.bump();
        c.blanks();
        let value = c.quoted().map_err(|e| format!("label {key:?}: {e}"))?;
        if out.iter().any(|(k, _)| *k == key) {
            return Err(format!("label {key:?} appears twice"));
        }
        out.push((key, value));
        c.blanks();
        match c.peek() {
            Some(b',') => c.bump(),
            Some(b'}') => {}
            Some(_) => return Err(format!("expected `,` or `}}` at {:?}", clip(c.rest()))),
            None => return Err("unterminated label set".into()),
        }
    }
}

/// A Go `ParseFloat` number as Prometheus writes it: decimal or exponent form, `NaN`,
/// `+Inf`, `-Inf`.
fn number(s: &str) -> Result<f64, String> {
    let ok = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'+' | b'-'));
    ok.then(|| s.parse::<f64>().ok())
        .flatten()
        .ok_or_else(|| format!("{:?} is not a number", clip(s)))
}

fn is_blank(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

/// At most 40 characters of `s`, for error messages.
fn clip(s: &str) -> String {
    match s.char_indices().nth(40) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_owned(),
    }
}

struct Cursor<'a> {
    s: &'a str,
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(s: &'a str) -> Self {
        Cursor { s, pos: 0 }
    }

    fn peek(&self) -> Option<u8> {
        self.s.as_bytes().get(self.pos).copied()
    }

    /// Steps over one ASCII byte (callers have peeked it).
    fn bump(&mut self) {
        self.pos += 1;
    }

    fn rest(&self) -> &'a str {
        &self.s[self.pos..]
    }

    fn at_end(&self) -> bool {
        self.pos == self.s.len()
    }

    fn end(&self) -> Result<(), String> {
        if self.at_end() {
            Ok(())
        } else {
            Err(format!(
                "unexpected {:?} at the end of the line",
                clip(self.rest())
            ))
        }
    }

    /// Skips spaces and tabs; true if there were any.
    fn blanks(&mut self) -> bool {
        !self.take_while(is_blank).is_empty()
    }

    fn take_while(&mut self, f: impl Fn(u8) -> bool) -> &'a str {
        let start = self.pos;
        while self.peek().is_some_and(&f) {
            self.pos += 1;
        }
        &self.s[start..self.pos]
    }

    /// The text up to the next blank.
    fn token(&mut self) -> &'a str {
        self.take_while(|b| !is_blank(b))
    }

    /// `[a-zA-Z_:][a-zA-Z0-9_:]*` for metric names, without `:` for label names.
    fn name(&mut self, metric: bool) -> Option<&'a str> {
        let first = self.peek()?;
        if !(first.is_ascii_alphabetic() || first == b'_' || (metric && first == b':')) {
            return None;
        }
        Some(self.take_while(|b| b.is_ascii_alphanumeric() || b == b'_' || (metric && b == b':')))
    }

    /// A double-quoted label value, unescaped.
    fn quoted(&mut self) -> Result<Cow<'a, str>, String> {
        if self.peek() != Some(b'"') {
            return Err(format!("expected `\"` at {:?}", clip(self.rest())));
        }
        self.bump();
        let start = self.pos;
        let mut owned: Option<String> = None;
        let mut chunk = start;
        loop {
            match self.peek() {
                None => return Err("unterminated label value".into()),
                Some(b'"') => {
                    let tail = &self.s[chunk..self.pos];
                    self.bump();
                    return Ok(match owned {
                        None => Cow::Borrowed(tail),
                        Some(mut o) => {
                            o.push_str(tail);
                            Cow::Owned(o)
                        }
                    });
                }
                Some(b'\\') => {
                    let o = owned.get_or_insert_with(String::new);
                    o.push_str(&self.s[chunk..self.pos]);
                    self.bump();
                    match self.peek() {
                        Some(b'\\') => o.push('\\'),
                        Some(b'"') => o.push('"'),
                        Some(b'n') => o.push('\n'),
                        Some(_) => {
                            let esc = self.rest().chars().next().unwrap_or_default();
                            return Err(format!("invalid escape `\\{esc}`"));
                        }
                        None => return Err("unterminated label value".into()),
                    }
                    self.bump();
                    chunk = self.pos;
                }
                // Multi-byte UTF-8 sequences contain no ASCII bytes, so stepping bytewise
                // never stops inside one at `"` or `\`.
                Some(_) => self.bump(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(line: &str) -> Series<'_> {
        let mut page = parse(line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
        assert_eq!(page.series.len(), 1, "{line:?}");
        page.series.remove(0)
    }

    fn fails(text: &str) -> ParseError {
        parse(text).expect_err(text)
    }

    #[test]
    fn samples_labels_and_values() {
        let s = one(r#"vllm:num_requests_waiting{engine="0",model_name="m"} 3.0"#);
        assert_eq!(s.name, "vllm:num_requests_waiting");
        assert_eq!(s.label("engine"), Some("0"));
        assert_eq!(s.label("model_name"), Some("m"));
        assert_eq!(s.label("missing"), None);
        assert_eq!(s.value, 3.0);

        assert_eq!(one("up 1").labels, vec![]);
        assert_eq!(one("x{} 1").labels, vec![]);
        assert_eq!(one("x 8.969000").value, 8.969);
        assert_eq!(one("x -2.5e-3").value, -0.0025);
        assert_eq!(one("x 7.557572e+06").value, 7_557_572.0);
        assert_eq!(one("x +Inf").value, f64::INFINITY);
        assert_eq!(one("x -Inf").value, f64::NEG_INFINITY);
        assert!(one("x NaN").value.is_nan());
        assert_eq!(one("x 9223372036854775794").value, 2f64.powi(63));
        // Spaces inside the label set (dcgm-exporter's README shows them), a trailing comma,
        // tabs as separators, CRLF line ends.
        let s = one("DCGM_FI_DEV_SM_CLOCK{gpu=\"0\", UUID=\"GPU-6\" ,} \t139\r\n");
        assert_eq!(s.label("UUID"), Some("GPU-6"));
        assert_eq!(s.value, 139.0);
        assert_eq!(one("x{a=\"1\"}2").value, 2.0);
    }

    #[test]
    fn escaped_label_values() {
        let s = one(r#"m{a="say \"hi\"",b="back\\slash",c="two\nlines",d="{x=1,y=\"}\"}"} 1"#);
        assert_eq!(s.label("a"), Some(r#"say "hi""#));
        assert_eq!(s.label("b"), Some(r"back\slash"));
        assert_eq!(s.label("c"), Some("two\nlines"));
        assert_eq!(s.label("d"), Some(r#"{x=1,y="}"}"#));
        assert!(matches!(s.labels[0].1, Cow::Owned(_)));
        let s = one("m{model=\"Llama-3.1-8B-Instruct ünïcödé\"} 1");
        assert_eq!(s.label("model"), Some("Llama-3.1-8B-Instruct ünïcödé"));
        assert!(matches!(s.labels[0].1, Cow::Borrowed(_)));
    }

    #[test]
    fn timestamps_and_exemplars_are_checked_and_dropped() {
        assert_eq!(one("x 1 1712345678901").value, 1.0);
        assert_eq!(one("x 1 1712345678.901").value, 1.0);
        let s = one(r#"ttft_bucket{le="0.5"} 3 # {trace_id="abc"} 0.31 1712345678.9"#);
        assert_eq!((s.label("le"), s.value), (Some("0.5"), 3.0));
        assert_eq!(one(r#"c_total 5 1712345678 # {a="b"} 1"#).value, 5.0);
        assert!(fails(r#"x 1 # trace"#).msg.contains("exemplar of x"));
        assert!(fails(r#"x 1 # {a="b"} nope"#).msg.contains("exemplar of x"));
        assert!(fails("x 1 soon").msg.contains("timestamp of x"));
        assert!(fails("x 1 2 3").msg.contains("unexpected \"3\""));
    }

    #[test]
    fn comments_help_type_and_eof() {
        let page = parse(
            "# HELP a The a.\n# TYPE a gauge\na 1\n\n  # just a comment\n# HELP b\n\
             # TYPE vllm:x histogram\n#\n# EOF\n\n",
        )
        .unwrap();
        assert_eq!(page.series.len(), 1);
        assert!(page.has("a") && !page.has("b"));
        assert_eq!(parse("").unwrap(), Page::default());
        assert_eq!(fails("# TYPE a gauges").line, 1);
        assert!(fails("# TYPE a gauges")
            .msg
            .contains("unknown metric type \"gauges\""));
        assert!(fails("# TYPE a").msg.contains("unknown metric type \"\""));
        assert!(fails("# TYPE a gauge extra")
            .msg
            .contains("unexpected \"extra\""));
        assert!(fails("# HELP").msg.contains("without a metric name"));
        assert!(fails("# TYPE 9a gauge")
            .msg
            .contains("not followed by a metric name"));
        let e = fails("a 1\n# EOF\nb 2\n");
        assert_eq!((e.line, e.msg.as_str()), (3, "content after `# EOF`"));
    }

    #[test]
    fn malformed_lines_fail_with_their_line_number() {
        let cases: &[(&str, &str)] = &[
            ("x", "value of x: \"\" is not a number"),
            ("x ", "value of x: \"\" is not a number"),
            ("x abc", "value of x: \"abc\" is not a number"),
            ("x 1.2.3", "is not a number"),
            ("x 0x1F", "is not a number"),
            ("x 1_000", "is not a number"),
            ("9x 1", "\"9x 1\" is not a metric name"),
            ("{a=\"b\"} 1", "is not a metric name"),
            ("x{a=\"b} 1", "label \"a\": unterminated label value"),
            ("x{a=\"b\" 1", "expected `,` or `}`"),
            ("x{a=\"b\",", "unterminated label set"),
            ("x{a=\"b\"", "unterminated label set"),
            ("x{a=b} 1", "label \"a\": expected `\"`"),
            ("x{a} 1", "expected `=` after label \"a\""),
            ("x{=\"b\"} 1", "expected a label name"),
            ("x{a:b=\"c\"} 1", "expected `=` after label \"a\""),
            ("x{a=\"\\q\"} 1", "invalid escape `\\q`"),
            ("x{a=\"b\\", "unterminated label value"),
            ("x{a=\"1\",a=\"2\"} 1", "label \"a\" appears twice"),
            ("x-y 1", "metric name \"x\" runs into \"-y 1\""),
        ];
        for (text, want) in cases {
            let page = format!("# HELP x An x.\nok 1\n{text}\nok 2\n");
            let e = parse(&page).expect_err(text);
            assert_eq!(e.line, 3, "{text:?}: {e}");
            assert!(e.msg.contains(want), "{text:?}: got {e}, want {want:?}");
        }
    }

    #[test]
    fn every_truncation_of_a_line_parses_or_errors() {
        let line = r#"vllm:e2e_bucket{engine="0",le="+Inf",model_name="a \"b\""} 4.5e+01 1712 # {t="x"} 1 2"#;
        // A cut line either is an error on line 1 or parses into at most one series whose
        // name and value are what the text says: never a made-up sample.
        let check = |text: &str| match parse(text) {
            Err(e) => {
                assert_eq!(e.line, 1, "{text:?}: {e}");
                assert!(!e.msg.is_empty(), "{text:?}: an error without a message");
                false
            }
            Ok(page) => {
                assert!(page.series.len() <= 1, "{text:?}: {:?}", page.series.len());
                for s in &page.series {
                    assert!(
                        text.trim_start().starts_with(s.name),
                        "{text:?}: {}",
                        s.name
                    );
                    assert!(s.value.is_finite(), "{text:?}: value {}", s.value);
                }
                true
            }
        };
        let mut prefixes_ok = Vec::new();
        for end in (0..=line.len()).filter(|&i| line.is_char_boundary(i)) {
            if check(&line[..end]) {
                prefixes_ok.push(end);
            }
            check(&line[end..]);
        }
        // The empty prefix and the full line parse; a name cut before its value does not.
        assert!(prefixes_ok.contains(&0) && prefixes_ok.contains(&line.len()));
        assert!(!prefixes_ok.contains(&line.find('{').unwrap()));
        assert!(!prefixes_ok.contains(&(line.find('}').unwrap() + 1)));
        // Spot checks: the whole line and the line without its exemplar are valid.
        assert_eq!(one(line).value, 45.0);
        assert_eq!(one(&line[..line.find(" #").unwrap()]).value, 45.0);
    }

    #[test]
    fn garbage_never_panics() {
        // A deterministic byte soup over the characters that matter to the grammar.
        let alphabet = b"ab_:{}=\",\\ \t\n#01.+-eInfNa\xc3\xa9";
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        for _ in 0..2000 {
            let mut bytes = Vec::new();
            for _ in 0..(state % 64) {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                bytes.push(alphabet[(state % alphabet.len() as u64) as usize]);
            }
            let text = String::from_utf8_lossy(&bytes);
            // An error names a line of the text; a page's values are numbers from it.
            match parse(&text) {
                Err(e) => assert!(
                    e.line >= 1 && e.line <= text.split('\n').count(),
                    "{text:?}: error on line {}",
                    e.line
                ),
                Ok(page) => {
                    for s in &page.series {
                        assert!(text.contains(s.name), "{text:?}: series {}", s.name);
                    }
                }
            }
        }
    }

    #[test]
    fn huge_pages_are_refused_before_parsing() {
        let big = "x 1\n".repeat(MAX_PAGE_BYTES / 4 + 1);
        let e = parse(&big).unwrap_err();
        assert_eq!(e.line, 0);
        assert!(e.msg.contains("the limit is 8388608"), "{e}");
        // Right at the limit it parses.
        let fits = "x 1\n".repeat(MAX_PAGE_BYTES / 4);
        assert_eq!(parse(&fits).unwrap().series.len(), MAX_PAGE_BYTES / 4);
    }
}
