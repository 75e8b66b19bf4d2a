//! Kubernetes label selectors, parsed to refuse a malformed one at start (naming its flag)
//! rather than learn of it from the API server's 400 at the first LIST.
//!
//! The grammar is apimachinery's (`k8s.io/apimachinery/pkg/labels`): requirements joined by
//! `,`, each `key`, `!key`, `key=value`, `key==value`, `key!=value`, `key in (v1,v2)`,
//! `key notin (v1,v2)`, `key>N` or `key<N`; whitespace between tokens is ignored; keys are
//! qualified names (`prefix/name`), values are label values (possibly empty). The string
//! sent to the API server is the operator's own (the server is the judge of its meaning);
//! the parsed form is for validation, logs and [`LabelSelector::matches`].
//!
//! kube 5 has typed selectors (`kube::core::Selector`) and their matching, but no parser of
//! the string form, and no `>`/`<`; hence this small parser.

use std::collections::BTreeMap;
use std::fmt;

/// One requirement of a selector.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    DoesNotExist(String),
    GreaterThan(String, i64),
    LessThan(String, i64),
}

/// A parsed label selector: every requirement must hold. Empty selects every pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LabelSelector(pub Vec<Requirement>);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct SelectorError(pub String);

impl LabelSelector {
    /// Whether a pod with these labels is selected.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.0.iter().all(|r| match r {
            Requirement::Equals(k, v) => labels.get(k) == Some(v),
            Requirement::NotEquals(k, v) => labels.get(k) != Some(v),
            Requirement::In(k, vs) => labels.get(k).is_some_and(|v| vs.contains(v)),
            Requirement::NotIn(k, vs) => labels.get(k).is_none_or(|v| !vs.contains(v)),
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::DoesNotExist(k) => !labels.contains_key(k),
            Requirement::GreaterThan(k, n) => labels
                .get(k)
                .and_then(|v| v.parse::<i64>().ok())
                .is_some_and(|v| v > *n),
            Requirement::LessThan(k, n) => labels
                .get(k)
                .and_then(|v| v.parse::<i64>().ok())
                .is_some_and(|v| v < *n),
        })
    }

    pub fn selects_all(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Display for Requirement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Requirement::Equals(k, v) => write!(f, "{k}={v}"),
            Requirement::NotEquals(k, v) => write!(f, "{k}!={v}"),
            Requirement::In(k, vs) => write!(f, "{k} in ({})", vs.join(",")),
            Requirement::NotIn(k, vs) => write!(f, "{k} notin ({})", vs.join(",")),
            Requirement::Exists(k) => write!(f, "{k}"),
            Requirement::DoesNotExist(k) => write!(f, "!{k}"),
            Requirement::GreaterThan(k, n) => write!(f, "{k}>{n}"),
            Requirement::LessThan(k, n) => write!(f, "{k}<{n}"),
        }
    }
}

impl fmt::Display for LabelSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, r) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{r}")?;
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Tok {
    Ident(String),
    Not,
    Eq,
    DoubleEq,
    NotEq,
    Gt,
    Lt,
    Open,
    Close,
    Comma,
}

impl Tok {
    fn describe(&self) -> String {
        match self {
            Tok::Ident(s) => format!("'{s}'"),
            Tok::Not => "'!'".into(),
            Tok::Eq => "'='".into(),
            Tok::DoubleEq => "'=='".into(),
            Tok::NotEq => "'!='".into(),
            Tok::Gt => "'>'".into(),
            Tok::Lt => "'<'".into(),
            Tok::Open => "'('".into(),
            Tok::Close => "')'".into(),
            Tok::Comma => "','".into(),
        }
    }
}

fn special(c: char) -> bool {
    matches!(c, '!' | '=' | '(' | ')' | ',' | '<' | '>')
}

fn lex(s: &str) -> Vec<Tok> {
    let mut out = Vec::new();
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        let tok = match c {
            c if c.is_whitespace() => continue,
            '!' if it.peek() == Some(&'=') => {
                it.next();
                Tok::NotEq
            }
            '!' => Tok::Not,
            '=' if it.peek() == Some(&'=') => {
                it.next();
                Tok::DoubleEq
            }
            '=' => Tok::Eq,
            '(' => Tok::Open,
            ')' => Tok::Close,
            ',' => Tok::Comma,
            '>' => Tok::Gt,
            '<' => Tok::Lt,
            c => {
                let mut id = String::from(c);
                while let Some(&n) = it.peek() {
                    if n.is_whitespace() || special(n) {
                        break;
                    }
                    id.push(n);
                    it.next();
                }
                Tok::Ident(id)
            }
        };
        out.push(tok);
    }
    out
}

struct Parser {
    toks: Vec<Tok>,
    at: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.at)
    }
    fn next(&mut self) -> Option<Tok> {
        let t = self.toks.get(self.at).cloned();
        self.at += 1;
        t
    }
    fn found(t: Option<&Tok>) -> String {
        t.map_or_else(|| "the end".to_string(), Tok::describe)
    }

    fn key(&mut self) -> Result<String, SelectorError> {
        match self.next() {
            Some(Tok::Ident(k)) if k != "in" && k != "notin" => {
                check_key(&k)?;
                Ok(k)
            }
            t => Err(SelectorError(format!(
                "expected a label key, found {}",
                Self::found(t.as_ref())
            ))),
        }
    }

    /// The value after `=`, `==` or `!=`: may be empty (`key=`).
    fn value(&mut self) -> Result<String, SelectorError> {
        match self.peek() {
            None | Some(Tok::Comma) => Ok(String::new()),
            Some(Tok::Ident(_)) => match self.next() {
                Some(Tok::Ident(v)) => {
                    check_value(&v)?;
                    Ok(v)
                }
                _ => Ok(String::new()),
            },
            t => Err(SelectorError(format!(
                "expected a label value, found {}",
                Self::found(t)
            ))),
        }
    }

    /// `( v1, v2, ... )`; empty entries are empty values, as apimachinery reads them.
    fn values(&mut self) -> Result<Vec<String>, SelectorError> {
        match self.next() {
            Some(Tok::Open) => {}
            t => {
                return Err(SelectorError(format!(
                    "expected '(' after in/notin, found {}",
                    Self::found(t.as_ref())
                )))
            }
        }
        let mut out = Vec::new();
        let mut current: Option<String> = None;
        loop {
            match self.next() {
                Some(Tok::Ident(v)) if current.is_none() => {
                    check_value(&v)?;
                    current = Some(v);
                }
                Some(Tok::Comma) => out.push(current.take().unwrap_or_default()),
                Some(Tok::Close) => {
                    out.push(current.take().unwrap_or_default());
                    out.sort();
                    out.dedup();
                    return Ok(out);
                }
                t => {
                    return Err(SelectorError(format!(
                        "expected a value, ',' or ')' in a value list, found {}",
                        Self::found(t.as_ref())
                    )))
                }
            }
        }
    }

    fn number(&mut self) -> Result<i64, SelectorError> {
        match self.next() {
            Some(Tok::Ident(v)) => v
                .parse::<i64>()
                .map_err(|_| SelectorError(format!("'{v}' is not an integer (after '>' or '<')"))),
            t => Err(SelectorError(format!(
                "expected an integer after '>' or '<', found {}",
                Self::found(t.as_ref())
            ))),
        }
    }

    fn requirement(&mut self) -> Result<Requirement, SelectorError> {
        if self.peek() == Some(&Tok::Not) {
            self.next();
            return Ok(Requirement::DoesNotExist(self.key()?));
        }
        let key = self.key()?;
        Ok(match self.peek() {
            None | Some(Tok::Comma) => Requirement::Exists(key),
            Some(Tok::Eq) | Some(Tok::DoubleEq) => {
                self.next();
                Requirement::Equals(key, self.value()?)
            }
            Some(Tok::NotEq) => {
                self.next();
                Requirement::NotEquals(key, self.value()?)
            }
            Some(Tok::Gt) => {
                self.next();
                Requirement::GreaterThan(key, self.number()?)
            }
            Some(Tok::Lt) => {
                self.next();
                Requirement::LessThan(key, self.number()?)
            }
            Some(Tok::Ident(op)) if op == "in" => {
                self.next();
                Requirement::In(key, self.values()?)
            }
            Some(Tok::Ident(op)) if op == "notin" => {
                self.next();
                Requirement::NotIn(key, self.values()?)
            }
            t => {
                return Err(SelectorError(format!(
                    "expected an operator (=, ==, !=, in, notin, >, <) after '{key}', found {}",
                    Self::found(t)
                )))
            }
        })
    }
}

/// Parses a selector; the empty string (or only whitespace) selects everything.
pub fn parse(s: &str) -> Result<LabelSelector, SelectorError> {
    let mut p = Parser {
        toks: lex(s),
        at: 0,
    };
    let mut reqs = Vec::new();
    if p.peek().is_none() {
        return Ok(LabelSelector(reqs));
    }
    loop {
        reqs.push(p.requirement()?);
        match p.next() {
            None => return Ok(LabelSelector(reqs)),
            Some(Tok::Comma) if p.peek().is_some() => {}
            Some(Tok::Comma) => {
                return Err(SelectorError(
                    "a ',' must be followed by another requirement".into(),
                ))
            }
            Some(t) => {
                return Err(SelectorError(format!(
                    "expected ',' or the end after a requirement, found {}",
                    t.describe()
                )))
            }
        }
    }
}

fn name_part_ok(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

fn dns_subdomain_ok(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|l| {
            let b = l.as_bytes();
            !b.is_empty()
                && b.len() <= 63
                && b.iter()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
                && b[0] != b'-'
                && b[b.len() - 1] != b'-'
        })
}

/// A label key: `[prefix/]name`, the prefix a DNS subdomain, the name 1–63 characters.
fn check_key(k: &str) -> Result<(), SelectorError> {
    let (prefix, name) = match k.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, k),
    };
    if prefix.is_some_and(|p| !dns_subdomain_ok(p)) || !name_part_ok(name) {
        return Err(SelectorError(format!(
            "'{k}' is not a valid label key ([prefix/]name: name of 1-63 alphanumerics, '-', \
             '_' or '.', starting and ending alphanumeric; prefix a DNS subdomain)"
        )));
    }
    Ok(())
}

/// A label value: empty, or 1–63 characters as a key's name part.
fn check_value(v: &str) -> Result<(), SelectorError> {
    if v.is_empty() || name_part_ok(v) {
        Ok(())
    } else {
        Err(SelectorError(format!(
            "'{v}' is not a valid label value (at most 63 alphanumerics, '-', '_' or '.', \
             starting and ending alphanumeric)"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &str) -> String {
        v.to_string()
    }

    #[test]
    fn valid_selectors_parse_to_their_requirements() {
        use Requirement::*;
        let cases: &[(&str, Vec<Requirement>)] = &[
            ("", vec![]),
            ("   ", vec![]),
            ("app=sglang", vec![Equals(s("app"), s("sglang"))]),
            ("app==sglang", vec![Equals(s("app"), s("sglang"))]),
            ("app = sglang ", vec![Equals(s("app"), s("sglang"))]),
            ("tier!=cache", vec![NotEquals(s("tier"), s("cache"))]),
            ("app=", vec![Equals(s("app"), s(""))]),
            (
                "app=sglang,component in (prefill, warm)",
                vec![
                    Equals(s("app"), s("sglang")),
                    In(s("component"), vec![s("prefill"), s("warm")]),
                ],
            ),
            (
                "env notin (dev,test)",
                vec![NotIn(s("env"), vec![s("dev"), s("test")])],
            ),
            ("x in ()", vec![In(s("x"), vec![s("")])]),
            ("gpu", vec![Exists(s("gpu"))]),
            ("!canary", vec![DoesNotExist(s("canary"))]),
            (
                "sglang.ai/role=prefill,!canary",
                vec![
                    Equals(s("sglang.ai/role"), s("prefill")),
                    DoesNotExist(s("canary")),
                ],
            ),
            ("rank>3", vec![GreaterThan(s("rank"), 3)]),
            ("rank < -1", vec![LessThan(s("rank"), -1)]),
            ("a.b_c-d=E.f_G-h", vec![Equals(s("a.b_c-d"), s("E.f_G-h"))]),
        ];
        for (text, want) in cases {
            let got = parse(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert_eq!(&got.0, want, "{text:?}");
            // The canonical form reads back to the same requirements.
            assert_eq!(parse(&got.to_string()).expect("canonical"), got, "{text:?}");
        }
    }

    #[test]
    fn malformed_selectors_are_refused_with_what_is_wrong() {
        let cases: &[(&str, &str)] = &[
            ("app=sglang,", "must be followed"),
            (",app", "expected a label key"),
            ("app in prefill", "expected '('"),
            ("app in (a b)", "value list"),
            ("app in (a", "value list"),
            ("app notin", "expected '('"),
            ("app=(x)", "expected a label value"),
            ("app=a=b", "expected ',' or the end"),
            ("app sglang", "expected an operator"),
            ("-app=x", "not a valid label key"),
            ("app_=x", "not a valid label key"),
            ("Bad_Prefix/app=x", "not a valid label key"),
            ("/app=x", "not a valid label key"),
            ("app=-x", "not a valid label value"),
            (
                "k=aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
                "not a valid label value",
            ),
            ("rank>three", "not an integer"),
            ("rank<", "expected an integer"),
            ("!", "expected a label key"),
            ("!app=x", "expected ',' or the end"),
            ("in=x", "expected a label key"),
            ("app==", ""),
        ];
        for (text, want) in cases {
            match parse(text) {
                Ok(sel) if want.is_empty() => {
                    // `app==` is `app=""` (apimachinery reads it so too).
                    assert_eq!(sel.0, vec![Requirement::Equals(s("app"), s(""))]);
                }
                Ok(sel) => panic!("{text:?} parsed as {sel:?}"),
                Err(e) => assert!(e.0.contains(want), "{text:?}: {e}"),
            }
        }
    }

    #[test]
    fn matching_follows_the_kubernetes_semantics() {
        let labels: BTreeMap<String, String> = [("app", "sglang"), ("role", "prefill"), ("n", "5")]
            .into_iter()
            .map(|(k, v)| (s(k), s(v)))
            .collect();
        let cases: &[(&str, bool)] = &[
            ("", true),
            ("app=sglang", true),
            ("app=other", false),
            ("app!=other", true),
            ("missing!=x", true),
            ("role in (prefill,decode)", true),
            ("role in (decode)", false),
            ("role notin (decode)", true),
            ("missing notin (x)", true),
            ("missing in (x)", false),
            ("app", true),
            ("missing", false),
            ("!missing", true),
            ("!app", false),
            ("n>4", true),
            ("n<5", false),
            ("app>1", false),
            ("app=sglang,role=decode", false),
        ];
        for (text, want) in cases {
            let sel = parse(text).expect("parse");
            assert_eq!(sel.matches(&labels), *want, "{text:?}");
        }
    }
}
