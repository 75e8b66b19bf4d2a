//! `[log]`: the log's format and level (SGLang's level words accepted), the access log, and
//! the bounded buffer that keeps a slow stdout from blocking a request.

use serde::{Deserialize, Serialize};

use super::{invalid, ConfigError};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    pub format: LogFormat,
    /// A level (`trace`, `debug`, `info`, `warn`/`warning`, `error`/`critical`, `off`) or
    /// a `tracing` filter of `target=level` directives (`pdgate=debug,info`); anything else
    /// is refused at start. `RUST_LOG` wins when set.
    pub level: String,
    /// One JSON line per request on the `pdgate::access` target.
    pub access: bool,
    /// Log lines that may wait for a slow stdout; past it lines are dropped and counted
    /// (`pdgate_log_lines_dropped_total`) so that logging never blocks a request.
    pub buffer_lines: usize,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: LogFormat::Text,
            level: "info".to_string(),
            access: false,
            buffer_lines: 65_536,
        }
    }
}

/// The level words `log.level` takes, SGLang's spellings included.
const LOG_LEVELS: &[(&str, &str)] = &[
    ("trace", "trace"),
    ("debug", "debug"),
    ("info", "info"),
    ("warn", "warn"),
    ("warning", "warn"),
    ("error", "error"),
    ("critical", "error"),
    ("off", "off"),
];

impl LogConfig {
    /// `level` as a `tracing` filter: SGLang's `warning` and `critical` spelt as tracing's
    /// `warn` and `error`. Refused: a word that is not a level (tracing would read it as a
    /// target name, and silence every line), or a `target=` directive without a level.
    pub fn filter(&self) -> Result<String, ConfigError> {
        let level = |w: &str| {
            LOG_LEVELS
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(w.trim()))
                .map(|(_, v)| *v)
        };
        let mut out = Vec::new();
        for d in self
            .level
            .split(',')
            .map(str::trim)
            .filter(|d| !d.is_empty())
        {
            let fixed = match d.rsplit_once('=') {
                None => level(d).map(str::to_string),
                Some((target, lvl)) if !target.trim().is_empty() => {
                    level(lvl).map(|l| format!("{}={l}", target.trim()))
                }
                Some(_) => None,
            };
            out.push(fixed.ok_or_else(|| {
                invalid(format!(
                    "log.level {:?}: {d:?} is not a log level (trace, debug, info, warning, \
                     error, critical, off) nor a `target=level` directive",
                    self.level
                ))
            })?);
        }
        if out.is_empty() {
            return Err(invalid("log.level must not be empty".to_string()));
        }
        Ok(out.join(","))
    }
}
