//! Wire types of SGLang's prefill/decode (PD) disaggregation protocol that both sides of
//! pdgate's tests speak: the router (`pdgate`) and the engine simulator (`pdgate-sim`).
//!
//! Why a crate: the router and the simulator must agree on these names and values, but
//! neither may depend on the other (the router library holds no test doubles; the
//! simulator stands in for SGLang, not for pdgate). Putting them here keeps one definition
//! without coupling the two.
//!
//! Invariants:
//! - Only what SGLang itself defines goes here, spelled as SGLang spells it on the wire
//!   (`--disaggregation-mode prefill|decode`, the bootstrap port's default). Anything
//!   either side merely finds convenient stays in that side's crate.
//! - A leaf: no I/O, no async, one dependency (serde, for the lowercase role names).
//! - The interop tests against SGLang's real bootstrap server (`tests/interop_bootstrap.rs`
//!   in `pdgate`) remain the judge of the wire; this crate only names it.
#![forbid(unsafe_code)]

use std::fmt;

/// SGLang's default `--disaggregation-bootstrap-port`: where a prefill engine's bootstrap
/// server listens when the engine does not say otherwise.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// Which side of PD disaggregation a worker serves (SGLang's `--disaggregation-mode`), or
/// none: a `Regular` engine runs whole requests (SGLang's default mode, which its
/// `/server_info` reports as `disaggregation_mode` `null`; SGLang's router calls such a
/// worker `regular`). Serialised, parsed and displayed as `prefill` / `decode` / `regular`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
    Regular,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Regular => "regular",
        }
    }

    /// The `disaggregation_mode` an engine of this role reports in `/server_info`
    /// (`null` for a regular engine: SGLang's `--disaggregation-mode` default).
    pub fn disaggregation_mode(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Regular => "null",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            "regular" => Ok(Role::Regular),
            other => Err(format!(
                "unknown role {other:?} (expected prefill, decode or regular)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_names_round_trip() {
        for r in [Role::Prefill, Role::Decode, Role::Regular] {
            assert_eq!(r.as_str().parse::<Role>(), Ok(r));
            assert_eq!(r.to_string(), r.as_str());
        }
        assert!("router".parse::<Role>().is_err());
    }
}
