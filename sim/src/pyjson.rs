//! Small helpers that reproduce Python semantics the real bootstrap server
//! (aiohttp + `json`) exposes on the wire.
//!
//! Why: the bootstrap server must answer byte-for-byte like SGLang 0.5.23
//! (`json.dumps` spacing, `int()` coercion of strings and floats, dict keys
//! where `1 == 1.0 == True` but `1 != "1"`).
//!
//! Invariants:
//! - [`dumps`] writes `json.dumps(obj)` defaults: `", "` / `": "` separators and
//!   `ensure_ascii=True`; objects keep the order they are given in.
//! - [`int_value`] / [`int_str`] return `None` exactly where Python's `int()`
//!   would raise (for the inputs JSON can carry).

use std::fmt::Write;

use serde_json::Value;

/// An ordered JSON object (Python dicts keep insertion order).
pub(crate) type PyObj = Vec<(String, Value)>;

/// `int(s)` for a Python `str`: surrounding whitespace, one sign, decimal digits
/// with single underscores between digits.
pub(crate) fn int_str(s: &str) -> Option<i64> {
    let t = s.trim();
    let (neg, digits) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    if digits.is_empty()
        || digits.starts_with('_')
        || digits.ends_with('_')
        || digits.contains("__")
    {
        return None;
    }
    let clean: String = digits.chars().filter(|c| *c != '_').collect();
    if !clean.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let v: i64 = clean.parse().ok()?;
    Some(if neg { -v } else { v })
}

/// `int(v)` for a JSON-decoded value (bool is an int, floats truncate).
pub(crate) fn int_value(v: &Value) -> Option<i64> {
    match v {
        Value::Bool(b) => Some(i64::from(*b)),
        Value::Number(n) => n.as_i64().or_else(|| {
            n.as_f64()
                .filter(|f| f.is_finite() && f.abs() < 9.2e18)
                .map(|f| f.trunc() as i64)
        }),
        Value::String(s) => int_str(s),
        _ => None,
    }
}

/// `str(v)` for a JSON-decoded value.
pub(crate) fn str_value(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "None".to_string(),
        Value::Bool(true) => "True".to_string(),
        Value::Bool(false) => "False".to_string(),
        other => dumps(other),
    }
}

/// Whether `v == 1` in Python.
pub(crate) fn eq_one(v: &Value) -> bool {
    match v {
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() == Some(1.0),
        _ => false,
    }
}

/// A hashable Python dict key built from a JSON value.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum PyKey {
    Int(i64),
    Float(u64),
    Str(String),
    None,
}

impl PyKey {
    /// `None` when the value is unhashable (list / dict): Python raises TypeError.
    pub(crate) fn from_value(v: &Value) -> Option<PyKey> {
        match v {
            Value::Bool(b) => Some(PyKey::Int(i64::from(*b))),
            Value::Number(n) => {
                if let Some(i) = n.as_i64() {
                    return Some(PyKey::Int(i));
                }
                let f = n.as_f64()?;
                if f.fract() == 0.0 && f.abs() < 9.2e18 {
                    Some(PyKey::Int(f as i64))
                } else {
                    Some(PyKey::Float(f.to_bits()))
                }
            }
            Value::String(s) => Some(PyKey::Str(s.clone())),
            Value::Null => Some(PyKey::None),
            Value::Array(_) | Value::Object(_) => None,
        }
    }
}

/// `json.dumps(v)` with Python's default separators and `ensure_ascii`.
pub(crate) fn dumps(v: &Value) -> String {
    let mut out = String::new();
    write_value(&mut out, v);
    out
}

/// `json.dumps` of an ordered object.
pub(crate) fn dumps_obj(obj: &PyObj) -> String {
    let mut out = String::from("{");
    for (i, (k, v)) in obj.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        write_str(&mut out, k);
        out.push_str(": ");
        write_value(&mut out, v);
    }
    out.push('}');
    out
}

fn write_value(out: &mut String, v: &Value) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            let _ = write!(out, "{n}");
        }
        Value::String(s) => write_str(out, s),
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_value(out, x);
            }
            out.push(']');
        }
        Value::Object(m) => {
            out.push('{');
            for (i, (k, x)) in m.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_str(out, k);
                out.push_str(": ");
                write_value(out, x);
            }
            out.push('}');
        }
    }
}

fn write_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn python_int() {
        assert_eq!(int_str(" 42 "), Some(42));
        assert_eq!(int_str("-1"), Some(-1));
        assert_eq!(int_str("1_0"), Some(10));
        assert_eq!(int_str("x"), None);
        assert_eq!(int_str(""), None);
        assert_eq!(int_str("1.0"), None);
        assert_eq!(int_value(&json!(2.7)), Some(2));
        assert_eq!(int_value(&json!(true)), Some(1));
        assert_eq!(int_value(&json!(null)), None);
    }

    #[test]
    fn python_dumps() {
        assert_eq!(dumps(&json!({"a": [1, "é"]})), "{\"a\": [1, \"\\u00e9\"]}");
        assert_eq!(
            dumps_obj(&vec![("z".into(), json!(1)), ("a".into(), json!(null))]),
            "{\"z\": 1, \"a\": null}"
        );
    }
}
